// The sm80-class dk/dv kernel of the dense walk (mma.sync through CuTe,
// cp.async): no mask, top-k, softcap, bias with rows or deterministic dq; no
// bias or a key-only one (its dbias per key); dq by float32 atomics. The
// dispatch plans it where those hold at D' = 64 and 128 (dispatch.cu); the
// rest runs backward_kernel (bwd/kernel_sm80.cuh), whose warps each own 16
// keys and their accumulators, a step of 32 queries at D = 128.
//
// Here a CTA owns kBlockN keys of one (batch, kv head) and walks steps of 64
// queries over the G query heads of the group, the three products of a step
// each spread over all 8 warps:
//   S = Q K^T, dP = dO V^T           (queries x keys: 2 x 4 warps)
//   P, dS (P (dP - delta)) to shared memory
//   dV += P^T dO, dK += dS^T Q       (keys x features, from shared memory)
//   dQ  = dS K, added into dq_acc    (queries x features)
// so that a step's fixed costs (its barriers, loads and row statistics) cover
// 64 x kBlockN elements, and no warp holds S and dP next to dK and dV longer
// than the element-wise step. docs/kernels.md "The dense sm80-class dk/dv
// kernel" has the measurements.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdint>

#include "../common/bias.cuh"
#include "../common/geometry.h"
#include "../common/softmax.cuh"
#include "../common/tile_sm80.cuh"
#include "../params.h"
#include "config.cuh"
#include "dkv_shared.cuh"
#include "dq_atomic_sm80.cuh"
#include "preprocess.cuh"

