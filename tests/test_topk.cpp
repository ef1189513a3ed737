// The dynamic top-k mask (SPEC 3): keep the w allowed keys with the largest
// bias, ties to the larger key index, no gradient through the selection.
#include "cases.h"

namespace dmattn_test {
namespace {

class TopK : public SeededTest<DType> {};

// Runs `in` again with other options on the same inputs.
Results rerun(const Instance& in, const dmattn::Options& options) {
  Instance other = in;
  other.c.options = options;
  Results r = run_forward(other);
  run_backward(other, r);
  return r;
}

// A constant bias ties every key, so the w most recent allowed keys win: under
// causal that is the sliding window (w - 1, 0).
TEST_P(TopK, ConstantBiasUnderCausalIsASlidingWindow) {
  for (std::int64_t w : {1, 3, 8})
    for (const auto& [Sq, Sk] : {std::pair<std::int64_t, std::int64_t>{9, 9}, {5, 12}, {12, 5}}) {
      Case c = make_case(GetParam(), Sq, Sk, 16);
      c.options.causal = true;
      c.options.keep_window_size = w;
      c.bias = BiasSpec{{c.B, c.Hk, 1, c.Sk}, {}, std::nullopt, Values::kConstant};
      SCOPED_TRACE(describe(c));
      const Checked top_k = check_case(c, rng, true);

      dmattn::Options window = c.options;
      window.keep_window_size.reset();
      window.sliding_window = {w - 1, 0};
      Instance windowed = top_k.in;
      windowed.c.options = window;
      EXPECT_EQ(reference(top_k.in.problem(), {}).allowed, reference(windowed.problem(), {}).allowed)
          << "oracle: top-k of a constant bias differs from the sliding window";
      SCOPED_TRACE("the sliding-window call against the top-k oracle");
      expect_results_match(rerun(top_k.in, window), c.dtype, oracle_of(top_k.in, true));
    }
}

// The Doge case: a key-only bias (B, Hk, 1, Sk) under causal and a key padding
// mask, with random and heavily tied values, for small and large w.
TEST_P(TopK, KeyOnlyBiasWithPaddingMask) {
  for (Values values : {Values::kUniform, Values::kTiers})
    for (std::int64_t w : {1, 4, 16})
      for (const auto& [Sq, Sk] :
           {std::pair<std::int64_t, std::int64_t>{13, 17}, {17, 17}, {17, 13}, {130, 257}}) {
        Case c = make_case(GetParam(), Sq, Sk, 16);
        c.options.causal = true;
        c.options.keep_window_size = w;
        c.mask = MaskSpec{{c.B, 1, 1, c.Sk}, {}, 0.8};
        c.bias = BiasSpec{{c.B, c.Hk, 1, c.Sk}, {}, std::nullopt, values};
        check_case(c, rng, true);
      }
}

// Per-row biases, with and without causal, and grouped / multi-query heads.
TEST_P(TopK, PerRowBias) {
  for (Values values : {Values::kUniform, Values::kTiers})
    for (std::int64_t w : {2, 5})
      for (bool causal : {false, true}) {
        Case c = make_case(GetParam(), 11, 14, 8);
        c.options.causal = causal;
        c.options.keep_window_size = w;
        c.bias = BiasSpec{{c.B, c.H, c.Sq, c.Sk}, {}, std::nullopt, values};
        check_case(c, rng, true);
        c.H = 4, c.Hk = 1;
        c.bias = BiasSpec{{1, 1, c.Sq, c.Sk}, Layout{true, true, {}}, DType::kFloat32, values};
        check_case(c, rng, true);
      }
}

// A sliding window lets keys leave a row's view; a per-query-head mask gives
// the query heads that share a bias head different allowed sets.
TEST_P(TopK, WithSlidingWindowAndPerHeadMask) {
  for (Values values : {Values::kUniform, Values::kTiers}) {
    for (const auto& [left, right] : {std::pair<std::int64_t, std::int64_t>{6, -1}, {4, 2}, {-1, 3}}) {
      Case c = make_case(GetParam(), 12, 15, 16);
      c.options.sliding_window = {left, right};
      c.options.keep_window_size = 3;
      c.bias = BiasSpec{{c.B, c.Hk, 1, c.Sk}, {}, std::nullopt, values};
      check_case(c, rng, true);
    }
    Case c = make_case(GetParam(), 10, 10, 16);
    c.options.causal = true;
    c.options.keep_window_size = 4;
    c.mask = MaskSpec{{c.B, c.H, c.Sq, c.Sk}, {}, 0.7};
    c.bias = BiasSpec{{c.B, c.Hk, 1, c.Sk}, {}, std::nullopt, values};
    check_case(c, rng, true);
  }
}

// w >= every row's allowed count keeps every key: the same as no top-k.
TEST_P(TopK, LargeWindowKeepsEveryKey) {
  for (std::int64_t extra : {0, 5}) {
    Case c = make_case(GetParam(), 8, 11, 16);
    c.options.keep_window_size = c.Sk + extra;
    c.mask = MaskSpec{{c.B, 1, c.Sq, c.Sk}, {}, 0.8};
    c.bias = BiasSpec{{c.B, c.H, c.Sq, c.Sk}, {}, std::nullopt, Values::kTiers};
    SCOPED_TRACE(describe(c));
    const Checked top_k = check_case(c, rng, true);
    Instance dense = top_k.in;
    dense.c.options.keep_window_size.reset();
    expect_results_match(top_k.r, c.dtype, oracle_of(dense, true));
  }
}

// The selection passes no gradient: dbias is exactly 0 on every entry the
// row did not select (or could not see).
TEST_P(TopK, NoBiasGradientOutsideTheSelection) {
  Case c = make_case(GetParam(), 9, 13, 16);
  c.options.causal = true;
  c.options.keep_window_size = 3;
  c.bias = BiasSpec{{c.B, c.H, c.Sq, c.Sk}, {}, std::nullopt, Values::kUniform};
  const Checked checked = check_case(c, rng, true);
  ASSERT_TRUE(checked.r.dbias);
  const RefResult ref = reference(checked.in.problem(), {});
  std::int64_t unselected = 0, selected_nonzero = 0;
  for (std::int64_t e = 0; e < checked.r.dbias->numel(); ++e) {
    if (ref.allowed[e]) {
      selected_nonzero += checked.r.dbias->at(e) != 0.0;
      continue;
    }
    ++unselected;
    EXPECT_EQ(checked.r.dbias->at(e), 0.0) << "dbias at flat index " << e << " (not selected)";
  }
  EXPECT_GT(unselected, 0);
  EXPECT_GT(selected_nonzero, 0);
}

INSTANTIATE_TEST_SUITE_P(All, TopK, ::testing::ValuesIn(all_dtypes()), dtype_param_name);

}  // namespace
}  // namespace dmattn_test
