// Extreme biases (+-1e30 and each dtype's lowest value), rows with no allowed
// key, and empty inputs (B, Sq or Sk = 0, empty varlen batches).
#include <cmath>

#include "harness.h"

namespace dmattn_test {
namespace {

class Extremes : public SeededTest<DType> {};

// The oracle itself stays finite on these inputs, so `within` (which fails on
// NaN, on INF where the reference is finite and on a finite lse where the
// reference is -inf) proves the library finite too.
void expect_reference_finite(const Instance& in) {
  const RefResult ref = reference(in.problem(), in.dout.values());
  for (const auto* v : {&ref.out, &ref.dq, &ref.dk, &ref.dv, &ref.dbias})
    for (double x : *v) ASSERT_TRUE(std::isfinite(x)) << "the oracle is not finite on these inputs";
  for (double x : ref.lse) ASSERT_TRUE(std::isfinite(x) || x == -INFINITY);
}

// Causal, a per-row or element mask (rows with no key), full or key-only
// biases in q's dtype or float32, with softcap or top-k.
std::vector<Case> extreme_cases(DType dtype) {
  std::vector<Case> cases;
  for (DType bias_dtype : {dtype, DType::kFloat32})
    for (const bool key_only : {false, true})
      for (const bool per_row_mask : {false, true})
        for (const std::int64_t keep : {0, 3}) {
          Case c = make_case(dtype, 9, 11, 16);
          c.options.causal = true;
          c.options.softcap = keep ? 0.0 : 5.0;
          if (keep) c.options.keep_window_size = keep;
          c.mask = per_row_mask ? MaskSpec{{c.B, 1, c.Sq, 1}, {}, 0.7} : MaskSpec{{c.B, 1, c.Sq, c.Sk}, {}, 0.8};
          const Shape4 shape = key_only ? Shape4{c.B, c.Hk, 1, c.Sk} : Shape4{c.B, c.H, c.Sq, c.Sk};
          c.bias = BiasSpec{shape, {}, bias_dtype, Values::kExtreme};
          cases.push_back(c);
        }
  return cases;
}

// No NaN or INF anywhere (lse: -inf exactly on rows with no key), the forward
// within the accuracy rule, masked rows exactly zero.
TEST_P(Extremes, HugeAndLowestBiases) {
  constexpr double kAnyFiniteError = INFINITY;
  for (const Case& c : extreme_cases(GetParam())) {
    SCOPED_TRACE(describe(c));
    Checked checked{make_instance(c, rng), {}};
    checked.r = run_forward(checked.in);
    run_backward(checked.in, checked.r);
    expect_reference_finite(checked.in);
    Results forward_only = checked.r;
    forward_only.backward = false;
    expect_matches_reference(checked.in, forward_only);
    const RefResult ref = reference(checked.in.problem(), checked.in.dout.values());
    EXPECT_TRUE(within("dq", checked.r.dq, ref.dq, kAnyFiniteError));
    EXPECT_TRUE(within("dk", checked.r.dk, ref.dk, kAnyFiniteError));
    EXPECT_TRUE(within("dv", checked.r.dv, ref.dv, kAnyFiniteError));
    EXPECT_TRUE(within("dbias", *checked.r.dbias, ref.dbias, kAnyFiniteError));
    expect_masked_rows_exact(checked);
  }
}

// The gradients under the accuracy rule too. Rows whose largest logits are
// huge and tied (several keys at +1e30, or only -1e30 keys) have
// lse = m + log(n) == m in floating point: a backward that recomputes
// p = exp(l - lse) from lse alone gets p = 1 for each of the n keys.
TEST_P(Extremes, HugeAndLowestBiasGradients) {
  for (const Case& c : extreme_cases(GetParam())) check_case(c, rng, true);
}

// A bias entry of -inf excludes the entry as the mask does (SPEC 2): every
// bias shape, with causal, softcap and top-k, against the oracle; rows whose
// entries are all -inf give o = 0, lse = -inf and zero dq exactly.
TEST_P(Extremes, NegativeInfinityBiasExcludes) {
  for (const bool topk : {false, true})
    for (const Shape4 shape : {Shape4{2, 4, 9, 11}, Shape4{2, 2, 1, 11}, Shape4{1, 1, 9, 11}, Shape4{2, 4, 9, 1},
                               Shape4{1, 2, 1, 1}}) {
      Case c = make_case(GetParam(), 9, 11, 16);
      c.options.causal = !topk;
      if (topk) c.options.keep_window_size = 4;
      else c.options.softcap = 5.0;
      c.bias = BiasSpec{shape, {}, std::nullopt, Values::kNegInf};
      SCOPED_TRACE(describe(c));
      EXPECT_GT(expect_masked_rows_exact(check_case(c, rng, true)), 0);
    }
}

// Every key masked: o = 0, lse = -inf and every gradient exactly 0.
TEST_P(Extremes, EverythingMasked) {
  Case c = make_case(GetParam(), 6, 7, 16);
  c.mask = MaskSpec{{1, 1, 1, 1}, {}, 0.0};
  c.bias = BiasSpec{{c.B, c.Hk, 1, c.Sk}, {}, std::nullopt, Values::kExtreme};
  const Checked checked = check_case(c, rng, true);
  EXPECT_EQ(expect_masked_rows_exact(checked), c.B * c.H * c.Sq);
  for (const HostTensor* g : {&checked.r.dk, &checked.r.dv, &*checked.r.dbias})
    for (std::int64_t e = 0; e < g->numel(); ++e) ASSERT_EQ(g->at(e), 0.0) << "element " << e;
}

// Empty inputs are valid: nothing to attend gives zeros and -inf.
TEST_P(Extremes, EmptyBatchedInputs) {
  for (const auto& [B, Sq, Sk] : {std::array<std::int64_t, 3>{0, 5, 7}, {2, 0, 7}, {2, 5, 0}, {0, 0, 0}}) {
    Case c = make_case(GetParam(), Sq, Sk, 16);
    c.B = B;
    c.options.causal = true;
    c.options.keep_window_size = 2;
    c.mask = MaskSpec{{c.B, 1, 1, c.Sk}, {}, 0.8};
    c.bias = BiasSpec{{c.B, c.H, c.Sq, c.Sk}, {}, std::nullopt, Values::kUniform};
    const Checked checked = check_case(c, rng, true);
    SCOPED_TRACE(describe(c));
    EXPECT_EQ(expect_masked_rows_exact(checked), Sk == 0 ? B * c.H * Sq : 0);
    for (const HostTensor* g : {&checked.r.dk, &checked.r.dv, &*checked.r.dbias})
      for (std::int64_t e = 0; e < g->numel(); ++e) ASSERT_EQ(g->at(e), 0.0) << "element " << e;
  }
}

TEST_P(Extremes, EmptyVarlenInputs) {
  for (const auto& lengths : {std::vector<std::pair<std::int64_t, std::int64_t>>{},
                              std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 0}, {0, 0}},
                              std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 4}, {3, 0}}}) {
    VarlenCase c;
    c.dtype = GetParam();
    c.lengths = lengths;
    c.bias_heads = c.Hk;
    c.options.causal = true;
    c.options.keep_window_size = 2;
    SCOPED_TRACE(describe(c));
    const VarlenInstance in = make_instance(c, rng);
    Results r = run_forward(in);
    run_backward(in, r);
    expect_matches_reference(in, r);
    for (std::int64_t e = 0; e < r.out.numel(); ++e) EXPECT_EQ(r.out.at(e), 0.0);
    for (std::int64_t e = 0; e < r.lse->numel(); ++e) EXPECT_EQ(r.lse->at(e), -INFINITY);
    for (const HostTensor* g : {&r.dq, &r.dk, &r.dv, &*r.dbias})
      for (std::int64_t e = 0; e < g->numel(); ++e) ASSERT_EQ(g->at(e), 0.0) << "element " << e;
  }
}

