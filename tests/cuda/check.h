// The CUDA check matrix (SPEC 5): the CUDA forward and backward against the
// library's own float64 CPU backend, case by case. Accuracy rule: max |gpu -
// ref| <= 2 * proxy + 1e-5 on out, where ref is the CPU backend in float64 and
// the proxy error the larger of two: lowp, the CPU backend run on the same
// fp16/bf16 tensors (float32 accumulation, one rounding of o), more accurate
// than a naive computation; and, where B*H*Sq*Sk is at most 2^27, the naive
// computations themselves (tests/reference.h: every intermediate rounded to the
// dtype, or only what is stored), SPEC 5's own rule, run only where an error
// exceeds the lowp bound (they are slow). lowp alone was stricter than SPEC 5:
// a forward whose row max lags (P up to 2^8, so the largest P of a row is not
// exactly 1) measured up to 2.3x lowp on rows of a few keys, below the naive
// computation's error on those shapes. lse (float32): |gpu - ref| <= 2 * |lowp
// - ref| + 1e-4, and -inf exactly where ref is -inf. Outputs are poisoned (NaN)
// before the call, and bytes of the output buffers outside the views must stay
// poisoned. The backward's rule: check_backward.cpp.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "device.h"
#include "reference.h"

namespace dmattn_gpu_test {

constexpr double kInf = std::numeric_limits<double>::infinity();

// One problem of the matrix. Mask and bias shapes are 4-D broadcast shapes
// (batched) or (total_k, Hb) (varlen bias); empty = absent.
struct Case {
  std::string name;
  DType dtype = DType::kBFloat16;
  std::int64_t B = 1, Sq = 1, Sk = 1, H = 4, Hk = 4, D = 128;
  std::vector<std::int64_t> seqlens_q, seqlens_k;  // varlen when not empty
  Shape mask_shape, bias_shape;
  Layout mask_layout, bias_layout, qkv_layout, out_layout;
  DType bias_dtype = DType::kBFloat16;
  double mask_density = 0.75;
  // Structured masks that leave whole tiles empty or full: kBands allows bands of
  // 160 rows x 96 keys (one in three), kKeyPadding a per-batch prefix of the keys.
  enum class MaskPattern { kRandom, kBands, kKeyPadding } mask_pattern = MaskPattern::kRandom;
  double bias_lo = -2.0, bias_hi = 2.0;
  double bias_quantum = 0.0;  // > 0: bias values rounded down to multiples of it (ties)
  // Not empty: each bias value is drawn from these (NaN: a draw as above). With
  // excluded_rows, every fourth row of the bias (along its keys) is -inf throughout.
  std::vector<double> bias_mix;
  bool excluded_rows = false;
  dmattn::Options options;
  bool with_lse = true;  // false: no lse tensor (options.return_lse = false)
  // The top-k selection given to the GPU calls (Inputs::topk_intervals): the CPU's
  // select_topk, which the GPU's select_topk must write byte for byte.
  bool given_intervals = false;
  // With given_intervals, the keep window they are selected with (0: the
  // call's): another one gives intervals that are no selection of the call,
  // which the CPU oracle is given too (batched cases).
  std::int64_t given_keep = 0;
  bool varlen() const { return !seqlens_q.empty(); }
};

struct Outcome {
  bool pass = true;
  std::string detail;
};

// Runs one case against the oracle (fresh random inputs from rng).
Outcome run_forward_case(const Case& c, Rng& rng);
Outcome run_backward_case(const Case& c, Rng& rng);
// The matrices (small: the few cases compute-sanitizer runs).
std::vector<Case> forward_matrix(bool small);
std::vector<Case> backward_matrix(bool small);
// The seed's failure case: 20 top-k forward + backward steps must stay finite.
Outcome topk_nan_sweep(Rng& rng);
extern const char* const kTopkNanSweepName;
// Wild given intervals: forward and backward finish and stay in bounds.
Outcome wild_intervals(Rng& rng);
extern const char* const kWildIntervalsName;
// Top-k at long rows, checked on the slices the oracle computes (check_long.cpp).
Outcome topk_long_rows(Rng& rng);
extern const char* const kTopkLongRowsName;

// ---- Shared by the forward and backward checks (check_forward.cpp).
HostTensor dense_copy(const HostTensor& t, DType dtype);
double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b);
// lse error where both are finite; a mismatch of -inf (or any NaN) is an infinite error.
double lse_error(const std::vector<double>& got, const std::vector<double>& ref);
std::vector<std::int32_t> cumulative(const std::vector<std::int64_t>& lengths);
// Shapes of q, k (and v) and lse: batched, or varlen (tokens of all sequences).
struct CaseShapes {
  Shape q, k, lse;
};
CaseShapes case_shapes(const Case& c);
// Fresh random q, k, v and the case's mask and bias.
struct CaseInputs {
  HostTensor q, k, v;
  std::optional<HostTensor> mask, bias;
};
CaseInputs make_inputs(const Case& c, const Shape& q_shape, const Shape& k_shape, Rng& rng);
std::vector<dmattn_test::RefResult> naive_runs(const Case& c, const CaseInputs& inputs,
                                               const std::optional<std::vector<double>>& dout);
