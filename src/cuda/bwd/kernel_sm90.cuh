// The Hopper dk/dv kernel (sm_90a): warpgroup MMAs (wgmma) for the dense walk
// of the common training case and the top-k key groups (intervals), dq by
// bulk reductions (deterministic: in key-block order, on the dense walk),
// batched or varlen. The dispatch plans it where it applies (dispatch.cu
// dkv_sm90_refusal); everything else runs backward_kernel<.., true>
// (bwd/kernel_sm80.cuh). docs/kernels.md "The Hopper dk/dv kernel" tells how
// it works and what each choice measured.
//
// One CTA of two warpgroups owns 128 keys of one (batch, kv head), 64 a
// warpgroup, and walks steps of kBlockM queries (64 at D = 128, 128 at D =
// 64) over the G query heads of the group (above D = 128, Config::kSplitFeatures:
// 64 keys, the warpgroups over a step's queries for S and dP and over the
// features for dK, dV and dQ, P^T and dS^T through shared memory; the dense
// walk only). A step:
//   S^T  = K Q^T,  dP^T = V dO^T     (shared-memory operands)
//   P^T  = exp(scale S^T + bias - max) inv,  dS^T = P^T (dP^T - delta)
//                                    (softcap: its tanh, and its factor in dS^T)
//   dQ   = dS K                      (dS^T through shared memory, after the
//                                     step's one barrier, where one thread issues
//                                     the TMA copies of the next step's Q, dO and
//                                     row statistics into the other buffer), then
//   dV  += P^T dO, dK += dS^T Q      (P^T and dS^T from registers: the
//                                     accumulators' layout is the A operand's)
// and while the dV and dK MMAs run, each warp adds its dQ accumulators to
// dq_acc by one bulk reduction (DqBlocks), or (kOrdered) hands them to the
// dQ-writer warp (dq_ordered_sm90.cuh). The key-only dbias sums dS^T over the
// queries of a bias head in registers, in the walk's order: bitwise
// reproducible, as dk and dv.
//
// The walks (DkvWalk), a kernel each so that the dense one keeps its
// registers: top-k key groups (BackwardParams::group_rows: the 128 keys are a
// group's entries of key_order, each element tested against its key's rows
// within the group's segment, a key's pieces added up in segment order); the
// user's mask (packed by key with the classes of its kBlockM x 128 tiles:
// empty steps skipped, full ones untested, partial ones tested by bit); a bias
// with rows (its elements by global loads; kBiasTiles: a full bias's tile by
// TMA into the step's dS buffer, overwritten with dS in place, dbias tiles
// stored by TMA from there). Varlen: K, V, the key-only bias, dk and dv from
// the sequence's first key; Q and dO by TMA over the packed rows, a step's
// rows past the sequence masked as those past a batched length.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_conversion.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/allowed.cuh"
#include "../common/bias.cuh"
#include "../common/element.cuh"
#include "../common/geometry.h"
#include "../common/sm90.cuh"
#include "../common/softmax.cuh"
#include "../common/tile_sm80.cuh"
#include "../params.h"
#include "config.cuh"
#include "dkv_shared.cuh"
#include "dq_ordered_sm90.cuh"
#include "epilogue_sm90.cuh"

