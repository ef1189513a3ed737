// The dispatch table (src/cuda/dispatch.cu plan_forward, plan_backward) on
// emulated devices, without a GPU: for the calls each fast path is built for,
// the kernel and walk of every step, and the refusals. A change that sends such
// a call to a slower kernel (a condition that silently stops holding, as when
// dbias's broadcast strides kept B = 1 off the Hopper bias tiles) fails here,
// where the GPU checks, which compare values only, would still pass.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <utility>

#include "cuda/dispatch.h"
#include "cuda/heuristics.h"
#include "harness.h"
#include "validate.h"

namespace {

using namespace dmattn;
using cuda::BackwardPlan;
using cuda::DeviceInfo;
using cuda::DkvKernel;
using cuda::ForwardKernel;
using cuda::ForwardPlan;

// The devices of the table: attributes as the CUDA runtime reports them.
constexpr DeviceInfo kH100{90, 132, 227 * 1024, false, true};
constexpr DeviceInfo kH100Portable{90, 132, 227 * 1024, false, false};  // DMATTN_PORTABLE=1
constexpr DeviceInfo kA100{80, 108, 163 * 1024, false, false};
constexpr DeviceInfo kRtx4090{89, 128, 99 * 1024, false, false};

using Shape = std::array<std::int64_t, 4>;

// One call, by default the benchmarks' training shape: (1, 8192, 32 / 8 heads,
// 128) bf16, causal. Tensors are contiguous at distinct, 16-byte aligned
// addresses that nothing reads (the plan reads metadata only).
struct Call {
  std::int64_t batch = 1, heads = 32, kv_heads = 8, seqlen_q = 8192, seqlen_k = 8192, head_dim = 128;
  DType dtype = DType::kBFloat16;
  bool causal = true;
  std::optional<Shape> mask;
  std::optional<Shape> bias;        // varlen: {0, Hb, 0, 0}, a (total_k, Hb) key-only bias
  std::optional<DType> bias_dtype;  // q's unless set
  bool dbias = false;
  std::optional<std::int64_t> keep;
  bool deterministic = false;
  double softcap = 0.0;
  bool varlen = false;  // the batch packed: cu_seqlens of batch + 1 entries, max lengths seqlen_q / seqlen_k

  Inputs inputs() const {
    Inputs in;
    in.q = token(1, seqlen_q, heads), in.k = token(2, seqlen_k, kv_heads), in.v = token(3, seqlen_k, kv_heads);
    if (mask) in.mask = view(4, DType::kBool, *mask);
    if (bias) in.bias = bias_view(5);
    return in;
  }
  Options options() const {
    Options o;
    o.causal = causal, o.keep_window_size = keep, o.deterministic = deterministic, o.softcap = softcap;
    return o;
  }
  std::optional<VarlenLayout> layout() const {
    if (!varlen) return std::nullopt;
    return VarlenLayout{TensorView::contiguous(address(6), DType::kInt32, {batch + 1}, kCuda),
                        TensorView::contiguous(address(7), DType::kInt32, {batch + 1}, kCuda), seqlen_q, seqlen_k};
  }
  TensorView out() const { return token(8, seqlen_q, heads); }
  TensorView lse() const {
    return varlen ? TensorView::contiguous(address(9), DType::kFloat32, {heads, batch * seqlen_q}, kCuda)
                  : TensorView::contiguous(address(9), DType::kFloat32, {batch, heads, seqlen_q}, kCuda);
  }

  ForwardPlan forward(const DeviceInfo& device) const {
    const std::optional<VarlenLayout> l = layout();
    const Problem p = make_forward_problem(inputs(), l ? &*l : nullptr, out(), lse(), options(), Reads::kMetadata);
    return cuda::plan_forward(p, device);
  }
  BackwardPlan backward(const DeviceInfo& device) const {
    const std::optional<VarlenLayout> l = layout();
    Gradients grads{token(10, seqlen_q, heads), token(11, seqlen_k, kv_heads), token(12, seqlen_k, kv_heads),
                    std::nullopt};
    if (dbias) grads.dbias = bias_view(13);
    const Problem p = make_backward_problem(inputs(), l ? &*l : nullptr, out(), token(14, seqlen_q, heads), lse(),
                                            grads, options(), Reads::kMetadata);
    return cuda::plan_backward(p, device);
  }

