// Forward pass against the oracle: the whole case matrix (sizes, options,
// broadcasts, heads, layouts) in every dtype, plus forward-only behaviour.
#include "cases.h"

namespace dmattn_test {
namespace {

class ForwardMatrix : public SeededTest<GroupParam> {};

TEST_P(ForwardMatrix, MatchesReference) {
  const auto& [dtype, group] = GetParam();
  for (const Case& c : cases(group, dtype)) check_case(c, rng, false);
}

INSTANTIATE_TEST_SUITE_P(All, ForwardMatrix,
                         ::testing::Combine(::testing::ValuesIn(all_dtypes()), ::testing::ValuesIn(case_groups())),
                         group_param_name);

class Forward : public SeededTest<DType> {};

TEST_P(Forward, LseIsOptionalWithoutReturnLse) {
  Case c = make_case(GetParam(), 6, 9, 16);
  c.options.causal = true;
  c.options.return_lse = false;
  c.bias = BiasSpec{{c.B, c.Hk, 1, c.Sk}, {}, std::nullopt, Values::kUniform};
  check_case(c, rng, false);
}

// An odd, long key dimension and a key-only bias sliced out of a bigger buffer:
// no alignment or padding requirement.
TEST_P(Forward, LongOddKeyDimension) {
  Case c = make_case(GetParam(), 3, 1023, 8);
  c.B = 1, c.H = 2, c.Hk = 1;
  c.options.causal = true;
  c.mask = MaskSpec{{1, 1, 1, c.Sk}, Layout{true, false, {}}, 0.9};
  c.bias = BiasSpec{{1, 1, 1, c.Sk}, Layout{true, false, {}}, std::nullopt, Values::kUniform};
  check_case(c, rng, false);
}

// Rows with no allowed key (a per-row mask, and causal with Sq > Sk) give
// o = 0 exactly and lse = -inf.
TEST_P(Forward, FullyMaskedRowsAreExactlyZero) {
  Case c = make_case(GetParam(), 9, 5, 16);
  c.options.causal = true;
  c.mask = MaskSpec{{c.B, c.H, c.Sq, 1}, {}, 0.6};
  c.bias = BiasSpec{{c.B, c.H, c.Sq, c.Sk}, {}, std::nullopt, Values::kUniform};
  EXPECT_GE(expect_masked_rows_exact(check_case(c, rng, false)), c.B * c.H * (c.Sq - c.Sk));
}

INSTANTIATE_TEST_SUITE_P(All, Forward, ::testing::ValuesIn(all_dtypes()), dtype_param_name);

// float64 inputs may return a float32 lse: then lse is exact to float32.
TEST_F(SeededFixture, Float64InputsWithFloat32Lse) {
  Case c = make_case(DType::kFloat64, 7, 12, 16);
  c.lse_dtype = DType::kFloat32;
  c.options.causal = true;
  c.bias = BiasSpec{{1, c.H, c.Sq, c.Sk}, {}, DType::kFloat32, Values::kUniform};
  check_case(c, rng, false);
}

}  // namespace
}  // namespace dmattn_test
