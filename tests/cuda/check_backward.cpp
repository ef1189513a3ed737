// The CUDA backward of one case against the CPU oracle, and the top-k NaN
// sweep.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "device.h"

namespace dmattn_gpu_test {

// ---- Backward: dq, dk, dv and dbias of the CUDA backward against the CPU backend.
//
// The reference is the CPU backward in float64 (its own float64 forward's out and
// lse); the low-precision proxy is the CPU backward on the same fp16/bf16 tensors
// (its own low-precision out and float32 lse), and the GPU backward takes that
// same out and lse. The CPU keeps P and dS in float32 where the GPU, like the
// naive computation of SPEC 5, rounds them to the dtype for the next products:
// where the tests' naive oracle (tests/reference.h, every (b, h, i, j) entry
// materialised) is affordable, the proxy error is the larger of the CPU's and
// the naive computations' of tests/harness.h (every intermediate rounded; only
// what is stored rounded). Each gradient: max |gpu - ref| <= 2 * proxy + 1e-5
// (dbias: + 1e-5 sqrt(n), n the dS entries an element sums; dk: + 1e-5
// sqrt(n_k) scale max|q| where that is more, n_k the entries of a key), no NaN, nothing
// written outside the views. The GPU backward runs twice: dk, dv and dbias must be
// bitwise equal, dq too with options.deterministic (without it dq may be summed by
// float32 atomics, in any order).

namespace {

struct Gradients {
  std::vector<double> dq, dk, dv, dbias;
};

// dbias: the bias's shape and layout, never a broadcast (stride-0) view.
Layout dbias_layout(const Case& c) {
  Layout l = c.bias_layout;
  l.expanded = {};
  return l;
}

// Errors against ref of dq, dk, dv and dbias of the two naive computations of a
// case, the larger of the two (0 where the oracle is not run or overflows the
// dtype).
std::array<double, 4> naive_errors(const Case& c, const CaseInputs& inputs, const HostTensor& dout,
                                   const Gradients& ref) {
  std::array<double, 4> err{};
  const bool db = inputs.bias.has_value();
  for (const dmattn_test::RefResult& n : naive_runs(c, inputs, dout.values())) {
    const std::vector<double>* got[4] = {&n.dq, &n.dk, &n.dv, &n.dbias};
    const std::vector<double>* want[4] = {&ref.dq, &ref.dk, &ref.dv, &ref.dbias};
    for (int i = 0; i < (db ? 4 : 3); ++i) {
      const double d = max_abs_diff(*got[i], *want[i]);
      if (std::isfinite(d)) err[i] = std::max(err[i], d);
    }
  }
  return err;
}

}  // namespace

Outcome run_backward_case(const Case& c, Rng& rng) {
  const bool varlen = c.varlen();
  const auto [q_shape, k_shape, lse_shape] = case_shapes(c);
  const CaseInputs inputs = make_inputs(c, q_shape, k_shape, rng);
  HostTensor dout(c.dtype, q_shape, c.qkv_layout);
  dout.fill([&](std::int64_t) { return rng.uniform(-1.0, 1.0); });
  const bool db = inputs.bias.has_value();

  // CPU: float64 (dense copies) or the case's dtype (the same tensors).
  std::vector<double> lowp_out, lowp_lse;
  auto cpu_grads = [&](bool lowp) {
    const DType dt = lowp ? c.dtype : DType::kFloat64;
    auto conv = [&](const HostTensor& t) { return lowp ? t : dense_copy(t, dt); };
    const HostTensor q = conv(inputs.q), k = conv(inputs.k), v = conv(inputs.v), dO = conv(dout);
    std::optional<HostTensor> bias;
    if (db) bias = conv(*inputs.bias);
    HostTensor out(dt, q_shape), lse(lowp ? DType::kFloat32 : DType::kFloat64, lse_shape);
    HostTensor dq(dt, q_shape), dk(dt, k_shape), dv(dt, k_shape);
    std::optional<HostTensor> dbias;
    if (db) dbias.emplace(bias->dtype(), c.bias_shape);
    dmattn::Inputs in{q.view(), k.view(), v.view(), std::nullopt, std::nullopt};
    if (inputs.mask) in.mask = inputs.mask->view();
    if (bias) in.bias = bias->view();
    std::optional<HostTensor> intervals;  // another keep window's selection (Case::given_keep), batched
    if (c.given_intervals && c.given_keep > 0) {
      intervals.emplace(DType::kInt32, Shape{c.B, selection_heads(c), c.Sk, 2});
      dmattn::select_topk(in, given_options(c), intervals->view());
      in.topk_intervals = intervals->view();
    }
    dmattn::Gradients g{dq.view(), dk.view(), dv.view(), std::nullopt};
    if (dbias) g.dbias = dbias->view();
    if (varlen) {
      std::vector<std::int32_t> cu;
      const dmattn::VarlenLayout layout = varlen_layout(c, cu, nullptr);
      dmattn::varlen_forward(in, layout, out.view(), lse.view(), c.options);
      dmattn::varlen_backward(in, layout, out.view(), dO.view(), lse.view(), g, c.options);
    } else {
      dmattn::forward(in, out.view(), lse.view(), c.options);
      dmattn::backward(in, out.view(), dO.view(), lse.view(), g, c.options);
    }
    if (lowp) lowp_out = out.values(), lowp_lse = lse.values();
    return Gradients{dq.values(), dk.values(), dv.values(), dbias ? dbias->values() : std::vector<double>{}};
  };
  const Gradients ref = cpu_grads(false), lowp = cpu_grads(true);

  // GPU: the backward, twice into poisoned gradients, from the low-precision CPU
  // run's out and lse, so that both backwards see the same forward (the GPU
  // forward's own accuracy is the forward check's business).
  const DeviceTensor q(inputs.q), k(inputs.k), v(inputs.v), dO(dout);
  std::optional<DeviceTensor> mask, bias;
  if (inputs.mask) mask.emplace(*inputs.mask);
  if (db) bias.emplace(*inputs.bias);
  HostTensor out_host(c.dtype, q_shape, c.out_layout), lse_host(DType::kFloat32, lse_shape);
  out_host.fill([&](std::int64_t i) { return lowp_out[i]; });
  lse_host.fill([&](std::int64_t i) { return lowp_lse[i]; });
  const DeviceTensor out(out_host), lse(lse_host);
  dmattn::Inputs in{q.view(), k.view(), v.view(), std::nullopt, std::nullopt};
  if (mask) in.mask = mask->view();
  if (bias) in.bias = bias->view();
  const DeviceVarlen cu(c);
  const GivenIntervals given = given_intervals(c, inputs, in, cu.layout());
  if (given.device) in.topk_intervals = given.device->view();
  bool untouched = true;
  std::string plan;
  auto gpu_grads = [&]() {
    HostTensor dq_host(c.dtype, q_shape, c.qkv_layout), dk_host(c.dtype, k_shape, c.qkv_layout),
        dv_host(c.dtype, k_shape, c.qkv_layout);
    std::optional<HostTensor> db_host;
    if (db) db_host.emplace(c.bias_dtype, c.bias_shape, dbias_layout(c), false);
    for (HostTensor* t : {&dq_host, &dk_host, &dv_host}) t->poison();
    if (db_host) db_host->poison();
    const DeviceTensor dq(dq_host), dk(dk_host), dv(dv_host);
    std::optional<DeviceTensor> dbias;
    if (db_host) dbias.emplace(*db_host);
    dmattn::Gradients g{dq.view(), dk.view(), dv.view(), std::nullopt};
    if (dbias) g.dbias = dbias->view();
    if (plan.empty()) plan = backward_plan(in, cu.layout(), out.view(), dO.view(), lse.view(), g, c.options);
    if (varlen)
      dmattn::varlen_backward(in, *cu.layout(), out.view(), dO.view(), lse.view(), g, c.options);
    else
      dmattn::backward(in, out.view(), dO.view(), lse.view(), g, c.options);
    check_cuda(cudaDeviceSynchronize(), "backward kernels");
    bool pad[4] = {true, true, true, true};
    Gradients r{dq.values(&pad[0]), dk.values(&pad[1]), dv.values(&pad[2]),
                dbias ? dbias->values(&pad[3]) : std::vector<double>{}};
    untouched = untouched && pad[0] && pad[1] && pad[2] && pad[3];
    return r;
  };
  const Gradients gpu = gpu_grads(), again = gpu_grads();

  auto bitwise = [](const std::vector<double>& a, const std::vector<double>& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
  };
  Outcome r;
  r.pass = untouched && given.gpu_equal;
  std::string detail = given.gpu_equal ? "" : "GPU SELECT_TOPK DIFFERS FROM THE CPU'S  ";
  const char* names[4] = {"dq", "dk", "dv", "dbias"};
  const std::vector<double>* g[4] = {&gpu.dq, &gpu.dk, &gpu.dv, &gpu.dbias};
  const std::vector<double>* rf[4] = {&ref.dq, &ref.dk, &ref.dv, &ref.dbias};
  const std::vector<double>* lp[4] = {&lowp.dq, &lowp.dk, &lowp.dv, &lowp.dbias};
  const std::vector<double>* ag[4] = {&again.dq, &again.dk, &again.dv, &again.dbias};
  // A dbias element sums n entries dS = P (dP - delta), each off by float32
  // rounding (dP and delta are sums in different orders); where dS is 0 exactly
  // (a row that keeps one key) the naive computation is exact and that noise is
  // all there is: dbias's absolute slack grows like sqrt(n).
  double entries = double(c.B * c.Sq * c.Sk);
  if (varlen) {
    entries = 0.0;
    for (std::size_t b = 0; b < c.seqlens_q.size(); ++b) entries += double(c.seqlens_q[b]) * double(c.seqlens_k[b]);
  }
  const double n = c.H * entries / double(std::max<std::size_t>(ref.dbias.size(), 1));
  // A dk element sums its key's n_k entries of scale dS q: the same noise
  // times scale |q| (a causal top-k window of 1 whose largest-bias key every
  // later row keeps: thousands of entries, a flat 1e-5 fails ~half of fp16 runs).
  const double n_k = c.H * entries * double(c.D) / double(std::max<std::size_t>(ref.dk.size(), 1));
  double q_max = 0.0;
  for (double x : inputs.q.values()) q_max = std::max(q_max, std::fabs(x));
  const double dk_noise = std::sqrt(n_k) * dmattn_test::ref_options(c.options, c.D).scale * q_max;
  const double slack[4] = {1e-5, 1e-5 * std::max(1.0, dk_noise), 1e-5, 1e-5 * std::sqrt(std::max(1.0, n))};
  const int grads = db ? 4 : 3;
  double err[4], lp_err[4];
  bool lowp_enough = true;
  for (int i = 0; i < grads; ++i) {
    err[i] = max_abs_diff(*g[i], *rf[i]), lp_err[i] = max_abs_diff(*lp[i], *rf[i]);
    lowp_enough = lowp_enough && err[i] <= 2.0 * lp_err[i] + slack[i];
  }
  // The naive computations of SPEC 5 (slow) only where the lowp bound alone fails.
  std::optional<std::array<double, 4>> naive;
  if (!lowp_enough) naive = naive_errors(c, inputs, dout, ref);
  for (int i = 0; i < grads; ++i) {
    const std::optional<double> naive_err = naive ? std::optional<double>((*naive)[i]) : std::nullopt;
    const bool same = bitwise(*g[i], *ag[i]), must_be_same = i != 0 || c.options.deterministic;
    r.pass = r.pass && err[i] <= 2.0 * std::max(lp_err[i], naive_err.value_or(0.0)) + slack[i] && (same || !must_be_same);
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s %.3g (%s)%s  ", names[i], err[i], bounds_text(lp_err[i], naive_err).c_str(),
                  same ? "" : (must_be_same ? " NOT REPRODUCIBLE" : " (runs differ: atomics)"));
    detail += buf;
  }
  r.detail = detail + (untouched ? "" : "WROTE OUTSIDE THE VIEW  ") + "[" + plan + "]";
  return r;
}

