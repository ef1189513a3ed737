// The backward's first pass: delta = <do, o> and the row statistics of every
// query row from lse.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/geometry.h"
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

}  // namespace dmattn::cuda
