// Device helpers shared by the CUDA forward and backward kernels: tile loads,
// tile-local limits, exp2, quad reductions, the
// shared-memory GEMM loop, the accumulator-to-operand conversion and the CUDA
// error check.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "forward.h"

namespace dmattn::cuda {

// Calls f(std::integral_constant<int, 0>{}) .. f(std::integral_constant<int, N - 1>{}).
template <class F, int... Is>
__device__ __forceinline__ void static_for(F&& f, std::integer_sequence<int, Is...>) {
  (f(std::integral_constant<int, Is>{}), ...);
}

// Issues the copy of a tile into shared memory: the calling thread's row
// (tile_row<Config, kRows>()) is row `row` of g (row stride `stride` elements,
// `cols` valid features), or zeros for row < 0; the rest of the tile is
// zero-filled so that padded rows and features add nothing. cp.async where
// 16-byte aligned (`vector`), else element by element; the caller commits the
// group. Each thread copies chunks of 16 bytes of one row, neighbouring threads
// neighbouring chunks, at constant offsets from one 64-bit row address (the
// compiler would otherwise keep one 64-bit address a chunk in registers).
template <class Config, int kRows>
__device__ int tile_row() {
  static_assert(Config::kThreads % kRows == 0, "tile rows must divide among the threads");
  return threadIdx.x / (Config::kThreads / kRows);
}

template <class Config, class SmemTensor>
__device__ void load_tile(SmemTensor&& s, const typename Config::Element* g, std::int64_t stride, std::int64_t row,
                          int cols, bool vector) {
  using Element = typename Config::Element;
  constexpr int kChunks = Config::kHeadDim / 8;  // 8 elements = 16 bytes
  constexpr int kRows = decltype(cute::size<0>(s))::value;
  constexpr int kPerRow = Config::kThreads / kRows;  // threads a row
  constexpr int kIters = (kChunks + kPerRow - 1) / kPerRow;
  const int r = tile_row<Config, kRows>(), first = threadIdx.x % kPerRow * 8;
  const bool row_valid = row >= 0;
  const Element* src = g + (row_valid ? row * stride : 0) + first;
  if (vector) {
    static_for(
        [&](auto it) {
          constexpr int kStep = decltype(it)::value * kPerRow * 8;  // elements past `first`
          const int col = first + kStep;
          if (kChunks % kPerRow != 0 && col >= Config::kHeadDim) return;
          Element* dst = &s(r, col);
          if (row_valid && col < cols) {
            const auto smem = static_cast<unsigned>(__cvta_generic_to_shared(dst));
            asm volatile("cp.async.cg.shared.global [%0], [%1+%2], 16;\n" ::"r"(smem), "l"(src),
                         "n"(kStep * int(sizeof(Element))));
          } else {
            *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
          }
        },
        std::make_integer_sequence<int, kIters>{});
    return;
  }
#pragma unroll 1
  for (int it = 0; it < kIters; ++it) {
    const int col = first + it * kPerRow * 8;
    if (col >= Config::kHeadDim) break;
    for (int e = 0; e < 8; ++e) s(r, col + e) = row_valid && col < cols ? src[it * kPerRow * 8 + e] : Element(0);
  }
}

// Loads rows [0, rows) of g into the tile s (zeros past them) with load_tile and
// commits the copies as one cp.async group.
template <class Config, class SmemTensor>
__device__ void load_rows(SmemTensor&& s, const typename Config::Element* g, std::int64_t stride, std::int64_t rows,
                          int cols, bool vector) {
  constexpr int kRows = decltype(cute::size<0>(s))::value;
  const int r = tile_row<Config, kRows>();
  load_tile<Config>(s, g, stride, r < rows ? r : -1, cols, vector);
  cute::cp_async_fence();
}

// Tile-local limits are clamped to +-kTileFar, far outside any tile, so that
// 64-bit sequence arithmetic becomes 32-bit comparisons inside the tile.
constexpr int kTileFar = 1 << 20;
__device__ inline int clamp_to_tile(std::int64_t x) {
  return static_cast<int>(x < -kTileFar ? -kTileFar : (x > kTileFar ? kTileFar : x));
}

// The causal and sliding-window band (SPEC 1; offset = sk - sq, bottom-right
// alignment: query i sees key j iff i + offset - left <= j <= i + offset (+ right)).
// band_covers: every pair of queries [q_first, q_last] and keys [k_first, k_last]
// is inside it. QueryRange: the queries a key block's band reaches. TileBand:
// the band of a tile at query q0 and key k0 in tile-local terms, query q0 + qi
// seeing key k0 + kj iff qi + lo <= kj <= qi + hi.
__device__ inline bool band_covers(const AttentionParams& p, std::int64_t offset, std::int64_t q_first,
                                   std::int64_t q_last, std::int64_t k_first, std::int64_t k_last) {
  return (!p.causal || k_last <= q_first + offset) && (p.window_left < 0 || k_first >= q_last + offset - p.window_left) &&
         (p.window_right < 0 || k_last <= q_first + offset + p.window_right);
}
// The queries [first, end) of [0, sq) that may see a key of [k_first, k_last].
struct QueryRange {
  std::int64_t first, end;
  __device__ QueryRange(const AttentionParams& p, std::int64_t offset, std::int64_t sq, std::int64_t k_first,
                        std::int64_t k_last)
      : first(0), end(sq) {
    if (p.causal) first = max(first, k_first - offset);
    if (p.window_right >= 0) first = max(first, k_first - offset - p.window_right);
    if (p.window_left >= 0) end = min(end, k_last - offset + p.window_left + 1);
  }
};
struct TileBand {
  int lo, hi;
  __device__ TileBand(const AttentionParams& p, std::int64_t offset, std::int64_t q0, std::int64_t k0)
      : lo(p.window_left < 0 ? -kTileFar : clamp_to_tile(q0 + offset - k0 - p.window_left)),
        hi(p.causal ? clamp_to_tile(q0 + offset - k0) : kTileFar) {
    if (p.window_right >= 0) hi = min(hi, clamp_to_tile(q0 + offset - k0 + p.window_right));
  }
};

// Element `at` of a bias or gradient in float32 or Element, as float.
template <class Element>
__device__ inline float load_float(const void* data, bool is_float32, std::int64_t at) {
  return is_float32 ? static_cast<const float*>(data)[at] : static_cast<float>(static_cast<const Element*>(data)[at]);
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

// The forward kernels' online softmax, in log2 units c: a row's max is the
// one of its keys so far, or one at most kStale below it. It moves to the
// tile's max mx (quad-reduced) only when that passes it by more, so that
// P <= 2^kStale and O is rescaled on the first tiles and seldom later (an
// exact max moves on nearly every other tile). Scales the row's sum by the
// correction it returns (1 where the max stays; -inf to -inf: NaN, not moved),
// sets moved where it moved and far where the max lies beyond kNearMax (logits
// up to that size take the one-FFMA exponent).
constexpr float kStale = 8.0f, kNearMax = 256.0f;
__device__ inline float move_row_max(float mx, float c_log2, float& row_max, float& row_sum, bool& moved, bool& far) {
  const bool row_moved = (mx - row_max) * c_log2 > kStale;
  const float correction = row_moved ? exp2_ftz((row_max - mx) * c_log2) : 1.0f;
  row_sum *= correction;
  moved |= row_moved;
  if (row_moved) row_max = mx;
  far |= row_max != -INFINITY && fabsf(row_max) > kNearMax;
  return correction;
}
__device__ inline float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
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