namespace dmattn::cuda {

// acc += A B^T, both operands read from shared memory by the tiled copies
// (ldmatrix, plain or transposed) of the tiled MMA's thread `tid`.
template <class Mma, class Acc, class CopyA, class SA, class CopyB, class SB>
__device__ __forceinline__ void gemm_smem(const Mma& mma, Acc& acc, const CopyA& copy_a, const SA& sA,
                                          const CopyB& copy_b, const SB& sB, int tid) {
  using namespace cute;
  auto thr = mma.get_thread_slice(tid);
  auto ldsm_a = copy_a.get_thread_slice(tid);
  auto ldsm_b = copy_b.get_thread_slice(tid);
  Tensor rA = thr.partition_fragment_A(sA);
  Tensor rB = thr.partition_fragment_B(sB);
  Tensor rAv = ldsm_a.retile_D(rA);
  Tensor rBv = ldsm_b.retile_D(rB);
  gemm_ss(mma, acc, copy_a, ldsm_a.partition_S(sA), rA, rAv, copy_b, ldsm_b.partition_S(sB), rB, rBv);
}

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1) dkv_kernel_sm80(const BackwardParams p) {
  using namespace cute;
  using Element = typename Config::Element;
  constexpr int kBlockN = Config::kBlockN, kBlockM = Config::kBlockM, kHeadDim = Config::kHeadDim;
  constexpr int kBuffers = Config::kBuffers;

  // CTAs in order of work under causal, kv heads fastest (the first key
  // blocks, which see the most queries, start first).
  const int b = blockIdx.z;
  const Sequence seq(p, b);
  const std::int64_t sq = seq.sq, sk = seq.sk, offset = seq.offset();
  const int linear = blockIdx.x + gridDim.x * blockIdx.y;
  const int kvh = linear % gridDim.y;
  const std::int64_t row0 = std::int64_t{linear / gridDim.y} * kBlockN;
  if (row0 >= sk) return;
  const int kcols = static_cast<int>(min(sk - row0, std::int64_t{kBlockN}));  // the CTA's keys inside the sequence
  // The query blocks any of the CTA's keys sees, of each query head of the
  // group (steps: head h_first + t / span, block first + t % span), and those
  // that test no element (covered_query_tiles).
  const QueryRange range = queries_of_keys(p.band, offset, sq, row0, min(row0 + kBlockN, sk) - 1);
  const TileIndices covered = covered_query_tiles(p.band, offset, sq, sk, row0, row0 + kBlockN - 1, kBlockM);
  const int first = range.end > range.first ? static_cast<int>(range.first / kBlockM) : 0;
  const int span = range.end > range.first ? static_cast<int>((range.end + kBlockM - 1) / kBlockM) - first : 0;
  const int h_first = kvh * p.group, total = p.group * span;
  const auto step_head = [&](int t) { return h_first + static_cast<int>(unsigned(t) / unsigned(span)); };
  const auto step_block = [&](int t) { return first + static_cast<int>(unsigned(t) % unsigned(span)); };

  extern __shared__ __align__(128) char smem[];
  auto* elems = reinterpret_cast<Element*>(smem);
  Tensor sK = make_tensor(make_smem_ptr(elems), typename Config::LayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(elems + Config::kKvElems), typename Config::LayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(elems), typename Config::LayoutKt{});
  Tensor sP = make_tensor(make_smem_ptr(elems + Config::kPAt), typename Config::LayoutPds{});
  Tensor sDs = make_tensor(make_smem_ptr(elems + Config::kDsAt), typename Config::LayoutPds{});
  Tensor sPt = make_tensor(make_smem_ptr(elems + Config::kPAt), typename Config::LayoutPdsT{});
  Tensor sDst = make_tensor(make_smem_ptr(elems + Config::kDsAt), typename Config::LayoutPdsT{});
  const auto q_at = [&](int buf) { return elems + Config::kQAt + buf * Config::kQElems; };
  const auto do_at = [&](int buf) { return elems + Config::kDoAt + buf * Config::kQElems; };
  auto* stats = reinterpret_cast<float*>(smem + Config::kStatsAt);  // kBuffers x (max, inv, delta) of 64 queries
  auto* sums = reinterpret_cast<float*>(smem + Config::kSumsAt);  // two rows of kBlockN
  float* key_bias = sums + 2 * kBlockN;

  const int d = p.head_dim, lane = threadIdx.x % 32;
  const auto* q = static_cast<const Element*>(p.q.data) + b * p.q.sb + seq.qs * p.q.sr;
  const auto* dout = static_cast<const Element*>(p.dout.data) + b * p.dout.sb + seq.qs * p.dout.sr;
  const auto* k = static_cast<const Element*>(p.k.data) + b * p.k.sb + kvh * p.k.sh + (seq.ks + row0) * p.k.sr;
  const auto* v = static_cast<const Element*>(p.v.data) + b * p.v.sb + kvh * p.v.sh + (seq.ks + row0) * p.v.sr;
  // Q, dO and the statistics of step t into buffer buf (cp.async groups).
  const auto issue = [&](int t, int buf) {
    const int h = step_head(t);
    const std::int64_t q0 = std::int64_t{step_block(t)} * kBlockM;
    load_rows<Config>(make_tensor(make_smem_ptr(q_at(buf)), typename Config::LayoutQ{}), q + h * p.q.sh + q0 * p.q.sr,
                      p.q.sr, sq - q0, d, p.vector_q);
    load_rows<Config>(make_tensor(make_smem_ptr(do_at(buf)), typename Config::LayoutQ{}),
                      dout + h * p.dout.sh + q0 * p.dout.sr, p.dout.sr, sq - q0, d, p.vector_dout);
    load_row_stats<Config::kThreads>(p, stats + buf * Config::kStatFloats, b, h, q0, kBlockM, sq);
  };
  if (total > 0) {
    load_rows<Config>(sK, k, p.k.sr, kcols, d, p.vector_k);
    load_rows<Config>(sV, v, p.v.sr, kcols, d, p.vector_v);
    issue(0, 0);
  }

  typename Config::MmaSdp mma_sdp;
  typename Config::MmaDkv mma_dkv;
  typename Config::MmaDq mma_dq;
  const auto sdp_a = make_tiled_copy_A(typename Config::LdsmAtom{}, mma_sdp);
  const auto sdp_b = make_tiled_copy_B(typename Config::LdsmAtom{}, mma_sdp);
  const auto dkv_a = make_tiled_copy_A(typename Config::LdsmAtomT{}, mma_dkv);
  const auto dkv_b = make_tiled_copy_B(typename Config::LdsmAtomT{}, mma_dkv);
  const auto dq_a = make_tiled_copy_A(typename Config::LdsmAtom{}, mma_dq);
  const auto dq_b = make_tiled_copy_B(typename Config::LdsmAtomT{}, mma_dq);
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  // The thread's elements of S as (query, key): ((c, half), m, n), the
  // column 2 n + c of its keys (kKeys of them) and the row 2 m + half of its
  // queries (four); cS(tid) of a step's thread index.
  const auto coords_s = [&](int t) {
    return mma_sdp.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  };
  using CoordsS = decltype(coords_s(0));
  constexpr int kM = decltype(size<1>(CoordsS{}))::value, kN = decltype(size<2>(CoordsS{}))::value, kKeys = 2 * kN;
  const auto key_of = [](const CoordsS& cS, int slot) {
    return get<1>(cS(make_coord(make_coord(slot % 2, 0), 0, slot / 2)));
  };
  // A key-only bias of the CTA's keys (of bias head bias_head), and their
  // dbias sums over the steps of a bias head, one row of them for each of the
  // two warps of a column block (each column's sum of a step by one lane),
  // in shared memory.
  const bool has_bias = p.bias.data != nullptr, key_sums = p.bias_grad == BiasGrad::kPerKey;
  int bias_head = -1;
  if (threadIdx.x < kBlockN) key_bias[threadIdx.x] = 0.0f, sums[threadIdx.x] = 0.0f, sums[kBlockN + threadIdx.x] = 0.0f;
  const BiasGradOut<Element> db_out(p, b, kvh, seq);

  const float scale = p.scale;
  int buf = 0;
  for (int t = 0; t < total; ++t) {
    const int h = step_head(t), blk = step_block(t), hb = static_cast<int>(unsigned(h) / unsigned(p.bias_group));
    const std::int64_t q0 = std::int64_t{blk} * kBlockM;
    // The thread's coordinates and ldmatrix addresses, kept across the walk
    // (52 / 100 bytes of spills at D = 128 on sm_90a; read anew each step:
    // 16 / 16 bytes and 14% more instructions in the loop, 3-5% slower).
    const int tid = threadIdx.x;
    const CoordsS cS = coords_s(tid);
    if (has_bias && hb != bias_head) {  // every warp is past its reads of the bias before (step t - 1's P)
      bias_head = hb;
      if (threadIdx.x < kcols) key_bias[threadIdx.x] = BiasReader<Element>(p, b, hb, 0, seq.ks).key(row0 + threadIdx.x);
    }
    cp_async_wait<0>();
    __syncthreads();  // step t landed, its bias staged; every warp is done with step t - 1 (its buffers, P and dS)
    if (kBuffers == 2 && t + 1 < total) issue(t + 1, buf ^ 1);
    Tensor sQ = make_tensor(make_smem_ptr(q_at(buf)), typename Config::LayoutQ{});
    Tensor sDo = make_tensor(make_smem_ptr(do_at(buf)), typename Config::LayoutQ{});
    // S, then P = exp(l - max) inv with l = scale s + bias (-inf outside the
    // band on a tested step), P to shared memory; then dP and dS = P (dP -
    // delta): dP's accumulators are allocated once S's are P.
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    gemm_smem(mma_sdp, acc_s, sdp_a, sQ, sdp_b, sK, tid);
    const float* st = stats + buf * Config::kStatFloats;
    const auto probabilities = [&](auto tested) {
      constexpr bool kTested = decltype(tested)::value;
      [[maybe_unused]] const TileBand band(p.band, offset, q0, row0);
      [[maybe_unused]] const int qrows = clamp_to_tile(sq - q0);
#pragma unroll
      for (int m = 0; m < kM; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int qi = get<0>(cS(make_coord(make_coord(0, half), m, 0)));
          const float mx = st[qi], inv = st[kBlockM + qi];
#pragma unroll
          for (int i = 0; i < kKeys; ++i) {
            const auto at = make_coord(make_coord(i % 2, half), m, i / 2);
            float x = fmaf(acc_s(at), scale, key_bias[key_of(cS, i)]);
            if constexpr (kTested) {
              const int kj = key_of(cS, i);
              if (!(qi < qrows && kj < kcols && kj >= qi + band.lo && kj <= qi + band.hi)) x = -kInf;
            }
            // (x - max) first: x and max near the float32 limit would overflow times log2(e).
            acc_s(at) = exp2_ftz((x - mx) * kLog2e) * inv;
          }
        }
    };
    if (covered.holds(blk))
      probabilities(std::false_type{});
    else
      probabilities(std::true_type{});
    // A tile of the thread's elements to shared memory as Element, adjacent
    // keys of a query as one word.
    const auto to_smem = [&](const auto& acc, auto& dst) {
      using Frag = cutlass::Array<float, decltype(size(acc))::value>;
      const auto elems = cutlass::NumericArrayConverter<Element, float, decltype(size(acc))::value>{}(
          *reinterpret_cast<const Frag*>(raw_pointer_cast(acc.data())));
      const auto* words = reinterpret_cast<const std::uint32_t*>(&elems);
#pragma unroll
      for (int e = 0; e < size(acc); e += 2)
        *reinterpret_cast<std::uint32_t*>(&dst(get<0>(cS(e)), get<1>(cS(e)))) = words[e / 2];
    };
    to_smem(acc_s, sP);
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_dp);
    gemm_smem(mma_sdp, acc_dp, sdp_a, sDo, sdp_b, sV, tid);
    // dS, and with a key dbias the step's sums of the thread's keys over its
    // queries, then over the 8 lanes of a column by a reduce-scatter (each
    // round halves the sums a lane holds, the upper lane of a pair keeping the
    // upper half: 7 shuffles at 8 keys a thread instead of 24), into the
    // warp's row of sums.
    const auto gradients = [&](auto with_sums) {
      constexpr bool kSums = decltype(with_sums)::value;
      [[maybe_unused]] float key_sum[kKeys] = {};
#pragma unroll
      for (int m = 0; m < kM; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float delta = st[2 * kBlockM + get<0>(cS(make_coord(make_coord(0, half), m, 0)))];
#pragma unroll
          for (int i = 0; i < kKeys; ++i) {
            const auto at = make_coord(make_coord(i % 2, half), m, i / 2);
            const float ds = acc_s(at) * (acc_dp(at) - delta);
            acc_dp(at) = ds;
            if constexpr (kSums) key_sum[i] += ds;
          }
        }
      if constexpr (kSums) {
        static_for(
            [&](auto round) {
              constexpr int kBit = 16 >> decltype(round)::value, kHeld = kKeys >> decltype(round)::value;
              if constexpr (kHeld > 1) {
                const bool upper = lane & kBit;
#pragma unroll
                for (int j = 0; j < kHeld / 2; ++j) {
                  const float mine = upper ? key_sum[j + kHeld / 2] : key_sum[j];
                  key_sum[j] = mine + __shfl_xor_sync(0xffffffff, upper ? key_sum[j] : key_sum[j + kHeld / 2], kBit);
                }
              } else {
                key_sum[0] += __shfl_xor_sync(0xffffffff, key_sum[0], kBit);
              }
            },
            std::make_integer_sequence<int, 3>{});
        // The lane's key: slot (lane >> 2) % 8 at 8 keys a thread; at 4, (lane >> 3) % 4, held by two lanes.
        constexpr int kShift = kKeys == 8 ? 2 : 3;
        static_assert(kKeys == 8 || kKeys == 4, "4 or 8 keys a thread");
        if (kKeys == 8 || (lane & 4) == 0)
          sums[get<0>(cS(0)) / 16 % 2 * kBlockN + key_of(cS, (lane >> kShift) % kKeys)] += key_sum[0];
      }
    };
    if (key_sums)
      gradients(std::true_type{});
    else
      gradients(std::false_type{});
    to_smem(acc_dp, sDs);
    __syncthreads();  // P and dS are visible

    gemm_smem(mma_dkv, acc_dv, dkv_a, sPt, dkv_b,
              make_tensor(make_smem_ptr(do_at(buf)), typename Config::LayoutQt{}), tid);
    gemm_smem(mma_dkv, acc_dk, dkv_a, sDst, dkv_b,
              make_tensor(make_smem_ptr(q_at(buf)), typename Config::LayoutQt{}), tid);
    if (kBuffers == 1) {
      __syncthreads();  // every warp is done with Q and dO
      if (t + 1 < total) issue(t + 1, 0);
    }

    // dQ = dS K of the step's queries below the sequence's end, features below d.
    {
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      clear(acc_dq);
      gemm_smem(mma_dq, acc_dq, dq_a, sDs, dq_b, sKt, tid);
      Tensor cQ = mma_dq.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
      float* dq_rows = p.dq_acc + ((std::int64_t{b} * p.heads + h) * p.seqlen_q + q0) * kHeadDim;
      const int qrows = clamp_to_tile(sq - q0);
#pragma unroll
      for (int e = 0; e < size(acc_dq); e += 2) {
        const int qi = get<0>(cQ(e)), f = get<1>(cQ(e));
        if (qi < qrows && f < d) red_add2(dq_rows + qi * kHeadDim + f, acc_dq(e), acc_dq(e + 1));
      }
    }
    // A bias head's key dbias sums are complete (every warp added its step's
    // before the barrier above) when the next step has another; zeroed
    // before the next step's first barrier.
    if (key_sums && (t + 1 == total || static_cast<int>(unsigned(step_head(t + 1)) / unsigned(p.bias_group)) != hb) &&
        threadIdx.x < kcols) {
      db_out.add(p, hb, 0, row0 + threadIdx.x, sums[threadIdx.x] + sums[kBlockN + threadIdx.x]);
      sums[threadIdx.x] = 0.0f, sums[kBlockN + threadIdx.x] = 0.0f;
    }
    if constexpr (kBuffers == 2) buf ^= 1;
  }

  // dK = scale dK, dV of the CTA's keys inside the sequence, features below d.
  Tensor cO = mma_dkv.get_thread_slice(threadIdx.x).partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  const auto store = [&](const auto& acc, const Operand& o, float factor) {
    auto* dst = static_cast<Element*>(o.data) + b * o.sb + kvh * o.sh + (seq.ks + row0) * o.sr;
#pragma unroll
    for (int e = 0; e < size(acc); ++e) {
      const int kj = get<0>(cO(e)), f = get<1>(cO(e));
      if (kj < kcols && f < d) dst[kj * o.sr + f] = static_cast<Element>(acc(e) * factor);
    }
  };
  store(acc_dk, p.dk, scale);
  store(acc_dv, p.dv, 1.0f);
}

}  // namespace dmattn::cuda