 private:
  static constexpr Device kCuda{DeviceType::kCUDA, 0};
  // Tensor i's address: 2^36 bytes apart, so that none overlaps another.
  static void* address(int i) { return reinterpret_cast<void*>(std::uintptr_t(i) << 36); }
  TensorView token(int i, std::int64_t seqlen, std::int64_t h) const {
    return varlen ? TensorView::contiguous(address(i), dtype, {batch * seqlen, h, head_dim}, kCuda)
                  : TensorView::contiguous(address(i), dtype, {batch, seqlen, h, head_dim}, kCuda);
  }
  static TensorView view(int i, DType dtype, const Shape& s) {
    return TensorView::contiguous(address(i), dtype, {s[0], s[1], s[2], s[3]}, kCuda);
  }
  TensorView bias_view(int i) const {
    const DType t = bias_dtype.value_or(dtype);
    return varlen ? TensorView::contiguous(address(i), t, {batch * seqlen_k, (*bias)[1]}, kCuda) : view(i, t, *bias);
  }
};

// The head dims this build compiles (DMATTN_HEAD_DIMS, ascending).
constexpr int kHeadDims[] = {
#define DMATTN_CUDA_HEAD_DIM(D) D,
#include "head_dims.inc"
#undef DMATTN_CUDA_HEAD_DIM
};
bool compiled(int d) {
  for (int h : kHeadDims)
    if (h == d) return true;
  return false;
}

bool has(const std::string& text, const char* words) { return text.find(words) != std::string::npos; }

// The cases below are written for the default head dims, 64 and 128.
class Dispatch : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!compiled(64) || !compiled(128)) GTEST_SKIP() << "head dims 64 and 128 not both compiled";
  }
};

// call() throws Error of `kind` naming `argument`.
template <class F>
void expect_refused(const F& call, Error::Kind kind, const char* argument) {
  try {
    call();
    ADD_FAILURE() << "no error, expected one naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_EQ(e.argument(), argument) << e.what();
  }
}

// The Hopper forward on an H100, as `plan` names it: persistent (a CTA an SM)
// where a producer warpgroup loads (D' >= 128) key lists, or rows of at most
// 4096 keys.
void expect_sm90_forward(const ForwardPlan& plan, bool key_lists, bool mask_tiles, bool bias_tiles) {
  EXPECT_EQ(plan.kernel, ForwardKernel::kSm90);
  EXPECT_EQ(plan.key_lists, key_lists);
  EXPECT_EQ(plan.mask_tiles, mask_tiles);
  EXPECT_EQ(plan.bias_tiles, bias_tiles);
  EXPECT_EQ(plan.params.num_splits, 1);
  const bool persistent = plan.head_dim >= 128 && (key_lists || plan.params.seqlen_k <= 4096);
  EXPECT_EQ(plan.persistent_ctas, persistent ? kH100.sms : 0) << "D' " << plan.head_dim;
}

// ---- Hopper (H100): the fast paths ----

TEST_F(Dispatch, H100DenseRunsHopperBothWaysAtEachHeadDim) {
  for (std::int64_t d : {128, 64, 96, 40}) {
    Call c;
    c.head_dim = d;
    const ForwardPlan f = c.forward(kH100);
    expect_sm90_forward(f, false, false, false);
    EXPECT_EQ(f.head_dim, d <= 64 ? 64 : 128) << "D " << d;
    const BackwardPlan b = c.backward(kH100);
    EXPECT_EQ(b.dkv, DkvKernel::kSm90) << "D " << d;
    EXPECT_TRUE(b.params.atomic_dq && b.params.dq_blocks && !b.ordered_dq) << "D " << d;
  }
}

