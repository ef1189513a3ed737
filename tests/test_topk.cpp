// The dynamic top-k mask (SPEC 3): keep the w allowed keys with the largest
// bias, ties to the larger key index, no gradient through the selection.
#include <algorithm>
#include <cmath>
#include <limits>

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

// ---- The selection given (Inputs::topk_intervals) and select_topk.

// Selection heads of a case: max(bias heads, mask heads) (dmattn.h select_topk).
std::int64_t selection_heads(const Case& c) {
  return std::max(c.bias->shape[1], c.mask ? c.mask->shape[1] : std::int64_t{1});
}

// The intervals select_topk writes for an instance (int32 (B, Hs, Sk, 2)).
HostTensor select(const Instance& in) {
  HostTensor t(DType::kInt32, {in.c.B, selection_heads(in.c), in.c.Sk, 2});
  t.poison();
  dmattn::select_topk(in.inputs(), in.c.options, t.view());
  return t;
}

Results forward_backward(const Instance& in) {
  Results r = run_forward(in);
  run_backward(in, r);
  return r;
}

void expect_bitwise_equal(const Results& given, const Results& computed) {
  EXPECT_TRUE(bitwise_equal("out", given.out, computed.out));
  EXPECT_TRUE(bitwise_equal("lse", *given.lse, *computed.lse));
  EXPECT_TRUE(bitwise_equal("dq", given.dq, computed.dq));
  EXPECT_TRUE(bitwise_equal("dk", given.dk, computed.dk));
  EXPECT_TRUE(bitwise_equal("dv", given.dv, computed.dv));
  EXPECT_TRUE(bitwise_equal("dbias", *given.dbias, *computed.dbias));
}

// Calls whose selection intervals express (a key-only bias, at most a key-only
// mask, causal and / or a right window), more than 16 query rows: the backends'
// own selection is then intervals too. Bias heads Hk with a mask of one head
// (Hs = Hk), a mask of H heads (Hs = H), Sq < Sk, Sq > Sk, not causal, ties.
std::vector<Case> interval_cases(DType dtype) {
  std::vector<Case> cases;
  Case c = make_case(dtype, 40, 40, 8);
  c.options.causal = true, c.options.keep_window_size = 5;
  c.mask = MaskSpec{{c.B, 1, 1, c.Sk}, {}, 0.8};
  c.bias = BiasSpec{{c.B, c.Hk, 1, c.Sk}, {}, std::nullopt, Values::kTiers};
  cases.push_back(c);
  c = make_case(dtype, 33, 50, 8);
  c.options.causal = true, c.options.keep_window_size = 7;
  c.mask = MaskSpec{{c.B, c.H, 1, c.Sk}, {}, 0.7};
  c.bias = BiasSpec{{1, 1, 1, c.Sk}, Layout{true, false, {}}, DType::kFloat32, Values::kUniform};
  cases.push_back(c);
  c = make_case(dtype, 40, 25, 8);
  c.options.causal = true, c.options.keep_window_size = 3;
  c.bias = BiasSpec{{c.B, c.H, 1, c.Sk}, {}, std::nullopt, Values::kTiers};
  cases.push_back(c);
  c = make_case(dtype, 20, 17, 8);
  c.options.sliding_window = {-1, 3}, c.options.keep_window_size = 4;
  c.bias = BiasSpec{{c.B, c.Hk, 1, c.Sk}, {}, std::nullopt, Values::kUniform};
  cases.push_back(c);
  c = make_case(dtype, 18, 30, 8);
  c.options.keep_window_size = 6;
  c.mask = MaskSpec{{1, 1, 1, c.Sk}, {}, 0.6};
  c.bias = BiasSpec{{c.B, c.Hk, 1, c.Sk}, {}, std::nullopt, Values::kConstant};
  cases.push_back(c);
  return cases;
}

// Given the intervals select_topk wrote, forward and backward are bitwise the
// calls that select themselves.
TEST_P(TopK, GivenIntervalsGiveTheSameResults) {
  for (const Case& c : interval_cases(GetParam())) {
    SCOPED_TRACE(describe(c));
    Instance in = make_instance(c, rng);
    const Results computed = forward_backward(in);
    in.topk_intervals = select(in);
    expect_bitwise_equal(forward_backward(in), computed);
  }
}

// The same for packed sequences: one without rows, one without keys, one of
// fewer rows than keys and one of more.
TEST_P(TopK, VarlenGivenIntervalsGiveTheSameResults) {
  for (const auto& [causal, right] : {std::pair<bool, std::int64_t>{true, -1}, {false, 2}}) {
    VarlenCase c;
    c.dtype = GetParam();
    c.lengths = {{20, 30}, {0, 5}, {37, 25}, {18, 0}};
    c.bias_heads = 2;
    c.bias_values = Values::kTiers;
    c.options.causal = causal, c.options.sliding_window.right = right, c.options.keep_window_size = 4;
    SCOPED_TRACE(describe(c));
    VarlenInstance in = make_instance(c, rng);
    Results computed = run_forward(in);
    run_backward(in, computed);
    HostTensor intervals(DType::kInt32, {4, 2, in.max_seqlen_k, 2});
    intervals.poison();
    dmattn::varlen_select_topk(in.inputs(), in.layout(), c.options, intervals.view());
    in.topk_intervals = intervals;
    Results given = run_forward(in);
    run_backward(in, given);
    expect_bitwise_equal(given, computed);
  }
}

