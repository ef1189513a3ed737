#include "selection.h"

#include <algorithm>
#include <numeric>

#include "convert.h"
#include "head.h"
#include "parallel.h"

namespace dmattn::cpu {
namespace {

// Counts over key positions with "find the k-th present position" in O(log n).
class Fenwick {
 public:
  explicit Fenwick(std::int64_t n) : n_(n), tree_(static_cast<std::size_t>(n + 1), 0) {}
  void insert(std::int64_t pos) {
    for (std::int64_t i = pos + 1; i <= n_; i += i & -i) ++tree_[i];
  }
  // Position of the k-th smallest present position (k >= 1, k <= count).
  std::int64_t kth(std::int64_t k) const {
    std::int64_t pos = 0;
    std::int64_t step = 1;
    while (step * 2 <= n_) step *= 2;
    for (; step > 0; step /= 2) {
      if (pos + step <= n_ && tree_[pos + step] < k) {
        pos += step;
        k -= tree_[pos];
      }
    }
    return pos;  // 0-based: the (pos+1)-th slot
  }

 private:
  std::int64_t n_;
  std::vector<std::int64_t> tree_;
};

bool beats(double va, std::int64_t a, double vb, std::int64_t b) { return va > vb || (va == vb && a > b); }

// Per-key row intervals of one head. Keys are visited from the strongest (bias,
// index) down; when key j is reached, the tree holds exactly the keys that beat
// it. Row i sees the key prefix [0, hi(i)), so j stops being selected at the
// first row that sees the w-th beater in index order.
void key_intervals(const Geometry& g, const double* bias, const double* key_mask, std::int64_t w,
                   RowInterval* out) {
  std::vector<std::int64_t> order;
  order.reserve(static_cast<std::size_t>(g.sk));
  for (std::int64_t j = 0; j < g.sk; ++j) {
    out[j] = RowInterval{};
    if (key_mask == nullptr || key_mask[j] != 0.0) order.push_back(j);
  }
  std::sort(order.begin(), order.end(),
            [&](std::int64_t a, std::int64_t b) { return beats(bias[a], a, bias[b], b); });
  Fenwick beaters(g.sk);
  for (std::size_t n = 0; n < order.size(); ++n) {
    const std::int64_t j = order[n];
    const std::int64_t start = g.first_row(j);
    const std::int64_t end = static_cast<std::int64_t>(n) >= w ? g.first_row(beaters.kth(w)) : g.sq;
    if (start < end) out[j] = RowInterval{start, end};
    beaters.insert(j);
  }
}

// Per-row thresholds of one head: the w-th strongest allowed (bias, key) of each row.
void row_thresholds(const Problem& p, const Geometry& g, std::int64_t b, std::int64_t h, Threshold* out) {
  const std::int64_t qs = p.q_start(b), ks = p.k_start(b);
  const std::int64_t bias_base = p.bias_base(b, h), mask_base = p.mask_base(b, h);
  std::vector<double> bias(static_cast<std::size_t>(g.sk)), mask(static_cast<std::size_t>(g.sk));
  std::vector<std::pair<double, std::int64_t>> cand;
  const auto stronger = [](const auto& x, const auto& y) { return beats(x.first, x.second, y.first, y.second); };
  for (std::int64_t i = 0; i < g.sq; ++i) {
    out[i] = Threshold{};
    const std::int64_t lo = g.lo(i), hi = g.hi(i);
    if (hi - lo <= p.keep_window_size) continue;
    read(p.bias.data, p.bias.dtype, bias_base + (qs + i) * p.bias.sr + (ks + lo) * p.bias.sc, hi - lo,
         Strided{p.bias.sc}, bias.data());
    if (p.mask.present())
      read(p.mask.data, DType::kBool, mask_base + (qs + i) * p.mask.sr + (ks + lo) * p.mask.sc, hi - lo,
           Strided{p.mask.sc}, mask.data());
    cand.clear();
    for (std::int64_t j = lo; j < hi; ++j)
      if (!p.mask.present() || mask[j - lo] != 0.0) cand.emplace_back(bias[j - lo], j);
    if (static_cast<std::int64_t>(cand.size()) <= p.keep_window_size) continue;
    const auto kth = cand.begin() + (p.keep_window_size - 1);
    std::nth_element(cand.begin(), kth, cand.end(), stronger);
    out[i] = Threshold{kth->first, kth->second};
  }
}

}  // namespace

Selection select_topk(const Problem& p) {
  Selection sel;
  if (p.keep_window_size == 0) return sel;
  sel.mode = p.topk_by_intervals() ? Selection::kIntervals : Selection::kThresholds;
  sel.heads = p.heads;
  sel.per_head = sel.mode == Selection::kIntervals ? p.seqlen_k : p.seqlen_q;
  const auto size = static_cast<std::size_t>(p.batch * p.heads * sel.per_head);
  if (sel.mode == Selection::kIntervals) {
    sel.intervals.resize(size);
  } else {
    sel.thresholds.resize(size);
  }
  parallel_for(p.batch * p.heads, [&](std::int64_t task) {
    const std::int64_t b = task / p.heads, h = task % p.heads;
    const Geometry g(p, b);
    if (sel.mode == Selection::kThresholds) {
      row_thresholds(p, g, b, h, &sel.thresholds[static_cast<std::size_t>(task * sel.per_head)]);
      return;
    }
    const std::int64_t ks = p.k_start(b);
    std::vector<double> bias(static_cast<std::size_t>(g.sk)), mask;
    read(p.bias.data, p.bias.dtype, p.bias_base(b, h) + ks * p.bias.sc,
         g.sk, Strided{p.bias.sc}, bias.data());
    if (p.mask.present()) {
      mask.resize(static_cast<std::size_t>(g.sk));
      read(p.mask.data, DType::kBool,
           p.mask_base(b, h) + ks * p.mask.sc, g.sk,
           Strided{p.mask.sc}, mask.data());
    }
    key_intervals(g, bias.data(), p.mask.present() ? mask.data() : nullptr, p.keep_window_size,
                  &sel.intervals[static_cast<std::size_t>(task * sel.per_head)]);
  });
  return sel;
}

}  // namespace dmattn::cpu
