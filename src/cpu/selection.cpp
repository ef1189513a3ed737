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

// Per-key row intervals of one head, {start, end} pairs of the sequence's keys
// (the first g.sk of out's). Keys are visited from the strongest (bias, index)
// down; when key j is reached, the tree holds exactly the keys that beat it. Row
// i sees the key prefix [0, hi(i)), so j stops being selected at the first row
// that sees the w-th beater in index order.
void key_intervals(const Geometry& g, const double* bias, const double* key_mask, std::int64_t w,
                   std::int32_t* out) {
  std::vector<std::int64_t> order;
  order.reserve(static_cast<std::size_t>(g.sk));
  for (std::int64_t j = 0; j < g.sk; ++j) {
    out[2 * j] = out[2 * j + 1] = 0;
    if (key_mask == nullptr || key_mask[j] != 0.0) order.push_back(j);
  }
  std::sort(order.begin(), order.end(),
            [&](std::int64_t a, std::int64_t b) { return beats(bias[a], a, bias[b], b); });
  Fenwick beaters(g.sk);
  for (std::size_t n = 0; n < order.size(); ++n) {
    const std::int64_t j = order[n];
    const std::int64_t start = g.first_row(j);
    const std::int64_t end = static_cast<std::int64_t>(n) >= w ? g.first_row(beaters.kth(w)) : g.sq;
    if (start < end) out[2 * j] = static_cast<std::int32_t>(start), out[2 * j + 1] = static_cast<std::int32_t>(end);
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

void write_intervals(const Problem& p, std::int32_t* out) {
  const std::int64_t heads = p.topk_heads(), group = p.heads / heads;
  parallel_for(p.batch * heads, [&](std::int64_t task) {
    const std::int64_t b = task / heads, h = task % heads * group;
    const Geometry g(p, b);
    std::int32_t* const head_out = out + 2 * task * p.seqlen_k;
    std::fill(head_out + 2 * g.sk, head_out + 2 * p.seqlen_k, 0);  // keys past a varlen sequence
    const std::int64_t ks = p.k_start(b);
    std::vector<double> bias(static_cast<std::size_t>(g.sk)), mask;
    read(p.bias.data, p.bias.dtype, p.bias_base(b, h) + ks * p.bias.sc, g.sk, Strided{p.bias.sc}, bias.data());
    if (p.mask.present()) {
      mask.resize(static_cast<std::size_t>(g.sk));
      read(p.mask.data, DType::kBool, p.mask_base(b, h) + ks * p.mask.sc, g.sk, Strided{p.mask.sc}, mask.data());
    }
    key_intervals(g, bias.data(), p.mask.present() ? mask.data() : nullptr, p.keep_window_size, head_out);
  });
}

Selection select_topk(const Problem& p) {
  Selection sel;
  if (p.keep_window_size == 0) return sel;
  sel.problem = &p;
  sel.heads = p.topk_heads();
  sel.group = p.heads / sel.heads;
  if (p.topk_by_intervals()) {
    sel.mode = Selection::kIntervals;
    sel.per_head = p.seqlen_k;
    sel.given = p.topk_intervals;
    if (sel.given == nullptr) {
      sel.computed.resize(static_cast<std::size_t>(2 * p.batch * sel.heads * p.seqlen_k));
      write_intervals(p, sel.computed.data());
    }
    return sel;
  }
  sel.mode = Selection::kThresholds;
  sel.per_head = p.seqlen_q;
  sel.thresholds.resize(static_cast<std::size_t>(p.batch * sel.heads * p.seqlen_q));
  parallel_for(p.batch * sel.heads, [&](std::int64_t task) {
    const std::int64_t b = task / sel.heads, h = task % sel.heads * sel.group;
    row_thresholds(p, Geometry(p, b), b, h, sel.thresholds.data() + task * p.seqlen_q);
  });
  return sel;
}

}  // namespace dmattn::cpu