// With few query rows the backends select per-row thresholds, and a keep window
// of at least Sk selects nothing; given intervals are used as they are in both,
// and give the oracle's results.
TEST_P(TopK, GivenIntervalsWithFewRowsOrAWideWindow) {
  for (const auto& [Sq, w] : {std::pair<std::int64_t, std::int64_t>{9, 3}, {1, 2}, {20, 40}}) {
    Case c = make_case(GetParam(), Sq, 24, 8);
    c.options.causal = true, c.options.keep_window_size = w;
    c.mask = MaskSpec{{c.B, c.H, 1, c.Sk}, {}, 0.8};
    c.bias = BiasSpec{{c.B, c.Hk, 1, c.Sk}, {}, std::nullopt, Values::kTiers};
    SCOPED_TRACE(describe(c));
    Instance in = make_instance(c, rng);
    in.topk_intervals = select(in);
    expect_results_match(forward_backward(in), c.dtype, oracle_of(in, true));
  }
}

// select_topk against the float64 oracle's allowed entries: the rows of (b,
// selection head s) that select key j are exactly [start, end), in every query
// head of s; {0, 0} where no row does.
TEST_P(TopK, SelectTopkIsTheOraclesSelection) {
  for (const Case& c : interval_cases(GetParam())) {
    SCOPED_TRACE(describe(c));
    const Instance in = make_instance(c, rng);
    const HostTensor intervals = select(in);
    const std::vector<char> allowed = reference(in.problem(), {}).allowed;
    const std::int64_t Hs = selection_heads(c), group = c.H / Hs;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.H; ++h)
        for (std::int64_t j = 0; j < c.Sk; ++j) {
          const std::int64_t e = ((b * Hs + h / group) * c.Sk + j) * 2;
          const auto start = static_cast<std::int64_t>(intervals.at(e)), end = static_cast<std::int64_t>(intervals.at(e + 1));
          EXPECT_TRUE(start < end || (start == 0 && end == 0)) << "key " << j << ": {" << start << ", " << end << "}";
          for (std::int64_t i = 0; i < c.Sq; ++i)
            ASSERT_EQ(allowed[static_cast<std::size_t>(((b * c.H + h) * c.Sq + i) * c.Sk + j)] != 0,
                      start <= i && i < end)
                << "b " << b << " head " << h << " row " << i << " key " << j << ": {" << start << ", " << end << "}";
        }
  }
}

// Intervals are user data: wild values (negative, past the rows, start after
// end, the int32 extremes) select other keys but never read or write out of
// bounds: every output is finite and nothing is written outside the views.
TEST_P(TopK, WildGivenIntervalsStayInBounds) {
  const std::int64_t extremes[] = {std::numeric_limits<std::int32_t>::min(), -1, 0, 1, 17, 40, 41, 1000,
                                   std::numeric_limits<std::int32_t>::max()};
  for (const Case& base : interval_cases(GetParam())) {
    Case c = base;
    c.out_layout = Layout{true, false, {}};
    SCOPED_TRACE(describe(c));
    Instance in = make_instance(c, rng);
    in.topk_intervals = HostTensor(DType::kInt32, {c.B, selection_heads(c), c.Sk, 2});
    in.topk_intervals->fill([&](std::int64_t) {
      return static_cast<double>(rng.bernoulli(0.5) ? extremes[rng.integer(0, 8)] : rng.integer(-5, c.Sq + 5));
    });
    const Results r = forward_backward(in);
    for (const auto& [name, t] : {std::pair<const char*, const HostTensor*>{"out", &r.out}, {"dq", &r.dq},
                                  {"dk", &r.dk}, {"dv", &r.dv}, {"dbias", &*r.dbias}}) {
      EXPECT_TRUE(t->padding_untouched()) << name << " was written outside its view";
      for (std::int64_t e = 0; e < t->numel(); ++e) ASSERT_TRUE(std::isfinite(t->at(e))) << name << " at " << e;
    }
    for (std::int64_t e = 0; e < r.lse->numel(); ++e) ASSERT_FALSE(std::isnan(r.lse->at(e))) << "lse at " << e;
  }
}

INSTANTIATE_TEST_SUITE_P(All, TopK, ::testing::ValuesIn(all_dtypes()), dtype_param_name);

}  // namespace
}  // namespace dmattn_test
