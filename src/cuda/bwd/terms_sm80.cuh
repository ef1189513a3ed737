// The additive term of an sm80-class backward tile (bwd/kernel_sm80.cuh),
// staged in shared memory where its elements differ: the bias (0 without one)
// where the element is allowed, -inf where the band, the sequences, the
// user's mask, the key list or the top-k threshold exclude it.
#pragma once

#include <cstdint>

#include "../common/bias.cuh"
#include "../common/geometry.h"
#include "../common/softmax.cuh"
#include "../params.h"

namespace dmattn::cuda {

// The term of each element (row r, column c) of the tile of queries from q0
// and keys from k0 (dq: rows are queries; dk/dv: keys) into
// tile_add[r * Config::kAddLd + c], by the CTA's threads. A dq step over a key
// list (`lists`; list_keys, list_count: its keys) takes its columns'
// keys from positions [c0, c0 + kStep) of the list; mask_full: the user's mask
// allows the whole tile (or there is none); bias_in: the bias from the
// tile's first query row and key 0.
template <class Config>
__device__ __forceinline__ void stage_tile_terms(const BackwardParams& p, const Sequence& seq, int b, int h,
                                                 std::int64_t q0, std::int64_t k0, std::int64_t c0, std::int64_t offset,
                                                 bool mask_full, bool lists, const std::int32_t* list_keys, int list_count,
                                                 bool has_bias, bool thresholds, const BiasReader<typename Config::Element>& bias_in,
                                                 float* tile_add, int tid) {
  constexpr bool kKeyRows = Config::kKeyRows;
  constexpr int kBlockRows = Config::kBlockRows, kStep = Config::kStep, kAddLd = Config::kAddLd;
  const int qrows = clamp_to_tile(seq.sq - q0), kcols = clamp_to_tile(seq.sk - k0);
  const TileBand band(p.band, offset, q0, k0);
  const std::uint8_t* mask_tile = nullptr;
  if (!mask_full)
    mask_tile = static_cast<const std::uint8_t*>(p.mask.data) +
                element_at(p.mask, b, h / p.mask_group, seq.qs + q0, seq.ks + k0);
#pragma unroll 4
  for (int e = tid; e < kBlockRows * kStep; e += Config::kThreads) {
    const int r = e / kStep, c = e % kStep;
    const int qi = kKeyRows ? c : r, kj = kKeyRows ? r : c;
    const std::int64_t key = lists ? (c0 + kj < list_count ? list_keys[c0 + kj] : -1) : k0 + kj;
    const bool ok = lists ? qi < qrows && key >= 0
                          : band.allows(qi, kj, qrows, kcols) &&
                                (mask_full || mask_tile[qi * p.mask.sr + kj * p.mask.sc] != 0);
    float x = ok ? 0.0f : -kInf;
    if (has_bias && ok) x = bias_in.at(qi, key);
    if (thresholds && ok) {  // (bias_ij, j) >= the row's threshold (SPEC 3)
      const RowThreshold thr =
          p.topk_thresholds[(std::int64_t{b} * p.topk_heads + h / p.topk_group) * p.seqlen_q + q0 + qi];
      if (!(x > thr.value || (x == thr.value && key >= thr.key))) x = -kInf;
    }
    tile_add[r * kAddLd + c] = x;
  }
}

}  // namespace dmattn::cuda
