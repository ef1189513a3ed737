// What the top-k selection's kernels share (sparse/selection.cu,
// select_intervals.cu, select_thresholds.cu, key_groups.cu): the Problem as
// they read it, the order of bias values, and the two selections' entry points.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/check.h"
#include "../common/element.cuh"
#include "../common/geometry.h"
#include "selection.h"

namespace dmattn::cuda::topk {

constexpr int kThreads = 256;

inline int ceil_log2(std::int64_t n) {
  int bits = 0;
  while ((std::int64_t{1} << bits) < n) ++bits;
  return bits;
}

inline unsigned blocks_for(std::int64_t threads) { return static_cast<unsigned>((threads + kThreads - 1) / kThreads); }

// What the kernels read of a Problem; selection head s of batch b reads the
// bias and mask of query head s * group.
struct Params {
  Operand bias, mask;  // mask.data == nullptr: no mask
  std::int64_t heads = 0, group = 1, bias_group = 1, mask_group = 1;
  std::int64_t seqlen_q = 0, seqlen_k = 0;
  const std::int32_t* cu_seqlens_q = nullptr;
  const std::int32_t* cu_seqlens_k = nullptr;
  Band band;
  std::int64_t w = 0;
};

// First row that may see key j (causal and right window, bottom-right aligned).
__device__ inline std::int64_t first_row(const Params& p, const Sequence& s, std::int64_t j) {
  return min(queries_of_keys(p.band, s.offset(), s.sq, j, j).first, s.sq);
}

__device__ inline bool load_mask(const Operand& mask, std::int64_t offset) {
  return mask.data == nullptr || static_cast<const std::uint8_t*>(mask.data)[offset] != 0;
}

// Order-preserving unsigned image of a float: a > b iff bits(a) > bits(b); -0 and +0 are one value.
__device__ inline std::uint32_t order_bits(float x) {
  const std::uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ inline float from_order_bits(std::uint32_t e) {
  return __uint_as_float((e & 0x80000000u) ? (e & 0x7FFFFFFFu) : ~e);
}

// The same order on the bias dtype's own bits: 16 for float16 and bfloat16
// (sign-magnitude like float32), 32 for float32. Fewer sort bits.
inline int order_width(DType dtype) { return dtype == DType::kFloat32 ? 32 : 16; }

__device__ inline std::uint32_t order_key(const Operand& bias, std::int64_t offset) {
  if (bias.dtype == DType::kFloat32) return order_bits(static_cast<const float*>(bias.data)[offset]);
  std::uint32_t h = static_cast<const std::uint16_t*>(bias.data)[offset];
  if (h == 0x8000u) h = 0;
  return (h & 0x8000u) ? (~h & 0xFFFFu) : (h | 0x8000u);
}

// Enqueue the selection of p for `batch` entries into out (KeyRows a key of
// each selection head; RowThreshold a row of each); intervals on a device of
// `sms` SMs (DeviceInfo::sms: how many CTAs share a head, fused_selection_parts).
void select_intervals(const Params& p, std::int64_t batch, int sms, KeyRows* out, cudaStream_t stream);
void select_thresholds(const Params& p, std::int64_t rows, RowThreshold* out, cudaStream_t stream);

}  // namespace dmattn::cuda::topk
