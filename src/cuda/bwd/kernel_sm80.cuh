// The sm80-class backward (mma.sync through CuTe, cp.async loads). dk, dv and
// dbias without atomic arithmetic: every output element is written by one CTA
// (the pieces of a top-k key add their float32 sums in segment order), so they
// are bitwise reproducible; so is dq with Problem::deterministic. Without it
// the dk/dv kernel also adds dQ = dS^T K of each step into float32 scratch by
// atomics (dq_atomic_sm80.cuh), and the dq kernel only recomputes the row
// statistics of rows whose |lse| float32 cannot hold (a bias of -1e30).
//   backward_kernel<Config>, Config::kKeyRows false (dq): one CTA owns 128
//     query rows of one (batch, head) (64 with the feature split) and walks
//     their key blocks, or with a mask or top-k the block's key list.
//   backward_kernel<Config>, Config::kKeyRows true (dk, dv, dbias): one CTA owns
//     128 keys (64 with the feature split) of one (batch, kv head) and walks
//     the query blocks of the G query heads of the group; dbias is reduced in
//     the CTA in its fixed loop order, across CTAs through float32 slices.
//     Top-k intervals: the keys are a group of pieces of keys (selection.h
//     KeyGroups), each element tested against its key's interval; thresholds:
//     the dense walk with the threshold test.
// Each warp owns 16 rows (its accumulators); the columns stream through
// double-buffered shared memory (BackwardConfig: a large tile and one that
// fits sm_86's shared memory; with a split two warps share a row block: the
// features, or in the small dk/dv tile the step's columns), and
//   S  = A0 B0^T, dP = A1 B1^T          (dq: Q K^T, dO V^T;  dk/dv: K Q^T, V dO^T)
//   acc_a += dS B0, acc_b += P B1        (dq: dQ += dS K;     dk/dv: dK += dS^T Q, dV += P^T dO)
// with P and dS going from the accumulators to the next MMA in registers. The
// passes around them: bwd/preprocess.cuh, bwd/postprocess.cuh, bwd/finish.h;
// the Hopper dk/dv kernel: bwd/kernel_sm90.cuh.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/bias.cuh"
#include "../common/element.cuh"
#include "../common/geometry.h"
#include "../common/softmax.cuh"
#include "../common/tile_sm80.cuh"
#include "../params.h"
#include "config.cuh"
#include "dkv_shared.cuh"
#include "dq_atomic_sm80.cuh"
#include "epilogue_sm80.cuh"
#include "preprocess.cuh"
#include "terms_sm80.cuh"

