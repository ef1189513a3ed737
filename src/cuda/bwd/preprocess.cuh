// The backward's first pass: delta = <do, o> and the row statistics of every
// query row from lse; how the sm80-class walks load a step's statistics; and
// the dq kernel's recomputation of those that lse cannot hold.
#pragma once

#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>

#include <cmath>
#include <cstdint>

#include "../common/geometry.h"
#include "../common/softmax.cuh"
#include "../params.h"

namespace dmattn::cuda {

// Beyond this |lse| a float32 lse = max + log(sum) has lost log(sum) to rounding
// (spacing 2^-11 here): the dq kernel recomputes max and sum of such rows.
constexpr float kLseExact = 4096.0f;

// The lanes of row_stats: kLanes a row (16-byte chunks of 8 elements, the
// head dim's chunks rounded up to a power of two, at most 32), kRows rows a
// warp, 8 warps a block.
template <int kHeadDim>
struct RowStatsLanes {
  static constexpr int kChunks = (kHeadDim + 7) / 8;
  static constexpr int kLanes = kChunks >= 32 ? 32 : kChunks > 8 ? 16 : kChunks > 4 ? 8 : kChunks > 2 ? 4 : kChunks;
  static constexpr int kRows = 32 / kLanes, kBlockRows = 8 * kRows;
  static_assert(kLanes * kRows == 32, "whole rows a warp");
};

// kLanes lanes per (b, h, query row): delta = <do, o> in float32 (16-byte
// loads where BackwardParams::vector_rows), and the row statistics from lse
// (max = lse, inv = 1; 0 and 0 for a row with no allowed key, lse = -inf);
// sets *huge_rows where |lse| exceeds kLseExact. blockIdx.x walks the row
// tiles of a head, y the (batch, head) pairs: one division a pair, not a
// chain of 64-bit ones a row, and each row's lse is loaded with its o and do
// (with the division chain and the lse loaded after the reduction it moved
// 1.75 TB/s, 58% of the H100's copy bandwidth; now 2.4 TB/s at B = 16 x 2048,
// D = 128).
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(256) row_stats(const BackwardParams p, int batch) {
  using Lanes = RowStatsLanes<kHeadDim>;
  const int lane = threadIdx.x % 32, part = lane % Lanes::kLanes;
  const std::int64_t i = std::int64_t{blockIdx.x} * Lanes::kBlockRows + threadIdx.x / Lanes::kLanes;
  for (std::int64_t bh = blockIdx.y; bh < std::int64_t{batch} * p.heads; bh += gridDim.y) {
    const int h = static_cast<int>(bh % p.heads), b = static_cast<int>(bh / p.heads);
    const Sequence s(p, b);
    const bool live = i < s.sq;
    const float lse =
        live && part == 0 ? static_cast<const float*>(p.lse.data)[b * p.lse.sb + h * p.lse.sh + (s.qs + i) * p.lse.sr]
                          : 0.0f;
    float dot = 0.0f;
    if (live) {
      const auto* o = static_cast<const Element*>(p.out.data) + b * p.out.sb + h * p.out.sh + (s.qs + i) * p.out.sr;
      const auto* dout =
          static_cast<const Element*>(p.dout.data) + b * p.dout.sb + h * p.dout.sh + (s.qs + i) * p.dout.sr;
      if (p.vector_rows) {
        for (int col = 8 * part; col < p.head_dim; col += 8 * Lanes::kLanes) {
          const uint4 a = *reinterpret_cast<const uint4*>(o + col), d = *reinterpret_cast<const uint4*>(dout + col);
          const auto* x = reinterpret_cast<const Element*>(&a);
          const auto* y = reinterpret_cast<const Element*>(&d);
#pragma unroll
          for (int e = 0; e < 8; ++e) dot += static_cast<float>(x[e]) * static_cast<float>(y[e]);
        }
      } else {
        for (int col = part; col < p.head_dim; col += Lanes::kLanes)
          dot += static_cast<float>(o[col]) * static_cast<float>(dout[col]);
      }
    }
#pragma unroll
    for (int m = Lanes::kLanes / 2; m > 0; m /= 2) dot += __shfl_xor_sync(0xffffffff, dot, m);
    if (!live || part != 0) continue;
    const bool empty = lse == -INFINITY;
    reinterpret_cast<float4*>(p.query_stats)[bh * p.seqlen_q + i] =
        make_float4(empty ? 0.0f : lse, empty ? 0.0f : 1.0f, dot, 0.0f);
    if (p.huge_rows != nullptr && !empty && fabsf(lse) > kLseExact) *p.huge_rows = 1;
  }
}

// Row statistics of queries [i0, i0 + n) of (b, h) into dst[0 .. 3n): max, inv,
// delta (0 past the sequence's sq rows), by cp.async so that no thread waits
// for them; commits the group.
template <int kThreads>
__device__ void load_row_stats(const BackwardParams& p, float* dst, int b, int h, std::int64_t i0, int n, std::int64_t sq) {
  for (int r = threadIdx.x; r < 3 * n; r += kThreads) {
    const int which = r / n, i = r % n;
    if (i0 + i >= sq) {
      dst[r] = 0.0f;
      continue;
    }
    const float* src = p.query_stats + 4 * ((std::int64_t{b} * p.heads + h) * p.seqlen_q + i0 + i) + which;
    const auto smem_dst = static_cast<unsigned>(__cvta_generic_to_shared(dst + r));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_dst), "l"(src));
  }
  cute::cp_async_fence();
}

