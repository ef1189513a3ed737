// The tests' oracle: a naive, materialising float64 implementation of SPEC
// sections 2-4, written independently of the library. It builds the full
// (B, H, Sq, Sk) score and allowed matrices and differentiates them by hand.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "tensor.h"

namespace dmattn_test {

using Shape4 = std::array<std::int64_t, 4>;

struct RefOptions {
  double scale = 1.0;
  double softcap = 0.0;  // 0 = off
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;  // -1 = unbounded
  std::int64_t keep_window_size = 0;                 // 0 = no top-k
};

// The oracle's options of a library call on head dim D.
RefOptions ref_options(const dmattn::Options& o, std::int64_t D);

// All tensors dense, row-major, float64.
struct RefProblem {
  std::int64_t B = 0, Sq = 0, Sk = 0, H = 0, Hk = 0, D = 0;
  std::vector<double> q, k, v;     // (B, Sq, H, D), (B, Sk, Hk, D), (B, Sk, Hk, D)
  Shape4 mask_shape{};             // each dim full or broadcast; heads H, Hk or 1
  std::vector<double> mask;        // empty: no mask; non-zero = may attend
  Shape4 bias_shape{};
  std::vector<double> bias;        // empty: no bias
  RefOptions options;
};

// How the oracle rounds: nothing (the float64 reference) or a naive computation
// in a low-precision dtype.
struct Rounding {
  std::optional<DType> intermediate;  // scores, logits, probabilities, dp, dS, lse
  std::optional<DType> out;           // o (before the backward reads it) and dq, dk, dv
  std::optional<DType> lse;           // stored lse (the backward reads it)
  std::optional<DType> dbias;
};

struct RefResult {
  std::vector<double> out, lse;      // (B, Sq, H, D), (B, H, Sq); lse = -inf for a row with no allowed key
  std::vector<double> dq, dk, dv;    // like q, k, v (empty without dout)
  std::vector<double> dbias;         // the bias's own shape: dl summed over its broadcast dims
  std::vector<double> dbias_abs;     // the same sums of |dl|: the magnitude dbias cancels from
  std::vector<char> allowed;         // (B, H, Sq, Sk): mask, causal, window and top-k (batched only)
};

// Without dout: forward only.
RefResult reference(const RefProblem& p, const std::optional<std::vector<double>>& dout,
                    const Rounding& rounding = {});

// Varlen: sequence b holds query tokens [cu_q[b], cu_q[b+1]) and key tokens
// [cu_k[b], cu_k[b+1]); the bias is key-only, (total_k, Hb).
struct RefVarlenProblem {
  std::vector<std::int64_t> cu_q, cu_k;
  std::int64_t H = 0, Hk = 0, D = 0, Hb = 0;
  std::vector<double> q, k, v;  // (total_q, H, D), (total_k, Hk, D), (total_k, Hk, D)
  std::vector<double> bias;     // (total_k, Hb); empty: no bias
  RefOptions options;
};

// Runs reference() on each sequence alone; lse is (H, total_q), dbias (total_k, Hb).
RefResult reference_varlen(const RefVarlenProblem& p, const std::optional<std::vector<double>>& dout,
                           const Rounding& rounding = {});

}  // namespace dmattn_test
