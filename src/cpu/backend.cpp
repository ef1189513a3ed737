// The CPU backend: top-k selection once per call (or the caller's), then forward
// or backward in float64 for float64 inputs and float32 for every other dtype;
// and the top-k intervals alone (select_topk).
#include <cstring>

#include "../backend.h"
#include "kernels.h"
#include "selection.h"

namespace dmattn {
namespace {

void run_forward(const Problem& p) {
  const cpu::Selection sel = cpu::select_topk(p);
  if (p.q.dtype == DType::kFloat64) {
    cpu::forward<double>(p, sel);
  } else {
    cpu::forward<float>(p, sel);
  }
}

void run_backward(const Problem& p) {
  const cpu::Selection sel = cpu::select_topk(p);
  if (p.q.dtype == DType::kFloat64) {
    cpu::backward<double>(p, sel);
  } else {
    cpu::backward<float>(p, sel);
  }
}

void run_select(const Problem& p) { cpu::write_intervals(p, p.topk_intervals); }

// Zero bits are +0 in every float dtype.
void fill_zeros(const TensorView& t, void*) {
  if (t.numel() == 0) return;
  const std::size_t size = dtype_size(t.dtype);
  std::int64_t index[kMaxRank] = {};
  for (std::int64_t e = 0; e < t.numel(); ++e) {
    std::int64_t offset = 0;
    for (int d = 0; d < t.ndim; ++d) offset += index[d] * t.stride[d];
    std::memset(static_cast<char*>(t.data) + offset * static_cast<std::int64_t>(size), 0, size);
    for (int d = t.ndim - 1; d >= 0 && ++index[d] == t.shape[d]; --d) index[d] = 0;
  }
}

}  // namespace

const Backend& cpu_backend() {
  static const Backend backend{run_forward, run_backward, run_select, fill_zeros};
  return backend;
}

}  // namespace dmattn
