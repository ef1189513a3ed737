// Shared test machinery: a problem description (Case / VarlenCase), its random
// inputs (Instance), library calls on poisoned outputs (Results) and the
// comparison with the oracle under the accuracy rule of SPEC section 5.
#pragma once

#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "reference.h"
#include "tensor.h"

namespace dmattn_test {

// Sets an environment variable (unsets it: nullopt) for a scope, restoring it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::optional<std::string>& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      setenv(name, value->c_str(), 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// How bias values are drawn.
enum class Values {
  kUniform,   // uniform in [-2, 2]
  kTiers,     // from {0, 1, 2}: heavy ties
  kConstant,  // 0.5 everywhere
  kDistinct,  // a shuffled grid: no two values within 1/numel of each other (float32 and float64)
  kExtreme,   // -1e30, +1e30 and the dtype's lowest value (clamped to the dtype) mixed with uniform ones
  kNegInf,    // -inf (an exclusion, SPEC 2) on a third of the entries and on every entry of every
              // fourth row (4-D tensors: rows along the last dimension), uniform elsewhere
};

struct MaskSpec {
  Shape4 shape{};     // the view's shape: each dim full or 1 (heads H, Hk or 1)
  Layout layout;
  double keep = 0.8;  // probability of true
};

struct BiasSpec {
  Shape4 shape{};
  Layout layout;
  std::optional<DType> dtype;  // default: the dtype of q
  Values values = Values::kUniform;
};

// A batched problem.
struct Case {
  DType dtype = DType::kFloat32;
  std::int64_t B = 2, Sq = 7, Sk = 9, H = 4, Hk = 2, D = 16;
  Layout qkv_layout;  // q, k, v and dout
  Layout out_layout;  // out, lse and dq, dk, dv
  std::optional<MaskSpec> mask;
  std::optional<BiasSpec> bias;
  dmattn::Options options;
  std::optional<DType> lse_dtype;  // default: float64 for float64 q, else float32
};
std::string describe(const Case& c);
// B = 2, H = 4, Hk = 2, no mask, bias or options.
Case make_case(DType dtype, std::int64_t Sq, std::int64_t Sk, std::int64_t D);

// Random inputs of a batched case (fresh draws, never zero tensors), and the
// top-k selection its calls are given (Inputs::topk_intervals; none: selected).
struct Instance {
  Case c;
  HostTensor q, k, v, dout;
  std::optional<HostTensor> mask, bias, topk_intervals;

  dmattn::Inputs inputs() const;
  RefProblem problem() const;  // float64 copies for the oracle, with c.options
};
Instance make_instance(const Case& c, Rng& rng);

// The outputs of one call, poisoned before it.
struct Results {
  HostTensor out;
  std::optional<HostTensor> lse;
  bool backward = false;
  HostTensor dq, dk, dv;
  std::optional<HostTensor> dbias;
};

Results run_forward(const Instance& in);
// Runs the backward on r's out and lse; with_dbias: ask for the bias gradient.
void run_backward(const Instance& in, Results& r, bool with_dbias = true);

// A varlen problem: sequence b has lengths[b] = (sq, sk) tokens.
struct VarlenCase {
  DType dtype = DType::kFloat32;
  std::vector<std::pair<std::int64_t, std::int64_t>> lengths;
  std::int64_t H = 4, Hk = 2, D = 16;
  std::optional<std::int64_t> bias_heads;  // Hb in {1, Hk, H}; none: no bias
  std::optional<DType> bias_dtype;         // default: the dtype of q
  Values bias_values = Values::kUniform;
  Layout qkv_layout, bias_layout;
  dmattn::Options options;
  std::int64_t max_seqlen_slack = 0;  // added to the true max_seqlen_q and max_seqlen_k
};
std::string describe(const VarlenCase& c);

struct VarlenInstance {
  VarlenCase c;
  HostTensor q, k, v, dout, cu_seqlens_q, cu_seqlens_k;
  std::optional<HostTensor> bias, topk_intervals;
  std::int64_t max_seqlen_q = 0, max_seqlen_k = 0;

  dmattn::Inputs inputs() const;
  dmattn::VarlenLayout layout() const;
  RefVarlenProblem problem() const;
};
VarlenInstance make_instance(const VarlenCase& c, Rng& rng);

Results run_forward(const VarlenInstance& in);
void run_backward(const VarlenInstance& in, Results& r, bool with_dbias = true);

// The oracle of one problem, run with a given rounding.
using Oracle = std::function<RefResult(const Rounding&)>;
Oracle oracle_of(const Instance& in, bool backward);
Oracle oracle_of(const VarlenInstance& in, bool backward);

// Fills a float tensor with draws of `values` for its dtype.
void fill_values(HostTensor& t, Values values, Rng& rng);

// SPEC 5: max |actual - expected| <= tol, no NaN, and -inf exactly where expected.
::testing::AssertionResult within(const std::string& name, const HostTensor& actual,
                                  const std::vector<double>& expected, double tol);
::testing::AssertionResult within(const std::string& name, const std::vector<double>& actual, const Shape& shape,
                                  const std::vector<double>& expected, double tol);
// Largest finite |x|.
double max_abs_finite(const std::vector<double>& x);

// Every output in r against the oracle. float64 / float32 outputs: max abs error
// at most 1e-12 / 1e-5 times the largest reference magnitude (for dbias, the
// largest sum of |dl| it reduces, since a bias broadcast over keys has a
// gradient that cancels to 0). float16 / bfloat16 q: max abs error at most
// 2 * (error of a naive computation in that dtype) + 1e-5, where the naive
// error is the larger of two naive computations: (a) every intermediate
// (scores, logits, probabilities, lse, o, dp, dS, gradients) rounded to the
// dtype, as an unfused implementation in that dtype would store them, and
// (b) only what is stored rounded (o before the backward reads it, the
// gradients, lse to its storage dtype), which is the error floor of any
// implementation that returns results in the dtype. (b) covers outputs that
// cancel (where (a)'s errors may cancel by chance), (a) the usual case. A naive
// computation that overflows the dtype (non-finite error) is left out.
// Also checks that sliced outputs were not written outside their views.
void expect_results_match(const Results& r, DType q_dtype, const Oracle& oracle);

// The same, for a batched or varlen instance and its results.
template <class AnyInstance>
void expect_matches_reference(const AnyInstance& in, const Results& r) {
  expect_results_match(r, in.c.dtype, oracle_of(in, r.backward));
}

// Every float dtype the CPU backend takes, for INSTANTIATE_TEST_SUITE_P.
const std::vector<DType>& all_dtypes();
std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info);

// Byte-for-byte equality of two results (bitwise determinism).
::testing::AssertionResult bitwise_equal(const std::string& name, const HostTensor& a, const HostTensor& b);

// Runs c's forward (and backward) on fresh inputs and compares with the oracle.
struct Checked {
  Instance in;
  Results r;
};
Checked check_case(const Case& c, Rng& rng, bool backward);

// Rows with no allowed key (per the oracle) must give o = 0 and lse = -inf
// exactly, and after a backward dq = 0 and, for a bias of full shape, dbias = 0
// exactly. Returns how many such rows there are.
std::int64_t expect_masked_rows_exact(const Checked& checked);

// Fixture bases: a fresh seed per test, printed with every failure.
struct Seeded {
  Rng rng;
  ::testing::ScopedTrace seed_trace{__FILE__, __LINE__, rng.trace()};
};
template <class Param>
class SeededTest : public ::testing::TestWithParam<Param>, protected Seeded {};
class SeededFixture : public ::testing::Test, protected Seeded {};

}  // namespace dmattn_test
