// Helpers of the Hopper (sm_90a) kernels: a batch of warpgroup MMAs, the
// proxy fence between generic shared-memory writes and wgmma (or TMA) reads,
// the bulk float32 reduction, and the TMA descriptors of a token operand and
// of a full bias (with the dispatch's tests that TMA can address them).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "../../problem.h"
#include "../params.h"
#include "geometry.h"

namespace dmattn::cuda {

// Warpgroup MMAs of (kM, kN, kK) tiles, Element operands and float
// accumulators, over the warpgroups of Layout: A and B from shared memory
// (WgmmaSS) or A from registers (WgmmaRS), each K-major unless given.
template <class Element, int kM, int kN, int kK, class Layout, cute::GMMA::Major kMajorA = cute::GMMA::Major::K,
          cute::GMMA::Major kMajorB = cute::GMMA::Major::K>
using WgmmaSS = decltype(cute::make_tiled_mma(
    cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::Int<kM>, cute::Int<kN>, cute::Int<kK>>,
                               kMajorA, kMajorB>(),
    Layout{}));
template <class Element, int kM, int kN, int kK, class Layout, cute::GMMA::Major kMajorB>
using WgmmaRS = decltype(cute::make_tiled_mma(
    cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<cute::Int<kM>, cute::Int<kN>, cute::Int<kK>>,
                               cute::GMMA::Major::K, kMajorB>(),
    Layout{}));

// acc(_, _, k) += A(_, _, k) B(_, _, k) over the K mode as one batch of warpgroup
// MMAs (zeroing acc first with kZero); the caller waits for it.
template <bool kZero, class Mma, class A, class B, class C>
__device__ __forceinline__ void wgmma_batch(Mma& mma, A& a, const B& b, C& acc) {
  using namespace cute;
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  if constexpr (kZero) mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int kk = 0; kk < size<2>(a); ++kk) {
    gemm(mma, a(_, _, kk), b(_, _, kk), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
}

// Generic-proxy shared-memory writes (cp.async, st.shared) made visible to the
// wgmma operand reads (async proxy) that follow the next barrier.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// One arrival on the mbarrier `bar` once the executing thread's cp.async
// copies so far have landed (.noinc: the barrier's count includes it).
__device__ __forceinline__ void cp_async_arrive(std::uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(bar)))
               : "memory");
}

// Byte offset of element (row, col) of a tile of 2-byte elements stored as
// GMMA 128-byte K-major swizzle atoms (Layout_K_SW128_Atom) whose rows hold
// the 64 columns, from the tile's 1024-byte aligned base: 16-byte chunk c of
// row r lands in chunk c ^ (r % 8).
__device__ __forceinline__ unsigned sw128_offset(int row, int col) {
  const unsigned linear = 128u * row + 2u * col;
  return linear ^ ((linear >> 3) & 0x70u);
}

// The threads that gather_rows_sw128 gives a row: kPerRow of them (at least
// 2, so that a row's threads read whole 32-byte sectors), and its rows: thread
// t takes tile rows t / kPerRow + kRowsAPass p, pass p < kPasses.
template <int kThreads, int kTileRows>
struct GatheredRows {
  static constexpr int kPerRow = kThreads / kTileRows > 2 ? kThreads / kTileRows : 2;
  static constexpr int kRowsAPass = kThreads / kPerRow, kPasses = kTileRows / kRowsAPass;
  static_assert(kThreads % kPerRow == 0 && kTileRows % kRowsAPass == 0 && kRowsAPass % 8 == 0 && 8 % kPerRow == 0,
                "whole rows a pass, a thread's rows in one swizzle phase");
  __device__ static int row(int t, int pass) { return t / kPerRow + kRowsAPass * pass; }
};

