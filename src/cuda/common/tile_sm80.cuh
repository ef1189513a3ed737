// The sm80-class tile helpers (mma.sync through CuTe, cp.async, ldmatrix)
// of the forward and backward kernels: a thread's row of a tile load, the
// loads of token tiles into shared memory, the shared-memory GEMM loop and the
// accumulator-to-operand conversion.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace dmattn::cuda {

// Calls f(std::integral_constant<int, 0>{}) .. f(std::integral_constant<int, N - 1>{}).
template <class F, int... Is>
__device__ __forceinline__ void static_for(F&& f, std::integer_sequence<int, Is...>) {
  (f(std::integral_constant<int, Is>{}), ...);
}

// The thread index, read anew where it is called: offsets derived from
// threadIdx.x once are kept live by the compiler across a whole walk (the
// coordinates and ldmatrix addresses of every tile), where registers are short.
__device__ __forceinline__ int thread_index() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  return tid;
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

// acc += A B^T with A already in registers. B spans the whole head dim here, so
// one k-slice of it is live at a time (the other warps hide the ldmatrix latency).
template <class Mma, class Acc, class RA, class CopyB, class SB, class RB, class RBv>
__device__ __forceinline__ void gemm_rs(Mma& mma, Acc& acc, const RA& rA, const CopyB& copy_b, const SB& sB, RB& rB,
                                        RBv& rBv) {
  using namespace cute;
#pragma unroll
  for (int kk = 0; kk < size<2>(rA); ++kk) {
    copy(copy_b, sB(_, _, kk), rBv(_, _, kk));
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

}  // namespace dmattn::cuda
