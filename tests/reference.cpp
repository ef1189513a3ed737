#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace dmattn_test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double rnd(const std::optional<DType>& dtype, double x) { return dtype ? round_to(*dtype, x) : x; }

// Element of a (possibly broadcast) mask or bias of shape s that (b, h, i, j) reads.
std::int64_t broadcast_index(const Shape4& s, std::int64_t H, std::int64_t b, std::int64_t h,
                             std::int64_t i, std::int64_t j) {
  const std::int64_t bb = s[0] == 1 ? 0 : b;
  const std::int64_t hh = h / (H / s[1]);  // heads H, Hk or 1
  const std::int64_t ii = s[2] == 1 ? 0 : i;
  const std::int64_t jj = s[3] == 1 ? 0 : j;
  return ((bb * s[1] + hh) * s[2] + ii) * s[3] + jj;
}

// Keeps the `keep` allowed keys of a row with the largest bias, ties to the
// larger key index, by sorting the row.
void select_top_k(const RefProblem& p, std::int64_t b, std::int64_t h, std::int64_t i, char* allowed) {
  std::vector<std::int64_t> keys;
  for (std::int64_t j = 0; j < p.Sk; ++j)
    if (allowed[j]) keys.push_back(j);
  const auto keep = static_cast<std::size_t>(p.options.keep_window_size);
  if (keys.size() <= keep) return;
  auto bias = [&](std::int64_t j) { return p.bias[broadcast_index(p.bias_shape, p.H, b, h, i, j)]; };
  std::sort(keys.begin(), keys.end(), [&](std::int64_t x, std::int64_t y) {
    return bias(x) > bias(y) || (bias(x) == bias(y) && x > y);
  });
  for (std::size_t n = keep; n < keys.size(); ++n) allowed[keys[n]] = 0;
}

}  // namespace

RefOptions ref_options(const dmattn::Options& o, std::int64_t D) {
  RefOptions r;
  r.scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(D)));
  r.softcap = o.softcap;
  r.causal = o.causal;
  r.window_left = o.sliding_window.left;
  r.window_right = o.sliding_window.right;
  r.keep_window_size = o.keep_window_size.value_or(0);
  return r;
}

RefResult reference(const RefProblem& p, const std::optional<std::vector<double>>& dout, const Rounding& r) {
  const RefOptions& o = p.options;
  const std::int64_t B = p.B, Sq = p.Sq, Sk = p.Sk, H = p.H, D = p.D;
  const std::int64_t group = H / p.Hk;
  const std::int64_t offset = Sk - Sq;  // bottom-right alignment
  auto q_at = [&](std::int64_t b, std::int64_t i, std::int64_t h) { return ((b * Sq + i) * H + h) * D; };
  auto kv_at = [&](std::int64_t b, std::int64_t j, std::int64_t h) {
    return ((b * Sk + j) * p.Hk + h / group) * D;
  };

  RefResult res;
  res.out.assign(p.q.size(), 0.0);
  res.lse.assign(static_cast<std::size_t>(B * H * Sq), -kInf);
  res.allowed.assign(static_cast<std::size_t>(B * H * Sq * Sk), 0);
  std::vector<double> prob(res.allowed.size(), 0.0), capped_tanh(res.allowed.size(), 0.0);
  std::vector<double> logit(static_cast<std::size_t>(Sk));

  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < Sq; ++i) {
        const std::int64_t row = (b * H + h) * Sq + i;
        char* allowed = &res.allowed[row * Sk];
        for (std::int64_t j = 0; j < Sk; ++j) {
          bool ok = p.mask.empty() || p.mask[broadcast_index(p.mask_shape, H, b, h, i, j)] != 0.0;
          if (o.causal) ok = ok && j <= i + offset;
          if (o.window_left >= 0) ok = ok && j >= i + offset - o.window_left;
          if (o.window_right >= 0) ok = ok && j <= i + offset + o.window_right;
          allowed[j] = ok;
          double s = 0.0;
          for (std::int64_t d = 0; d < D; ++d) s += p.q[q_at(b, i, h) + d] * p.k[kv_at(b, j, h) + d];
          s = rnd(r.intermediate, o.scale * s);
          if (o.softcap > 0.0) {
            const double t = rnd(r.intermediate, std::tanh(s / o.softcap));
            capped_tanh[row * Sk + j] = t;
            s = rnd(r.intermediate, o.softcap * t);
          }
          logit[j] = p.bias.empty() ? s
                                    : rnd(r.intermediate, s + p.bias[broadcast_index(p.bias_shape, H, b, h, i, j)]);
        }
        if (o.keep_window_size > 0) select_top_k(p, b, h, i, allowed);
        double m = -kInf;
        for (std::int64_t j = 0; j < Sk; ++j)
          if (allowed[j]) m = std::max(m, logit[j]);
        if (m == -kInf) continue;  // no allowed key: o = 0, lse = -inf
        double sum = 0.0;
        for (std::int64_t j = 0; j < Sk; ++j)
          if (allowed[j]) sum += std::exp(logit[j] - m);
        res.lse[row] = rnd(r.lse, rnd(r.intermediate, m + std::log(sum)));
        // Normalised by the sum, not through lse: m + log(sum) loses log(sum) when |m| is huge.
        for (std::int64_t j = 0; j < Sk; ++j)
          if (allowed[j]) prob[row * Sk + j] = rnd(r.intermediate, std::exp(logit[j] - m) / sum);
        for (std::int64_t d = 0; d < D; ++d) {
          double acc = 0.0;
          for (std::int64_t j = 0; j < Sk; ++j) acc += prob[row * Sk + j] * p.v[kv_at(b, j, h) + d];
          res.out[q_at(b, i, h) + d] = rnd(r.out, acc);
        }
      }
  if (!dout) return res;

  res.dq.assign(p.q.size(), 0.0);
  res.dk.assign(p.k.size(), 0.0);
  res.dv.assign(p.v.size(), 0.0);
  res.dbias.assign(p.bias.size(), 0.0);
  res.dbias_abs.assign(p.bias.size(), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < Sq; ++i) {
        const std::int64_t row = (b * H + h) * Sq + i;
        if (res.lse[row] == -kInf) continue;
        const double* dout_i = &(*dout)[q_at(b, i, h)];
        double delta = 0.0;
        for (std::int64_t d = 0; d < D; ++d) delta += dout_i[d] * res.out[q_at(b, i, h) + d];
        delta = rnd(r.intermediate, delta);
        for (std::int64_t j = 0; j < Sk; ++j) {
          if (!res.allowed[row * Sk + j]) continue;
          const double pij = prob[row * Sk + j];
          double dp = 0.0;
          for (std::int64_t d = 0; d < D; ++d) dp += dout_i[d] * p.v[kv_at(b, j, h) + d];
          dp = rnd(r.intermediate, dp);
          const double dl = rnd(r.intermediate, pij * (dp - delta));
          if (!p.bias.empty()) {
            const std::int64_t e = broadcast_index(p.bias_shape, H, b, h, i, j);
            res.dbias[e] += dl;
            res.dbias_abs[e] += std::fabs(dl);
          }
          const double t = capped_tanh[row * Sk + j];
          const double ds = o.softcap > 0.0 ? rnd(r.intermediate, dl * (1.0 - t * t)) : dl;
          for (std::int64_t d = 0; d < D; ++d) {
            res.dq[q_at(b, i, h) + d] += o.scale * ds * p.k[kv_at(b, j, h) + d];
            res.dk[kv_at(b, j, h) + d] += o.scale * ds * p.q[q_at(b, i, h) + d];
            res.dv[kv_at(b, j, h) + d] += pij * dout_i[d];
          }
        }
      }
  for (auto* g : {&res.dq, &res.dk, &res.dv})
    for (double& x : *g) x = rnd(r.out, x);
  for (double& x : res.dbias) x = rnd(r.dbias, x);
  return res;
}