const char* const kTopkNanSweepName =
    "top-k NaN sweep bf16 B1 S4096 H8/2 w2048 causal, Doge bias A*softplus(dt), 20 fwd+bwd";

// The seed's failure case (NaN under top-k in bf16): B=1, H=8/Hk=2, S=4096,
// w=2048, causal, a Doge-style key-only bias A_h * softplus(dt_j) with fresh
// random A, dt, q, k, v and dout at each of 20 forward + backward steps on the
// GPU: out, dq, dk, dv and dbias must be finite.
Outcome topk_nan_sweep(Rng& rng) {
  const std::int64_t B = 1, H = 8, Hk = 2, D = 128, S = 4096;
  Outcome r;
  for (int step = 0; step < 20 && r.pass; ++step) {
    HostTensor q(DType::kBFloat16, {B, S, H, D}), k(DType::kBFloat16, {B, S, Hk, D}), v(DType::kBFloat16, {B, S, Hk, D}),
        dout(DType::kBFloat16, {B, S, H, D}), bias(DType::kBFloat16, {B, Hk, 1, S});
    const double spread = rng.uniform(0.5, 4.0);
    for (HostTensor* t : {&q, &k, &v, &dout}) t->fill([&](std::int64_t) { return rng.uniform(-spread, spread); });
    const double a[2] = {rng.uniform(-8.0, 8.0), rng.uniform(-8.0, 8.0)};
    bias.fill([&](std::int64_t i) {
      const double dt = rng.uniform(-12.0, 12.0);
      return a[i / S] * (dt > 0 ? dt + std::log1p(std::exp(-dt)) : std::log1p(std::exp(dt)));
    });
    const DeviceTensor dq(q), dk(k), dv(v), ddo(dout), db(bias), out(dout), gq(q), gk(k), gv(v), gb(bias);
    const DeviceTensor lse(HostTensor(DType::kFloat32, {B, H, S}));
    dmattn::Options o;
    o.causal = true;
    o.keep_window_size = 2048;
    const dmattn::Inputs in{dq.view(), dk.view(), dv.view(), std::nullopt, db.view()};
    dmattn::forward(in, out.view(), lse.view(), o);
    dmattn::backward(in, out.view(), ddo.view(), lse.view(), {gq.view(), gk.view(), gv.view(), gb.view()}, o);
    check_cuda(cudaDeviceSynchronize(), "top-k forward + backward");
    const char* names[5] = {"out", "dq", "dk", "dv", "dbias"};
    const DeviceTensor* outputs[5] = {&out, &gq, &gk, &gv, &gb};
    for (int t = 0; t < 5; ++t) {
      bool pad = true;
      const std::vector<double> x = outputs[t]->values(&pad);
      const auto bad = std::count_if(x.begin(), x.end(), [](double e) { return !std::isfinite(e); });
      if (bad > 0) r.pass = false, r.detail += "step " + std::to_string(step) + ": " + std::to_string(bad) + " non-finite in " + names[t] + "  ";
    }
  }
  if (r.pass) r.detail = "20 steps, all finite";
  return r;
}

