// Helpers of the Hopper (sm_90a) kernels: a batch of warpgroup MMAs, the
// proxy fence between generic shared-memory writes and wgmma (or TMA) reads,
// the bulk float32 reduction, the TMA descriptor of a token operand, and the
// launch-time test that the device runs a kernel's sm_90a code.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "../problem.h"

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

// Byte offset of element (row, col) of a tile of 2-byte elements stored as
// GMMA 128-byte K-major swizzle atoms (Layout_K_SW128_Atom) whose rows hold
// the 64 columns, from the tile's 1024-byte aligned base: 16-byte chunk c of
// row r lands in chunk c ^ (r % 8).
__device__ __forceinline__ unsigned sw128_offset(int row, int col) {
  const unsigned linear = 128u * row + 2u * col;
  return linear ^ ((linear >> 3) & 0x70u);
}

// Adds `bytes` (a multiple of 16) of float32 from shared memory at `from` into
// global memory at `to` (both 16-byte aligned) as one bulk reduction of the
// calling thread's current bulk group.
__device__ __forceinline__ void bulk_reduce_add(float* to, const float* from, int bytes) {
  const auto smem = static_cast<unsigned>(__cvta_generic_to_shared(from));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(to), "r"(smem),
               "r"(bytes)
               : "memory");
}

// The TMA descriptor of a token operand of Element (bf16 or fp16) as
// (feature, row, head, batch) of kFeatures x `rows` x `heads` x `batch`, boxes
// of 64 features (128 bytes, swizzled as GMMA's 128-byte K-major atoms) x
// `box_rows` rows; false where TMA cannot address it (strides not whole
// 16 bytes, or no driver entry point).
template <class Element, int kFeatures>
bool encode_token_map(CUtensorMap* map, const Operand& t, int batch, int heads, std::int64_t rows, int box_rows) {
  static_assert(sizeof(Element) == 2 && kFeatures % 64 == 0, "2-byte elements, whole boxes of 64 features");
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<decltype(&cuTensorMapEncodeTiled)>(fn);  // the driver's, not linked
  }();
  const std::int64_t extent[3] = {rows, heads, batch}, stride[3] = {t.sr, t.sh, t.sb};
  cuuint64_t dims[4] = {static_cast<cuuint64_t>(kFeatures), 0, 0, 0}, strides[3] = {};
  for (int i = 0; i < 3; ++i) {
    const std::int64_t bytes = extent[i] == 1 ? 16 : 2 * stride[i];  // a stride of one row, head or batch is unused
    if (bytes <= 0 || bytes % 16 != 0) return false;
    dims[i + 1] = static_cast<cuuint64_t>(extent[i]), strides[i] = static_cast<cuuint64_t>(bytes);
  }
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1}, step[4] = {1, 1, 1, 1};
  constexpr auto kType = std::is_same_v<Element, cutlass::bfloat16_t> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                      : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode != nullptr && t.sc == 1 && reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0 &&
         encode(map, kType, 4, t.data, dims, strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
             CUDA_SUCCESS;
}

// Issues the TMA copies of rows [row, row + kRows) of head `head` and batch
// `batch` of encode_token_map maps (boxes of kRows rows): for each (map, dst)
// pair, its tile of kRows x kFeatures into dst (boxes of 64 features one after
// another, as tile_to_shape lays out GMMA's atoms), box by box across the
// pairs (the order ptxas allocates the dk/dv kernel's registers best for),
// completing on the mbarrier bar.
template <int kRows, int kFeatures, class Element, class... More>
__device__ __forceinline__ void tma_load_rows(std::uint64_t* bar, int row, int head, int batch,
                                              std::pair<const CUtensorMap*, Element*> tile, More... more) {
#pragma unroll
  for (int box = 0; box < kFeatures / 64; ++box)
    for (const auto& [map, dst] : {tile, more...})
      cute::SM90_TMA_LOAD_4D::copy(map, bar, 0, dst + box * kRows * 64, 64 * box, row, head, batch);
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
