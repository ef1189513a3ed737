// The dQ-writer warp of the Hopper dk/dv kernel's ordered walk (DkvWalk::
// kOrdered, deterministic=True; bwd/kernel_sm90.cuh): it adds each step's dQ
// block, which the MMA warps handed it in a shared-memory buffer, into dq_acc
// after the key block before has added it, so that every element of dq_acc
// sums its key blocks in key order (bitwise reproducible), and neither the
// turn's wait nor its release fence holds up the MMA warps.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "../common/sm90.cuh"

namespace dmattn::cuda {

// Named barriers of the ordered walk (the writer warpgroup is in none of the
// CTA's __syncthreads after the walk starts): the MMA warps' step barrier,
// and for dQ buffer i, kDqFull + i (the MMA warps have stored their parts of a
// step's block) and kDqEmpty + i (the writer's reduction has read it), each
// the MMA threads' and the writer warp's.
struct OrderedDqBarriers {
  static constexpr int kStep = 0, kDqFull = 1, kDqEmpty = 3;
};

// The writer warp's walk over the `total` steps (the ordered walk skips none):
// step s's block (step_head(s), step_block(s)), from dQ buffer s % kBuffers
// (dq_buffer), by one bulk reduction into dq_block(h, blk) once key block
// key_block - 1 has added it (turn(h, blk) reads key_block; only query blocks
// before before_end are on that key block's walk); the buffer freed once read,
// the turn passed on once the reduction is complete (release). kHandOff: the
// MMA threads and this warp.
template <int kBuffers, int kHandOff, int kBlockFloats, class StepHead, class StepBlock, class DqBlock, class Turn,
          class DqBuffer>
__device__ __forceinline__ void write_ordered_dq(int total, int key_block, int before_end, int lane,
                                                 const StepHead& step_head, const StepBlock& step_block,
                                                 const DqBlock& dq_block, const Turn& turn, const DqBuffer& dq_buffer) {
  using cutlass::arch::NamedBarrier;
  for (int s = 0; s < total; ++s) {
    const int buf = s % kBuffers, h = step_head(s), blk = step_block(s);
    int* const block_turn = turn(h, blk);
    NamedBarrier::sync(kHandOff, OrderedDqBarriers::kDqFull + buf);
    if (lane == 0) {
      if (blk < before_end) wait_turn(block_turn, key_block);
      fence_async_global();
      bulk_reduce_add(dq_block(h, blk), dq_buffer(buf), kBlockFloats * int(sizeof(float)));
      cute::tma_store_arrive();
      cute::tma_store_wait<0>();
    }
    __syncwarp();
    if (s + kBuffers < total) NamedBarrier::arrive(kHandOff, OrderedDqBarriers::kDqEmpty + buf);
    if (lane == 0) {
      bulk_wait_complete<0>();
      pass_turn(block_turn, key_block + 1);
    }
  }
}

}  // namespace dmattn::cuda
