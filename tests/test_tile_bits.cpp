// The Hopper kernels' bit words of a tested tile (src/cuda/common/allowed.cuh),
// on the host: a span's bits against the columns one by one, and the
// accumulator layout that lets an element test a constant bit; the walks'
// tiles that test no element (src/cuda/common/geometry.h) against band_covers.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/common/allowed.cuh"
#include "cuda/common/geometry.h"

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

// A walk's untested tiles, as its blocks find them once (covered_tiles: a
// query block's key tiles; covered_query_tiles: a key block's query tiles),
// are exactly those that band_covers and that end inside the sequences, for
// causal or not, windows on either side, more keys than queries or fewer, and
// sequences that end inside a tile.
TEST(TileBits, CoveredTilesAreThoseTheBandCovers) {
  using dmattn::cuda::Band;
  const Band bands[] = {{false, -1, -1}, {true, -1, -1}, {true, 0, -1},  {true, 37, -1}, {true, 200, -1},
                        {false, 50, 20}, {false, -1, 0}, {false, 3, 90}, {true, 63, 5}};
  for (const Band& band : bands)
    for (const std::int64_t sq : {1, 40, 64, 130, 300})
      for (const std::int64_t sk : {1, 64, 100, 300, 513}) {
        const std::int64_t offset = sk - sq;  // bottom-right aligned, as the kernels' sequences
        for (const int rows : {16, 64, 128})
          for (const int cols : {32, 64, 128})
            for (std::int64_t r0 = 0; r0 < sq; r0 += rows) {
              const std::int64_t r1 = std::min(r0 + rows, sq) - 1;
              const auto keys = dmattn::cuda::covered_tiles(band, offset, sk, r0, r1, cols);
              for (int n = 0; n <= sk / cols + 1; ++n) {
                const std::int64_t k0 = std::int64_t{n} * cols;
                const bool want = k0 + cols <= sk && dmattn::cuda::band_covers(band, offset, r0, r1, k0, k0 + cols - 1);
                ASSERT_EQ(keys.holds(n), want) << "queries " << r0 << ".." << r1 << " key tile " << n << " of " << cols;
              }
            }
        for (const int rows : {64, 128})
          for (const int cols : {32, 64})
            for (std::int64_t k0 = 0; k0 < sk; k0 += rows) {
              const std::int64_t k1 = k0 + rows - 1;
              const auto queries = dmattn::cuda::covered_query_tiles(band, offset, sq, sk, k0, k1, cols);
              for (int n = 0; n <= sq / cols + 1; ++n) {
                const std::int64_t q0 = std::int64_t{n} * cols;
                const bool want = q0 + cols <= sq && k1 < sk &&
                                  dmattn::cuda::band_covers(band, offset, q0, q0 + cols - 1, k0, k1);
                ASSERT_EQ(queries.holds(n), want) << "keys " << k0 << ".." << k1 << " query tile " << n << " of " << cols;
              }
            }
      }
}

}  // namespace
