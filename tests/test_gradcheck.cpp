// Central finite differences in float64 of the loss sum(out * W), W = dout,
// against the library's backward (and, to validate the oracle, against the
// oracle's analytic gradients). Independent of the oracle's forward formulas.
#include <cmath>
#include <functional>

#include "harness.h"

namespace dmattn_test {
namespace {

constexpr double kStep = 1e-5;       // error ~ step^2 (truncation) + 1e-16 / step (rounding)
constexpr double kTolerance = 1e-6;  // times max(1, largest gradient)

// Forward output of an instance as float64 values.
using ForwardFn = std::function<std::vector<double>(const Instance&)>;

struct Grads {
  std::vector<double> dq, dk, dv, dbias;
};

// Checks the gradients of q, k, v and bias of `in` against finite differences
// of `forward`.
void expect_gradients_match_finite_differences(Instance in, const ForwardFn& forward, const Grads& grads) {
  const std::vector<double> w = in.dout.values();
  auto loss = [&] {
    const std::vector<double> out = forward(in);
    double sum = 0.0;
    for (std::size_t e = 0; e < out.size(); ++e) sum += out[e] * w[e];
    return sum;
  };
  auto check = [&](const char* name, HostTensor& x, const std::vector<double>& analytic) {
    std::vector<double> numeric(static_cast<std::size_t>(x.numel()));
    for (std::int64_t e = 0; e < x.numel(); ++e) {
      const double v = x.at(e);
      x.set(e, v + kStep);
      const double up = loss();
      x.set(e, v - kStep);
      const double down = loss();
      x.set(e, v);
      numeric[e] = (up - down) / (2 * kStep);
    }
    EXPECT_TRUE(within(name, analytic, x.shape(), numeric, kTolerance * std::max(1.0, max_abs_finite(numeric))));
  };
  check("dq", in.q, grads.dq);
  check("dk", in.k, grads.dk);
  check("dv", in.v, grads.dv);
  if (in.bias) check("dbias", *in.bias, grads.dbias);
}

void gradcheck(const Case& c, Rng& rng) {
  SCOPED_TRACE(describe(c));
  const Instance in = make_instance(c, rng);
  Results r = run_forward(in);
  run_backward(in, r);
  {
    SCOPED_TRACE("library");
    expect_gradients_match_finite_differences(
        in, [](const Instance& x) { return run_forward(x).out.values(); },
        {r.dq.values(), r.dk.values(), r.dv.values(), r.dbias ? r.dbias->values() : std::vector<double>{}});
  }
  SCOPED_TRACE("oracle");
  const RefResult ref = reference(in.problem(), in.dout.values());
  expect_gradients_match_finite_differences(
      in, [](const Instance& x) { return reference(x.problem(), {}).out; }, {ref.dq, ref.dk, ref.dv, ref.dbias});
}

Case small_case() {
  Case c = make_case(DType::kFloat64, 5, 7, 3);
  c.qkv_layout = Layout{true, true, {}};
  return c;
}

class GradCheck : public SeededFixture {};

TEST_F(GradCheck, FullBias) {
  Case c = small_case();
  c.bias = BiasSpec{{c.B, c.H, c.Sq, c.Sk}, {}, std::nullopt, Values::kUniform};
  gradcheck(c, rng);
}

TEST_F(GradCheck, KeyOnlyBiasCausalSoftcap) {
  Case c = small_case();
  c.bias = BiasSpec{{1, c.Hk, 1, c.Sk}, Layout{true, false, {}}, std::nullopt, Values::kUniform};
  c.options.causal = true;
  c.options.softcap = 1.0;
  c.options.scale = 1.5;
  gradcheck(c, rng);
}

// A bias broadcast over keys shifts whole rows: its gradient is 0.
TEST_F(GradCheck, RowBiasWithWindowAndMask) {
  Case c = small_case();
  c.bias = BiasSpec{{c.B, 1, c.Sq, 1}, {}, std::nullopt, Values::kUniform};
  c.mask = MaskSpec{{c.B, 1, c.Sq, c.Sk}, {}, 0.75};
  c.options.sliding_window = {2, 1};
  gradcheck(c, rng);
}

// With top-k the selection is fixed under small perturbations (distinct bias
// values), so finite differences see no gradient through it: unselected bias
// entries have a zero numeric gradient, which the library must match.
TEST_F(GradCheck, TopKSelection) {
  for (const bool key_only : {false, true}) {
    Case c = small_case();
    const Shape4 shape = key_only ? Shape4{c.B, c.Hk, 1, c.Sk} : Shape4{c.B, c.H, c.Sq, c.Sk};
    c.bias = BiasSpec{shape, {}, std::nullopt, Values::kDistinct};
    c.options.causal = true;
    c.options.keep_window_size = key_only ? 2 : 3;
    c.options.softcap = 3.0;
    gradcheck(c, rng);
  }
}

}  // namespace
}  // namespace dmattn_test
