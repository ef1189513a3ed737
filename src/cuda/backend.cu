// CUDA backend. The kernels arrive with the CUDA forward and backward issues;
// until then a CUDA problem is refused with a clear error after validation.
#include <string>

#include "../backend.h"

namespace dmattn {
namespace {
[[noreturn]] void not_built(const Problem& p) {
  throw Error(Error::Kind::kUnsupported, "q.device", "cpu (the CUDA kernels are not built yet)",
              "cuda:" + std::to_string(p.device.index));
}
}  // namespace

const Backend* cuda_backend() {
  static const Backend backend{not_built, not_built};
  return &backend;
}
}  // namespace dmattn
