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

namespace dmattn::cuda {

// The bit of element e in its word, after the shift by the thread's first column.
DMATTN_HOST_DEVICE constexpr int column_bit(int e) { return 8 * (e / 4 % 4) + e % 2; }

// Columns [from, to) of the tile (any ints; clamped) within word w's columns
// [32 w, 32 w + 32), as bits.
DMATTN_HOST_DEVICE inline std::uint32_t span_bits(int from, int to, int w) {
  const int a = min(max(from - 32 * w, 0), 32), z = min(max(to - 32 * w, 0), 32);
  return z > a ? (0xffffffffu >> (32 - (z - a))) << a : 0u;
}

}  // namespace dmattn::cuda
