// The sm80-class forward (mma.sync through CuTe, cp.async loads in a pipeline
// of K/V stages): one CTA owns kBlockM query rows of one (batch, head) and walks
// the key tiles that causal and the sliding window leave, with an online softmax
// in registers. With a mask or a top-k selection, the key lists
// (sparse/key_lists.h) give per query block the keys that some row of the
// block may see; the CTA then walks only those keys, gathered 64 a tile (a
// top-k selection lets a block see a small, scattered part of the keys). Grids too small to fill the GPU (decode) split
// the keys over several CTAs and merge them in a combine kernel (fwd/combine.cu).
// The warps lie over the rows (16 each), or on the key-split tile of decode
// (ForwardConfig::kKeySplit: 16 rows) over the keys of each tile, each with its
// own online softmax, their partial rows added before the epilogue.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/element.cuh"
#include "../common/geometry.h"
#include "../common/softmax.cuh"
#include "../common/tile_sm80.cuh"
#include "../params.h"
#include "block.cuh"
#include "config.cuh"

namespace dmattn::cuda {

// Loads `rows` consecutive rows of g (row stride `stride` elements, `cols`
// valid features, zeros past them) into the K or V tile s with 16-byte
// cp.async; the caller commits the group. kPerRow threads share a row, one
// chunk each (neighbouring threads neighbouring chunks: whole 128-byte lines a
// warp), and a thread's rows are kRowStep apart, a multiple of the swizzle
// atom's 8 rows: the swizzled address of each of its copies is then its first
// plus a constant, where load_tile works out every address anew. Only for the
// head dims that allow such a step (kDenseLoads); the rest take load_tile.
template <class Config>
struct DenseLoad {
  static constexpr int kChunks = Config::kHeadDim / 8;
  static constexpr int kPerRow = kChunks % 16 == 0 ? 16 : kChunks % 8 == 0 ? 8 : kChunks % 4 == 0 ? 4 : 1;
  static constexpr int kRowStep = Config::kThreads / kPerRow;
  static constexpr bool kDenseLoads = kRowStep % 8 == 0 && Config::kBlockN % kRowStep == 0 &&
                                      (kPerRow == kChunks || 8 * kPerRow % Config::kSmemRow == 0);
};

template <class Config, class SmemTensor>
__device__ void load_dense_rows(SmemTensor&& s, const typename Config::Element* g, std::int64_t stride, int rows,
                                int cols) {
  using namespace cute;
  using Element = typename Config::Element;
  using Load = DenseLoad<Config>;
  constexpr int kPerRow = Load::kPerRow, kRowStep = Load::kRowStep;
  const int r0 = threadIdx.x / kPerRow, c0 = threadIdx.x % kPerRow * 8;
  const auto smem0 = static_cast<unsigned>(__cvta_generic_to_shared(&s(r0, c0)));
  const Element* src0 = g + r0 * stride + c0;
  static_for(
      [&](auto it) {
        constexpr int kRow = decltype(it)::value * kRowStep;
        const bool row_valid = r0 + kRow < rows;
        const Element* src = src0 + kRow * stride;
        static_for(
            [&](auto j) {
              constexpr int kCol = decltype(j)::value * kPerRow * 8;
              constexpr int kDst = decltype(typename Config::SmemLayoutKV{}(Int<kRow>{}, Int<kCol>{}))::value *
                                   int(sizeof(Element));
              if (row_valid && c0 + kCol < cols) {
                asm volatile("cp.async.cg.shared.global [%0+%1], [%2+%3], 16;\n" ::"r"(smem0), "n"(kDst), "l"(src),
                             "n"(kCol * int(sizeof(Element))));
              } else {
                asm volatile("st.shared.v4.u32 [%0+%1], {%2, %2, %2, %2};\n" ::"r"(smem0), "n"(kDst), "r"(0));
              }
            },
            std::make_integer_sequence<int, Load::kChunks / kPerRow>{});
      },
      std::make_integer_sequence<int, Config::kBlockN / kRowStep>{});
}

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, Config::kMinCtas) forward_kernel(const ForwardParams p) {
  using namespace cute;
  using Element = typename Config::Element;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN, kStages = Config::kStages;
  constexpr int kRows = Config::kRowsPerThread;

  const ForwardBlock blk(p, kBlockM, kBlockN, blockIdx.x);
  if (blk.row0 >= blk.sq) return;
  const int h = blk.h, b = blk.b, hk = h / p.group;
  const std::int64_t row0 = blk.row0, qs = blk.qs, ks = blk.ks, sq = blk.sq, sk = blk.sk, offset = blk.offset;
  // The block's key tiles that no element of tests (covered_tiles).
  const TileIndices covered = covered_tiles(p.band, offset, sk, row0, blk.row_last, kBlockN);
  const bool has_mask = blk.has_mask, has_bias = p.bias.data != nullptr;
  const std::int64_t mask_block = blk.mask_block;
  const int mask_count = blk.mask_count;
  const std::int32_t* mask_keys = blk.mask_keys;
  // This split's share of the key blocks: [n_first, n_end).
  const int per_split = (blk.tile_end - blk.tile_first + p.num_splits - 1) / p.num_splits;
  const int n_first = min(blk.tile_end, blk.tile_first + blk.split * per_split);
  const int n_end = min(blk.tile_end, n_first + per_split);

  const auto* q = static_cast<const Element*>(p.q.data) + b * p.q.sb + h * p.q.sh + (qs + row0) * p.q.sr;
  const auto* k = static_cast<const Element*>(p.k.data) + b * p.k.sb + hk * p.k.sh + ks * p.k.sr;
  const auto* v = static_cast<const Element*>(p.v.data) + b * p.v.sb + hk * p.v.sh + ks * p.v.sr;
  // The key tiles are visited from n_end - 1 down to n_first.
  auto next_block = [](int n) { return n - 1; };
  // Mask bits of the block's first row (local rows; seqlen_q rows a slice).
  const std::uint32_t* mask_bits =
      has_mask ? p.mask_bits + (mask_block / p.mask_blocks * p.seqlen_q + row0) * p.bits_sr : nullptr;
  // Keys of tile n from its first: how many, and the key of the calling
  // thread's K/V row (-1 past the keys; a mask's keys come from its list).
  auto tile_count = [&](int n) { return (has_mask ? mask_count : sk) - std::int64_t{n} * kBlockN; };
  auto kv_row = [&](int n) -> std::int64_t {
    const int r = tile_row<Config, kBlockN>();
    if (r >= tile_count(n)) return -1;
    return has_mask ? mask_keys[std::int64_t{n} * kBlockN + r] : std::int64_t{n} * kBlockN + r;
  };
  // BiasReader's base (common/bias.cuh), written out: this walk stages a
  // key-only bias's raw bits and 16-byte chunks, and the reader compiled to
  // other SASS here.
  std::int64_t bias_base = 0;
  if (has_bias) bias_base = element_at(p.bias, b, h / p.bias_group, qs + row0, ks);

  extern __shared__ __align__(128) char smem[];
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Config::SmemLayoutQ{});
  // Stage s of K at sK0 + s * kTileElems, of V at sV0 + s * kTileElems.
  const auto sK0 = sQ.data() + size(sQ);
  const auto sV0 = sK0 + kStages * Config::kTileElems;
  auto stage_k = [&](int s) { return make_tensor(sK0 + s * Config::kTileElems, typename Config::SmemLayoutKV{}); };
  auto stage_v = [&](int s) { return make_tensor(sV0 + s * Config::kTileElems, typename Config::SmemLayoutKV{}); };
  // The MMAs' warps: over the rows, or (the key-split tile) each over its
  // kWarpKeys keys of a tile, from key column warp_key0, its MMA indexed by lane.
  constexpr bool kKeySplit = Config::kKeySplit;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned mma_tid = kKeySplit ? threadIdx.x % 32 : threadIdx.x;
  const int warp_key0 = kKeySplit ? warp * Config::kWarpKeys : 0;
  auto warp_k = [&](int s) {
    return make_tensor(sK0 + s * Config::kTileElems + warp_key0 * Config::kHeadDim, typename Config::SmemLayoutWarpKV{});
  };
  auto warp_vt = [&](int s) {
    return make_tensor(sV0 + s * Config::kTileElems + warp_key0 * Config::kHeadDim, typename Config::SmemLayoutVt{});
  };
  // Per stage, what a tile needs besides K and V, fetched into registers with the
  // tile's K and V and stored after its S = Q K^T, so that no thread waits on
  // them: the tile's mask bits by row, the key-only bias, the key of each column.
  // On the 64-row tile (decode, bound by reading K and V), a key-only bias of
  // 16-byte aligned rows on the dense walk (vector_bias) is copied instead in
  // 16-byte chunks in the tile's cp.async group: through registers, every
  // tile's short S = Q K^T waited on its load, 20% of a decode call. The
  // 128-row tile's product hides that load, and its registers are full (the
  // copies spilled 16 more bytes there).
  std::uint64_t* const s_bits = reinterpret_cast<std::uint64_t*>(smem + (Config::kSmemBytes - Config::kExtrasBytes));
  // Copied, a 16-bit bias stays in its dtype (key c at byte 2 c of the stage's
  // row) and is converted where S = Q K^T takes it.
  float* const s_bias = reinterpret_cast<float*>(s_bits + kStages * kBlockM);
  int* const s_keys = reinterpret_cast<int*>(s_bias + kStages * kBlockN);
  // key_bias: AttentionParams::key_only_bias written out (the call compiles to other SASS here).
  const bool key_bias = has_bias && p.bias.sr == 0, bias_chunks = Config::kDecodeTile && key_bias && p.vector_bias && !has_mask;
  const bool extras_needed = has_mask || (has_bias && !bias_chunks);
  // The bias is held as its raw bits (float32 or Element) until the store: a
  // conversion next to the load would wait there for it, before S = Q K^T.
  static_assert(sizeof(Element) == 2, "16-bit elements");
  struct Extras {
    std::uint32_t bias = 0;
    int key = -1;  // -1: past the keys
    std::uint64_t bits = 0;
  };
  auto fetch_extras = [&](int n) {
    Extras e;
    if (threadIdx.x < kBlockN && threadIdx.x < tile_count(n)) {
      e.key = has_mask ? mask_keys[std::int64_t{n} * kBlockN + threadIdx.x] : n * kBlockN + threadIdx.x;
      if (key_bias) {
        const std::int64_t at = bias_base + e.key * p.bias.sc;
        e.bias = p.bias_float32 ? static_cast<const std::uint32_t*>(p.bias.data)[at]
                                : std::uint32_t{static_cast<const std::uint16_t*>(p.bias.data)[at]};
      }
    }
    if (has_mask && threadIdx.x < kBlockM && row0 + threadIdx.x < sq) {
      const std::uint32_t* word = mask_bits + threadIdx.x * p.bits_sr + std::int64_t{n} * kBlockN / 32;
      e.bits = kBlockN == 64 ? *reinterpret_cast<const std::uint64_t*>(word) : std::uint64_t{*word};
    }
    return e;
  };
  auto store_extras = [&](int s, const Extras& e) {
    if (threadIdx.x < kBlockN) {
      s_bias[s * kBlockN + threadIdx.x] = p.bias_float32 ? __uint_as_float(e.bias)
                                                         : static_cast<float>(Element::bitcast(std::uint16_t(e.bias)));
      s_keys[s * kBlockN + threadIdx.x] = e.key;
    }
    if (threadIdx.x < kBlockM) s_bits[s * kBlockM + threadIdx.x] = e.bits;
  };
  // The bias of the keys of tile n (consecutive) into stage s, 16 bytes a thread
  // (bias_chunks: whole chunks within the keys, aligned); the caller commits.
  auto load_bias_chunks = [&](int s, int n) {
    const int bias_bytes = p.bias_float32 ? 4 : 2, first = threadIdx.x * 16 / bias_bytes;
    if (first >= kBlockN) return;
    const std::int64_t key = std::int64_t{n} * kBlockN + first;
    const auto dst = static_cast<unsigned>(
        __cvta_generic_to_shared(reinterpret_cast<char*>(s_bias + s * kBlockN) + first * bias_bytes));
    if (key < sk) {
      const char* src = static_cast<const char*>(p.bias.data) + (bias_base + key) * bias_bytes;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
    } else {
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0));
    }
  };

  typename Config::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(mma_tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);                  // (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_mma.partition_fragment_B(warp_k(0));           // (MMA, MMA_N, MMA_K)
  Tensor tOrVt = thr_mma.partition_fragment_B(warp_vt(0));         // (MMA, MMA_D, MMA_N)
  auto copy_q = make_tiled_copy_A(typename Config::LdsmAtom{}, mma);
  auto copy_k = make_tiled_copy_B(typename Config::LdsmAtom{}, mma);
  auto copy_v = make_tiled_copy_B(typename Config::LdsmAtomT{}, mma);
  auto ldsm_q = copy_q.get_thread_slice(mma_tid);
  auto ldsm_k = copy_k.get_thread_slice(mma_tid);
  auto ldsm_v = copy_v.get_thread_slice(mma_tid);
  Tensor tSsQ = ldsm_q.partition_S(sQ);
  Tensor tSrQv = ldsm_q.retile_D(tSrQ);
  Tensor tSrKv = ldsm_k.retile_D(tSrK);
  Tensor tOrVtv = ldsm_v.retile_D(tOrVt);

  Tensor acc_o = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<Config::kHeadDim>>{});  // ((2, 2), MMA_M, MMA_D)
  clear(acc_o);
  // The thread's accumulator element ((c, half), m, nn) is tile row
  // row_of(m, half) and column 8 nn + col_base + c (the mma.sync C layout): of
  // O a feature, of S key column key_base + 8 nn + c of the tile.
  const int col_base = 2 * (lane % 4), key_base = warp_key0 + col_base;
  auto row_of = [&](int m, int half) {
    return (kKeySplit ? 0 : 16 * (threadIdx.x / 32)) + 16 * Config::kRowWarps * m + lane / 4 + 8 * half;
  };
  float row_max[kRows], row_sum[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) row_max[r] = -kInf, row_sum[r] = 0.0f;

  // The logit l is x * unit for what the tile holds, x: with neither softcap
  // nor bias the raw product q.k (unit = scale); otherwise the tile is turned
  // into the logits themselves (unit = 1). exp(l - max l) = exp2(x c - max x c)
  // with c = unit log2 e (see the online softmax below).
  const float scale = p.scale, softcap = p.softcap;
  const bool logits = has_bias || softcap > 0.0f;
  const float unit = logits ? 1.0f : scale, c_log2 = unit * kLog2e;

  // Prologue: Q with the first stage, then kStages - 1 key blocks in flight.
  const int d = p.head_dim;
  auto load_kv = [&](int s, std::int64_t row) {
    load_tile<Config>(stage_k(s), k, p.k.sr, row, d, p.vector_k);
    load_tile<Config>(stage_v(s), v, p.v.sr, row, d, p.vector_v);
  };
  // Consecutive keys (no key list) with 16-byte aligned rows load as whole
  // tiles (load_dense_rows), the rest row by row (load_kv).
  const bool dense_loads = DenseLoad<Config>::kDenseLoads && !has_mask && p.vector_k && p.vector_v;
  auto load_block = [&](int s, int n) {
    if (bias_chunks) load_bias_chunks(s, n);
    if (dense_loads) {
      const std::int64_t col0 = std::int64_t{n} * kBlockN;
      const int rows = static_cast<int>(min(std::int64_t{kBlockN}, sk - col0));
      load_dense_rows<Config>(stage_k(s), k + col0 * p.k.sr, p.k.sr, rows, d);
      load_dense_rows<Config>(stage_v(s), v + col0 * p.v.sr, p.v.sr, rows, d);
    } else {
      load_kv(s, kv_row(n));
    }
  };
  int n_load = n_end;
  for (int s = 0; s < kStages - 1; ++s) {
    n_load = next_block(n_load);
    if (s == 0 && n_load >= n_first) {
      const int r = tile_row<Config, kBlockM>();
      load_tile<Config>(sQ, q, p.q.sr, r < sq - row0 ? r : -1, d, p.vector_q);
    }
    if (n_load >= n_first) {
      load_block(s, n_load);
      if (extras_needed) store_extras(s, fetch_extras(n_load));
    }
    cute::cp_async_fence();
  }

  int stage = 0;
  for (int n = next_block(n_end); n >= n_first; n = next_block(n)) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // block n landed; every thread is done with the previous stage
    n_load = next_block(n_load);
    const int load_stage = (stage + kStages - 1) % kStages;
    // A gathered tile's rows come from the key list: read here, the copy issued
    // after S = Q K^T (the read's latency hidden behind it).
    const bool load = n_load >= n_first;
    const std::int64_t load_row = load && has_mask ? kv_row(n_load) : -1;
    Extras extras;
    if (load && !has_mask) load_block(load_stage, n_load);
    if (load && extras_needed) extras = fetch_extras(n_load);
    if (!has_mask) cute::cp_async_fence();
    const std::int64_t col0 = std::int64_t{n} * kBlockN;

    Tensor tSsK = ldsm_k.partition_S(warp_k(stage));
    Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<Config::kWarpKeys>>{});
    clear(acc_s);
    gemm_ss(mma, acc_s, copy_q, tSsQ, tSrQ, tSrQv, copy_k, tSsK, tSrK, tSrKv);
    if (has_mask) {
      if (load) load_kv(load_stage, load_row);
      cute::cp_async_fence();
    }
    if (load && extras_needed) store_extras(load_stage, extras);

    // The logits: s = scale q.k (softcap: softcap tanh(s / softcap)), plus the
    // bias; a key-only bias and the scale make one FFMA (times `pre`).
    if (softcap > 0.0f) {
      const float inner = scale / softcap * kTanhArg;
#pragma unroll
      for (int e = 0; e < size(acc_s); ++e) acc_s(e) = softcap_ex2(acc_s(e) * inner, softcap);
    } else if (has_bias && !key_bias) {
#pragma unroll
      for (int e = 0; e < size(acc_s); ++e) acc_s(e) *= scale;
    }
    if (key_bias) {  // one value per key, staged in shared memory
      const float pre = softcap > 0.0f ? 1.0f : scale;
      const float* bias_cols = s_bias + stage * kBlockN + key_base;
      const auto* copied = reinterpret_cast<const std::uint16_t*>(s_bias + stage * kBlockN) + key_base;
      const bool copied16 = bias_chunks && !p.bias_float32;
#pragma unroll
      for (int nn = 0; nn < size<2>(acc_s); ++nn) {
        float2 value;
        if (copied16) {  // columns key_base, key_base + 1 in one word
          const std::uint32_t pair = *reinterpret_cast<const std::uint32_t*>(copied + 8 * nn);
          value.x = static_cast<float>(Element::bitcast(static_cast<std::uint16_t>(pair)));
          value.y = static_cast<float>(Element::bitcast(static_cast<std::uint16_t>(pair >> 16)));
        } else {
          value = *reinterpret_cast<const float2*>(bias_cols + 8 * nn);
        }
#pragma unroll
        for (int m = 0; m < size<1>(acc_s); ++m)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            float& x0 = acc_s(make_coord(0, half), m, nn);
            float& x1 = acc_s(make_coord(1, half), m, nn);
            x0 = fmaf(x0, pre, value.x);
            x1 = fmaf(x1, pre, value.y);
          }
      }
    } else if (has_bias) {
      const int rows = clamp_to_tile(sq - row0);
      const int* keys = s_keys + stage * kBlockN + key_base;
      auto add_bias = [&](auto* bias) {
#pragma unroll
        for (int m = 0; m < size<1>(acc_s); ++m)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = row_of(m, half);
            if (row >= rows) continue;
            const auto* bias_row = bias + bias_base + row * p.bias.sr;
#pragma unroll
            for (int nn = 0; nn < size<2>(acc_s); ++nn)
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                const int key = keys[8 * nn + c];
                if (key >= 0) acc_s(make_coord(c, half), m, nn) += static_cast<float>(bias_row[key * p.bias.sc]);
              }
          }
      };
      if (p.bias_float32)
        add_bias(static_cast<const float*>(p.bias.data));
      else
        add_bias(static_cast<const Element*>(p.bias.data));
    }

    // The allowed set. With a mask, the tile's bits (the pre-pass folded causal,
    // the window and the key range into them). Without one, a tile wholly inside
    // the causal band, the window and the keys needs no per-element test;
    // elsewhere row r allows columns [lo + r, hi + r] within the keys.
    if (has_mask) {
#pragma unroll
      for (int m = 0; m < size<1>(acc_s); ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const std::uint64_t allowed = s_bits[stage * kBlockM + row_of(m, half)] >> key_base;
#pragma unroll
          for (int nn = 0; nn < size<2>(acc_s); ++nn)
#pragma unroll
            for (int c = 0; c < 2; ++c)
              if (!((allowed >> (8 * nn + c)) & 1)) acc_s(make_coord(c, half), m, nn) = -kInf;
        }
    } else if (!covered.holds(n)) {
      // TileBand, written out: the call compiles to other SASS here.
      const int cols = clamp_to_tile(sk - col0);
      const int lo = p.band.left < 0 ? -kTileFar : clamp_to_tile(row0 + offset - col0 - p.band.left);
      int hi = p.band.causal ? clamp_to_tile(row0 + offset - col0) : kTileFar;
      if (p.band.right >= 0) hi = min(hi, clamp_to_tile(row0 + offset - col0 + p.band.right));
#pragma unroll
      for (int m = 0; m < size<1>(acc_s); ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = row_of(m, half);
          const int first = lo + row, last = min(cols - 1, hi + row);
#pragma unroll
          for (int nn = 0; nn < size<2>(acc_s); ++nn)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int col = 8 * nn + key_base + c;
              if (col < first || col > last) acc_s(make_coord(c, half), m, nn) = -kInf;
            }
        }
    }

    // Online softmax: masked entries are -inf and add exactly 0; a row with no
    // allowed key so far keeps max -inf and sum 0. First the row maxima
    // (move_row_max), with O and the sums rescaled to them (when some row of the
    // warp moved). The sums and O carry the same factor and lse = max + log(sum)
    // holds for any such max.
    float correction[kRows];
    bool moved = false, far = false;
