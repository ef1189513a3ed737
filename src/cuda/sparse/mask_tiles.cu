// The mask's tile classes (MaskTiles) of the dk/dv walks and the Hopper
// forward: empty tiles are skipped, loads included, and full ones need no mask
// work; for the Hopper kernels, in the same pass, the mask's bits (MaskBits).
// Tiles outside the causal / window band are empty without a read.
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

// The bits a pass writes: none, by query row (the forward's) or by key (the
// dk/dv walk's).
enum class Packing { kNone, kByRow, kByKey };

// Bit t of the result: byte t of w is not zero (t < 4).
__device__ inline std::uint32_t byte_bits(std::uint32_t w) { return ((__vcmpne4(w, 0) & 0x01010101u) * 0x01020408u) >> 24; }

// Block (n, m, z) (by key: (m, n, z)) classifies the mask tile of key block n
// and query block m (m = 0 when the mask is broadcast over rows) of mask batch
// and head z as
// empty (no key allowed), full (every in-range key allowed) or partial, and
// writes its bits: first the tile's words by row in shared memory (32 keys a
// thread, two 16-byte loads where the mask's keys are consecutive and
// aligned), then those words (by row) or their 32 x 32 transposes (by key, a
// warp's ballots). Bits past the sequences are 0; a dimension the mask
// broadcasts over has one word of 32 equal bits (the inner one) or one
// index (the outer one). By key, the query blocks of a key block are
// consecutive CTAs: a key's words of neighbouring query blocks share 32-byte
// sectors, which L2 then fills from CTAs that run together (with key blocks
// fastest, each sector took its words at different times).
template <int kTileM, int kTileN, Packing kPacking>
__global__ void __launch_bounds__(kClassifyThreads)
    mask_tile_pass(const AttentionParams p, MaskTiles tiles, MaskBits bits, std::uint32_t* words, int mask_heads) {
  constexpr int kWordsN = kTileN / 32;
  __shared__ std::uint32_t tile_bits[kTileM][kWordsN];
  const bool row_broadcast = p.mask.sr == 0, key_broadcast = p.mask.sc == 0;
  const std::int64_t rows = row_broadcast ? 1 : p.seqlen_q, cols = p.seqlen_k;
  constexpr bool kByKey = kPacking == Packing::kByKey;
  const int tile_m = kByKey ? blockIdx.x : blockIdx.y, tile_n = kByKey ? blockIdx.y : blockIdx.x;
  const std::int64_t row0 = std::int64_t{tile_m} * kTileM, col0 = std::int64_t{tile_n} * kTileN;
  const int mb = blockIdx.z / mask_heads, mh = blockIdx.z % mask_heads;
  const auto* mask = static_cast<const std::uint8_t*>(p.mask.data) + element_at(p.mask, mb, mh, 0, 0);
  const int tile_rows = row_broadcast ? 1 : kTileM;
  // A tile outside the causal / window band is never walked: empty, its bits
  // neither read nor written (about half the mask's bytes under causal
  // masking). Batched calls only: varlen sequences have bands of their own.
  if (!row_broadcast && p.cu_seqlens_q == nullptr) {
    const KeyRange seen =
        keys_of_queries(p.band, p.seqlen_k - p.seqlen_q, p.seqlen_k, row0, min(row0 + kTileM, rows) - 1);
    if (seen.end <= col0 || seen.first >= col0 + kTileN) {
      if (threadIdx.x == 0) tiles.data[mb * tiles.sb + mh * tiles.sh + tile_m * tiles.sm + tile_n] = kTileEmpty;
      return;
    }
  }
  bool any = false, all = true;
  for (int item = threadIdx.x; item < tile_rows * kWordsN; item += kClassifyThreads) {
    const int r = item / kWordsN, w = item % kWordsN;
    const std::int64_t i = row0 + r, j0 = col0 + 32 * w;
    const int valid = i < rows ? static_cast<int>(max(min(cols - j0, std::int64_t{32}), std::int64_t{0})) : 0;
    std::uint32_t word = 0;
    if (valid > 0) {
      const std::uint8_t* at = mask + i * p.mask.sr + j0 * p.mask.sc;
      if (valid == 32 && p.mask.sc == 1 && reinterpret_cast<std::uintptr_t>(at) % 16 == 0) {
        const uint4 lo = reinterpret_cast<const uint4*>(at)[0], hi = reinterpret_cast<const uint4*>(at)[1];
        const std::uint32_t parts[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int t = 0; t < 8; ++t) word |= byte_bits(parts[t]) << (4 * t);
      } else {
        for (int t = 0; t < valid; ++t) word |= std::uint32_t{at[t * p.mask.sc] != 0} << t;
      }
    }
    const std::uint32_t in = valid == 32 ? ~0u : (1u << valid) - 1;
    any |= (word & in) != 0, all &= (word & in) == in;
    tile_bits[r][w] = word;
  }
  any = __syncthreads_or(any), all = __syncthreads_and(all);  // tile_bits complete
  if (threadIdx.x == 0)
    tiles.data[mb * tiles.sb + mh * tiles.sh + tile_m * tiles.sm + tile_n] =
        !any ? kTileEmpty : (all ? kTileFull : kTilePartial);
  std::uint32_t* slice = words + mb * bits.sb + mh * bits.sh;
  if constexpr (kPacking == Packing::kByRow) {
    for (int item = threadIdx.x; item < tile_rows * kWordsN; item += kClassifyThreads) {
      const int r = item / kWordsN, w = item % kWordsN;
      if (key_broadcast && col0 + 32 * w != 0) continue;
      const std::uint32_t word = tile_bits[r][w];
      slice[(row0 + r) * bits.so + (col0 / 32 + w) * bits.si] = key_broadcast ? 0u - (word & 1) : word;
    }
  } else if constexpr (kByKey) {  // a warp a 32 x 32 square: lane l row 32 bm + l, then key
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int squares = (row_broadcast ? 1 : kTileM / 32) * kWordsN;
    for (int square = warp; square < squares; square += kClassifyThreads / 32) {
      const int bm = square / kWordsN, w = square % kWordsN;
      const std::uint32_t mine = tile_bits[row_broadcast ? 0 : 32 * bm + lane][w];
      std::uint32_t column = 0;
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        const std::uint32_t t = __ballot_sync(0xffffffff, (mine >> k) & 1);
        if (lane == k) column = t;
      }
      if (row_broadcast) column = 0u - ((mine >> lane) & 1);  // row 0's bit of key lane, 32 times
      const std::int64_t key = col0 + 32 * w + lane;
      if (!key_broadcast || key == 0) slice[key * bits.so + (row0 / 32 + bm) * bits.si] = column;
    }
  }
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
  const auto n = static_cast<unsigned>(tiles_n), m = static_cast<unsigned>(tiles_m);
  constexpr bool kByKey = kPacking == Packing::kByKey;  // query blocks fastest (mask_tile_pass)
  const dim3 grid(kByKey ? m : n, kByKey ? n : m, static_cast<unsigned>(slices));
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
