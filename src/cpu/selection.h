// Top-k selection of SPEC 3 (keep_window_size = w) on the CPU, computed once per
// call for every (batch, selection head) before any attention work, or given.
//
// Query-broadcast bias (its Sq dimension is 1) with causal / right-window limits
// and at most a key-only mask (Problem::topk_by_intervals): the rows that select
// key j form one interval [start_j, end_j), O(Sk log Sk) time and O(Sk) memory
// per head, or the caller's (Problem::topk_intervals). Otherwise each row keeps a
// threshold (the w-th largest (bias, key) pair): O(Sq) memory per head, O(Sq *
// Sk) time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "../problem.h"

namespace dmattn::cpu {

struct RowInterval {
  std::int64_t start = 0, end = 0;  // rows [start, end) select the key
};

// A row selects key j iff (bias_ij, j) >= (value, key) lexicographically: larger
// bias first, ties to the larger key index. The default selects every key.
struct Threshold {
  double value = -std::numeric_limits<double>::infinity();
  std::int64_t key = -1;
  bool selects(double bias, std::int64_t j) const { return bias > value || (bias == value && j >= key); }
};

// Per (batch, selection head) (Problem::topk_heads: query head h uses selection
// head h / group): Sk intervals, int32 {start, end} pairs in the layout of
// Problem::topk_intervals, or Sq thresholds.
struct Selection {
  enum Mode { kNone, kIntervals, kThresholds };
  Mode mode = kNone;
  const Problem* problem = nullptr;
  std::int64_t heads = 0, group = 1, per_head = 0;  // entries per (b, s): Sk intervals or Sq thresholds
  const std::int32_t* given = nullptr;  // the caller's intervals; else `computed`
  std::vector<std::int32_t> computed;
  std::vector<Threshold> thresholds;

  // The rows of (b, query head h) that select key j: the interval clamped to the
  // sequence's rows, empty when it has none. The one place intervals are read:
  // given ones are user data, whatever their values.
  RowInterval interval(std::int64_t b, std::int64_t h, std::int64_t j) const {
    const std::int32_t* r = (given != nullptr ? given : computed.data()) + 2 * index(b, h, j);
    const std::int64_t start = std::max<std::int64_t>(r[0], 0), end = std::min<std::int64_t>(r[1], problem->q_len(b));
    return start < end ? RowInterval{start, end} : RowInterval{};
  }
  const Threshold& threshold(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return thresholds[static_cast<std::size_t>(index(b, h, i))];
  }

 private:
  std::int64_t index(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return (b * heads + h / group) * per_head + i;
  }
};

// The selection of p (which outlives it): none, the given intervals, or computed.
Selection select_topk(const Problem& p);
// The intervals of p (Problem::topk_as_intervals) into `out`, in the layout of
// Problem::topk_intervals (select_topk of the API).
void write_intervals(const Problem& p, std::int32_t* out);

}  // namespace dmattn::cpu
