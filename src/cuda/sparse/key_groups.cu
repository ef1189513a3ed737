// Keys of a top-k interval selection grouped for the backward's dk/dv walk
// (selection.h KeyGroups): sorted by the rows that select them, cut into
// pieces at row segments.
#include <algorithm>
#include <climits>
#include <type_traits>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "../common/scratch.h"
#include "select.cuh"

namespace dmattn::cuda {
namespace {

using topk::blocks_for;
using topk::ceil_log2;
using topk::kThreads;

// ---- key groups for the backward (dk/dv) ----------------------------------
// What the grouping kernels read: slice z = b * kv_heads + kvh uses selection
// heads [first, last] (those of the query heads of kv head kvh); segment s of
// it holds rows [s * segment_rows, (s + 1) * segment_rows).
struct GroupParams {
  const KeyRows* intervals = nullptr;
  std::int64_t sel_heads = 0, sel_group = 1, group = 1, kv_heads = 1, seqlen_q = 0, seqlen_k = 0;
  std::int64_t segments = 1, segment_rows = 0;
  // The entries of a (slice, segment) in the sorted arrays: seqlen_k, or
  // kSegmentSortKeys where the compacting sort bounds its pieces (`compact`
  // in group_keys); more pieces there set *overflow.
  std::int64_t entries = 0;
  int* overflow = nullptr;
  // Past kSegmentSortKeys keys (sort_segments<true>): the count of each
  // (slice, segment)'s pieces (zeroed before count_pieces), whose keys
  // count_pieces lists in its entries of the order array, in no order.
  int* listed = nullptr;
  const std::int32_t* cu_seqlens_q = nullptr;
  const std::int32_t* cu_seqlens_k = nullptr;
  int end_bits = 32;  // sort key: (slice, segment) << end_bits | end in the segment; all ones: no piece
  __host__ __device__ std::uint64_t no_end() const { return (std::uint64_t{1} << end_bits) - 1; }
  __device__ std::int64_t sq(std::int64_t z) const {
    const std::int64_t b = z / kv_heads;
    return cu_seqlens_q == nullptr ? seqlen_q : cu_seqlens_q[b + 1] - cu_seqlens_q[b];
  }
  __device__ std::int64_t sk(std::int64_t z) const {
    const std::int64_t b = z / kv_heads;
    return cu_seqlens_k == nullptr ? seqlen_k : cu_seqlens_k[b + 1] - cu_seqlens_k[b];
  }
  __device__ std::int64_t first_head(std::int64_t z) const { return z % kv_heads * group / sel_group; }
  __device__ std::int64_t last_head(std::int64_t z) const { return (z % kv_heads * group + group - 1) / sel_group; }
  __device__ KeyRows at(std::int64_t z, std::int64_t s, std::int64_t j) const {
    return sequence_rows(intervals[(z / kv_heads * sel_heads + s) * seqlen_k + j], sq(z));
  }
  // Key j's piece in segment s: the hull of the slice's intervals within the
  // segment ({0, 0}: no head selects j there); j in the sequence.
  __device__ KeyRows piece(std::int64_t z, std::int64_t s, std::int64_t j) const {
    const std::int64_t lo = s * segment_rows, hi = lo + segment_rows;
    std::int64_t start = hi, end = lo;
    for (std::int64_t h = first_head(z); h <= last_head(z); ++h) {
      const KeyRows r = at(z, h, j);
      const std::int64_t a = max(std::int64_t{r.start}, lo), e = min(std::int64_t{r.end}, hi);
      if (a < e) start = min(start, a), end = max(end, e);
    }
    return start < end ? KeyRows{static_cast<std::int32_t>(start), static_cast<std::int32_t>(end)} : KeyRows{0, 0};
  }
  // The segments [lo, hi), hi <= upto, where key j of slice z may have a
  // piece: with one selection head each of them (its interval meets them),
  // else those of them where piece() finds one.
  __device__ void piece_range(std::int64_t z, std::int64_t j, std::int64_t upto, std::int64_t& lo,
                              std::int64_t& hi) const {
    lo = upto, hi = 0;
    for (std::int64_t h = first_head(z); h <= last_head(z); ++h) {
      const KeyRows r = at(z, h, j);
      if (r.end > r.start) lo = min(lo, r.start / segment_rows), hi = max(hi, (r.end - 1) / segment_rows + 1);
    }
    hi = first_head(z) == last_head(z) ? min(hi, upto) : upto;
  }
  // Pieces of key j in segments [0, upto) of slice z.
  __device__ std::int32_t pieces_before(std::int64_t z, std::int64_t j, std::int64_t upto) const {
    std::int64_t lo, hi;
    piece_range(z, j, upto, lo, hi);
    if (first_head(z) == last_head(z)) return static_cast<std::int32_t>(max(std::int64_t{0}, hi - lo));
    std::int32_t n = 0;
    for (std::int64_t s = lo; s < hi; ++s) n += piece(z, s, j).end > 0;
    return n;
  }
};

// Sort keys of (slice, segment) v = z * segments + s: v in the top bits, then
// the end of key j's piece there (from the segment's first row) in end_bits;
// no piece (or out of sequence): all ones there.
__device__ std::uint32_t piece_end(const GroupParams& p, std::int64_t z, std::int64_t s, std::int64_t j) {
  if (j < p.sk(z)) {
    const KeyRows r = p.piece(z, s, j);
    if (r.end > r.start) return static_cast<std::uint32_t>(r.end - s * p.segment_rows);
  }
  return static_cast<std::uint32_t>(p.no_end());
}

// One thread per (slice, segment, key), for the device-wide sort.
__global__ void __launch_bounds__(kThreads) group_sort_keys(const GroupParams p, std::int64_t items, std::uint64_t* keys,
                                                            std::int32_t* values) {
  const std::int64_t e = std::int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (e >= items) return;
  const std::int64_t v = e / p.entries, j = e % p.entries;
  keys[e] = static_cast<std::uint64_t>(v) << p.end_bits | piece_end(p, v / p.segments, v % p.segments, j);
  values[e] = static_cast<std::int32_t>(j);
}

// One CTA a (slice, segment) where at most kSegmentSortKeys keys have a piece
// there (group_keys: every key's, or a bound on a selection's): one launch
// instead of the sort keys' kernel and the device-wide sort's kernels and
// memsets. At most kSegmentSortKeys keys (kCompact false) are sorted by their
// pieces' ends alone (a block radix sort; no piece: all ones, after the
// pieces); more (kCompact) are first compacted, those with a piece in index
// order (kSegmentSortItems a thread a round, one block scan), to be sorted the
// same way, the others after them (end all ones, key -1, which sort_strips
// gives those in any case). Either is the device-wide sort's order, as both
// sorts are stable over the keys in index order. More pieces than the sort
// takes (given intervals that are no selection) stay in key order, which the
// groups take as well (only the fill of the dk/dv walk depends on the order);
// in compact entries (p.entries < seqlen_k) only the first p.entries of them,
// and *p.overflow is set. Past kSegmentSortKeys keys the pieces are those of
// count_pieces' list (p.listed) where it holds them all, sorted by key, then
// by end as above; testing every key for each segment instead read S^2 / 2048
// intervals a slice (0.86 ms at S = 131072, w = 2048, H100, on the side
// stream, where its CTAs held the SMs that the dq memset beside it needed).
// Two kernels: as one, the sort of every key of a segment took 25 us against
// 20 (top-k at S = 4096, w = 256, H100); sort_segments<false> is the kernel of
// 0954372 (the same SASS).
constexpr int kSegmentSortThreads = 1024, kSegmentSortItems = 4;
constexpr int kSegmentSortKeys = kSegmentSortThreads * kSegmentSortItems;
using SegmentSort = cub::BlockRadixSort<std::uint32_t, kSegmentSortThreads, kSegmentSortItems, std::int32_t>;
using ListedSort = cub::BlockRadixSort<std::uint32_t, kSegmentSortThreads, kSegmentSortItems>;
using SegmentScan = cub::BlockScan<int, kSegmentSortThreads>;
union CompactingStorage {  // the listed keys' sort or the compacted pieces, then the sort's storage in their place
  typename SegmentSort::TempStorage sort;
  typename ListedSort::TempStorage listed;
  struct {
    std::uint32_t end[kSegmentSortKeys];
    std::int32_t key[kSegmentSortKeys];
  } pieces;
};

template <bool kCompact>
__global__ void __launch_bounds__(kSegmentSortThreads) sort_segments(const GroupParams p, std::uint64_t* sorted,
                                                                     std::int32_t* order) {
  __shared__ std::conditional_t<kCompact, CompactingStorage, typename SegmentSort::TempStorage> storage;
  const std::int64_t v = blockIdx.x;
  const auto put = [&](std::int64_t at, std::uint32_t e, std::int32_t j) {  // entry `at` of the segment
    sorted[v * p.entries + at] = static_cast<std::uint64_t>(v) << p.end_bits | e;
    order[v * p.entries + at] = j;
  };
  std::uint32_t end[kSegmentSortItems];
  std::int32_t key[kSegmentSortItems];
  std::int64_t count = kCompact ? 0 : p.seqlen_k;  // the entries to sort
  if constexpr (!kCompact) {
#pragma unroll
    for (int i = 0; i < kSegmentSortItems; ++i) {
      const int j = kSegmentSortItems * threadIdx.x + i;
      key[i] = j;
      end[i] = j < p.seqlen_k ? piece_end(p, v / p.segments, v % p.segments, j) : 1u << p.end_bits;  // past: last
    }
  } else if (const int listed = p.listed[v]; listed <= kSegmentSortKeys) {
    const int key_bits = 32 - __clz(static_cast<int>(p.seqlen_k));  // 2^key_bits - 1 > every key: the padding sorts last
    std::uint32_t sorted_key[kSegmentSortItems];
#pragma unroll
    for (int i = 0; i < kSegmentSortItems; ++i) {
      const int at = kSegmentSortItems * threadIdx.x + i;
      sorted_key[i] = at < listed ? static_cast<std::uint32_t>(order[v * p.entries + at]) : (1u << key_bits) - 1;
    }
    ListedSort(storage.listed).Sort(sorted_key, 0, key_bits);
    count = listed;
#pragma unroll
    for (int i = 0; i < kSegmentSortItems; ++i) {
      const int at = kSegmentSortItems * threadIdx.x + i;
      key[i] = at < listed ? static_cast<std::int32_t>(sorted_key[i]) : -1;
      end[i] = at < listed ? piece_end(p, v / p.segments, v % p.segments, key[i]) : 1u << p.end_bits;
    }
    for (std::int64_t at = count + threadIdx.x; at < p.entries; at += kSegmentSortThreads)
      put(at, static_cast<std::uint32_t>(p.no_end()), -1);
    __syncthreads();  // the listed sort's storage is free for the sort by end
  } else {
    __shared__ typename SegmentScan::TempStorage scan;
    const auto no_end = static_cast<std::uint32_t>(p.no_end());
    for (std::int64_t j0 = 0; j0 < p.seqlen_k; j0 += kSegmentSortKeys) {
      int mine = 0;
#pragma unroll
      for (int i = 0; i < kSegmentSortItems; ++i) {
        const std::int64_t j = j0 + kSegmentSortItems * threadIdx.x + i;
        end[i] = j < p.seqlen_k ? piece_end(p, v / p.segments, v % p.segments, j) : no_end;
        mine += end[i] != no_end;
      }
      int at, round;
      SegmentScan(scan).ExclusiveSum(mine, at, round);
      at += static_cast<int>(count);
#pragma unroll
      for (int i = 0; i < kSegmentSortItems; ++i) {
        if (end[i] == no_end) continue;
        const auto j = static_cast<std::int32_t>(j0 + kSegmentSortItems * threadIdx.x + i);
        if (at < kSegmentSortKeys)  // the pieces the CTA sorts, or (more of them) writes in key order below
          storage.pieces.end[at] = end[i], storage.pieces.key[at] = j;
        else if (at < p.entries)
          put(at, end[i], j);
        ++at;
      }
      count += round;
      __syncthreads();  // the scan's storage is free again
    }
    for (std::int64_t at = count + threadIdx.x; at < p.entries; at += kSegmentSortThreads)
      put(at, no_end, -1);
    if (count > p.entries && threadIdx.x == 0) *p.overflow = 1;
    if (count > kSegmentSortKeys) {  // more than the sort takes: in key order
      for (int at = threadIdx.x; at < kSegmentSortKeys; at += kSegmentSortThreads)
        put(at, storage.pieces.end[at], storage.pieces.key[at]);
      return;
    }
#pragma unroll
    for (int i = 0; i < kSegmentSortItems; ++i) {
      const int at = kSegmentSortItems * threadIdx.x + i;
      end[i] = at < count ? storage.pieces.end[at] : 1u << p.end_bits;
      key[i] = at < count ? storage.pieces.key[at] : -1;
    }
    __syncthreads();  // the pieces are read before the sort's storage takes their place
  }
  if constexpr (kCompact)
    SegmentSort(storage.sort).Sort(end, key, 0, p.end_bits + 1);
  else
    SegmentSort(storage).Sort(end, key, 0, p.end_bits + 1);
#pragma unroll
  for (int i = 0; i < kSegmentSortItems; ++i) {
    const int at = kSegmentSortItems * threadIdx.x + i;
    if (at < count) put(at, end[i], key[i]);
  }
}

// The number of pieces of each key, one thread per (slice, key); and the
// overflow flag cleared (sort_segments may set it after). With p.listed
// (sort_segments<true>) each piece's key also goes to its (slice, segment)'s
// entries of `order`, at a place counted in p.listed, in no order; those past
// the entries are counted, not stored. A warp walks the segments its keys'
// pieces meet and takes each segment's places with one atomic (a thread an
// atomic a piece: 0.53 ms at S = 131072, w = 2048, H100).
__global__ void __launch_bounds__(kThreads) count_pieces(const GroupParams p, std::int64_t items, std::int32_t* pieces,
                                                         std::int32_t* order) {
  const std::int64_t e = std::int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (e == 0 && p.overflow != nullptr) *p.overflow = 0;
  const std::int64_t z = e / p.seqlen_k, j = e % p.seqlen_k;
  const bool key = e < items && j < p.sk(z);
  if (p.listed == nullptr) {
    if (e < items) pieces[e] = key ? p.pieces_before(z, j, p.segments) : 0;
    return;
  }
  std::int64_t lo = 0, hi = 0;
  if (key) p.piece_range(z, j, p.segments, lo, hi);
  const bool one_head = key && p.first_head(z) == p.last_head(z);
  const int lane = threadIdx.x % 32;
  const auto first = static_cast<int>(__reduce_min_sync(0xffffffffu, static_cast<unsigned>(lo < hi ? lo : p.segments)));
  const auto last = static_cast<int>(__reduce_max_sync(0xffffffffu, static_cast<unsigned>(hi)));
  std::int32_t n = 0;
  for (int s = first; s < last; ++s) {
    const bool has = s >= lo && s < hi && (one_head || p.piece(z, s, j).end > 0);
    const std::int64_t v = z * p.segments + s;
    const unsigned peers = __match_any_sync(0xffffffffu, has ? v : -1);
    const int leader = __ffs(peers) - 1;
    int at = 0;
    if (has && lane == leader) at = atomicAdd(&p.listed[v], __popc(peers));
    at = __shfl_sync(0xffffffffu, at, leader) + __popc(peers & ((1u << lane) - 1));
    if (has) {
      if (at < p.entries) order[v * p.entries + at] = static_cast<std::int32_t>(j);
      ++n;
    }
  }
  if (e < items) pieces[e] = n;
}

// Strips: after the sort by end, each run of kStripGroups groups of a
// (slice, segment) is sorted again by the start of its pieces (stable; entries
// without a piece stay last). The end alone leaves a group's starts spread
// from the segment's first row to its end; a strip's ends stay close and its
// groups each take a third of its starts. Fill of the dk/dv walk at S =
// 16384, w = 1024, uniform key bias, no segments: 0.622 (end) -> 0.705 (strips
// of 3; 2 and 4 close, 8 back to 0.62: docs/kernels.md).
constexpr int kStripGroups = 3;

// One CTA of kBlock threads per (strip, slice and segment v): kStripGroups
// items a thread, blocked, so that the sorted strip comes back in place; then
// the entries' keys (-1: no piece) and, with rank, the pieces' ranks.
template <int kBlock>
__global__ void __launch_bounds__(kBlock) sort_strips(const GroupParams p, const std::uint64_t* sorted, std::int32_t* order,
                                                      std::int32_t* rank) {
  using Sort = cub::BlockRadixSort<std::uint32_t, kBlock, kStripGroups, std::int32_t>;
  __shared__ typename Sort::TempStorage storage;
  const std::int64_t v = blockIdx.y, z = v / p.segments, s = v % p.segments;
  const std::int64_t pos0 = std::int64_t{blockIdx.x} * kBlock * kStripGroups + threadIdx.x * kStripGroups;
  if ((sorted[v * p.entries + std::int64_t{blockIdx.x} * kBlock * kStripGroups] & p.no_end()) == p.no_end()) {
    for (int i = 0; i < kStripGroups; ++i)  // a strip past the pieces (most of them with many segments)
      if (pos0 + i < p.entries) order[v * p.entries + pos0 + i] = -1;
    return;
  }
  std::uint32_t start[kStripGroups];
  std::int32_t key[kStripGroups];
  for (int i = 0; i < kStripGroups; ++i) {
    const std::int64_t pos = pos0 + i;
    start[i] = 0xffffffffu, key[i] = -1;
    if (pos >= p.entries || (sorted[v * p.entries + pos] & p.no_end()) == p.no_end()) continue;
    key[i] = order[v * p.entries + pos];
    start[i] = static_cast<std::uint32_t>(p.piece(z, s, key[i]).start);
  }
  Sort(storage).Sort(start, key);
  for (int i = 0; i < kStripGroups; ++i) {
    const std::int64_t at = v * p.entries + pos0 + i;
    if (pos0 + i >= p.entries) continue;
    order[at] = key[i];
    if (rank != nullptr) rank[at] = key[i] >= 0 ? p.pieces_before(z, key[i], s) : 0;
  }
}

// One CTA per slice z: the groups of its segments in order, each segment's
// groups from its last (the latest ends) to its first; first[z * groups + g]
// = the entry of group g's first piece, -1 past the last group. The slice's
// groups never exceed `groups` (group_keys proves the bound).
__global__ void group_firsts(const GroupParams p, const std::uint64_t* sorted, std::int64_t groups, std::int32_t* first) {
  extern __shared__ std::int64_t seg_first[];  // [segments + 1]: the segments' first group
  const std::int64_t z = blockIdx.x;
  for (std::int64_t s = threadIdx.x; s < p.segments; s += blockDim.x) {
    const std::uint64_t* keys = sorted + (z * p.segments + s) * p.entries;
    std::int64_t lo = 0, hi = p.entries;  // the first entry without a piece
    while (lo < hi) {
      const std::int64_t mid = (lo + hi) / 2;
      if ((keys[mid] & p.no_end()) == p.no_end()) hi = mid; else lo = mid + 1;
    }
    seg_first[s + 1] = (lo + kKeyGroupKeys - 1) / kKeyGroupKeys;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    seg_first[0] = 0;
    for (std::int64_t s = 0; s < p.segments; ++s) seg_first[s + 1] += seg_first[s];
  }
  __syncthreads();
  for (std::int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
    std::int64_t s = 0;
    while (s < p.segments && seg_first[s + 1] <= g) ++s;
    first[z * groups + g] = s < p.segments ? static_cast<std::int32_t>((z * p.segments + s) * p.entries +
                                                                      (seg_first[s + 1] - 1 - g) * kKeyGroupKeys)
                                           : -1;
  }
}

// One CTA of `block` threads per (group g, slice z): the union of the group's
// pieces (unsorted: of its keys' intervals).
__global__ void group_rows(const GroupParams p, const std::int32_t* order, const std::int32_t* first, std::int64_t groups,
                           KeyRows* rows) {
  const std::int64_t z = blockIdx.y;
  __shared__ int lo, hi;
  if (threadIdx.x == 0) lo = INT_MAX, hi = INT_MIN;
  __syncthreads();
  std::int64_t j = -1, s = 0;
  if (first != nullptr) {
    const std::int64_t at = first[z * groups + blockIdx.x];
    if (at >= 0 && at % p.entries + threadIdx.x < p.entries)
      j = order[at + threadIdx.x], s = at / p.entries % p.segments;
  } else {
    j = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
    if (j >= p.sk(z)) j = -1;
  }
  if (j >= 0) {
    const KeyRows r = p.piece(z, s, j);
    if (r.end > r.start) atomicMin(&lo, r.start), atomicMax(&hi, r.end);
  }
  __syncthreads();
  if (threadIdx.x == 0) rows[z * groups + blockIdx.x] = lo < hi ? KeyRows{lo, hi} : KeyRows{0, 0};
}


}  // namespace

KeyGroups group_keys(const DeviceSelection& sel, std::int64_t batch, std::int64_t heads, std::int64_t kv_heads,
                     std::int64_t seqlen_q, std::int64_t seqlen_k, const std::int32_t* cu_seqlens_q,
                     const std::int32_t* cu_seqlens_k, std::int64_t w, bool sort, bool split, cudaStream_t stream) {
  constexpr int block = kKeyGroupKeys;
  GroupParams p;
  p.intervals = sel.intervals;
  p.sel_heads = sel.heads, p.sel_group = sel.group, p.group = heads / kv_heads, p.kv_heads = kv_heads;
  p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k, p.cu_seqlens_q = cu_seqlens_q, p.cu_seqlens_k = cu_seqlens_k;
  KeyGroups g;
  const std::int64_t slices = batch * kv_heads, key_groups = (seqlen_k + block - 1) / block;
  g.groups = key_groups;
  if (slices * seqlen_k == 0) return g;
  std::int64_t slice_heads = 1;  // most selection heads of a slice's query heads
  for (std::int64_t kvh = 0; kvh < kv_heads; ++kvh)
    slice_heads = std::max(slice_heads, (kvh * p.group + p.group - 1) / sel.group - kvh * p.group / sel.group + 1);
  // A selection's pieces in a segment of `rows` rows: at most slice_heads
  // (min(w, seqlen_k) + rows - 1). Proof: intervals express a selection only
  // where each row's allowed keys are the row before's and at most one more
  // (no left window, no mask with rows), so a row selects at most one key the
  // row before did not (its new key: the others' order is unchanged), and a
  // segment's rows at most min(w, seqlen_k) + rows - 1 keys a head.
  const auto piece_bound = [&](std::int64_t rows) {
    return slice_heads * (std::min(w, seqlen_k) + std::min(rows, seqlen_q) - 1);
  };
  // Segments of kKeySegmentRows rows where there are at most kMaxKeySegments;
  // more rows, segments of kLongSegmentRows where a segment's pieces fit the
  // compacting sort (compact: entries of kSegmentSortKeys a segment, any
  // number of segments), else of a multiple of kKeySegmentRows, at most
  // kMaxKeySegments of them (the arrays have an entry a key and segment);
  // where the arrays and the grid fit, else one segment, or unsorted.
  const auto fits = [&](std::int64_t segments, std::int64_t rows, std::int64_t entries) {
    return slices * segments * entries <= INT_MAX && slices * segments <= 65535 &&
           ceil_log2(rows + 2) + ceil_log2(slices * segments) <= 64;
  };
  p.segments = 1, p.segment_rows = std::max<std::int64_t>(seqlen_q, 1), p.entries = seqlen_k;
  sort = sort && fits(1, p.segment_rows, seqlen_k);
  if (split && sort && seqlen_q > kKeySegmentRows) {
    const std::int64_t base = (seqlen_q + kKeySegmentRows - 1) / kKeySegmentRows;  // segments of kKeySegmentRows
    const bool compact =
        base > kMaxKeySegments && seqlen_k > kSegmentSortKeys && piece_bound(kLongSegmentRows) <= kSegmentSortKeys;
    const std::int64_t rows =
        compact ? kLongSegmentRows : kKeySegmentRows * ((base + kMaxKeySegments - 1) / kMaxKeySegments);
    const std::int64_t segments = (seqlen_q + rows - 1) / rows, entries = compact ? kSegmentSortKeys : seqlen_k;
    if (fits(segments, rows, entries)) p.segments = segments, p.segment_rows = rows, p.entries = entries;
  }
  p.end_bits = ceil_log2(std::min(seqlen_q, p.segment_rows) + 2);  // ends 1..rows and the all-ones value
  g.segments = p.segments, g.segment_rows = p.segment_rows, g.entries = p.entries;
  const std::int64_t items = slices * p.segments * p.entries;
  if (sort) {
    // The dk/dv grid: a bound on the groups of a slice, known without reading
    // the selection (no host sync). Proof: a key's piece in segment s exists
    // iff one of the slice's selection heads selects the key in a row of s. For
    // one head, key j's rows are one interval [start, end); it meets 1 + c
    // segments, c the segment boundaries r (r a multiple of segment_rows,
    // start < r < end) it crosses, and a key crossing r is selected by row r,
    // which selects at most min(w, seqlen_k) keys. So a head has at most
    // seqlen_k + (segments - 1) min(w, seqlen_k) pieces (varlen: fewer rows and
    // keys), the slice at most `pieces` below (a piece of the hull is a piece of
    // one of its heads), and a segment at most its entries (seqlen_k, or the
    // compacting sort's, which bound it: piece_bound). Segment s takes
    // ceil(n_s / 128) groups; summed over the segments that is at most
    // ceil(sum n_s / 128) + segments - 1, and at most segments ceil(entries /
    // 128).
    const std::int64_t pieces = std::min(p.segments * p.entries,
                                         slice_heads * (seqlen_k + (p.segments - 1) * std::min(w, seqlen_k)));
    g.groups = std::min(p.segments * ((p.entries + block - 1) / block), (pieces + block - 1) / block + p.segments - 1);
  }
  const int sort_bits = p.end_bits + ceil_log2(slices * p.segments);
  // One CTA a segment (sort_segments) where its pieces fit the CTA's sort: at
  // most seqlen_k, or piece_bound. Given intervals that are no selection may
  // exceed the bound: then the pieces stay in key order (sort_segments), and
  // in compact entries those past them are dropped (*overflow: their keys'
  // later pieces wait for no turn, and the gradients of those keys are not
  // the call's; dmattn.h select_topk).
  const bool by_segment = seqlen_k <= kSegmentSortKeys || piece_bound(p.segment_rows) <= kSegmentSortKeys;
  std::size_t sort_bytes = 0;
  if (sort && !by_segment)
    check_cuda(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const std::uint64_t*>(nullptr),
                                               static_cast<std::uint64_t*>(nullptr), static_cast<const std::int32_t*>(nullptr),
                                               static_cast<std::int32_t*>(nullptr), static_cast<int>(items), 0,
                                               sort_bits, stream),
               "radix sort size");
  const auto n = static_cast<std::size_t>(items), keys = static_cast<std::size_t>(slices * seqlen_k);
  const std::size_t group_entries = static_cast<std::size_t>(slices * g.groups);
  // The groups' rows first (free_groups frees the allocation from them), then
  // the sorted order, pieces and firsts, and the sort's keys, values and
  // temporary storage, kept with the groups (one CUDA call fewer each way).
  // With count_pieces' lists (sort_segments<true>) their counts are zeroed,
  // and the rows too, so that they stay first (Scratch puts the zeroed parts
  // first).
  const bool lists = sort && by_segment && seqlen_k > kSegmentSortKeys;
  std::uint64_t *keys_in = nullptr, *keys_out = nullptr;
  std::int32_t* values_in = nullptr;
  char* temp = nullptr;
  Scratch memory;
  memory.add(g.rows, group_entries, lists);
  if (lists) memory.add(p.listed, static_cast<std::size_t>(slices * p.segments), true);
  if (sort) {
    memory.add(g.order, n, false);
    if (p.segments > 1) memory.add(g.rank, n, false);
    memory.add(g.pieces, keys, false), memory.add(g.first, group_entries, false), memory.add(keys_out, n, false);
    if (p.entries < seqlen_k) memory.add(g.overflow, 1, false);
    if (!by_segment) memory.add(keys_in, n, false), memory.add(values_in, n, false), memory.add(temp, sort_bytes, false);
  }
  check_cuda(memory.allocate(stream), "cudaMallocAsync (key groups)");
  p.overflow = g.overflow;
  if (sort) {
    count_pieces<<<blocks_for(slices * seqlen_k), kThreads, 0, stream>>>(p, slices * seqlen_k, g.pieces, g.order);
    if (by_segment) {
      const auto segment_sort = lists ? sort_segments<true> : sort_segments<false>;
      segment_sort<<<static_cast<unsigned>(slices * p.segments), kSegmentSortThreads, 0, stream>>>(p, keys_out, g.order);
    } else {
      group_sort_keys<<<blocks_for(items), kThreads, 0, stream>>>(p, items, keys_in, values_in);
      check_cuda(cub::DeviceRadixSort::SortPairs(temp, sort_bytes, keys_in, keys_out, values_in, g.order,
                                                 static_cast<int>(items), 0, sort_bits, stream),
                 "radix sort");
    }
    const std::int64_t strips = (p.entries + block * kStripGroups - 1) / (block * kStripGroups);
    sort_strips<block><<<dim3(static_cast<unsigned>(strips), static_cast<unsigned>(slices * p.segments)), block, 0, stream>>>(
        p, keys_out, g.order, g.rank);
    group_firsts<<<static_cast<unsigned>(slices), kThreads, static_cast<std::size_t>(p.segments + 1) * 8, stream>>>(
        p, keys_out, g.groups, g.first);
  }
  group_rows<<<dim3(static_cast<unsigned>(g.groups), static_cast<unsigned>(slices)), block, 0, stream>>>(p, g.order, g.first,
                                                                                                         g.groups, g.rows);
  check_cuda(cudaGetLastError(), "key group kernels");
  return g;
}

void free_groups(KeyGroups& groups, cudaStream_t stream) {
  if (groups.rows != nullptr) check_cuda(cudaFreeAsync(groups.rows, stream), "cudaFreeAsync");
  groups = KeyGroups{};
}


}  // namespace dmattn::cuda
