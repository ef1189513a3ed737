// Where a query row may look (SPEC 2), for the kernels, the key-list passes
// and the top-k selection alike (host and device): the sequence of a batch
// entry (batched or varlen), the causal / sliding-window band, bottom-right
// aligned, and the key or query ranges and tile-local limits it gives.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__CUDACC__)
#define DMATTN_HOST_DEVICE __host__ __device__
#else
#define DMATTN_HOST_DEVICE
#endif

namespace dmattn::cuda {

#if !defined(__CUDACC__)
using std::max;  // nvcc: CUDA's integer max and min, host and device
using std::min;
#endif

// Sequence b of a batch: where its queries and keys start (global rows: 0, or
// cu_seqlens[b] for varlen) and its lengths. offset() aligns the band to the
// bottom right: query i meets key i + offset(). p: the lengths of a launch,
// any parameters with seqlen_q, seqlen_k, cu_seqlens_q and cu_seqlens_k (the
// kernels' AttentionParams, the selection's), read only as needed; b indexes
// cu_seqlens in the caller's type.
struct Sequence {
  std::int64_t qs = 0, ks = 0, sq = 0, sk = 0;
  template <class Lengths, class Index>
  DMATTN_HOST_DEVICE Sequence(const Lengths& p, Index b) : sq(p.seqlen_q), sk(p.seqlen_k) {
    if (p.cu_seqlens_q != nullptr) {
      qs = p.cu_seqlens_q[b], sq = p.cu_seqlens_q[b + 1] - qs;
      ks = p.cu_seqlens_k[b], sk = p.cu_seqlens_k[b + 1] - ks;
    }
  }
  DMATTN_HOST_DEVICE std::int64_t offset() const { return sk - sq; }
};

// The (batch, rows) extent of a token operand as the Hopper kernels' TMA maps
// address it: batched, (B, the length), sequence b at batch b from row 0;
// varlen, one batch of the packed rows, sequence b at batch 0 from its start
// (Sequence::qs or ks). A tile may run past its sequence into the next one
// (the kernels mask those rows) or past the packed rows (TMA zero-fills).
struct TokenExtent {
  std::int64_t batch, rows;
};

// The causal and sliding-window limits (SPEC 2): query i sees key j iff
// i + offset - left <= j (left >= 0) and j <= i + offset (causal) and
// j <= i + offset + right (right >= 0); -1: unbounded on that side.
struct Band {
  bool causal = false;
  std::int64_t left = -1, right = -1;
};

// Keys [first, end) that some query of [q_first, q_last] sees within [0, sk)
// (end <= first: none).
struct KeyRange {
  std::int64_t first, end;
};
DMATTN_HOST_DEVICE inline KeyRange keys_of_queries(const Band& band, std::int64_t offset, std::int64_t sk,
                                                   std::int64_t q_first, std::int64_t q_last) {
  KeyRange r{band.left < 0 ? 0 : max(std::int64_t{0}, q_first + offset - band.left), sk};
  if (band.causal) r.end = min(r.end, q_last + offset + 1);
  if (band.right >= 0) r.end = min(r.end, q_last + offset + band.right + 1);
  return r;
}

// Keys [lo, hi] (inclusive; lo may be below 0) that query i sees within
// [0, sk): one row's test, where keys_of_queries gives a block's range.
struct KeySpan {
  std::int64_t lo, hi;
};
DMATTN_HOST_DEVICE inline KeySpan keys_of_query(const Band& band, std::int64_t offset, std::int64_t sk, std::int64_t i) {
  KeySpan s{0, sk - 1};
  if (band.causal) s.hi = min(s.hi, i + offset);
  if (band.right >= 0) s.hi = min(s.hi, i + offset + band.right);
  s.lo = band.left >= 0 ? i + offset - band.left : 0;
  return s;
}

// Tile indices [first, last] (none where first > last) of a walk that needs no
// element test (band_covers), found once a walk instead of by 64-bit
// arithmetic each tile: holds(n) is two comparisons.
struct TileIndices {
  int first, last;
  DMATTN_HOST_DEVICE bool holds(int n) const { return n >= first && n <= last; }
};
// The tiles of `size` (tile n: [n size, (n + 1) size)) inside [lo, end).
DMATTN_HOST_DEVICE inline TileIndices tiles_within(std::int64_t lo, std::int64_t end, int size) {
  return {static_cast<int>((max(std::int64_t{0}, lo) + size - 1) / size), end <= 0 ? -1 : static_cast<int>(end / size) - 1};
}
// The key tiles of block_n keys whose every key queries [q_first, q_last] see
// within [0, sk): the keys the last query sees from on, up to those the first sees.
DMATTN_HOST_DEVICE inline TileIndices covered_tiles(const Band& band, std::int64_t offset, std::int64_t sk,
                                                    std::int64_t q_first, std::int64_t q_last, int block_n) {
  return tiles_within(keys_of_query(band, offset, sk, q_last).lo, keys_of_query(band, offset, sk, q_first).hi + 1,
                      block_n);
}

// Queries [first, end) of [0, sq) that see some key of [k_first, k_last].
struct QueryRange {
  std::int64_t first, end;
};
DMATTN_HOST_DEVICE inline QueryRange queries_of_keys(const Band& band, std::int64_t offset, std::int64_t sq,
                                                     std::int64_t k_first, std::int64_t k_last) {
  QueryRange r{0, sq};
  if (band.causal) r.first = max(r.first, k_first - offset);
  if (band.right >= 0) r.first = max(r.first, k_first - offset - band.right);
  if (band.left >= 0) r.end = min(r.end, k_last - offset + band.left + 1);
  return r;
}

// The query tiles of block_m queries of [0, sq) each of whose queries sees
// every key of [k_first, k_last] within [0, sk) (none where k_last >= sk): the
// queries that see the last key from on, up to those that see the first.
DMATTN_HOST_DEVICE inline TileIndices covered_query_tiles(const Band& band, std::int64_t offset, std::int64_t sq,
                                                          std::int64_t sk, std::int64_t k_first, std::int64_t k_last,
                                                          int block_m) {
  if (k_last >= sk) return {0, -1};
  return tiles_within(queries_of_keys(band, offset, sq, k_last, k_last).first,
                      queries_of_keys(band, offset, sq, k_first, k_first).end, block_m);
}

// Whether every pair of queries [q_first, q_last] and keys [k_first, k_last]
// is inside the band (a tile that needs no per-element test).
DMATTN_HOST_DEVICE inline bool band_covers(const Band& band, std::int64_t offset, std::int64_t q_first,
                                           std::int64_t q_last, std::int64_t k_first, std::int64_t k_last) {
  return (!band.causal || k_last <= q_first + offset) && (band.left < 0 || k_first >= q_last + offset - band.left) &&
         (band.right < 0 || k_last <= q_first + offset + band.right);
}

// Element (batch b, head h, row r, column c) of a strided 4-D operand (a
// bias or a mask: Operand's strides, 0 along a broadcast extent), for every
// reader of one (r = 0 where it reads a row's keys from c on).
template <class Strided>
DMATTN_HOST_DEVICE std::int64_t element_at(const Strided& o, std::int64_t b, std::int64_t h, std::int64_t r,
                                           std::int64_t c) {
  return b * o.sb + h * o.sh + r * o.sr + c * o.sc;
}

// Tile-local limits are clamped to +-kTileFar, far outside any tile, so that
// 64-bit sequence arithmetic becomes 32-bit comparisons inside the tile.
constexpr int kTileFar = 1 << 20;
DMATTN_HOST_DEVICE inline int clamp_to_tile(std::int64_t x) {
  return static_cast<int>(x < -kTileFar ? -kTileFar : (x > kTileFar ? kTileFar : x));
}

// Columns (or rows) [from, to) of a tile.
struct TileSpan {
  int from, to;
};

// The band of a tile at query q0 and key k0 in tile-local terms: query q0 + qi
// sees key k0 + kj iff qi + lo <= kj <= qi + hi. qrows and kcols: the tile's
// queries and keys inside their sequences (clamp_to_tile).
struct TileBand {
  int lo, hi;
  DMATTN_HOST_DEVICE TileBand(const Band& band, std::int64_t offset, std::int64_t q0, std::int64_t k0)
      : lo(band.left < 0 ? -kTileFar : clamp_to_tile(q0 + offset - k0 - band.left)),
        hi(band.causal ? clamp_to_tile(q0 + offset - k0) : kTileFar) {
    if (band.right >= 0) hi = min(hi, clamp_to_tile(q0 + offset - k0 + band.right));
  }
  // Whether query qi sees key kj, both inside the sequences.
  DMATTN_HOST_DEVICE bool allows(int qi, int kj, int qrows, int kcols) const {
    return qi < qrows && kj < kcols && kj >= qi + lo && kj <= qi + hi;
  }
  // The keys that query qi sees, and the queries that see key kj.
  DMATTN_HOST_DEVICE TileSpan keys_of(int qi, int qrows, int kcols) const {
    return {max(0, qi + lo), qi < qrows ? min(kcols, qi + hi + 1) : 0};
  }
  DMATTN_HOST_DEVICE TileSpan queries_of(int kj, int qrows, int kcols) const {
    return {max(0, kj - hi), kj < kcols ? min(qrows, kj - lo + 1) : 0};
  }
};

}  // namespace dmattn::cuda
