// CPU backward in two passes that recompute p_ij from lse, each owning its outputs
// (no atomics, deterministic for any thread count):
//   dq pass:  one task per (batch, query head, row block), keys as in the forward.
//   dkv pass: one task per (batch, kv head, key block) owning dk and dv of those keys;
//             where a dbias element sums over batches, kv heads or keys (a broadcast
//             bias), the task widens to cover all of them, so that every dbias element
//             is reduced by one task in a fixed order and written once.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "head.h"
#include "kernels.h"
#include "parallel.h"
#include "tile.h"

namespace dmattn::cpu {
namespace {

// Per-row inputs of the backward for rows [row0, row0 + n) of (b, h): q, do, lse, delta.
template <class A>
struct RowBlock {
  std::vector<A> Q, dO, lse, delta;

  void load(const Problem& p, std::int64_t b, std::int64_t h, std::int64_t row0, std::int64_t n) {
    const std::int64_t D = p.head_dim;
    Q.resize(n * D), dO.resize(n * D), lse.resize(n), delta.resize(n);
    std::vector<A> O(n * D);
    load_rows(p.q, b, h, row0, n, D, Q.data());
    load_rows(p.dout, b, h, row0, n, D, dO.data());
    load_rows(p.out, b, h, row0, n, D, O.data());
    row_dots(n, D, dO.data(), O.data(), delta.data());
    read(p.lse.data, p.lse.dtype, b * p.lse.sb + h * p.lse.sh + row0 * p.lse.sr, n, Strided{p.lse.sr}, lse.data());
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
    softmax_backward(nr, nc, ld, rows.lse.data(), rows.delta.data(), softcap, P.data(), G.data(), T.data());
  }
  const A* dS() const { return softcap ? T.data() : G.data(); }
};

template <class A>
void dq_block(const Problem& p, const Selection& sel, std::int64_t b, std::int64_t h, std::int64_t i0, std::int64_t i1) {
  const HeadLogits<A> head(p, sel, b, h);
  const std::int64_t D = p.head_dim, nr = i1 - i0, kvh = h / p.group(), qs = p.q_start(b);
  RowBlock<A> rows;
  rows.load(p, b, h, qs + i0, nr);
  std::vector<std::int64_t> keys;
  std::vector<A> key_scratch, dQ(nr * D, A(0));
  head.candidate_keys(i0, i1, keys, key_scratch);
  KeyTile<A> kt;
  GradTile<A> tile;
  for (std::size_t k0 = 0; k0 < keys.size(); k0 += kBlockKeys) {
    const std::int64_t nc = std::min<std::int64_t>(kBlockKeys, static_cast<std::int64_t>(keys.size() - k0));
    kt.load(p, b, kvh, keys.data() + k0, nc);
    tile.compute(p, head, rows, kt, i0, nr, keys.data() + k0, nc);
    accumulate_wy(nr, nc, D, kBlockKeys, tile.dS(), kt.K.data(), dQ.data());
  }
  const A scale = static_cast<A>(p.scale);
  for (A& x : dQ) x *= scale;
  store_rows(p.dq, b, h, qs + i0, nr, D, dQ.data());
}

// A dkv task: batches [b0, b1), kv heads [kvh0, kvh1), key blocks [kb0, kb1).
struct DkvTask {
  std::int64_t b0, b1, kvh0, kvh1, kb0, kb1;
};

// The dbias elements one task reduces: bias heads [hb0, hb0 + nhb), every bias
// row, and the task's keys (one column when the bias broadcasts over keys), of
// bias batch b_bias. Summed in A in the task's fixed order, rounded once.
template <class A>
struct BiasGradSlice {
  std::int64_t b_bias = 0, hb0 = 0, nhb = 0, rows = 0, cols = 0, j0 = 0;
  std::vector<A> acc;

  void init(const Problem& p, const DkvTask& t) {
    const BroadcastShape& bs = p.bias_shape;
    b_bias = bs.batch == 1 ? 0 : t.b0;
    hb0 = p.operand_head(t.kvh0 * p.group(), bs.heads);
    nhb = bs.heads == p.heads ? p.group() : 1;
    rows = bs.rows;
    j0 = t.kb0 * kBlockKeys;
    cols = bs.cols == 1 ? 1 : std::max<std::int64_t>(0, std::min(p.k_len(t.b0), t.kb1 * kBlockKeys) - j0);
    acc.assign(static_cast<std::size_t>(nhb * rows * cols), A(0));
  }

  // Adds dS of rows [i0, i0 + nr) x keys [k0, k0 + nc) of query head h.
  void add(const Problem& p, std::int64_t h, std::int64_t i0, std::int64_t nr, std::int64_t k0, std::int64_t nc,
           const A* dS) {
    const std::int64_t hb = p.operand_head(h, p.bias_shape.heads) - hb0;
    for (std::int64_t r = 0; r < nr; ++r) {
      A* dst = &acc[static_cast<std::size_t>((hb * rows + (rows == 1 ? 0 : i0 + r)) * cols)];
      if (cols == 1) {
        for (std::int64_t c = 0; c < nc; ++c) dst[0] += dS[r * kBlockKeys + c];
      } else {
        for (std::int64_t c = 0; c < nc; ++c) dst[k0 - j0 + c] += dS[r * kBlockKeys + c];
      }
    }
  }