#pragma unroll
    for (int m = 0; m < size<1>(acc_s); ++m) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * m + half;
        float mx = row_max[r];
#pragma unroll
        for (int nn = 0; nn < size<2>(acc_s); ++nn)
#pragma unroll
          for (int c = 0; c < 2; ++c) mx = fmaxf(mx, acc_s(make_coord(c, half), m, nn));
        correction[r] = move_row_max(quad_max(mx), c_log2, row_max[r], row_sum[r], moved, far);
      }
    }
    if (__any_sync(0xffffffff, moved)) {
#pragma unroll
      for (int m = 0; m < size<1>(acc_o); ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int dd = 0; dd < size<2>(acc_o); ++dd)
#pragma unroll
            for (int c = 0; c < 2; ++c) acc_o(make_coord(c, half), m, dd) *= correction[2 * m + half];
    }
    // Then P = exp(x unit - max unit) as exp2(x c - max c), one FFMA: max c is
    // rounded (by at most 2^-24 |max c|: a factor that the row's entries of this
    // tile share, within 2e-5 of 1 while |max| <= kNearMax). Larger logits (a
    // bias of -1e30, say) take exp2((x - max) c), whose argument is exact near
    // the max however large it is, so that lse = max + log(sum) stays exact.
    const bool exact = logits && __any_sync(0xffffffff, far);
