// The dispatch (dispatch.h): a Problem and the device in, the kernel
// parameters and the kernel of every step out, or Error::kUnsupported, before
// anything is enqueued. The table it implements (docs/architecture.md):
//
//   forward        Hopper kSm90       sm_90a device, D' = 64 or 128 compiled (D <= D'), batched or varlen,
//                                     no bias or a key-only one, one split, TMA-addressable q, k, v (varlen:
//                                     the packed rows); a full bias of q's dtype, TMA-addressable, without a
//                                     mask or top-k: loaded by tiles with K (kRowBias); top-k (intervals or
//                                     thresholds, with a mask or not): the key lists of 128-row blocks
//                                     (kKeyLists: runs of consecutive keys by TMA, the rest gathered;
//                                     D' = 128: by a producer warpgroup); a mask alone: packed with its tile classes
//                                     (kMasked), no key lists
//                  sm80 kSm80Decode   at most 64 query rows (after decode folds query heads), D <= 128
//                  sm80 kSm80KeySplit at most 16 of them
//                  sm80 kSm80         everything else (128 rows a CTA; 64 above D = 128)
//                  split-KV           grids that leave SMs idle, decode grids whose last wave is part empty
//                                     (choose_splits), sm80 kernels only
//   backward dq    sm80 kernel        always; with dq summed by the dk/dv kernel (by atomics:
//                                     deterministic = false, D % 64 == 0; ordered: the Hopper dense
//                                     walk) it only recomputes the row statistics that need it
//   backward dk/dv Hopper kSm90(Groups)  sm_90a device, D' = 64 or 128 compiled (D <= D'), query rows,
//                                     no top-k or top-k intervals (their key groups; a mask without
//                                     top-k: packed by key with its tile classes), softcap without either,
//                                     batched or varlen, no bias or a key-only one, TMA-addressable q, dout;
//                                     dq by atomics, deterministic by ordered additions (the dense walk
//                                     alone: batched, no mask or softcap; CTAs started in order:
//                                     bwd/kernel_sm90.cuh)
//                  Hopper kSm90RowBias  the same device, head dims and operands, a bias with rows (per-row
//                                     or full) or a dbias per element, no mask, top-k, softcap or
//                                     deterministic; dbias summed over a bias head's query heads in the
//                                     CTA (D' = 128; at D' = 64 only where no two query heads of a kv head
//                                     share a bias head), float32 slices only across batch entries or kv heads;
//                                     a full bias of q's dtype TMA can address, with no dbias or one
//                                     written directly that TMA can address: by tiles (kBiasTiles)
//                  sm80 kSm80Dense    D' = 64 or 128, no mask or top-k, no bias or a key-only one, no
//                                     softcap, dq by atomics: 64-query steps over 128 keys (64 at D' = 128
//                                     where 163 KiB is not there), P and dS through shared memory
//                  sm80 kSm80         everything else
//   top-k          the caller's intervals (Problem::topk_intervals) when given, else selected:
//                  intervals (Problem::topk_by_intervals) or per-row thresholds
//   backward tiles the large tile of the sm80 dq and dk/dv kernels where its CTA fits the device's
//                  opt-in shared memory, else the small one (sized for sm_86's 99 KiB); kSm80Dense
//                  where one of its tiles fits, else kSm80
//   refused        compute capability below 8.0; D above the largest compiled head dim; a backward
//                  at a compiled head dim without one; a kernel's shared memory above the device's
//   emulation      DMATTN_SMEM_LIMIT caps the device's shared memory, DMATTN_PORTABLE=1 turns the
//                  Hopper kernels off (dispatch.h DeviceInfo)
#include "dispatch.h"

#include <cutlass/numeric_types.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "bwd/config.cuh"
#include "common/check.h"
#include "common/sm90.cuh"
#include "fwd/config.cuh"
#include "heuristics.h"

