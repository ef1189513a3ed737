// The one seam between the API and the backends: a validated attention problem
// as plain pointers and 64-bit element strides. Backends trust it completely.
#pragma once

#include <algorithm>
#include <cstdint>

#include "dmattn/dmattn.h"

namespace dmattn {

// Element (b, h, r, c) lives at data + b*sb + h*sh + r*sr + c*sc (in elements).
//   token tensors (q, k, v, out, dout, dq, dk, dv): r = token, c = feature (sc = 1)
//   mask, bias, dbias: r = query row, c = key;   lse: r = query row, c unused
// r is a global row: sequence start (0 batched, cu_seqlens[b] varlen) + local row.
// Broadcast dimensions of mask and bias have stride 0.
struct Operand {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  std::int64_t sb = 0, sh = 0, sr = 0, sc = 0;
  bool present() const { return data != nullptr; }
};

// Sizes of a mask or bias before broadcasting: each is 1 or the full extent.
struct BroadcastShape {
  std::int64_t batch = 1, heads = 1, rows = 1, cols = 1;
};

struct Problem {
  std::int64_t batch = 0, heads = 0, kv_heads = 0, head_dim = 0;
  std::int64_t seqlen_q = 0, seqlen_k = 0;  // batched: the lengths; varlen: the max lengths
  const std::int32_t* cu_seqlens_q = nullptr;  // varlen only, B + 1 entries
  const std::int32_t* cu_seqlens_k = nullptr;
  std::int64_t total_q = 0, total_k = 0;  // varlen only: the packed rows of q and of k

  Operand q, k, v, out, lse;
  Operand mask, bias;            // absent: data == nullptr
  BroadcastShape mask_shape, bias_shape;
  Operand dout, dq, dk, dv, dbias;  // backward only; dbias absent: no bias gradient

  double scale = 1.0;
  double softcap = 0.0;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  std::int64_t keep_window_size = 0;  // 0: no top-k
  // Top-k as per-key row intervals, int32 (batch, topk_heads(), seqlen_k, 2) contiguous:
  // rows [start, end) of each key, given by the caller (forward, backward:
  // Inputs::topk_intervals, user data that a backend clamps as it reads them) or
  // written (select_topk). Absent: nullptr.
  std::int32_t* topk_intervals = nullptr;
  bool deterministic = false;
  Device device{};
  void* stream = nullptr;

  bool varlen() const { return cu_seqlens_q != nullptr; }
  std::int64_t q_start(std::int64_t b) const { return varlen() ? cu_seqlens_q[b] : 0; }
  std::int64_t k_start(std::int64_t b) const { return varlen() ? cu_seqlens_k[b] : 0; }
  std::int64_t q_len(std::int64_t b) const {
    return varlen() ? cu_seqlens_q[b + 1] - cu_seqlens_q[b] : seqlen_q;
  }
  std::int64_t k_len(std::int64_t b) const {
    return varlen() ? cu_seqlens_k[b + 1] - cu_seqlens_k[b] : seqlen_k;
  }
  std::int64_t group() const { return heads / kv_heads; }  // query heads per kv head
  // Head of a mask or bias with `n` heads (H, Hk or 1) that query head h reads.
  std::int64_t operand_head(std::int64_t h, std::int64_t n) const { return h / (heads / n); }
  // Selection heads: the selection of query head h depends on h only through the
  // bias head and the mask head it reads (each H, Hk or 1), so the finer of the two
  // decides; query head h uses selection head h / (heads / topk_heads()).
  std::int64_t topk_heads() const { return std::max(bias_shape.heads, mask_shape.heads); }
  // Whether per-key row intervals express the top-k selection (SPEC 3): a
  // query-broadcast bias, at most a key-only mask (no mask: mask_shape is all
  // ones), no left window (the keys a row sees only grow with the row).
  bool topk_as_intervals() const { return bias_shape.rows == 1 && mask_shape.rows == 1 && window_left < 0; }
  // How top-k (keep_window_size) is selected, on every backend: per-key row
  // intervals, O(Sk log Sk) work, where they express it and either are given or
  // the call has more than a decode step's rows; otherwise per-row thresholds,
  // O(Sq * Sk) work, which is also the cheaper choice for a few query rows.
  static constexpr std::int64_t kThresholdRows = 16;
  bool topk_by_intervals() const {
    return topk_as_intervals() && (topk_intervals != nullptr || seqlen_q > kThresholdRows);
  }
  // Element offset of the (batch b, query head h) slice of the mask or the bias.
  std::int64_t mask_base(std::int64_t b, std::int64_t h) const {
    return b * mask.sb + operand_head(h, mask_shape.heads) * mask.sh;
  }
  std::int64_t bias_base(std::int64_t b, std::int64_t h) const {
    return b * bias.sb + operand_head(h, bias_shape.heads) * bias.sh;
  }
};

}  // namespace dmattn
