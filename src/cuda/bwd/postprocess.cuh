// The backward's last pass of a head dim: dq from the float32 sums of dq by
// atomics (the dbias reduction and the zeros of unselected keys, compiled
// once: bwd/finish.cu).
#pragma once

#include <cstdint>

#include "../common/element.cuh"
#include "../common/geometry.h"
#include "../params.h"
#include "config.cuh"

namespace dmattn::cuda {

// dq by atomics: dq = scale * dq_acc in the dtype, for the rows of each
// sequence, eight features of a row a thread, one 16-byte store where dq's
// strides allow: blockIdx.y walks the (batch, head) pairs, x the head's octets
// (no 64-bit division an element). Rows of kHeadDim floats: an octet is two
// consecutive float4. DqBlocks: a warp reads 64 quads, two a lane (features
// 8 j .. 8 j + 7 and the next eight of its row group, j even, for rows r and
// r + 8), and the four lanes of a row trade pairs so that each holds eight
// features of one row: the lanes of a row write 32 contiguous bytes of it.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(256) finish_dq(const BackwardParams p, int batch) {
  using Blocks = DqBlocks<kHeadDim>;
  constexpr int kOctets = kHeadDim / 8;
  const std::int64_t rows = p.dq_blocks ? (p.seqlen_q + Blocks::kRows - 1) / Blocks::kRows * Blocks::kRows : p.seqlen_q;
  const std::int64_t head_octets = rows * kOctets;  // DqBlocks: a multiple of 32, whole warps in the loop
  const bool vector = runs_aligned(p.dq.data, p.dq.sb, p.dq.sh, p.dq.sr, 8);
  const bool pairs = pairs_aligned(p.dq.data, p.dq.sb, p.dq.sh, p.dq.sr);
  const int lane = threadIdx.x % 32, k = lane % 4;
  for (std::int64_t bh = blockIdx.y; bh < std::int64_t{batch} * p.heads; bh += gridDim.y) {
    const int h = static_cast<int>(bh % p.heads), b = static_cast<int>(bh / p.heads);
    const Sequence s(p, b);
    const auto* acc = reinterpret_cast<const float4*>(p.dq_acc) + bh * head_octets * 2;
    auto* dq = static_cast<Element*>(p.dq.data) + b * p.dq.sb + h * p.dq.sh + s.qs * p.dq.sr;
    for (std::int64_t at = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; at < head_octets;
         at += std::int64_t{gridDim.x} * blockDim.x) {
      float v[8];
      std::int64_t i = 0;
      int col = 0;
      if (p.dq_blocks) {
        const std::int64_t q = at / 32 * 64 + lane;
        const float4 x = acc[q], y = acc[q + 32];
        // The lane's pairs: (r, features 2 k, 2 k + 1 of octet j), (r + 8, ... j), (r, ... j + 1), (r + 8, ... j + 1).
        const float mine[4][2] = {{x.x, x.y}, {x.z, x.w}, {y.x, y.y}, {y.z, y.w}};
        // Round t: lane k sends its pair for role (k - t) & 3 and takes lane (k + t) & 3's pair for role k.
        float got[4][2];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int send = (k - t) & 3;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float out = send == 0 ? mine[0][e] : send == 1 ? mine[1][e] : send == 2 ? mine[2][e] : mine[3][e];
            got[t][e] = __shfl_sync(0xFFFFFFFFu, out, (lane & ~3) | ((k + t) & 3));
          }
        }
        // Features 2 m, 2 m + 1 of the role's octet came from lane m, in round (m - k) & 3.
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int t = (m - k) & 3;
#pragma unroll
          for (int e = 0; e < 2; ++e) v[2 * m + e] = t == 0 ? got[0][e] : t == 1 ? got[1][e] : t == 2 ? got[2][e] : got[3][e];
        }
        int row = 0, c = 0;
        Blocks::quad(static_cast<int>(q % Blocks::kQuads), &row, &c);
        i = q / Blocks::kQuads * Blocks::kRows + row + 8 * (k & 1);
        col = c - 2 * k + 8 * (k >> 1);
      } else {
        const float4 x = acc[2 * at], y = acc[2 * at + 1];
        const float own[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = own[e];
        i = at / kOctets;
        col = static_cast<int>(at % kOctets) * 8;
      }
      // The head dim is a multiple of 8 on CUDA: an octet is whole or padding.
      if (col >= p.head_dim || i >= s.sq) continue;
      Element* dst = dq + i * p.dq.sr + col;
      if (vector) {
        struct alignas(16) Octet { Element e[8]; } o;
#pragma unroll
        for (int e = 0; e < 8; ++e) o.e[e] = static_cast<Element>(v[e] * p.scale);
        *reinterpret_cast<Octet*>(dst) = o;
      } else {
#pragma unroll
        for (int e = 0; e < 8; e += 2) store_pair(dst + e, v[e] * p.scale, v[e + 1] * p.scale, pairs);
      }
    }
  }
}

}  // namespace dmattn::cuda
