// The calls of the validation tests (test_validation.cpp): a valid call of
// each entry point on small host tensors, and the bad cases made from it by
// one change each, with the error each must throw (SPEC 6).
#pragma once

#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "harness.h"

namespace dmattn_test::validation {

using dmattn::Device;
using dmattn::DeviceType;
using dmattn::TensorView;
using Kind = dmattn::Error::Kind;

constexpr std::int64_t B = 2, Sq = 5, Sk = 6, H = 4, Hk = 2, D = 8;
// Varlen: sequences (2, 3), (0, 1), (3, 2).
const std::vector<std::int32_t> kCuQ{0, 2, 2, 5}, kCuK{0, 3, 4, 6};
constexpr std::int64_t kTotalQ = 5, kTotalK = 6;

enum class Entry { kForward, kBackward, kVarlenForward, kVarlenBackward, kSelect, kVarlenSelect };

inline bool is_varlen(Entry e) { return e == Entry::kVarlenForward || e == Entry::kVarlenBackward || e == Entry::kVarlenSelect; }
inline bool is_select(Entry e) { return e == Entry::kSelect || e == Entry::kVarlenSelect; }

// Every tensor a valid call uses; outputs poisoned.
struct Tensors {
  std::deque<HostTensor> all;  // stable addresses
  HostTensor& add(DType dtype, Shape shape, Rng& rng, bool poison) {
    HostTensor& t = all.emplace_back(dtype, std::move(shape));
    if (poison)
      t.poison();
    else if (dtype == DType::kBool)
      t.fill([](std::int64_t i) { return i % 3 != 0; });
    else
      fill_values(t, Values::kUniform, rng);
    return t;
  }
};

// The arguments of one call of one entry point.
struct Call {
  Entry entry = Entry::kForward;
  dmattn::Inputs in;
  dmattn::VarlenLayout layout;
  TensorView out, dout;
  std::optional<TensorView> lse;
  dmattn::Gradients grads;
  TensorView intervals;  // select_topk's output
  dmattn::Options options;
  Tensors* tensors = nullptr;
  Rng* rng = nullptr;

  // A fresh tensor (kept alive with the others), e.g. to replace an input by one of another dtype.
  TensorView make(DType dtype, Shape shape) {
    if (dtype == DType::kInt32) {
      HostTensor& t = tensors->all.emplace_back(dtype, std::move(shape));
      t.fill([](std::int64_t i) { return static_cast<double>(i); });
      return t.view();
    }
    return tensors->add(dtype, std::move(shape), *rng, false).view();
  }
  TensorView& cu_q() { return layout.cu_seqlens_q; }
};

Call valid_call(Entry entry, Tensors& t, Rng& rng);

// Makes a forward or backward call one whose top-k intervals express (key-only
// mask and bias) and gives it intervals: int32 (B, Hs = Hk, Sk, 2), varlen (3
// sequences, Hk, max_seqlen_k = 3, 2).
void give_intervals(Call& c);

struct BadCase {
  const char* name;
  Entry entry;
  std::function<void(Call&)> mutate;
  Kind kind;
  std::string argument;
  std::string message;  // a substring of what(), after "dmattn: <argument>: "
};

// Puts every tensor of the call on `device`, with bfloat16 q, k, v, out, dout
// and gradients (the dtypes CUDA takes).
void move_to(Call& c, Device device, std::int64_t head_dim = D);
constexpr Device kCuda0{DeviceType::kCUDA, 0};
constexpr Device kCuda1{DeviceType::kCUDA, 1};

// Every bad case: one change of a valid call.
std::vector<BadCase> bad_cases();

}  // namespace dmattn_test::validation