const char* const kWildIntervalsName = "top-k wild given intervals bf16 B2 S2100, B1 Sq16500 Sk6000 H4/2 D128 w64 causal";

// Given intervals are user data (Inputs::topk_intervals): wild values (negative,
// past the rows, start after end, the int32 extremes) select other keys, past
// the bounds the kernels size their key lists and key groups by (keys dropped,
// the gradients of some keys unwritten), but the forward and the backward finish
// without a CUDA error, write nothing outside their views and, under
// compute-sanitizer (the Small suite), read and write nothing out of bounds.
// At Sq = 16500, Sk = 6000 the key groups have segments of 2048 rows and 4096
// entries each (key_groups.cu), which intervals of every row for three keys in
// four overflow: no piece then waits for one the grouping dropped.
Outcome wild_intervals(Rng& rng) {
  Outcome r;
  for (const std::int64_t Sq : {2100, 16500}) {
    const bool compact = Sq > 4096;
    const std::int64_t B = compact ? 1 : 2, S = compact ? 6000 : Sq, H = 4, Hk = 2, D = 128;
    const Layout sliced{true, false, {}};
    HostTensor q(DType::kBFloat16, {B, Sq, H, D}), k(DType::kBFloat16, {B, S, Hk, D}), v(DType::kBFloat16, {B, S, Hk, D}),
        dout(DType::kBFloat16, {B, Sq, H, D}), bias(DType::kBFloat16, {B, Hk, 1, S}), intervals(DType::kInt32, {B, Hk, S, 2});
    for (HostTensor* t : {&q, &k, &v, &dout, &bias}) t->fill([&](std::int64_t) { return rng.uniform(-2.0, 2.0); });
    const double extremes[] = {std::numeric_limits<std::int32_t>::min(), -1, 0, 1, double(Sq - 1), double(Sq),
                               double(Sq + 1), std::numeric_limits<std::int32_t>::max()};
    std::vector<bool> every_row(static_cast<std::size_t>(intervals.numel() / 2));
    for (std::size_t i = 0; i < every_row.size(); ++i) every_row[i] = compact && rng.bernoulli(0.75);
    intervals.fill([&](std::int64_t i) {
      if (every_row[static_cast<std::size_t>(i / 2)]) return i % 2 ? double(Sq) : 0.0;
      return rng.bernoulli(0.5) ? extremes[rng.integer(0, 7)] : static_cast<double>(rng.integer(-5, Sq + 5));
    });
    HostTensor out(DType::kBFloat16, {B, Sq, H, D}, sliced), lse(DType::kFloat32, {B, H, Sq}, sliced),
        dq(DType::kBFloat16, {B, Sq, H, D}, sliced), dk(DType::kBFloat16, {B, S, Hk, D}, sliced),
        dv(DType::kBFloat16, {B, S, Hk, D}, sliced), dbias(DType::kBFloat16, {B, Hk, 1, S}, sliced);
    for (HostTensor* t : {&out, &lse, &dq, &dk, &dv, &dbias}) t->poison();
    const DeviceTensor gq(q), gk(k), gv(v), gdout(dout), gbias(bias), gintervals(intervals), gout(out), glse(lse),
        gdq(dq), gdk(dk), gdv(dv), gdbias(dbias);
    dmattn::Options o;
    o.causal = true;
    o.keep_window_size = 64;
    dmattn::Inputs in{gq.view(), gk.view(), gv.view(), std::nullopt, gbias.view()};
    in.topk_intervals = gintervals.view();
    dmattn::forward(in, gout.view(), glse.view(), o);
    dmattn::backward(in, gout.view(), gdout.view(), glse.view(), {gdq.view(), gdk.view(), gdv.view(), gdbias.view()}, o);
    check_cuda(cudaDeviceSynchronize(), "top-k forward + backward with wild intervals");
    const char* names[6] = {"out", "lse", "dq", "dk", "dv", "dbias"};
    const DeviceTensor* outputs[6] = {&gout, &glse, &gdq, &gdk, &gdv, &gdbias};
    for (int t = 0; t < 6; ++t) {
      bool untouched = true;
      outputs[t]->values(&untouched);
      if (!untouched) r.pass = false, r.detail += "Sq" + std::to_string(Sq) + " " + names[t] + " WROTE OUTSIDE THE VIEW  ";
    }
  }
  if (r.pass) r.detail = "forward and backward finished at both shapes, nothing written outside the views";
  return r;
}

}  // namespace dmattn_gpu_test