// Above D = 128 the forward runs the Hopper kernel (128-row blocks where the
// sm80 kernel's are 64), a key-only bias, top-k or a mask included; the
// Hopper dk/dv kernel at D' = 256 its dense walk (a key-only bias with dbias,
// varlen; D = 192 and 160 padded to 256, where the instantiation of 192 has
// no Hopper dk/dv kernel), the sm80-class kernels the others.
TEST_F(Dispatch, H100WideHeadsRunTheHopperForward) {
  if (!compiled(192) || !compiled(256)) GTEST_SKIP() << "head dims 192 and 256 not both compiled";
  for (std::int64_t d : {192, 256, 160}) {
    Call c;
    c.head_dim = d;
    const ForwardPlan f = c.forward(kH100);
    expect_sm90_forward(f, false, false, false);
    EXPECT_EQ(f.block_m, 128) << "D " << d;
    EXPECT_EQ(f.head_dim, d <= 192 ? 192 : 256) << "D " << d;
    Call biased = c;
    biased.bias = Shape{1, 8, 1, 8192}, biased.keep = 1024;
    expect_sm90_forward(biased.forward(kH100), true, false, false);
    Call masked = c;
    masked.mask = Shape{1, 1, 8192, 8192};
    expect_sm90_forward(masked.forward(kH100), false, true, false);
    Call key_bias = c;
    key_bias.bias = Shape{1, 8, 1, 8192}, key_bias.dbias = true;
    for (const Call& dense : {c, key_bias}) {
      const BackwardPlan b = dense.backward(kH100);
      EXPECT_EQ(b.dkv, DkvKernel::kSm90) << "D " << d;
      EXPECT_EQ(b.head_dim, 256) << "D " << d;
      EXPECT_TRUE(b.params.atomic_dq && b.params.dq_blocks) << "D " << d;
    }
    Call deterministic = c, softcap = c;
    deterministic.deterministic = true, softcap.softcap = 30.0;
    for (const Call& other : {biased, masked, deterministic, softcap}) {
      const BackwardPlan b = other.backward(kH100);
      EXPECT_EQ(b.dkv, DkvKernel::kSm80) << "D " << d;
      EXPECT_EQ(b.head_dim, d <= 192 ? 192 : 256) << "D " << d;
      EXPECT_TRUE(has(b.why_not_sm90, d <= 192 ? "no Hopper kernel at this head dim" : "above D' = 128 its dense walk only"))
          << "D " << d;
    }
  }
}

TEST_F(Dispatch, H100ShortSequencesInLargeBatchesAndFp16) {
  Call c;
  c.batch = 16, c.heads = 16, c.kv_heads = 4, c.seqlen_q = c.seqlen_k = 2048, c.dtype = DType::kFloat16;
  expect_sm90_forward(c.forward(kH100), false, false, false);
  EXPECT_EQ(c.backward(kH100).dkv, DkvKernel::kSm90);
}

TEST_F(Dispatch, H100VarlenRunsHopper) {
  Call c;
  c.varlen = true, c.batch = 4, c.seqlen_q = c.seqlen_k = 4096;
  expect_sm90_forward(c.forward(kH100), false, false, false);
  EXPECT_EQ(c.backward(kH100).dkv, DkvKernel::kSm90);
  c.bias = Shape{0, 8, 0, 0}, c.dbias = true;  // a key-only varlen bias (total_k, Hk)
  expect_sm90_forward(c.forward(kH100), false, false, false);
  EXPECT_EQ(c.backward(kH100).dkv, DkvKernel::kSm90);
}

TEST_F(Dispatch, H100SoftcapRunsHopper) {
  Call c;
  c.softcap = 30.0;
  expect_sm90_forward(c.forward(kH100), false, false, false);
  EXPECT_EQ(c.backward(kH100).dkv, DkvKernel::kSm90);
}

TEST_F(Dispatch, H100KeyBiasWithItsGradientRunsHopper) {
  for (const Shape& s : {Shape{1, 8, 1, 8192}, Shape{1, 1, 1, 8192}, Shape{1, 32, 1, 8192}}) {
    Call c;
    c.bias = s, c.dbias = true;
    expect_sm90_forward(c.forward(kH100), false, false, false);
    const BackwardPlan b = c.backward(kH100);
    EXPECT_EQ(b.dkv, DkvKernel::kSm90) << "bias heads " << s[1];
    EXPECT_EQ(b.params.bias_grad, cuda::BiasGrad::kPerKey);
  }
}

