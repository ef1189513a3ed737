// The CUDA backward: what the host side hands to a kernel instantiation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "forward.h"

namespace dmattn::cuda {

// Head dims with a CUDA backward (CMakeLists.txt mirrors this): above 128 the
// warps split the features in two halves of whole 32-feature swizzle atoms
// (192 and 256).
constexpr bool backward_compiled(int head_dim) { return head_dim <= 128 || head_dim % 64 == 0; }

// Where the dbias reduction of an element happens (SPEC 4: dbias sums dl over
// every dimension the bias broadcasts).
enum class BiasGrad : int {
  kNone = 0,
  kPerElement,  // bias has rows and keys: dS tile elements, summed over the heads sharing a bias head
  kPerKey,      // key-only bias (rows broadcast): column sums over the query loop, in registers
};
// (A bias broadcast over keys has an exactly zero gradient, written by the API.)

// Mask tile classes of one tiling: tile (mask batch b, mask head mh, query block
// m, key block n) at b * sb + mh * sh + m * sm + n; sb or sm is 0 where the mask
// broadcasts. Empty: no allowed key; full: every in-range key allowed.
enum : std::uint8_t { kTileEmpty = 0, kTilePartial = 1, kTileFull = 2 };
struct MaskTiles {
  std::uint8_t* data = nullptr;
  std::int64_t sb = 0, sh = 0, sm = 0;
};

// A validated backward Problem reduced to what the kernels read (dout, dq, dk,
// dv like the token operands, dbias like the bias). With a mask or a top-k
// selection the dq walk takes the key lists (KeyLists, rows of kBlockRows).
struct BackwardParams : AttentionParams, KeyLists {
  Operand dout, dq, dk, dv, dbias;
  int heads = 1;
  bool vector_dout = false;

  // Row statistics, float32 scratch, four floats a (b, h, local row) from
  // 4 * ((b * heads + h) * seqlen_q + i): max, inv, delta, 0. p_ij = exp(l_ij -
  // max) * inv (max = lse and inv = 1 unless the dq kernel recomputed them, inv
  // = 0 for a row with no allowed key), and delta = <do_i, o_i>; one 16-byte
  // word a row, so that a block of rows is one bulk copy.
  float* query_stats = nullptr;

  MaskTiles dkv_tiles;  // mask tiles of the dk/dv walk (a mask without top-k, or top-k thresholds)

  // Top-k intervals, dk/dv walk (selection.h KeyGroups): CTA (b, kv head, g)
  // owns the 128 entries of key_order from group_first[z * key_groups + g]
  // (slice z = b * kv heads + kv head; keys -1 past the pieces), or with
  // key_order null the keys [128 g, 128 g + 128), and walks the query rows
  // group_rows of its group; each element is tested against its key's interval
  // within the group's segment (above 128 features a group is two CTAs of 64
  // entries, BackwardConfig::kGroupBlocks). Thresholds: the dk/dv walk is the
  // dense one, each element tested against its row's threshold.
  const std::int32_t* key_order = nullptr;
  const std::int32_t* key_rank = nullptr;    // with key_segments > 1: a piece's rank among its key's pieces
  const std::int32_t* key_pieces = nullptr;  // pieces of key j of slice z at z * seqlen_k + j (sorted)
  const std::int32_t* group_first = nullptr;
  const KeyRows* group_rows = nullptr;
  std::int64_t key_groups = 0, key_segments = 1, segment_rows = 0;
  // Pieces (key_segments > 1): the pieces of a key add their dK, dV (unscaled)
  // and key dbias sums in segment order through the float32 slot of the key
  // (z * seqlen_k + j, 2 kHeadDim + 1 floats) in piece_acc, piece_turn of the
  // key the rank of the next piece; the last piece writes the gradients.
  float* piece_acc = nullptr;
  int* piece_turn = nullptr;
  // Set: the top-k selection and its groups are computed on another stream and
  // ready once this event completes; the stream waits for it after row_stats
  // (the dq memset and row_stats read neither).
  cudaEvent_t selection_ready = nullptr;

  // dbias: dense extents (batch, heads, rows, keys) of the bias before broadcasting
  // (varlen: B, Hb, 1, max_seqlen_k with local keys). Direct (scratch == nullptr):
  // each element receives one value, written in the bias dtype. Otherwise CTA
  // (b, kv head, key block) adds into float32 slice c = cb * contrib_h + ch of
  // `scratch` (cb = b when the bias broadcasts over batches, ch = kv head when
  // over all heads, else 0), and reduce_bias_grad sums the slices in order.
  BiasGrad bias_grad = BiasGrad::kNone;
  std::int64_t db_batch = 1, db_heads = 1, db_rows = 1, db_cols = 1;
  float* scratch = nullptr;
  int contrib_b = 1, contrib_h = 1;

  // dq by atomics (Problem::deterministic false; head dims that are multiples of
  // 64): the dk/dv kernel adds each step's dQ = dS^T K into float32 dq_acc of
  // (b, h, local row, kHeadDim) at ((b * heads + h) * seqlen_q + i) * kHeadDim,
  // the dq kernel only recomputes the row statistics that need it, and finish_dq
  // writes dq = scale * dq_acc. launch_backward sets dq_acc where atomic_dq allows.
  // dq_blocks: dq_acc holds the Hopper dk/dv kernel's blocks instead
  // (backward_kernel.cuh DqBlocks).
  bool atomic_dq = false, dq_blocks = false;
  float* dq_acc = nullptr;
  // With dq_acc: 1 once row_stats finds a row whose statistics the dq kernel
  // recomputes; while 0 the dq kernel and its key lists' pre-passes do nothing.
  int* huge_rows = nullptr;
};

// Launches the backward for `batch` x `heads` on `stream`: row statistics, dq,
// dk/dv/dbias and the dbias reduction, with stream-ordered scratch memory.
// kHeadDim >= head_dim. Throws on CUDA errors.
template <class Element, int kHeadDim>
void launch_backward(const BackwardParams& params, int batch, cudaStream_t stream);

}  // namespace dmattn::cuda
