// The Hopper kernels' bit words of a tested tile (src/cuda/common/allowed.cuh),
// on the host: a span's bits against the columns one by one, and the
// accumulator layout that lets an element test a constant bit.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/common/allowed.cuh"

namespace {

using dmattn::cuda::column_bit;
using dmattn::cuda::span_bits;

// Every span, in and around the tile's 128 columns (empty, reversed and far
// outside ones too): word w holds exactly the span's columns of [32 w, 32 w + 32).
TEST(TileBits, SpanBitsHoldTheSpansColumns) {
  for (int from = -70; from <= 170; ++from)
    for (int to = -70; to <= 170; ++to)
      for (int w = 0; w < 4; ++w) {
        std::uint32_t want = 0;
        for (int c = 0; c < 32; ++c)
          if (32 * w + c >= from && 32 * w + c < to) want |= 1u << c;
        ASSERT_EQ(span_bits(from, to, w), want) << "from " << from << " to " << to << " word " << w;
      }
  EXPECT_EQ(span_bits(-(1 << 20), 1 << 20, 3), 0xffffffffu);  // the band's far limits (kTileFar)
}

// Element e of a thread whose first column is `first` (2 (lane % 4)) sits at
// column first + 8 (e / 4) + e % 2: in word e / 16, at bit first + column_bit(e),
// so the word shifted right by `first` holds it at column_bit(e), every element
// of a 128-column tile inside its word.
TEST(TileBits, ElementsAtAConstantBitAfterTheShift) {
  for (int first = 0; first < 8; first += 2)
    for (int e = 0; e < 64; ++e) {
      const int column = first + 8 * (e / 4) + e % 2;
      ASSERT_EQ(column / 32, e / 16) << "element " << e;
      ASSERT_EQ(column % 32, first + column_bit(e)) << "element " << e;
      ASSERT_LT(first + column_bit(e), 32);
    }
}

}  // namespace
