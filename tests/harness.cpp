#include "harness.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>

namespace dmattn_test {
namespace {

constexpr double kAbsoluteSlack = 1e-5;  // SPEC 5: "+ 1e-5" for float16 / bfloat16

double relative_tolerance(DType storage) { return storage == DType::kFloat64 ? 1e-12 : 1e-5; }

std::string options_str(const dmattn::Options& o) {
  std::ostringstream s;
  if (o.scale) s << " scale=" << *o.scale;
  if (o.softcap > 0) s << " softcap=" << o.softcap;
  if (o.causal) s << " causal";
  if (o.sliding_window.left != -1 || o.sliding_window.right != -1)
    s << " window=(" << o.sliding_window.left << "," << o.sliding_window.right << ")";
  if (o.keep_window_size) s << " keep=" << *o.keep_window_size;
  if (o.deterministic) s << " deterministic";
  if (!o.return_lse) s << " no-lse";
  return s.str();
}

const char* values_str(Values v) {
  switch (v) {
    case Values::kUniform: return "uniform";
    case Values::kTiers: return "tiers";
    case Values::kConstant: return "constant";
    case Values::kDistinct: return "distinct";
    case Values::kExtreme: return "extreme";
    case Values::kNegInf: return "-inf";
  }
  return "?";
}

HostTensor random_tensor(DType dtype, Shape shape, const Layout& layout, Rng& rng) {
  HostTensor t(dtype, std::move(shape), layout);
  fill_values(t, Values::kUniform, rng);
  return t;
}

HostTensor poisoned(DType dtype, Shape shape, const Layout& layout, bool last_dim_contiguous = true) {
  HostTensor t(dtype, std::move(shape), layout, last_dim_contiguous);
  t.poison();
  return t;
}

DType lse_dtype_for(DType q, const std::optional<DType>& requested) {
  return requested.value_or(q == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32);
}

// An output layout cannot broadcast: the same layout without stride-0 dims.
Layout writable(Layout layout) {
  layout.expanded = {};
  return layout;
}

// Largest |a - b|, treating equal infinities as equal; +inf when an element is
// NaN or infinite in one vector only.
double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    const double d = std::fabs(a[i] - b[i]);
    m = std::isfinite(d) ? std::max(m, d) : std::numeric_limits<double>::infinity();
  }
  return m;
}

std::string index_str(const Shape& shape, std::int64_t index) {
  Shape at(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    at[d] = index % shape[d];
    index /= shape[d];
  }
  return shape_str(at);
}

// Poisons fresh gradients (shaped like out and k, dbias like the bias) and runs `call` on them.
void run_backward_on(const Shape& k_shape, const Layout& grad_layout, const std::optional<HostTensor>& bias,
                     const Layout& bias_layout, bool with_dbias, Results& r,
                     const std::function<void(const dmattn::Gradients&)>& call) {
  r.dq = poisoned(r.out.dtype(), r.out.shape(), grad_layout);
  r.dk = poisoned(r.out.dtype(), k_shape, grad_layout);
  r.dv = poisoned(r.out.dtype(), k_shape, grad_layout);
  r.dbias.reset();
  if (with_dbias && bias) r.dbias = poisoned(bias->dtype(), bias->shape(), writable(bias_layout), false);
  dmattn::Gradients g{r.dq.view(), r.dk.view(), r.dv.view(), std::nullopt};
  if (r.dbias) g.dbias = r.dbias->view();
  call(g);
  r.backward = true;
}

}  // namespace

std::string describe(const Case& c) {
  std::ostringstream s;
  s << dmattn::dtype_name(c.dtype) << " B=" << c.B << " Sq=" << c.Sq << " Sk=" << c.Sk << " H=" << c.H
    << " Hk=" << c.Hk << " D=" << c.D << " qkv=" << layout_str(c.qkv_layout) << " out=" << layout_str(c.out_layout);
  if (c.mask)
    s << " mask" << shape_str({c.mask->shape.begin(), c.mask->shape.end()}) << "/" << layout_str(c.mask->layout)
      << "/keep=" << c.mask->keep;
  if (c.bias)
    s << " bias" << shape_str({c.bias->shape.begin(), c.bias->shape.end()}) << "/"
      << dmattn::dtype_name(c.bias->dtype.value_or(c.dtype)) << "/" << values_str(c.bias->values) << "/"
      << layout_str(c.bias->layout);
  if (c.lse_dtype) s << " lse=" << dmattn::dtype_name(*c.lse_dtype);
  return s.str() + options_str(c.options);
}