namespace dmattn::cuda {

// The dk/dv kernel's walks, one instantiation each: dense (dq by atomics),
// dense with dq added in key-block order (deterministic), dense with softcap,
// dense with the user's mask (a mask with top-k intervals is folded into the
// key groups), dense with a bias that has rows (its tile loaded a step, dbias
// a tile at a time; kBiasTiles: a full bias whose tiles TMA loads), top-k key
// groups.
enum class DkvWalk { kDense, kOrdered, kSoftcap, kMasked, kRowBias, kBiasTiles, kKeyGroups };

template <class Config, DkvWalk kWalk>
__global__ void __launch_bounds__(Config::threads(kWalk == DkvWalk::kOrdered), 1)
    dkv_kernel_sm90(const __grid_constant__ BackwardParams p, const __grid_constant__ DkvSm90Maps maps) {
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  constexpr bool kKeyGroups = kWalk == DkvWalk::kKeyGroups, kMasked = kWalk == DkvWalk::kMasked;
  constexpr bool kSoftcap = kWalk == DkvWalk::kSoftcap, kOrdered = kWalk == DkvWalk::kOrdered;
  constexpr bool kBiasTiles = kWalk == DkvWalk::kBiasTiles, kRowBias = kWalk == DkvWalk::kRowBias || kBiasTiles;
  using namespace cute;
  using Element = typename Config::Element;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  using cutlass::arch::NamedBarrier;
  constexpr int kBlockN = Config::kBlockN, kBlockM = Config::kBlockM, kHeadDim = Config::kHeadDim;

  // Grid as backward_kernel's dk/dv walk: heads fastest, the longest key blocks
  // (or key groups, in segment order) first.
  const int b = blockIdx.z, blocks = gridDim.x, linear = blockIdx.x + blocks * blockIdx.y;
  const int kvh = linear % gridDim.y, key_block = linear / gridDim.y;
  const Sequence seq(p, b);
  const std::int64_t sq = seq.sq, sk = seq.sk, offset = seq.offset();
  const std::int64_t row0 = std::int64_t{key_block} * kBlockN;
  const std::int64_t kv_slice = std::int64_t{b} * (p.heads / p.group) + kvh;
  std::int64_t entry0 = 0;  // sorted key groups: the group's first entry of key_order
  if (kKeyGroups && p.group_first != nullptr) {
    entry0 = p.group_first[kv_slice * p.key_groups + key_block];
    if (entry0 < 0) return;
  } else if (row0 >= sk) {
    return;
  }
  const bool pieces = kKeyGroups && p.key_segments > 1;
  // The queries of the dense walk of the key block from key k0.
  const auto dense_queries = [&](std::int64_t k0) {
    return queries_of_keys(p.band, offset, sq, k0, min(k0 + kBlockN, sk) - 1);
  };
  // The queries [q_lo, q_hi) of the walk.
  std::int64_t q_lo, q_hi;
  if constexpr (kKeyGroups) {
    const KeyRows rows = p.group_rows[kv_slice * p.key_groups + key_block];
    q_lo = rows.start, q_hi = rows.end;
  } else {
    const QueryRange range = dense_queries(row0);
    q_lo = range.first, q_hi = range.end;
  }
  // Steps: query blocks [first, first + span) of each head of the group in
  // turn; a bias with rows, the heads of the group for each query block in
  // turn (the query heads of a bias head consecutive, so that their dS^T
  // tiles add up to one dbias tile before it is stored); ordered dq, the
  // heads of the group for each query block in turn from the last block
  // down, so that every key block reaches (head, query block) at the same
  // step as the key block before it, whose addition it waits for (ascending,
  // heads outermost, key block n reached it 2 (head + 1) steps earlier than
  // n - 1: the key blocks of a wave waited on each other in a chain).
  const int first = q_hi > q_lo ? static_cast<int>(q_lo / kBlockM) : 0;
  // The query blocks whose steps test no element against the band (covered_query_tiles).
  const TileIndices covered = covered_query_tiles(p.band, offset, sq, sk, row0, row0 + kBlockN - 1, kBlockM);
  const int span = q_hi > q_lo ? static_cast<int>((q_hi + kBlockM - 1) / kBlockM) - first : 0;
  const int h_first = kvh * p.group, total = p.group * span;
  const auto step_head = [&](int s) { return h_first + (kRowBias || kOrdered ? s % p.group : s / span); };
  const auto step_block = [&](int s) {
    return kOrdered ? first + span - 1 - s / p.group : first + (kRowBias ? s / p.group : s % span);
  };
  // The mask (dense walk): step s = (head h_first + s / span, query block
  // first + s % span) is walked unless its tile is empty (the batch strides
  // are 0 where the mask broadcasts over batches).
  const std::uint8_t* classes = kMasked ? p.dkv_tiles.data + b * p.dkv_tiles.sb + key_block : nullptr;
  const std::uint32_t* mask_words = kMasked ? p.dkv_packed.words + b * p.dkv_packed.sb : nullptr;
  struct Step {
    int s;
    bool partial;
  };
  // The walk's step after step s (total: none).
  auto next_step = [&](int s) {
    if constexpr (kMasked) {
      const ClassedTile t = next_classed_tile<1>(s + 1, total, [&](int u) {
        const int mh = (h_first + u / span) / p.mask_group;
        return classes[mh * p.dkv_tiles.sh + std::int64_t{first + u % span} * p.dkv_tiles.sm];
      });
      return Step{t.at, t.partial};
    } else {
      return Step{s + 1, false};
    }
  };
  const int q_blocks = static_cast<int>((p.seqlen_q + kBlockM - 1) / kBlockM);
  // Ordered dq (kOrdered, BackwardParams::dq_turns; the dense walk): the
  // dQ-writer warp adds a step's dQ block after the writer of key block
  // key_block - 1 of this (b, kv head) has added it, where that key block's
  // walk has this query block too. Both ends of a key block's query
  // range grow with its keys, so a query block's key blocks are consecutive
  // (that one is the one before in the block's order of additions) and the
  // walk of key_block - 1 has the query blocks from at most `first` to
  // before_end (its walk's end, computed as that walk computes it; 0: none):
  // every element of dq_acc adds its key blocks' values in key order, bitwise
  // reproducible. The wait cannot deadlock as long as CTAs start in the order
  // of their linear index (what the hardware does, as FlashAttention 3's
  // deterministic backward also assumes): key block key_block - 1 is CTA
  // linear - gridDim.y of the same batch entry, started before this one, and
  // it waits only on CTAs before itself (its MMA warps wait on its writer
  // only for a dQ buffer, which the writer frees without waiting on them).
  const QueryRange before = kOrdered && key_block > 0 ? dense_queries(row0 - kBlockN) : QueryRange{0, 0};
  const int before_end = before.end > before.first ? static_cast<int>((before.end + kBlockM - 1) / kBlockM) : 0;

  extern __shared__ __align__(1024) char smem[];
  auto* k_smem = reinterpret_cast<Element*>(smem);
  Element* v_smem = k_smem + Config::kKvElems;
  Element* q_smem = v_smem + Config::kKvElems;       // two buffers
  Element* do_smem = q_smem + 2 * Config::kQElems;  // two buffers
  Element* ds_smem = do_smem + 2 * Config::kQElems;  // Config::kDsAt, two buffers
  auto* dq_smem = reinterpret_cast<float*>(smem + Config::kDqAt);
  // dQ buffer i (ordered: step t's is t % kDqBuffers; else one).
  constexpr int kDqBuffers = kOrdered ? Config::kOrderedDqBuffers : 1;
  const auto dq_buffer = [&](int i) { return i == 0 ? dq_smem : reinterpret_cast<float*>(smem + Config::kDq2At); };
  auto* stats = reinterpret_cast<float4*>(smem + Config::kStatsAt);      // two buffers of (max, inv, delta, 0)
  auto* own_keys = reinterpret_cast<std::int32_t*>(smem + Config::kKeysAt);
  int* piece_info = own_keys + kBlockN;
  auto* own_rows = reinterpret_cast<KeyRows*>(piece_info + kBlockN);
  auto* loaded = reinterpret_cast<std::uint64_t*>(smem + Config::kBarriersAt);  // a buffer's Q, dO and statistics
  Tensor sK = make_tensor(make_smem_ptr(k_smem), typename Config::LayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(v_smem), typename Config::LayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(k_smem), typename Config::LayoutKt{});
  auto rows_tile = [&](Element* base, int buf) {
    return make_tensor(make_smem_ptr(base + buf * Config::kQElems), typename Config::LayoutQ{});
  };
  auto rows_tile_t = [&](Element* base, int buf) {
    return make_tensor(make_smem_ptr(base + buf * Config::kQElems), typename Config::LayoutQt{});
  };

  const auto* k = static_cast<const Element*>(p.k.data) + b * p.k.sb + kvh * p.k.sh + seq.ks * p.k.sr;
  const auto* v = static_cast<const Element*>(p.v.data) + b * p.v.sb + kvh * p.v.sh + seq.ks * p.v.sr;
  const int d = p.head_dim, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const bool mma_thread = !kOrdered || tid < Config::kThreads;  // ordered: not the writer warpgroup's
  if constexpr (kKeyGroups) {  // the CTA's keys gathered from key_order
    const std::int64_t key = group_key(p, entry0, row0, sk, tile_row<Config, kBlockN>());
    load_tile<Config>(sK, k, p.k.sr, key, d, true);
    load_tile<Config>(sV, v, p.v.sr, key, d, true);
    cp_async_fence();
    if (tid < kBlockN) {
      const std::int64_t key = group_key(p, entry0, row0, sk, tid);
      own_keys[tid] = static_cast<std::int32_t>(key);
      if (pieces) piece_info[tid] = KeyPieces<kHeadDim, kBlockN>::info_of(p, entry0 + tid, kv_slice, key);
    }
  } else if (mma_thread) {
    load_rows<Config>(sK, k + row0 * p.k.sr, p.k.sr, sk - row0, d, true);
    load_rows<Config>(sV, v + row0 * p.v.sr, p.v.sr, sk - row0, d, true);
  }
  const int segment_lo = kKeyGroups ? group_segment_lo(p, entry0) : 0;
  // Statistics of rows past sq are never loaded: finite (zero) until then, so
  // that their masked elements give 0.
  for (int i = tid; i < 2 * kBlockM; i += Config::kThreads) stats[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (tid == 0) {
    Barrier::init(&loaded[0], 1);
    Barrier::init(&loaded[1], 1);
    cutlass::arch::fence_barrier_init();
  }
  // Q, dO and the statistics of the step at head h, query block blk into
  // buffer buf (thread 0): TMA tiles, and one bulk copy of the statistics'
  // rows before sq.
  const int tma_b = p.token_batch(b);
  // kBiasTiles: and the step's bias tile into its dS buffer (which the
  // step's dS then overwrites element by element, kBiasTiles below).
  auto issue = [&](int h, int blk, int buf) {
    const int q0 = blk * kBlockM, rows = static_cast<int>(min(std::int64_t{kBlockM}, sq - q0));
    constexpr int kBiasBytes = kBiasTiles ? Config::kDsElems * int(sizeof(Element)) : 0;
    Barrier::arrive_and_expect_tx(&loaded[buf], Config::kTxBytes + 16 * rows + kBiasBytes);
    tma_load_rows<kBlockM, kHeadDim>(&loaded[buf], static_cast<int>(seq.qs + q0), h, tma_b,
                                     std::pair{&maps.q, q_smem + buf * Config::kQElems},
                                     std::pair{&maps.dout, do_smem + buf * Config::kQElems});
    if constexpr (kBiasTiles)
      tma_bias_tile<kBlockM, kBlockN>(&maps.bias, &loaded[buf], ds_smem + buf * Config::kDsElems,
                                      static_cast<int>(seq.qs + q0), static_cast<int>(seq.ks + row0),
                                      bias_tile_coords(p, h, b));
    SM90_BULK_COPY_G2S::copy(p.query_stats + 4 * ((std::int64_t{b} * p.heads + h) * p.seqlen_q + q0), &loaded[buf],
                             stats + buf * kBlockM, 16 * rows);
  };

  typename Config::MmaSdp mma_sdp;
  typename Config::MmaDkv mma_dkv;
  std::conditional_t<kBiasTiles, typename Config::MmaDqRows, typename Config::MmaDq> mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);
  Tensor tSrV = thr_sdp.partition_fragment_A(sV);
  Tensor tQrK = thr_dq.partition_fragment_B(sKt);
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);
  // The thread's (key, query) of S^T and dS^T: two keys (rows r and r + 8 of
  // its warp's 16), pairs of adjacent queries; dS^T goes to shared memory by
  // 32-bit addresses (a swizzled CuTe pointer computes 64-bit generic ones).
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
  constexpr int kAccS = decltype(size(cS))::value;  // (2 queries, 2 keys, kBlockM / 8 query groups)
  const int my_key[2] = {get<0>(cS(0)), get<0>(cS(2))}, first_query = get<1>(cS(0));
  // kBiasTiles: the thread's elements of the dS buffer (the bias tile as
  // loaded, rows of keys) as transposed 8 x 8 matrices, 8 elements (e = 8 c ..
  // 8 c + 7: query groups 2 c and 2 c + 1, both keys) a chunk c: the address
  // of the lane's row of matrix lane / 8 of chunk 0 (query group lane / 16,
  // keys 8 (lane / 8 % 2) on from the warp's first); chunk c is 16 query rows on.
  const int tile_key = my_key[0] - lane / 4 + 8 * (lane / 8 % 2);
  const unsigned tile_lane = static_cast<unsigned>(tile_key / 64 * (kBlockM * 128)) +
                             sw128_offset(8 * (lane / 16) + lane % 8, tile_key % 64);
  constexpr unsigned kTileChunkBytes = 16 * 128;
  const auto tile_at = [&](int buf, int c) {
    return static_cast<unsigned>(__cvta_generic_to_shared(ds_smem + buf * Config::kDsElems)) + tile_lane +
           c * kTileChunkBytes;
  };
  // The key of the thread's row my_key[half] (-1: none).
  auto thread_key = [&](int half) -> std::int64_t {
    if constexpr (kKeyGroups) return own_keys[my_key[half]];
    return row0 + my_key[half] < sk ? row0 + my_key[half] : -1;
  };

