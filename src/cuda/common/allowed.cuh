// A thread's allowed elements of a wgmma accumulator tile as bit words, for
// the Hopper kernels' tested tiles: the band (causal, window, the sequence's
// rows and keys), a key's row interval (top-k) and the mask's bits folded
// into one word per 32 tile columns once a tile, so that each element tests a
// constant bit (an AND and a select) instead of comparing its coordinates.
//
// The accumulator layout (S = Q K^T of the forward, S^T = K Q^T of dk/dv):
// element e of a thread sits in column first + 8 (e / 4) + e % 2, first =
// 2 (lane % 4) < 8; its 32-column word is e / 16. A word shifted right by the
// thread's `first` holds element e at bit column_bit(e).
#pragma once

#include <cstdint>

#include "geometry.h"  // DMATTN_HOST_DEVICE; min and max on the host
#if defined(__CUDACC__)
#include "../params.h"  // the mask's tile classes
#endif

namespace dmattn::cuda {

// The bit of element e in its word, after the shift by the thread's first column.
DMATTN_HOST_DEVICE constexpr int column_bit(int e) { return 8 * (e / 4 % 4) + e % 2; }

// Columns [from, to) of the tile (any ints; clamped) within word w's columns
// [32 w, 32 w + 32), as bits.
DMATTN_HOST_DEVICE inline std::uint32_t span_bits(int from, int to, int w) {
  const int a = min(max(from - 32 * w, 0), 32), z = min(max(to - 32 * w, 0), 32);
  return z > a ? (0xffffffffu >> (32 - (z - a))) << a : 0u;
}

#if defined(__CUDACC__)
// A thread's allowed words: its two rows (or keys, of S^T) half = e / 2 % 2,
// kWords words of 32 tile columns each, shifted by its first column.
template <int kWords>
struct AllowedWords {
  std::uint32_t word[2][kWords];
  // Row `half` allows the columns of `span`, and of those where `bits`, the
  // set bits of its words.
  __device__ __forceinline__ void set(int half, TileSpan span, bool bits, const std::uint32_t (&words)[kWords],
                                      int first) {
#pragma unroll
    for (int w = 0; w < kWords; ++w) word[half][w] = (span_bits(span.from, span.to, w) & (bits ? words[w] : ~0u)) >> first;
  }
  __device__ __forceinline__ bool allows(int e) const { return ((word[e / 2 % 2][e / 16] >> column_bit(e)) & 1u) != 0; }
};

// The mask's walks over tile classes (MaskTiles): of the tiles first, first +
// kStep, ... before `end` (kStep = 1 or -1), the first one not empty and
// whether it is partial, 32 classes a look by the warp; {end, false} where
// none is.
struct ClassedTile {
  int at;
  bool partial;
};
template <int kStep, class ClassOf>
__device__ __forceinline__ ClassedTile next_classed_tile(int first, int end, const ClassOf& class_of) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const auto before_end = [&](int t) { return kStep > 0 ? t < end : t > end; };
  for (int at = first; before_end(at); at += 32 * kStep) {
    const int t = at + kStep * lane;
    const int cls = before_end(t) ? class_of(t) : kTileEmpty;
    const unsigned found = __ballot_sync(0xffffffff, cls != kTileEmpty);
    const unsigned partial = __ballot_sync(0xffffffff, cls == kTilePartial);
    if (found != 0) {
      const int low = __ffs(found) - 1;
      return {at + kStep * low, ((partial >> low) & 1) != 0};
    }
  }
  return {end, false};
}
#endif

}  // namespace dmattn::cuda