// Rows gathered into a tile of kTileRows rows laid out as TMA writes it
// (boxes of 64 features, 128-byte swizzled rows: what a wgmma descriptor
// reads): tile row r gets the row at row_of(pass, r) (nullptr: none), by
// kThreads threads with 16-byte cp.async; zeros past the head dim and where
// there is no row. Thread t copies chunks t % kPerRow + kPerRow i of its rows
// (GatheredRows): the threads of a row read adjacent chunks, a thread's chunks
// lie at constant offsets from its row's address, and since kPerRow divides 8
// chunk c = a + q (a = kPerRow i, q = t % kPerRow) of row r lands in chunk
// (c % 8) ^ (r % 8) = (a % 8) ^ (q ^ r % 8): one xor with a constant a chunk.
// The caller commits or tracks the copies.
template <int kThreads, int kTileRows, int kHeadDim, class Element, class RowOf>
__device__ __forceinline__ void gather_rows_sw128(int t, const RowOf& row_of, Element* dst, int head_dim) {
  using Rows = GatheredRows<kThreads, kTileRows>;
  constexpr int kPerRow = Rows::kPerRow, kChunks = kHeadDim / 8;
  static_assert(kChunks % kPerRow == 0, "whole chunks a thread");
  const int q = t % kPerRow;
  const auto tile = static_cast<unsigned>(__cvta_generic_to_shared(dst));
#pragma unroll
  for (int pass = 0; pass < Rows::kPasses; ++pass) {
    const int r = Rows::row(t, pass);
    const Element* row = row_of(pass, r);
    const int chunks = row != nullptr ? head_dim / 8 - q : 0;  // chunks a + q < head_dim / 8 are copied
    const Element* src = row != nullptr ? row + 8 * q : row;
    const unsigned at = tile + 128u * r + 16u * (q ^ (r % 8));
#pragma unroll
    for (int i = 0; i < kChunks / kPerRow; ++i) {
      const int a = kPerRow * i;
      const unsigned to = (at + a / 8 * (kTileRows * 128u)) ^ (16u * (a % 8));
      if (a < chunks) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(src + 8 * a));
      } else {
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(to), "r"(0));
      }
    }
  }
}

// Adds `bytes` (a multiple of 16) of float32 from shared memory at `from` into
// global memory at `to` (both 16-byte aligned) as one bulk reduction of the
// calling thread's current bulk group.
__device__ __forceinline__ void bulk_reduce_add(float* to, const float* from, int bytes) {
  const auto smem = static_cast<unsigned>(__cvta_generic_to_shared(from));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(to), "r"(smem),
               "r"(bytes)
               : "memory");
}

// Waits until the calling thread's bulk groups but the kPending most recent
// are complete, their writes to global memory performed and visible to it
// (tma_store_wait waits only until they have read their shared memory).
template <int kPending>
__device__ __forceinline__ void bulk_wait_complete() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Generic-proxy accesses of global memory ordered with the async proxy's
// (bulk copies and reductions) that follow, and the other way round.
__device__ __forceinline__ void fence_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

// A turn counter in global memory orders additions of several CTAs into one
// place (gpu scope). wait_turn: spins until the counter reads `value`
// (acquire); the caller then issues fence_async_global before its bulk
// additions. pass_turn: after bulk_wait_complete, the calling thread's bulk
// writes and its other memory operations before the counter's new `value`
// (the proxy fence, then a release: fence and relaxed store).
__device__ __forceinline__ void wait_turn(const int* turn, int value) {
  int seen = 0;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(turn) : "memory");
  } while (seen != value);
}
__device__ __forceinline__ void pass_turn(int* turn, int value) {
  fence_async_global();
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
  asm volatile("st.relaxed.gpu.global.b32 [%0], %1;\n" ::"l"(turn), "r"(value) : "memory");
}

// The driver's cuTensorMapEncodeTiled (looked up once, not linked), or null
// where the driver has none.
inline decltype(&cuTensorMapEncodeTiled) tensor_map_encoder() {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<decltype(&cuTensorMapEncodeTiled)>(fn);
  }();
  return encode;
}

