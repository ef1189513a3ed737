// A forward CTA's query block, for the sm80 and the Hopper kernel alike.
#pragma once

#include <cstdint>

#include "../common/geometry.h"
#include "../params.h"

namespace dmattn::cuda {

// A forward CTA's query block: work item `item` of count(), which enumerate
// (query block, split, batch, head), head fastest, and the query blocks in
// reverse: under causal masking the last rows have the most keys, so the
// items start longest first across every head and batch and the grid ends on
// the shortest (fewer idle SMs in its last wave). A CTA takes one item (its
// blockIdx.x of gridDim.x) or, persistent, one a round (the Hopper forward).
// has_mask: the pre-passes listed the block's keys (a mask, a top-k selection
// or both) and the block walks them, block_n a tile, gathered;
// otherwise it walks the keys that any row of it may see. Its key tiles:
// [tile_first, tile_end). Nothing past row0 and sq is set where row0 >= sq.
struct ForwardBlock {
  int h, b, split;
  std::int64_t row0, qs = 0, ks = 0, sq = 0, sk = 0, offset = 0, row_last = 0, mask_block = 0;
  bool has_mask;
  int mask_count = 0, tile_first = 0, tile_end = 0;
  const std::int32_t* mask_keys = nullptr;
  // The items of a launch of block_m-row query blocks: the grid of a CTA a block.
  static DMATTN_HOST_DEVICE int query_blocks(const ForwardParams& p, int block_m) {
    return static_cast<int>((p.seqlen_q + block_m - 1) / block_m);
  }
  static DMATTN_HOST_DEVICE unsigned count(const ForwardParams& p, int block_m) {
    return static_cast<unsigned>(query_blocks(p, block_m)) * p.num_splits * p.batch * p.heads;
  }
  __device__ ForwardBlock(const ForwardParams& p, int block_m, int block_n, unsigned item)
      : h(static_cast<int>(item % p.heads)), has_mask(p.mask_keys != nullptr) {
    const unsigned slice = item / p.heads;
    b = static_cast<int>(slice % p.batch);
    split = static_cast<int>(slice / p.batch % p.num_splits);
    const int blocks_m = query_blocks(p, block_m);
    row0 = std::int64_t{blocks_m - 1 - static_cast<int>(slice / p.batch / p.num_splits)} * block_m;
    const Sequence seq(p, b);
    qs = seq.qs, ks = seq.ks, sq = seq.sq, sk = seq.sk;
    if (row0 >= sq) return;
    offset = seq.offset();
    row_last = min(row0 + block_m, sq) - 1;
    if (has_mask) {
      mask_block = ((p.list_batched ? b : 0) * std::int64_t{p.heads / p.list_group} + h / p.list_group) * p.mask_blocks +
                   row0 / block_m;
      mask_count = p.mask_counts[mask_block];
      mask_keys = p.mask_keys + mask_block * p.keys_stride;
      tile_end = (mask_count + block_n - 1) / block_n;
      return;
    }
    const KeyRange keys = keys_of_queries(p.band, offset, sk, row0, row_last);
    tile_first = static_cast<int>(keys.first / block_n);
    tile_end = keys.end > keys.first ? static_cast<int>((keys.end + block_n - 1) / block_n) : tile_first;
  }
};

// Readings of a block's key list (its tiles of kBlockN positions) loaded apart
// from their use, so that a walk may load them a tile ahead (the Hopper
// forward's producer). ListRun: a tile's first and last keys (first -1: no
// whole tile n); the list ascends, so the tile is a run of consecutive keys
// (start(): its first) iff last - first == kBlockN - 1.
template <int kBlockN>
struct ListRun {
  int first = -1, last = -1;
  __device__ static ListRun of(const ForwardBlock& blk, int n) {
    const int at = n * kBlockN;
    return n >= blk.tile_first && at + kBlockN <= blk.mask_count
               ? ListRun{blk.mask_keys[at], blk.mask_keys[at + kBlockN - 1]}
               : ListRun{};
  }
  __device__ int start() const { return first >= 0 && last - first == kBlockN - 1 ? first : -1; }
};

// Thread t's keys of tile n, those of the rows Rows::row(t, pass) (-1 past the list).
template <int kBlockN, class Rows>
struct HeldKeys {
  int of[Rows::kPasses];
  __device__ static HeldKeys of_tile(const ForwardBlock& blk, int n, int t) {
    HeldKeys keys;
#pragma unroll
    for (int pass = 0; pass < Rows::kPasses; ++pass) {
      const int at = n * kBlockN + Rows::row(t, pass);
      keys.of[pass] = n >= blk.tile_first && at < blk.mask_count ? blk.mask_keys[at] : -1;
    }
    return keys;
  }
};

}  // namespace dmattn::cuda