RefResult reference_varlen(const RefVarlenProblem& p, const std::optional<std::vector<double>>& dout,
                           const Rounding& r) {
  const std::int64_t H = p.H, Hk = p.Hk, D = p.D, Hb = p.Hb;
  const std::int64_t total_q = p.cu_q.back();
  const bool backward = dout.has_value();
  RefResult res;
  res.out.assign(p.q.size(), 0.0);
  res.lse.assign(static_cast<std::size_t>(H * total_q), -kInf);
  if (backward) {
    res.dq.assign(p.q.size(), 0.0);
    res.dk.assign(p.k.size(), 0.0);
    res.dv.assign(p.v.size(), 0.0);
    res.dbias.assign(p.bias.size(), 0.0);
    res.dbias_abs.assign(p.bias.size(), 0.0);
  }
  auto slice = [](const std::vector<double>& x, std::int64_t begin, std::int64_t end, std::int64_t row) {
    return std::vector<double>(x.begin() + begin * row, x.begin() + end * row);
  };
  auto place = [](std::vector<double>& dst, const std::vector<double>& src, std::int64_t begin, std::int64_t row) {
    std::copy(src.begin(), src.end(), dst.begin() + begin * row);
  };
  for (std::size_t b = 0; b + 1 < p.cu_q.size(); ++b) {
    const std::int64_t q0 = p.cu_q[b], q1 = p.cu_q[b + 1], k0 = p.cu_k[b], k1 = p.cu_k[b + 1];
    const std::int64_t sq = q1 - q0, sk = k1 - k0;
    RefProblem s;
    s.B = 1, s.Sq = sq, s.Sk = sk, s.H = H, s.Hk = Hk, s.D = D;
    s.q = slice(p.q, q0, q1, H * D);
    s.k = slice(p.k, k0, k1, Hk * D);
    s.v = slice(p.v, k0, k1, Hk * D);
    s.options = p.options;
    if (!p.bias.empty()) {
      s.bias_shape = {1, Hb, 1, sk};
      s.bias.resize(static_cast<std::size_t>(Hb * sk));
      for (std::int64_t h = 0; h < Hb; ++h)
        for (std::int64_t j = 0; j < sk; ++j) s.bias[h * sk + j] = p.bias[(k0 + j) * Hb + h];
    }
    const RefResult one =
        reference(s, backward ? std::optional(slice(*dout, q0, q1, H * D)) : std::nullopt, r);
    place(res.out, one.out, q0, H * D);
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < sq; ++i) res.lse[h * total_q + q0 + i] = one.lse[h * sq + i];
    if (!backward) continue;
    place(res.dq, one.dq, q0, H * D);
    place(res.dk, one.dk, k0, Hk * D);
    place(res.dv, one.dv, k0, Hk * D);
    for (std::int64_t h = 0; h < Hb && !p.bias.empty(); ++h)
      for (std::int64_t j = 0; j < sk; ++j) {
        res.dbias[(k0 + j) * Hb + h] = one.dbias[h * sk + j];
        res.dbias_abs[(k0 + j) * Hb + h] = one.dbias_abs[h * sk + j];
      }
  }
  return res;
}

}  // namespace dmattn_test
