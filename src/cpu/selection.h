// Top-k selection of SPEC 3 (keep_window_size = w) on the CPU, computed once per
// call for every (batch, query head) before any attention work.
//
// Query-broadcast bias (its Sq dimension is 1) with causal / right-window limits
// and at most a key-only mask, more than a decode step's rows
// (Problem::topk_by_intervals): the rows that select key j form one interval
// [start_j, end_j), O(Sk log Sk) time and O(Sk) memory per head. Otherwise each
// row keeps a threshold (the w-th largest (bias, key) pair): O(Sq) memory per
// head, O(Sq * Sk) time.
#pragma once

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

struct Selection {
  enum Mode { kNone, kIntervals, kThresholds };
  Mode mode = kNone;
  std::int64_t heads = 0, per_head = 0;  // entries per (b, h): Sk intervals or Sq thresholds
  std::vector<RowInterval> intervals;
  std::vector<Threshold> thresholds;

  const RowInterval& interval(std::int64_t b, std::int64_t h, std::int64_t j) const {
    return intervals[static_cast<std::size_t>((b * heads + h) * per_head + j)];
  }
  const Threshold& threshold(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return thresholds[static_cast<std::size_t>((b * heads + h) * per_head + i)];
  }
};

Selection select_topk(const Problem& p);

}  // namespace dmattn::cpu
