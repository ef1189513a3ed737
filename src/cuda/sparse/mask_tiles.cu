// The mask tile classes of the backward's dk/dv walk (MaskTiles): empty tiles
// are skipped, loads included, and full ones need no mask work.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../common/check.h"
#include "key_lists.h"

namespace dmattn::cuda {
namespace {

// Threads of a classifying CTA.
constexpr int kClassifyThreads = 256;

// The mask pre-pass: block (n, m, z) classifies the mask tile of key block n and
// query block m (m = 0 when the mask is broadcast over rows) of mask batch and
// head z as empty (no key allowed: the walk skips it, loads included), full
// (every in-range key allowed: no mask work) or partial.
template <int kBlockM, int kBlockN, int kThreads>
__global__ void __launch_bounds__(kThreads) mask_tile_classes(const AttentionParams p, MaskTiles tiles, int mask_heads) {
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
    tiles.data[mb * tiles.sb + mh * tiles.sh + blockIdx.y * tiles.sm + blockIdx.x] =
        !any ? kTileEmpty : (all ? kTileFull : kTilePartial);
}

// The mask tile classes of one tiling (kBlockM query rows x kBlockN keys), in
// stream-ordered memory the caller frees.
template <int kBlockM, int kBlockN, int kThreads>
MaskTiles classify(const AttentionParams& p, int batch, int heads, cudaStream_t stream, std::uint8_t** memory) {
  const std::int64_t tiles_m = p.mask.sr == 0 ? 1 : (p.seqlen_q + kBlockM - 1) / kBlockM;
  const std::int64_t tiles_n = (p.seqlen_k + kBlockN - 1) / kBlockN;
  const int mask_heads = heads / p.mask_group, mask_batches = p.mask.sb == 0 ? 1 : batch;
  MaskTiles tiles;
  tiles.sm = tiles_m == 1 ? 0 : tiles_n;
  tiles.sh = tiles_m * tiles_n;
  tiles.sb = mask_batches == 1 ? 0 : mask_heads * tiles.sh;
  const std::int64_t bytes = std::int64_t{mask_batches} * mask_heads * tiles.sh;
  check_cuda(cudaMallocAsync(reinterpret_cast<void**>(memory), static_cast<std::size_t>(bytes), stream),
             "cudaMallocAsync (mask tile classes)");
  tiles.data = *memory;
  const dim3 grid(static_cast<unsigned>(tiles_n), static_cast<unsigned>(tiles_m),
                  static_cast<unsigned>(mask_batches * mask_heads));
  mask_tile_classes<kBlockM, kBlockN, kThreads><<<grid, kThreads, 0, stream>>>(p, tiles, mask_heads);
  return tiles;
}

}  // namespace

MaskTiles classify_mask_tiles(const AttentionParams& params, int block_m, int block_n, int batch, int heads,
                              cudaStream_t stream, std::uint8_t** memory) {
  if (block_m == 32 && block_n == 128) return classify<32, 128, kClassifyThreads>(params, batch, heads, stream, memory);
  if (block_m == 32 && block_n == 64) return classify<32, 64, kClassifyThreads>(params, batch, heads, stream, memory);
  if (block_m == 64 && block_n == 128) return classify<64, 128, kClassifyThreads>(params, batch, heads, stream, memory);
  throw std::logic_error("dmattn: no mask tile classes of " + std::to_string(block_m) + " x " + std::to_string(block_n));
}

}  // namespace dmattn::cuda
