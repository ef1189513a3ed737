// Bias and dbias elements, float32 or the inputs' Element, as float.
#pragma once

#include <cstdint>

namespace dmattn::cuda {

// Element `at` of a bias or gradient in float32 or Element, as float.
template <class Element>
__device__ inline float load_float(const void* data, bool is_float32, std::int64_t at) {
  return is_float32 ? static_cast<const float*>(data)[at] : static_cast<float>(static_cast<const Element*>(data)[at]);
}

// x into element `at` of a float32 or Element array (rounded once).
template <class Element>
__device__ inline void store_float(void* data, bool is_float32, std::int64_t at, float x) {
  if (is_float32)
    static_cast<float*>(data)[at] = x;
  else
    static_cast<Element*>(data)[at] = static_cast<Element>(x);
}

}  // namespace dmattn::cuda