// A full bias of q's dtype goes by TMA tiles both ways, dbias stored by tiles
// too: at B = 1 (dbias's batch stride 0) and B = 2, bias heads Hk or H.
TEST_F(Dispatch, H100FullBiasByTilesWithDbias) {
  for (std::int64_t batch : {1, 2})
    for (std::int64_t bias_heads : {8, 32}) {
      Call c;
      c.batch = batch, c.seqlen_q = c.seqlen_k = 4096, c.bias = Shape{batch, bias_heads, 4096, 4096}, c.dbias = true;
      expect_sm90_forward(c.forward(kH100), false, false, true);
      const BackwardPlan b = c.backward(kH100);
      EXPECT_EQ(b.dkv, DkvKernel::kSm90RowBias) << "B " << batch << ", bias heads " << bias_heads;
      EXPECT_TRUE(b.bias_tiles) << "B " << batch << ", bias heads " << bias_heads;
      EXPECT_EQ(b.dbias_slices, 0) << "B " << batch << ", bias heads " << bias_heads;
    }
  Call c;  // no dbias: one bias head too
  for (std::int64_t bias_heads : {8, 1}) {
    c.bias = Shape{1, bias_heads, 8192, 8192};
    expect_sm90_forward(c.forward(kH100), false, false, true);
    EXPECT_TRUE(c.backward(kH100).bias_tiles) << "bias heads " << bias_heads;
  }
}

// A bias the tiles cannot take: the sm80 forward and the Hopper row-bias walk
// reading it element by element (a full float32 one; keys not a multiple of 8;
// a per-row bias; a full bias shared across batch entries or kv heads, whose
// dbias sums float32 slices).
TEST_F(Dispatch, H100BiasOffTheTiles) {
  Call f32;
  f32.bias = Shape{1, 8, 8192, 8192}, f32.bias_dtype = DType::kFloat32, f32.dbias = true;
  Call odd;
  odd.seqlen_q = odd.seqlen_k = 4100, odd.bias = Shape{1, 8, 4100, 4100}, odd.dbias = true;
  Call per_row;
  per_row.bias = Shape{1, 8, 8192, 1}, per_row.dbias = true;
  for (const Call& c : {f32, odd, per_row}) {
    EXPECT_EQ(c.forward(kH100).kernel, ForwardKernel::kSm80);
    const BackwardPlan b = c.backward(kH100);
    EXPECT_EQ(b.dkv, DkvKernel::kSm90RowBias);
    EXPECT_FALSE(b.bias_tiles);
  }
  for (const Shape& s : {Shape{1, 8, 4096, 4096}, Shape{2, 1, 4096, 4096}}) {
    Call shared;
    shared.batch = 2, shared.seqlen_q = shared.seqlen_k = 4096, shared.bias = s, shared.dbias = true;
    expect_sm90_forward(shared.forward(kH100), false, false, true);
    const BackwardPlan b = shared.backward(kH100);
    EXPECT_EQ(b.dkv, DkvKernel::kSm90RowBias);
    EXPECT_EQ(b.dbias_slices, s[0] == 1 ? 2 : 8) << "bias batch " << s[0];
    EXPECT_FALSE(b.bias_tiles);
  }
}

// A mask alone: the forward by its tile classes and bits (no key lists), the
// dk/dv walk skipping its empty tiles, dq over key lists.
TEST_F(Dispatch, H100MaskByTileClasses) {
  for (const Shape& s : {Shape{1, 1, 8192, 8192}, Shape{1, 8, 8192, 8192}}) {
    Call c;
    c.mask = s;
    expect_sm90_forward(c.forward(kH100), false, true, false);
    const BackwardPlan b = c.backward(kH100);
    EXPECT_EQ(b.dkv, DkvKernel::kSm90);
    EXPECT_TRUE(b.mask_tiles && b.key_lists);
  }
}

// Top-k over a key bias: intervals selected, the Hopper forward over key lists
// at every length, dk/dv over key groups.
TEST_F(Dispatch, H100TopkOverIntervals) {
  for (std::int64_t d : {128, 64})
    for (std::int64_t s : {4096, 8192, 16384, 131072}) {
      Call c;
      c.head_dim = d, c.seqlen_q = c.seqlen_k = s, c.bias = Shape{1, 8, 1, s}, c.dbias = true, c.keep = 1024;
      const ForwardPlan f = c.forward(kH100);
      EXPECT_EQ(f.selection, cuda::DeviceSelection::kIntervals);
      EXPECT_TRUE(f.key_lists);
      EXPECT_EQ(f.kernel, ForwardKernel::kSm90) << "D " << d << ", S " << s;
      EXPECT_EQ(f.persistent_ctas, d == 128 ? kH100.sms : 0) << "D " << d << ", S " << s;
      const BackwardPlan b = c.backward(kH100);
      EXPECT_EQ(b.selection, cuda::DeviceSelection::kIntervals);
      EXPECT_EQ(b.dkv, DkvKernel::kSm90Groups) << "D " << d << ", S " << s;
    }
}

