// Top-k selection of SPEC 3 (keep_window_size = w) on the GPU: the same selection
// as src/cpu/selection.h, computed on the Problem's stream into device arrays
// that the gather kernels read. Everything is asynchronous: scratch comes from
// cudaMallocAsync/cudaFreeAsync on the stream and no call waits for the device,
// so a CUDA graph can capture it.
//
// Selection heads (Problem::topk_heads). The selection of (b, query head h)
// depends on h only through the bias head and the mask head it reads; with head
// counts in {1, Hk, H}, the finer of the two decides, so there are `heads` =
// max(bias heads, mask heads) selection heads and query head h uses selection
// head h / group.
//
// Intervals (query-broadcast bias, causal / right-window limits, at most a
// key-only mask, more than 16 query rows or given: Problem::topk_by_intervals):
// rows [start, end) of (b, s) select key j, the caller's (given_selection) or
// computed. Per head an ascending radix sort of the
// keys by (bias, index) descending, then a wavelet matrix over the sorted key
// indices answers "the w-th smallest index among the r strongest keys" in
// O(log Sk) per key: O(Sk log Sk) work and O(Sk log Sk) bits of scratch per
// head, O(Sk) output (select_intervals.cu).
//
// Thresholds (anything else): row i of (b, s) keeps key j iff (bias_ij, j) >=
// (value, key), larger bias first, ties to the larger key; the w-th strongest
// allowed pair of a row in O(Sk) per row: one CTA a row radix-selects it, or,
// for few rows of many keys (decode), one CTA per 4096-key chunk of a row and
// one kernel per 8-bit digit, then a pass for the ties (select_thresholds.cu).
// The default {-inf, -1} (fewer than w + 1 allowed keys) keeps every allowed key.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../../problem.h"

namespace dmattn::cuda {

struct KeyRows {
  std::int32_t start, end;  // rows [start, end) select the key; {0, 0}: none
};

// The rows of interval r as every reader of an interval selection takes them:
// within the sequence's rows [0, sq), {0, 0} when that leaves none. The identity
// on a computed selection; given intervals (Problem::topk_intervals) are user
// data, and through this nothing addresses a row outside the sequence whatever
// their values.
__host__ __device__ inline KeyRows sequence_rows(KeyRows r, std::int64_t sq) {
  const std::int64_t start = r.start > 0 ? r.start : 0, end = r.end < sq ? r.end : sq;
  return start < end ? KeyRows{static_cast<std::int32_t>(start), static_cast<std::int32_t>(end)} : KeyRows{0, 0};
}

struct RowThreshold {
  float value;        // a bias value (exact in float32 for every bias dtype)
  std::int32_t key;   // local key index; -1 with value -inf: every allowed key
};

struct DeviceSelection {
  enum Mode { kNone, kIntervals, kThresholds };
  Mode mode = kNone;
  bool given = false;         // intervals are the caller's (Problem::topk_intervals): not freed here
  std::int64_t heads = 0;     // selection heads per batch
  std::int64_t group = 1;     // query head h uses selection head h / group
  std::int64_t per_head = 0;  // entries per (b, selection head): seqlen_k keys or seqlen_q rows
  KeyRows* intervals = nullptr;       // [batch][heads][seqlen_k], device memory (kIntervals)
  RowThreshold* thresholds = nullptr; // [batch][heads][seqlen_q], device memory (kThresholds)

  // Index of (b, query head h, key or row) in the array of the mode.
  std::int64_t index(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return (b * heads + h / group) * per_head + i;
  }
};

// Enqueues the selection of p (keep_window_size > 0, a bias of dtype float32,
// float16 or bfloat16, device pointers, cu_seqlens included) by `mode` (the
// dispatch's: Problem::topk_by_intervals) on `stream`. The arrays are
// allocated on that stream; release them with free_selection.
DeviceSelection select_topk(const Problem& p, DeviceSelection::Mode mode, cudaStream_t stream);
// The caller's intervals of p (Problem::topk_intervals), as they are: nothing is
// enqueued, allocated or freed.
DeviceSelection given_selection(const Problem& p);
void free_selection(DeviceSelection& sel, cudaStream_t stream);
// Enqueues the intervals of p (Problem::topk_as_intervals) into
// p.topk_intervals on `stream` (select_topk of the API).
void write_intervals(const Problem& p, cudaStream_t stream);

// Keys of an interval selection grouped for the backward's dk/dv walk, per
// (b, kv head) slice z = b * kv_heads + kvh over the union of the slice's
// selection heads. Sorted: each key's rows are cut at multiples of
// segment_rows (`segments` segments; 1: not cut) into pieces; the pieces of
// segment s of slice z are sorted (by end, empty last, then strips of a few
// groups by start) into entries [(z * segments + s) * entries, + entries) of
// order (the key, -1 past the segment's pieces; `entries` is seqlen_k, or
// fewer where a selection's pieces in a segment are bounded) and rank (the piece's place
// among its key's pieces, in segment order); pieces[z * seqlen_k + j] counts
// key j's pieces. Group g of slice z (CTA order: segments ascending, then the
// latest ends first) owns the 128 entries from first[z * groups + g] (-1: no
// group). Unsorted (order null): group g owns keys [128 g, 128 g + 128).
// rows[z * groups + g] is the union of the group's pieces ({0, 0}: none).
constexpr int kKeyGroupKeys = 128;   // entries a group: the rows of a backward CTA
constexpr int kKeySegmentRows = 1024;  // rows a segment: 32 query tiles of the dk/dv walk
constexpr int kMaxKeySegments = 16;    // of kKeySegmentRows, or of a multiple of it with entries of seqlen_k
// More rows: segments of kLongSegmentRows where a selection's pieces bound a
// segment's entries, so that the dk/dv CTAs running at once add to the dq sums
// of a few thousand rows (they stay in the L2), at any length.
constexpr int kLongSegmentRows = 2048;

struct KeyGroups {
  std::int32_t* order = nullptr;
  std::int32_t* rank = nullptr;
  std::int32_t* pieces = nullptr;
  std::int32_t* first = nullptr;
  KeyRows* rows = nullptr;
  std::int64_t groups = 0;    // per slice
  std::int64_t segments = 1;  // per slice
  std::int64_t segment_rows = 0;
  std::int64_t entries = 0;  // entries of a (slice, segment) in order and rank
  int* overflow = nullptr;   // compact entries: set where a segment had more pieces (given intervals)
};

// Enqueues the grouping of sel (kIntervals) on stream. `heads` / `kv_heads`
// query / kv heads, seqlen_q, seqlen_k, cu_seqlens_q and cu_seqlens_k as in the
// Problem (device, varlen only), w the keep window. split: cut at kKeySegmentRows, or
// at a multiple of it for more than kMaxKeySegments segments (the partial
// dk/dv of a key's pieces are then added in order; needs sort).
KeyGroups group_keys(const DeviceSelection& sel, std::int64_t batch, std::int64_t heads, std::int64_t kv_heads,
                     std::int64_t seqlen_q, std::int64_t seqlen_k, const std::int32_t* cu_seqlens_q,
                     const std::int32_t* cu_seqlens_k, std::int64_t w, bool sort, bool split, cudaStream_t stream);
void free_groups(KeyGroups& groups, cudaStream_t stream);

}  // namespace dmattn::cuda
