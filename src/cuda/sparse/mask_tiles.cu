// The mask's tile classes (MaskTiles) of the dk/dv walks and the Hopper
// forward: empty tiles are skipped, loads included, and full ones need no mask
// work; for the Hopper kernels, in the same pass, the mask's bits (MaskBits).
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../common/check.h"
#include "key_lists.h"

namespace dmattn::cuda {
namespace {

// Threads of a classifying CTA: 32 x 32, one mask element each of a 32 x 32
// square of the tile at a time.
constexpr int kClassifyThreads = 1024;

// The bits a pass writes: none, by query row (the forward's) or by key (the
// dk/dv walk's).
enum class Packing { kNone, kByRow, kByKey };

// Block (n, m, z) classifies the mask tile of key block n and query block m
// (m = 0 when the mask is broadcast over rows) of mask batch and head z as
// empty (no key allowed), full (every in-range key allowed) or partial, and
// writes its bits. Reads clamp to the last row and key: the bits past the
// sequences repeat them.
template <int kTileM, int kTileN, Packing kPacking>
__global__ void __launch_bounds__(kClassifyThreads)
    mask_tile_pass(const AttentionParams p, MaskTiles tiles, MaskBits bits, std::uint32_t* words, int mask_heads) {
  __shared__ std::uint8_t square[32][33];
  const bool row_broadcast = p.mask.sr == 0, key_broadcast = p.mask.sc == 0;
  const std::int64_t rows = row_broadcast ? 1 : p.seqlen_q, cols = p.seqlen_k;
  const std::int64_t row0 = std::int64_t{blockIdx.y} * kTileM, col0 = std::int64_t{blockIdx.x} * kTileN;
  const int mb = blockIdx.z / mask_heads, mh = blockIdx.z % mask_heads;
  const auto* mask = static_cast<const std::uint8_t*>(p.mask.data) + mb * p.mask.sb + mh * p.mask.sh;
  std::uint32_t* slice = words + mb * bits.sb + mh * bits.sh;
  const int x = threadIdx.x % 32, y = threadIdx.x / 32;
  bool any = false, all = true;
  const int squares_m = row_broadcast ? 1 : kTileM / 32;
  for (int sm = 0; sm < squares_m; ++sm)
#pragma unroll
    for (int sn = 0; sn < kTileN / 32; ++sn) {
      const std::int64_t r0 = row0 + 32 * sm, c0 = col0 + 32 * sn, i = r0 + y, j = c0 + x;
      const bool allowed = mask[min(i, rows - 1) * p.mask.sr + min(j, cols - 1) * p.mask.sc] != 0;
      const bool in = i < rows && j < cols;
      any |= in && allowed, all &= !in || allowed;
      if constexpr (kPacking == Packing::kByRow) {  // warp y: row i, its 32 keys from c0
        const std::uint32_t word = __ballot_sync(0xffffffff, allowed);
        if (x == 0 && (!row_broadcast || i == 0) && (!key_broadcast || c0 == 0))
          slice[i * bits.so + c0 / 32 * bits.si] = word;
      } else if constexpr (kPacking == Packing::kByKey) {  // warp y: key c0 + y, its 32 rows from r0
        square[y][x] = allowed;
        __syncthreads();
        const std::uint32_t word = __ballot_sync(0xffffffff, square[x][y] != 0);
        if (x == 0 && (!key_broadcast || c0 + y == 0) && (!row_broadcast || r0 == 0))
          slice[(c0 + y) * bits.so + r0 / 32 * bits.si] = word;
        __syncthreads();
      }
    }
  any = __syncthreads_or(any), all = __syncthreads_and(all);
  if (threadIdx.x == 0)
    tiles.data[mb * tiles.sb + mh * tiles.sh + blockIdx.y * tiles.sm + blockIdx.x] =
        !any ? kTileEmpty : (all ? kTileFull : kTilePartial);
}

// The pass of one tiling (kTileM query rows x kTileN keys): the classes, then
// the bits, in stream-ordered memory the caller frees.
template <int kTileM, int kTileN, Packing kPacking>
MaskTiles classify(const AttentionParams& p, int batch, int heads, cudaStream_t stream, std::uint8_t** memory,
                   MaskBits* bits) {
  const bool row_broadcast = p.mask.sr == 0, key_broadcast = p.mask.sc == 0;
  const std::int64_t tiles_m = row_broadcast ? 1 : (p.seqlen_q + kTileM - 1) / kTileM;
  const std::int64_t tiles_n = (p.seqlen_k + kTileN - 1) / kTileN;
  const int mask_heads = heads / p.mask_group, mask_batches = p.mask.sb == 0 ? 1 : batch;
  MaskTiles tiles;
  tiles.sm = tiles_m == 1 ? 0 : tiles_n;
  tiles.sh = tiles_m * tiles_n;
  tiles.sb = mask_batches == 1 ? 0 : mask_heads * tiles.sh;
  const std::int64_t slices = std::int64_t{mask_batches} * mask_heads;
  const std::int64_t class_bytes = (slices * tiles.sh + 15) / 16 * 16;
  // Bits: outer indices x words, both padded to whole tiles (no reads past them).
  MaskBits packed;
  if constexpr (kPacking != Packing::kNone) {
    const bool by_row = kPacking == Packing::kByRow;
    const bool outer_broadcast = by_row ? row_broadcast : key_broadcast;
    const bool inner_broadcast = by_row ? key_broadcast : row_broadcast;
    const std::int64_t outer = outer_broadcast ? 1 : by_row ? tiles_m * kTileM : tiles_n * kTileN;
    const std::int64_t inner_words = inner_broadcast ? 1 : by_row ? tiles_n * kTileN / 32 : tiles_m * kTileM / 32;
    packed.so = outer_broadcast ? 0 : inner_words;
    packed.si = inner_broadcast ? 0 : 1;
    packed.sh = outer * inner_words;
    packed.sb = mask_batches == 1 ? 0 : mask_heads * packed.sh;
  }
  const std::int64_t bytes = class_bytes + slices * packed.sh * 4;
  check_cuda(cudaMallocAsync(reinterpret_cast<void**>(memory), static_cast<std::size_t>(bytes), stream),
             "cudaMallocAsync (mask tile classes)");
  tiles.data = *memory;
  auto* words = reinterpret_cast<std::uint32_t*>(*memory + class_bytes);
  const dim3 grid(static_cast<unsigned>(tiles_n), static_cast<unsigned>(tiles_m), static_cast<unsigned>(slices));
  mask_tile_pass<kTileM, kTileN, kPacking><<<grid, kClassifyThreads, 0, stream>>>(p, tiles, packed, words, mask_heads);
  if (bits != nullptr) *bits = packed, bits->words = words;
  return tiles;
}

}  // namespace

MaskTiles classify_mask_tiles(const AttentionParams& params, int block_m, int block_n, int batch, int heads,
                              cudaStream_t stream, std::uint8_t** memory) {
  constexpr Packing kNone = Packing::kNone;
  if (block_m == 32 && block_n == 128) return classify<32, 128, kNone>(params, batch, heads, stream, memory, nullptr);
  if (block_m == 32 && block_n == 64) return classify<32, 64, kNone>(params, batch, heads, stream, memory, nullptr);
  if (block_m == 64 && block_n == 128) return classify<64, 128, kNone>(params, batch, heads, stream, memory, nullptr);
  throw std::logic_error("dmattn: no mask tile classes of " + std::to_string(block_m) + " x " + std::to_string(block_n));
}

MaskTiles pack_mask(const AttentionParams& params, int block_m, int block_n, bool by_key, int batch, int heads,
                    cudaStream_t stream, std::uint8_t** memory, MaskBits& bits) {
  constexpr Packing kByRow = Packing::kByRow, kByKey = Packing::kByKey;
  if (!by_key && block_m == 128 && block_n == 128)
    return classify<128, 128, kByRow>(params, batch, heads, stream, memory, &bits);
  if (!by_key && block_m == 128 && block_n == 64)
    return classify<128, 64, kByRow>(params, batch, heads, stream, memory, &bits);
  if (by_key && block_m == 64 && block_n == 128)
    return classify<64, 128, kByKey>(params, batch, heads, stream, memory, &bits);
  if (by_key && block_m == 128 && block_n == 128)
    return classify<128, 128, kByKey>(params, batch, heads, stream, memory, &bits);
  throw std::logic_error("dmattn: no packed mask of " + std::to_string(block_m) + " x " + std::to_string(block_n) +
                         (by_key ? " by key" : " by row"));
}

}  // namespace dmattn::cuda
