// Storage <-> accumulation conversions of the CPU backend. Every strided read
// or write of a tensor row goes through read()/write(): the dtype switch runs
// once per row, the loop inside is plain and typed.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "dmattn/dmattn.h"

namespace dmattn::cpu {

inline float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline std::uint32_t float_to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bf16_to_float(std::uint16_t h) { return bits_to_float(std::uint32_t{h} << 16); }

inline std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = float_to_bits(f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // stay a NaN
  const std::uint32_t round = 0x7fff + ((u >> 16) & 1);                   // to nearest, ties to even
  return static_cast<std::uint16_t>((u + round) >> 16);
}

inline float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  const std::uint32_t exp = (h >> 10) & 0x1f;
  const std::uint32_t man = h & 0x3ff;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
  const float sub = std::ldexp(static_cast<float>(man), -24);  // subnormal or zero
  return sign ? -sub : sub;
}

inline std::uint16_t float_to_fp16(float f) {
  const std::uint32_t u = float_to_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00;
  if (a >= 65520.0f) return sign | 0x7c00;  // rounds past the largest half: infinity
  if (a < 6.103515625e-05f) {               // subnormal half: multiples of 2^-24, ties to even
    return sign | static_cast<std::uint16_t>(std::nearbyint(std::ldexp(a, 24)));
  }
  const std::uint32_t au = float_to_bits(a);
  const std::uint32_t round = 0xfff + ((au >> 13) & 1);
  return sign | static_cast<std::uint16_t>(((au + round) >> 13) - (112u << 10));
}

// dst[c] = element (base + offset(c)) of `data`, converted to A, for c < n.
// Bool elements read as 0 / 1.
template <class A, class Offset>
void read(const void* data, DType dtype, std::int64_t base, std::int64_t n, Offset offset, A* dst) {
  switch (dtype) {
    case DType::kFloat16: {
      const auto* p = static_cast<const std::uint16_t*>(data) + base;
      for (std::int64_t c = 0; c < n; ++c) dst[c] = static_cast<A>(fp16_to_float(p[offset(c)]));
      break;
    }
    case DType::kBFloat16: {
      const auto* p = static_cast<const std::uint16_t*>(data) + base;
      for (std::int64_t c = 0; c < n; ++c) dst[c] = static_cast<A>(bf16_to_float(p[offset(c)]));
      break;
    }
    case DType::kFloat32: {
      const auto* p = static_cast<const float*>(data) + base;
      for (std::int64_t c = 0; c < n; ++c) dst[c] = static_cast<A>(p[offset(c)]);
      break;
    }
    case DType::kFloat64: {
      const auto* p = static_cast<const double*>(data) + base;
      for (std::int64_t c = 0; c < n; ++c) dst[c] = static_cast<A>(p[offset(c)]);
      break;
    }
    case DType::kBool: {
      const auto* p = static_cast<const bool*>(data) + base;
      for (std::int64_t c = 0; c < n; ++c) dst[c] = p[offset(c)] ? A(1) : A(0);
      break;
    }
    case DType::kInt32: {
      const auto* p = static_cast<const std::int32_t*>(data) + base;
      for (std::int64_t c = 0; c < n; ++c) dst[c] = static_cast<A>(p[offset(c)]);
      break;
    }
  }
}

// Element (base + offset(c)) of `data` = src[c] rounded to the storage dtype (floats only).
template <class A, class Offset>
void write(void* data, DType dtype, std::int64_t base, std::int64_t n, Offset offset, const A* src) {
  switch (dtype) {
    case DType::kFloat16: {
      auto* p = static_cast<std::uint16_t*>(data) + base;
      for (std::int64_t c = 0; c < n; ++c) p[offset(c)] = float_to_fp16(static_cast<float>(src[c]));
      break;
    }
    case DType::kBFloat16: {
      auto* p = static_cast<std::uint16_t*>(data) + base;
      for (std::int64_t c = 0; c < n; ++c) p[offset(c)] = float_to_bf16(static_cast<float>(src[c]));
      break;
    }
    case DType::kFloat32: {
      auto* p = static_cast<float*>(data) + base;
      for (std::int64_t c = 0; c < n; ++c) p[offset(c)] = static_cast<float>(src[c]);
      break;
    }
    case DType::kFloat64: {
      auto* p = static_cast<double*>(data) + base;
      for (std::int64_t c = 0; c < n; ++c) p[offset(c)] = static_cast<double>(src[c]);
      break;
    }
    case DType::kBool:
    case DType::kInt32: break;  // never an output of the backend
  }
}

// Offsets of a strided row: c * stride.
struct Strided {
  std::int64_t stride;
  std::int64_t operator()(std::int64_t c) const { return c * stride; }
};
// Offsets of a gathered row: idx[c] * stride.
struct Gathered {
  const std::int64_t* idx;
  std::int64_t stride;
  std::int64_t operator()(std::int64_t c) const { return idx[c] * stride; }
};

}  // namespace dmattn::cpu
