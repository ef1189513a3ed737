// The kernel parameters: a validated Problem as the CUDA kernels read it (plain
// pointers, 64-bit strides, the launch's geometry). dispatch.cu is the one
// place that fills them from a Problem; the kernels never see the Problem.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../problem.h"
#include "common/geometry.h"
#include "sparse/selection.h"

namespace dmattn::cuda {

// What a bias varies along as a launch reads it (AttentionParams::bias_kind,
// from the launch's strides, a decode's folded rows included): kKeyOnly, one
// value per key shared by every row (row stride 0: a (B, H, 1, Sk) bias);
// kPerRow, one value per row (key stride 0); kFull, both vary.
enum class BiasKind { kNone, kKeyOnly, kPerRow, kFull };

// What the forward and the backward kernels share of a validated Problem. Token
// operands are indexed (b, head, global row, feature); mask and bias (b, operand
// head, global query row, global key); lse (b, head, global query row).
struct AttentionParams {
  Operand q, k, v, out, lse, mask, bias;
  bool bias_float32 = false;
  // Query head h reads kv head h / group, mask head h / mask_group, bias head h / bias_group.
  int group = 1, mask_group = 1, bias_group = 1;
  int head_dim = 0;
  std::int64_t seqlen_q = 0, seqlen_k = 0;  // batched: the lengths; varlen: the max lengths
  const std::int32_t* cu_seqlens_q = nullptr;  // device pointers, varlen only
  const std::int32_t* cu_seqlens_k = nullptr;
  std::int64_t total_q = 0, total_k = 0;  // varlen: the packed rows of q (out, dout) and of k (v)
  float scale = 1.0f, softcap = 0.0f;
  Band band;  // causal and sliding window
  // 16-byte cp.async loads are legal for q, k, v rows (base and strides checked).
  bool vector_q = false, vector_k = false, vector_v = false;
  // Top-k (keep_window_size): the selection of the Problem (selection.h), one
  // of the two arrays set; its `topk_heads` selection heads per batch, query
  // head h reading selection head h / topk_group. Key lists (KeyLists) are then
  // built from it (and the mask, if any) instead of from the mask alone.
  const KeyRows* topk_intervals = nullptr;
  const RowThreshold* topk_thresholds = nullptr;
  int topk_heads = 0, topk_group = 1;
  std::int64_t keep_window_size = 0;
  // Decode with query heads folded into rows (dispatch.cu fold_query_heads):
  // the forward's head h is kv head h, its row i query head h * topk_fold + i
  // at query row 0; the top-k lists then have a slice per (b, kv head). 1: not folded.
  int topk_fold = 1;

  // The TokenExtent of q-like (q, out, dout) and of k-like (k, v) operands of
  // `batch` sequences, and the batch coordinate of sequence b in it.
  DMATTN_HOST_DEVICE TokenExtent query_tokens(std::int64_t batch) const {
    return cu_seqlens_q != nullptr ? TokenExtent{1, total_q} : TokenExtent{batch, seqlen_q};
  }
  DMATTN_HOST_DEVICE TokenExtent key_tokens(std::int64_t batch) const {
    return cu_seqlens_q != nullptr ? TokenExtent{1, total_k} : TokenExtent{batch, seqlen_k};
  }
  DMATTN_HOST_DEVICE int token_batch(int b) const { return cu_seqlens_q != nullptr ? 0 : b; }

