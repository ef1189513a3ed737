// SPEC 6: every invalid call throws dmattn::Error naming the argument, the
// expected and the actual value, of the right Kind, before anything runs, and
// leaves every tensor of the caller untouched.
#include <cmath>
#include <functional>
#include <set>
#include <tuple>

#include "validation_calls.h"

namespace dmattn_test::validation {
namespace {

void invoke(const Call& c) {
  switch (c.entry) {
    case Entry::kForward: dmattn::forward(c.in, c.out, c.lse, c.options); return;
    case Entry::kBackward: dmattn::backward(c.in, c.out, c.dout, *c.lse, c.grads, c.options); return;
    case Entry::kVarlenForward: dmattn::varlen_forward(c.in, c.layout, c.out, c.lse, c.options); return;
    case Entry::kVarlenBackward:
      dmattn::varlen_backward(c.in, c.layout, c.out, c.dout, *c.lse, c.grads, c.options);
      return;
    case Entry::kSelect: dmattn::select_topk(c.in, c.options, c.intervals); return;
    case Entry::kVarlenSelect: dmattn::varlen_select_topk(c.in, c.layout, c.options, c.intervals); return;
  }
}

class Validation : public ::testing::TestWithParam<BadCase>, protected Seeded {};

TEST_P(Validation, RejectsWithoutTouchingTensors) {
  const BadCase& bad = GetParam();
  Tensors tensors;
  Call call = valid_call(bad.entry, tensors, rng);
  bad.mutate(call);
  std::vector<std::vector<unsigned char>> before;
  for (const HostTensor& t : tensors.all) before.push_back(t.bytes());
  try {
    invoke(call);
    FAIL() << "no error thrown";
  } catch (const dmattn::Error& e) {
    EXPECT_EQ(e.kind(), bad.kind) << e.what();
    EXPECT_EQ(e.argument(), bad.argument) << e.what();
    const std::string what = e.what();
    const std::string prefix = "dmattn: " + bad.argument + ": expected ";
    EXPECT_EQ(what.rfind(prefix, 0), 0u) << what;
    EXPECT_NE(what.find(bad.message, prefix.size() - 9), std::string::npos)
        << what << "\n  should contain: " << bad.message;
  } catch (const std::exception& e) {
    FAIL() << "threw a non-dmattn::Error: " << e.what();
  }
  for (std::size_t i = 0; i < before.size(); ++i)
    EXPECT_TRUE(tensors.all[i].bytes() == before[i]) << "tensor " << i << " was written";
}

INSTANTIATE_TEST_SUITE_P(All, Validation, ::testing::ValuesIn(bad_cases()),
                         [](const ::testing::TestParamInfo<BadCase>& info) { return std::string(info.param.name); });

// dmattn::check_forward / check_backward on the same calls with every data pointer
// null: the same error, but for the cases that only the data shows (cu_seqlens values).
void check_only(const Call& c) {
  const dmattn::VarlenLayout* layout = is_varlen(c.entry) ? &c.layout : nullptr;
  if (is_select(c.entry))
    dmattn::check_select_topk(c.in, layout, c.options, c.intervals);
  else if (c.entry == Entry::kForward || c.entry == Entry::kVarlenForward)
    dmattn::check_forward(c.in, layout, c.out, c.lse, c.options);
  else
    dmattn::check_backward(c.in, layout, c.out, c.dout, *c.lse, c.grads, c.options);
}

void drop_data(Call& c) {
  for (TensorView* t : {&c.in.q, &c.in.k, &c.in.v, &c.out, &c.dout, &c.grads.dq, &c.grads.dk, &c.grads.dv,
                        &c.layout.cu_seqlens_q, &c.layout.cu_seqlens_k, &c.intervals})
    t->data = nullptr;
  for (auto* t : {&c.in.mask, &c.in.bias, &c.in.topk_intervals, &c.lse, &c.grads.dbias})
    if (*t) (*t)->data = nullptr;
}

class CheckOnly : public Validation {};

TEST_P(CheckOnly, ThrowsWhatTheCallThrowsWithoutData) {
  const BadCase& bad = GetParam();
  const std::set<std::string> data_cases{"null_data",          "cu_seqlens_first",       "cu_seqlens_decreasing",
                                         "cu_seqlens_last",    "max_seqlen_q_too_small", "max_seqlen_k_too_small",
                                         "topk_intervals_null_data", "select_null_intervals",
                                         "out_is_q",           "lse_in_out",             "dq_is_dout",
                                         "dv_is_dk",           "dbias_is_bias",          "varlen_dk_in_k",
                                         "select_intervals_in_bias"};
  const bool data_only = data_cases.count(bad.name) > 0;
  Tensors tensors;
  Call call = valid_call(bad.entry, tensors, rng);
  bad.mutate(call);
  std::string expected;
  try {
    invoke(call);
  } catch (const dmattn::Error& e) {
    expected = e.what();
  }
  drop_data(call);
  if (data_only) {
    EXPECT_NO_THROW(check_only(call));
    return;
  }
  try {
    check_only(call);
    FAIL() << "no error thrown; the call threw " << expected;
  } catch (const dmattn::Error& e) {
    EXPECT_EQ(e.kind(), bad.kind) << e.what();
    EXPECT_EQ(std::string(e.what()), expected);
  }
}

INSTANTIATE_TEST_SUITE_P(All, CheckOnly, ::testing::ValuesIn(bad_cases()),
                         [](const ::testing::TestParamInfo<BadCase>& info) { return std::string(info.param.name); });

class ValidCalls : public SeededFixture {};

bool has_nan(const TensorView& t) {  // t: float32, contiguous
  for (std::int64_t e = 0; e < t.numel(); ++e)
    if (std::isnan(static_cast<const float*>(t.data)[e])) return true;
  return false;
}

// The calls the bad cases start from are valid, so every error above comes
// from its one change; they write every output element.
TEST_F(ValidCalls, BaselinesRun) {
  for (const auto& [forward, backward] :
       {std::pair<Entry, Entry>{Entry::kForward, Entry::kBackward}, {Entry::kVarlenForward, Entry::kVarlenBackward}}) {
    Tensors tensors;
    Call call = valid_call(forward, tensors, rng);
    ASSERT_NO_THROW(invoke(call));
    EXPECT_FALSE(has_nan(call.out)) << "out";
    EXPECT_FALSE(has_nan(*call.lse)) << "lse";
    call.entry = backward;
    ASSERT_NO_THROW(invoke(call));
    for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"dq", &call.grads.dq},
                                  {"dk", &call.grads.dk}, {"dv", &call.grads.dv}, {"dbias", &*call.grads.dbias}})
      EXPECT_FALSE(has_nan(*t)) << name << " has unwritten (NaN) elements after the "
                                << (forward == Entry::kForward ? "batched" : "varlen") << " backward";
  }
}

