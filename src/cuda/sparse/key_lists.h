// Key lists of a mask and/or a top-k selection (KeyLists) for the sm80
// forward and the backward's dq walk, and the mask tile classes of the
// backward's dk/dv walk and the Hopper forward (with the mask's bits for the
// Hopper kernels): passes enqueued before those kernels.
#pragma once

#include <cuda_runtime.h>

#include "../params.h"

namespace dmattn::cuda {

// Threads of a key-list pass.
constexpr int kListThreads = 128;

// Enqueues the key-list passes of params' mask and/or top-k selection for
// query blocks of block_m (64 or 128) rows of batch x heads into one scratch
// buffer (params.mask_bits, the caller frees it after the kernels) and sets
// the lists' fields. A mask alone keeps a slice per mask head (one for a mask
// broadcast over batches); top-k a slice per selection head (or per kv head
// with folded query heads).
void build_key_lists(KeyListParams& params, int block_m, int batch, int heads, cudaStream_t stream);

// Enqueues the classes of the block_m x block_n tiles of params' mask (the
// dk/dv kernel's query step x its keys: 32 x 128, 32 x 64 or 64 x 128) for
// batch x heads into stream-ordered memory it allocates (*memory; the caller
// frees it).
MaskTiles classify_mask_tiles(const AttentionParams& params, int block_m, int block_n, int batch, int heads,
                              cudaStream_t stream, std::uint8_t** memory);

// Enqueues the Hopper kernels' one pass over params' mask: the classes of its
// block_m x block_n tiles (the forward's query block x key tile, 128 x 128 or
// 128 x 64, by_key false; the dk/dv walk's query step x keys, 64 x 128 or
// 128 x 128, by_key true) and its bits (MaskBits: by query row for the
// forward, by key for the dk/dv walk), into stream-ordered memory it allocates
// (*memory; the caller frees it).
MaskTiles pack_mask(const AttentionParams& params, int block_m, int block_n, bool by_key, int batch, int heads,
                    cudaStream_t stream, std::uint8_t** memory, MaskBits& bits);

}  // namespace dmattn::cuda