// Top-k that intervals cannot express (a full bias: per-row thresholds).
TEST_F(Dispatch, H100TopkByThresholds) {
  Call c;
  c.seqlen_q = c.seqlen_k = 2048, c.bias = Shape{1, 8, 2048, 2048}, c.keep = 256;
  const ForwardPlan f = c.forward(kH100);
  EXPECT_EQ(f.selection, cuda::DeviceSelection::kThresholds);
  EXPECT_EQ(f.kernel, ForwardKernel::kSm80);
  EXPECT_TRUE(f.key_lists);
  EXPECT_FALSE(f.bias_tiles);
  EXPECT_EQ(c.backward(kH100).dkv, DkvKernel::kSm80);
}

// deterministic: dq summed in order by the Hopper dense walk; with a mask the
// sm80 dk/dv kernel and dq by the dq kernel, no atomics.
TEST_F(Dispatch, H100Deterministic) {
  for (std::int64_t d : {128, 64}) {
    Call c;
    c.head_dim = d, c.deterministic = true;
    const BackwardPlan b = c.backward(kH100);
    EXPECT_EQ(b.dkv, DkvKernel::kSm90) << "D " << d;
    EXPECT_TRUE(b.ordered_dq) << "D " << d;
  }
  Call masked;
  masked.deterministic = true, masked.mask = Shape{1, 1, 8192, 8192};
  const BackwardPlan b = masked.backward(kH100);
  EXPECT_EQ(b.dkv, DkvKernel::kSm80);
  EXPECT_FALSE(b.ordered_dq || b.params.atomic_dq || b.params.dq_blocks);
}

// Key splits: a grid that leaves SMs idle fills one wave; a decode grid of
// more than one wave whose last wave is at most half full takes the splits (at
// most 4, each at least 4 key blocks) of the fewest waves per unit of work;
// other grids none.
TEST(ChooseSplits, WavesOfTheDecodeTiles) {
  const auto slots = [] { return std::int64_t{396}; };  // 132 SMs x 3 CTAs
  EXPECT_EQ(cuda::choose_splits(32, 2048, 132, true, slots), 12);
  EXPECT_EQ(cuda::choose_splits(32, 2048, 132, false, slots), 12);
  EXPECT_EQ(cuda::choose_splits(256, 128, 132, true, slots), 1);   // one wave
  EXPECT_EQ(cuda::choose_splits(512, 64, 132, true, slots), 3);    // 2 waves; 3, 4 or 6 for 2, 3, 4 splits
  EXPECT_EQ(cuda::choose_splits(512, 64, 132, false, slots), 1);   // not a decode tile
  EXPECT_EQ(cuda::choose_splits(512, 8, 132, true, slots), 2);     // 4 key blocks a split at least
  EXPECT_EQ(cuda::choose_splits(792, 64, 132, true, slots), 1);    // whole waves already
  EXPECT_EQ(cuda::choose_splits(1024, 64, 132, true, slots), 1);   // the last wave 59% full
  EXPECT_EQ(cuda::choose_splits(990, 64, 132, true, slots), 2);    // ... 50%: 5, 8 or 10 waves for 2, 3, 4 splits
  EXPECT_EQ(cuda::choose_splits(512, 7, 132, true, slots), 1);     // too few key blocks to split
}

// Decode with grouped kv heads: the query heads folded into rows, at most 16
// of them on the key-split tile, at most 64 on the 64-row tile.
TEST_F(Dispatch, H100DecodeFoldsQueryHeads) {
  Call c;  // fewer than 8 key blocks: no split, no occupancy query (no GPU here)
  c.batch = 64, c.seqlen_q = 1, c.seqlen_k = 448, c.causal = false;
  const ForwardPlan f = c.forward(kH100);
  EXPECT_EQ(f.kernel, ForwardKernel::kSm80KeySplit);
  EXPECT_EQ(f.block_m, 16);
  EXPECT_EQ(f.params.heads, 8);
  EXPECT_EQ(f.params.seqlen_q, 4);
  Call chunk = c;  // more than one query row: the query heads stay apart
  chunk.seqlen_q = 16;
  EXPECT_EQ(chunk.forward(kH100).kernel, ForwardKernel::kSm80KeySplit);
  chunk.seqlen_q = 17;
  const ForwardPlan g = chunk.forward(kH100);
  EXPECT_EQ(g.kernel, ForwardKernel::kSm80Decode);
  EXPECT_EQ(g.block_m, 64);
}