  // The bias kind, defined here once for the dispatch and the kernels.
  DMATTN_HOST_DEVICE bool key_only_bias() const { return bias.data != nullptr && bias.sr == 0; }
  DMATTN_HOST_DEVICE BiasKind bias_kind() const {
    if (bias.data == nullptr) return BiasKind::kNone;
    if (key_only_bias()) return BiasKind::kKeyOnly;
    return bias.sc == 0 ? BiasKind::kPerRow : BiasKind::kFull;
  }
};

// Key lists of a mask and/or a top-k selection, for the forward and for the
// backward's dq walk.
struct KeyLists {
  // The allowed pairs (mask and/or top-k), written by the pre-passes of
  // sparse/key_lists.cu build_key_lists, per list slice z = (b if list_batched, else 0)
  // * (H / list_group) + h / list_group and query block m of kBlockM rows: the
  // keys with at least one allowed (row, key) pair in the block (mask, top-k,
  // causal, window and key range together), ascending, local to the sequence,
  // at mask_keys[(z * mask_blocks + m) * keys_stride + t], mask_counts[z *
  // mask_blocks + m] <= keys_stride of them; and for each local query row i,
  // bit t % 32 of word mask_bits[(z * seqlen_q + i) * bits_sr + t / 32] says
  // whether the row may see the block's key t (0 past the count). bits_sr is
  // even, so that the two words of a 64-key tile load as one. The kernels walk
  // these keys, 64 a tile. No lists (mask_keys null): no mask and no top-k.
  std::int32_t* mask_keys = nullptr;
  std::int32_t* mask_counts = nullptr;
  std::uint32_t* mask_bits = nullptr;
  std::int64_t keys_stride = 0, bits_sr = 0;
  int mask_blocks = 0;
  int list_group = 1;
  bool list_batched = true;
  // Query blocks a CTA of the top-k interval lists takes (DMATTN_LIST_BLOCKS,
  // dispatch.h DeviceInfo); 0: build_key_lists picks.
  int list_cta_blocks = 0;
  // Set (device memory): the pre-passes build nothing while *build_if is 0 (the
  // backward's dq by atomics reads lists only for rows it recomputes).
  const int* build_if = nullptr;
};

// What the key-list passes (sparse/key_lists.h) read and write: the attention
// and its lists.
struct KeyListParams : AttentionParams, KeyLists {};

// Mask tile classes of one tiling: tile (mask batch b, mask head mh, query block
// m, key block n) at b * sb + mh * sh + m * sm + n; sb or sm is 0 where the mask
// broadcasts. Empty: no allowed key; full: every in-range key allowed.
enum : std::uint8_t { kTileEmpty = 0, kTilePartial = 1, kTileFull = 2 };
struct MaskTiles {
  std::uint8_t* data = nullptr;
  std::int64_t sb = 0, sh = 0, sm = 0;
};

// A mask packed into bits for the Hopper kernels (sparse/key_lists.h
// pack_mask): bit t % 32 of words[b * sb + mh * sh + o * so + w * si] is the
// mask of mask batch b, mask head mh at outer index o and inner index 32 w + t.
// The forward's outer index is the query row and the inner one the key; the
// dk/dv walk's the key and the query row. so = 0 where the mask broadcasts over
// the outer dimension, si = 0 (one word of 32 equal bits) over the inner one,
// sb = 0 over batches. Bits outside the sequences are unspecified: the kernels
// test the ranges too.
struct MaskBits {
  const std::uint32_t* words = nullptr;
  std::int64_t sb = 0, sh = 0, so = 0, si = 0;
};

// A validated forward Problem reduced to what the kernel reads.
struct ForwardParams : KeyListParams {
  // A key-only bias (row stride 0) of consecutive keys whose tile runs copy as
  // 16-byte chunks: aligned rows, a whole number of chunks a row, no varlen.
  bool vector_bias = false;
  // Split-KV, for grids too small to fill the GPU (decode): split s of a query
  // block takes its s-th share of the key blocks and writes float32 partials,
  // o normalised by its own sum, and that row max (in logit units) and sum, at
  // partial row ((s * B + b) * H + h) * seqlen_q + i (o_partial rows of
  // head_dim, stat_partial a (max, sum) pair a row); a combine kernel merges the
  // splits into out and lse. The max and the sum stay apart: a split's
  // max + log(sum) in float32 loses log(sum) where |max| is huge (a bias of
  // -1e30), which would weigh splits of tied keys alike whatever their counts.
  // num_splits = 1: no split.
  int num_splits = 1;
  float* o_partial = nullptr;
  float2* stat_partial = nullptr;
  // The launch's batches and heads (query heads, or kv heads when decode folds
  // them into rows): the kernel's one-dimensional grid enumerates
  // (query block, split, batch, head), head fastest.
  int batch = 1, heads = 1;
  // The Hopper forward's mask (no key lists): the classes of its query block x
  // key tile tiles (empty ones skipped, full ones untested) and its bits by
  // query row.
  MaskTiles tiles;
  MaskBits packed;
};

// Where the dbias reduction of an element happens (SPEC 4: dbias sums dl over
// every dimension the bias broadcasts).
enum class BiasGrad : int {
  kNone = 0,
  kPerElement,  // bias has rows and keys: dS tile elements, summed over the heads sharing a bias head
  kPerKey,      // key-only bias (rows broadcast): column sums over the query loop, in registers
};
// (A bias broadcast over keys has an exactly zero gradient, written by the API.)

// A validated backward Problem reduced to what the kernels read (dout, dq, dk,
// dv like the token operands, dbias like the bias). With a mask or a top-k
// selection the dq walk takes the key lists (KeyLists, rows of kBlockRows).
struct BackwardParams : KeyListParams {
  Operand dout, dq, dk, dv, dbias;
  int heads = 1;
  bool vector_dout = false;
  // out and dout rows as whole 16-byte chunks (row_stats): both vector_loads
  // and a head dim of whole chunks.
  bool vector_rows = false;