#pragma unroll
    for (int m = 0; m < size<1>(acc_s); ++m) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * m + half;
        const float base = row_max[r] == -kInf ? 0.0f : row_max[r], base_c = base * c_log2;
        float sum = 0.0f;
        if (exact) {
#pragma unroll
          for (int nn = 0; nn < size<2>(acc_s); ++nn)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              float& x = acc_s(make_coord(c, half), m, nn);
              x = exp2_ftz((x - base) * c_log2);
              sum += x;
            }
        } else {
#pragma unroll
          for (int nn = 0; nn < size<2>(acc_s); ++nn)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              float& x = acc_s(make_coord(c, half), m, nn);
              x = exp2_ftz(fmaf(x, c_log2, -base_c));
              sum += x;
            }
        }
        row_sum[r] += sum;
      }
    }

    // P in the A-operand register layout.
    Tensor tOrP = to_a_operand<Element>(acc_s);

    Tensor tOsVt = ldsm_v.partition_S(warp_vt(stage));
    copy(copy_v, tOsVt(_, _, 0), tOrVtv(_, _, 0));
#pragma unroll
    for (int kk = 0; kk < size<2>(tOrP); ++kk) {
      if (kk + 1 < size<2>(tOrP)) copy(copy_v, tOsVt(_, _, kk + 1), tOrVtv(_, _, kk + 1));
      gemm(mma, tOrP(_, _, kk), tOrVt(_, _, kk), acc_o);
    }
    stage = (stage + 1) % kStages;
  }

  // The rows' sums over the CTA's keys. On the key-split tile each warp's
  // (max, sum, O) holds for its keys as any max of the online softmax does:
  // weighed by exp2((max_w - top) c), top the row's largest (the exponent
  // first: both near the float32 limit would overflow), the warps' O and sums
  // add up in warp order into warp 0's, which writes the rows.
  float row_total[kRows];  // the key-split tile's (the other tiles sum each row in the epilogue)
  if constexpr (kKeySplit) {
    static_assert(kRows == 2, "one 16-row MMA tile");
#pragma unroll
    for (int r = 0; r < kRows; ++r) row_total[r] = quad_sum(row_sum[r]);
    constexpr int kAccFloats = decltype(size(acc_o))::value;
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the K and V stages, which take the partial rows now
    // Element e of lane l of warp w's O at (w kAccFloats + e) 32 + l; then the
    // maxima and the sums of the rows, by warp.
    float* const partial_o = reinterpret_cast<float*>(raw_pointer_cast(sK0));
    float* const partial_max = partial_o + Config::kWarps * kAccFloats * 32;
    float* const partial_sum = partial_max + Config::kWarps * kBlockM;
#pragma unroll
    for (int half = 0; half < 2; ++half)
      if (lane % 4 == 0) {
        partial_max[warp * kBlockM + row_of(0, half)] = row_max[half];
        partial_sum[warp * kBlockM + row_of(0, half)] = row_total[half];
      }
    __syncthreads();
    float own[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row_of(0, half);
      float top = -kInf, total = 0.0f;
#pragma unroll
      for (int w = 0; w < Config::kWarps; ++w) top = fmaxf(top, partial_max[w * kBlockM + row]);
      auto weight = [&](float max_w) { return max_w == -kInf ? 0.0f : exp2_ftz((max_w - top) * c_log2); };
#pragma unroll
      for (int w = 0; w < Config::kWarps; ++w)
        total += weight(partial_max[w * kBlockM + row]) * partial_sum[w * kBlockM + row];
      own[half] = weight(row_max[half]);
      row_max[half] = top, row_total[half] = total;
    }
    auto element = [&](int e) -> float& { return acc_o(make_coord(e % 2, e / 2 % 2), 0, e / 4); };
    if (warp != 0) {
#pragma unroll
      for (int e = 0; e < kAccFloats; ++e)
        partial_o[(warp * kAccFloats + e) * 32 + lane] = element(e) * own[e / 2 % 2];
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int e = 0; e < kAccFloats; ++e) {
      float x = element(e) * own[e / 2 % 2];
#pragma unroll
      for (int w = 1; w < Config::kWarps; ++w) x += partial_o[(w * kAccFloats + e) * 32 + lane];
      element(e) = x;
    }
  }

  // Epilogue: o = acc / sum (0 for a row with no allowed key), lse = max + log(sum).
  // A thread's pairs (col_base + 8 dd, + 1) start at even columns: whole or
  // padding (past a head dim of whole 8-feature chunks); one 32-bit store
  // each where out's strides allow, every word of a row rounded first
  // (rounded_word).
  auto* out = static_cast<Element*>(p.out.data) + b * p.out.sb + h * p.out.sh + (qs + row0) * p.out.sr;
  auto* lse = static_cast<float*>(p.lse.data);
  const bool aligned = pairs_aligned(p.out.data, p.out.sb, p.out.sh, p.out.sr);
