// Public entry points: validate (src/validate.cpp), then run the device's backend.
#include <sstream>

#include "backend.h"
#include "dmattn/dmattn.h"
#include "validate.h"

namespace dmattn {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kBool: return "bool";
    case DType::kInt32: return "int32";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat64: return 8;
    case DType::kBool: return 1;
  }
  return 0;
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                  Device device) {
  TensorView t;
  t.data = data, t.dtype = dtype, t.device = device;
  t.ndim = static_cast<int>(shape.size());
  if (t.ndim > kMaxRank)
    throw Error(Error::Kind::kValue, "shape", "at most 4 dimensions", std::to_string(t.ndim));
  int d = 0;
  for (std::int64_t s : shape) t.shape[d++] = s;
  std::int64_t stride = 1;
  for (d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               std::initializer_list<std::int64_t> stride, Device device) {
  if (shape.size() != stride.size())
    throw Error(Error::Kind::kValue, "stride", std::to_string(shape.size()) + " strides (one per dimension)",
                std::to_string(stride.size()));
  TensorView t = contiguous(data, dtype, shape, device);
  int d = 0;
  for (std::int64_t s : stride) t.stride[d++] = s;
  return t;
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

namespace {
std::string error_message(const std::string& argument, const std::string& expected, const std::string& actual) {
  std::ostringstream s;
  s << "dmattn: " << argument << ": expected " << expected << ", got " << actual;
  return s.str();
}
}  // namespace

Error::Error(Kind kind, std::string argument, const std::string& expected, const std::string& actual)
    : std::invalid_argument(error_message(argument, expected, actual)), kind_(kind), argument_(std::move(argument)) {}

namespace {
const Backend& backend_for(const Problem& p) {
  if (p.device.type == DeviceType::kCPU) return cpu_backend();
  const Backend* cuda = cuda_backend();
  if (cuda == nullptr)
    throw Error(Error::Kind::kUnsupported, "q.device", "cpu (this build of dmattn has no CUDA backend)",
                "cuda:" + std::to_string(p.device.index));
  return *cuda;
}

// A bias whose key dimension is 1 (constant along keys, or every sequence of at
// most one key) cannot change the softmax: its gradient is exactly zero (SPEC
// 4), written here rather than summed from rounding noise by the backend, once
// the backend has accepted the call (it may refuse it before running anything).
void run_backward(Problem p, const std::optional<TensorView>& dbias) {
  const Backend& backend = backend_for(p);
  const bool zero_dbias = p.dbias.present() && p.bias_shape.cols == 1;
  if (zero_dbias) p.dbias = Operand{};
  backend.backward(p);
  if (zero_dbias) backend.fill_zeros(*dbias, p.stream);
}
}  // namespace

void forward(const Inputs& in, const TensorView& out, const std::optional<TensorView>& lse, const Options& options) {
  const Problem p = make_forward_problem(in, nullptr, out, lse, options);
  backend_for(p).forward(p);
}

void backward(const Inputs& in, const TensorView& out, const TensorView& dout, const TensorView& lse,
              const Gradients& grads, const Options& options) {
  run_backward(make_backward_problem(in, nullptr, out, dout, lse, grads, options), grads.dbias);
}

void varlen_forward(const Inputs& in, const VarlenLayout& layout, const TensorView& out,
                    const std::optional<TensorView>& lse, const Options& options) {
  const Problem p = make_forward_problem(in, &layout, out, lse, options);
  backend_for(p).forward(p);
}

void varlen_backward(const Inputs& in, const VarlenLayout& layout, const TensorView& out, const TensorView& dout,
                     const TensorView& lse, const Gradients& grads, const Options& options) {
  run_backward(make_backward_problem(in, &layout, out, dout, lse, grads, options), grads.dbias);
}

void select_topk(const Inputs& in, const Options& options, const TensorView& intervals) {
  const Problem p = make_select_problem(in, nullptr, intervals, options);
  backend_for(p).select(p);
}

void varlen_select_topk(const Inputs& in, const VarlenLayout& layout, const Options& options,
                        const TensorView& intervals) {
  const Problem p = make_select_problem(in, &layout, intervals, options);
  backend_for(p).select(p);
}

void check_forward(const Inputs& in, const VarlenLayout* layout, const TensorView& out,
                   const std::optional<TensorView>& lse, const Options& options) {
  backend_for(make_forward_problem(in, layout, out, lse, options, Reads::kMetadata));
}

void check_backward(const Inputs& in, const VarlenLayout* layout, const TensorView& out, const TensorView& dout,
                    const TensorView& lse, const Gradients& grads, const Options& options) {
  backend_for(make_backward_problem(in, layout, out, dout, lse, grads, options, Reads::kMetadata));
}

void check_select_topk(const Inputs& in, const VarlenLayout* layout, const Options& options,
                       const TensorView& intervals) {
  backend_for(make_select_problem(in, layout, intervals, options, Reads::kMetadata));
}

BuildInfo build_info() {
  BuildInfo info;
  info.cuda = cuda_backend() != nullptr;
  info.version = DMATTN_VERSION;
  info.cuda_architectures = DMATTN_CUDA_ARCHITECTURES;
  info.head_dims = DMATTN_HEAD_DIMS;
  return info;
}

}  // namespace dmattn
