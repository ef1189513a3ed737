#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>
#include <stdexcept>

namespace dmattn_test {
namespace {

// A binary floating-point format with `precision` significand bits (the
// implicit one included) and normal exponents down to `min_exponent`.
struct Format {
  int precision;
  int min_exponent;
  double max_finite;
};

constexpr Format kBFloat16{8, -126, 3.38953138925153547590470800371487866880e38};
constexpr Format kFloat16{11, -14, 65504.0};

double round_to_format(const Format& f, double x) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  // Quantum of the binade of x; below the normal range the subnormal quantum.
  const int exponent = std::max(std::ilogb(x), f.min_exponent);
  const double quantum = std::ldexp(1.0, exponent - (f.precision - 1));
  const double r = std::nearbyint(x / quantum) * quantum;  // default mode: ties to even
  if (std::fabs(r) > f.max_finite) return std::copysign(std::numeric_limits<double>::infinity(), x);
  return r;
}

std::uint16_t encode_bfloat16(double x) {
  const float f = static_cast<float>(round_to_format(kBFloat16, x));  // exact: bf16 values are floats
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return std::isnan(f) ? std::uint16_t{0x7FC0} : static_cast<std::uint16_t>(bits >> 16);
}

double decode_bfloat16(std::uint16_t h) {
  const std::uint32_t bits = std::uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

std::uint16_t encode_float16(double x) {
  if (std::isnan(x)) return 0x7E00;
  const double r = round_to_format(kFloat16, x);
  const std::uint16_t sign = std::signbit(r) ? 0x8000 : 0;
  const double a = std::fabs(r);
  if (std::isinf(a)) return sign | 0x7C00;
  if (a == 0.0) return sign;
  const int e = std::ilogb(a);
  if (e < kFloat16.min_exponent)  // subnormal: multiples of 2^-24
    return sign | static_cast<std::uint16_t>(std::ldexp(a, 24));
  const auto mantissa = static_cast<std::uint16_t>((std::ldexp(a, -e) - 1.0) * 1024.0);
  return sign | static_cast<std::uint16_t>((e + 15) << 10) | mantissa;
}

double decode_float16(std::uint16_t h) {
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  const int e = (h >> 10) & 0x1F;
  const int m = h & 0x3FF;
  if (e == 0x1F) return m ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024 + m, e - 25);
}

void store(DType dtype, unsigned char* p, double x) {
  switch (dtype) {
    case DType::kFloat64: std::memcpy(p, &x, 8); return;
    case DType::kFloat32: {
      const float f = static_cast<float>(x);
      std::memcpy(p, &f, 4);
      return;
    }
    case DType::kBFloat16: {
      const std::uint16_t h = encode_bfloat16(x);
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::kFloat16: {
      const std::uint16_t h = encode_float16(x);
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::kBool: *p = x != 0.0 ? 1 : 0; return;
    case DType::kInt32: {
      const auto i = static_cast<std::int32_t>(x);
      std::memcpy(p, &i, 4);
      return;
    }
  }
}

double load(DType dtype, const unsigned char* p) {
  switch (dtype) {
    case DType::kFloat64: {
      double x;
      std::memcpy(&x, p, 8);
      return x;
    }
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBFloat16:
    case DType::kFloat16: {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      return dtype == DType::kBFloat16 ? decode_bfloat16(h) : decode_float16(h);
    }
    case DType::kBool: return *p ? 1.0 : 0.0;
    case DType::kInt32: {
      std::int32_t i;
      std::memcpy(&i, p, 4);
      return i;
    }
  }
  return 0.0;
}

constexpr unsigned char kPoisonByte = 0xFF;  // all-ones: NaN in every float dtype

}  // namespace

double round_to(DType dtype, double x) {
  unsigned char bytes[8];
  store(dtype, bytes, x);
  return load(dtype, bytes);
}

double lowest(DType dtype) { return -max_finite(dtype); }

double max_finite(DType dtype) {
  switch (dtype) {
    case DType::kFloat64: return std::numeric_limits<double>::max();
    case DType::kFloat32: return std::numeric_limits<float>::max();
    case DType::kBFloat16: return kBFloat16.max_finite;
    case DType::kFloat16: return kFloat16.max_finite;
    default: throw std::logic_error("max_finite of a non-float dtype");
  }
}

bool is_low_precision(DType dtype) { return dtype == DType::kBFloat16 || dtype == DType::kFloat16; }

std::int64_t numel(const Shape& shape) {
  return std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
}

std::string shape_str(const Shape& shape) {
  std::ostringstream s;
  s << "(";
  for (std::size_t d = 0; d < shape.size(); ++d) s << (d ? "," : "") << shape[d];
  s << ")";
  return s.str();
}

Rng::Rng() {
  if (const char* env = std::getenv("DMATTN_TEST_SEED")) {
    seed_ = std::strtoull(env, nullptr, 10);
  } else {
    std::random_device device;
    seed_ = (std::uint64_t{device()} << 32) ^ device();
  }
  engine_.seed(seed_);
}

std::string Rng::trace() const {
  return "seed " + std::to_string(seed_) + " (replay with DMATTN_TEST_SEED=" + std::to_string(seed_) + ")";
}

double Rng::uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(engine_); }

bool Rng::bernoulli(double p) { return std::bernoulli_distribution(p)(engine_); }

std::int64_t Rng::integer(std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(engine_);
}

std::string layout_str(const Layout& layout) {
  std::string s = layout.sliced ? "sliced" : "dense";
  if (layout.permuted) s += "+permuted";
  for (std::size_t d = 0; d < layout.expanded.size(); ++d)
    if (layout.expanded[d]) s += "+expanded" + std::to_string(d);
  return s;
}

HostTensor::HostTensor(DType dtype, Shape shape, Layout layout, bool last_dim_contiguous)
    : dtype_(dtype), shape_(std::move(shape)), stride_(shape_.size()) {
  const int rank = static_cast<int>(shape_.size());
  const std::int64_t pad = layout.sliced ? 1 : 0;
  // Storage order, outermost first.
  std::vector<int> order(rank);
  std::iota(order.begin(), order.end(), 0);
  if (layout.permuted) std::reverse(order.begin(), order.end() - (last_dim_contiguous ? 1 : 0));
  std::int64_t stride = 1;
  for (int o = rank - 1; o >= 0; --o) {
    const int d = order[o];
    const bool expanded = d < 4 && layout.expanded[d];
    stride_[d] = expanded ? 0 : stride;
    offset_ += pad * stride;
    stride *= (expanded ? 1 : std::max<std::int64_t>(shape_[d], 1)) + pad;  // like torch: no 0 strides
  }
  buffer_.assign(static_cast<std::size_t>((stride + pad) * dmattn::dtype_size(dtype_)), 0);
}

dmattn::TensorView HostTensor::view() const {
  dmattn::TensorView t;
  t.data = buffer_.data() + offset_ * dmattn::dtype_size(dtype_);
  t.dtype = dtype_;
  t.ndim = static_cast<int>(shape_.size());
  for (int d = 0; d < t.ndim; ++d) t.shape[d] = shape_[d], t.stride[d] = stride_[d];
  return t;
}

std::int64_t HostTensor::offset_of(std::int64_t index) const {
  std::int64_t offset = offset_;
  for (int d = static_cast<int>(shape_.size()) - 1; d >= 0; --d) {
    offset += (index % shape_[d]) * stride_[d];
    index /= shape_[d];
  }
  return offset;
}

double HostTensor::at(std::int64_t index) const {
  return load(dtype_, buffer_.data() + offset_of(index) * dmattn::dtype_size(dtype_));
}

void HostTensor::set(std::int64_t index, double x) {
  store(dtype_, buffer_.data() + offset_of(index) * dmattn::dtype_size(dtype_), x);
}

std::vector<double> HostTensor::values() const {
  std::vector<double> v(static_cast<std::size_t>(numel()));
  for (std::int64_t i = 0; i < numel(); ++i) v[i] = at(i);
  return v;
}

void HostTensor::fill(const std::function<double(std::int64_t)>& draw) {
  for (std::int64_t i = 0; i < numel(); ++i) set(i, draw(i));
}

void HostTensor::poison() { std::fill(buffer_.begin(), buffer_.end(), kPoisonByte); }

bool HostTensor::padding_untouched() const {
  const std::size_t size = dmattn::dtype_size(dtype_);
  std::vector<bool> in_view(buffer_.size() / size, false);
  for (std::int64_t i = 0; i < numel(); ++i) in_view[offset_of(i)] = true;
  for (std::size_t e = 0; e < in_view.size(); ++e)
    for (std::size_t b = 0; !in_view[e] && b < size; ++b)
      if (buffer_[e * size + b] != kPoisonByte) return false;
  return true;
}

}  // namespace dmattn_test
