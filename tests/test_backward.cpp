// Backward pass against the oracle: dq, dk, dv and dbias reduced to the bias's
// own shape, over the whole case matrix in every dtype; zero gradients of
// masked rows; bitwise determinism across runs and thread counts.
#include <cstdlib>
#include <optional>
#include <string>

#include "cases.h"

namespace dmattn_test {
namespace {

class BackwardMatrix : public SeededTest<GroupParam> {};

TEST_P(BackwardMatrix, MatchesReference) {
  const auto& [dtype, group] = GetParam();
  for (const Case& c : cases(group, dtype)) check_case(c, rng, true);
}

INSTANTIATE_TEST_SUITE_P(All, BackwardMatrix,
                         ::testing::Combine(::testing::ValuesIn(all_dtypes()), ::testing::ValuesIn(case_groups())),
                         group_param_name);

class Backward : public SeededTest<DType> {};

TEST_P(Backward, BiasGradientIsOptional) {
  Case c = make_case(GetParam(), 7, 10, 16);
  c.options.causal = true;
  c.bias = BiasSpec{{c.B, c.H, c.Sq, c.Sk}, {}, std::nullopt, Values::kUniform};
  SCOPED_TRACE(describe(c));
  const Instance in = make_instance(c, rng);
  Results r = run_forward(in);
  run_backward(in, r, /*with_dbias=*/false);
  EXPECT_FALSE(r.dbias);
  expect_matches_reference(in, r);
}

// Rows with no allowed key contribute nothing: their dq and dbias rows are
// exactly 0, and with every key masked all gradients are exactly 0.
TEST_P(Backward, FullyMaskedRowsHaveZeroGradients) {
  Case c = make_case(GetParam(), 9, 5, 16);
  c.options.causal = true;
  c.mask = MaskSpec{{c.B, c.H, c.Sq, 1}, {}, 0.6};
  c.bias = BiasSpec{{c.B, c.H, c.Sq, c.Sk}, {}, std::nullopt, Values::kUniform};
  EXPECT_GE(expect_masked_rows_exact(check_case(c, rng, true)), c.B * c.H * (c.Sq - c.Sk));

  c.mask->keep = 0.0;
  const Checked none = check_case(c, rng, true);
  for (const auto* g : {&none.r.dq, &none.r.dk, &none.r.dv, &*none.r.dbias})
    for (std::int64_t e = 0; e < g->numel(); ++e) ASSERT_EQ(g->at(e), 0.0) << "element " << e;
}

// A bias constant along keys (its key dimension 1) cannot change the softmax:
// its gradient is exactly zero (SPEC 4), not rounding noise, in every dtype.
TEST_P(Backward, KeyConstantBiasHasExactlyZeroGradient) {
  for (const Shape4 shape : {Shape4{1, 1, 1, 1}, Shape4{2, 1, 1, 1}, Shape4{1, 4, 1, 1}, Shape4{2, 2, 13, 1},
                             Shape4{1, 1, 13, 1}}) {
    Case c = make_case(GetParam(), 13, 17, 16);
    c.options.causal = true;
    c.bias = BiasSpec{shape, {}, std::nullopt, Values::kUniform};
    SCOPED_TRACE(describe(c));
    const Checked checked = check_case(c, rng, true);
    for (std::int64_t e = 0; e < checked.r.dbias->numel(); ++e) ASSERT_EQ(checked.r.dbias->at(e), 0.0) << "element " << e;
  }
}

// dk, dv and dbias are bitwise reproducible, dq too with deterministic = true,
// whatever the thread count.
TEST_P(Backward, BitwiseDeterministic) {
  for (bool deterministic : {false, true}) {
    Case c = make_case(GetParam(), 33, 31, 16);
    c.H = 8, c.Hk = 2;
    c.options.causal = true;
    c.options.deterministic = deterministic;
    c.bias = BiasSpec{{1, c.Hk, 1, c.Sk}, {}, std::nullopt, Values::kUniform};
    SCOPED_TRACE(describe(c));
    const Instance in = make_instance(c, rng);
    const Results forward = run_forward(in);
    std::optional<Results> first;
    for (std::optional<int> threads : {std::optional<int>{}, std::optional<int>{1}, std::optional<int>{3},
                                       std::optional<int>{1}}) {
      SCOPED_TRACE("DMATTN_NUM_THREADS=" + (threads ? std::to_string(*threads) : std::string("unset")));
      const ScopedEnv scope("DMATTN_NUM_THREADS",  // read by the CPU backend on every call
                            threads ? std::optional<std::string>(std::to_string(*threads)) : std::nullopt);
      Results r = forward;
      run_backward(in, r);
      if (!first) {
        expect_matches_reference(in, r);
        first = r;
        continue;
      }
      EXPECT_TRUE(bitwise_equal("dk", r.dk, first->dk));
      EXPECT_TRUE(bitwise_equal("dv", r.dv, first->dv));
      EXPECT_TRUE(bitwise_equal("dbias", *r.dbias, *first->dbias));
      if (deterministic) {
        EXPECT_TRUE(bitwise_equal("dq", r.dq, first->dq));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, Backward, ::testing::ValuesIn(all_dtypes()), dtype_param_name);

}  // namespace
}  // namespace dmattn_test