namespace dmattn::cuda {
namespace {

// ---- The device -----------------------------------------------------------

// Whether DMATTN_CUDA_ARCHS (CMake's list, e.g. "80,90a") has sm_90a code: the
// Hopper kernels are empty in any other build of them.
bool build_has_sm90a() {
  const std::string archs = DMATTN_CUDA_ARCHITECTURES;
  for (std::size_t at = 0; at < archs.size();) {
    std::size_t end = archs.find(',', at);
    if (end == std::string::npos) end = archs.size();
    if (archs.compare(at, 3, "90a") == 0) return true;
    at = end + 1;
  }
  return false;
}

DeviceInfo query_device(int device) {
  DeviceInfo info;
  int major = 0, minor = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&info.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute");
  info.arch = 10 * major + minor;
  info.sm90a = info.arch == 90 && build_has_sm90a() && tensor_map_encoder() != nullptr;
  return info;
}

// An emulation setting (dispatch.h DeviceInfo): the environment variable's
// value, or nullptr where it is unset or empty.
const char* setting(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

// A setting that is 0 or 1 (unset or empty: 0), else Error::kValue naming it.
bool switched_on(const char* name, const char* expected) {
  const char* value = setting(name);
  if (value == nullptr) return false;
  const std::string v = value;
  if (v != "0" && v != "1") throw Error(Error::Kind::kValue, name, expected, "'" + v + "'");
  return v == "1";
}

// A device's attributes under the emulation settings.
DeviceInfo emulate(DeviceInfo info) {
  if (const char* limit = setting("DMATTN_SMEM_LIMIT")) {
    char* end = nullptr;
    const long kib = limit[0] >= '0' && limit[0] <= '9' ? std::strtol(limit, &end, 10) : 0;
    if (end == nullptr || *end != '\0' || kib < 1 || kib > (1 << 20))
      throw Error(Error::Kind::kValue, "DMATTN_SMEM_LIMIT",
                  "the shared memory a block may use in KiB, a whole number from 1 to 1048576 (e.g. 99: sm_86 / "
                  "sm_89, 163: sm_80)",
                  std::string("'") + limit + "'");
    const int bytes = static_cast<int>(kib * 1024);
    info.smem_capped = bytes < info.smem_optin;
    info.smem_optin = std::min(info.smem_optin, bytes);
  }
  if (switched_on("DMATTN_PORTABLE", "0 or 1 (1: the sm80-class kernels only)")) info.sm90a = false;
  if (const char* blocks = setting("DMATTN_LIST_BLOCKS")) {
    const std::string v = blocks;
    if (v != "1" && v != "2" && v != "4" && v != "8")
      throw Error(Error::Kind::kValue, "DMATTN_LIST_BLOCKS",
                  "1, 2, 4 or 8 (the query blocks a CTA of the top-k interval lists takes)", "'" + v + "'");
    info.list_cta_blocks = std::stoi(v);
  }
  return info;
}

// ---- The compiled instantiations ------------------------------------------

// One compiled head dim (DMATTN_HEAD_DIMS): its launchers by dtype (fp16,
// bf16) and what the dispatch checks of its kernels.
struct Instance {
  int head_dim = 0;
  ForwardRun forward[2] = {};
  int (*ctas_per_sm[2])(ForwardKernel) = {};
  // Bytes of shared memory of a CTA of kSm80, kSm80Decode and kSm80KeySplit.
  int forward_smem = 0, decode_smem = 0, key_split_smem = 0;
  BackwardRun backward[2] = {};           // none: this head dim has no backward (backward_compiled)
  // Bytes of shared memory of a CTA of the sm80 dq and dk/dv kernels: large tile, small tile.
  int dq_smem[2] = {}, dkv_smem[2] = {};
  int dkv_dense_smem[2] = {};  // ... of the dense dk/dv kernel's tiles (0: none at this head dim)
  // Of a CTA of the Hopper forward and dk/dv kernels; 0: none at this head
  // dim (sm90_forward_head_dim, sm90_backward_head_dim).
  int forward_sm90_smem = 0, dkv_sm90_smem = 0;
  int forward_sm90_tile_smem = 0;  // ... of the Hopper forward's walk of full-bias tiles
  // ... of its walk of a bias with rows, and whether that walk sums dbias over
  // the query heads of a kv head (bwd/config.cuh DkvSm90Config::kDbSums).
  int dkv_sm90_row_bias_smem = 0;
  bool dkv_sm90_db_sums = false;
  int dkv_sm90_ordered_smem = 0;  // ... of its walk with ordered dq (deterministic)
};

template <int kHeadDim>
Instance make_instance() {
  using cutlass::bfloat16_t;
  using cutlass::half_t;
  Instance i;
  i.head_dim = kHeadDim;
  i.forward[0] = &ForwardInstance<half_t, kHeadDim>::run, i.forward[1] = &ForwardInstance<bfloat16_t, kHeadDim>::run;
  i.ctas_per_sm[0] = &ForwardInstance<half_t, kHeadDim>::ctas_per_sm;
  i.ctas_per_sm[1] = &ForwardInstance<bfloat16_t, kHeadDim>::ctas_per_sm;
  i.forward_smem = ForwardConfig<half_t, kHeadDim>::kSmemBytes;
  i.decode_smem = ForwardConfig<half_t, kHeadDim, kForwardDecodeRows>::kSmemBytes;
  i.key_split_smem = ForwardConfig<half_t, kHeadDim, kForwardKeySplitRows>::kSmemBytes;
  if constexpr (backward_compiled(kHeadDim)) {
    i.backward[0] = &BackwardInstance<half_t, kHeadDim>::run;
    i.backward[1] = &BackwardInstance<bfloat16_t, kHeadDim>::run;
    i.dq_smem[0] = BackwardKernelConfig<half_t, kHeadDim, false, false>::kSmemBytes;
    i.dq_smem[1] = BackwardKernelConfig<half_t, kHeadDim, false, true>::kSmemBytes;
    i.dkv_smem[0] = BackwardKernelConfig<half_t, kHeadDim, true, false>::kSmemBytes;
    i.dkv_smem[1] = BackwardKernelConfig<half_t, kHeadDim, true, true>::kSmemBytes;
  }
  if constexpr (dkv_sm80_dense_head_dim(kHeadDim)) {
    i.dkv_dense_smem[0] = DkvSm80KernelConfig<half_t, kHeadDim, false>::kSmemBytes;
    i.dkv_dense_smem[1] = DkvSm80KernelConfig<half_t, kHeadDim, true>::kSmemBytes;
  }
  if constexpr (sm90_forward_head_dim(kHeadDim)) {
    using Config = ForwardSm90Config<half_t, kHeadDim>;
    i.forward_sm90_smem = Config::smem_bytes(false, Config::kSecondQ);  // the most a walk without bias tiles takes
    i.forward_sm90_tile_smem = Config::kTileSmemBytes;
  }
  if constexpr (sm90_backward_head_dim(kHeadDim)) {
    i.dkv_sm90_smem = DkvSm90Config<half_t, kHeadDim>::kSmemBytes;
    i.dkv_sm90_row_bias_smem = DkvSm90Config<half_t, kHeadDim>::kRowBiasSmemBytes;
    i.dkv_sm90_db_sums = DkvSm90Config<half_t, kHeadDim>::kDbSums;
    i.dkv_sm90_ordered_smem = DkvSm90Config<half_t, kHeadDim>::kOrderedSmemBytes;
  }
  return i;
}

// The instantiation of head dim d: the smallest compiled head dim >= d (the
// features past d are zero-padded in shared memory).
const Instance kInstances[] = {
#define DMATTN_CUDA_HEAD_DIM(D) make_instance<D>(),
#include "head_dims.inc"
#undef DMATTN_CUDA_HEAD_DIM
};

const Instance& instance_for(std::int64_t d) {
  for (const Instance& i : kInstances)
    if (d <= i.head_dim) return i;
  throw Error(Error::Kind::kUnsupported, "q.shape[-1]",
              std::string("a head_dim <= the largest compiled CUDA head dim (DMATTN_HEAD_DIMS = ") + DMATTN_HEAD_DIMS + ")",
              std::to_string(d));
}

// The device must run the sm80-class code (every instantiation has it).
void check_arch(const DeviceInfo& device, const Problem& p) {
  if (device.arch < 80)
    throw Error(Error::Kind::kUnsupported, "q.device",
                "a GPU of compute capability 8.0 or above (the CUDA kernels are sm80-class or Hopper)",
                "cuda:" + std::to_string(p.device.index) + " of compute capability " +
                    std::to_string(device.arch / 10) + "." + std::to_string(device.arch % 10));
}

// A kernel's CTA must fit the device's shared memory.
void check_smem(int bytes, const DeviceInfo& device, const Problem& p, const Instance& i, const char* direction,
                const char* kernel) {
  if (bytes > device.smem_optin)
    throw Error(Error::Kind::kUnsupported, "q.shape[-1]",
                std::string("a head dim whose CUDA ") + direction + " fits in " + std::to_string(device.smem_optin) +
                    " bytes of shared memory a block (" +
                    (device.smem_capped ? "DMATTN_SMEM_LIMIT" : "this GPU's opt-in limit") + ")",
                std::to_string(p.head_dim) + " (compiled head dim " + std::to_string(i.head_dim) + ": its " + kernel +
                    " needs " + std::to_string(bytes) + " bytes)");
}

// The small tile of a backward kernel (true) where the large one's CTA does
// not fit the device's shared memory; kUnsupported where neither fits.
bool small_tile(const int (&bytes)[2], const DeviceInfo& device, const Problem& p, const Instance& i,
                const char* kernel) {
  if (bytes[0] <= device.smem_optin) return false;
  check_smem(bytes[1], device, p, i, "backward", kernel);
  return true;
}

// ---- Problem -> kernel parameters -----------------------------------------

// 16-byte cp.async needs a 16-byte aligned base and row, head and batch strides
// of whole 16-byte chunks (8 elements of 2 bytes).
bool vector_loads(const Operand& t) {
  return reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0 && t.sb % 8 == 0 && t.sh % 8 == 0 && t.sr % 8 == 0;
}

// The forward's key-only bias loads a tile's keys as 16-byte chunks
// (ForwardParams::vector_bias): consecutive keys, 16-byte aligned rows and
// sequences of whole chunks (8 keys cover one of either bias dtype).
bool vector_key_bias(const Problem& p, const AttentionParams& params) {
  const Operand& b = params.bias;
  if (params.bias_kind() != BiasKind::kKeyOnly || b.sc != 1 || p.varlen() || p.seqlen_k % 8 != 0) return false;
  const auto per_chunk = static_cast<std::int64_t>(16 / dtype_size(b.dtype));
  return reinterpret_cast<std::uintptr_t>(b.data) % 16 == 0 && b.sb % per_chunk == 0 && b.sh % per_chunk == 0;
}

// The fields the forward and the backward share (not the vector-load flags and
// the bias kind: the forward sets them after folding query heads).
void set_attention_params(const Problem& p, AttentionParams& params) {
  params.q = p.q, params.k = p.k, params.v = p.v, params.out = p.out, params.lse = p.lse;
  params.mask = p.mask, params.bias = p.bias;
  params.bias_float32 = p.bias.present() && p.bias.dtype == DType::kFloat32;
  params.group = static_cast<int>(p.group());
  params.mask_group = static_cast<int>(p.heads / p.mask_shape.heads);
  params.bias_group = static_cast<int>(p.heads / p.bias_shape.heads);
  params.head_dim = static_cast<int>(p.head_dim);
  params.seqlen_q = p.seqlen_q, params.seqlen_k = p.seqlen_k;
  params.cu_seqlens_q = p.cu_seqlens_q, params.cu_seqlens_k = p.cu_seqlens_k;
  params.total_q = p.total_q, params.total_k = p.total_k;
  params.scale = static_cast<float>(p.scale), params.softcap = static_cast<float>(p.softcap);
  params.band = Band{p.causal, p.window_left, p.window_right};
}

// Decode with grouped kv heads: one query row (batched, no sliding window) and
// G = H / Hk > 1 query heads per kv head. The G query heads of kv head h' become
// the G query rows of one head h': row i of head h' is query head h' * G + i, so
// a row steps by the head stride and a head by G of them. One CTA then reads
// each K and V tile once for all G heads instead of once per head. Causal is
// dropped: bottom-right aligned, the single row sees every key. A mask or bias
// with H heads gets the same head-to-row view; one with Hk heads (or one) is
// shared by the G rows (row stride 0). Top-k (per-row thresholds at one query
// row) lists keys per (b, kv head) then, each row tested against its query
// head's threshold (topk_fold). Returns the number of heads to launch.
std::int64_t fold_query_heads(const Problem& p, ForwardParams& params) {
  const std::int64_t G = p.group();
  if (p.seqlen_q != 1 || G == 1 || p.varlen() || p.window_left >= 0 || p.window_right >= 0 ||
      (p.keep_window_size > 0 && p.topk_by_intervals()))
    return p.heads;
  for (Operand* t : {&params.q, &params.out, &params.lse}) t->sr = t->sh, t->sh *= G;
  const auto fold_operand = [&](Operand& t, std::int64_t operand_heads) {
    t.sr = operand_heads == p.heads ? t.sh : 0;
    if (operand_heads == p.heads) t.sh *= G;
    return static_cast<int>(operand_heads == 1 ? p.kv_heads : 1);  // kv heads per operand head
  };
  if (p.mask.present()) params.mask_group = fold_operand(params.mask, p.mask_shape.heads);
  if (p.bias.present()) params.bias_group = fold_operand(params.bias, p.bias_shape.heads);
  params.group = 1;
  params.topk_fold = static_cast<int>(G);
  params.seqlen_q = G;
  params.band.causal = false;
  return p.kv_heads;
}

// The top-k selection of a call with keys and query rows, and whether the
// caller gave it (its intervals) or it is selected here: decided here alone.
template <class Plan>
void plan_selection(const Problem& p, Plan& plan) {
  if (p.keep_window_size == 0 || p.seqlen_k == 0 || p.seqlen_q == 0) return;
  plan.selection = p.topk_by_intervals() ? DeviceSelection::kIntervals : DeviceSelection::kThresholds;
  plan.selection_given = plan.selection == DeviceSelection::kIntervals && p.topk_intervals != nullptr;
}

// ---- The Hopper kernels' conditions ---------------------------------------
// Each is a refusal: why the Hopper kernel does not take the call (the plan's
// why_not_sm90, shown by DMATTN_LOG_PLAN), or nullptr where it does.

constexpr const char* kNoSm90a = "not an sm_90a device and build (or DMATTN_PORTABLE=1)";
constexpr const char* kNoSm90HeadDim = "no Hopper kernel at this head dim (see heuristics.h sm90_*_head_dim)";
constexpr const char* kSm90Smem = "its CTA needs more shared memory than the device gives (DMATTN_SMEM_LIMIT?)";

// The Hopper forward: written for the training shapes at D' = 64 to 256 (TMA
// fills the features past a smaller head dim with zeros; its 128-row blocks
// where the sm80 kernel's are 64 above D = 128), a top-k selection
// walked over the key lists, a mask alone by tile class and bit, a full bias
// by tiles (`tiles`: ForwardWalk::kRowBias, without a mask or top-k, whose
// walks take none, where TMA can load it); the 128-row sm80 walk otherwise.
const char* forward_sm90_refusal(const ForwardPlan& plan, const Instance& i, const DeviceInfo& device, bool tiles) {
  const ForwardParams& p = plan.params;
  const BiasKind bias = p.bias_kind();
  if (!device.sm90a) return kNoSm90a;
  if (plan.kernel != ForwardKernel::kSm80) return "at most 64 query rows: the sm80 decode tiles";
  if (i.forward_sm90_smem == 0) return kNoSm90HeadDim;
  if (p.num_splits != 1) return "split-KV (the grid leaves SMs idle): the sm80 kernel";
  if (!p.vector_q || !p.vector_k || !p.vector_v) return "q, k or v rows not in 16-byte chunks";
  if (bias == BiasKind::kPerRow) return "a per-row bias (the Hopper forward takes key-only and full ones)";
  if (bias == BiasKind::kFull && !tiles) {
    if (plan.key_lists) return "a full bias with a mask or top-k";
    if (p.bias_float32) return "a float32 full bias (its tiles take q's dtype)";
    return "a full bias whose rows TMA cannot address (keys a multiple of 8, a 16-byte aligned base)";
  }
  if ((tiles ? i.forward_sm90_tile_smem : i.forward_sm90_smem) > device.smem_optin) return kSm90Smem;
  if (!tma_addressable(p.q, p.query_tokens(p.batch), p.heads) ||
      !tma_addressable(p.k, p.key_tokens(p.batch), p.heads / p.group) ||
      !tma_addressable(p.v, p.key_tokens(p.batch), p.heads / p.group))
    return "q, k or v strides TMA cannot address";
  return nullptr;
}

// The Hopper dk/dv kernel's walk of a bias with rows (a bias not key-only,
// or one whose gradient has rows: DkvWalk::kRowBias).
bool row_bias_walk(const BackwardParams& p) {
  return p.bias_kind() == BiasKind::kPerRow || p.bias_kind() == BiasKind::kFull || p.bias_grad == BiasGrad::kPerElement;
}

// The Hopper dk/dv kernel: D' = 64 to 256 (a smaller D padded; above 128 the
// dense walk alone, without softcap, ordered dq or a bias with rows), dq summed in
// its dQ blocks (deterministic: in order, the dense walk of a batched call
// without a mask or softcap), the dense walk (a mask tested by tile class and
// bit; or softcap) or top-k key groups (a mask folded into them), key-only
// dbias; or the walk of a bias with rows (batched: varlen biases are
// key-only), without a mask, top-k, softcap or ordered dq, where its dbias
// sums fit (D' = 128), or no two query heads of a kv head share a bias head.
const char* dkv_sm90_refusal(const BackwardPlan& plan, const Instance& i, const DeviceInfo& device,
                             bool deterministic) {
  const BackwardParams& p = plan.params;
  const bool dense = plan.selection == DeviceSelection::kNone, plain = dense && p.mask.data == nullptr;
  if (!device.sm90a) return kNoSm90a;
  if (i.dkv_sm90_smem == 0) return kNoSm90HeadDim;
  if (p.seqlen_q == 0) return "no query rows";
  if (dkv_sm90_split_features(i.head_dim) && (!plain || row_bias_walk(p) || deterministic || p.softcap != 0.0f))
    return "above D' = 128 its dense walk only: no mask, top-k, softcap, bias with rows or deterministic=True";
  int smem = i.dkv_sm90_smem;
  if (row_bias_walk(p)) {
    if (!plain) return "a bias with rows, or dbias per element, with a mask or top-k";
    if (deterministic) return "a bias with rows, or dbias per element, with deterministic=True";
    if (p.softcap != 0.0f) return "a bias with rows, or dbias per element, with softcap";
    const bool heads_share = p.bias_grad == BiasGrad::kPerElement && p.bias_group > 1 && p.group > 1;
    if (heads_share && !i.dkv_sm90_db_sums)
      return "dbias per element that query heads of a kv head share, at D' = 64 (its sums do not fit)";
    smem = i.dkv_sm90_row_bias_smem;
  } else if (deterministic) {
    if (!plain) return "deterministic=True with a mask or top-k";
    if (p.softcap != 0.0f) return "deterministic=True with softcap";
    if (p.cu_seqlens_q != nullptr) return "deterministic=True with varlen";
    smem = i.dkv_sm90_ordered_smem;
  } else {
    if (!dense && plan.selection != DeviceSelection::kIntervals) return "top-k by per-row thresholds";
    if (p.softcap != 0.0f && !plain) return "softcap with a mask or top-k";
  }
  if (!p.vector_q || !p.vector_k || !p.vector_v || !p.vector_dout) return "q, k, v or dout rows not in 16-byte chunks";
  if (smem > device.smem_optin) return kSm90Smem;
  if (!tma_addressable(p.q, p.query_tokens(plan.batch), p.heads) ||
      !tma_addressable(p.dout, p.query_tokens(plan.batch), p.heads))
    return "q or dout strides TMA cannot address";
  return nullptr;
}

int dtype_index(const Problem& p) { return p.q.dtype == DType::kBFloat16 ? 1 : 0; }

}  // namespace

DeviceInfo device_info(int device) {
  static std::mutex mutex;
  static std::vector<std::unique_ptr<DeviceInfo>> known;  // by device index, queried once
  const DeviceInfo* hardware = nullptr;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (known.size() <= static_cast<std::size_t>(device)) known.resize(device + 1);
    if (known[device] == nullptr) known[device] = std::make_unique<DeviceInfo>(query_device(device));
    hardware = known[device].get();
  }
  return emulate(*hardware);
}

ForwardPlan plan_forward(const Problem& p, const DeviceInfo& device) {
  ForwardPlan plan;
  plan.empty = p.batch == 0 || p.seqlen_q == 0;
  if (plan.empty) return plan;
  check_arch(device, p);
  const Instance& instance = instance_for(p.head_dim);
  plan.head_dim = instance.head_dim;

  ForwardParams& params = plan.params;
  set_attention_params(p, params);
  params.list_cta_blocks = device.list_cta_blocks;
  params.heads = static_cast<int>(fold_query_heads(p, params));
  params.batch = static_cast<int>(p.batch);
  params.vector_q = vector_loads(params.q), params.vector_k = vector_loads(p.k), params.vector_v = vector_loads(p.v);
  params.vector_bias = vector_key_bias(p, params);
  // No keys: nothing to mask or select, every row empty.
  if (p.seqlen_k == 0) params.mask.data = nullptr;
  plan_selection(p, plan);
  plan.key_lists = params.mask.data != nullptr || plan.selection != DeviceSelection::kNone;

  // The sm80 tile: for few query rows where the head dim's tile is taller, 64
  // rows, or 16 with the warps over the keys.
  const bool decode = forward_block_m(instance.head_dim) > kForwardDecodeRows && params.seqlen_q <= kForwardDecodeRows;
  struct Sm80Tile {
    ForwardKernel kernel;
    int rows, smem;
    const char* name;
  };
  const Sm80Tile tile =
      !decode ? Sm80Tile{ForwardKernel::kSm80, forward_block_m(instance.head_dim), instance.forward_smem, "forward kernel"}
      : params.seqlen_q <= kForwardKeySplitRows
          ? Sm80Tile{ForwardKernel::kSm80KeySplit, kForwardKeySplitRows, instance.key_split_smem, "16-row forward kernel"}
          : Sm80Tile{ForwardKernel::kSm80Decode, kForwardDecodeRows, instance.decode_smem, "64-row forward kernel"};
  plan.kernel = tile.kernel;
  plan.block_m = tile.rows;
  check_smem(tile.smem, device, p, instance, "forward", tile.name);
  // Split-KV where the grid leaves SMs idle.
  const int dtype = dtype_index(p);
  const std::int64_t blocks_m = (params.seqlen_q + plan.block_m - 1) / plan.block_m;
  const int block_n = forward_block_n(instance.head_dim);
  params.num_splits = choose_splits(blocks_m * params.heads * params.batch, (params.seqlen_k + block_n - 1) / block_n,
                                    device.sms, decode,
                                    [&] { return device.sms * instance.ctas_per_sm[dtype](plan.kernel); });
  // The Hopper forward: top-k (with a mask or not) over the key lists (built
  // for its 128-row blocks); a mask alone by its tile classes and bits. The
  // mask's one pass costs less than the lists' two, and on a dense mask its
  // walk less than the lists' (H200, a ~50% random mask: fwd 1.61 ms against
  // 2.75 over key lists); on a sparse one the lists' shorter walk wins (a
  // top-1024 mask: 6.17 against 4.02). Nothing the plan sees tells them apart
  // (docs/kernels.md).
  const bool bias_tiles = !plan.key_lists && bias_tiles_apply(params, params.batch);
  plan.why_not_sm90 = forward_sm90_refusal(plan, instance, device, bias_tiles);
  if (plan.why_not_sm90 == nullptr) {
    plan.kernel = ForwardKernel::kSm90;
    plan.block_m = kForwardSm90BlockM;
    plan.mask_tiles = plan.key_lists && plan.selection == DeviceSelection::kNone;
    plan.bias_tiles = bias_tiles;
    if (plan.mask_tiles) plan.key_lists = false;
    if (forward_sm90_persistent(instance.head_dim, plan.key_lists, params.seqlen_k))
      plan.persistent_ctas = device.sms * forward_sm90_ctas_per_sm(instance.head_dim);
  }
  plan.run = instance.forward[dtype];
  return plan;
}

// The backward of p on `instance`.
BackwardPlan plan_backward_on(const Problem& p, const DeviceInfo& device, const Instance& instance) {
  BackwardPlan plan;
  const int dtype = dtype_index(p);
  if (instance.backward[dtype] == nullptr)
    throw Error(Error::Kind::kUnsupported, "q.shape[-1]",
                "a head_dim whose compiled CUDA head dim has a backward (<= 128, 192 or 256)",
                std::to_string(p.head_dim) + " (compiled head dim " + std::to_string(instance.head_dim) + ")");
  plan.small_dq = small_tile(instance.dq_smem, device, p, instance, "dq kernel");
  plan.small_dkv = small_tile(instance.dkv_smem, device, p, instance, "dk/dv kernel");
  plan.head_dim = instance.head_dim;
  plan.batch = static_cast<int>(p.batch);

  BackwardParams& params = plan.params;
  set_attention_params(p, params);
  params.list_cta_blocks = device.list_cta_blocks;
  params.dout = p.dout, params.dq = p.dq, params.dk = p.dk, params.dv = p.dv, params.dbias = p.dbias;
  params.heads = static_cast<int>(p.heads);
  params.vector_q = vector_loads(p.q), params.vector_k = vector_loads(p.k), params.vector_v = vector_loads(p.v);
  params.vector_dout = vector_loads(p.dout);
  params.vector_rows = vector_loads(p.out) && params.vector_dout && p.head_dim % 8 == 0;

  // dbias (a key-constant bias's exact zeros are the API's): per key or per
  // element, written directly where each element gets one value, else summed
  // over float32 slices (one per batch entry or kv head it broadcasts over).
  if (p.dbias.present()) {
    params.bias_grad = p.bias_shape.rows == 1 ? BiasGrad::kPerKey : BiasGrad::kPerElement;
    params.db_batch = p.bias_shape.batch, params.db_heads = p.bias_shape.heads;
    params.db_rows = p.bias_shape.rows == 1 ? 1 : p.seqlen_q, params.db_cols = p.seqlen_k;
    const std::int64_t kv_heads = p.kv_heads;
    params.contrib_b = params.db_batch == 1 && p.batch > 1 ? static_cast<int>(p.batch) : 1;
    params.contrib_h = params.db_heads == 1 && kv_heads > 1 ? static_cast<int>(kv_heads) : 1;
    const bool heads_summed = params.bias_group > 1 && params.group > 1;
    const bool direct = params.contrib_b * params.contrib_h == 1 &&
                        (params.bias_grad == BiasGrad::kPerKey || !heads_summed);
    if (!direct) plan.dbias_slices = params.contrib_b * params.contrib_h;
  }
  // dq by float32 atomics from the dk/dv kernel unless deterministic (then by
  // ordered additions where the Hopper dk/dv kernel runs, below).
  params.atomic_dq = !p.deterministic && backward_atomic_dq(instance.head_dim) && p.seqlen_q > 0;

  plan_selection(p, plan);
  const bool keys = p.seqlen_k > 0 && p.seqlen_q > 0;
  plan.key_lists = keys && (p.mask.present() || plan.selection != DeviceSelection::kNone);
  plan.mask_tiles = plan.key_lists && p.mask.present() && plan.selection != DeviceSelection::kIntervals;
  // Key groups sorted by rows unless dbias needs contiguous keys; keys cut at
  // row segments add their pieces' sums in a slot with one key dbias: one bias
  // head a kv head.
  plan.sort_groups = params.bias_grad == BiasGrad::kNone || params.bias_grad == BiasGrad::kPerKey;
  plan.split_groups = params.bias_grad == BiasGrad::kNone || params.bias_group % params.group == 0;
  plan.why_not_sm90 = dkv_sm90_refusal(plan, instance, device, p.deterministic);
  if (plan.why_not_sm90 == nullptr) {
    plan.dkv = plan.selection == DeviceSelection::kIntervals ? DkvKernel::kSm90Groups
               : row_bias_walk(params)                        ? DkvKernel::kSm90RowBias
                                                              : DkvKernel::kSm90;
    plan.ordered_dq = p.deterministic;
    params.atomic_dq = true;
    // The ordered walk takes the heads of a group in turn for each query
    // block: a key-only dbias whose bias heads split the group gets each
    // head's sums several times, added in a float32 slice.
    if (plan.ordered_dq && params.bias_grad == BiasGrad::kPerKey && params.bias_group % params.group != 0)
      plan.dbias_slices = std::max(plan.dbias_slices, 1);
    // The row-bias walk sums the query heads of a bias head within its CTA:
    // slices only where a bias element spans batch entries or kv heads.
    if (plan.dkv == DkvKernel::kSm90RowBias && params.bias_grad == BiasGrad::kPerElement)
      plan.dbias_slices = params.contrib_b * params.contrib_h > 1 ? params.contrib_b * params.contrib_h : 0;
    // By tiles: dbias too (stored by TMA), written directly.
    const BiasTileExtent db_tiles = dbias_tile_extent(params);
    plan.bias_tiles = plan.dkv == DkvKernel::kSm90RowBias && bias_tiles_apply(params, plan.batch) &&
                      (params.bias_grad == BiasGrad::kNone ||
                       (plan.dbias_slices == 0 && tma_addressable(params.dbias, db_tiles.tokens, db_tiles.heads)));
  }
  // Elsewhere the dense walk with dq by atomics, no bias or a key-only one and
  // no softcap runs the dense sm80-class kernel, where one of its tiles fits.
  const bool dense_walk = !plan.key_lists && params.atomic_dq && p.softcap == 0.0f && !row_bias_walk(params);
  if (plan.dkv == DkvKernel::kSm80 && dense_walk && instance.dkv_dense_smem[1] > 0 &&
      instance.dkv_dense_smem[1] <= device.smem_optin) {
    plan.dkv = DkvKernel::kSm80Dense;
    plan.small_dkv = instance.dkv_dense_smem[0] > device.smem_optin;
  }
  params.dq_blocks = !sm80_dkv(plan.dkv);
  plan.run = instance.backward[dtype];
  return plan;
}

// The backward of p on its instantiation; where that has no Hopper dk/dv
// kernel (D' = 192) and a wider compiled one's takes the call, on the wider
// one, padded (TMA fills the features past D with zeros, the stores stop at
// D): D = 192 on D' = 256's dense walk runs ~2x faster than on the sm80-class
// kernels (docs/kernels.md).
BackwardPlan plan_backward(const Problem& p, const DeviceInfo& device) {
  if (p.batch == 0) {
    BackwardPlan plan;
    plan.empty = true;
    return plan;
  }
  check_arch(device, p);
  const Instance& instance = instance_for(p.head_dim);
  BackwardPlan plan = plan_backward_on(p, device, instance);
  if (plan.why_not_sm90 != kNoSm90HeadDim) return plan;
  for (const Instance& wider : kInstances) {
    if (wider.head_dim <= instance.head_dim || wider.dkv_sm90_smem == 0) continue;
    BackwardPlan padded = plan_backward_on(p, device, wider);
    if (padded.why_not_sm90 == nullptr) return padded;
  }
  return plan;
}

namespace {

// Prints the plan's description once a process (DMATTN_LOG_PLAN=1).
template <class Plan>
void report_once(const Plan& plan) {
  if (!switched_on("DMATTN_LOG_PLAN", "0 or 1 (1: each distinct plan printed to stderr once)")) return;
  static std::mutex mutex;
  static std::set<std::string> seen;
  const std::string text = describe(plan);
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (!seen.insert(text).second) return;
  }
  std::fprintf(stderr, "dmattn: %s\n", text.c_str());
}

}  // namespace

void report(const ForwardPlan& plan) { report_once(plan); }
void report(const BackwardPlan& plan) { report_once(plan); }

void plan_select(const Problem& p) { check_arch(device_info(p.device.index), p); }

}  // namespace dmattn::cuda