namespace dmattn::cuda {

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1) backward_kernel(const BackwardParams p) {
  using namespace cute;
  using Element = typename Config::Element;
  constexpr bool kKeyRows = Config::kKeyRows;
  constexpr int kBlockRows = Config::kBlockRows, kHeadDim = Config::kHeadDim, kStep = Config::kStep;
  using SmemLayoutCols = typename Config::SmemLayoutCols;
  using SmemLayoutColsT = typename Config::SmemLayoutColsT;

  const int b = blockIdx.z;
  const Sequence seq(p, b);
  const std::int64_t sq = seq.sq, sk = seq.sk, offset = seq.offset();
  // CTAs start in order of work under causal, heads fastest, so that the longest
  // ones (dk/dv: the first key blocks, which see the most queries; dq: the last
  // query blocks, which see the most keys; dk/dv key groups: the last groups,
  // whose keys' rows end last and span the most) start first for every head.
  // Sorted key groups come in segment order (a key's pieces wait for the
  // earlier ones), each segment's widest first (selection.h group_keys).
  const int blocks = gridDim.x, linear = blockIdx.x + blocks * blockIdx.y;
  const int head = linear % gridDim.y, order = linear / gridDim.y;
  const bool key_groups = kKeyRows && p.group_rows != nullptr;
  const int row_block = kKeyRows ? order : blocks - 1 - order;
  const std::int64_t row0 = std::int64_t{row_block} * kBlockRows, own_len = kKeyRows ? sk : sq;
  // The column blocks (steps) that test no element against the band: dk/dv's
  // query blocks, dq's key blocks (covered_tiles).
  const TileIndices covered =
      kKeyRows ? covered_query_tiles(p.band, offset, sq, sk, row0, row0 + kBlockRows - 1, kStep)
               : covered_tiles(p.band, offset, sk, row0, row0 + kBlockRows - 1, kStep);
  const int kv_heads = p.heads / p.group;
  const std::int64_t kv_slice = std::int64_t{b} * kv_heads + (kKeyRows ? head : head / p.group);
  // Sorted key groups: the group's first entry of key_order (its segment's
  // first row goes to shared memory with the entries' keys: few registers
  // stay live across the walk).
  std::int64_t entry0 = 0;
  if (key_groups && p.group_first != nullptr) {
    entry0 = p.group_first[kv_slice * p.key_groups + row_block / Config::kGroupBlocks];
    if (entry0 < 0) return;
    if constexpr (Config::kGroupBlocks > 1) {  // this CTA's share of the group's entries: none past its pieces
      const int share = row_block % Config::kGroupBlocks * kBlockRows;
      if (entry0 % p.segment_entries + share >= p.segment_entries || p.key_order[entry0 + share] < 0) return;
      entry0 += share;
    }
  } else if (row0 >= own_len) {
    return;
  }
  const bool pieces = key_groups && p.key_segments > 1;
  if (!kKeyRows && p.huge_rows != nullptr && *p.huge_rows == 0) return;  // dq by atomics: no row to recompute
  const std::int64_t row_last = min(row0 + kBlockRows, own_len) - 1;
  const int kvh = kKeyRows ? head : head / p.group;
  const int h_first = kKeyRows ? kvh * p.group : head;
  const int n_heads = kKeyRows ? p.group : 1;

  // Walks. dq with a mask or top-k: the block's key list (KeyLists), its allowed
  // pairs from the list bits. dk/dv with top-k intervals: the keys of a group
  // (key_order) over the group's query rows, each element tested against its
  // key's interval; with top-k thresholds: the dense walk, each element tested
  // against its row's threshold.
  const bool lists = !kKeyRows && p.mask_keys != nullptr;
  const bool thresholds = kKeyRows && p.topk_thresholds != nullptr;
  std::int64_t list_block = 0;
  int list_count = 0;
  if (lists) {
    list_block = ((p.list_batched ? b : 0) * std::int64_t{p.heads / p.list_group} + head / p.list_group) * p.mask_blocks +
                 row_block;
    list_count = p.mask_counts[list_block];
  }
  const std::int32_t* list_keys = lists ? p.mask_keys + list_block * p.keys_stride : nullptr;

  // The column blocks any row of the CTA may use: [first, end) for each head.
  std::int64_t col_lo = 0, col_hi = kKeyRows ? sq : sk;
  if (lists) {
    col_hi = list_count;
  } else if (key_groups) {
    const KeyRows rows = p.group_rows[kv_slice * p.key_groups + row_block / Config::kGroupBlocks];
    col_lo = rows.start, col_hi = rows.end;
  } else if constexpr (kKeyRows) {  // query i sees key j iff i + offset - left <= j <= i + offset (+ right)
    const QueryRange range = queries_of_keys(p.band, offset, sq, row0, row_last);
    col_lo = range.first, col_hi = range.end;
  } else {  // keys_of_queries written out (the call compiles to other SASS here)
    if (p.band.left >= 0) col_lo = max(col_lo, row0 + offset - p.band.left);
    if (p.band.causal) col_hi = min(col_hi, row_last + offset + 1);
    if (p.band.right >= 0) col_hi = min(col_hi, row_last + offset + p.band.right + 1);
  }
  const int first = col_hi > col_lo ? static_cast<int>(col_lo / kStep) : 0;
  const int span = col_hi > col_lo ? static_cast<int>((col_hi + kStep - 1) / kStep) - first : 0;
  const int total = n_heads * span;  // steps: head h_first + t / span, column block first + t % span
  // Unsigned division (t >= 0, span > 0): half the instructions of the signed one, three times a step.
  const auto step_head = [&](int t) { return h_first + static_cast<int>(unsigned(t) / unsigned(span)); };
  const auto step_block = [&](int t) { return first + static_cast<int>(unsigned(t) % unsigned(span)); };

  const bool has_bias = p.bias.data != nullptr;
  const MaskTiles& tiles = p.dkv_tiles;
  const bool has_tiles = kKeyRows && tiles.data != nullptr;
  auto tile_class = [&](int t) -> int {
    const int h = step_head(t), blk = step_block(t);
    const std::int64_t qb = kKeyRows ? blk : row_block, kb = kKeyRows ? row_block : blk;
    return tiles.data[b * tiles.sb + (h / p.mask_group) * tiles.sh + qb * tiles.sm + kb];
  };
  auto next = [&](int t) {
    ++t;
    while (has_tiles && t < total && tile_class(t) == kTileEmpty) ++t;
    return t;
  };

  const int d = p.head_dim, tid = threadIdx.x;
  // Feature or column split (Config::kSplit): the thread's MMA slice; with the
  // feature split its share of the accumulators' features from `feature0` and
  // whether it writes the dS terms that both warps of a row block hold
  // (stager); with the column split its share of a step's columns from
  // `column0` and whether it holds the sums of both warps' accumulators and
  // row sums at the end (holder).
  const int mma_tid = Config::kSplit == 1 ? tid : tid % Config::kMmaThreads;
  const int part = Config::kSplit == 1 ? 0 : tid / Config::kMmaThreads;
  const int feature_part = Config::kFeatureSplit == 1 ? 0 : part;
  const int feature0 = feature_part * Config::kAccDim;
  const int column_part = Config::kColumnSplit ? part : 0, column0 = column_part * Config::kWarpStep;
  const bool stager = feature_part == 0, holder = column_part == 0;
  extern __shared__ __align__(128) char smem[];
  auto* rows_smem = reinterpret_cast<Element*>(smem);
  Element* cols_smem = rows_smem + 2 * Config::kRowElems;
  auto* stats = reinterpret_cast<float*>(cols_smem + 4 * Config::kColElems);
  float* tile_add = stats + Config::kStatFloats;           // the staged bias / allowed term, then dS
  float* key_add = tile_add + kBlockRows * Config::kAddLd;  // a key-only bias of the step's keys
  float* part_sums = key_add + kBlockRows;                   // column split: the second warp's key dbias sums
  auto* row_bits = reinterpret_cast<std::uint64_t*>(smem + Config::kSmemBytes - kBlockRows * 16);  // dq
  auto* own_keys = reinterpret_cast<std::int32_t*>(row_bits);                                      // dk/dv
  auto* own_rows = reinterpret_cast<KeyRows*>(own_keys + kBlockRows);                             // dk/dv
  auto* piece_info = reinterpret_cast<int*>(key_add);  // dk/dv with pieces: a row's rank and last flag
  __shared__ int segment_lo;  // dk/dv key groups: the segment's first row (in a register, the walk spills)
  static_assert(!kKeyRows || kKeySegmentRows % kStep == 0, "a dk/dv query tile lies in one row segment");
  constexpr int kAddLd = Config::kAddLd, kKeepDsAt = Config::kKeepDsAt;  // dk/dv: the dS tile kept for dbias
  Tensor sA0 = make_tensor(make_smem_ptr(rows_smem), typename Config::SmemLayoutRows{});
  Tensor sA1 = make_tensor(make_smem_ptr(rows_smem + Config::kRowElems), typename Config::SmemLayoutRows{});
  auto col_tile = [&](int buf, int which) {
    return make_tensor(make_smem_ptr(cols_smem + (2 * buf + which) * Config::kColElems), SmemLayoutCols{});
  };
  auto warp_cols = [&](int buf, int which) {  // the thread's columns (Config::kColumnSplit)
    return make_tensor(make_smem_ptr(cols_smem + (2 * buf + which) * Config::kColElems + column0 * Config::kSmemRow),
                       typename Config::SmemLayoutWarpCols{});
  };
  auto col_tile_t = [&](int buf, int which) {  // the thread's features and columns
    return make_tensor(make_smem_ptr(cols_smem + (2 * buf + which) * Config::kColElems + feature_part * kStep * Config::kAccDim +
                                     column0 * Config::kSmemRow),
                       SmemLayoutColsT{});
  };

  const auto* q = static_cast<const Element*>(p.q.data) + b * p.q.sb + seq.qs * p.q.sr;
  const auto* dout = static_cast<const Element*>(p.dout.data) + b * p.dout.sb + seq.qs * p.dout.sr;
  const auto* k = static_cast<const Element*>(p.k.data) + b * p.k.sb + kvh * p.k.sh + seq.ks * p.k.sr;
  const auto* v = static_cast<const Element*>(p.v.data) + b * p.v.sb + kvh * p.v.sh + seq.ks * p.v.sr;
  // A key-only bias: dk/dv keep the values of the thread's keys (of bias head
  // key_bias_head); dq loads the next step's keys with its tiles (key_bias_next,
  // one key a thread) and stages them in key_add.
  float key_bias_rows[2];  // the two rows of the thread in its warp's 16 (kM = 1)
  int key_bias_head = -1;
  int rows_head = -1;  // the selection head of own_rows (dk/dv, key groups)
  float key_bias_now = 0.0f, key_bias_next = 0.0f;
  const bool key_only_bias = p.key_only_bias();
  // dq by atomics: the dk/dv kernel adds dS^T K of each step into dq_acc; the dq
  // kernel only recomputes the row statistics where they need it.
  constexpr bool kDqAtomic = kKeyRows && Config::kAtomicDq;  // the code is there; dq_acc turns it on
  const bool dq_atomic = kDqAtomic && p.dq_acc != nullptr;
  const bool dq_stats = !kKeyRows && p.dq_acc != nullptr;
  // dS^T of a step goes to buffer (step's buf) of ds_t; its product runs after
  // the next barrier of the walk (dq_pending: that step, or -1; its rows are
  // recomputed from it, fewer registers live across the step). A warp's
  // share of the product needs no other warp, so warps 0..3 run it at the
  // start of step t + 1 and warps 4..7 at its end (step t + 2 rewrites the
  // buffer only after its opening barrier). Warps w and w + 4 share a
  // scheduler: the product's dependent MMA chains then overlap the other
  // warp's S/dP or dK/dV products instead of the same chains.
  auto* ds_t = reinterpret_cast<Element*>(tile_add) + Config::kDsAt;
  int dq_pending = -1;
  const bool dq_early = tid < Config::kThreads / 2;
  auto flush_dq = [&](int t, int from) {
    if constexpr (kDqAtomic) {
      if (t < 0) return;
      const std::int64_t q0 = std::int64_t{step_block(t)} * kStep;
      add_dq_step<Config>(ds_t + from * kStep, rows_smem,
                          p.dq_acc + ((std::int64_t{b} * p.heads + step_head(t)) * p.seqlen_q + q0) * kHeadDim,
                          clamp_to_tile(sq - q0), d);
    }
  };

  auto load_stats = [&](float* dst, int h, std::int64_t i0, int n) {
    load_row_stats<Config::kThreads>(p, dst, b, h, i0, n, sq);
  };
  // The column tiles (and for dk/dv the statistics) of step t into buffer buf.
  auto issue = [&](int t, int buf, bool second) {
    const int h = step_head(t);
    const std::int64_t c0 = std::int64_t{step_block(t)} * kStep;
    Tensor d0 = col_tile(buf, 0), d1 = col_tile(buf, 1);
    if constexpr (kKeyRows) {
      load_rows<Config>(d0, q + h * p.q.sh + c0 * p.q.sr, p.q.sr, sq - c0, d, p.vector_q);
      load_rows<Config>(d1, dout + h * p.dout.sh + c0 * p.dout.sr, p.dout.sr, sq - c0, d, p.vector_dout);
      load_stats(stats + buf * 3 * kStep, h, c0, kStep);
    } else {
      if (lists) {  // K and V rows gathered by key, the rows' bits of the tile
        const std::int64_t at = c0 + tile_row<Config, kStep>();
        const std::int64_t key = at < list_count ? list_keys[at] : -1;
        load_tile<Config>(d0, k, p.k.sr, key, d, p.vector_k);
        if (second) load_tile<Config>(d1, v, p.v.sr, key, d, p.vector_v);
        if (tid < kBlockRows) {
          std::uint64_t* dst = row_bits + buf * kBlockRows + tid;
          if (row0 + tid < sq) {
            const std::uint32_t* src = p.mask_bits + (list_block / p.mask_blocks * p.seqlen_q + row0 + tid) * p.bits_sr + c0 / 32;
            const auto smem_dst = static_cast<unsigned>(__cvta_generic_to_shared(dst));
            // The tile's bits: 8 bytes at 64 columns, 4 at 32 (an odd word
            // from every other step; the upper half, past the tile, unread).
            asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_dst), "l"(src), "n"(kStep / 8));
          } else {
            *dst = 0;
          }
        }
        cp_async_fence();
      } else {
        load_rows<Config>(d0, k + c0 * p.k.sr, p.k.sr, sk - c0, d, p.vector_k);
        if (second) load_rows<Config>(d1, v + c0 * p.v.sr, p.v.sr, sk - c0, d, p.vector_v);
      }
      if (key_only_bias && tid < kStep) {
        const std::int64_t key = lists ? (c0 + tid < list_count ? list_keys[c0 + tid] : -1) : (c0 + tid < sk ? c0 + tid : -1);
        if (key >= 0)
          key_bias_next = BiasReader<Element>(p, b, h / p.bias_group, 0, seq.ks).key(key);
      }
    }
  };
  {
    Tensor d0 = sA0, d1 = sA1;
    if constexpr (kKeyRows) {  // the CTA's keys: row0 on, or gathered from key_order
      const std::int64_t key = group_key(p, entry0, row0, sk, tile_row<Config, kBlockRows>());
      load_tile<Config>(d0, k, p.k.sr, key, d, p.vector_k);
      load_tile<Config>(d1, v, p.v.sr, key, d, p.vector_v);
      cp_async_fence();
      if (tid < kBlockRows) {
        const std::int64_t key = group_key(p, entry0, row0, sk, tid);
        own_keys[tid] = static_cast<std::int32_t>(key);
        if (pieces) piece_info[tid] = KeyPieces<kHeadDim, kBlockRows>::info_of(p, entry0 + tid, kv_slice, key);
      }
      if (tid == 0) segment_lo = group_segment_lo(p, entry0);
    } else {
      const int h = h_first;
      load_rows<Config>(d0, q + h * p.q.sh + row0 * p.q.sr, p.q.sr, sq - row0, d, p.vector_q);
      if (!dq_stats)
        load_rows<Config>(d1, dout + h * p.dout.sh + row0 * p.dout.sr, p.dout.sr, sq - row0, d, p.vector_dout);
      load_stats(stats, h, row0, kBlockRows);
    }
  }

  typename Config::TiledMma mma;
  auto thr = mma.get_thread_slice(mma_tid);
  auto copy_a = make_tiled_copy_A(typename Config::LdsmAtom{}, mma);
  auto copy_b = make_tiled_copy_B(typename Config::LdsmAtom{}, mma);
  auto copy_bt = make_tiled_copy_B(typename Config::LdsmAtomT{}, mma);
  auto ldsm_a = copy_a.get_thread_slice(mma_tid);
  auto ldsm_b = copy_b.get_thread_slice(mma_tid);
  auto ldsm_bt = copy_bt.get_thread_slice(mma_tid);
  constexpr int kAccDim = Config::kAccDim;
  Tensor rA = thr.partition_fragment_A(sA0);                              // (MMA, MMA_M, MMA_K = D / 16)
  Tensor rB = thr.partition_fragment_B(warp_cols(0, 0));                  // (MMA, MMA_N, MMA_K = D / 16)
  Tensor rBt = thr.partition_fragment_B(col_tile_t(0, 0));  // (MMA, MMA_D, MMA_K = kWarpStep / 16)
  Tensor rA1 = thr.partition_fragment_A(sA1);                             // dP's operands (S and dP in one k-loop)
  Tensor rB1 = thr.partition_fragment_B(warp_cols(0, 1));
  Tensor rAv = ldsm_a.retile_D(rA), rA1v = ldsm_a.retile_D(rA1);
  Tensor rBv = ldsm_b.retile_D(rB), rB1v = ldsm_b.retile_D(rB1);
  Tensor rBtv = ldsm_bt.retile_D(rBt);
  Tensor sA0p = ldsm_a.partition_S(sA0), sA1p = ldsm_a.partition_S(sA1);

  Tensor acc_a = partition_fragment_C(mma, Shape<Int<kBlockRows>, Int<kAccDim>>{});  // dQ or dK
  Tensor acc_b = partition_fragment_C(mma, Shape<Int<kBlockRows>, Int<kAccDim>>{});  // dV
  clear(acc_a);
  if constexpr (kKeyRows) clear(acc_b);
  // The thread's elements of S as (row, column of its warp's, from column0).
  Tensor cS = thr.partition_C(make_identity_tensor(Shape<Int<kBlockRows>, Int<Config::kWarpStep>>{}));
  constexpr int kM = decltype(size<1>(cS))::value, kN = decltype(size<2>(cS))::value;
  static_assert(kM == 1, "a warp owns 16 rows");
  const float scale = p.scale, softcap = p.softcap, tanh_arg = softcap > 0.0f ? kTanhArg / softcap : 0.0f;
  const int lane = tid % 32;

  // dbias state (dk/dv only): key-only sums of the thread's rows, and the slice of this CTA.
  float key_sum[2 * kM];
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) key_sum[r] = 0.0f;
  const BiasGradOut<Element> db_out(p, b, kvh, seq);
  // Key-only dbias of bias head hb: the quad-reduced sums x of the thread's two
  // rows (those of bit `half` of rows).
  auto store_key_sums = [&](int hb, const float* x, unsigned rows) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = own_keys[get<0>(cS(make_coord(make_coord(0, half), 0, 0)))];
      if (lane % 4 != 0 || key < 0 || !stager || !holder || !((rows >> half) & 1)) continue;
      db_out.add(p, hb, 0, key, x[half]);
    }
  };
  // Column split: the second warp's quad-reduced key sums x of the thread's two
  // rows added into the first's (a barrier of the whole CTA; the slots are
  // written again only after the walk's next one).
  auto add_key_sum_parts = [&](float* x) {
    if constexpr (Config::kColumnSplit) {
#pragma unroll
      for (int half = 0; half < 2; ++half)
        if (!holder && lane % 4 == 0) part_sums[get<0>(cS(make_coord(make_coord(0, half), 0, 0)))] = x[half];
      __syncthreads();
#pragma unroll
      for (int half = 0; half < 2; ++half)
        if (holder) x[half] += part_sums[get<0>(cS(make_coord(make_coord(0, half), 0, 0)))];
    }
  };

  // Online row max and sum of the dq rows (the statistics pass).
  float run_max[2 * kM], run_sum[2 * kM];
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) run_max[r] = -kInf, run_sum[r] = 0.0f;

  // One step: the S (and dP) tile of head h against column block blk.
  auto compute = [&](int t, int buf, bool stats_only) {
    const int h = step_head(t), blk = step_block(t), hb = static_cast<int>(unsigned(h) / unsigned(p.bias_group));
    const std::int64_t q0 = kKeyRows ? std::int64_t{blk} * kStep : row0;
    // A list step's columns are the list's entries [c0, c0 + kStep), keys from 0.
    const std::int64_t c0 = std::int64_t{blk} * kStep, k0 = kKeyRows ? row0 : (lists ? 0 : c0);
    constexpr int kQ = kKeyRows ? kStep : kBlockRows, kK = kKeyRows ? kBlockRows : kStep;
    const float* st = kKeyRows ? stats + buf * 3 * kStep : stats;  // max, inv, delta of the tile's queries
    if (key_groups && h / p.topk_group != rows_head) {  // the intervals of the CTA's keys for this head
      rows_head = h / p.topk_group;
      if (tid < kBlockRows) {
        const int key = own_keys[tid];
        own_rows[tid] = key >= 0 ? segment_key_rows(p, b, rows_head, key, sq, segment_lo) : KeyRows{0, 0};
      }
      __syncthreads();
    }

    // The allowed set and the bias, staged in shared memory as one additive term
    // per tile element (bias or -inf): a tile wholly inside the sequences, the
    // causal band, the window and a full mask tile needs none unless its bias
    // varies along the queries; a key-only bias then takes one value per key.
    // Lists and key groups fold all of it into their per-element test, which
    // thresholds stage.
    const bool mask_full = !has_tiles || tile_class(t) == kTileFull;
    const bool whole = lists || key_groups || (!thresholds && mask_full && covered.holds(blk));
    // (has_bias && !key_only_bias, written out: the SASS stays the hand-tuned one.)
    const bool staged = !whole || (has_bias && p.bias.sr != 0) ||
                        (kKeyRows && !stats_only && p.bias_grad == BiasGrad::kPerElement);
    const bool key_bias = !staged && has_bias;
    const BiasReader<Element> bias_in(p, b, hb, seq.qs + q0, seq.ks);
    if (staged) {
      stage_tile_terms<Config>(p, seq, b, h, q0, k0, c0, offset, mask_full, lists, list_keys, list_count,
                               has_bias, thresholds, bias_in, tile_add, tid);
    } else if (key_bias) {
      if constexpr (kKeyRows) {  // the CTA's keys: read again only when the bias head changes
        if (hb != key_bias_head) {
          key_bias_head = hb;
#pragma unroll
          for (int m = 0; m < kM; ++m)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int key = own_keys[get<0>(cS(make_coord(make_coord(0, half), m, 0)))];
              key_bias_rows[2 * m + half] =
                  key >= 0 ? bias_in.key(key) : 0.0f;
            }
        }
      } else if (tid < kK) {
        key_add[tid] = key_bias_now;  // loaded with the step's tiles
      }
    }

    Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockRows>, Int<Config::kWarpStep>>{});
    Tensor acc_dp = partition_fragment_C(mma, Shape<Int<kBlockRows>, Int<Config::kWarpStep>>{});
    clear(acc_s);
    if (stats_only || !Config::kPairedSdp) {
      gemm_ss(mma, acc_s, copy_a, sA0p, rA, rAv, copy_b, ldsm_b.partition_S(warp_cols(buf, 0)), rB, rBv);
      if (!stats_only) {
        clear(acc_dp);
        gemm_ss(mma, acc_dp, copy_a, sA1p, rA, rAv, copy_b, ldsm_b.partition_S(warp_cols(buf, 1)), rB, rBv);
      }
    } else {  // S and dP in one k-loop: two independent MMA chains between a k-slice's ldmatrix and its use
      clear(acc_dp);
      Tensor sB0 = ldsm_b.partition_S(warp_cols(buf, 0)), sB1 = ldsm_b.partition_S(warp_cols(buf, 1));
#pragma unroll
      for (int kk = 0; kk < size<2>(rA); ++kk) {
        copy(copy_a, sA0p(_, _, kk), rAv(_, _, kk));
        copy(copy_b, sB0(_, _, kk), rBv(_, _, kk));
        copy(copy_a, sA1p(_, _, kk), rA1v(_, _, kk));
        copy(copy_b, sB1(_, _, kk), rB1v(_, _, kk));
        gemm(mma, rA(_, _, kk), rB(_, _, kk), acc_s);
        gemm(mma, rA1(_, _, kk), rB1(_, _, kk), acc_dp);
      }
    }
    if (staged || (key_bias && !kKeyRows)) __syncthreads();  // the staged terms are visible

    // l = softcap(scale s) + bias (-inf where not allowed), P = exp(l - max) inv,
    // dS = P (dP - delta); dP becomes the score gradient (softcap's factor) and,
    // where dbias needs the tile, dS goes back to shared memory.
    const bool keep_ds = kKeyRows && !stats_only && staged && p.bias_grad == BiasGrad::kPerElement;
    // The allowed columns of the thread's two rows (bit = column), from the list
    // bits (dq) or the interval of the row's key (dk/dv: queries [start, end)).
    // A step's columns in one word (32 bits at 32-column steps); key groups'
    // rows are int32 (KeyRows), so their limits are tile-local 32-bit ones.
    using Allow = std::conditional_t<(kStep > 32), std::uint64_t, std::uint32_t>;
    constexpr int kAllowBits = 8 * sizeof(Allow);
    static_assert(kStep <= kAllowBits, "a step's columns in one word");
    const bool use_allow = lists || key_groups;
    Allow allow[2] = {0, 0};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = get<0>(cS(make_coord(make_coord(0, half), 0, 0)));
      if (lists) allow[half] = static_cast<Allow>(row_bits[buf * kBlockRows + r]);
      if (key_groups) {
        const KeyRows rows = own_rows[r];
        const int q0_row = blk * kStep;  // the group's rows are below its int32 end
        const int lo = min(max(rows.start - q0_row, 0), kStep), hi = min(max(rows.end - q0_row, 0), kStep);
        allow[half] = hi > lo ? (~Allow{0} >> (kAllowBits - hi)) & (~Allow{0} << lo) : Allow{0};
      }
    }
    // Query-major order: a query's statistics are read once and die. The loop is
    // compiled once per (softcap, additive term) so that no element tests them.
    auto elementwise = [&](auto with_softcap, auto add_kind) {  // add_kind: 0 none, 1 staged tile, 2 key-only
      constexpr bool kSoftcap = decltype(with_softcap)::value;
      constexpr int kAdd = decltype(add_kind)::value;
#pragma unroll
      for (int e = 0; e < 4 * kM * kN; ++e) {
        const int outer = kKeyRows ? e / (2 * kM) : e / (2 * kN), inner = kKeyRows ? e % (2 * kM) : e % (2 * kN);
        const int m = kKeyRows ? inner / 2 : outer / 2, half = kKeyRows ? inner % 2 : outer % 2;
        const int nn = kKeyRows ? outer / 2 : inner / 2, c = kKeyRows ? outer % 2 : inner % 2;
        const auto at = make_coord(make_coord(c, half), m, nn);
        const int r = get<0>(cS(at)), col = column0 + get<1>(cS(at));
        const int qi = kKeyRows ? col : r, kj = kKeyRows ? r : col;
        float x = acc_s(at) * scale, tanh_x = 0.0f;
        if constexpr (kSoftcap) tanh_x = tanh_ex2(x * tanh_arg), x = softcap * tanh_x;
        if constexpr (kAdd == 1) x += tile_add[r * kAddLd + col];
        if constexpr (kAdd == 2) x += kKeyRows ? key_bias_rows[2 * m + half] : key_add[kj];
        if (use_allow && !((allow[half] >> col) & 1)) x = -kInf;
        if (stats_only) {
          acc_s(at) = x;
          continue;
        }
        // (x - max) first: x and max near the float32 limit (a bias of its lowest) would overflow times log2(e).
        const float prob = exp2_ftz((x - st[qi]) * kLog2e) * st[kQ + qi];
        const float ds = prob * (acc_dp(at) - st[2 * kQ + qi]);
        acc_s(at) = prob;
        acc_dp(at) = kSoftcap ? ds * (1.0f - tanh_x * tanh_x) : ds;
        if constexpr (kKeyRows) {
          if (p.bias_grad == BiasGrad::kPerKey) key_sum[2 * m + half] += ds;
          if (keep_ds && stager) tile_add[kKeepDsAt + r * kAddLd + col] = ds;
        }
      }
    };
    auto with_add = [&](auto with_softcap) {
      if (staged)
        elementwise(with_softcap, std::integral_constant<int, 1>{});
      else if (key_bias)
        elementwise(with_softcap, std::integral_constant<int, 2>{});
      else
        elementwise(with_softcap, std::integral_constant<int, 0>{});
    };
    if (softcap > 0.0f)
      with_add(std::true_type{});
    else
      with_add(std::false_type{});

    if (stats_only) {  // online max and sum of the rows (dq: rows are queries)
      add_row_stats(acc_s, run_max, run_sum);
      return;
    }

    // Both operands in Element first: the float tiles are dead before the MMAs.
    Tensor rdS = to_a_operand<Element>(acc_dp);
    Tensor rP = to_a_operand<Element>(acc_s);
    if (dq_atomic) {  // dS^T for dQ: adjacent queries of a key as one word
      const auto* pairs = reinterpret_cast<const std::uint32_t*>(raw_pointer_cast(rdS.data()));
#pragma unroll
      for (int e = 0; e < size(acc_dp); e += 2) {
        const int r = get<0>(cS(e)), col = column0 + get<1>(cS(e));
        if (stager) *reinterpret_cast<std::uint32_t*>(ds_t + buf * kStep + r * Config::kDsLd + col) = pairs[e / 2];
      }
      dq_pending = t;
    }
    gemm_rs(mma, acc_a, rdS, copy_bt, ldsm_bt.partition_S(col_tile_t(buf, 0)), rBt, rBtv);
    if constexpr (kKeyRows) {
      gemm_rs(mma, acc_b, rP, copy_bt, ldsm_bt.partition_S(col_tile_t(buf, 1)), rBt, rBtv);

      if (keep_ds) {  // dbias from the dS tile (rows: keys, columns: queries), each element by one thread
        __syncthreads();
        const int qrows = clamp_to_tile(sq - q0), kcols = clamp_to_tile(sk - k0);
#pragma unroll 1
        for (int e = tid; e < kBlockRows * kStep; e += Config::kThreads) {
          const int kj = e / kStep, qi = e % kStep;
          if (qi >= qrows || kj >= kcols) continue;
          const float x = tile_add[kKeepDsAt + kj * kAddLd + qi];
          db_out.add(p, hb, q0 + qi, k0 + kj, x);
        }
      }
      // Key-only dbias: the sums of a bias head are complete when the next step
      // has another (pieces of keys: in the epilogue, one bias head).
      const int t_next = next(t);
      if (p.bias_grad == BiasGrad::kPerKey && !pieces &&
          (t_next >= total || (h_first + t_next / span) / p.bias_group != hb)) {
        float x[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) x[half] = quad_sum(key_sum[half]), key_sum[half] = 0.0f;
        add_key_sum_parts(x);
        store_key_sums(hb, x, 3u);
      }
    }
  };

  // dq: rows whose |lse| is too large for float32 to hold max + log(sum) (biases
  // near +-1e30, rare) make a first pass over the keys that recomputes max and sum
  // of the block's rows, for this kernel and the dk/dv one.
  bool recompute = false;
  if constexpr (!kKeyRows) {
    cp_async_wait<0>();
    __syncthreads();  // the statistics are in shared memory
    bool huge = false;
    for (int r = tid; r < kBlockRows; r += Config::kThreads)
      huge |= fabsf(stats[r]) > kLseExact && stats[kBlockRows + r] != 0.0f;
    recompute = __syncthreads_or(huge);
  }
  // The walk over the steps: the column tiles of the next step load while this one computes.
  for (int pass = recompute ? 0 : 1; pass < (dq_stats ? 1 : 2); ++pass) {
    const bool stats_only = pass == 0;
    int t = next(-1), buf = 0;
    if (t < total) issue(t, 0, !stats_only);
    while (t < total) {
      const int t_next = next(t);
      cp_async_wait<0>();
      __syncthreads();  // step t landed; every thread is done with the other buffer
      key_bias_now = key_bias_next;
      if (t_next < total) issue(t_next, buf ^ 1, !stats_only);
      const int prev = dq_pending;  // the previous step's dS^T is complete, in the other buffer
      dq_pending = -1;
      if (dq_early) flush_dq(prev, buf ^ 1);
      compute(t, buf, stats_only);
      if (!dq_early) flush_dq(prev, buf ^ 1);
      t = t_next, buf ^= 1;
    }
    cp_async_wait<0>();
    __syncthreads();
    flush_dq(dq_pending, buf ^ 1);
    if (stats_only)
      store_row_stats<kBlockRows>(p, cS, run_max, run_sum, stats, b, h_first, row0, sq, lane, stager);
  }

  if (dq_stats) return;

  store_backward<Config>(p, seq, b, kvh, h_first, acc_a, acc_b, thr, cS, own_keys, piece_info, row0, own_len, feature0,
                         holder, stager, pieces, key_sum, add_key_sum_parts, store_key_sums, cols_smem, lane, d, scale);
}

}  // namespace dmattn::cuda