  // Row statistics, float32 scratch, four floats a (b, h, local row) from
  // 4 * ((b * heads + h) * seqlen_q + i): max, inv, delta, 0. p_ij = exp(l_ij -
  // max) * inv (max = lse and inv = 1 unless the dq kernel recomputed them, inv
  // = 0 for a row with no allowed key), and delta = <do_i, o_i>; one 16-byte
  // word a row, so that a block of rows is one bulk copy.
  float* query_stats = nullptr;

  MaskTiles dkv_tiles;  // mask tiles of the dk/dv walk (a mask without top-k, or top-k thresholds)
  MaskBits dkv_packed;  // the Hopper dk/dv walk's mask, by key

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
  std::int64_t segment_entries = 0;      // entries of key_order and key_rank a (slice, segment)
  const int* groups_overflow = nullptr;  // set: a segment had more pieces than its entries (KeyPieces)
  // Pieces (key_segments > 1): the pieces of a key add their dK, dV (unscaled)
  // and key dbias sums in segment order through the float32 slot of the key
  // (z * seqlen_k + j, piece_slot_floats(head dim) floats) in piece_acc, piece_turn of the
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
  // A direct dbias of dense rows that no memset zeroed (the Hopper walk of a
  // bias with rows): each dk/dv CTA writes zeros into the rows of its keys
  // that its walk does not reach (bwd/launch.cuh).
  bool dbias_zeros = false;

  // dq summed by the dk/dv kernel (atomic_dq; head dims that are multiples of
  // 64): it adds each step's dQ = dS^T K into float32 dq_acc of (b, h, local
  // row, kHeadDim) at ((b * heads + h) * seqlen_q + i) * kHeadDim, the dq
  // kernel only recomputes the row statistics that need it, and finish_dq
  // writes dq = scale * dq_acc. The dispatch sets atomic_dq where it applies:
  // by atomics in any order (Problem::deterministic false), or in order on the
  // Hopper dense walk (dq_turns).
  // dq_blocks: dq_acc holds the Hopper dk/dv kernel's blocks instead
  // (bwd/config.cuh DqBlocks): the plan's Hopper dk/dv kernel.
  bool atomic_dq = false, dq_blocks = false;
  float* dq_acc = nullptr;
  // With dq_acc: 1 once row_stats finds a row whose statistics the dq kernel
  // recomputes; while 0 the dq kernel and its key lists' pre-passes do nothing.
  int* huge_rows = nullptr;
  // Ordered dq (deterministic, Hopper dense walk): the turn counter of dq_acc
  // block (b, h, query block) at its block index, zeroed; key block n's dQ
  // writer warp adds the block once the counter reads n where key block n - 1
  // adds to the block too, and sets it to n + 1 (bwd/kernel_sm90.cuh).
  int* dq_turns = nullptr;
};

}  // namespace dmattn::cuda
