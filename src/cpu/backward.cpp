// CPU backward in two passes, each owning its outputs (no atomics, deterministic
// for any thread count):
//   dq pass:  one task per (batch, query head, row block), keys as in the forward.
//             It first recomputes each row's softmax max and sum in A: a float32
//             lse cannot hold them where |lse| is large (a bias of 1e30), the
//             recomputed pair can. The dkv pass reads them from RowStats.
//   dkv pass: one task per (batch, kv head, key block) owning dk and dv of those keys;
//             where a dbias element sums over batches or kv heads (a broadcast bias),
//             the task widens to cover all of them, so that every dbias element is
//             reduced by one task in a fixed order and written once. (A bias constant
//             along keys has a zero gradient, written by the API: no dbias here.)
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "head.h"
#include "kernels.h"
#include "parallel.h"
#include "tile.h"

namespace dmattn::cpu {
namespace {

// Softmax max and 1 / sum of every (batch, query head, row), from the dq pass.
template <class A>
struct RowStats {
  std::int64_t heads = 0, rows = 0;
  std::vector<A> max, inv_sum;

  explicit RowStats(const Problem& p)
      : heads(p.heads), rows(p.seqlen_q),
        max(static_cast<std::size_t>(p.batch * p.heads * p.seqlen_q)), inv_sum(max.size()) {}
  std::size_t at(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return static_cast<std::size_t>((b * heads + h) * rows + i);
  }
};

// Per-row inputs of the backward for local rows [i0, i0 + n) of (b, h): q, do,
// delta = <do, o>, and the softmax statistics.
template <class A>
struct RowBlock {
  std::vector<A> Q, dO, O, max, inv_sum, delta;

  void load(const Problem& p, std::int64_t b, std::int64_t h, std::int64_t i0, std::int64_t n) {
    const std::int64_t D = p.head_dim, row0 = p.q_start(b) + i0;
    Q.resize(n * D), dO.resize(n * D), O.resize(n * D), max.resize(n), inv_sum.resize(n), delta.resize(n);
    load_rows(p.q, b, h, row0, n, D, Q.data());
    load_rows(p.dout, b, h, row0, n, D, dO.data());
    load_rows(p.out, b, h, row0, n, D, O.data());
    row_dots(n, D, dO.data(), O.data(), delta.data());
  }
  void load_stats(const RowStats<A>& stats, std::int64_t b, std::int64_t h, std::int64_t i0, std::int64_t n) {
    std::copy_n(&stats.max[stats.at(b, h, i0)], n, max.begin());
    std::copy_n(&stats.inv_sum[stats.at(b, h, i0)], n, inv_sum.begin());
  }
};

// K and V of a key tile, both as rows and transposed.
template <class A>
struct KeyTile {
  std::vector<A> K, KT, VT, scratch;

  void load(const Problem& p, std::int64_t b, std::int64_t kvh, const std::int64_t* keys, std::int64_t n) {
    const std::int64_t D = p.head_dim, ld = kBlockKeys, ks = p.k_start(b);
    K.resize(ld * D), KT.resize(D * ld), VT.resize(D * ld), scratch.resize(D);
    gather_keys(p.k, b, kvh, ks, keys, n, D, ld, KT.data(), K.data(), scratch.data());
    gather_keys(p.v, b, kvh, ks, keys, n, D, ld, VT.data(), static_cast<A*>(nullptr), scratch.data());
  }
};

// Gradient tile of rows [i0, i0 + nr) against keys: on return P = p_ij, G = dS_ij
// (the dbias term) and dS() the score gradient (with softcap's factor).
template <class A>
struct GradTile {
  std::vector<A> P, G, T, row;
  bool softcap = false;