  void store(const Problem& p) const {
    const Operand& db = p.dbias;
    const std::int64_t ks = cols == 1 ? 0 : p.k_start(b_bias) + j0;
    for (std::int64_t hb = 0; hb < nhb; ++hb)
      for (std::int64_t i = 0; i < rows; ++i)
        write(db.data, db.dtype, b_bias * db.sb + (hb0 + hb) * db.sh + i * db.sr + ks * db.sc, cols,
              Strided{db.sc}, &acc[static_cast<std::size_t>((hb * rows + i) * cols)]);
  }
};

// Rows of head `head` that may use some key of [j0, j1).
template <class A>
std::pair<std::int64_t, std::int64_t> row_range(const Selection& sel, const HeadLogits<A>& head, std::int64_t b,
                                                std::int64_t h, std::int64_t j0, std::int64_t j1) {
  const Geometry& g = head.geometry();
  std::int64_t r0 = g.first_row(j0), r1 = g.last_row(j1);
  if (sel.mode == Selection::kIntervals) {
    std::int64_t lo = g.sq, hi = 0;
    for (std::int64_t j = j0; j < j1; ++j) {
      const RowInterval& iv = sel.interval(b, h, j);
      if (iv.start < iv.end) lo = std::min(lo, iv.start), hi = std::max(hi, iv.end);
    }
    r0 = std::max(r0, lo), r1 = std::min(r1, hi);
  }
  return {r0, r1};
}

template <class A>
void dkv_task(const Problem& p, const Selection& sel, const DkvTask& t) {
  const std::int64_t D = p.head_dim, G = p.group(), ld = kBlockKeys;
  const A scale = static_cast<A>(p.scale);
  BiasGradSlice<A> dbias;
  if (p.dbias.present()) dbias.init(p, t);
  RowBlock<A> rows;
  KeyTile<A> kt;
  GradTile<A> tile;
  std::vector<A> dK(ld * D), dV(ld * D);
  std::vector<std::int64_t> keys(ld);
  for (std::int64_t b = t.b0; b < t.b1; ++b) {
    const std::int64_t sk = p.k_len(b), qs = p.q_start(b), ks = p.k_start(b);
    for (std::int64_t kvh = t.kvh0; kvh < t.kvh1; ++kvh) {
      for (std::int64_t kb = t.kb0; kb < t.kb1; ++kb) {
        const std::int64_t j0 = kb * ld, nc = std::min(sk, j0 + ld) - j0;
        if (nc <= 0) break;
        for (std::int64_t c = 0; c < nc; ++c) keys[c] = j0 + c;
        kt.load(p, b, kvh, keys.data(), nc);
        std::fill(dK.begin(), dK.end(), A(0));
        std::fill(dV.begin(), dV.end(), A(0));
        for (std::int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
          const HeadLogits<A> head(p, sel, b, h);
          const auto [r0, r1] = row_range(sel, head, b, h, j0, j0 + nc);
          for (std::int64_t i0 = r0; i0 < r1; i0 += kBlockRows) {
            const std::int64_t nr = std::min(r1, i0 + kBlockRows) - i0;
            rows.load(p, b, h, qs + i0, nr);
            tile.compute(p, head, rows, kt, i0, nr, keys.data(), nc);
            accumulate_wtx(nr, nc, D, ld, tile.P.data(), rows.dO.data(), dV.data());
            accumulate_wtx(nr, nc, D, ld, tile.dS(), rows.Q.data(), dK.data());
            if (p.dbias.present()) dbias.add(p, h, i0, nr, j0, nc, tile.G.data());
          }
        }
        for (std::int64_t e = 0; e < nc * D; ++e) dK[e] *= scale;
        store_rows(p.dk, b, kvh, ks + j0, nc, D, dK.data());
        store_rows(p.dv, b, kvh, ks + j0, nc, D, dV.data());
      }
    }
  }
  if (p.dbias.present()) dbias.store(p);
}

}  // namespace

template <class A>
void backward(const Problem& p, const Selection& sel) {
  const std::int64_t q_blocks = (p.seqlen_q + kBlockRows - 1) / kBlockRows;
  parallel_for(p.batch * p.heads * q_blocks, [&](std::int64_t task) {
    const std::int64_t blk = task % q_blocks, bh = task / q_blocks;
    const std::int64_t b = bh / p.heads, h = bh % p.heads;
    const std::int64_t sq = p.q_len(b), i0 = blk * kBlockRows;
    if (i0 < sq) dq_block<A>(p, sel, b, h, i0, std::min(sq, i0 + kBlockRows));
  });
  // Widen a task over every dimension a dbias element sums over.
  const BroadcastShape& bs = p.bias_shape;
  const bool db = p.dbias.present();
  const std::int64_t k_blocks = (p.seqlen_k + kBlockKeys - 1) / kBlockKeys;
  const std::int64_t nb = db && bs.batch == 1 ? 1 : p.batch;
  const std::int64_t nh = db && bs.heads == 1 ? 1 : p.kv_heads;
  const std::int64_t nk = db && bs.cols == 1 ? 1 : k_blocks;
  parallel_for(nb * nh * nk, [&](std::int64_t task) {
    const std::int64_t tk = task % nk, th = (task / nk) % nh, tb = task / (nk * nh);
    DkvTask t{tb, tb + 1, th, th + 1, tk, tk + 1};
    if (nb == 1) t.b0 = 0, t.b1 = p.batch;
    if (nh == 1) t.kvh0 = 0, t.kvh1 = p.kv_heads;
    if (nk == 1) t.kb0 = 0, t.kb1 = k_blocks;
    dkv_task<A>(p, sel, t);
  });
}

template void backward<float>(const Problem&, const Selection&);
template void backward<double>(const Problem&, const Selection&);

}  // namespace dmattn::cpu
