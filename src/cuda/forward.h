// The CUDA forward: what the host side hands to a kernel instantiation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../problem.h"
#include "selection.h"

namespace dmattn::cuda {

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
  float scale = 1.0f, softcap = 0.0f;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
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
  // Decode with query heads folded into rows (backend.cu fold_query_heads):
  // the forward's head h is kv head h, its row i query head h * topk_fold + i
  // at query row 0; the top-k lists then have a slice per (b, kv head). 1: not folded.
  int topk_fold = 1;
};

// Key lists of a mask and/or a top-k selection, for the forward and for the
// backward's dq walk.
struct KeyLists {
  // The allowed pairs (mask and/or top-k), written by the pre-passes of
  // forward_kernel.cuh build_key_lists, per list slice z = (b if list_batched, else 0)
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
  // Set (device memory): the pre-passes build nothing while *build_if is 0 (the
  // backward's dq by atomics reads lists only for rows it recomputes).
  const int* build_if = nullptr;
};

// A validated forward Problem reduced to what the kernel reads.
struct ForwardParams : AttentionParams, KeyLists {
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
};

// Launches the forward for batch x heads on `stream` (with a mask or a top-k
// selection, first the passes that list its keys, in stream-ordered scratch
// memory); kHeadDim >= head_dim (smaller heads are zero-padded in shared
// memory). Throws on CUDA errors.
template <class Element, int kHeadDim>
void launch_forward(const ForwardParams& params, int batch, int heads, cudaStream_t stream);

}  // namespace dmattn::cuda