// Row-major views of empty tensors made by TensorView::contiguous have stride
// 0 on the dims outside the empty one; nothing is written through them, so
// they are valid outputs.
TEST(EmptyViews, ContiguousEmptyOutputsAreAccepted) {
  using dmattn::TensorView;
  constexpr std::int64_t B = 2, Sq = 0, Sk = 3, H = 4, D = 8;
  std::vector<float> buffer(B * Sk * H * D, 0.5f);
  const DType f32 = DType::kFloat32;
  const dmattn::Inputs in{TensorView::contiguous(buffer.data(), f32, {B, Sq, H, D}),
                          TensorView::contiguous(buffer.data(), f32, {B, Sk, H, D}),
                          TensorView::contiguous(buffer.data(), f32, {B, Sk, H, D}), std::nullopt, std::nullopt};
  std::vector<float> out(1), lse(1), dk(B * Sk * H * D), dv(dk.size());
  const TensorView out_view = TensorView::contiguous(out.data(), f32, {B, Sq, H, D});
  const TensorView lse_view = TensorView::contiguous(lse.data(), f32, {B, H, Sq});
  EXPECT_NO_THROW(dmattn::forward(in, out_view, lse_view, {}));
  const dmattn::Gradients grads{TensorView::contiguous(out.data(), f32, {B, Sq, H, D}),
                                TensorView::contiguous(dk.data(), f32, {B, Sk, H, D}),
                                TensorView::contiguous(dv.data(), f32, {B, Sk, H, D}), std::nullopt};
  EXPECT_NO_THROW(dmattn::backward(in, out_view, out_view, lse_view, grads, {}));
}

INSTANTIATE_TEST_SUITE_P(All, Extremes, ::testing::ValuesIn(all_dtypes()), dtype_param_name);

// The test helpers' own float16 / bfloat16 rounding: ties to even, subnormals,
// overflow to infinity.
TEST(TestHelpers, LowPrecisionRounding) {
  EXPECT_EQ(round_to(DType::kBFloat16, 1.0 + std::ldexp(1.0, -8)), 1.0);  // tie, to even
  EXPECT_EQ(round_to(DType::kBFloat16, 1.0 + 3 * std::ldexp(1.0, -8)), 1.0 + std::ldexp(1.0, -6));
  EXPECT_EQ(round_to(DType::kBFloat16, 3.0 + 1.0 / 128), 3.0);             // tie, to even
  EXPECT_EQ(round_to(DType::kBFloat16, 3.0 + 3.0 / 128), 3.0 + 1.0 / 32);  // tie, to even
  EXPECT_EQ(round_to(DType::kFloat16, 65504.0 + 15.0), 65504.0);
  EXPECT_TRUE(std::isinf(round_to(DType::kFloat16, 65520.0)));  // halfway to 2^16: rounds up
  EXPECT_EQ(round_to(DType::kFloat16, std::ldexp(3.0, -26)), std::ldexp(1.0, -24));  // subnormal
  EXPECT_EQ(round_to(DType::kFloat16, 2049.0), 2048.0);  // tie, to even
  EXPECT_EQ(round_to(DType::kFloat16, 2051.0), 2052.0);
  EXPECT_EQ(round_to(DType::kBFloat16, lowest(DType::kBFloat16)), lowest(DType::kBFloat16));
  EXPECT_EQ(round_to(DType::kFloat16, -0.1), -0.0999755859375);
}

}  // namespace
}  // namespace dmattn_test
