// The online softmax's device arithmetic, shared by every attention kernel:
// exp2 on the special-function unit, the quad reductions of a row's four
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