  const bool has_bias = p.bias.data != nullptr, key_sums = p.bias_grad == BiasGrad::kPerKey;
  const BiasGradOut<Element> db_out(p, b, kvh, seq);
  // A bias with rows and its gradient: the dbias tile of the step's (bias
  // head, query block) is open (its sums so far in db_sum) until a step of
  // another one follows; then the thread stores its elements, one value each.
  const bool tile_grads = kRowBias && p.bias_grad == BiasGrad::kPerElement;
  float* db_sum = reinterpret_cast<float*>(smem + Config::kDbSumAt) + tid;
  bool db_open = false;
  float key_bias[2] = {0.0f, 0.0f}, key_sum[2] = {0.0f, 0.0f};
  int key_bias_head = -1, rows_head = -1;  // rows_head: the selection head of own_rows
  const float scale = p.scale, softcap = p.softcap, inner = kSoftcap ? scale / softcap * kTanhArg : 0.0f;
  // The dQ block of head h, query block blk in dq_acc (DqBlocks), and its turn counter.
  const auto dq_block = [&](int h, int blk) {
    return p.dq_acc + ((std::int64_t{b} * p.heads + h) * q_blocks + blk) * Config::kQElems;
  };
  const auto turn = [&](int h, int blk) { return p.dq_turns + (std::int64_t{b} * p.heads + h) * q_blocks + blk; };
  // Ordered: the named barriers (dq_ordered_sm90.cuh), kHandOff's the MMA threads' and the writer warp's.
  constexpr int kStepBarrier = OrderedDqBarriers::kStep, kDqFull = OrderedDqBarriers::kDqFull;
  constexpr int kDqEmpty = OrderedDqBarriers::kDqEmpty, kHandOff = Config::kThreads + 32;

