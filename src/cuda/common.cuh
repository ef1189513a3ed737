// Device helpers shared by the CUDA forward and backward kernels: tile loads,
// tile-local limits, exp2, quad reductions, the mask tile-class pre-pass, the
// shared-memory GEMM loop, the accumulator-to-operand conversion and the CUDA
// error check.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "forward.h"

namespace dmattn::cuda {

// Copies `rows` valid rows (row stride `stride` elements, `cols` valid features)
// of a tile into shared memory; the rest of the tile is zero-filled so that
// padded rows and features add nothing. cp.async where 16-byte aligned.
template <class Config, class SmemTensor>
__device__ void load_tile(SmemTensor& s, const typename Config::Element* g, std::int64_t stride, std::int64_t rows,
                          int cols, bool vector) {
  using Element = typename Config::Element;
  constexpr int kChunks = Config::kHeadDim / 8;  // 8 elements = 16 bytes
  constexpr int kRows = decltype(cute::size<0>(s))::value;
#pragma unroll
  for (int it = 0; it < (kRows * kChunks + Config::kThreads - 1) / Config::kThreads; ++it) {
    const int c = it * Config::kThreads + threadIdx.x;
    if (kRows * kChunks % Config::kThreads != 0 && c >= kRows * kChunks) break;
    const int r = c / kChunks, col = c % kChunks * 8;
    Element* dst = &s(r, col);
    if (r < rows && col < cols) {
      const Element* src = g + r * stride + col;
      if (vector) {
        const auto smem = static_cast<unsigned>(__cvta_generic_to_shared(dst));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(src));
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[e] = src[e];
      }
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
  }
  cute::cp_async_fence();
}

// Tile-local limits are clamped to +-kTileFar, far outside any tile, so that
// 64-bit sequence arithmetic becomes 32-bit comparisons inside the tile.
constexpr int kTileFar = 1 << 20;
__device__ inline int clamp_to_tile(std::int64_t x) {
  return static_cast<int>(x < -kTileFar ? -kTileFar : (x > kTileFar ? kTileFar : x));
}

// 2^x on the special-function unit alone; results below the normal range flush
// to 0, far below anything that changes a float32 softmax sum.
__device__ inline float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ inline float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ inline float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// The mask pre-pass: block (n, m, z) classifies the mask tile of key block n and
// query block m (m = 0 when the mask is broadcast over rows) of mask batch and
// head z as empty (no key allowed: the forward skips it, loads included), full
// (every in-range key allowed: no mask work) or partial.
template <int kBlockM, int kBlockN, int kThreads>
__global__ void __launch_bounds__(kThreads) classify_mask_tiles(const ForwardParams p, int mask_heads) {
  const std::int64_t row0 = std::int64_t{blockIdx.y} * kBlockM, col0 = std::int64_t{blockIdx.x} * kBlockN;
  const int rows = p.mask.sr == 0 ? 1 : static_cast<int>(min(std::int64_t{kBlockM}, p.seqlen_q - row0));
  const int cols = static_cast<int>(min(std::int64_t{kBlockN}, p.seqlen_k - col0));
  const int mb = blockIdx.z / mask_heads, mh = blockIdx.z % mask_heads;
  const auto* mask = static_cast<const std::uint8_t*>(p.mask.data) + mb * p.mask.sb + mh * p.mask.sh +
                     row0 * p.mask.sr + col0 * p.mask.sc;
  bool any = false, all = true;
  for (int e = threadIdx.x; e < rows * cols; e += kThreads) {
    const bool allowed = mask[(e / cols) * p.mask.sr + (e % cols) * p.mask.sc] != 0;
    any |= allowed, all &= allowed;
  }
  any = __syncthreads_or(any), all = __syncthreads_and(all);
  if (threadIdx.x == 0)
    p.mask_tiles[mb * p.tiles_sb + mh * p.tiles_sh + blockIdx.y * p.tiles_sm + blockIdx.x] =
        !any ? kTileEmpty : (all ? kTileFull : kTilePartial);
}

// acc += A B^T over the K mode, A and B read from shared memory by ldmatrix
// (the next k-slice loads while the current one multiplies).
template <class Mma, class Acc, class CopyA, class SA, class RA, class RAv, class CopyB, class SB, class RB, class RBv>
__device__ __forceinline__ void gemm_ss(Mma& mma, Acc& acc, const CopyA& copy_a, const SA& sA, RA& rA, RAv& rAv,
                                        const CopyB& copy_b, const SB& sB, RB& rB, RBv& rBv) {
  using namespace cute;
  copy(copy_a, sA(_, _, 0), rAv(_, _, 0));
  copy(copy_b, sB(_, _, 0), rBv(_, _, 0));
#pragma unroll
  for (int kk = 0; kk < size<2>(rA); ++kk) {
    if (kk + 1 < size<2>(rA)) {
      copy(copy_a, sA(_, _, kk + 1), rAv(_, _, kk + 1));
      copy(copy_b, sB(_, _, kk + 1), rBv(_, _, kk + 1));
    }
    gemm(mma, rA(_, _, kk), rB(_, _, kk), acc);
  }
}

// An accumulator tile (MMA C layout, float) rounded to Element in the A-operand
// register layout of the next MMA: C tiles 2k and 2k + 1 along N form the 16
// columns of k-step k.
template <class Element, class Accumulator>
__device__ auto to_a_operand(const Accumulator& acc) {
  using namespace cute;
  constexpr int kS = decltype(size(acc))::value;
  constexpr int kM = decltype(size<1>(acc))::value, kN = decltype(size<2>(acc))::value;
  const auto layout = make_layout(make_shape(make_shape(_2{}, _2{}, _2{}), Int<kM>{}, Int<kN / 2>{}),
                                  make_stride(make_stride(_1{}, _2{}, Int<4 * kM>{}), _4{}, Int<8 * kM>{}));
  Tensor a = make_tensor<Element>(layout);
  *reinterpret_cast<cutlass::Array<Element, kS>*>(raw_pointer_cast(a.data())) =
      cutlass::NumericArrayConverter<Element, float, kS>{}(*reinterpret_cast<const cutlass::Array<float, kS>*>(
          raw_pointer_cast(acc.data())));
  return a;
}

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("dmattn: CUDA: ") + what + ": " + cudaGetErrorString(err));
}


}  // namespace dmattn::cuda
