// dq by float32 atomics from the sm80-class dk/dv kernel
// (BackwardParams::dq_acc): the dQ = dS^T K product of a step and its vector
// reductions into dq_acc.
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "../common/tile_sm80.cuh"

namespace dmattn::cuda {

// Adds x, y to at[0], at[1] in global memory (8-byte aligned), one vector
// reduction on sm_90.
__device__ __forceinline__ void red_add2(float* at, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(at), "f"(x), "f"(y) : "memory");
#else
  atomicAdd(at, x);
  atomicAdd(at + 1, y);
#endif
}

// dq by atomics: dQ of a dk/dv step's kStep queries = dS^T K (ds_t staged by
// the step, k_rows the CTA's keys), added into dq_rows (float32, kHeadDim a row)
// for queries below `rows` and features below d: up to D = 128 all features in
// one pass (4 independent MMA chains a warp), above it 64 at a time; no
// ldmatrix prefetch (few registers: the dk/dv accumulators are live).
template <class Config>
__device__ void add_dq_step(typename Config::Element* ds_t, typename Config::Element* k_rows, float* dq_rows, int rows,
                            int d) {
  using namespace cute;
  constexpr int kCols = Config::kHeadDim <= 128 ? Config::kHeadDim : 64;
  using Block = Shape<Int<Config::kStep>, Int<kCols>>;
  typename Config::TiledMmaDq mma;
  // The thread index read anew each step (sm_90a, dk/dv kernel: 88 bytes of
  // spills instead of 44 from threadIdx.x).
  const int tid = thread_index();
  auto thr = mma.get_thread_slice(tid);
  auto copy_a = make_tiled_copy_A(typename Config::LdsmAtomT{}, mma);
  auto copy_b = make_tiled_copy_B(typename Config::LdsmAtomT{}, mma);
  auto ldsm_a = copy_a.get_thread_slice(tid);
  auto ldsm_b = copy_b.get_thread_slice(tid);
  Tensor sA = make_tensor(make_smem_ptr(ds_t), typename Config::SmemLayoutDsT{});
  Tensor sB = make_tensor(make_smem_ptr(k_rows), typename Config::SmemLayoutRowsT{});
  Tensor rA = thr.partition_fragment_A(sA);  // (MMA, 1, kBlockRows / 16)
  Tensor rAv = ldsm_a.retile_D(rA);
  Tensor c = thr.partition_C(make_identity_tensor(Block{}));
#pragma unroll 1
  for (int n0 = 0; n0 < d; n0 += kCols) {
    Tensor sBn = local_tile(sB, Shape<Int<kCols>, Int<Config::kBlockRows>>{}, make_coord(n0 / kCols, 0));
    Tensor rB = thr.partition_fragment_B(sBn);  // (MMA, MMA_N, kBlockRows / 16)
    Tensor rBv = ldsm_b.retile_D(rB);
    Tensor acc = partition_fragment_C(mma, Block{});
    clear(acc);
    Tensor sAp = ldsm_a.partition_S(sA);
    Tensor sBp = ldsm_b.partition_S(sBn);
#pragma unroll
    for (int kk = 0; kk < size<2>(rA); ++kk) {
      copy(copy_a, sAp(_, _, kk), rAv(_, _, kk));
      copy(copy_b, sBp(_, _, kk), rBv(_, _, kk));
      gemm(mma, rA(_, _, kk), rB(_, _, kk), acc);
    }
    // Elements e, e + 1: adjacent features of a query. A whole tile (the usual
    // case) takes no tests and constant offsets from one address.
    float* at = dq_rows + get<0>(c(0)) * Config::kHeadDim + n0 + get<1>(c(0));
    if (rows == Config::kStep && n0 + kCols <= d) {
#pragma unroll
      for (int e = 0; e < size(acc); e += 2)
        red_add2(at + (get<0>(c(e)) - get<0>(c(0))) * Config::kHeadDim + get<1>(c(e)) - get<1>(c(0)), acc(e), acc(e + 1));
    } else {
#pragma unroll
      for (int e = 0; e < size(acc); e += 2) {
        const int qi = get<0>(c(e)), col = n0 + get<1>(c(e));
        if (qi < rows && col < d) red_add2(dq_rows + qi * Config::kHeadDim + col, acc(e), acc(e + 1));
      }
    }
  }
}

}  // namespace dmattn::cuda