  cp_async_wait<0>();
  fence_async_shared();
  __syncthreads();  // K, V, the zeroed statistics and the barriers
  if constexpr (kOrdered) {
    if (!mma_thread) {
      cutlass::arch::warpgroup_reg_dealloc<Config::kWriterRegs>();
      if (warp > Config::Dq::kWarps) return;
      write_ordered_dq<kDqBuffers, kHandOff, Config::kQElems>(total, key_block, before_end, lane, step_head, step_block,
                                                              dq_block, turn, dq_buffer);
      return;
    }
    cutlass::arch::warpgroup_reg_alloc<Config::kMmaRegs>();
  }
  Step cur = next_step(-1);
  if (tid == 0 && cur.s < total) issue(step_head(cur.s), step_block(cur.s), 0);
  if (kRowBias && p.dbias_zeros)  // under the first step's loads
    zero_dbias_rows(p, b, h_first / p.bias_group, (h_first + p.group - 1) / p.bias_group, row0,
                    static_cast<int>(min(std::int64_t{kBlockN}, sk - row0)), std::int64_t{first} * kBlockM,
                    std::int64_t{first + span} * kBlockM, tid, Config::kThreads);
  // The walk's step t: head h, query block blk; (h_next, blk_next) the next step's.
  for (int t = 0; cur.s < total; ++t) {
    const int h = step_head(cur.s), blk = step_block(cur.s);
    const int buf = t & 1, hb = static_cast<int>(unsigned(h) / unsigned(p.bias_group));
    const std::int64_t q0 = std::int64_t{blk} * kBlockM;
    // A partial step's mask words: the thread's two keys, queries [q0, q0 + kBlockM).
    const bool partial = kMasked && cur.partial;
    constexpr int kWords = kBlockM / 32;
    std::uint32_t key_bits[2][kWords];
    if (partial) {
      const std::uint32_t* words = mask_words + (h / p.mask_group) * p.dkv_packed.sh;
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int w = 0; w < kWords; ++w)
          key_bits[half][w] = words[(row0 + my_key[half]) * p.dkv_packed.so + (q0 / 32 + w) * p.dkv_packed.si];
    }
    if (has_bias && !kRowBias && hb != key_bias_head) {
      key_bias_head = hb;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const std::int64_t key = thread_key(half);
        key_bias[half] =
            key >= 0 ? BiasReader<Element>(p, b, hb, 0, seq.ks).key(key) : 0.0f;
      }
    }
    if (kKeyGroups && h / p.topk_group != rows_head) {  // the rows of the CTA's keys in this selection head
      rows_head = h / p.topk_group;
      if (tid < kBlockN) {
        const int key = own_keys[tid];
        own_rows[tid] = key >= 0 ? segment_key_rows(p, b, rows_head, key, sq, segment_lo) : KeyRows{0, 0};
      }
      __syncthreads();
    }
    Barrier::wait(&loaded[buf], (t >> 1) & 1);

    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor tSrQ = thr_sdp.partition_fragment_B(rows_tile(q_smem, buf));
    Tensor tSrDo = thr_sdp.partition_fragment_B(rows_tile(do_smem, buf));
    wgmma_batch<true>(mma_sdp, tSrK, tSrQ, acc_s);
    wgmma_batch<true>(mma_sdp, tSrV, tSrDo, acc_dp);
    // While they run: the next step.
    const Step next = next_step(cur.s);
    const bool more = next.s < total;
    const int h_next = step_head(next.s), blk_next = step_block(next.s);
    const int qrows = clamp_to_tile(sq - q0), kcols = clamp_to_tile(sk - row0);
    // A bias with rows: the step's tile from here (0 past the sequences).
    const BiasReader<Element> step_bias(p, b, hb, seq.qs + q0, seq.ks + row0);
    const bool db_close = !more || blk_next != blk || unsigned(h_next) / unsigned(p.bias_group) != unsigned(hb);
    // S^T first: P^T is computed under the dP^T MMA (softcap: both, its dS^T
    // needs each element's tanh).
    warpgroup_wait<kSoftcap ? 0 : 1>();
    warpgroup_fence_operand(acc_s);

    // A tile wholly inside the sequences, the causal band and the window tests
    // no element; key groups test each against its key's rows [lo, hi).
    const bool whole = covered.holds(blk);
    int lo[2] = {0, 0}, hi[2] = {0, 0};
    if constexpr (kKeyGroups) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const KeyRows rows = own_rows[my_key[half]];
        lo[half] = clamp_to_tile(rows.start - q0), hi[half] = clamp_to_tile(rows.end - q0);
      }
    }
    const float4* st = stats + buf * kBlockM;
    // P^T and dS^T in place of S^T and dP^T; kTested: each element tested (the
    // code of whole tiles, most of a causal walk, has no test) against the
    // band, or (kBits: the mask and key-group walks, where every tile may be
    // tested) against its key's allowed queries, the band's (or a key group's
    // rows [lo, hi)) and the mask's bits on a partial tile, one word a key and
    // 32 queries (allowed.cuh; query qi's word: e / 16). kSoftcap:
    // l = softcap tanh(scale s / softcap) + bias, and dS^T carries the factor
    // dl / d(scale s) = 1 - tanh^2 (dbias sums dS^T without it). kRowBias:
    // the tile's bias, kChunk elements at a time, each chunk's loads issued
    // together before the arithmetic of the chunk before (a load next to its
    // use, in a loop with branches, left 32 global round trips a step).
    auto gradients = [&](auto tested) {
      constexpr bool kTested = decltype(tested)::value, kBits = kMasked || kKeyGroups;
      [[maybe_unused]] const TileBand band(p.band, offset, q0, row0);  // a tested step's
      constexpr int kChunk = kRowBias ? 8 : kAccS;
      float bias_now[kChunk], bias_next[kChunk];
      const auto load_bias = [&](int c, float(&to)[kChunk]) {
        if constexpr (kBiasTiles) {
          std::uint32_t pairs[4];
          ldsm_x4<true>(tile_at(buf, c), pairs);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const auto two = reinterpret_cast<const cutlass::Array<Element, 2>&>(pairs[i]);
            to[2 * i] = float(two[0]), to[2 * i + 1] = float(two[1]);
          }
        } else if constexpr (kRowBias) {
#pragma unroll
          for (int i = 0; i < kChunk; ++i) {
            const int kj = get<0>(cS(c * kChunk + i)), qi = get<1>(cS(c * kChunk + i));
            to[i] = !kTested || (qi < qrows && kj < kcols) ? step_bias.at(qi, kj) : 0.0f;
          }
        }
      };
      AllowedWords<kWords> allow;
      if constexpr (kTested && kBits) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
          allow.set(half, kKeyGroups ? TileSpan{lo[half], hi[half]} : band.queries_of(my_key[half], qrows, kcols),
                    partial, key_bits[half], first_query);
      }
      load_bias(0, bias_now);