// The dq kernel's first pass, for rows whose |lse| float32 cannot hold
// (kLseExact): the online max and sum of the thread's rows (run_max, run_sum:
// 2 kM of them, two a 16-row MMA tile) over a tile of their logits (acc_s,
// the sm80 MMA's C layout: ((c, half), m, nn)), then (store_row_stats) their
// max and 1 / sum into the statistics, global and the CTA's copy (stats:
// kBlockRows maxima, then the inverses), by the thread that holds a row's
// quad-reduced sum (lane % 4 == 0, and with a split the stager).
template <class AccS, int kRows>
__device__ __forceinline__ void add_row_stats(const AccS& acc_s, float (&run_max)[kRows], float (&run_sum)[kRows]) {
  using cute::make_coord;
  constexpr int kM = kRows / 2, kN = decltype(cute::size<2>(acc_s))::value;
#pragma unroll
  for (int m = 0; m < kM; ++m)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 2 * m + half;
      float mx = run_max[r];
#pragma unroll
      for (int nn = 0; nn < kN; ++nn)
#pragma unroll
        for (int c = 0; c < 2; ++c) mx = fmaxf(mx, acc_s(make_coord(c, half), m, nn));
      mx = quad_max(mx);
      const float base = mx == -kInf ? 0.0f : mx;
      float sum = 0.0f;
#pragma unroll
      for (int nn = 0; nn < kN; ++nn)
#pragma unroll
        for (int c = 0; c < 2; ++c) sum += exp2_ftz((acc_s(make_coord(c, half), m, nn) - base) * kLog2e);
      run_sum[r] = run_sum[r] * exp2_ftz((run_max[r] - base) * kLog2e) + sum;
      run_max[r] = mx;
    }
}

template <int kBlockRows, class CoordS, int kRows>
__device__ __forceinline__ void store_row_stats(const BackwardParams& p, const CoordS& cS, const float (&run_max)[kRows],
                                                const float (&run_sum)[kRows], float* stats, int b, int h,
                                                std::int64_t row0, std::int64_t sq, int lane, bool stager) {
  using cute::get;
  using cute::make_coord;
#pragma unroll
  for (int m = 0; m < kRows / 2; ++m)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 2 * m + half, row = get<0>(cS(make_coord(make_coord(0, half), m, 0)));
      const float sum = quad_sum(run_sum[r]);
      if (lane % 4 != 0 || row0 + row >= sq || !stager) continue;
      const std::int64_t at = (std::int64_t{b} * p.heads + h) * p.seqlen_q + row0 + row;
      const float mx = run_max[r] == -kInf ? 0.0f : run_max[r], inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      stats[row] = p.query_stats[4 * at] = mx;
      stats[kBlockRows + row] = p.query_stats[4 * at + 1] = inv;
    }
}

}  // namespace dmattn::cuda
