// Dense tile arithmetic of the CPU backend: small row-major blocks in the
// accumulation type A. Loops are ordered so the innermost one is contiguous
// and free of reductions, which lets the compiler vectorise it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "../problem.h"
#include "convert.h"

namespace dmattn::cpu {

// Rows rows[r] (global token rows) of token tensor t at head `head` of sequence
// batch b, D features each, into dst[r * D + d].
template <class A>
void load_rows(const Operand& t, std::int64_t b, std::int64_t head, std::int64_t row0, std::int64_t n,
               std::int64_t D, A* dst) {
  const std::int64_t base = b * t.sb + head * t.sh;
  for (std::int64_t r = 0; r < n; ++r) read(t.data, t.dtype, base + (row0 + r) * t.sr, D, Strided{t.sc}, dst + r * D);
}

template <class A>
void store_rows(const Operand& t, std::int64_t b, std::int64_t head, std::int64_t row0, std::int64_t n,
                std::int64_t D, const A* src) {
  const std::int64_t base = b * t.sb + head * t.sh;
  for (std::int64_t r = 0; r < n; ++r) write(t.data, t.dtype, base + (row0 + r) * t.sr, D, Strided{t.sc}, src + r * D);
}

// Gathers token rows row0 + keys[c] into kt[d * ld + c] (transposed) and, if
// rows != nullptr, into rows[c * D + d].
template <class A>
void gather_keys(const Operand& t, std::int64_t b, std::int64_t head, std::int64_t row0, const std::int64_t* keys,
                 std::int64_t n, std::int64_t D, std::int64_t ld, A* kt, A* rows, A* scratch) {
  const std::int64_t base = b * t.sb + head * t.sh;
  for (std::int64_t c = 0; c < n; ++c) {
    A* row = rows != nullptr ? rows + c * D : scratch;
    read(t.data, t.dtype, base + (row0 + keys[c]) * t.sr, D, Strided{t.sc}, row);
    for (std::int64_t d = 0; d < D; ++d) kt[d * ld + c] = row[d];
  }
}

// C[r * ld + c] = sum_d X[r * D + d] * YT[d * ld + c]   (C = X Y^T with Y given transposed)
template <class A>
void matmul_xyt(std::int64_t nr, std::int64_t nc, std::int64_t D, std::int64_t ld, const A* X, const A* YT, A* C) {
  for (std::int64_t r = 0; r < nr; ++r) {
    A* c_row = C + r * ld;
    for (std::int64_t c = 0; c < nc; ++c) c_row[c] = A(0);
    for (std::int64_t d = 0; d < D; ++d) {
      const A x = X[r * D + d];
      const A* y = YT + d * ld;
      for (std::int64_t c = 0; c < nc; ++c) c_row[c] += x * y[c];
    }
  }
}

// Out[o * D + d] += sum_i w(o, i) * In[i * D + d] over o < n_out, i < n_in, skipping zero weights
// (a row's masked entries).
template <class A, class Weight>
void accumulate(std::int64_t n_out, std::int64_t n_in, std::int64_t D, Weight w, const A* In, A* Out) {
  for (std::int64_t o = 0; o < n_out; ++o) {
    A* out = Out + o * D;
    for (std::int64_t i = 0; i < n_in; ++i) {
      const A weight = w(o, i);
      if (weight == A(0)) continue;
      const A* in = In + i * D;
      for (std::int64_t d = 0; d < D; ++d) out[d] += weight * in[d];
    }
  }
}

// Out[r * D + d] += sum_c W[r * ld + c] * Y[c * D + d]   (Out += W Y)
template <class A>
void accumulate_wy(std::int64_t nr, std::int64_t nc, std::int64_t D, std::int64_t ld, const A* W, const A* Y, A* Out) {
  accumulate(nr, nc, D, [&](std::int64_t r, std::int64_t c) { return W[r * ld + c]; }, Y, Out);
}

// Out[c * D + d] += sum_r W[r * ld + c] * X[r * D + d]   (Out += W^T X)
template <class A>
void accumulate_wtx(std::int64_t nr, std::int64_t nc, std::int64_t D, std::int64_t ld, const A* W, const A* X, A* Out) {
  accumulate(nc, nr, D, [&](std::int64_t c, std::int64_t r) { return W[r * ld + c]; }, X, Out);
}

// One online-softmax step over a tile. On entry L holds logits (-inf: not
// allowed); on exit L holds exp(l_ij - m_i) with the updated running max m_i,
// sum_i is updated, and alpha_i = exp(m_old - m_new) rescales earlier sums.
template <class A>
void online_softmax(std::int64_t nr, std::int64_t nc, std::int64_t ld, A* L, A* m, A* sum, A* alpha) {
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  for (std::int64_t r = 0; r < nr; ++r) {
    A* l = L + r * ld;
    A block_max = kNegInf;
    for (std::int64_t c = 0; c < nc; ++c) block_max = std::max(block_max, l[c]);
    if (block_max == kNegInf) {
      std::fill(l, l + nc, A(0));
      alpha[r] = A(1);
      continue;
    }
    const A m_new = std::max(m[r], block_max);
    alpha[r] = m[r] == kNegInf ? A(0) : std::exp(m[r] - m_new);
    A s = A(0);
    for (std::int64_t c = 0; c < nc; ++c) {
      l[c] = l[c] == kNegInf ? A(0) : std::exp(l[c] - m_new);
      s += l[c];
    }
    sum[r] = sum[r] * alpha[r] + s;
    m[r] = m_new;
  }
}

// Backward of the softmax on one tile. On entry L holds logits (-inf: not
// allowed) and G holds dp_ij = <do_i, v_j>. On exit L holds
// p_ij = exp(l_ij - m_i) / sum_i, G holds dS_ij = p_ij (dp_ij - delta_i) (the
// bias gradient), and, with softcap, T holds ds_ij = dS_ij (1 - tanh^2) (the
// score gradient; T held the tanh values). Rows with m_i = -inf see no key.
template <class A>
void softmax_backward(std::int64_t nr, std::int64_t nc, std::int64_t ld, const A* m, const A* inv_sum,
                      const A* delta, bool softcap, A* L, A* G, A* T) {
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  for (std::int64_t r = 0; r < nr; ++r) {
    for (std::int64_t c = 0; c < nc; ++c) {
      const std::int64_t e = r * ld + c;
      const A p = (L[e] == kNegInf || m[r] == kNegInf) ? A(0) : std::exp(L[e] - m[r]) * inv_sum[r];
      L[e] = p;
      G[e] = p == A(0) ? A(0) : p * (G[e] - delta[r]);
      if (softcap) T[e] = G[e] * (A(1) - T[e] * T[e]);
    }
  }
}

// delta_i = <do_i, o_i> for n rows of D features.
template <class A>
void row_dots(std::int64_t n, std::int64_t D, const A* X, const A* Y, A* out) {
  for (std::int64_t r = 0; r < n; ++r) {
    A s = A(0);
    for (std::int64_t d = 0; d < D; ++d) s += X[r * D + d] * Y[r * D + d];
    out[r] = s;
  }
}

}  // namespace dmattn::cpu
