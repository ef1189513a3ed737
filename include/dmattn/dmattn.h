// dmattn: trainable dynamic-mask sparse attention.
//
// The public C++ API. Every entry point takes non-owning strided tensor views,
// validates all of its arguments in one place (src/validate.cpp) and then runs
// the backend of the tensors' device. The semantics are those of docs/spec.md:
//
//   s_ij = scale * <q_i, k_j>;  s_ij = softcap * tanh(s_ij / softcap) if softcap > 0
//   l_ij = s_ij + bias_ij;      a_ij = mask & causal & window & top-k selection
//   o_i  = sum_j softmax_j(l_ij over allowed j) v_j;  lse_i = log sum_j exp(l_ij)
//
// A row with no allowed key gives o_i = 0 and lse_i = -inf.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>

namespace dmattn {

enum class DType : std::uint8_t { kFloat16, kBFloat16, kFloat32, kFloat64, kBool, kInt32 };
enum class DeviceType : std::uint8_t { kCPU, kCUDA };

const char* dtype_name(DType dtype);
std::size_t dtype_size(DType dtype);

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;  // CUDA ordinal; 0 for the CPU
};

constexpr int kMaxRank = 4;

// A non-owning view of a strided tensor. Strides count elements (not bytes),
// are 64-bit and may be 0 (an expanded, broadcast view).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device{};
  int ndim = 0;
  std::array<std::int64_t, kMaxRank> shape{};
  std::array<std::int64_t, kMaxRank> stride{};

  // Row-major contiguous view of `shape`.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               Device device = {});
  // View with explicit strides (same length as shape).
  static TensorView strided(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                            std::initializer_list<std::int64_t> stride, Device device = {});
  std::int64_t numel() const;
};

// Every invalid call throws this before any backend runs; the caller's tensors
// are untouched. what() reads "dmattn: <argument>: expected <expected>, got <actual>".
class Error : public std::invalid_argument {
 public:
  enum class Kind : std::uint8_t {
    kValue,        // a shape, size, stride or option value is wrong
    kType,         // a dtype is wrong
    kUnsupported,  // valid input this build or device cannot run
  };
  Error(Kind kind, std::string argument, const std::string& expected, const std::string& actual);
  Kind kind() const { return kind_; }
  const std::string& argument() const { return argument_; }

 private:
  Kind kind_;
  std::string argument_;
};

struct SlidingWindow {
  std::int64_t left = -1;   // keys j >= i + (Sk - Sq) - left may be seen; -1 = unbounded
  std::int64_t right = -1;  // keys j <= i + (Sk - Sq) + right may be seen; -1 = unbounded
};

struct Options {
  std::optional<double> scale;                  // default 1 / sqrt(D)
  double softcap = 0.0;                         // 0 = off
  bool causal = false;                          // bottom-right aligned
  SlidingWindow sliding_window{};
  std::optional<std::int64_t> keep_window_size; // top-k over the bias per row (SPEC 3); needs a bias
  bool deterministic = false;                   // bitwise reproducible dq as well
  bool return_lse = true;                       // forward: lse must be given when true
  void* stream = nullptr;                       // cudaStream_t for CUDA tensors; unused on CPU
};

// Inputs shared by forward and backward.
//   batched: q (B, Sq, H, D), k and v (B, Sk, Hk, D), H % Hk == 0;
//            mask (bool) and bias (float) 4-D, broadcastable to (B, H, Sq, Sk):
//            batch {B, 1}, heads {H, Hk, 1}, queries {Sq, 1}, keys {Sk, 1}.
//   varlen:  q (total_q, H, D), k and v (total_k, Hk, D), bias (total_k, Hb) with
//            Hb in {H, Hk, 1} (a key-only bias), no mask.
//   topk_intervals: the call's top-k selection, given rather than selected (see
//            select_topk): only with keep_window_size, in a call whose selection
//            intervals express. The backends use it as it is, whatever
//            keep_window_size (even one of at least Sk), and never read or write
//            out of bounds whatever its values; values that are not the call's
//            selection give another (see select_topk).
struct Inputs {
  TensorView q, k, v;
  std::optional<TensorView> mask;
  std::optional<TensorView> bias;
  std::optional<TensorView> topk_intervals = std::nullopt;
};

