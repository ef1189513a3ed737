// The Hopper forward (sm_90a): warpgroup MMAs (wgmma) for the 128-row query
// blocks of head dim 128 without split-KV, dense or over the key lists of a
// mask or a top-k selection, with no bias or a key-only one. launch_config
// takes it where forward_sm90_eligible holds and the device runs the sm_90a
// code; everything else (decode tiles, split-KV, per-row biases, other head
// dims) stays on forward_kernel.
//
// One CTA of three warpgroups owns 128 query rows and walks key tiles of 128
// (the last first, as forward_kernel). Warpgroup 0 loads: Q, then each tile's
// K, V and key-only bias into one of kStages buffers by cp.async, signalling a
// buffer full on an mbarrier once its copies landed (and were fenced for the
// tensor cores), waiting for the consumers to release it before refilling it.
// Warpgroups 1 and 2 compute, 64 rows each, with most of the registers
// (setmaxnreg). Tile i's S = Q K^T is issued together with the previous
// tile's O += P V, so that the softmax of tile i runs while the tensor cores
// do P V of tile i - 1:
//   iteration i:  S_i = Q K_i^T  and  O += P_{i-1} V_{i-1}   (both in flight)
//                 wait for S_i; logits, online softmax -> P_i (float)
//                 wait for P V; release tile i - 1's buffer;
//                 O *= the correction of tile i; P_i to Element
#pragma once

#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_conversion.h>

#include <cstdint>

#include "forward_kernel.cuh"
#include "sm90.cuh"

namespace dmattn::cuda {

template <class Element_, int kHeadDim_>
struct ForwardSm90Config {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // query rows a CTA, 64 a consumer warpgroup
  static constexpr int kBlockN = 128;  // keys a tile
  // The loader signals a tile after issuing the next one's copies, and refills
  // a buffer once the consumers released its tile (in the iteration after it):
  // two buffers would deadlock (the loader waiting for the release of tile
  // i - 2, the consumers for the signal of tile i - 1); three keep two tiles
  // in flight (231 KB of shared memory, within the 227 KiB an sm_90 CTA may have).
  static constexpr int kStages = 3;
  static constexpr int kThreads = 384;  // a loading warpgroup and two computing ones
  static_assert(kHeadDim == 128, "tiles sized for head dim 128");
  // What load_tile needs to know of the loading warpgroup: a thread a row.
  struct Loader {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_, kThreads = 128;
  };

  using Atom = decltype(cute::GMMA::Layout_K_SW128_Atom<Element>{});
  using LayoutQ = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using LayoutKV = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V seen as (feature, key): the MN-major B operand of O += P V.
  using LayoutVt = decltype(cute::composition(
      LayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using MmaS = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  using MmaO = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));

