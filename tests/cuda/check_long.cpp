// Top-k at long rows against the oracle, on the slices of the call that the
// oracle computes exactly at a small cost.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "check.h"
#include "device.h"

namespace dmattn_gpu_test {

const char* const kTopkLongRowsName = "top-k long rows bf16 B1 S32768 H4/2 D128 w1024 causal key bias";

namespace {

constexpr std::int64_t kS = 32768, kH = 4, kHk = 2, kD = 128, kKeep = 1024;
constexpr std::int64_t kBlockRows = 64, kTailRows = 128;

// Rows [r0, r0 + n) of a (1, S, heads, D) token tensor; keys [0, n) of a
// (1, Hk, 1, S) bias.
HostTensor token_rows(const HostTensor& t, std::int64_t r0, std::int64_t n) {
  const std::int64_t row = t.shape()[2] * t.shape()[3];
  HostTensor out(t.dtype(), {1, n, t.shape()[2], t.shape()[3]});
  out.fill([&](std::int64_t i) { return t.at(r0 * row + i); });
  return out;
}
HostTensor bias_keys(const HostTensor& t, std::int64_t n) {
  HostTensor out(t.dtype(), {1, t.shape()[1], 1, n});
  out.fill([&](std::int64_t i) { return t.at(i / n * t.shape()[3] + i % n); });
  return out;
}

// Elements [r0 * width, (r0 + n) * width) of row-major values whose rows are
// `width` wide, for each of `outer` leading slices of `rows` rows.
std::vector<double> rows_of(const std::vector<double>& v, std::int64_t outer, std::int64_t rows, std::int64_t width,
                            std::int64_t r0, std::int64_t n) {
  std::vector<double> out;
  for (std::int64_t o = 0; o < outer; ++o)
    out.insert(out.end(), v.begin() + (o * rows + r0) * width, v.begin() + (o * rows + r0 + n) * width);
  return out;
}

// One call on the CPU: rows [r0, r0 + n) and keys [0, keys) of the inputs, in
// float64 (the oracle) or bf16 (the low-precision bound); with dout, the backward too.
struct Sub {
  std::vector<double> out, lse, dq, dk, dv, dbias;
};
Sub cpu_call(const HostTensor& q, const HostTensor& k, const HostTensor& v, const HostTensor& bias,
             const std::optional<HostTensor>& dout, std::int64_t r0, std::int64_t n, std::int64_t keys, bool lowp,
             const dmattn::Options& o) {
  const DType dt = lowp ? DType::kBFloat16 : DType::kFloat64;
  const auto conv = [&](const HostTensor& t) { return lowp ? t : dense_copy(t, dt); };
  const HostTensor sq = conv(token_rows(q, r0, n)), sk = conv(token_rows(k, 0, keys));
  const HostTensor sv = conv(token_rows(v, 0, keys)), sb = conv(bias_keys(bias, keys));
  HostTensor out(dt, sq.shape()), lse(lowp ? DType::kFloat32 : DType::kFloat64, {1, kH, n});
  const dmattn::Inputs in{sq.view(), sk.view(), sv.view(), std::nullopt, sb.view()};
  dmattn::forward(in, out.view(), lse.view(), o);
  Sub r{out.values(), lse.values(), {}, {}, {}, {}};
  if (!dout) return r;
  const HostTensor sdo = conv(token_rows(*dout, r0, n));
  HostTensor dq(dt, sq.shape()), dk(dt, sk.shape()), dv(dt, sk.shape()), db(sb.dtype(), sb.shape());
  dmattn::backward(in, out.view(), sdo.view(), lse.view(), {dq.view(), dk.view(), dv.view(), db.view()}, o);
  r.dq = dq.values(), r.dk = dk.values(), r.dv = dv.values(), r.dbias = db.values();
  return r;
}

}  // namespace

// S = 32768, w = 1024, causal, a key-only bias (1, Hk, 1, S): the Hopper
// key-list forward and the key-group backward with row segments longer than
// 1024 rows (past S = 16384), where the oracle of the whole call is out of
// reach. Causal row i sees keys 0..i only, so
//  - out and lse of rows [r, r + 64) are those of the call of those rows over
//    keys [0, r + 64) (bottom-right aligned, each row sees the same keys): at
//    the first, a middle and the last block;
//  - dq of the last 128 rows, and dk, dv and dbias of the last 128 keys, are
//    those of the call of the last 128 rows over every key (no earlier row sees
//    those keys).
// The GPU's slices against the oracle's: within twice the bf16 CPU run's error
// plus run_backward_case's slacks; everything finite.
Outcome topk_long_rows(Rng& rng) {
  HostTensor q(DType::kBFloat16, {1, kS, kH, kD}), k(DType::kBFloat16, {1, kS, kHk, kD}),
      v(DType::kBFloat16, {1, kS, kHk, kD}), dout(DType::kBFloat16, {1, kS, kH, kD}),
      bias(DType::kBFloat16, {1, kHk, 1, kS});
  for (HostTensor* t : {&q, &k, &v, &dout}) t->fill([&](std::int64_t) { return rng.uniform(-1.0, 1.0); });
  bias.fill([&](std::int64_t) { return rng.uniform(-4.0, 4.0); });
  dmattn::Options o;
  o.causal = true;
  o.keep_window_size = kKeep;

  const DeviceTensor gq(q), gk(k), gv(v), gdo(dout), gbias(bias), gout(HostTensor(DType::kBFloat16, {1, kS, kH, kD})),
      glse(HostTensor(DType::kFloat32, {1, kH, kS})), gdq(q), gdk(k), gdv(v), gdb(bias);
  const dmattn::Inputs in{gq.view(), gk.view(), gv.view(), std::nullopt, gbias.view()};
  dmattn::forward(in, gout.view(), glse.view(), o);
  dmattn::backward(in, gout.view(), gdo.view(), glse.view(), {gdq.view(), gdk.view(), gdv.view(), gdb.view()}, o);
  check_cuda(cudaDeviceSynchronize(), "top-k forward + backward at long rows");
  bool pad = true;  // contiguous outputs: no padding to check
  const std::vector<double> out = gout.values(&pad), lse = glse.values(&pad), dq = gdq.values(&pad),
                            dk = gdk.values(&pad), dv = gdv.values(&pad), db = gdb.values(&pad);

  Outcome r;
  char buf[160];
  const auto compare = [&](const char* what, const std::vector<double>& got, const std::vector<double>& ref,
                           const std::vector<double>& lowp, double slack) {
    const double err = max_abs_diff(got, ref), lp = max_abs_diff(lowp, ref);
    const bool ok = err <= 2.0 * lp + slack;
    r.pass = r.pass && ok;
    std::snprintf(buf, sizeof buf, "%s %.3g (lowp %.3g)%s  ", what, err, lp, ok ? "" : " FAILED");
    r.detail += buf;
  };
  for (const std::int64_t r0 : {std::int64_t{0}, kS / 2 - 37, kS - kBlockRows}) {
    const std::int64_t keys = r0 + kBlockRows;
    const Sub ref = cpu_call(q, k, v, bias, std::nullopt, r0, kBlockRows, keys, false, o);
    const Sub lowp = cpu_call(q, k, v, bias, std::nullopt, r0, kBlockRows, keys, true, o);
    std::snprintf(buf, sizeof buf, "rows %lld: ", static_cast<long long>(r0));
    r.detail += buf;
    compare("out", rows_of(out, 1, kS, kH * kD, r0, kBlockRows), ref.out, lowp.out, 1e-5);
    const std::vector<double> rows_lse = rows_of(lse, kH, kS, 1, r0, kBlockRows);
    const double lerr = lse_error(rows_lse, ref.lse), lp_lerr = lse_error(lowp.lse, ref.lse);
    r.pass = r.pass && lerr <= 2.0 * lp_lerr + 1e-4;
    std::snprintf(buf, sizeof buf, "lse %.3g (lowp %.3g)  ", lerr, lp_lerr);
    r.detail += buf;
  }

  const std::int64_t t0 = kS - kTailRows;
  const Sub ref = cpu_call(q, k, v, bias, dout, t0, kTailRows, kS, false, o);
  const Sub lowp = cpu_call(q, k, v, bias, dout, t0, kTailRows, kS, true, o);
  r.detail += "last rows and keys: ";
  compare("dq", rows_of(dq, 1, kS, kH * kD, t0, kTailRows), ref.dq, lowp.dq, 1e-5);
  // run_backward_case's slacks: a dk element sums scale dS q over its entries, a
  // dbias element dS over its entries (at most kTailRows rows of kH / kHk heads).
  double q_max = 0.0;
  for (const double x : q.values()) q_max = std::max(q_max, std::fabs(x));
  const double entries = double(kTailRows) * (kH / kHk);
  const double dk_slack = 1e-5 * std::max(1.0, std::sqrt(entries) * q_max / std::sqrt(double(kD)));
  const auto tail_keys = [&](const std::vector<double>& x) { return rows_of(x, 1, kS, kHk * kD, t0, kTailRows); };
  compare("dk", tail_keys(dk), tail_keys(ref.dk), tail_keys(lowp.dk), dk_slack);
  compare("dv", tail_keys(dv), tail_keys(ref.dv), tail_keys(lowp.dv), 1e-5);
  const auto tail_bias = [&](const std::vector<double>& x) { return rows_of(x, kHk, kS, 1, t0, kTailRows); };
  compare("dbias", tail_bias(db), tail_bias(ref.dbias), tail_bias(lowp.dbias), 1e-5 * std::sqrt(entries));
  for (const std::vector<double>* x : {&out, &dq, &dk, &dv, &db})
    if (!std::all_of(x->begin(), x->end(), [](double e) { return std::isfinite(e); }))
      r.pass = false, r.detail += "NON-FINITE OUTPUT  ";
  return r;
}

}  // namespace dmattn_gpu_test