// Whether TMA can address a token operand of 2-byte elements as (feature, row,
// head, batch) of tokens.rows x `heads` x tokens.batch (geometry.h
// TokenExtent): contiguous features, a 16-byte aligned base, and the strides
// of the row, head and batch dimensions of more than one element whole 16
// bytes below 2^40 (extents from 1 to 2^32: no map of an empty operand).
inline bool tma_addressable(const Operand& t, TokenExtent tokens, std::int64_t heads) {
  const std::int64_t extent[3] = {tokens.rows, heads, tokens.batch}, stride[3] = {t.sr, t.sh, t.sb};
  for (int i = 0; i < 3; ++i) {
    const std::int64_t bytes = 2 * stride[i];
    if (extent[i] < 1 || extent[i] > (std::int64_t{1} << 32)) return false;
    if (extent[i] != 1 && (bytes <= 0 || bytes % 16 != 0 || bytes >= (std::int64_t{1} << 40))) return false;
  }
  return t.sc == 1 && reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0;
}

// The TMA descriptor of a token operand of Element (bf16 or fp16) as
// (feature, row, head, batch) of `features` x tokens.rows x `heads` x
// tokens.batch, boxes of 64 features (128 bytes, swizzled as GMMA's 128-byte
// K-major atoms) x `box_rows` rows, where tma_addressable holds; throws naming
// the operand where the driver refuses it. A kernel's tiles hold kFeatures >=
// features: TMA fills the features past the operand's (a head dim padded to
// the instantiation's) with zeros, as it does rows past tokens.rows.
template <class Element, int kFeatures>
CUtensorMap encode_token_map(const Operand& t, int features, TokenExtent tokens, int heads, int box_rows,
                             const char* name) {
  static_assert(sizeof(Element) == 2 && kFeatures % 64 == 0, "2-byte elements, whole boxes of 64 features");
  const std::int64_t extent[3] = {tokens.rows, heads, tokens.batch}, stride[3] = {t.sr, t.sh, t.sb};
  cuuint64_t dims[4] = {static_cast<cuuint64_t>(features), 0, 0, 0}, strides[3] = {};
  for (int i = 0; i < 3; ++i) {
    const std::int64_t bytes = extent[i] == 1 ? 16 : 2 * stride[i];  // a stride of one row, head or batch is unused
    dims[i + 1] = static_cast<cuuint64_t>(extent[i]), strides[i] = static_cast<cuuint64_t>(bytes);
  }
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1}, step[4] = {1, 1, 1, 1};
  constexpr auto kType = std::is_same_v<Element, cutlass::bfloat16_t> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                      : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  CUtensorMap map;
  const auto encode = tensor_map_encoder();
  const CUresult result =
      encode == nullptr ? CUDA_ERROR_NOT_SUPPORTED
                        : encode(&map, kType, 4, t.data, dims, strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS)
    throw std::runtime_error(std::string("dmattn: CUDA: cuTensorMapEncodeTiled (") + name + "): error " +
                             std::to_string(static_cast<int>(result)));
  return map;
}

