// Warp-wide scans shared by the sparse passes (key lists, the top-k selection).
#pragma once

namespace dmattn::cuda {

// The sum of x over lanes 0 .. lane of the warp (all 32 lanes call it).
template <class T>
__device__ inline T warp_inclusive_sum(T x, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const T y = __shfl_up_sync(0xffffffff, x, d);
    if (lane >= d) x += y;
  }
  return x;
}

}  // namespace dmattn::cuda