Case make_case(DType dtype, std::int64_t Sq, std::int64_t Sk, std::int64_t D) {
  Case c;
  c.dtype = dtype, c.Sq = Sq, c.Sk = Sk, c.D = D;
  return c;
}

std::string describe(const VarlenCase& c) {
  std::ostringstream s;
  s << dmattn::dtype_name(c.dtype) << " varlen lengths=";
  for (const auto& [sq, sk] : c.lengths) s << "(" << sq << "," << sk << ")";
  s << " H=" << c.H << " Hk=" << c.Hk << " D=" << c.D << " qkv=" << layout_str(c.qkv_layout);
  if (c.bias_heads)
    s << " bias(total_k," << *c.bias_heads << ")/" << dmattn::dtype_name(c.bias_dtype.value_or(c.dtype)) << "/"
      << values_str(c.bias_values) << "/" << layout_str(c.bias_layout);
  if (c.max_seqlen_slack) s << " max_seqlen+" << c.max_seqlen_slack;
  return s.str() + options_str(c.options);
}

void fill_values(HostTensor& t, Values values, Rng& rng) {
  const DType dtype = t.dtype();
  switch (values) {
    case Values::kUniform: t.fill([&](std::int64_t) { return rng.uniform(-2.0, 2.0); }); return;
    case Values::kTiers: t.fill([&](std::int64_t) { return static_cast<double>(rng.integer(0, 2)); }); return;
    case Values::kConstant: t.fill([](std::int64_t) { return 0.5; }); return;
    case Values::kDistinct: {
      std::vector<std::int64_t> rank(static_cast<std::size_t>(t.numel()));
      std::iota(rank.begin(), rank.end(), 0);
      std::shuffle(rank.begin(), rank.end(), rng.engine());
      const double step = 4.0 / static_cast<double>(std::max<std::int64_t>(1, t.numel()));
      t.fill([&](std::int64_t i) { return -2.0 + step * static_cast<double>(rank[i]); });
      return;
    }
    case Values::kExtreme: {
      const double clamp = max_finite(dtype);
      const double extremes[] = {std::max(-1e30, -clamp), std::min(1e30, clamp), lowest(dtype)};
      t.fill([&](std::int64_t) {
        const std::int64_t pick = rng.integer(0, 5);
        return pick < 3 ? extremes[pick] : rng.uniform(-2.0, 2.0);
      });
      return;
    }
    case Values::kNegInf: {
      const std::int64_t row_length = t.shape().size() == 4 ? t.shape()[3] : t.numel() + 1;
      t.fill([&](std::int64_t i) {
        const bool excluded = (i / std::max<std::int64_t>(row_length, 1)) % 4 == 1 || rng.integer(0, 2) == 0;
        return excluded ? -std::numeric_limits<double>::infinity() : rng.uniform(-2.0, 2.0);
      });
      return;
    }
  }
}

dmattn::Inputs Instance::inputs() const {
  dmattn::Inputs in{q.view(), k.view(), v.view(), std::nullopt, std::nullopt};
  if (mask) in.mask = mask->view();
  if (bias) in.bias = bias->view();
  if (topk_intervals) in.topk_intervals = topk_intervals->view();
  return in;
}

RefProblem Instance::problem() const {
  RefProblem p;
  p.B = c.B, p.Sq = c.Sq, p.Sk = c.Sk, p.H = c.H, p.Hk = c.Hk, p.D = c.D;
  p.q = q.values(), p.k = k.values(), p.v = v.values();
  if (mask) p.mask_shape = c.mask->shape, p.mask = mask->values();
  if (bias) p.bias_shape = c.bias->shape, p.bias = bias->values();
  p.options = ref_options(c.options, c.D);
  return p;
}

