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

// The softcap's tanh in one special-function operation: tanh(y) = 1 - 2 r,
// r = 1 / (1 + 2^x) at x = kTanhArg y (callers fold kTanhArg into their
// scale). 2^x by ex2, the reciprocal by two Newton steps on the FMA pipe from
// an integer estimate, the first step's constant tuned with the estimate's
// (0.13% off after it, 1.9e-6 after the second): tanh to 3.4e-6 absolute,
// the logit softcap tanh to 1e-4 at softcap 30, far below a bf16 or fp16
// logit's rounding (4e-3 at 30), in 9 FMA-pipe operations where three
// standard steps and separate scalings took 13 (x above 26, y above 9 where
// tanh is 1 in float32, is clamped). tanh.approx (one operation, 2^-11
// relative error) gave up to 10x the error of a fp16 computation with float32
// logits in a simulation; rcp as a second special-function operation would
// add half again to the softmax's exponentials, which bound a tile's
// elementwise work.
constexpr float kTanhArg = 2.0f * kLog2e;
__device__ inline float inv_1p_ex2(float x) {
  const float d = 1.0f + exp2_ftz(fminf(x, 26.0f));
  float r = __int_as_float(0x7EF339C0 - __float_as_int(d));
  r *= fmaf(-d, r, 2.0013f);
  return r * fmaf(-d, r, 2.0f);
}
__device__ inline float tanh_ex2(float x) { return fmaf(-2.0f, inv_1p_ex2(x), 1.0f); }
// softcap tanh(y) at x = kTanhArg y, one FFMA after the reciprocal.
__device__ inline float softcap_ex2(float x, float softcap) {
  return fmaf(-2.0f * softcap, inv_1p_ex2(x), softcap);
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