  void compute(const Problem& p, const HeadLogits<A>& head, const RowBlock<A>& rows, const KeyTile<A>& kt,
               std::int64_t i0, std::int64_t nr, const std::int64_t* keys, std::int64_t nc) {
    const std::int64_t D = p.head_dim, ld = kBlockKeys;
    P.resize(nr * ld), G.resize(nr * ld), T.resize(nr * ld), row.resize(ld);
    softcap = p.softcap > 0.0;
    matmul_xyt(nr, nc, D, ld, rows.Q.data(), kt.KT.data(), P.data());
    head.logits(i0, nr, keys, nc, ld, P.data(), T.data(), row.data());
    matmul_xyt(nr, nc, D, ld, rows.dO.data(), kt.VT.data(), G.data());
    softmax_backward(nr, nc, ld, rows.max.data(), rows.inv_sum.data(), rows.delta.data(), softcap, P.data(), G.data(),
                     T.data());
  }
  const A* dS() const { return softcap ? T.data() : G.data(); }
};

template <class A>
void dq_block(const Problem& p, const Selection& sel, RowStats<A>& stats, std::int64_t b, std::int64_t h,
              std::int64_t i0, std::int64_t i1) {
  const HeadLogits<A> head(p, sel, b, h);
  const std::int64_t D = p.head_dim, nr = i1 - i0, kvh = h / p.group(), ld = kBlockKeys;
  RowBlock<A> rows;
  rows.load(p, b, h, i0, nr);
  std::vector<std::int64_t> keys;
  std::vector<A> key_scratch, dQ(nr * D, A(0)), L(nr * ld), T(nr * ld), row(ld), sum(nr, A(0)), alpha(nr);
  head.candidate_keys(i0, i1, keys, key_scratch);
  KeyTile<A> kt;
  std::fill(rows.max.begin(), rows.max.end(), -std::numeric_limits<A>::infinity());
  for (std::size_t k0 = 0; k0 < keys.size(); k0 += ld) {  // softmax statistics of the rows
    const std::int64_t nc = std::min<std::int64_t>(ld, static_cast<std::int64_t>(keys.size() - k0));
    kt.load(p, b, kvh, keys.data() + k0, nc);
    matmul_xyt(nr, nc, D, ld, rows.Q.data(), kt.KT.data(), L.data());
    head.logits(i0, nr, keys.data() + k0, nc, ld, L.data(), T.data(), row.data());
    online_softmax(nr, nc, ld, L.data(), rows.max.data(), sum.data(), alpha.data());
  }
  for (std::int64_t r = 0; r < nr; ++r) {
    rows.inv_sum[r] = sum[r] > A(0) ? A(1) / sum[r] : A(0);
    stats.max[stats.at(b, h, i0 + r)] = rows.max[r];
    stats.inv_sum[stats.at(b, h, i0 + r)] = rows.inv_sum[r];
  }
  GradTile<A> tile;
  for (std::size_t k0 = 0; k0 < keys.size(); k0 += ld) {
    const std::int64_t nc = std::min<std::int64_t>(ld, static_cast<std::int64_t>(keys.size() - k0));
    kt.load(p, b, kvh, keys.data() + k0, nc);
    tile.compute(p, head, rows, kt, i0, nr, keys.data() + k0, nc);
    accumulate_wy(nr, nc, D, ld, tile.dS(), kt.K.data(), dQ.data());
  }
  const A scale = static_cast<A>(p.scale);
  for (A& x : dQ) x *= scale;
  store_rows(p.dq, b, h, p.q_start(b) + i0, nr, D, dQ.data());
}

// A dkv task: batches [b0, b1), kv heads [kvh0, kvh1), key group g.
struct DkvTask {
  std::int64_t b0, b1, kvh0, kvh1, g;
};

// Keys per group-sorting window: groups are formed inside windows of this many
// consecutive keys, so a group's keys stay close (a narrow causal row start).
constexpr std::int64_t kGroupWindow = 8 * kBlockKeys;

// The keys of group g (kBlockKeys of them, fewer at the end) of a sequence with
// sk keys. Without top-k intervals a group is a block of consecutive keys. With
// them, the keys of a window are ordered by the last row that selects them
// (for the reference head (b, h)), so that keys used by similar row ranges share
// a group and a row block meets few groups whose keys it does not select.
void key_group(const Selection& sel, std::int64_t b, std::int64_t h, std::int64_t sk, std::int64_t g,
               std::vector<std::int64_t>& keys) {
  keys.clear();
  if (sel.mode != Selection::kIntervals) {
    for (std::int64_t j = g * kBlockKeys; j < std::min(sk, (g + 1) * kBlockKeys); ++j) keys.push_back(j);
    return;
  }
  const std::int64_t w0 = g * kBlockKeys / kGroupWindow * kGroupWindow, w1 = std::min(sk, w0 + kGroupWindow);
  if (w1 <= w0) return;  // past this sequence's keys (varlen: a shorter sequence than the longest)
  std::vector<std::int64_t> window(static_cast<std::size_t>(w1 - w0));
  std::iota(window.begin(), window.end(), w0);
  std::stable_sort(window.begin(), window.end(), [&](std::int64_t x, std::int64_t y) {
    return sel.interval(b, h, x).end < sel.interval(b, h, y).end;
  });
  const std::int64_t first = g * kBlockKeys - w0;
  for (std::int64_t a = first; a < std::min(w1 - w0, first + kBlockKeys); ++a) keys.push_back(window[a]);
}

// The dbias elements one task reduces: bias heads [hb0, hb0 + nhb), every bias
// row, and the keys of one group, of bias batch b_bias. Summed in A in the
// task's fixed order, rounded once.
template <class A>
struct BiasGradSlice {
  std::int64_t b_bias = 0, hb0 = 0, nhb = 0, rows = 0, cols = 0;
  std::vector<A> acc;

