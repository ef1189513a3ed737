// The CPU backend: top-k selection once per call, then forward or backward in
// float64 for float64 inputs and float32 for every other dtype.
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

}  // namespace

const Backend& cpu_backend() {
  static const Backend backend{run_forward, run_backward};
  return backend;
}

}  // namespace dmattn
