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

// One warp per (b, h, query row): delta = <do, o> in float32, and the row
// statistics from lse (max = lse, inv = 1; 0 and 0 for a row with no
// allowed key, lse = -inf); sets *huge_rows where |lse| exceeds kLseExact.
template <class Element>
__global__ void __launch_bounds__(256) row_stats(const BackwardParams p, int batch) {
  const std::int64_t row = std::int64_t{blockIdx.x} * 8 + threadIdx.x / 32;  // (b * H + h) * seqlen_q + i
  if (row >= std::int64_t{batch} * p.heads * p.seqlen_q) return;
  const std::int64_t i = row % p.seqlen_q;
  const int h = static_cast<int>(row / p.seqlen_q % p.heads), b = static_cast<int>(row / p.seqlen_q / p.heads);
  const Sequence s(p, b);
  if (i >= s.sq) return;
  const int lane = threadIdx.x % 32;
  const auto* o = static_cast<const Element*>(p.out.data) + b * p.out.sb + h * p.out.sh + (s.qs + i) * p.out.sr;
  const auto* dout = static_cast<const Element*>(p.dout.data) + b * p.dout.sb + h * p.dout.sh + (s.qs + i) * p.dout.sr;
  float dot = 0.0f;
  for (int col = lane; col < p.head_dim; col += 32) dot += static_cast<float>(o[col]) * static_cast<float>(dout[col]);
#pragma unroll
  for (int m = 16; m > 0; m /= 2) dot += __shfl_xor_sync(0xffffffff, dot, m);
  if (lane != 0) return;
  const float lse = static_cast<const float*>(p.lse.data)[b * p.lse.sb + h * p.lse.sh + (s.qs + i) * p.lse.sr];
  const bool empty = lse == -INFINITY;
  reinterpret_cast<float4*>(p.query_stats)[row] = make_float4(empty ? 0.0f : lse, empty ? 0.0f : 1.0f, dot, 0.0f);
  if (p.huge_rows != nullptr && !empty && fabsf(lse) > kLseExact) *p.huge_rows = 1;
}

}  // namespace dmattn::cuda