// ---- The sm80-class devices: their tiles ----

TEST_F(Dispatch, Sm80PortableHopperRunsTheSm80Kernels) {
  Call c;
  c.bias = Shape{1, 8, 8192, 8192}, c.dbias = true;
  const ForwardPlan f = c.forward(kH100Portable);
  EXPECT_EQ(f.kernel, ForwardKernel::kSm80);
  EXPECT_EQ(f.persistent_ctas, 0);
  const BackwardPlan b = c.backward(kH100Portable);
  EXPECT_EQ(b.dkv, DkvKernel::kSm80);
  EXPECT_FALSE(b.bias_tiles || b.small_dq || b.small_dkv);
}

// The sm80-class backward's tiles by shared memory a block: the dense walk's
// dk/dv kernel takes its large tile (128 keys) on an A100's 163 KiB at D = 64
// and 128 and on an RTX 4090's 99 KiB at D = 64, its small one (64 keys) on
// the RTX 4090 at D = 128; the dq kernel its small tile at D = 128 below 166
// KiB and on the RTX 4090 at D = 64; an H100 the large ones.
TEST_F(Dispatch, Sm80BackwardTilesBySharedMemory) {
  struct Row {
    DeviceInfo device;
    std::int64_t head_dim;
    bool small_dq, small_dkv;
  };
  for (const Row& r : {Row{kA100, 128, true, false}, Row{kA100, 64, false, false}, Row{kRtx4090, 128, true, true},
                       Row{kRtx4090, 64, true, false}, Row{kH100Portable, 128, false, false}}) {
    Call c;
    c.head_dim = r.head_dim;
    EXPECT_EQ(c.forward(r.device).kernel, ForwardKernel::kSm80);
    const BackwardPlan b = c.backward(r.device);
    EXPECT_EQ(b.dkv, DkvKernel::kSm80Dense);
    EXPECT_EQ(b.small_dq, r.small_dq) << r.device.smem_optin << " bytes, D " << r.head_dim;
    EXPECT_EQ(b.small_dkv, r.small_dkv) << r.device.smem_optin << " bytes, D " << r.head_dim;
  }
}

// The dense sm80-class dk/dv kernel takes the dense walk with dq by atomics,
// no bias or a key-only one (with its dbias), batched or varlen, any band;
// a mask, top-k, softcap, deterministic dq, a bias with rows or a head dim
// it is not compiled for (D' = 256) keep the other sm80-class kernel.
TEST_F(Dispatch, Sm80DenseDkvKernelWhereItApplies) {
  for (const DeviceInfo& device : {kA100, kRtx4090, kH100Portable}) {
    Call dense;
    EXPECT_EQ(dense.backward(device).dkv, DkvKernel::kSm80Dense);
    Call key_bias;
    key_bias.bias = Shape{1, 8, 1, 8192}, key_bias.dbias = true, key_bias.causal = false;
    EXPECT_EQ(key_bias.backward(device).dkv, DkvKernel::kSm80Dense);
    Call varlen;
    varlen.varlen = true, varlen.batch = 3, varlen.head_dim = 64;
    EXPECT_EQ(varlen.backward(device).dkv, DkvKernel::kSm80Dense);
    Call mask, topk, softcap, deterministic, full_bias;
    mask.mask = Shape{1, 8, 8192, 8192};
    topk.bias = Shape{1, 8, 1, 8192}, topk.keep = 1024;
    softcap.softcap = 30.0;
    deterministic.deterministic = true;
    full_bias.bias = Shape{1, 8, 8192, 8192};
    for (const Call& c : {mask, topk, softcap, deterministic, full_bias})
      EXPECT_EQ(c.backward(device).dkv, DkvKernel::kSm80) << device.smem_optin << " bytes";
  }
}

// ---- Why not the Hopper kernel, and the plan in words ----


// The plan names `words` as the reason its step is not on the Hopper kernel, and so does its description.
template <class Plan>
void expect_reason(const Plan& plan, const char* words) {
  ASSERT_NE(plan.why_not_sm90, nullptr) << words;
  EXPECT_TRUE(has(plan.why_not_sm90, words)) << plan.why_not_sm90;
  EXPECT_TRUE(has(cuda::describe(plan), words)) << cuda::describe(plan);
}

