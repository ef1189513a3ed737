// Split-KV (ForwardParams::num_splits): the merge of the splits' partials,
// compiled once (the output's dtype read at run time).
#include "combine.h"

#include <cmath>
#include <cstdint>

#include "../common/element.cuh"
#include "../common/softmax.cuh"

namespace dmattn::cuda {
namespace {

// Merges the split-KV partials: one warp per (b, h, query row) of the grid
// (B * H * seqlen_q rows). With split s's max m_s and sum z_s, its weight is
// w_s = exp(m_s - top) z_s (top = max_s m_s), o = sum_s w_s o_s / sum_s w_s and
// lse = top + log(sum_s w_s). Lane t holds the weights of splits t, t + 32, ...,
// and the lanes sum four neighbouring columns each over the splits, eight
// splits' loads in flight (a loop over the splits one load at a time is a chain
// of memory latencies that a decode call would wait on).
__global__ void __launch_bounds__(128) merge_splits(const ForwardParams p) {
  const std::int64_t row = std::int64_t{blockIdx.x} * 4 + threadIdx.x / 32;  // (b * H + h) * seqlen_q + i
  const int heads = p.heads;
  const std::int64_t rows = std::int64_t{p.batch} * heads * p.seqlen_q;
  if (row >= rows) return;
  const std::int64_t i = row % p.seqlen_q;
  const int h = static_cast<int>(row / p.seqlen_q % heads), b = static_cast<int>(row / p.seqlen_q / heads);
  const Sequence seq(p, b);
  const std::int64_t qs = seq.qs;
  if (i >= seq.sq) return;  // the warp's row: the whole warp returns
  const int lane = threadIdx.x % 32, d = p.head_dim, splits = p.num_splits;
  auto stat_of = [&](int s) { return s < splits ? p.stat_partial[s * rows + row] : make_float2(-kInf, 0.0f); };
  float top = -kInf;
  for (int s = lane; s < splits; s += 32) top = fmaxf(top, stat_of(s).x);
  for (int w = 16; w >= 1; w /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, w));
  // exp(m_s - top) before the sum: both near the float32 limit (a bias of its lowest) would overflow otherwise.
  auto weight_of = [&](int s) {
    const float2 st = stat_of(s);
    return st.y > 0.0f ? expf(st.x - top) * st.y : 0.0f;
  };
  float sum = 0.0f;
  if (top != -kInf)
    for (int s = lane; s < splits; s += 32) sum += weight_of(s);
  for (int w = 16; w >= 1; w /= 2) sum += __shfl_xor_sync(0xffffffff, sum, w);
  const std::int64_t out = b * p.out.sb + h * p.out.sh + (qs + i) * p.out.sr;
  for (int c0 = 0; c0 < d; c0 += 128) {
    float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s0 = 0; s0 < splits && top != -kInf; s0 += 32) {
      const float weight = weight_of(s0 + lane) / sum;  // 0 past the splits
      const int n = min(32, splits - s0);
#pragma unroll 8
      for (int j = 0; j < n; ++j) {
        const float w = __shfl_sync(0xffffffff, weight, j);
        const float* o_split = p.o_partial + ((s0 + j) * rows + row) * d;
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (c0 + 4 * lane + e < d) o[e] += w * o_split[c0 + 4 * lane + e];
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (c0 + 4 * lane + e < d) store_rounded(p.out.data, p.out.dtype, out + c0 + 4 * lane + e, o[e]);
  }
  if (p.lse.data != nullptr && lane == 0)
    static_cast<float*>(p.lse.data)[b * p.lse.sb + h * p.lse.sh + (qs + i) * p.lse.sr] =
        top == -kInf ? -kInf : top + logf(sum);
}

}  // namespace

cudaError_t combine_splits(const ForwardParams& p, cudaStream_t stream) {
  const std::int64_t rows = std::int64_t{p.batch} * p.heads * p.seqlen_q;
  if (rows == 0) return cudaSuccess;
  merge_splits<<<static_cast<unsigned>((rows + 3) / 4), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dmattn::cuda
