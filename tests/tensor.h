// Host tensors for the tests: storage in any dtype the API takes, exposed as
// dmattn::TensorView with contiguous, sliced, permuted or broadcast (stride 0)
// strides. Written for the tests only; no library internals are used.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "dmattn/dmattn.h"

namespace dmattn_test {

using dmattn::DType;
using Shape = std::vector<std::int64_t>;

// The value of `dtype` nearest to x, ties to even (float16/bfloat16 emulated
// from float64 in one rounding; bool: x != 0; int32: truncation).
double round_to(DType dtype, double x);
// Most negative / largest finite value of a float dtype.
double lowest(DType dtype);
double max_finite(DType dtype);
bool is_low_precision(DType dtype);
std::int64_t numel(const Shape& shape);
std::string shape_str(const Shape& shape);

// Fresh randomness per run; DMATTN_TEST_SEED=<n> replays a run.
class Rng {
 public:
  Rng();
  // For SCOPED_TRACE: the seed and how to replay it.
  std::string trace() const;
  double uniform(double lo, double hi);
  bool bernoulli(double p);
  std::int64_t integer(std::int64_t lo, std::int64_t hi);  // inclusive bounds
  std::mt19937_64& engine() { return engine_; }

 private:
  std::uint64_t seed_;
  std::mt19937_64 engine_;
};

// How a tensor's elements are laid out in its buffer. The last dimension stays
// contiguous unless `permuted` is set on a tensor created with
// last_dim_contiguous = false (mask, bias).
struct Layout {
  bool sliced = false;    // cut out of a bigger buffer: every dim padded, a non-zero offset
  bool permuted = false;  // dims stored in reverse order (non-contiguous token/head strides)
  std::array<bool, 4> expanded{};  // dims stored once and repeated through stride 0
};
std::string layout_str(const Layout& layout);

class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, Shape shape, Layout layout = {}, bool last_dim_contiguous = true);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  std::int64_t numel() const { return dmattn_test::numel(shape_); }
  dmattn::TensorView view() const;

  // Element at a row-major logical index; set() rounds to the dtype (elements of
  // expanded dims share storage).
  double at(std::int64_t index) const;
  void set(std::int64_t index, double x);
  // All logical elements, row-major.
  std::vector<double> values() const;
  // Sets every logical element to draw(index).
  void fill(const std::function<double(std::int64_t)>& draw);
  // Every byte of the buffer, padding included, set to a NaN pattern.
  void poison();
  std::vector<unsigned char> bytes() const { return buffer_; }
  // True when no element outside the view was written since poison().
  bool padding_untouched() const;

 private:
  std::int64_t offset_of(std::int64_t index) const;

  DType dtype_ = DType::kFloat32;
  Shape shape_;
  std::vector<std::int64_t> stride_;
  std::int64_t offset_ = 0;
  mutable std::vector<unsigned char> buffer_;
};

}  // namespace dmattn_test