// Sequence layout of the varlen entry points: cu_seqlens_* are int32 (B + 1,),
// non-decreasing, starting at 0 and ending at total_q / total_k.
struct VarlenLayout {
  TensorView cu_seqlens_q;
  TensorView cu_seqlens_k;
  std::int64_t max_seqlen_q = 0;
  std::int64_t max_seqlen_k = 0;
};

// Gradient outputs: dq, dk, dv shaped and typed like q, k, v; dbias (optional)
// shaped and typed like the bias, holding the sum of dl over every broadcast dim.
struct Gradients {
  TensorView dq, dk, dv;
  std::optional<TensorView> dbias;
};

// out: like q. lse: float32 (B, H, Sq) batched, (H, total_q) varlen; float64 is
// also accepted for float64 inputs so that the float64 backward stays exact.
void forward(const Inputs& in, const TensorView& out, const std::optional<TensorView>& lse,
             const Options& options);
void backward(const Inputs& in, const TensorView& out, const TensorView& dout, const TensorView& lse,
              const Gradients& grads, const Options& options);
void varlen_forward(const Inputs& in, const VarlenLayout& layout, const TensorView& out,
                    const std::optional<TensorView>& lse, const Options& options);
void varlen_backward(const Inputs& in, const VarlenLayout& layout, const TensorView& out,
                     const TensorView& dout, const TensorView& lse, const Gradients& grads,
                     const Options& options);

// The top-k selection of a call (spec §3) as per-key row intervals, written into
// `intervals`, so that it is selected once and given to several calls
// (Inputs::topk_intervals): the forward's selection kept for its backward, or the
// selection of a whole sequence cut into the blocks of sequence parallelism.
//
//   intervals: int32 (B, Hs, Sk, 2), contiguous (row-major), on q's device. Entry
//     (b, s, j) = {start, end}: the query rows [start, end) of batch entry b that
//     select key j under selection head s ({0, 0}: no row). Varlen: B sequences,
//     Sk = max_seqlen_k, rows and keys local to the sequence, keys past its length
//     {0, 0}. Hs = max(bias heads, mask heads), each H, Hk or 1 (1 without a
//     mask); query head h uses selection head h / (H / Hs).
//   The call must be one that intervals express: keep_window_size given, a bias
//     constant along queries (its Sq dimension 1), at most a key-only mask,
//     no left sliding window (causal and a right window are fine); any Sq and any
//     keep_window_size (one of at least Sk keeps every allowed key). Else Error
//     (kValue) naming `intervals` (`topk_intervals` in forward and backward).
//   q, k, v: only their shapes, dtypes and devices are read (data may be null).
//
// Given intervals are trusted: a backend clamps each to its sequence's rows and
// reads nothing else out of bounds, but intervals that are not the call's
// selection select other keys (the CPU still applies the mask, causal and the
// window; the CUDA kernels size their key lists and key groups for a selection of
// at most keep_window_size keys a row, and past that drop keys from the forward
// and may leave the gradients of some keys unwritten or not the call's; the
// calls still finish and stay within the tensors' bounds).
void select_topk(const Inputs& in, const Options& options, const TensorView& intervals);
void varlen_select_topk(const Inputs& in, const VarlenLayout& layout, const Options& options,
                        const TensorView& intervals);

// The validation of forward / backward / select_topk alone (of their varlen twins when
// a layout is given; nullptr: batched): throws the Error the call's validation would
// throw, and runs nothing. Only metadata is read (shapes, strides, dtypes, devices,
// options): data pointers may be null, and the cu_seqlens values, which the call
// reads, are not checked; nor are the refusals of a backend that lacks a kernel for
// valid input (the CUDA head dims it was not built for). For shape inference, e.g.
// fake tensors in torch.compile.
void check_forward(const Inputs& in, const VarlenLayout* layout, const TensorView& out,
                   const std::optional<TensorView>& lse, const Options& options);
void check_backward(const Inputs& in, const VarlenLayout* layout, const TensorView& out, const TensorView& dout,
                    const TensorView& lse, const Gradients& grads, const Options& options);
void check_select_topk(const Inputs& in, const VarlenLayout* layout, const Options& options,
                       const TensorView& intervals);

// Which backends and kernels this build holds.
struct BuildInfo {
  bool cuda = false;
  const char* version;
  const char* cuda_architectures;  // "" without CUDA
  const char* head_dims;           // CUDA head dims compiled, "" without CUDA
};
BuildInfo build_info();

}  // namespace dmattn