// Outputs interleaved with inputs, element by element apart (out and q the two
// halves of one buffer's last dim: their byte ranges cross, their elements do
// not), are valid: out is what a buffer of its own gets.
TEST_F(ValidCalls, InterleavedOutputsRun) {
  Tensors tensors;
  Call call = valid_call(Entry::kForward, tensors, rng);
  ASSERT_NO_THROW(invoke(call));
  const TensorView alone = call.out;
  HostTensor& both = tensors.add(DType::kFloat32, {B, Sq, H, 2 * D}, rng, false);
  auto* data = static_cast<float*>(both.view().data);
  for (std::int64_t e = 0; e < call.in.q.numel(); ++e)  // q (contiguous) into the first halves
    data[e / D * 2 * D + e % D] = static_cast<const float*>(call.in.q.data)[e];
  const std::initializer_list<std::int64_t> strides{Sq * H * 2 * D, H * 2 * D, 2 * D, 1};
  call.in.q = TensorView::strided(data, DType::kFloat32, {B, Sq, H, D}, strides);
  call.out = TensorView::strided(data + D, DType::kFloat32, {B, Sq, H, D}, strides);
  ASSERT_NO_THROW(invoke(call));
  for (std::int64_t e = 0; e < alone.numel(); ++e)
    ASSERT_EQ(data[e / D * 2 * D + D + e % D], static_cast<const float*>(alone.data)[e]) << "element " << e;
}

// A valid problem on a CUDA device reaches the backend: a build without CUDA
// refuses it as unsupported after validation, and so does its check alone.
TEST_F(ValidCalls, CudaTensorsWithoutCudaBackend) {
  if (dmattn::build_info().cuda) GTEST_SKIP() << "this build has a CUDA backend; host pointers cannot be used";
  Tensors tensors;
  Call call = valid_call(Entry::kForward, tensors, rng);
  move_to(call, kCuda0);
  for (const auto& run : {std::function<void()>([&] { invoke(call); }), std::function<void()>([&] {
                            drop_data(call);
                            check_only(call);
                          })}) {
    try {
      run();
      FAIL() << "no error thrown";
    } catch (const dmattn::Error& e) {
      EXPECT_EQ(e.kind(), Kind::kUnsupported) << e.what();
      EXPECT_EQ(e.argument(), "q.device") << e.what();
    }
  }
}

// The valid calls pass their checks, without data.
TEST_F(ValidCalls, CheckOnlyPasses) {
  for (Entry entry : {Entry::kForward, Entry::kBackward, Entry::kVarlenForward, Entry::kVarlenBackward, Entry::kSelect,
                      Entry::kVarlenSelect}) {
    Tensors tensors;
    Call call = valid_call(entry, tensors, rng);
    drop_data(call);
    EXPECT_NO_THROW(check_only(call));
  }
}

// select_topk writes every entry of its intervals, and reads no data of q, k
// and v; forward and backward take what it wrote, batched and varlen, whatever
// keep_window_size (one of at least Sk included) and however few query rows.
TEST_F(ValidCalls, SelectedIntervalsAreTaken) {
  for (const auto& [select, forward, backward] :
       {std::tuple<Entry, Entry, Entry>{Entry::kSelect, Entry::kForward, Entry::kBackward},
        {Entry::kVarlenSelect, Entry::kVarlenForward, Entry::kVarlenBackward}})
    for (std::int64_t w : {2, 100}) {
      Tensors tensors;
      Call call = valid_call(select, tensors, rng);
      call.options.keep_window_size = w;
      for (TensorView* t : {&call.in.q, &call.in.k, &call.in.v}) t->data = nullptr;
      ASSERT_NO_THROW(invoke(call));
      for (std::int64_t e = 0; e < call.intervals.numel(); ++e)
        EXPECT_NE(static_cast<const std::int32_t*>(call.intervals.data)[e], -1) << "entry " << e << " unwritten";
      const TensorView intervals = call.intervals;
      call = valid_call(forward, tensors, rng);
      call.options.keep_window_size = w;
      give_intervals(call);
      call.in.topk_intervals = intervals;
      ASSERT_NO_THROW(invoke(call));
      call.entry = backward;
      ASSERT_NO_THROW(invoke(call));
    }
}

}  // namespace
}  // namespace dmattn_test::validation