#pragma unroll
      for (int c = 0; c < kAccS / kChunk; ++c) {
        if (c + 1 < kAccS / kChunk) load_bias(c + 1, bias_next);
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
          const int e = c * kChunk + i;
          const int half = e / 2 % 2, kj = get<0>(cS(e)), qi = get<1>(cS(e));
          // The logit rounded as the forward kernels round it (one FFMA; softcap:
          // tanh of s times scale / softcap), so that P is exactly 1 where a
          // row's max is its one key (a top-k window of 1).
          float x;
          [[maybe_unused]] float tanh_x = 0.0f;
          if constexpr (kSoftcap) {
            tanh_x = tanh_ex2(acc_s(e) * inner);
            x = softcap * tanh_x + key_bias[half];
          } else {
            x = acc_s(e) * scale + (kRowBias ? bias_now[i] : key_bias[half]);
          }
          // (The band's test written out: band.allows(...) made ptxas spill 12 B in the dense walk.)
          if (kTested && (kBits ? !allow.allows(e) : !(qi < qrows && kj < kcols && kj >= qi + band.lo && kj <= qi + band.hi)))
            x = -kInf;
          // (x - max) first: x and max near the float32 limit would overflow times log2(e).
          const float4 row = st[qi];
          const float prob = exp2_ftz((x - row.x) * kLog2e) * row.y;
          acc_s(e) = prob;
          if constexpr (kSoftcap) {
            const float ds = prob * (acc_dp(e) - row.z);
            acc_dp(e) = ds * (1.0f - tanh_x * tanh_x);
            if (key_sums) key_sum[half] += ds;
          }
        }
