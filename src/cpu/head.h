// One (batch, query head) of a Problem as the CPU backend sees it: where its
// rows live, which keys a row may see, and the logits of a tile.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../problem.h"
#include "convert.h"
#include "selection.h"

namespace dmattn::cpu {

// Query rows per tile and keys per tile. 64 x 64 accumulators stay in L1/L2
// next to a 64 x D block of q and of k, and the key loop vectorises over 64.
constexpr std::int64_t kBlockRows = 64;
constexpr std::int64_t kBlockKeys = 64;

// Row limits of (batch b, query head h): causal and window are arithmetic.
struct Geometry {
  std::int64_t sq = 0, sk = 0;
  std::int64_t offset = 0;  // sk - sq: bottom-right alignment
  bool causal = false;
  std::int64_t left = -1, right = -1;

  Geometry(const Problem& p, std::int64_t b)
      : sq(p.q_len(b)), sk(p.k_len(b)), offset(sk - sq), causal(p.causal),
        left(p.window_left), right(p.window_right) {}

  // Row i may see keys [lo(i), hi(i)); both are non-decreasing in i.
  std::int64_t lo(std::int64_t i) const { return left < 0 ? 0 : std::clamp(i + offset - left, std::int64_t{0}, sk); }
  std::int64_t hi(std::int64_t i) const {
    std::int64_t h = sk;
    if (causal) h = std::min(h, i + offset + 1);
    if (right >= 0) h = std::min(h, i + offset + right + 1);
    return std::max(h, std::int64_t{0});
  }
  // Rows that may see some key of [j0, j1): [first, last).
  std::int64_t first_row(std::int64_t j0) const {
    std::int64_t r = 0;
    if (causal) r = std::max(r, j0 - offset);
    if (right >= 0) r = std::max(r, j0 - offset - right);
    return std::min(r, sq);
  }
  std::int64_t last_row(std::int64_t j1) const {
    if (left < 0) return sq;
    return std::clamp(j1 - 1 - offset + left + 1, std::int64_t{0}, sq);
  }
};

// Logits of (batch b, query head h): l_ij = softcap(scale * s_ij) + bias_ij, or
// -inf where the entry is not allowed (mask, causal, window, top-k selection, a
// bias of -inf). Other logits are clamped to A's range so that no sum of finite
// inputs overflows.
template <class A>
class HeadLogits {
 public:
  HeadLogits(const Problem& p, const Selection& sel, std::int64_t b, std::int64_t h)
      : p_(p), sel_(sel), b_(b), h_(h), g_(p, b), qs_(p.q_start(b)), ks_(p.k_start(b)),
        mask_base_(p.mask_base(b, h)), bias_base_(p.bias_base(b, h)) {}

  const Geometry& geometry() const { return g_; }

  // Keys that may be allowed for some row of [i0, i1), ascending. Keys masked for
  // every row (a key-only mask) and keys no row of the block selects are skipped.
  void candidate_keys(std::int64_t i0, std::int64_t i1, std::vector<std::int64_t>& keys,
                      std::vector<A>& scratch) const {
    keys.clear();
    const std::int64_t j0 = g_.lo(i0), j1 = g_.hi(i1 - 1);
    if (j1 <= j0) return;
    const bool key_only_mask = p_.mask.present() && p_.mask_shape.rows == 1;
    scratch.resize(static_cast<std::size_t>(j1 - j0));
    if (key_only_mask)
      read(p_.mask.data, DType::kBool, mask_base_ + (ks_ + j0) * p_.mask.sc, j1 - j0, Strided{p_.mask.sc},
           scratch.data());
    for (std::int64_t j = j0; j < j1; ++j) {
      if (key_only_mask && scratch[j - j0] == A(0)) continue;
      if (sel_.mode == Selection::kIntervals) {
        const RowInterval r = sel_.interval(b_, h_, j);
        if (r.end <= i0 || r.start >= i1) continue;
      }
      keys.push_back(j);
    }
  }

  // L[r * ld + c] for rows i0 + r (r < nrows) and keys keys[c] (c < ncols). On entry
  // L holds the raw dot products <q_i, k_j>; T (if softcap) receives tanh(s / softcap).
  // `row` is scratch for one row of ncols values.
  void logits(std::int64_t i0, std::int64_t nrows, const std::int64_t* keys, std::int64_t ncols,
              std::int64_t ld, A* L, A* T, A* row) const {
    const A scale = static_cast<A>(p_.scale), cap = static_cast<A>(p_.softcap);
    const A inv_cap = cap > A(0) ? A(1) / cap : A(0);
    constexpr A kInf = std::numeric_limits<A>::infinity();
    constexpr A kMax = std::numeric_limits<A>::max();
    for (std::int64_t r = 0; r < nrows; ++r) {
      const std::int64_t i = i0 + r;
      A* l = L + r * ld;
      for (std::int64_t c = 0; c < ncols; ++c) {
        A s = l[c] * scale;
        if (cap > A(0)) {
          const A t = std::tanh(s * inv_cap);
          T[r * ld + c] = t;
          s = cap * t;
        }
        l[c] = s;
      }
      if (p_.bias.present()) {
        read(p_.bias.data, p_.bias.dtype, bias_base_ + (qs_ + i) * p_.bias.sr + ks_ * p_.bias.sc, ncols,
             Gathered{keys, p_.bias.sc}, row);
        for (std::int64_t c = 0; c < ncols; ++c) l[c] = row[c] == -kInf ? -kInf : std::clamp(l[c] + row[c], -kMax, kMax);
        if (sel_.mode == Selection::kThresholds) {
          const Threshold& t = sel_.threshold(b_, h_, i);
          for (std::int64_t c = 0; c < ncols; ++c)
            if (!t.selects(static_cast<double>(row[c]), keys[c])) l[c] = -kInf;
        }
      }
      const std::int64_t lo = g_.lo(i), hi = g_.hi(i);
      for (std::int64_t c = 0; c < ncols; ++c)
        if (keys[c] < lo || keys[c] >= hi) l[c] = -kInf;
      if (p_.mask.present()) {
        read(p_.mask.data, DType::kBool, mask_base_ + (qs_ + i) * p_.mask.sr + ks_ * p_.mask.sc, ncols,
             Gathered{keys, p_.mask.sc}, row);
        for (std::int64_t c = 0; c < ncols; ++c)
          if (row[c] == A(0)) l[c] = -kInf;
      }
      if (sel_.mode == Selection::kIntervals) {
        for (std::int64_t c = 0; c < ncols; ++c) {
          const RowInterval r = sel_.interval(b_, h_, keys[c]);
          if (i < r.start || i >= r.end) l[c] = -kInf;
        }
      }
    }
  }

 private:
  const Problem& p_;
  const Selection& sel_;
  std::int64_t b_, h_;
  Geometry g_;
  std::int64_t qs_, ks_;
  std::int64_t mask_base_, bias_base_;
};

}  // namespace dmattn::cpu
