// Helpers of the Hopper (sm_90a) kernels: a batch of warpgroup MMAs, the
// proxy fence between generic shared-memory writes and wgmma reads, and the
// launch-time test that the device runs a kernel's sm_90a code.
#pragma once

#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cuda_runtime.h>

namespace dmattn::cuda {

// acc(_, _, k) += A(_, _, k) B(_, _, k) over the K mode as one batch of warpgroup
// MMAs (zeroing acc first with kZero); the caller waits for it.
template <bool kZero, class Mma, class A, class B, class C>
__device__ __forceinline__ void wgmma_batch(Mma& mma, A& a, const B& b, C& acc) {
  using namespace cute;
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  if constexpr (kZero) mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int kk = 0; kk < size<2>(a); ++kk) {
    gemm(mma, a(_, _, kk), b(_, _, kk), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
}

// Generic-proxy shared-memory writes (cp.async, st.shared) made visible to the
// wgmma operand reads (async proxy) that follow the next barrier.
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Whether `kernel` runs its sm_90a code on the current device (an sm_90 device
// and a binary built for it; *runs false otherwise), with `smem_bytes` of
// dynamic shared memory allowed; the runtime's error, if any.
template <class Kernel>
cudaError_t prepare_sm90(Kernel kernel, int smem_bytes, bool* runs) {
  *runs = false;
  int device = 0, major = 0;
  cudaFuncAttributes attr{};
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess || major != 9 || attr.binaryVersion != 90 || attr.ptxVersion < 90) return err;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  *runs = err == cudaSuccess;
  return err;
}

}  // namespace dmattn::cuda
