// Built when the CUDA backend is off: CUDA tensors are refused by the API.
#include "backend.h"

namespace dmattn {
const Backend* cuda_backend() { return nullptr; }
}  // namespace dmattn
