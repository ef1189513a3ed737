// Variable-length batches (SPEC 1): packed sequences of odd lengths, empty ones
// included, with a key-only bias (total_k, Hb); each sequence behaves exactly
// as if it were run alone.
#include <cstring>
#include <string>
#include <tuple>

#include "harness.h"

namespace dmattn_test {
namespace {

// Sequence lengths (sq, sk): an empty query sequence, a sequence without keys,
// Sq < Sk, Sq == Sk and Sq > Sk.
const std::vector<std::pair<std::int64_t, std::int64_t>> kLengths{{5, 7}, {0, 3}, {9, 4}, {1, 1},
                                                                   {13, 13}, {4, 0}, {8, 11}};

VarlenCase make_varlen(DType dtype, std::optional<std::int64_t> bias_heads) {
  VarlenCase c;
  c.dtype = dtype;
  c.lengths = kLengths;
  c.bias_heads = bias_heads;
  return c;
}

void check_varlen(const VarlenCase& c, Rng& rng) {
  SCOPED_TRACE(describe(c));
  const VarlenInstance in = make_instance(c, rng);
  Results r;
  try {
    r = run_forward(in);
    run_backward(in, r);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "dmattn threw: " << e.what();
    return;
  }
  expect_matches_reference(in, r);
}

std::vector<dmattn::Options> varlen_options() {
  std::vector<dmattn::Options> all(6);
  all[1].causal = true;
  all[2].causal = true, all[2].keep_window_size = 3;
  all[3].sliding_window = {3, 1}, all[3].keep_window_size = 2;
  all[4].softcap = 2.0, all[4].scale = 1.0, all[4].causal = true;
  all[5].sliding_window = {-1, 0}, all[5].keep_window_size = 1;
  return all;
}

class Varlen : public SeededTest<DType> {};

TEST_P(Varlen, MatchesReference) {
  for (std::optional<std::int64_t> heads : {std::optional<std::int64_t>{}, std::optional<std::int64_t>{1},
                                            std::optional<std::int64_t>{2}, std::optional<std::int64_t>{4}})
    for (const dmattn::Options& o : varlen_options()) {
      if (o.keep_window_size && !heads) continue;
      VarlenCase c = make_varlen(GetParam(), heads);
      c.options = o;
      check_varlen(c, rng);
    }
}

// Grouped heads, tied biases, strided tokens and bias, float32 bias,
// max_seqlen larger than every sequence.
TEST_P(Varlen, LayoutsAndHeads) {
  VarlenCase c = make_varlen(GetParam(), 8);
  c.H = 8, c.Hk = 2;
  c.bias_values = Values::kTiers;
  c.bias_dtype = DType::kFloat32;
  c.qkv_layout = Layout{true, true, {}};
  c.bias_layout = Layout{true, true, {}};
  c.options.causal = true;
  c.options.keep_window_size = 4;
  c.max_seqlen_slack = 5;
  check_varlen(c, rng);
  c.Hk = 1, c.bias_heads = 1;
  c.qkv_layout = Layout{true, false, {}};
  check_varlen(c, rng);
}

// Top-k intervals where one sequence has keys past the CPU backward's first
// key-group windows (kGroupWindow = 512 keys) and the others have fewer keys
// than that: the short sequences' later key groups are empty.
TEST_P(Varlen, TopKShortSequencesBesideALongOne) {
  VarlenCase c = make_varlen(GetParam(), 2);
  c.lengths = {{40, 600}, {20, 9}, {0, 700}, {30, 1}};
  c.options.causal = true;
  c.options.keep_window_size = 30;
  check_varlen(c, rng);
}

INSTANTIATE_TEST_SUITE_P(All, Varlen, ::testing::ValuesIn(all_dtypes()), dtype_param_name);

// Sequence b of a varlen instance as a batched instance with B = 1.
Instance sequence_instance(const VarlenInstance& v, std::int64_t b) {
  const auto q0 = static_cast<std::int64_t>(v.cu_seqlens_q.at(b));
  const auto k0 = static_cast<std::int64_t>(v.cu_seqlens_k.at(b));
  const auto [sq, sk] = v.c.lengths[b];
  const std::int64_t H = v.c.H, Hk = v.c.Hk, D = v.c.D;
  Instance in;
  in.c = make_case(v.c.dtype, sq, sk, D);
  in.c.B = 1, in.c.H = H, in.c.Hk = Hk;
  in.c.options = v.c.options;
  auto copy = [](const HostTensor& from, std::int64_t begin, Shape shape) {
    HostTensor t(from.dtype(), std::move(shape));
    t.fill([&](std::int64_t i) { return from.at(begin + i); });
    return t;
  };
  in.q = copy(v.q, q0 * H * D, {1, sq, H, D});
  in.dout = copy(v.dout, q0 * H * D, {1, sq, H, D});
  in.k = copy(v.k, k0 * Hk * D, {1, sk, Hk, D});
  in.v = copy(v.v, k0 * Hk * D, {1, sk, Hk, D});
  if (v.bias) {
    const std::int64_t Hb = *v.c.bias_heads;
    in.c.bias = BiasSpec{{1, Hb, 1, sk}, {}, v.bias->dtype(), v.c.bias_values};
    in.bias = HostTensor(v.bias->dtype(), {1, Hb, 1, sk});
    in.bias->fill([&](std::int64_t i) { return v.bias->at((k0 + i % sk) * Hb + i / sk); });
  }
  return in;
}

std::vector<double> rows(const HostTensor& t, std::int64_t begin, std::int64_t end, std::int64_t row) {
  const std::vector<double> all = t.values();
  return {all.begin() + begin * row, all.begin() + end * row};
}

// The lse rows of sequence b from a varlen (H, total_q) lse, as (1, H, sq).
std::vector<double> lse_rows(const HostTensor& lse, std::int64_t begin, std::int64_t end) {
  const std::int64_t H = lse.shape()[0], total = lse.shape()[1];
  std::vector<double> out;
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t i = begin; i < end; ++i) out.push_back(lse.at(h * total + i));
  return out;
}

// The bias gradient rows of sequence b from (total_k, Hb), as (1, Hb, 1, sk).
std::vector<double> dbias_rows(const HostTensor& dbias, std::int64_t begin, std::int64_t end) {
  const std::int64_t Hb = dbias.shape()[1];
  std::vector<double> out;
  for (std::int64_t h = 0; h < Hb; ++h)
    for (std::int64_t j = begin; j < end; ++j) out.push_back(dbias.at(j * Hb + h));
  return out;
}

// The outputs of sequence b of a varlen call, in batched (B = 1) layouts.
struct SequenceOutputs {
  std::vector<double> out, lse, dq, dk, dv, dbias;
};

SequenceOutputs sequence_outputs(const VarlenInstance& v, const Results& r, std::int64_t b) {
  const auto q0 = static_cast<std::int64_t>(v.cu_seqlens_q.at(b)), q1 = static_cast<std::int64_t>(v.cu_seqlens_q.at(b + 1));
  const auto k0 = static_cast<std::int64_t>(v.cu_seqlens_k.at(b)), k1 = static_cast<std::int64_t>(v.cu_seqlens_k.at(b + 1));
  const std::int64_t qrow = v.c.H * v.c.D, krow = v.c.Hk * v.c.D;
  SequenceOutputs s{rows(r.out, q0, q1, qrow), lse_rows(*r.lse, q0, q1), rows(r.dq, q0, q1, qrow),
                    rows(r.dk, k0, k1, krow), rows(r.dv, k0, k1, krow), {}};
  if (r.dbias) s.dbias = dbias_rows(*r.dbias, k0, k1);
  return s;
}

class VarlenSequences : public SeededFixture {};

// Each sequence of a varlen call equals the batched API on that sequence alone.
TEST_F(VarlenSequences, EqualsBatchedCallsPerSequence) {
  for (const dmattn::Options& o : varlen_options()) {
    VarlenCase c = make_varlen(DType::kFloat64, 2);
    c.options = o;
    SCOPED_TRACE(describe(c));
    const VarlenInstance v = make_instance(c, rng);
    Results r = run_forward(v);
    run_backward(v, r);
    for (std::size_t b = 0; b < c.lengths.size(); ++b) {
      SCOPED_TRACE("sequence " + std::to_string(b));
      const Instance one = sequence_instance(v, static_cast<std::int64_t>(b));
      Results expected = run_forward(one);
      run_backward(one, expected);
      const SequenceOutputs got = sequence_outputs(v, r, static_cast<std::int64_t>(b));
      auto expect = [&](const char* name, const std::vector<double>& actual, const HostTensor& want) {
        const std::vector<double> w = want.values();
        EXPECT_TRUE(within(name, actual, want.shape(), w, 1e-12 * max_abs_finite(w)));
      };
      expect("out", got.out, expected.out);
      expect("lse", got.lse, *expected.lse);
      expect("dq", got.dq, expected.dq);
      expect("dk", got.dk, expected.dk);
      expect("dv", got.dv, expected.dv);
      expect("dbias", got.dbias, *expected.dbias);
    }
  }
}

// Changing one sequence's keys, values and bias leaves every other sequence's
// outputs and gradients bitwise unchanged.
TEST_F(VarlenSequences, SequencesNeverSeeEachOther) {
  for (DType dtype : {DType::kFloat64, DType::kBFloat16}) {
    VarlenCase c = make_varlen(dtype, 4);
    c.options.causal = true;
    c.options.keep_window_size = 3;
    c.options.deterministic = true;
    SCOPED_TRACE(describe(c));
    const VarlenInstance v = make_instance(c, rng);
    Results before = run_forward(v);
    run_backward(v, before);
    for (std::int64_t changed : {0, 4, 6}) {
      SCOPED_TRACE("changed sequence " + std::to_string(changed));
      VarlenInstance w = v;
      const auto k0 = static_cast<std::int64_t>(w.cu_seqlens_k.at(changed));
      const auto k1 = static_cast<std::int64_t>(w.cu_seqlens_k.at(changed + 1));
      const std::int64_t krow = c.Hk * c.D;
      for (std::int64_t e = k0 * krow; e < k1 * krow; ++e) {
        w.k.set(e, rng.uniform(-2.0, 2.0));
        w.v.set(e, rng.uniform(-2.0, 2.0));
      }
      for (std::int64_t e = k0 * *c.bias_heads; e < k1 * *c.bias_heads; ++e) w.bias->set(e, rng.uniform(-2.0, 2.0));
      Results after = run_forward(w);
      run_backward(w, after);
      for (std::int64_t b = 0; b < static_cast<std::int64_t>(c.lengths.size()); ++b) {
        const SequenceOutputs x = sequence_outputs(v, before, b), y = sequence_outputs(w, after, b);
        std::string differing;
        for (const auto& [name, p, q] : {std::tuple{"out", &x.out, &y.out}, {"lse", &x.lse, &y.lse},
                                         {"dq", &x.dq, &y.dq}, {"dk", &x.dk, &y.dk}, {"dv", &x.dv, &y.dv},
                                         {"dbias", &x.dbias, &y.dbias}})
          if (std::memcmp(p->data(), q->data(), p->size() * sizeof(double)) != 0) differing += std::string(" ") + name;
        if (b == changed)
          EXPECT_NE(differing, "") << "changing sequence " << b << " changed none of its outputs";
        else
          EXPECT_EQ(differing, "") << "sequence " << b << " changed when sequence " << changed << " did";
      }
    }
  }
}

}  // namespace
}  // namespace dmattn_test