#pragma unroll
        for (int i = 0; i < kChunk; ++i) bias_now[i] = bias_next[i];
      }
      if constexpr (!kSoftcap) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dp);
#pragma unroll
        for (int e = 0; e < kAccS; ++e) {
          const float ds = acc_s(e) * (acc_dp(e) - st[get<1>(cS(e))].z);
          acc_dp(e) = ds;
          if (key_sums) key_sum[e / 2 % 2] += ds;
        }
      }
    };
    if (kKeyGroups || !whole || partial)
      gradients(std::true_type{});
    else
      gradients(std::false_type{});
    // A bias with rows: dS^T (acc_dp) into the open dbias tile, or at its last
    // step, out (the thread's elements inside the sequences). kBiasTiles: the
    // tile goes out by TMA from the step's dS buffer once the dQ MMA has read
    // it (below): dS itself, or the sums, which go to db_sum here first.
    const bool db_store = kBiasTiles && tile_grads && db_close, db_summed = db_store && db_open;
    if (tile_grads) {
      if (!db_close || db_summed) {
        if constexpr (Config::kDbSums) {
#pragma unroll
          for (int e = 0; e < kAccS; ++e)
            db_sum[e * Config::kThreads] = acc_dp(e) + (db_open ? db_sum[e * Config::kThreads] : 0.0f);
        }
      } else if constexpr (!kBiasTiles) {
#pragma unroll
        for (int e = 0; e < kAccS; ++e) {
          const int kj = get<0>(cS(e)), qi = get<1>(cS(e));
          const float sum = acc_dp(e) + (Config::kDbSums && db_open ? db_sum[e * Config::kThreads] : 0.0f);
          if (whole || (qi < qrows && kj < kcols)) db_out.add(p, hb, q0 + qi, row0 + kj, sum);
        }
      }
    }
    if constexpr (kRowBias) db_open = !db_close;

    // P^T and dS^T for the dK / dV MMAs, dS^T (split: and P^T) to shared memory.
    using ARegs = Layout<Shape<Shape<_2, _2, _2>, _1, Int<kAccS / 8>>>;
    Tensor rP = make_tensor<Element>(ARegs{});
    Tensor rDs = make_tensor<Element>(ARegs{});
    stage_p_ds<Config, kBiasTiles>(acc_s, acc_dp, cS, rP, rDs,
                                   smem + Config::kDsAt + buf * Config::kDsElems * int(sizeof(Element)),
                                   smem + Config::kPtAt, [&](int c) { return tile_at(buf, c); });

    // dQ first: its store and reduction then overlap the dK and dV MMAs (split:
    // last, staged in this step's Q and dO buffers; each warp's reduction of
    // the step before has read the buffer the next step's copies fill).
    if (Config::kSplitFeatures && lane == 0) tma_store_wait<0>();
    fence_async_shared();
    // The walk's one barrier a step: both warpgroups' dS^T are in shared
    // memory, and both are done with step t - 1 (Q, dO and statistics buffer
    // buf ^ 1, which the next step's copies then fill, and dS^T buffer buf ^ 1).
    if constexpr (kOrdered)
      NamedBarrier::sync(Config::kThreads, kStepBarrier);
    else
      __syncthreads();
    if (tid == 0 && more) {
      if (kBiasTiles && tile_grads) tma_store_wait<0>();  // a dbias tile stored from buffer buf ^ 1 has been read
      issue(h_next, blk_next, buf ^ 1);
    }
    using LayoutDs = std::conditional_t<kBiasTiles, typename Config::LayoutDsRows, typename Config::LayoutDsT>;
    Tensor tQrDs =
        thr_dq.partition_fragment_A(make_tensor(make_smem_ptr(ds_smem + buf * Config::kDsElems), LayoutDs{}));
    Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    if constexpr (!Config::kSplitFeatures) wgmma_batch<true>(mma_dq, tQrDs, tQrK, acc_dq);
    Tensor tVrDo = thr_dkv.partition_fragment_B(rows_tile_t(do_smem, buf));
    Tensor tKrQ = thr_dkv.partition_fragment_B(rows_tile_t(q_smem, buf));
    if constexpr (Config::kSplitFeatures) {  // P^T and dS^T from shared memory, then dQ
      using LayoutPs = typename Config::LayoutDs;
      auto* pt_smem = reinterpret_cast<Element*>(smem + Config::kPtAt);
      Tensor tVrP = thr_dkv.partition_fragment_A(make_tensor(make_smem_ptr(pt_smem), LayoutPs{}));
      Tensor tKrDs =
          thr_dkv.partition_fragment_A(make_tensor(make_smem_ptr(ds_smem + buf * Config::kDsElems), LayoutPs{}));
      wgmma_batch<false>(mma_dkv, tVrP, tVrDo, acc_dv);
      wgmma_batch<false>(mma_dkv, tKrDs, tKrQ, acc_dk);
      wgmma_batch<true>(mma_dq, tQrDs, tQrK, acc_dq);
      warpgroup_wait<0>();
      __syncthreads();  // both warpgroups' dK and dV MMAs have read Q and dO
    } else {
      warpgroup_fence_operand(rP);
      warpgroup_fence_operand(rDs);
      wgmma_batch<false>(mma_dkv, rP, tVrDo, acc_dv);
      wgmma_batch<false>(mma_dkv, rDs, tKrQ, acc_dk);
      warpgroup_wait<2>();
    }
    warpgroup_fence_operand(acc_dq);

    // The warp's part of the DqBlocks block: registers in order, then one bulk
    // reduction into dq_acc by lane 0 (ordered: handed to the writer warp,
    // once its reduction of the buffer's step before has read it).
    constexpr int kWarpFloats = Config::Dq::kWarpFloats;
    const int dq_buf = t % kDqBuffers;
    float* dq_warp = Config::kSplitFeatures ? Config::dq_stage(q_smem, do_smem, buf, warp)
                                            : dq_buffer(dq_buf) + warp * kWarpFloats;
    static_assert(decltype(size(acc_dq))::value * 32 == kWarpFloats, "a thread's dQ is words of 4 floats");
    if constexpr (kOrdered) {
      if (t >= kDqBuffers) NamedBarrier::sync(kHandOff, kDqEmpty + dq_buf);
    } else if constexpr (!Config::kSplitFeatures) {
      if (lane == 0) tma_store_wait<0>();  // the previous step's reduction has read the buffer
      __syncwarp();
    }