Instance make_instance(const Case& c, Rng& rng) {
  Instance in;
  in.c = c;
  in.q = random_tensor(c.dtype, {c.B, c.Sq, c.H, c.D}, c.qkv_layout, rng);
  in.k = random_tensor(c.dtype, {c.B, c.Sk, c.Hk, c.D}, c.qkv_layout, rng);
  in.v = random_tensor(c.dtype, {c.B, c.Sk, c.Hk, c.D}, c.qkv_layout, rng);
  in.dout = random_tensor(c.dtype, {c.B, c.Sq, c.H, c.D}, c.qkv_layout, rng);
  if (c.mask) {
    in.mask = HostTensor(DType::kBool, {c.mask->shape.begin(), c.mask->shape.end()}, c.mask->layout, false);
    in.mask->fill([&](std::int64_t) { return rng.bernoulli(c.mask->keep) ? 1.0 : 0.0; });
  }
  if (c.bias) {
    in.bias = HostTensor(c.bias->dtype.value_or(c.dtype), {c.bias->shape.begin(), c.bias->shape.end()},
                         c.bias->layout, false);
    fill_values(*in.bias, c.bias->values, rng);
  }
  return in;
}

Results run_forward(const Instance& in) {
  const Case& c = in.c;
  Results r;
  r.out = poisoned(c.dtype, in.q.shape(), c.out_layout);
  if (c.options.return_lse)
    r.lse = poisoned(lse_dtype_for(c.dtype, c.lse_dtype), {c.B, c.H, c.Sq}, writable(c.out_layout), false);
  dmattn::forward(in.inputs(), r.out.view(),
                  r.lse ? std::optional<dmattn::TensorView>(r.lse->view()) : std::nullopt, c.options);
  return r;
}

void run_backward(const Instance& in, Results& r, bool with_dbias) {
  const Layout bias_layout = in.c.bias ? in.c.bias->layout : Layout{};
  run_backward_on(in.k.shape(), in.c.out_layout, in.bias, bias_layout, with_dbias, r,
                  [&](const dmattn::Gradients& g) {
                    dmattn::backward(in.inputs(), r.out.view(), in.dout.view(), r.lse->view(), g, in.c.options);
                  });
}

dmattn::Inputs VarlenInstance::inputs() const {
  dmattn::Inputs in{q.view(), k.view(), v.view(), std::nullopt, std::nullopt};
  if (bias) in.bias = bias->view();
  if (topk_intervals) in.topk_intervals = topk_intervals->view();
  return in;
}

dmattn::VarlenLayout VarlenInstance::layout() const {
  return {cu_seqlens_q.view(), cu_seqlens_k.view(), max_seqlen_q, max_seqlen_k};
}

RefVarlenProblem VarlenInstance::problem() const {
  RefVarlenProblem p;
  for (std::int64_t b = 0; b < cu_seqlens_q.numel(); ++b) {
    p.cu_q.push_back(static_cast<std::int64_t>(cu_seqlens_q.at(b)));
    p.cu_k.push_back(static_cast<std::int64_t>(cu_seqlens_k.at(b)));
  }
  p.H = c.H, p.Hk = c.Hk, p.D = c.D;
  p.q = q.values(), p.k = k.values(), p.v = v.values();
  if (bias) p.Hb = *c.bias_heads, p.bias = bias->values();
  p.options = ref_options(c.options, c.D);
  return p;
}

VarlenInstance make_instance(const VarlenCase& c, Rng& rng) {
  VarlenInstance in;
  in.c = c;
  const auto n = static_cast<std::int64_t>(c.lengths.size());
  in.cu_seqlens_q = HostTensor(DType::kInt32, {n + 1});
  in.cu_seqlens_k = HostTensor(DType::kInt32, {n + 1});
  std::int64_t total_q = 0, total_k = 0;
  in.cu_seqlens_q.set(0, 0);
  in.cu_seqlens_k.set(0, 0);
  for (std::int64_t b = 0; b < n; ++b) {
    const auto [sq, sk] = c.lengths[b];
    total_q += sq, total_k += sk;
    in.cu_seqlens_q.set(b + 1, static_cast<double>(total_q));
    in.cu_seqlens_k.set(b + 1, static_cast<double>(total_k));
    in.max_seqlen_q = std::max(in.max_seqlen_q, sq);
    in.max_seqlen_k = std::max(in.max_seqlen_k, sk);
  }
  in.max_seqlen_q += c.max_seqlen_slack;
  in.max_seqlen_k += c.max_seqlen_slack;
  in.q = random_tensor(c.dtype, {total_q, c.H, c.D}, c.qkv_layout, rng);
  in.k = random_tensor(c.dtype, {total_k, c.Hk, c.D}, c.qkv_layout, rng);
  in.v = random_tensor(c.dtype, {total_k, c.Hk, c.D}, c.qkv_layout, rng);
  in.dout = random_tensor(c.dtype, {total_q, c.H, c.D}, c.qkv_layout, rng);
  if (c.bias_heads) {
    in.bias = HostTensor(c.bias_dtype.value_or(c.dtype), {total_k, *c.bias_heads}, c.bias_layout, false);
    fill_values(*in.bias, c.bias_values, rng);
  }
  return in;
}

