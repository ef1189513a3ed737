// The GPU side of the CUDA tests and benchmarks: device copies of the host
// tensors of tests/tensor.h (whole buffers, padding included, so that a write
// outside a view shows), and what this machine and build can run.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "dmattn/dmattn.h"
#include "tensor.h"

namespace dmattn_gpu_test {

using dmattn::DType;
using dmattn_test::HostTensor;
using dmattn_test::Layout;
using dmattn_test::Rng;
using dmattn_test::Shape;

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// Byte offset of a host tensor's view in its buffer: element 0 has the lowest
// offset, so it is the first byte that a poisoned copy shows written.
inline std::size_t view_offset(const HostTensor& t) {
  if (t.numel() == 0) return 0;
  HostTensor c = t;
  c.poison();
  c.set(0, 0.0);
  const std::vector<unsigned char> b = c.bytes();
  return static_cast<std::size_t>(std::find_if(b.begin(), b.end(), [](unsigned char x) { return x != 0xFF; }) -
                                  b.begin());
}

// A device copy of a host tensor's whole buffer (padding included), viewed alike.
class DeviceTensor {
 public:
  explicit DeviceTensor(const HostTensor& t) : host_(t), offset_(view_offset(t)) {
    const std::vector<unsigned char> bytes = t.bytes();
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, std::max<std::size_t>(bytes.size(), 16)), "cudaMalloc");
    data_.reset(p);
    check_cuda(cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), "cudaMemcpy to device");
    size_ = bytes.size();
  }
  dmattn::TensorView view() const {
    dmattn::TensorView v = host_.view();
    v.data = static_cast<unsigned char*>(data_.get()) + offset_;
    v.device = {dmattn::DeviceType::kCUDA, 0};
    return v;
  }
  // Logical elements (row-major), and whether bytes outside the view kept the poison.
  std::vector<double> values(bool* padding_untouched) const {
    std::vector<unsigned char> bytes(size_);
    check_cuda(cudaMemcpy(bytes.data(), data_.get(), size_, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
    const dmattn::TensorView v = host_.view();
    const std::size_t es = dmattn::dtype_size(v.dtype);
    std::vector<bool> in_view(size_ / es, false);
    std::vector<double> out(static_cast<std::size_t>(host_.numel()));
    for (std::int64_t i = 0; i < host_.numel(); ++i) {
      std::int64_t rest = i, at = 0;
      for (int d = v.ndim - 1; d >= 0; --d) at += (rest % v.shape[d]) * v.stride[d], rest /= v.shape[d];
      const std::size_t byte = offset_ + static_cast<std::size_t>(at) * es;
      in_view[byte / es] = true;
      out[i] = decode(v.dtype, bytes.data() + byte);
    }
    *padding_untouched = true;
    for (std::size_t e = 0; e < in_view.size(); ++e)
      for (std::size_t b = 0; !in_view[e] && b < es; ++b)
        if (bytes[e * es + b] != 0xFF) *padding_untouched = false;
    return out;
  }

 private:
  static double decode(DType dtype, const unsigned char* p) {
    if (dtype == DType::kInt32) {
      std::int32_t i;
      std::memcpy(&i, p, 4);
      return i;
    }
    if (dtype == DType::kFloat32) {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    std::uint16_t h;
    std::memcpy(&h, p, 2);
    if (dtype == DType::kBFloat16) {
      const std::uint32_t bits = std::uint32_t{h} << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    const double sign = (h & 0x8000) ? -1.0 : 1.0;  // float16
    const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0x1F) return m ? std::nan("") : sign * std::numeric_limits<double>::infinity();
    return e == 0 ? sign * std::ldexp(m, -24) : sign * std::ldexp(1024 + m, e - 25);
  }
  struct Free {
    void operator()(void* p) const { cudaFree(p); }
  };
  HostTensor host_;
  std::size_t offset_ = 0;
  std::size_t size_ = 0;
  std::unique_ptr<void, Free> data_;
};

// Whether a CUDA device is visible (the CUDA tests skip without one).
inline bool gpu_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// Whether the build has an instantiation for head dim d (a compiled head dim
// >= d; above 128 the backward's head dims are 192 and 256, and so are the
// cases').
inline bool head_dim_compiled(std::int64_t d) {
  const std::string dims = dmattn::build_info().head_dims;  // "128,192,256"
  for (std::size_t at = 0; at < dims.size();) {
    const std::size_t end = std::min(dims.find(',', at), dims.size());
    if (std::stoll(dims.substr(at, end - at)) >= d) return true;
    at = end + 1;
  }
  return false;
}

}  // namespace dmattn_gpu_test