#pragma unroll
    for (int j = 0; j < kWarpFloats / 128; ++j)
      *reinterpret_cast<float4*>(dq_warp + 128 * j + 4 * lane) =
          make_float4(acc_dq(4 * j), acc_dq(4 * j + 1), acc_dq(4 * j + 2), acc_dq(4 * j + 3));
    fence_async_shared();
    if constexpr (kOrdered) {
      NamedBarrier::arrive(kHandOff, kDqFull + dq_buf);
    } else {
      __syncwarp();
      if (lane == 0) {
        bulk_reduce_add(dq_block(h, blk) + warp * kWarpFloats, dq_warp, kWarpFloats * int(sizeof(float)));
        tma_store_arrive();
      }
    }
    if constexpr (!Config::kSplitFeatures) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(rP);
      warpgroup_fence_operand(rDs);
    }
    if (db_store)  // the dbias tile out of dS buffer buf (db_close is the CTA's)
      store_dbias_tile<Config, kAccS>(
          db_summed, db_sum, [&](int c) { return tile_at(buf, c); }, &maps.dbias, ds_smem + buf * Config::kDsElems,
          static_cast<int>(seq.qs + q0), static_cast<int>(seq.ks + row0), make_int2(hb, b), tid);

    // Key-only dbias: a bias head's sums are complete when the next step has
    // another (pieces of keys: in the epilogue, one bias head).
    if (key_sums && !pieces && (!more || unsigned(h_next) / unsigned(p.bias_group) != unsigned(hb)))
      store_key_dbias<Config>(p, db_out, hb, key_sum, my_key, thread_key, reinterpret_cast<float*>(smem + Config::kKeysAt),
                              tid, lane);
    cur = next;
  }
  if (lane == 0) tma_store_wait<0>();

  // dk = scale * acc_dk, dv = acc_dv by key, the pieces of a key added up first.
  if (kKeyGroups) __syncthreads();  // own_keys, where the walk had no step
  store_dkv<Config>(p, b, kvh, seq, acc_dk, acc_dv, thr_dkv, my_key, thread_key, own_keys, piece_info, pieces, key_sums,
                    key_sum, db_out, h_first, lane, d, scale);
#endif
}

}  // namespace dmattn::cuda
