// What a consumer thread of the Hopper forward (fwd/kernel_sm90.cuh) does with
// its elements of a key tile's S = Q K^T besides the walk's own tests (the
// key-only bias and the allowed set stay in the walk, whose register
// allocation is sensitive to them): the loop over its elements, a bias tile's
// logits, the online softmax; and a block's epilogue.
// The thread's elements of S: two rows (my_row[0] and my_row[1], 8 apart in
// its warp's 16), pairs of adjacent keys, kBlockN / 8 groups of 8 keys;
// element e lies in row half e / 2 % 2 at key col_base + 8 (e / 4) + e % 2.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>

#include <cmath>
#include <cstdint>

#include "../common/element.cuh"
#include "../common/sm90.cuh"
#include "../common/softmax.cuh"
#include "../params.h"
#include "block.cuh"

namespace dmattn::cuda {

// f(e, its row half, its key in the tile) for each of the thread's kAccS elements.
template <int kAccS, class F>
__device__ __forceinline__ void for_each_element(int col_base, F&& f) {
#pragma unroll
  for (int e = 0; e < kAccS; ++e) f(e, e / 2 % 2, col_base + 8 * (e / 4) + e % 2);
}

// The logits of a bias tile (ForwardWalk::kRowBias): acc_s = acc_s pre + the
// bias, whose kBlockM x kBlockN tile (Element, boxes of 64 keys laid out as
// Q's atoms) is at `tile` in shared memory; 8 elements (e = 8 c ..: key
// groups 2 c and 2 c + 1, both rows) an ldmatrix.
template <class Config, class AccS>
__device__ __forceinline__ void add_bias_tile(AccS& acc_s, const typename Config::Element* tile, int my_row0, int lane,
                                              float pre) {
  using Element = typename Config::Element;
  constexpr int kAccS = decltype(cute::size(acc_s))::value;
  const auto at = static_cast<unsigned>(__cvta_generic_to_shared(tile));
  const int row = my_row0 - lane / 4 + 8 * (lane / 8 % 2) + lane % 8;  // the lane's of matrix lane / 8
#pragma unroll
  for (int c = 0; c < kAccS / 8; ++c) {
    const int kj = 8 * (2 * c + lane / 16);
    std::uint32_t pairs[4];
    ldsm_x4<false>(at + kj / 64 * (Config::kBlockM * 128) + sw128_offset(row, kj % 64), pairs);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const auto two = reinterpret_cast<const cutlass::Array<Element, 2>&>(pairs[i]);
      acc_s(8 * c + 2 * i) = fmaf(acc_s(8 * c + 2 * i), pre, float(two[0]));
      acc_s(8 * c + 2 * i + 1) = fmaf(acc_s(8 * c + 2 * i + 1), pre, float(two[1]));
    }
  }
}

// The online softmax of the tile (forward_kernel's): each row's max moved
// lazily (move_row_max; `moved`: some row's did, correction[half] rescales
// its O), acc_s turned into exp(l - max) with the exact exponent where a
// logit lies far from the max, the row sums added.
template <class AccS>
__device__ __forceinline__ void tile_softmax(AccS& acc_s, float (&row_max)[2], float (&row_sum)[2], float (&correction)[2],
                                             bool& moved, float c_log2, bool logits) {
  constexpr int kAccS = decltype(cute::size(acc_s))::value;
  bool far = false;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = row_max[half];
#pragma unroll
    for (int e = 2 * half; e < kAccS; e += 4) mx = fmaxf(mx, fmaxf(acc_s(e), acc_s(e + 1)));
    correction[half] = move_row_max(quad_max(mx), c_log2, row_max[half], row_sum[half], moved, far);
  }
  const bool exact = logits && __any_sync(0xffffffff, far);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float base = row_max[half] == -kInf ? 0.0f : row_max[half], base_c = base * c_log2;
    float sum = 0.0f;
    if (exact) {
#pragma unroll
      for (int e = 2 * half; e < kAccS; e += 4)
#pragma unroll
        for (int c = 0; c < 2; ++c) sum += acc_s(e + c) = exp2_ftz((acc_s(e + c) - base) * c_log2);
    } else {
#pragma unroll
      for (int e = 2 * half; e < kAccS; e += 4)
#pragma unroll
        for (int c = 0; c < 2; ++c) sum += acc_s(e + c) = exp2_ftz(fmaf(acc_s(e + c), c_log2, -base_c));
    }
    row_sum[half] += sum;
  }
}

