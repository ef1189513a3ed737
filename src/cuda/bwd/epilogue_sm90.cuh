// What the Hopper dk/dv kernel (bwd/kernel_sm90.cuh) writes: a step's P^T and
// dS^T for its MMAs, a bias head's key-only dbias sums, a step's dbias tile (a
// full bias's, kBiasTiles) by TMA, and at the end dk = scale * acc_dk and dv =
// acc_dv by key, a top-k key's pieces added up first (KeyPieces, in segment
// order), and its key-only dbias sum out with its last piece.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include <cstdint>

#include "../common/bias.cuh"
#include "../common/element.cuh"
#include "../common/geometry.h"
#include "../common/sm90.cuh"
#include "../common/softmax.cuh"
#include "../params.h"
#include "dkv_shared.cuh"

namespace dmattn::cuda {

// P^T and dS^T of a step in Element into rP and rDs, the A-operand layout of
// the dK / dV MMAs (the accumulator's kAccS / 4 query groups are kAccS / 8
// k-slices of 16), and dS^T to shared memory: kBiasTiles, over the thread's
// bias elements as they were read (chunk c at tile_at(c)); else pair e at
// the swizzle atom of queries 64 (e / 32) .. + 63 (8 query groups an atom) of
// the dS buffer `ds` (split features: P^T's too, at `pt`).
template <class Config, bool kBiasTiles, class Acc, class Coords, class Regs, class TileAt>
__device__ __forceinline__ void stage_p_ds(const Acc& acc_s, const Acc& acc_dp, const Coords& cS, Regs& rP, Regs& rDs,
                                           char* ds, char* pt, const TileAt& tile_at) {
  using namespace cute;
  using Element = typename Config::Element;
  constexpr int kAccS = decltype(size(acc_s))::value;
  using Convert = cutlass::NumericArrayConverter<Element, float, kAccS>;
  *reinterpret_cast<cutlass::Array<Element, kAccS>*>(raw_pointer_cast(rP.data())) =
      Convert{}(*reinterpret_cast<const cutlass::Array<float, kAccS>*>(raw_pointer_cast(acc_s.data())));
  *reinterpret_cast<cutlass::Array<Element, kAccS>*>(raw_pointer_cast(rDs.data())) =
      Convert{}(*reinterpret_cast<const cutlass::Array<float, kAccS>*>(raw_pointer_cast(acc_dp.data())));
  const auto* ds_pairs = reinterpret_cast<const std::uint32_t*>(raw_pointer_cast(rDs.data()));
  [[maybe_unused]] const auto* p_pairs = reinterpret_cast<const std::uint32_t*>(raw_pointer_cast(rP.data()));
  if constexpr (kBiasTiles) {
#pragma unroll
    for (int c = 0; c < kAccS / 8; ++c)
      stsm_x4_trans(tile_at(c), {ds_pairs[4 * c], ds_pairs[4 * c + 1], ds_pairs[4 * c + 2], ds_pairs[4 * c + 3]});
  } else {
#pragma unroll
    for (int e = 0; e < kAccS; e += 2) {
      const unsigned at = e / 32 * Config::kDsAtomBytes + sw128_offset(get<0>(cS(e)), get<1>(cS(e)) - e / 32 * 64);
      *reinterpret_cast<std::uint32_t*>(ds + at) = ds_pairs[e / 2];
      if constexpr (Config::kSplitFeatures) *reinterpret_cast<std::uint32_t*>(pt + at) = p_pairs[e / 2];
    }
  }
}

// A bias head's key-only dbias sums of the thread's two keys (key_sum, reset
// here) out by the first lane of their quads (split features: a key's two
// halves of the queries meet in `halves`, the key area, first).
template <class Config, class Element, class KeyOf>
__device__ __forceinline__ void store_key_dbias(const BackwardParams& p, const BiasGradOut<Element>& db_out, int hb,
                                                float (&key_sum)[2], const int (&my_key)[2], const KeyOf& thread_key,
                                                float* halves, int tid, int lane) {
  float x[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) x[half] = quad_sum(key_sum[half]), key_sum[half] = 0.0f;
  if constexpr (Config::kSplitFeatures) {
    if (tid >= 128 && lane % 4 == 0) halves[my_key[0]] = x[0], halves[my_key[1]] = x[1];
    __syncthreads();
    if (tid < 128) x[0] += halves[my_key[0]], x[1] += halves[my_key[1]];
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t key = thread_key(half);
    if (lane % 4 == 0 && key >= 0 && (!Config::kSplitFeatures || tid < 128)) db_out.add(p, hb, 0, key, x[half]);
  }
}

// The dbias tile of a step's (bias head, query block) out of the step's dS
// buffer `tile` (kBlockM x kBlockN, the bias tile's layout) to `map` at
// (query q, key k, `at`: (bias head, batch)), by thread 0's TMA store, once
// every thread's part is there: dS itself, or (summed: the tile's sums over
// several query heads, in db_sum, one float a thread and element, kThreads
// apart) the sums, rounded and written over dS as dS was (chunk c's address:
// tile_at(c)), once both warpgroups' dQ MMAs have read it.
template <class Config, int kAccS, class TileAt>
__device__ __forceinline__ void store_dbias_tile(bool summed, const float* db_sum, const TileAt& tile_at,
                                                 const CUtensorMap* map, typename Config::Element* tile, int q, int k,
                                                 int2 at, int tid) {
  using Element = typename Config::Element;
  if constexpr (Config::kDbSums) {
    if (summed) {
      __syncthreads();
      using Pair = cutlass::NumericArrayConverter<Element, float, 2>;
#pragma unroll
      for (int c = 0; c < kAccS / 8; ++c) {
        std::uint32_t pairs[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          cutlass::Array<float, 2> two;
          two[0] = db_sum[(8 * c + 2 * i) * Config::kThreads];
          two[1] = db_sum[(8 * c + 2 * i + 1) * Config::kThreads];
          const cutlass::Array<Element, 2> rounded = Pair{}(two);
          pairs[i] = reinterpret_cast<const std::uint32_t&>(rounded);
        }
        stsm_x4_trans(tile_at(c), pairs);
      }
    }
  }
  fence_async_shared();
  __syncthreads();
  if (tid == 0) {
    tma_bias_tile<Config::kBlockM, Config::kBlockN, true>(map, nullptr, tile, q, k, at);
    cute::tma_store_arrive();
  }
}

// The thread's accumulators of keys my_key[0] and my_key[1] (its two rows of
// its warp's 16; thread_key(half): the key, -1: none) of (b, kvh) in
// Config's layout (thr_dkv's partition of kBlockN x kHeadDim). With pieces
// (top-k key groups cut at row segments: piece_info, own_keys) each key's
// partial sums, key_sum included, go through the pieces' slots first and
// only its last piece stores; key_sum[half] is then the key's whole dbias
// sum. d: the head dim, scale: dk's factor.
template <class Config, class Acc, class ThrDkv, class KeyOf>
__device__ __forceinline__ void store_dkv(const BackwardParams& p, int b, int kvh, const Sequence& seq, Acc& acc_dk,
                                          Acc& acc_dv, const ThrDkv& thr_dkv, const int (&my_key)[2],
                                          const KeyOf& thread_key, const std::int32_t* own_keys, const int* piece_info,
                                          bool pieces, bool key_sums, float (&key_sum)[2],
                                          const BiasGradOut<typename Config::Element>& db_out, int h_first, int lane,
                                          int d, float scale) {
  using namespace cute;
  using Element = typename Config::Element;
  constexpr int kBlockN = Config::kBlockN, kHeadDim = Config::kHeadDim;
  Tensor cO = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  bool stores[2] = {true, true};
  if (pieces) {
    const KeyPieces<kHeadDim, kBlockN> hand(p, b, kvh, own_keys, piece_info);
    hand.wait();
    typename KeyPieces<kHeadDim, kBlockN>::Row piece[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      piece[half] = hand.row(my_key[half]);
      stores[half] = piece[half].last();
      key_sum[half] = piece[half].take(2 * kHeadDim, quad_sum(key_sum[half]));
      piece[half].leave(2 * kHeadDim, key_sum[half], lane % 4 == 0);
    }
#pragma unroll
    for (int e = 0; e < size(acc_dk); e += 2) {
      const int half = e / 2 % 2, f = get<1>(cO(e));
      piece[half].take_pair(f, acc_dk(e), acc_dk(e + 1));
      piece[half].take_pair(kHeadDim + f, acc_dv(e), acc_dv(e + 1));
    }
#pragma unroll
    for (int e = 0; e < size(acc_dk); e += 2) {
      const int half = e / 2 % 2, f = get<1>(cO(e));
      piece[half].leave_pair(f, acc_dk(e), acc_dk(e + 1));
      piece[half].leave_pair(kHeadDim + f, acc_dv(e), acc_dv(e + 1));
    }
    hand.pass();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t key = thread_key(half);
      if (key_sums && stores[half] && lane % 4 == 0 && key >= 0)
        db_out.add(p, h_first / p.bias_group, 0, key, key_sum[half]);
    }
  }
  auto* dk = static_cast<Element*>(p.dk.data) + b * p.dk.sb + kvh * p.dk.sh + seq.ks * p.dk.sr;
  auto* dv = static_cast<Element*>(p.dv.data) + b * p.dv.sb + kvh * p.dv.sh + seq.ks * p.dv.sr;
  const std::int64_t store_key[2] = {stores[0] ? thread_key(0) : -1, stores[1] ? thread_key(1) : -1};
  // A thread's pairs (f, f + 1) start at even features: whole or padding (past
  // a head dim of whole 8-feature chunks).
  const bool dk_pairs = pairs_aligned(p.dk.data, p.dk.sb, p.dk.sh, p.dk.sr);
  const bool dv_pairs = pairs_aligned(p.dv.data, p.dv.sb, p.dv.sh, p.dv.sr);
#pragma unroll
  for (int e = 0; e < size(acc_dk); e += 2) {
    const std::int64_t key = store_key[e / 2 % 2];
    const int f = get<1>(cO(e));
    if (key < 0 || f >= d) continue;
    store_pair(dk + key * p.dk.sr + f, acc_dk(e) * scale, acc_dk(e + 1) * scale, dk_pairs);
    store_pair(dv + key * p.dv.sr + f, acc_dv(e), acc_dv(e + 1), dv_pairs);
  }
}

}  // namespace dmattn::cuda