// The plan names the condition that keeps a call off the Hopper kernel.
TEST_F(Dispatch, WhyNotTheHopperKernel) {
  Call f32;
  f32.bias = Shape{1, 8, 8192, 8192}, f32.bias_dtype = DType::kFloat32;
  Call masked_bias = f32;
  masked_bias.bias_dtype.reset(), masked_bias.mask = Shape{1, 1, 8192, 8192};
  Call per_row;
  per_row.bias = Shape{1, 8, 8192, 1};
  Call decode;
  decode.batch = 64, decode.seqlen_q = 1, decode.seqlen_k = 448, decode.causal = false;
  const std::pair<Call, const char*> forward[] = {{f32, "float32 full bias"},
                                                  {masked_bias, "full bias with a mask or top-k"},
                                                  {per_row, "per-row bias"},
                                                  {decode, "decode tile"}};
  for (const auto& [c, words] : forward) expect_reason(c.forward(kH100), words);
  EXPECT_TRUE(has(Call{}.forward(kH100Portable).why_not_sm90, "sm_90a"));
  EXPECT_EQ(Call{}.forward(kH100).why_not_sm90, nullptr);

  Call deterministic_mask;
  deterministic_mask.deterministic = true, deterministic_mask.mask = Shape{1, 1, 8192, 8192};
  Call deterministic_varlen;
  deterministic_varlen.deterministic = true, deterministic_varlen.varlen = true, deterministic_varlen.batch = 2;
  Call thresholds;  // a mask with rows and top-k: per-row thresholds
  thresholds.mask = Shape{1, 1, 8192, 8192}, thresholds.bias = Shape{1, 8, 1, 8192}, thresholds.keep = 1024;
  Call softcap_mask;
  softcap_mask.softcap = 30.0, softcap_mask.mask = Shape{1, 1, 8192, 8192};
  Call shared_dbias_64;  // 4 query heads of a kv head share a bias head's dbias, D' = 64
  shared_dbias_64.head_dim = 64, shared_dbias_64.bias = Shape{1, 8, 8192, 8192}, shared_dbias_64.dbias = true;
  const std::pair<Call, const char*> backward[] = {{deterministic_mask, "deterministic=True with a mask or top-k"},
                                                   {deterministic_varlen, "deterministic=True with varlen"},
                                                   {thresholds, "per-row thresholds"},
                                                   {softcap_mask, "softcap with a mask or top-k"},
                                                   {shared_dbias_64, "at D' = 64"}};
  for (const auto& [c, words] : backward) {
    EXPECT_EQ(c.backward(kH100).dkv, DkvKernel::kSm80) << words;
    expect_reason(c.backward(kH100), words);
  }
  EXPECT_EQ(Call{}.backward(kH100).why_not_sm90, nullptr);
}

TEST_F(Dispatch, PlansInWords) {
  Call c;
  c.bias = Shape{1, 8, 8192, 8192}, c.dbias = true;
  EXPECT_EQ(cuda::describe(c.forward(kH100)), "forward, D' = 128: Hopper kernel, bias-tile walk");
  Call short_rows;
  short_rows.batch = 16, short_rows.seqlen_q = short_rows.seqlen_k = 2048;
  EXPECT_EQ(cuda::describe(short_rows.forward(kH100)), "forward, D' = 128: Hopper kernel, dense walk, 132 persistent CTAs");
  EXPECT_EQ(cuda::describe(c.backward(kH100)),
            "backward, D' = 128: dk/dv Hopper kernel, bias-tile walk; dq added by atomics in the dk/dv kernel; "
            "dbias written directly");
  Call decode;
  decode.batch = 64, decode.seqlen_q = 1, decode.seqlen_k = 448, decode.causal = false;
  EXPECT_TRUE(has(cuda::describe(decode.forward(kH100)),
                  "sm80 kernel, 16 rows a CTA, the warps over the keys, 4 query heads folded into rows"));
  Call topk;
  topk.bias = Shape{1, 8, 1, 8192}, topk.keep = 1024, topk.deterministic = true;
  const std::string b = cuda::describe(topk.backward(kH100));
  EXPECT_TRUE(has(b, "dk/dv sm80 kernel, large tile, key groups; dq by the sm80 dq kernel, large tile, key lists"))
      << b;
  EXPECT_TRUE(has(b, "top-k: intervals selected; not the Hopper kernel: deterministic=True with a mask or top-k")) << b;
}