// The rows a block's epilogue writes, and its output rounded: o = acc / sum
// (0 for a row with no allowed key) in words of a pair each (the pair's
// first element in the low half), lse = max + log(sum) of the thread's two
// rows. A persistent walk rounds a block's output once its last P V is done
// and writes it under the next block's first S = Q K^T, holding no register
// that a wgmma wrote (ptxas waits for the wgmma in flight before reading one).
struct BlockRows {
  int h = 0, b = 0;
  std::int64_t qs = 0, row0 = 0, sq = 0;
  __device__ static BlockRows of(const ForwardBlock& blk) { return {blk.h, blk.b, blk.qs, blk.row0, blk.sq}; }
};
template <int kWords>
struct RoundedBlock {
  std::uint32_t words[kWords];
  float lse[2];
};
template <class Config, class AccO>
__device__ __forceinline__ auto round_block(const AccO& acc_o, const float (&row_max)[2], const float (&row_sum)[2],
                                            float unit) {
  constexpr int kAccO = decltype(cute::size(acc_o))::value;
  RoundedBlock<kAccO / 2> r;
  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float sum = quad_sum(row_sum[half]);
    inv[half] = sum > 0.0f ? 1.0f / sum : 0.0f;
    r.lse[half] = sum > 0.0f ? row_max[half] * unit + logf(sum) : -kInf;
  }
#pragma unroll
  for (int e = 0; e < kAccO; e += 2)
    r.words[e / 2] = rounded_word<typename Config::Element>(acc_o(e) * inv[e / 2 % 2], acc_o(e + 1) * inv[e / 2 % 2]);
  return r;
}

// The block's epilogue from its rounded output. A thread's pairs (f, f + 1)
// start at even features: one 32-bit store each where out's strides allow,
// else two 16-bit ones; a pair is whole or padding (past a head dim of whole
// 8-feature chunks). Each of the thread's two rows has its pointer at the
// thread's first feature, so that a store's address is that pointer and a
// constant (an address computed for each store into one register had each
// store wait for the one before it to read that register).
template <class Config, class ThrO, int kWords>
__device__ __forceinline__ void write_block(const ForwardParams& p, const BlockRows& blk, const RoundedBlock<kWords>& r,
                                            const ThrO& thr_o, const int (&my_row)[2], int lane) {
  using namespace cute;
  using Element = typename Config::Element;
  const int h = blk.h, b = blk.b;
  const std::int64_t row0 = blk.row0, sq = blk.sq;
  auto* out = static_cast<Element*>(p.out.data) + b * p.out.sb + h * p.out.sh + (blk.qs + row0) * p.out.sr;
  Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<Config::kBlockM>, Int<Config::kHeadDim>>{}));
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t row = row0 + my_row[half];
    if (p.lse.data != nullptr && lane % 4 == 0 && row < sq)
      static_cast<float*>(p.lse.data)[b * p.lse.sb + h * p.lse.sh + (blk.qs + row) * p.lse.sr] = r.lse[half];
  }
  const bool aligned = pairs_aligned(p.out.data, p.out.sb, p.out.sh, p.out.sr);
  const int f0 = get<1>(cO(0));
  Element* row_out[2];
  bool row_in[2];
#pragma unroll
  for (int half = 0; half < 2; ++half)
    row_out[half] = out + my_row[half] * p.out.sr + f0, row_in[half] = row0 + my_row[half] < sq;
  if (aligned) {
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
      const int half = w % 2, f = get<1>(cO(2 * w));
      if (row_in[half] && f < p.head_dim) store_word(row_out[half] + (f - f0), r.words[w]);
    }
  } else {
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
      const int half = w % 2, f = get<1>(cO(2 * w));
      auto* pair = reinterpret_cast<std::uint16_t*>(row_out[half] + (f - f0));
      if (row_in[half] && f < p.head_dim)
        pair[0] = static_cast<std::uint16_t>(r.words[w]), pair[1] = static_cast<std::uint16_t>(r.words[w] >> 16);
    }
  }
}

// The block's epilogue at once.
template <class Config, class AccO, class ThrO>
__device__ __forceinline__ void store_block(const ForwardParams& p, const BlockRows& blk, const AccO& acc_o,
                                            const ThrO& thr_o, const float (&row_max)[2], const float (&row_sum)[2],
                                            const int (&my_row)[2], float unit, int lane) {
  write_block<Config>(p, blk, round_block<Config>(acc_o, row_max, row_sum, unit), thr_o, my_row, lane);
}

}  // namespace dmattn::cuda