  void init(const Problem& p, const DkvTask& t, std::int64_t columns) {
    const BroadcastShape& bs = p.bias_shape;
    b_bias = bs.batch == 1 ? 0 : t.b0;
    hb0 = p.operand_head(t.kvh0 * p.group(), bs.heads);
    nhb = bs.heads == p.heads ? p.group() : 1;
    rows = bs.rows;
    cols = columns;
    acc.assign(static_cast<std::size_t>(nhb * rows * cols), A(0));
  }

  // Adds dS of rows [i0, i0 + nr) x group positions pos[a] (a < na) of query head h.
  void add(const Problem& p, std::int64_t h, std::int64_t i0, std::int64_t nr, const std::int64_t* pos,
           std::int64_t na, const A* dS) {
    const std::int64_t hb = p.operand_head(h, p.bias_shape.heads) - hb0;
    for (std::int64_t r = 0; r < nr; ++r) {
      A* dst = acc.data() + (hb * rows + (rows == 1 ? 0 : i0 + r)) * cols;
      for (std::int64_t a = 0; a < na; ++a) dst[pos[a]] += dS[r * kBlockKeys + a];
    }
  }

  // Writes the slice; keys are the task's group.
  void store(const Problem& p, const std::vector<std::int64_t>& keys) const {
    const Operand& db = p.dbias;
    const std::int64_t ks = p.k_start(b_bias);
    for (std::int64_t hb = 0; hb < nhb; ++hb)
      for (std::int64_t i = 0; i < rows; ++i) {
        const std::int64_t base = b_bias * db.sb + (hb0 + hb) * db.sh + i * db.sr;
        const A* src = acc.data() + (hb * rows + i) * cols;  // acc may be empty (no keys): no operator[]
        write(db.data, db.dtype, base + ks * db.sc, cols, Gathered{keys.data(), db.sc}, src);
      }
  }
};

// Rows of head `head` that may use some key of the group: [first, last).
template <class A>
std::pair<std::int64_t, std::int64_t> row_range(const Selection& sel, const HeadLogits<A>& head, std::int64_t b,
                                                std::int64_t h, const std::vector<std::int64_t>& keys) {
  const Geometry& g = head.geometry();
  const auto [jmin, jmax] = std::minmax_element(keys.begin(), keys.end());
  std::int64_t r0 = g.first_row(*jmin), r1 = g.last_row(*jmax + 1);
  if (sel.mode == Selection::kIntervals) {
    std::int64_t lo = g.sq, hi = 0;
    for (std::int64_t j : keys) {
      const RowInterval iv = sel.interval(b, h, j);
      if (iv.start < iv.end) lo = std::min(lo, iv.start), hi = std::max(hi, iv.end);
    }
    r0 = std::max(r0, lo), r1 = std::min(r1, hi);
  }
  return {r0, r1};
}

// Positions (into keys) of the keys that some row of [i0, i1) may select.
void active_keys(const Selection& sel, std::int64_t b, std::int64_t h, const std::vector<std::int64_t>& keys,
                 std::int64_t i0, std::int64_t i1, std::vector<std::int64_t>& pos) {
  pos.clear();
  for (std::size_t a = 0; a < keys.size(); ++a) {
    if (sel.mode == Selection::kIntervals) {
      const RowInterval iv = sel.interval(b, h, keys[a]);
      if (iv.end <= i0 || iv.start >= i1) continue;
    }
    pos.push_back(static_cast<std::int64_t>(a));
  }
}

// dk, dv (and the dbias slice) of the task's key groups. Each row block gathers
// only the group's keys it may select, accumulates into tile-local sums and adds
// them to the group's sums, so a key costs the row blocks that use it.
template <class A>
void dkv_task(const Problem& p, const Selection& sel, const RowStats<A>& stats, const DkvTask& t) {
  const std::int64_t D = p.head_dim, G = p.group(), ld = kBlockKeys;
  const A scale = static_cast<A>(p.scale);
  BiasGradSlice<A> dbias;
  RowBlock<A> rows;
  KeyTile<A> kt;
  GradTile<A> tile;
  std::vector<A> dK(ld * D), dV(ld * D), dK_tile(ld * D), dV_tile(ld * D);
  std::vector<std::int64_t> keys, pos, active;
  // Every (b, kvh) of the task shares the groups of its first head, so a dbias
  // column the task owns is the same key throughout.
  key_group(sel, t.b0, t.kvh0 * G, p.k_len(t.b0), t.g, keys);
  const std::int64_t nc = static_cast<std::int64_t>(keys.size());
  if (p.dbias.present()) dbias.init(p, t, nc);
  for (std::int64_t b = t.b0; b < t.b1 && nc > 0; ++b) {
    const std::int64_t ks = p.k_start(b);
    for (std::int64_t kvh = t.kvh0; kvh < t.kvh1; ++kvh) {
      std::fill(dK.begin(), dK.end(), A(0));
      std::fill(dV.begin(), dV.end(), A(0));
      for (std::int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
        const HeadLogits<A> head(p, sel, b, h);
        const auto [r0, r1] = row_range(sel, head, b, h, keys);
        for (std::int64_t i0 = r0; i0 < r1; i0 += kBlockRows) {
          const std::int64_t nr = std::min(r1, i0 + kBlockRows) - i0;
          active_keys(sel, b, h, keys, i0, i0 + nr, pos);
          const std::int64_t na = static_cast<std::int64_t>(pos.size());
          if (na == 0) continue;
          active.resize(pos.size());
          for (std::int64_t a = 0; a < na; ++a) active[a] = keys[pos[a]];
          kt.load(p, b, kvh, active.data(), na);
          rows.load(p, b, h, i0, nr);
          rows.load_stats(stats, b, h, i0, nr);
          tile.compute(p, head, rows, kt, i0, nr, active.data(), na);
          std::fill(dK_tile.begin(), dK_tile.begin() + na * D, A(0));
          std::fill(dV_tile.begin(), dV_tile.begin() + na * D, A(0));
          accumulate_wtx(nr, na, D, ld, tile.P.data(), rows.dO.data(), dV_tile.data());
          accumulate_wtx(nr, na, D, ld, tile.dS(), rows.Q.data(), dK_tile.data());
          for (std::int64_t a = 0; a < na; ++a) {
            A* dk = &dK[pos[a] * D];
            A* dv = &dV[pos[a] * D];
            for (std::int64_t d = 0; d < D; ++d) dk[d] += dK_tile[a * D + d], dv[d] += dV_tile[a * D + d];
          }
          if (p.dbias.present()) dbias.add(p, h, i0, nr, pos.data(), na, tile.G.data());
        }
      }
      for (std::int64_t c = 0; c < nc; ++c) {
        for (std::int64_t d = 0; d < D; ++d) dK[c * D + d] *= scale;
        store_rows(p.dk, b, kvh, ks + keys[c], 1, D, &dK[c * D]);
        store_rows(p.dv, b, kvh, ks + keys[c], 1, D, &dV[c * D]);
      }
    }
  }
  if (p.dbias.present()) dbias.store(p, keys);
}

}  // namespace

template <class A>
void backward(const Problem& p, const Selection& sel) {
  RowStats<A> stats(p);
  const std::int64_t q_blocks = (p.seqlen_q + kBlockRows - 1) / kBlockRows;
  parallel_for(p.batch * p.heads * q_blocks, [&](std::int64_t task) {
    const std::int64_t blk = task % q_blocks, bh = task / q_blocks;
    const std::int64_t b = bh / p.heads, h = bh % p.heads;
    const std::int64_t sq = p.q_len(b), i0 = blk * kBlockRows;
    if (i0 < sq) dq_block<A>(p, sel, stats, b, h, i0, std::min(sq, i0 + kBlockRows));
  });
  // Widen a task over every dimension a dbias element sums over.
  const BroadcastShape& bs = p.bias_shape;
  const bool db = p.dbias.present();
  const std::int64_t k_groups = (p.seqlen_k + kBlockKeys - 1) / kBlockKeys;
  const std::int64_t nb = db && bs.batch == 1 ? 1 : p.batch;
  const std::int64_t nh = db && bs.heads == 1 ? 1 : p.kv_heads;
  parallel_for(nb * nh * k_groups, [&](std::int64_t task) {
    const std::int64_t tk = task % k_groups, th = (task / k_groups) % nh, tb = task / (k_groups * nh);
    DkvTask t{tb, tb + 1, th, th + 1, tk};
    if (nb == 1) t.b0 = 0, t.b1 = p.batch;
    if (nh == 1) t.kvh0 = 0, t.kvh1 = p.kv_heads;
    dkv_task<A>(p, sel, stats, t);
  });
}

template void backward<float>(const Problem&, const Selection&);
template void backward<double>(const Problem&, const Selection&);

}  // namespace dmattn::cpu