  static constexpr int kQElems = kBlockM * kHeadDim, kKvElems = kBlockN * kHeadDim;
  // Q, kStages buffers of K, of V, of the key-only bias (floats), then the
  // buffers' full and empty mbarriers.
  static constexpr int kBiasAt = (kQElems + 2 * kStages * kKvElems) * int(sizeof(Element));
  static constexpr int kBarriersAt = kBiasAt + kStages * kBlockN * int(sizeof(float));
  static constexpr int kSmemBytes = kBarriersAt + 2 * kStages * 8;
  static_assert(kStages >= 3 && kSmemBytes <= 227 * 1024, "see kStages");
};

// Whether the Hopper forward computes this launch (launch_config also needs an
// sm_90 device running its sm_90a code, and no split-KV).
inline bool forward_sm90_eligible(const ForwardParams& p) {
  return p.head_dim == 128 && p.vector_q && p.vector_k && p.vector_v && (p.bias.data == nullptr || p.bias.sr == 0);
}

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1) forward_kernel_sm90(const __grid_constant__ ForwardParams p) {
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using namespace cute;
  using Element = typename Config::Element;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN, kHeadDim = Config::kHeadDim;
  constexpr int kStages = Config::kStages;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kInf = INFINITY;

  const ForwardBlock blk(p, kBlockM, kBlockN);
  if (blk.row0 >= blk.sq) return;
  const int h = blk.h, b = blk.b;
  const std::int64_t row0 = blk.row0, sq = blk.sq, sk = blk.sk, offset = blk.offset;
  const bool has_mask = blk.has_mask, has_bias = p.bias.data != nullptr;
  const int tiles = blk.tile_end - blk.tile_first;  // iteration i: key tile tile_end - 1 - i, buffer i % kStages
  const auto tile_of = [&](int i) { return blk.tile_end - 1 - i; };
  const std::int64_t key_count = has_mask ? blk.mask_count : sk;

  extern __shared__ __align__(1024) char smem[];
  auto* q_smem = reinterpret_cast<Element*>(smem);
  Element* k_smem = q_smem + Config::kQElems;
  Element* v_smem = k_smem + kStages * Config::kKvElems;
  auto* bias_smem = reinterpret_cast<float*>(smem + Config::kBiasAt);
  auto* full = reinterpret_cast<std::uint64_t*>(smem + Config::kBarriersAt);  // the buffer's tile landed
  std::uint64_t* empty = full + kStages;  // the consumers are done with the buffer
  Tensor sQ = make_tensor(make_smem_ptr(q_smem), typename Config::LayoutQ{});
  auto stage_k = [&](int s) {
    return make_tensor(make_smem_ptr(k_smem + s * Config::kKvElems), typename Config::LayoutKV{});
  };
  auto stage_v = [&](int s) {
    return make_tensor(make_smem_ptr(v_smem + s * Config::kKvElems), typename Config::LayoutKV{});
  };
  auto stage_vt = [&](int s) {
    return make_tensor(make_smem_ptr(v_smem + s * Config::kKvElems), typename Config::LayoutVt{});
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) Barrier::init(full + s, 128), Barrier::init(empty + s, 256);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x < 128) {  // the loading warpgroup: thread t copies row t of each tile
    cutlass::arch::warpgroup_reg_dealloc<24>();
    using Loader = typename Config::Loader;
    const int t = threadIdx.x, d = p.head_dim, hk = h / p.group;
    const auto* q = static_cast<const Element*>(p.q.data) + b * p.q.sb + h * p.q.sh + (blk.qs + row0) * p.q.sr;
    const auto* k = static_cast<const Element*>(p.k.data) + b * p.k.sb + hk * p.k.sh + blk.ks * p.k.sr;
    const auto* v = static_cast<const Element*>(p.v.data) + b * p.v.sb + hk * p.v.sh + blk.ks * p.v.sr;
    const std::int64_t bias_base = has_bias ? b * p.bias.sb + (h / p.bias_group) * p.bias.sh + blk.ks * p.bias.sc : 0;
    if (tiles > 0) load_tile<Loader>(sQ, q, p.q.sr, t < sq - row0 ? t : -1, d, true);  // with the first tile
    for (int i = 0; i < tiles; ++i) {
      const int s = i % kStages;
      if (i >= kStages) Barrier::wait(empty + s, (i / kStages - 1) & 1);
      const std::int64_t e = std::int64_t{tile_of(i)} * kBlockN + t;
      const std::int64_t key = e >= key_count ? -1 : has_mask ? blk.mask_keys[e] : e;
      load_tile<Loader>(stage_k(s), k, p.k.sr, key, d, true);
      load_tile<Loader>(stage_v(s), v, p.v.sr, key, d, true);
      cute::cp_async_fence();
      if (has_bias)
        bias_smem[s * kBlockN + t] =
            key < 0 ? 0.0f : load_float<Element>(p.bias.data, p.bias_float32, bias_base + key * p.bias.sc);
      if (i > 0) {  // the previous tile landed: fenced for the tensor cores, signalled
        cp_async_wait<1>();
        fence_async_shared();
        Barrier::arrive(full + (i - 1) % kStages);
      }
    }
    if (tiles > 0) {
      cp_async_wait<0>();
      fence_async_shared();
      Barrier::arrive(full + (tiles - 1) % kStages);
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<240>();
  const int tid = threadIdx.x - 128, lane = tid % 32;
  typename Config::MmaS mma_s;
  typename Config::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);
  // The thread's (row, key) of S: two rows (r and r + 8 of its warp's 16),
  // pairs of adjacent keys, 16 groups of 8 keys; element e = c + 2 half + 4 j.
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  constexpr int kAccS = decltype(size(cS))::value;  // 64
  const int my_row[2] = {get<0>(cS(0)), get<0>(cS(2))}, col_base = get<1>(cS(0));
  // Mask / top-k bits of the thread's rows (local rows; seqlen_q rows a slice).
  const std::uint32_t* bits_row[2] = {nullptr, nullptr};
  if (has_mask)
#pragma unroll
    for (int half = 0; half < 2; ++half)
      bits_row[half] = p.mask_bits + (blk.mask_block / p.mask_blocks * p.seqlen_q + row0 + my_row[half]) * p.bits_sr;

  // The logit l is x * unit, x: with neither softcap nor bias the raw product
  // q.k (unit = scale); otherwise the logits themselves (unit = 1). As in
  // forward_kernel, exp(l - max l) = exp2(x c - max x c), c = unit log2 e.
  const float scale = p.scale, softcap = p.softcap;
  const bool logits = has_bias || softcap > 0.0f;
  const float unit = logits ? 1.0f : scale, c_log2 = unit * kLog2e;
  constexpr float kNearMax = 256.0f;
  constexpr float kStale = 8.0f;  // forward_kernel's lazily moved row maxima
  float row_max[2] = {-kInf, -kInf}, row_sum[2] = {0.0f, 0.0f};

  // P of the previous tile, the A operand of O += P V: the accumulator's 16
  // groups of 8 keys are 8 k-slices of 16.
  using ARegs = Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>>;
  Tensor rP = make_tensor<Element>(ARegs{});
  auto mma_pv = [&](int s) {
    Tensor tOrV = thr_o.partition_fragment_B(stage_vt(s));
    warpgroup_fence_operand(rP);
    wgmma_batch<false>(mma_o, rP, tOrV, acc_o);
  };

  // Iteration i; kPipelined (all but the first): with the previous tile's P V.
  auto iteration = [&](int i, auto pipelined) {
    constexpr bool kPipelined = decltype(pipelined)::value;
    const int n = tile_of(i), s = i % kStages;
    Barrier::wait(full + s, (i / kStages) & 1);
    Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor tSrK = thr_s.partition_fragment_B(stage_k(s));
    wgmma_batch<true>(mma_s, tSrQ, tSrK, acc_s);
    if constexpr (kPipelined) mma_pv((i - 1) % kStages);
    // While they run: this tile's mask bits.
    std::uint64_t bits[2][2] = {{0, 0}, {0, 0}};
    if (has_mask) {
      const std::int64_t word = std::int64_t{n} * kBlockN / 32;
      const bool second = std::int64_t{n} * kBlockN + 64 < key_count;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (row0 + my_row[half] >= sq) continue;
        bits[half][0] = *reinterpret_cast<const std::uint64_t*>(bits_row[half] + word);
        if (second) bits[half][1] = *reinterpret_cast<const std::uint64_t*>(bits_row[half] + word + 2);
      }
    }
    if constexpr (kPipelined)
      warpgroup_wait<1>();
    else
      warpgroup_wait<0>();

    // The logits (SPEC 1: softcap, then the bias) and the allowed set: with a
    // mask, the tile's bits (the pre-pass folded causal, the window and the key
    // range into them); without, a tile wholly inside the band and the keys
    // tests no element. Each condition is tested once a tile, outside the
    // element loops.
    const std::int64_t col0 = std::int64_t{n} * kBlockN;
    const bool whole = !has_mask && col0 + kBlockN <= sk && band_covers(p, offset, row0, blk.row_last, col0, col0 + kBlockN - 1);
    const int qrows = clamp_to_tile(sq - row0), kcols = clamp_to_tile(sk - col0);
    const TileBand band(p, offset, row0, col0);
    const float* bias_cols = bias_smem + s * kBlockN;
    const auto for_each = [&](auto&& f) {
#pragma unroll
      for (int e = 0; e < kAccS; ++e) f(e, e / 2 % 2, col_base + 8 * (e / 4) + e % 2);
    };
    if (softcap > 0.0f) {
      const float inner = scale / softcap;
      for_each([&](int e, int, int) { acc_s(e) = softcap * tanhf(acc_s(e) * inner); });
    }
    if (has_bias) {
      const float pre = softcap > 0.0f ? 1.0f : scale;
      for_each([&](int e, int, int kj) { acc_s(e) = fmaf(acc_s(e), pre, bias_cols[kj]); });
    }
    if (has_mask) {
      for_each([&](int e, int half, int kj) {
        const int word = e / 4 / 8;  // keys 64 word on
        if (!((bits[half][word] >> (kj - 64 * word)) & 1)) acc_s(e) = -kInf;
      });
    } else if (!whole) {
      for_each([&](int e, int half, int kj) {
        const int qi = my_row[half];
        if (!(qi < qrows && kj < kcols && kj >= qi + band.lo && kj <= qi + band.hi)) acc_s(e) = -kInf;
      });
    }

    // Online softmax (forward_kernel's): lazily moved maxima, the exact
    // exponent for large logits.
    float correction[2];
    bool moved = false, far = false;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = row_max[half];
#pragma unroll
      for (int e = 2 * half; e < kAccS; e += 4) mx = fmaxf(mx, fmaxf(acc_s(e), acc_s(e + 1)));
      mx = quad_max(mx);
      const bool row_moved = (mx - row_max[half]) * c_log2 > kStale;
      correction[half] = row_moved ? exp2_ftz((row_max[half] - mx) * c_log2) : 1.0f;
      row_sum[half] *= correction[half];
      moved |= row_moved;
      if (row_moved) row_max[half] = mx;
      far |= row_max[half] != -kInf && fabsf(row_max[half]) > kNearMax;
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

    if constexpr (kPipelined) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(rP);
      Barrier::arrive(empty + (i - 1) % kStages);
    }
    if (__any_sync(0xffffffff, moved)) {
#pragma unroll
      for (int e = 0; e < size(acc_o); ++e) acc_o(e) *= correction[e / 2 % 2];
    }
    using Convert = cutlass::NumericArrayConverter<Element, float, kAccS>;
    *reinterpret_cast<cutlass::Array<Element, kAccS>*>(raw_pointer_cast(rP.data())) =
        Convert{}(*reinterpret_cast<const cutlass::Array<float, kAccS>*>(raw_pointer_cast(acc_s.data())));
  };
  if (tiles > 0) iteration(0, std::false_type{});
  for (int i = 1; i < tiles; ++i) iteration(i, std::true_type{});
  if (tiles > 0) {  // the last tile's P V
    mma_pv((tiles - 1) % kStages);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_o);
  }

  // Epilogue: o = acc / sum (0 for a row with no allowed key), lse = max + log(sum).
  const int d = p.head_dim;
  auto* out = static_cast<Element*>(p.out.data) + b * p.out.sb + h * p.out.sh + (blk.qs + row0) * p.out.sr;
  Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float sum = quad_sum(row_sum[half]);
    inv[half] = sum > 0.0f ? 1.0f / sum : 0.0f;
    const std::int64_t row = row0 + my_row[half];
    if (p.lse.data != nullptr && lane % 4 == 0 && row < sq)
      static_cast<float*>(p.lse.data)[b * p.lse.sb + h * p.lse.sh + (blk.qs + row) * p.lse.sr] =
          sum > 0.0f ? row_max[half] * unit + logf(sum) : -kInf;
  }
