// The online softmax's device arithmetic, shared by every attention kernel:
// exp2 on the special-function unit, tanh, the quad reductions of a row's four
// threads (mma.sync and wgmma accumulator layouts alike) and the lazily moved
// row max.
#pragma once

#include <cmath>

namespace dmattn::cuda {

// log2(e): exp(x) = exp2(x * kLog2e).
constexpr float kLog2e = 1.4426950408889634f;
// The logit of an excluded entry, and the max of a row that has none allowed.
constexpr float kInf = INFINITY;

// 2^x on the special-function unit alone; results below the normal range flush
// to 0, far below anything that changes a float32 softmax sum.
__device__ inline float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) = 1 - 2 / (1 + e^2x) to 4e-7 absolute (the softcap's logit
// softcap tanh(s / softcap) to 1e-5 at softcap 30, far below a bf16 or fp16
// score's rounding) for one special-function operation: e^2x by ex2, the
// reciprocal by three Newton steps on the FMA pipe from an integer estimate
// (5% off over [1, e^18]: x above 9, where tanh is 1 in float32, is clamped).
// tanh.approx (one operation, 2^-11 relative error) gave up to 10x the error of
// a fp16 computation with float32 logits in a simulation; rcp as a second
// special-function operation would add half again to the softmax's
// exponentials, which bound a tile's elementwise work.
__device__ inline float tanh_ex2(float x) {
  const float d = 1.0f + exp2_ftz(fminf(x, 9.0f) * (2.0f * kLog2e));
  float r = __int_as_float(0x7EF311C3 - __float_as_int(d));
#pragma unroll
  for (int i = 0; i < 3; ++i) r *= fmaf(-d, r, 2.0f);
  return fmaf(-2.0f, r, 1.0f);
}

__device__ inline float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

// The forward kernels' online softmax, in log2 units c: a row's max is the
// one of its keys so far, or one at most kStale below it. It moves to the
// tile's max mx (quad-reduced) only when that passes it by more, so that
// P <= 2^kStale and O is rescaled on the first tiles and seldom later (an
// exact max moves on nearly every other tile). Scales the row's sum by the
// correction it returns (1 where the max stays; -inf to -inf: NaN, not moved),
// sets moved where it moved and far where the max lies beyond kNearMax (logits
// up to that size take the one-FFMA exponent).
constexpr float kStale = 8.0f, kNearMax = 256.0f;
__device__ inline float move_row_max(float mx, float c_log2, float& row_max, float& row_sum, bool& moved, bool& far) {
  const bool row_moved = (mx - row_max) * c_log2 > kStale;
  const float correction = row_moved ? exp2_ftz((row_max - mx) * c_log2) : 1.0f;
  row_sum *= correction;
  moved |= row_moved;
  if (row_moved) row_max = mx;
  far |= row_max != -INFINITY && fabsf(row_max) > kNearMax;
  return correction;
}
__device__ inline float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

}  // namespace dmattn::cuda