Results run_forward(const VarlenInstance& in) {
  const VarlenCase& c = in.c;
  Results r;
  r.out = poisoned(c.dtype, in.q.shape(), c.qkv_layout);
  if (c.options.return_lse)
    r.lse = poisoned(lse_dtype_for(c.dtype, std::nullopt), {c.H, in.q.shape()[0]}, writable(c.qkv_layout), false);
  dmattn::varlen_forward(in.inputs(), in.layout(), r.out.view(),
                         r.lse ? std::optional<dmattn::TensorView>(r.lse->view()) : std::nullopt, c.options);
  return r;
}

void run_backward(const VarlenInstance& in, Results& r, bool with_dbias) {
  run_backward_on(in.k.shape(), in.c.qkv_layout, in.bias, in.c.bias_layout, with_dbias, r,
                  [&](const dmattn::Gradients& g) {
                    dmattn::varlen_backward(in.inputs(), in.layout(), r.out.view(), in.dout.view(), r.lse->view(),
                                            g, in.c.options);
                  });
}

Oracle oracle_of(const Instance& in, bool backward) {
  return [problem = in.problem(), dout = backward ? std::optional(in.dout.values()) : std::nullopt](const Rounding& r) {
    return reference(problem, dout, r);
  };
}

Oracle oracle_of(const VarlenInstance& in, bool backward) {
  return [problem = in.problem(), dout = backward ? std::optional(in.dout.values()) : std::nullopt](const Rounding& r) {
    return reference_varlen(problem, dout, r);
  };
}

double max_abs_finite(const std::vector<double>& x) {
  double m = 0.0;
  for (double e : x)
    if (std::isfinite(e)) m = std::max(m, std::fabs(e));
  return m;
}

::testing::AssertionResult within(const std::string& name, const HostTensor& actual,
                                  const std::vector<double>& expected, double tol) {
  return within(name, actual.values(), actual.shape(), expected, tol);
}

::testing::AssertionResult within(const std::string& name, const std::vector<double>& a, const Shape& shape,
                                  const std::vector<double>& expected, double tol) {
  if (a.size() != expected.size())
    return ::testing::AssertionFailure() << name << ": " << a.size() << " elements, expected " << expected.size();
  double worst = 0.0;
  std::size_t worst_at = 0, bad = 0, first_bad = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    // NaN never passes; an infinity only where the reference has the same one.
    if (std::isnan(a[i]) || (std::isinf(expected[i]) ? a[i] != expected[i] : !std::isfinite(a[i]))) {
      if (bad++ == 0) first_bad = i;
      continue;
    }
    if (std::isfinite(expected[i]) && std::fabs(a[i] - expected[i]) > worst) {
      worst = std::fabs(a[i] - expected[i]);
      worst_at = i;
    }
  }
  if (bad == 0 && worst <= tol) return ::testing::AssertionSuccess();
  ::testing::AssertionResult failure = ::testing::AssertionFailure();
  failure << name << " (shape " << shape_str(shape) << "):";
  if (bad)
    failure << " " << bad << " non-finite or wrongly infinite element(s), first " << name
            << index_str(shape, static_cast<std::int64_t>(first_bad)) << " = " << a[first_bad] << " (expected "
            << expected[first_bad] << ");";
  if (worst > tol)
    failure << " max abs error " << worst << " > tolerance " << tol << " at " << name
            << index_str(shape, static_cast<std::int64_t>(worst_at)) << " (got " << a[worst_at] << ", expected "
            << expected[worst_at] << ")";
  return failure;
}

