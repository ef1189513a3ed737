// Bias and dbias elements, float32 or the inputs' Element, as float; pairs of
// output elements; elements of a dtype known only at run time (the passes
// compiled once for both input dtypes).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <type_traits>

#include "dmattn/dmattn.h"

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

// Element `at` of a float16, bfloat16 or float32 array as float, and x into it
// (rounded once to nearest even), the dtype read at run time.
__device__ inline float load_as_float(const void* data, DType dtype, std::int64_t at) {
  switch (dtype) {
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(data)[at]);
    case DType::kBFloat16:
      return __uint_as_float(std::uint32_t{static_cast<const std::uint16_t*>(data)[at]} << 16);
    default:
      return static_cast<const float*>(data)[at];
  }
}
__device__ inline void store_rounded(void* data, DType dtype, std::int64_t at, float x) {
  switch (dtype) {
    case DType::kFloat16:
      static_cast<__half*>(data)[at] = __float2half_rn(x);
      break;
    case DType::kBFloat16:
      static_cast<__nv_bfloat16*>(data)[at] = __float2bfloat16_rn(x);
      break;
    default:
      static_cast<float*>(data)[at] = x;
  }
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

// Output pair (x, y) rounded into one word, x in its low half, and a word
// stored: asm volatile, so that an epilogue's words, rounded before its
// first store, stay so (the compiler keeps such statements in program order).
// Rounded next to its store, a pair took the registers of the pair before
// and waited for that store to read them (ncu, the Hopper forward:
// long-scoreboard stalls on the epilogue's multiplies, 5% of a B = 16,
// S = 2048 forward's samples).
template <class Element>
__device__ __forceinline__ std::uint32_t rounded_word(float x, float y) {
  static_assert(std::is_same_v<Element, cutlass::bfloat16_t> || std::is_same_v<Element, cutlass::half_t>);
  std::uint32_t w;
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>)
    asm volatile("cvt.rn.bf16x2.f32 %0, %2, %1;\n" : "=r"(w) : "f"(x), "f"(y));
  else
    asm volatile("cvt.rn.f16x2.f32 %0, %2, %1;\n" : "=r"(w) : "f"(x), "f"(y));
  return w;
}
__device__ __forceinline__ void store_word(void* at, std::uint32_t w) {
  asm volatile("st.global.b32 [%0], %1;\n" ::"l"(at), "r"(w) : "memory");
}

}  // namespace dmattn::cuda
