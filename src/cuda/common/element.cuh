// Bias and dbias elements, float32 or the inputs' Element, as float; pairs of
// output elements.
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

// Whether a strided output's runs of `run` elements (run e .. run e + run - 1)
// along its contiguous last dim are (2 run)-byte aligned wherever they start:
// an aligned base and strides of whole runs.
__host__ __device__ inline bool runs_aligned(const void* data, std::int64_t sb, std::int64_t sh, std::int64_t sr,
                                             int run) {
  return reinterpret_cast<std::uintptr_t>(data) % (2 * run) == 0 && sb % run == 0 && sh % run == 0 && sr % run == 0;
}
__host__ __device__ inline bool pairs_aligned(const void* data, std::int64_t sb, std::int64_t sh, std::int64_t sr) {
  return runs_aligned(data, sb, sh, sr, 2);
}

// x and y into dst[0] and dst[1] (rounded once each): one 32-bit store where
// `aligned` (pairs_aligned, dst at an even element), else two.
template <class Element>
__device__ inline void store_pair(Element* dst, float x, float y, bool aligned) {
  static_assert(sizeof(Element) == 2, "pairs of 16-bit elements");
  if (aligned) {
    struct alignas(4) Pair { Element a, b; };
    *reinterpret_cast<Pair*>(dst) = Pair{static_cast<Element>(x), static_cast<Element>(y)};
  } else {
    dst[0] = static_cast<Element>(x), dst[1] = static_cast<Element>(y);
  }
}

}  // namespace dmattn::cuda