#pragma unroll
  for (int m = 0; m < size<1>(acc_o); ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 2 * m + half;
      const float sum = kKeySplit ? row_total[r] : quad_sum(row_sum[r]);
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      const int row = row_of(m, half);
      if (row0 + row >= sq) continue;
      if (p.num_splits > 1) {
        const std::int64_t partial_row =
            ((std::int64_t{blk.split} * p.batch + b) * p.heads + h) * p.seqlen_q + row0 + row;
#pragma unroll
        for (int dd = 0; dd < size<2>(acc_o); ++dd)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int col = 8 * dd + col_base + c;
            if (col < d) p.o_partial[partial_row * d + col] = acc_o(make_coord(c, half), m, dd) * inv;
          }
        if (lane % 4 == 0) p.stat_partial[partial_row] = make_float2(sum > 0.0f ? row_max[r] * unit : -kInf, sum);
        continue;
      }
      constexpr int kPairs = decltype(size<2>(acc_o))::value;
      if (aligned) {
        std::uint32_t words[kPairs];
#pragma unroll
        for (int dd = 0; dd < kPairs; ++dd)
          words[dd] = rounded_word<Element>(acc_o(make_coord(0, half), m, dd) * inv,
                                            acc_o(make_coord(1, half), m, dd) * inv);
#pragma unroll
        for (int dd = 0; dd < kPairs; ++dd)
          if (8 * dd + col_base < d) store_word(out + row * p.out.sr + 8 * dd + col_base, words[dd]);
      } else {
#pragma unroll
        for (int dd = 0; dd < kPairs; ++dd)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int col = 8 * dd + col_base + c;
            if (col < d) out[row * p.out.sr + col] = static_cast<Element>(acc_o(make_coord(c, half), m, dd) * inv);
          }
      }
      if (lse != nullptr && lane % 4 == 0)
        lse[b * p.lse.sb + h * p.lse.sh + (qs + row0 + row) * p.lse.sr] = sum > 0.0f ? row_max[r] * unit + logf(sum) : -kInf;
    }
  }
}

}  // namespace dmattn::cuda
