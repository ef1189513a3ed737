// CPU forward: one task per (batch, query head, block of kBlockRows rows), an
// online softmax over the block's candidate keys in tiles of kBlockKeys. Each
// task owns its rows of out and lse, so results are deterministic.
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

template <class A>
void forward_block(const Problem& p, const Selection& sel, std::int64_t b, std::int64_t h, std::int64_t i0,
                   std::int64_t i1) {
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  constexpr std::int64_t ld = kBlockKeys;
  const HeadLogits<A> head(p, sel, b, h);
  const std::int64_t D = p.head_dim, nr = i1 - i0, kvh = h / p.group();
  const std::int64_t qs = p.q_start(b), ks = p.k_start(b);

  std::vector<A> Q(nr * D), KT(D * ld), V(ld * D), L(nr * ld), T(nr * ld), O(nr * D, A(0));
  std::vector<A> m(nr, kNegInf), sum(nr, A(0)), alpha(nr), scratch(std::max(ld, D));
  std::vector<std::int64_t> keys;
  std::vector<A> key_scratch;
  load_rows(p.q, b, h, qs + i0, nr, D, Q.data());
  head.candidate_keys(i0, i1, keys, key_scratch);

  for (std::size_t k0 = 0; k0 < keys.size(); k0 += ld) {
    const std::int64_t nc = std::min<std::int64_t>(ld, static_cast<std::int64_t>(keys.size() - k0));
    const std::int64_t* kj = keys.data() + k0;
    gather_keys(p.k, b, kvh, ks, kj, nc, D, ld, KT.data(), static_cast<A*>(nullptr), scratch.data());
    for (std::int64_t c = 0; c < nc; ++c) load_rows(p.v, b, kvh, ks + kj[c], 1, D, V.data() + c * D);
    matmul_xyt(nr, nc, D, ld, Q.data(), KT.data(), L.data());
    head.logits(i0, nr, kj, nc, ld, L.data(), T.data(), scratch.data());
    online_softmax(nr, nc, ld, L.data(), m.data(), sum.data(), alpha.data());
    for (std::int64_t r = 0; r < nr; ++r)
      for (std::int64_t d = 0; d < D; ++d) O[r * D + d] *= alpha[r];
    accumulate_wy(nr, nc, D, ld, L.data(), V.data(), O.data());
  }

  for (std::int64_t r = 0; r < nr; ++r) {
    A lse = kNegInf;
    if (m[r] != kNegInf) {
      const A inv = A(1) / sum[r];
      for (std::int64_t d = 0; d < D; ++d) O[r * D + d] *= inv;
      lse = m[r] + std::log(sum[r]);
    }
    if (p.lse.present()) write(p.lse.data, p.lse.dtype, b * p.lse.sb + h * p.lse.sh + (qs + i0 + r) * p.lse.sr, 1,
                               Strided{0}, &lse);
  }
  store_rows(p.out, b, h, qs + i0, nr, D, O.data());
}

}  // namespace

template <class A>
void forward(const Problem& p, const Selection& sel) {
  const std::int64_t blocks = (p.seqlen_q + kBlockRows - 1) / kBlockRows;
  parallel_for(p.batch * p.heads * blocks, [&](std::int64_t task) {
    const std::int64_t blk = task % blocks, bh = task / blocks;
    const std::int64_t b = bh / p.heads, h = bh % p.heads;
    const std::int64_t sq = p.q_len(b), i0 = blk * kBlockRows;
    if (i0 < sq) forward_block<A>(p, sel, b, h, i0, std::min(sq, i0 + kBlockRows));
  });
}

template void forward<float>(const Problem&, const Selection&);
template void forward<double>(const Problem&, const Selection&);

}  // namespace dmattn::cpu
