// The backward's passes of bwd/finish.h: grid-stride loops over elements or
// keys, the dtype of dbias, dk and dv read at run time.
#include "finish.h"

#include <algorithm>
#include <cstdint>

#include "../common/element.cuh"
#include "../common/geometry.h"

namespace dmattn::cuda {
namespace {

// Element e of the dense dbias is the sum over slices s of
// scratch[s * elements + e] in order of s, rounded once (no slices: 0).
__global__ void __launch_bounds__(256) bias_grad_slices(const BackwardParams p, int slices) {
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
    store_rounded(p.dbias.data, p.dbias.dtype,
                  bb * p.dbias.sb + hb * p.dbias.sh + i * p.dbias.sr + (ks + j) * p.dbias.sc, x);
  }
}

// A warp a key (b, kv head, j), the columns over its lanes (the key's test and
// index arithmetic once, not per element).
__global__ void __launch_bounds__(256) unselected_zeros(const BackwardParams p, int batch) {
  const int kv_heads = p.heads / p.group, lane = threadIdx.x % 32;
  const std::int64_t keys = std::int64_t{batch} * kv_heads * p.seqlen_k;
  for (std::int64_t key = (std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; key < keys;
       key += std::int64_t{gridDim.x} * blockDim.x / 32) {
    if (p.key_pieces[key] != 0) continue;
    const std::int64_t j = key % p.seqlen_k, slice = key / p.seqlen_k;
    const int b = static_cast<int>(slice / kv_heads), kvh = static_cast<int>(slice % kv_heads);
    const Sequence s(p, b);
    if (j >= s.sk) continue;
    const std::int64_t dk = b * p.dk.sb + kvh * p.dk.sh + (s.ks + j) * p.dk.sr;
    const std::int64_t dv = b * p.dv.sb + kvh * p.dv.sh + (s.ks + j) * p.dv.sr;
    for (int col = lane; col < p.head_dim; col += 32)
      store_rounded(p.dk.data, p.dk.dtype, dk + col, 0.0f), store_rounded(p.dv.data, p.dv.dtype, dv + col, 0.0f);
  }
}

unsigned grid_for(std::int64_t threads) {
  return static_cast<unsigned>(std::min<std::int64_t>((threads + 255) / 256, 65536));
}

}  // namespace

cudaError_t reduce_bias_grad(const BackwardParams& p, int slices, cudaStream_t stream) {
  const std::int64_t elements = p.db_batch * p.db_heads * p.db_rows * p.db_cols;
  if (elements == 0) return cudaSuccess;
  bias_grad_slices<<<grid_for(elements), 256, 0, stream>>>(p, slices);
  return cudaGetLastError();
}

cudaError_t zero_unselected(const BackwardParams& p, int batch, cudaStream_t stream) {
  const std::int64_t keys = std::int64_t{batch} * (p.heads / p.group) * p.seqlen_k;
  if (keys == 0) return cudaSuccess;
  unselected_zeros<<<grid_for(keys * 32), 256, 0, stream>>>(p, batch);
  return cudaGetLastError();
}

}  // namespace dmattn::cuda