void expect_results_match(const Results& r, DType q_dtype, const Oracle& oracle) {
  const RefResult ref = oracle(Rounding{});
  std::vector<RefResult> naive;
  if (is_low_precision(q_dtype)) {
    const std::optional<DType> bias_dtype = r.dbias ? std::optional<DType>(r.dbias->dtype()) : std::nullopt;
    const DType lse_dtype = r.lse ? r.lse->dtype() : DType::kFloat32;
    naive.push_back(oracle(Rounding{q_dtype, q_dtype, q_dtype, bias_dtype}));
    naive.push_back(oracle(Rounding{std::nullopt, q_dtype, lse_dtype, bias_dtype}));
  }
  auto check = [&](const char* name, const HostTensor& actual, std::vector<double> RefResult::*member,
                   const std::vector<double>& magnitude) {
    double tol = relative_tolerance(actual.dtype()) * max_abs_finite(magnitude);
    if (!naive.empty()) {
      // A naive computation that overflows the dtype (e.g. a float32 bias of 1e30 rounded
      // to float16) measures nothing: only finite naive errors count.
      double naive_error = 0.0;
      for (const RefResult& n : naive) {
        const double e = max_abs_diff(n.*member, ref.*member);
        if (std::isfinite(e)) naive_error = std::max(naive_error, e);
      }
      tol = 2.0 * naive_error + kAbsoluteSlack;
    }
    EXPECT_TRUE(within(name, actual, ref.*member, tol));
    EXPECT_TRUE(actual.padding_untouched()) << name << " was written outside its view";
  };
  check("out", r.out, &RefResult::out, ref.out);
  if (r.lse) check("lse", *r.lse, &RefResult::lse, ref.lse);
  if (!r.backward) return;
  check("dq", r.dq, &RefResult::dq, ref.dq);
  check("dk", r.dk, &RefResult::dk, ref.dk);
  check("dv", r.dv, &RefResult::dv, ref.dv);
  if (r.dbias) check("dbias", *r.dbias, &RefResult::dbias, ref.dbias_abs);
}

const std::vector<DType>& all_dtypes() {
  static const std::vector<DType> dtypes{DType::kFloat64, DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  return dtypes;
}

std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info) {
  return dmattn::dtype_name(info.param);
}

::testing::AssertionResult bitwise_equal(const std::string& name, const HostTensor& a, const HostTensor& b) {
  const std::vector<double> x = a.values(), y = b.values();
  if (x.size() != y.size()) return ::testing::AssertionFailure() << name << ": sizes differ";
  for (std::size_t i = 0; i < x.size(); ++i)
    if (std::memcmp(&x[i], &y[i], sizeof(double)) != 0)
      return ::testing::AssertionFailure() << name << index_str(a.shape(), static_cast<std::int64_t>(i))
                                           << " differs: " << x[i] << " vs " << y[i];
  return ::testing::AssertionSuccess();
}

Checked check_case(const Case& c, Rng& rng, bool backward) {
  SCOPED_TRACE(describe(c));
  Checked checked{make_instance(c, rng), {}};
  try {
    checked.r = run_forward(checked.in);
    if (backward) run_backward(checked.in, checked.r);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "dmattn threw: " << e.what();
    return checked;
  }
  expect_matches_reference(checked.in, checked.r);
  return checked;
}

std::int64_t expect_masked_rows_exact(const Checked& checked) {
  const Case& c = checked.in.c;
  const Results& r = checked.r;
  const RefResult ref = reference(checked.in.problem(), {});
  const bool full_bias = r.dbias && r.dbias->shape() == Shape{c.B, c.H, c.Sq, c.Sk};
  std::int64_t masked = 0;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.H; ++h)
      for (std::int64_t i = 0; i < c.Sq; ++i) {
        const std::int64_t row = (b * c.H + h) * c.Sq + i;
        if (ref.lse[row] != -std::numeric_limits<double>::infinity()) continue;
        ++masked;
        const std::string at = "(b, h, i) = (" + std::to_string(b) + ", " + std::to_string(h) + ", " +
                               std::to_string(i) + ")";
        if (r.lse) {
          EXPECT_EQ(r.lse->at(row), -std::numeric_limits<double>::infinity()) << "lse at " << at;
        }
        for (std::int64_t d = 0; d < c.D; ++d) {
          const std::int64_t e = ((b * c.Sq + i) * c.H + h) * c.D + d;
          EXPECT_EQ(r.out.at(e), 0.0) << "out at " << at;
          if (r.backward) {
            EXPECT_EQ(r.dq.at(e), 0.0) << "dq at " << at;
          }
        }
        for (std::int64_t j = 0; full_bias && j < c.Sk; ++j)
          EXPECT_EQ(r.dbias->at(row * c.Sk + j), 0.0) << "dbias at " << at << ", j = " << j;
      }
  return masked;
}

}  // namespace dmattn_test
