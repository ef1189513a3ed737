// What both dk/dv kernels (sm80 and Hopper) share besides the bias policy
// (common/bias.cuh): the keys of a top-k key group and the hand-over of a
// key's pieces.
#pragma once

#include <cstdint>

#include "../common/geometry.h"
#include "../params.h"

namespace dmattn::cuda {

// Top-k key groups of the dk/dv walk (BackwardParams::group_rows), helpers of
// both dk/dv kernels. Key r of a CTA: entry r of its group in key_order from
// entry0 (sorted groups), else key row0 + r (-1: none past sk).
__device__ inline std::int64_t group_key(const BackwardParams& p, std::int64_t entry0, std::int64_t row0, std::int64_t sk,
                                         int r) {
  if (p.key_order != nullptr)
    return entry0 % p.segment_entries + r < p.segment_entries ? p.key_order[entry0 + r] : -1;
  return row0 + r < sk ? row0 + r : -1;
}
// The first row of the segment of the group whose entries start at entry0.
__device__ inline int group_segment_lo(const BackwardParams& p, std::int64_t entry0) {
  return static_cast<int>(entry0 / p.segment_entries % p.key_segments * p.segment_rows);
}
// The rows of selection head sh of batch b (sq rows) that select key `key`
// (>= 0), within the segment from row segment_lo.
__device__ inline KeyRows segment_key_rows(const BackwardParams& p, int b, int sh, std::int64_t key, std::int64_t sq,
                                           int segment_lo) {
  KeyRows r = sequence_rows(p.topk_intervals[(std::int64_t{b} * p.topk_heads + sh) * p.seqlen_k + key], sq);
  r.start = max(r.start, segment_lo);
  r.end = static_cast<std::int32_t>(min(std::int64_t{r.end}, segment_lo + p.segment_rows));
  return r;
}

// Pieces (key_segments > 1): the pieces of a key add their dK, dV (unscaled)
// and key dbias sums in segment order through the key's float32 slot: piece r
// waits until the key's turn counter reads r (its earlier pieces are in earlier
// segments, whose CTAs started before it: CTAs start in order), adds the slot,
// and passes it on; the last piece writes the gradients. Where the grouping
// dropped pieces (BackwardParams::groups_overflow: given intervals that are no
// selection of the call) no piece waits, so that none waits for a dropped one.
// Row r of the CTA's kRows holds key keys[r] (-1: none) with info[r] (info()).
// A key's slot: dK, dV, key dbias, 32-byte aligned, so that a quad's eight
// consecutive features (a pair a lane) are one sector.
constexpr int piece_slot_floats(int head_dim) { return 2 * head_dim + 8; }
template <int kHeadDim, int kRows>
struct KeyPieces {
  static constexpr int kSlot = piece_slot_floats(kHeadDim);
  float* slots;
  int* turns;
  const std::int32_t* keys;
  const int* info;
  bool dropped;
  __device__ KeyPieces(const BackwardParams& p, int b, int kvh, const std::int32_t* keys_, const int* info_)
      : keys(keys_), info(info_), dropped(p.groups_overflow != nullptr && *p.groups_overflow != 0) {
    const std::int64_t slice = std::int64_t{b} * (p.heads / p.group) + kvh;
    slots = p.piece_acc + slice * p.seqlen_k * kSlot;
    turns = p.piece_turn + slice * p.seqlen_k;
  }
  // The info of group entry `entry` holding key `key` of kv slice `slice`:
  // 2 rank + 1 for the key's last piece (no key: 1).
  __device__ static int info_of(const BackwardParams& p, std::int64_t entry, std::int64_t slice, std::int64_t key) {
    const int rank = key >= 0 ? p.key_rank[entry] : 0;
    return 2 * rank + (key < 0 || rank + 1 == p.key_pieces[slice * p.seqlen_k + key]);
  }
  // One row's piece: x plus the sum its key's earlier pieces left at `at` of
  // the slot (take), left there in turn for the later ones (leave, where
  // `writes`). A thread takes its sums (all of them; sm80: a row's, which
  // keeps ptxas from spilling), then leaves them, so that its loads are in
  // flight together: a store between two loads of slots, which the compiler
  // cannot tell apart, serialises them (a round trip to L2 each).
  // The pairs: features at, at + 1 (at even), one 8-byte access.
  struct Row {
    float* slot;
    int info;
    __device__ bool last() const { return info & 1; }
    __device__ float take(int at, float x) const { return info > 1 ? x + __ldcg(slot + at) : x; }
    __device__ void leave(int at, float x, bool writes) const {
      if (!(info & 1) && writes) __stcg(slot + at, x);
    }
    __device__ void take_pair(int at, float& x, float& y) const {
      if (info > 1) {
        const float2 got = __ldcg(reinterpret_cast<const float2*>(slot + at));
        x += got.x, y += got.y;
      }
    }
    __device__ void leave_pair(int at, float x, float y) const {
      if (!(info & 1)) __stcg(reinterpret_cast<float2*>(slot + at), make_float2(x, y));
    }
  };
  __device__ Row row(int r) const {
    const int key = keys[r];
    return Row{slots + std::int64_t{max(key, 0)} * kSlot, key >= 0 ? info[r] : 1};
  }
  // The whole CTA: waits for the turns of its keys; passes them on.
  __device__ void wait() const {
    const int tid = threadIdx.x;
    if (tid < kRows && keys[tid] >= 0 && !dropped) {
      while (atomicAdd(turns + keys[tid], 0) != info[tid] >> 1) __nanosleep(256);
      __threadfence();
    }
    __syncthreads();
  }
  __device__ void pass() const {
    const int tid = threadIdx.x;
    __threadfence();
    __syncthreads();
    if (tid < kRows && keys[tid] >= 0 && !(info[tid] & 1)) atomicExch(turns + keys[tid], (info[tid] >> 1) + 1);
  }
};

}  // namespace dmattn::cuda