std::string bounds_text(double lowp, const std::optional<double>& naive);
// What the dispatch plans for a GPU call, in words (src/cuda/dispatch.h describe): each
// case's line says which kernel and walk every step took.
std::string forward_plan(const dmattn::Inputs& in, const dmattn::VarlenLayout* layout, const dmattn::TensorView& out,
                         const std::optional<dmattn::TensorView>& lse, const dmattn::Options& options);
std::string backward_plan(const dmattn::Inputs& in, const dmattn::VarlenLayout* layout, const dmattn::TensorView& out,
                          const dmattn::TensorView& dout, const dmattn::TensorView& lse, const dmattn::Gradients& grads,
                          const dmattn::Options& options);
// The varlen layout of a case, its cu_seqlens in `storage` (host) or copied to
// `device_storage` (2 (B + 1) int32) where that is given.
dmattn::VarlenLayout varlen_layout(const Case& c, std::vector<std::int32_t>& storage, void* device_storage);
// A case's varlen layout with its cu_seqlens on the device, owning that
// memory; layout() is nullptr for a batched case.
class DeviceVarlen {
 public:
  explicit DeviceVarlen(const Case& c);
  const dmattn::VarlenLayout* layout() const { return layout_ ? &*layout_ : nullptr; }

 private:
  std::unique_ptr<void, decltype(&cudaFree)> memory_{nullptr, cudaFree};
  std::vector<std::int32_t> host_;
  std::optional<dmattn::VarlenLayout> layout_;
};
// Case::given_intervals: the CPU's select_topk of the case's inputs on the
// device, and whether the GPU's select_topk (of gpu_in and gpu_layout, the GPU
// calls' own; nullptr: batched) wrote the same. Without given_intervals: none.
struct GivenIntervals {
  std::optional<DeviceTensor> device;
  bool gpu_equal = true;
};
GivenIntervals given_intervals(const Case& c, const CaseInputs& inputs, const dmattn::Inputs& gpu_in,
                               const dmattn::VarlenLayout* gpu_layout);
// The selection heads of a case's intervals (Hs: max(bias heads, mask heads)),
// and the options of the selection given to its calls (Case::given_keep).
std::int64_t selection_heads(const Case& c);
dmattn::Options given_options(const Case& c);

// ---- Shared by the two matrices (matrix_forward.cpp).
std::string dtype_tag(DType d);
std::vector<Shape> broadcast_shapes(std::int64_t B, std::int64_t H, std::int64_t Hk, std::int64_t Sq, std::int64_t Sk);
void topk_per_row(Case& c, int i);
void topk_padding(Case& c, int i);
void topk_varlen(Case& c, int i);
void hopper_varlen(Case& c, int i);
std::vector<Case> given_interval_cases();
std::vector<Case> bias_magnitude_sweep(const std::string& prefix);
void add_head_dim_64(std::vector<Case>& cases);
// The mask cases of the Hopper kernels (D = 64 or 128 exactly): c with the
// sizes, heads, mask, key-only bias and options of variant 0 .. 7 (their kinds
// in matrix_shared.cpp) and "Hopper mask <variant> <mask shape>" as its
// name's stem.
constexpr int kHopperMaskVariants = 8;
Case hopper_mask_case(Case c, std::int64_t d, int variant);

}  // namespace dmattn_gpu_test
