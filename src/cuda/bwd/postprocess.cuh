// The backward's last passes: the dbias reduction, the zeros of keys no row
// selects, and dq from the float32 sums of dq by atomics.
#pragma once

#include <cstdint>

#include "../common/element.cuh"
#include "../common/geometry.h"
#include "../params.h"
#include "config.cuh"

namespace dmattn::cuda {

// dbias from the float32 slices: element e of the dense dbias is the sum over
// slices s of scratch[s * elements + e] in order of s, rounded once; without
// slices (scratch == nullptr) dbias is zero-filled.
template <class Element>
__global__ void __launch_bounds__(256) reduce_bias_grad(const BackwardParams p, int slices) {
  const std::int64_t elements = p.db_batch * p.db_heads * p.db_rows * p.db_cols;
  for (std::int64_t e = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < elements;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t j = e % p.db_cols, i = e / p.db_cols % p.db_rows;
    const std::int64_t hb = e / (p.db_cols * p.db_rows) % p.db_heads, bb = e / (p.db_cols * p.db_rows * p.db_heads);
    std::int64_t ks = 0;
    if (p.cu_seqlens_k != nullptr) {  // varlen: a key-only bias, dense keys local to sequence bb
      ks = p.cu_seqlens_k[bb];
      if (j >= p.cu_seqlens_k[bb + 1] - ks) continue;
    }
    float x = 0.0f;
    for (int s = 0; s < slices; ++s) x += p.scratch[s * elements + e];
    store_float<Element>(p.dbias.data, p.bias_float32,
                         bb * p.dbias.sb + hb * p.dbias.sh + i * p.dbias.sr + (ks + j) * p.dbias.sc, x);
  }
}

// Sorted key groups hold only pieces: dk and dv of the keys that no row
// selects are zeros, written here: a warp a key (b, kv head, j), the columns
// over its lanes (the key's test and index arithmetic once, not per element).
template <class Element>
__global__ void __launch_bounds__(256) zero_unselected(const BackwardParams p, int batch) {
  const int kv_heads = p.heads / p.group, lane = threadIdx.x % 32;
  const std::int64_t keys = std::int64_t{batch} * kv_heads * p.seqlen_k;
  for (std::int64_t key = (std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; key < keys;
       key += std::int64_t{gridDim.x} * blockDim.x / 32) {
    if (p.key_pieces[key] != 0) continue;
    const std::int64_t j = key % p.seqlen_k, slice = key / p.seqlen_k;
    const int b = static_cast<int>(slice / kv_heads), kvh = static_cast<int>(slice % kv_heads);
    const Sequence s(p, b);
    if (j >= s.sk) continue;
    auto* dk = static_cast<Element*>(p.dk.data) + b * p.dk.sb + kvh * p.dk.sh + (s.ks + j) * p.dk.sr;
    auto* dv = static_cast<Element*>(p.dv.data) + b * p.dv.sb + kvh * p.dv.sh + (s.ks + j) * p.dv.sr;
    for (int col = lane; col < p.head_dim; col += 32) dk[col] = Element(0.0f), dv[col] = Element(0.0f);
  }
}

// dq by atomics: dq = scale * dq_acc in the dtype, for the rows of each
// sequence, four floats of dq_acc a thread (rows of kHeadDim floats, or
// DqBlocks): blockIdx.y walks the (batch, head) pairs, x the head's quads (no
// 64-bit division an element), each pair of dq one 32-bit store where dq's
// strides allow.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(256) finish_dq(const BackwardParams p, int batch) {
  using Blocks = DqBlocks<kHeadDim>;
  constexpr int kQuads = kHeadDim / 4;
  const std::int64_t rows = p.dq_blocks ? (p.seqlen_q + Blocks::kRows - 1) / Blocks::kRows * Blocks::kRows : p.seqlen_q;
  const std::int64_t head_quads = rows * kQuads;
  const bool aligned = pairs_aligned(p.dq.data, p.dq.sb, p.dq.sh, p.dq.sr);
  for (std::int64_t bh = blockIdx.y; bh < std::int64_t{batch} * p.heads; bh += gridDim.y) {
    const int h = static_cast<int>(bh % p.heads), b = static_cast<int>(bh / p.heads);
    const Sequence s(p, b);
    const auto* acc = reinterpret_cast<const float4*>(p.dq_acc) + bh * head_quads;
    auto* dq = static_cast<Element*>(p.dq.data) + b * p.dq.sb + h * p.dq.sh + s.qs * p.dq.sr;
    for (std::int64_t at = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; at < head_quads;
         at += std::int64_t{gridDim.x} * blockDim.x) {
      // The two pairs of the quad: rows i[half], features col[half] and col[half] + 1.
      std::int64_t i[2];
      int col[2];
      if (p.dq_blocks) {
        int row = 0, c = 0;
        Blocks::quad(static_cast<int>(at % Blocks::kQuads), &row, &c);
        i[0] = at / Blocks::kQuads * Blocks::kRows + row, i[1] = i[0] + 8;
        col[0] = col[1] = c;
      } else {
        i[0] = i[1] = at / kQuads;
        col[0] = static_cast<int>(at % kQuads) * 4, col[1] = col[0] + 2;
      }
      const float4 x = acc[at];
      const float pair[2][2] = {{x.x, x.y}, {x.z, x.w}};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // col is even and the head dim a multiple of 8 on CUDA: a pair is whole or padding.
        if (col[half] >= p.head_dim || i[half] >= s.sq) continue;
        store_pair(dq + i[half] * p.dq.sr + col[half], pair[half][0] * p.scale, pair[half][1] * p.scale, aligned);
      }
    }
  }
}

}  // namespace dmattn::cuda