// ldmatrix of four 8 x 8 matrices of 16-bit elements (stmatrix: transposed):
// lanes 8 i .. 8 i + 7 give the shared-memory addresses of matrix i's rows,
// register i holds the thread's two elements of matrix i: thread t's of row t
// / 4, columns 2 (t % 4) and + 1; kTrans: of column t / 4, rows 2 (t % 4) and
// + 1 (the accumulator's layout of the matrix or of its transpose); the first
// in the low half.
template <bool kTrans>
__device__ __forceinline__ void ldsm_x4(unsigned addr, std::uint32_t (&r)[4]) {
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void stsm_x4_trans(unsigned addr, const std::uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// A full bias as TMA addresses the Hopper kernels' bias tiles: (key, row,
// head, batch) of seqlen_k x seqlen_q x its heads x its batch entries of
// `batch`, one head or batch entry where it broadcasts (stride 0: the
// kernels' coordinate 0, bias_tile_coords). (dbias: bwd/config.cuh.)
struct BiasTileExtent {
  TokenExtent tokens;
  std::int64_t heads;
};
template <class Params>
BiasTileExtent bias_tile_extent(const Params& p, std::int64_t batch) {
  return {{p.bias.sb == 0 ? 1 : batch, p.seqlen_q}, p.bias.sh == 0 ? 1 : p.heads / p.bias_group};
}
// Whether the Hopper kernels can load the bias by tiles: a full bias of q's
// dtype, batched, contiguous keys, rows TMA can address.
template <class Params>
bool bias_tiles_apply(const Params& p, std::int64_t batch) {
  const BiasTileExtent extent = bias_tile_extent(p, batch);
  return p.bias_kind() == BiasKind::kFull && !p.bias_float32 && p.cu_seqlens_q == nullptr &&
         tma_addressable(p.bias, extent.tokens, extent.heads);
}
// The TMA descriptor of t (the bias, or dbias) of `keys` keys and `extent`
// as bias tiles: boxes of 64 keys x box_rows rows, swizzled as a token
// operand's.
template <class Element>
CUtensorMap encode_bias_map(const Operand& t, std::int64_t keys, const BiasTileExtent& extent, int box_rows,
                            const char* name) {
  return encode_token_map<Element, 64>(t, static_cast<int>(keys), extent.tokens, static_cast<int>(extent.heads),
                                       box_rows, name);
}
// The bias map's (head, batch) of query head h of batch entry b.
__device__ __forceinline__ int2 bias_tile_coords(const AttentionParams& p, int h, int b) {
  return make_int2(p.bias.sh == 0 ? 0 : h / p.bias_group, p.bias.sb == 0 ? 0 : b);
}
// Issues the TMA copies of the bias tile of rows [row, row + kRows) and keys
// [key, key + kKeys) at `at` (bias_tile_coords) into `tile` (boxes of 64 keys
// one after another), completing on bar (which the caller told the bytes);
// kStore: from `tile` into dbias's map, in the calling thread's bulk group,
// marked evict-first in L2 (no kernel reads dbias back: a full bias's
// fwd+bwd at (1, 8, 8192, 8192) 5.24-5.27 -> 5.18-5.22 ms with the zeros
// streamed too, H100).
template <int kRows, int kKeys, bool kStore = false, class Element>
__device__ __forceinline__ void tma_bias_tile(const CUtensorMap* map, std::uint64_t* bar, Element* tile, int row,
                                              int key, int2 at) {
  constexpr auto kEvictFirst = static_cast<std::uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST);
#pragma unroll
  for (int box = 0; box < kKeys / 64; ++box) {
    if constexpr (kStore)
      asm volatile(
          "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group.L2::cache_hint [%0, {%2, %3, %4, %5}], [%1], %6;" ::"l"(
              reinterpret_cast<std::uint64_t>(map)),
          "r"(cute::cast_smem_ptr_to_uint(tile + box * kRows * 64)), "r"(key + 64 * box), "r"(row), "r"(at.x), "r"(at.y),
          "l"(kEvictFirst)
          : "memory");
    else
      cute::SM90_TMA_LOAD_4D::copy(map, bar, 0, tile + box * kRows * 64, key + 64 * box, row, at.x, at.y);
  }
}

// Issues the TMA copies of rows [row, row + kRows) of head `head` and batch
// `batch` (TokenExtent's coordinates) of encode_token_map maps (boxes of kRows rows): for each (map, dst)
// pair, its tile of kRows x kFeatures into dst (boxes of 64 features one after
// another, as tile_to_shape lays out GMMA's atoms), box by box across the
// pairs (the order ptxas allocates the dk/dv kernel's registers best for),
// completing on the mbarrier bar.
template <int kRows, int kFeatures, class Element, class... More>
__device__ __forceinline__ void tma_load_rows(std::uint64_t* bar, int row, int head, int batch,
                                              std::pair<const CUtensorMap*, Element*> tile, More... more) {
#pragma unroll
  for (int box = 0; box < kFeatures / 64; ++box)
    for (const auto& [map, dst] : {tile, more...})
      cute::SM90_TMA_LOAD_4D::copy(map, bar, 0, dst + box * kRows * 64, 64 * box, row, head, batch);
}

}  // namespace dmattn::cuda