#pragma unroll
  for (int e = 0; e < size(acc_o); e += 2) {
    const int half = e / 2 % 2, qi = get<0>(cO(e)), f = get<1>(cO(e));
    if (row0 + qi >= sq || f >= d) continue;
    out[qi * p.out.sr + f] = static_cast<Element>(acc_o(e) * inv[half]);
    if (f + 1 < d) out[qi * p.out.sr + f + 1] = static_cast<Element>(acc_o(e + 1) * inv[half]);
  }
#endif
}

// Launches the Hopper forward for this launch if it may (forward_sm90_eligible,
// one split, key lists built for its block_m rows, an sm_90 device running the
// kernel's sm_90a code) and sets *launched; the launch's error, if any.
template <class Element, int kHeadDim>
cudaError_t launch_forward_sm90(const ForwardParams& p, int block_m, cudaStream_t stream, bool* launched) {
  *launched = false;
  if constexpr (kHeadDim != 128) {
    return cudaSuccess;
  } else {
    using Config = ForwardSm90Config<Element, kHeadDim>;
    if (p.num_splits != 1 || block_m != Config::kBlockM || !forward_sm90_eligible(p)) return cudaSuccess;
    auto kernel = forward_kernel_sm90<Config>;
    bool runs = false;
    const cudaError_t err = prepare_sm90(kernel, Config::kSmemBytes, &runs);
    if (!runs) return err;
    const std::int64_t blocks_m = (p.seqlen_q + Config::kBlockM - 1) / Config::kBlockM;
    const auto grid = static_cast<unsigned>(blocks_m * p.batch * p.heads);
    kernel<<<grid, Config::kThreads, Config::kSmemBytes, stream>>>(p);
    *launched = true;
    return cudaGetLastError();
  }
}

}  // namespace dmattn::cuda
