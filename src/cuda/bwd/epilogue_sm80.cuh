// What backward_kernel (bwd/kernel_sm80.cuh) writes at the end of its walk:
// dq = scale * acc_a (a dq CTA's rows), or dk = scale * acc_a and dv = acc_b
// by key (a dk/dv CTA's keys): with the column split the second warp of a row
// block adds its sums into the first's (the holder's) through the column
// buffers; a top-k key's pieces add up in segment order (KeyPieces), its
// key-only dbias sum with them.
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "../common/geometry.h"
#include "../common/softmax.cuh"
#include "../params.h"
#include "dkv_shared.cuh"

namespace dmattn::cuda {

// The thread's accumulators (thr's partition, rows as cS's: its two rows of
// its warp's 16) of the CTA's rows from row0 (own_len: the sequence's rows or
// keys; a dk/dv CTA's keys: own_keys); its features from feature0; holder,
// stager: its part of a split row block (BackwardConfig::kSplit). With pieces:
// the key sums key_sum (add_key_sum_parts: the column split's second warp's
// added) go out by store_key_sums(bias head, sums, rows) with the key's last
// piece. cols_smem: the column buffers, free after the walk. d: the head dim.
template <class Config, class Acc, class ThrMma, class CoordS, class AddParts, class StoreKeySums>
__device__ __forceinline__ void store_backward(const BackwardParams& p, const Sequence& seq, int b, int kvh, int h_first,
                                               Acc& acc_a, Acc& acc_b, const ThrMma& thr, const CoordS& cS,
                                               const std::int32_t* own_keys, const int* piece_info, std::int64_t row0,
                                               std::int64_t own_len, int feature0, bool holder, bool stager,
                                               bool pieces, float (&key_sum)[2], const AddParts& add_key_sum_parts,
                                               const StoreKeySums& store_key_sums, typename Config::Element* cols_smem,
                                               int lane, int d, float scale) {
  using namespace cute;
  using Element = typename Config::Element;
  constexpr bool kKeyRows = Config::kKeyRows;
  constexpr int kBlockRows = Config::kBlockRows, kHeadDim = Config::kHeadDim, kAccDim = Config::kAccDim;
  Tensor cO = thr.partition_C(make_identity_tensor(Shape<Int<kBlockRows>, Int<kAccDim>>{}));
  // The rows of a dk/dv CTA stored: all but the pieces that hand their sums on
  // (column split: by the holders).
  const int my_row[2] = {get<0>(cS(make_coord(make_coord(0, 0), 0, 0))), get<0>(cS(make_coord(make_coord(0, 1), 0, 0)))};
  bool my_store[2] = {holder, holder};
  constexpr int kAccN = decltype(size<2>(acc_a))::value;
  // f(e, feature) for the thread's accumulator elements e of row `half` (a
  // key's pieces; the stores below keep their loop: as a call, the bf16 dq
  // kernel's SASS changes).
  const auto for_each_feature = [&](int half, auto&& f) {
#pragma unroll
    for (int nn = 0; nn < kAccN; ++nn)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const auto e = make_coord(make_coord(c, half), 0, nn);
        f(e, feature0 + get<1>(cO(e)));
      }
  };
  auto store = [&](auto& acc, const Operand& o, int head, std::int64_t start, float factor) {
    auto* dst = static_cast<Element*>(o.data) + b * o.sb + head * o.sh + start * o.sr;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = my_row[half];
      const std::int64_t at = kKeyRows ? own_keys[row] : (row0 + row < own_len ? row0 + row : -1);  // dk/dv: by key
      if (at < 0 || !my_store[half]) continue;
#pragma unroll
      for (int nn = 0; nn < kAccN; ++nn)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const auto e = make_coord(make_coord(c, half), 0, nn);
          const int col = feature0 + get<1>(cO(e));
          if (col < d) dst[at * o.sr + col] = static_cast<Element>(acc(e) * factor);
        }
    }
  };
  if constexpr (kKeyRows) {
    if constexpr (Config::kColumnSplit) {  // the second warp's dK and dV added into the first's through the column buffers
      auto* sums = reinterpret_cast<float*>(cols_smem);
      const auto add_parts = [&](auto& acc) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
          for_each_feature(half, [&](auto e, int f) {
            if (!holder) sums[my_row[half] * kHeadDim + f] = acc(e);
          });
        __syncthreads();
#pragma unroll
        for (int half = 0; half < 2; ++half)
          for_each_feature(half, [&](auto e, int f) {
            if (holder) acc(e) += sums[my_row[half] * kHeadDim + f];
          });
        __syncthreads();
      };
      add_parts(acc_a);
      add_parts(acc_b);
    }
    if (pieces) {  // the key's earlier pieces' sums added, handed on unless the last piece
      const KeyPieces<kHeadDim, kBlockRows> hand(p, b, kvh, own_keys, piece_info);
      float x[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) x[half] = quad_sum(key_sum[half]);
      add_key_sum_parts(x);
      hand.wait();
      typename KeyPieces<kHeadDim, kBlockRows>::Row piece[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        piece[half] = hand.row(my_row[half]);
        my_store[half] = holder && piece[half].last();
        x[half] = piece[half].take(2 * kHeadDim, x[half]);
        piece[half].leave(2 * kHeadDim, x[half], lane % 4 == 0 && stager && holder);
      }
      // dK's sums, then dV's: interleaved, ptxas for sm_80 / 86 / 89 spilled
      // the column split's walk (576 / 720 bytes, some of it every step).
      const auto add_pieces = [&](auto& acc, int at) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          for_each_feature(half, [&](auto e, int f) { acc(e) = piece[half].take(at + f, acc(e)); });
          for_each_feature(half, [&](auto e, int f) { piece[half].leave(at + f, acc(e), holder); });
        }
      };
      add_pieces(acc_a, 0);
      add_pieces(acc_b, kHeadDim);
      hand.pass();
      if (p.bias_grad == BiasGrad::kPerKey)
        store_key_sums(h_first / p.bias_group, x, unsigned{my_store[0]} | unsigned{my_store[1]} << 1);
    }
    store(acc_a, p.dk, kvh, seq.ks, scale);
    store(acc_b, p.dv, kvh, seq.ks, 1.0f);
  } else {
    store(acc_a, p.dq, h_first, seq.qs, scale);
  }
}

}  // namespace dmattn::cuda