// DMATTN_LOG_PLAN=1 prints a plan's description once; another value is refused naming it.
TEST_F(Dispatch, LogPlanPrintsEachPlanOnce) {
  Call c;
  c.seqlen_q = c.seqlen_k = 3072;  // a plan no other test reports
  const ForwardPlan plan = c.forward(kH100);
  {
    const dmattn_test::ScopedEnv on("DMATTN_LOG_PLAN", "1");
    testing::internal::CaptureStderr();
    cuda::report(plan);
    cuda::report(plan);
    const std::string printed = testing::internal::GetCapturedStderr();
    EXPECT_EQ(printed, "dmattn: " + cuda::describe(plan) + "\n");
  }
  const dmattn_test::ScopedEnv bad("DMATTN_LOG_PLAN", "yes");
  expect_refused([&] { cuda::report(plan); }, Error::Kind::kValue, "DMATTN_LOG_PLAN");
}

// The fused top-k selection's CTAs a head: parts while the grid leaves SMs
// idle, a power of two up to 8 (a part is whole threads of positions).
TEST_F(Dispatch, FusedSelectionSharesHeadsWhereSmsIdle) {
  EXPECT_EQ(cuda::fused_selection_parts(8, 132), 8);    // 8 selection heads on an H100: 64 CTAs
  EXPECT_EQ(cuda::fused_selection_parts(32, 132), 4);   // B = 4: 128 CTAs
  EXPECT_EQ(cuda::fused_selection_parts(64, 132), 2);
  EXPECT_EQ(cuda::fused_selection_parts(128, 132), 1);  // a full grid: no redundant sorts
  EXPECT_EQ(cuda::fused_selection_parts(1, 132), 8);
}

// The counted top-k selection: few heads of at most 4096 keys, where its
// O(heads x keys^2) compares take less than a sort per head.
TEST_F(Dispatch, CountedSelectionForFewShortHeads) {
  EXPECT_TRUE(cuda::counted_selection(8, 2048));     // B = 1, 8 kv heads, S = 2048
  EXPECT_TRUE(cuda::counted_selection(8, 4096));
  EXPECT_TRUE(cuda::counted_selection(64, 1024));    // B = 8, S = 1024
  EXPECT_FALSE(cuda::counted_selection(32, 2048));   // B = 4, S = 2048: the sort
  EXPECT_FALSE(cuda::counted_selection(128, 1024));
  EXPECT_FALSE(cuda::counted_selection(1, 4097));    // past the shared memory of a head's keys
}

// ---- Refusals: before anything is enqueued, naming the argument ----

TEST_F(Dispatch, RefusalsOlderGpuHeadDimAndSharedMemory) {
  Call c;
  constexpr DeviceInfo kTuring{75, 40, 64 * 1024, false, false};
  expect_refused([&] { c.forward(kTuring); }, Error::Kind::kUnsupported, "q.device");
  expect_refused([&] { c.backward(kTuring); }, Error::Kind::kUnsupported, "q.device");
  const int largest = kHeadDims[std::size(kHeadDims) - 1];
  if (largest < 256) {  // a head dim CUDA takes (<= 256) above the largest compiled one
    Call wide;
    wide.head_dim = largest + 8;
    expect_refused([&] { wide.forward(kH100); }, Error::Kind::kUnsupported, "q.shape[-1]");
    expect_refused([&] { wide.backward(kH100); }, Error::Kind::kUnsupported, "q.shape[-1]");
  }
  if (compiled(256)) {  // its dk/dv CTA takes 155 KiB: an A100's 163 hold it, an RTX 4090's 99 do not
    Call d256;
    d256.head_dim = 256;
    EXPECT_EQ(d256.backward(kA100).dkv, DkvKernel::kSm80);
    expect_refused([&] { d256.backward(kRtx4090); }, Error::Kind::kUnsupported, "q.shape[-1]");
    EXPECT_EQ(d256.forward(kH100).why_not_sm90, nullptr);
  }
  constexpr DeviceInfo kSmall{80, 108, 48 * 1024, true, false};  // DMATTN_SMEM_LIMIT=48
  expect_refused([&] { c.forward(kSmall); }, Error::Kind::kUnsupported, "q.shape[-1]");
  expect_refused([&] { c.backward(kSmall); }, Error::Kind::kUnsupported, "q.shape[-1]");
}

}  // namespace
