// The forward kernels' configurations: tile shapes, shared-memory layouts and
// sizes of the sm80-class kernel (fwd/kernel_sm80.cuh; a 128-row and a 64-row
// tile) and of the Hopper kernel (fwd/kernel_sm90.cuh, D = 64 to 256), from
// heuristics.h. The dispatch reads their sizes without instantiating a kernel.
#pragma once

#include <cuda.h>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include <cstdint>

#include <type_traits>

#include "../common/sm90.cuh"
#include "../heuristics.h"

namespace dmattn::cuda {

template <class Element_, int kHeadDim_, int kBlockM_ = forward_block_m(kHeadDim_)>
struct ForwardConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kWarps = kForwardWarps;
  static constexpr int kBlockN = forward_block_n(kHeadDim);
  static constexpr bool kDecodeTile = forward_decode_tile(kHeadDim, kBlockM);
  static constexpr int kThreads = kWarps * 32;
  // The key-split tile (kForwardKeySplitRows): the warps lie over the keys of
  // a tile, kWarpKeys each, every warp over all the rows; the other tiles lie
  // over the rows, every warp over all the keys.
  static constexpr bool kKeySplit = kBlockM == kForwardKeySplitRows;
  static constexpr int kKeyWarps = kKeySplit ? kWarps : 1, kRowWarps = kWarps / kKeyWarps;
  static constexpr int kWarpKeys = kBlockN / kKeyWarps;
  static constexpr int kRowsPerThread = 2 * kBlockM / (16 * kRowWarps);  // two rows per 16-row MMA tile
  // CTAs an SM the registers must allow: the key-split tile's accumulators are
  // small and its CTA (~70 KiB) fits three times, which ptxas's 187 registers
  // at D = 64 would not allow.
  static constexpr int kMinCtas = kKeySplit ? 3 : 1;
  static constexpr int kStages = forward_stages(kHeadDim, kBlockM);
  // Shared memory rows of 64 elements (128 bytes) swizzled so that ldmatrix is
  // conflict-free; heads that are not a multiple of 64 use 32-element rows.
  static constexpr int kSmemRow = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kSmemRow == 64 ? 3 : 2;

  using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, cute::SM80_16x8x16_F32F16F16F32_TN,
                                   cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  // Warp w owns rows 16 w + 16 kWarps m + (0..15) of the tile (m < kBlockM /
  // (16 kWarps)); on the key-split tile each warp is an MMA of its own (every
  // row; the thread's index in it is its lane).
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<MmaOp>, cute::Layout<cute::Shape<cute::Int<kRowWarps>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kRowWarps>, cute::_16, cute::_16>>;
  using SmemAtom = decltype(cute::composition(
      cute::Swizzle<kSwizzleBits, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kSmemRow>>, cute::Stride<cute::Int<kSmemRow>, cute::_1>>{}));
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  // A K or V tile, and the keys of one warp (kWarpKeys rows from the warp's
  // first times kHeadDim elements on: the key-split tile lays its swizzle
  // atoms out row by row, so that a warp's rows are one contiguous block).
  using KvOrder = std::conditional_t<kKeySplit, cute::Step<cute::_2, cute::_1>, cute::Step<cute::_1, cute::_2>>;
  using SmemLayoutKV =
      decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}, KvOrder{}));
  using SmemLayoutWarpKV =
      decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kWarpKeys>, cute::Int<kHeadDim>>{}, KvOrder{}));
  // A warp's V seen as (feature, key): the B operand of P @ V, read with transposing ldmatrix.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutWarpKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kWarpKeys>>{}, cute::GenRowMajor{})));
  using LdsmAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using LdsmAtomT = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;

  static constexpr int kTileElems = kBlockN * kHeadDim;  // one K or V stage buffer
  // Behind Q, K and V, each stage has the mask bits of its tile (kBlockM 64-bit
  // rows), a key-only bias row (kBlockN floats) and its key indices (kBlockN).
  static constexpr int kExtrasBytes = kStages * (kBlockM * 8 + kBlockN * 8);
  static constexpr int kSmemBytes =
      (kBlockM + 2 * kStages * kBlockN) * kHeadDim * int(sizeof(Element)) + kExtrasBytes;
  // The key-split tile adds its warps' partial rows through the K and V stages
  // at the end: each warp's O (in its accumulators' register order), then the
  // rows' maxima and sums.
  static constexpr int kPartialFloats = kWarps * 32 * (kBlockM * kHeadDim / 32) + 2 * kWarps * kBlockM;
  static_assert(!kKeySplit || (kPartialFloats * 4 <= 2 * kStages * kTileElems * int(sizeof(Element)) &&
                               kWarpKeys % 16 == 0),
                "the key-split tile's partial rows fit its K and V stages; a warp's keys are whole MMA k-steps");
};

template <class Element_, int kHeadDim_>
struct ForwardSm90Config {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kForwardSm90BlockM;              // query rows a CTA, 64 a warpgroup
  static constexpr int kBlockN = forward_sm90_block_n(kHeadDim);  // keys a tile
  static constexpr int kCtasPerSm = forward_sm90_ctas_per_sm(kHeadDim);  // the register budget's launch bound
  // Two consumer warpgroups (the MMAs and the softmax); the walks add a
  // producer warpgroup where heuristics.h says so, which gives its registers
  // to the consumers (setmaxnreg): 128 x 24 + 256 x 240 = 384 x 168, the
  // launch bound's share of one CTA an SM; `wide` (a persistent walk, or the
  // key lists' gathers), 128 x 40 + 256 x 232: the producer's walk over several
  // query blocks spilled in 24 (and serialized its loads of a tile's key-only
  // bias), its gathers 120 B; the consumers' 232 spill nothing (the one-block
  // dense walk keeps 240: a key bias at S = 16384 ran 3% slower with 232).
  static constexpr int kConsumerThreads = 256;
  static constexpr int kProducerThreads = forward_sm90_producer(kHeadDim) ? 128 : 0;
  static constexpr int threads(bool producer) { return kConsumerThreads + (producer ? kProducerThreads : 0); }
  static constexpr int producer_regs(bool wide) { return wide ? 40 : 24; }
  static constexpr int consumer_regs(bool wide) { return wide ? 232 : 240; }
  // setmaxnreg.inc waits until the CTA's own released registers cover it: the
  // split must fit what the launch gives 384 threads (168 each, of 65536 in
  // steps of 8).
  static constexpr bool regs_fit(bool wide) {
    return kProducerThreads * producer_regs(wide) + kConsumerThreads * consumer_regs(wide) <=
           threads(true) * (65536 / threads(true) / 8 * 8);
  }
  static_assert(kProducerThreads == 0 || (kCtasPerSm == 1 && regs_fit(false) && regs_fit(true)),
                "a producer warpgroup with one CTA an SM, its registers within the launch's");
  static_assert(kBlockM == 128 && sm90_forward_head_dim(kHeadDim), "two warpgroups of 64 rows, a head dim of the Hopper kernels");

  using Atom = decltype(cute::GMMA::Layout_K_SW128_Atom<Element>{});
  using LayoutQ = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using LayoutKV = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  // V seen as (feature, key): the MN-major B operand of O += P V.
  using LayoutVt = decltype(cute::composition(
      LayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  // Two warpgroups over the rows: S = Q K^T (64 x kBlockN a warpgroup) and
  // O += P V (P from registers, V MN-major).
  using TwoWarpgroups = cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>;
  using MmaS = WgmmaSS<Element, 64, kBlockN, kHeadDim, TwoWarpgroups>;
  using MmaO = WgmmaRS<Element, 64, kHeadDim, kBlockN, TwoWarpgroups, cute::GMMA::Major::MN>;

  static constexpr int kQElems = kBlockM * kHeadDim, kKvElems = kBlockN * kHeadDim;
  // Q, two buffers of K, two of V, two of the key-only bias (floats, a K
  // buffer's tile), three of a key list's keys (ints), then the barriers (at
  // these indices): the Q buffers full, the K and V buffers full, the K and V
  // buffers empty, the Q buffers empty. The persistent dense walk has a
  // second Q buffer behind them where it fits (kSecondQ), so that the
  // producer loads the next block's Q while the consumers still use this one's.
  static constexpr int kQFull = 0, kKFull = 2, kVFull = 4, kKEmpty = 6, kVEmpty = 8, kQEmpty = 10, kBarriers = 12;
  static constexpr int kBiasAt = (kQElems + 4 * kKvElems) * int(sizeof(Element));
  static constexpr int kKeysAt = kBiasAt + 2 * kBlockN * int(sizeof(float));
  static constexpr int kBarriersAt = kKeysAt + 3 * kBlockN * int(sizeof(int));
  static constexpr int kSmemBytes = kBarriersAt + kBarriers * 8;
  static constexpr int kQ1At = (kSmemBytes + 1023) / 1024 * 1024;
  static constexpr int kTwoQSmemBytes = kQ1At + kQElems * int(sizeof(Element));
  static constexpr bool kSecondQ = kTwoQSmemBytes <= kSmemSm90;
  // The walk of a bias with rows (ForwardWalk::kRowBias) has two buffers of
  // its kBlockM x kBlockN tiles (Element, boxes of 64 keys laid out as Q's
  // atoms) where the others keep the key-only bias and the list's keys.
  static constexpr int kBiasTileElems = kBlockM * kBlockN;
  static constexpr int kTileBarriersAt = kBiasAt + 2 * kBiasTileElems * int(sizeof(Element));
  static constexpr int kTileSmemBytes = kTileBarriersAt + kBarriers * 8;
  static_assert(kBiasAt % 1024 == 0 && kTileSmemBytes * kCtasPerSm <= kSmemSm90,
                "bias tiles at a swizzle atom's alignment, within the shared memory of an SM");
  // The barriers from `bars` (barriers_at()): the K and V buffers' empty ones
  // serve producer walks, Q empty persistent ones. A producer
  // walk's K buffer's full barrier takes an arrival from each lane of the
  // producer's warp (after its bias stores; a key list's K and V buffers' two
  // from each producer thread, one when its gathers land), its empty one from
  // each consumer thread (after its bias reads); a V buffer's empty barrier
  // one from each consumer warp (wgmma reads V).
  template <bool kLists>
  static __device__ void init_barriers(std::uint64_t* bars) {
    using Barrier = cutlass::arch::ClusterTransactionBarrier;
    constexpr bool kProducer = kProducerThreads > 0;
    constexpr int kListArrivals = 2 * kProducerThreads;
    for (int s = 0; s < 2; ++s) {
      Barrier::init(bars + kQFull + s, 1), Barrier::init(bars + kQEmpty + s, kConsumerThreads);
      Barrier::init(bars + kKFull + s, kLists && kProducer ? kListArrivals : kProducer ? 32 : 1);
      Barrier::init(bars + kVFull + s, kLists && kProducer ? kListArrivals : 1);
      Barrier::init(bars + kKEmpty + s, kConsumerThreads), Barrier::init(bars + kVEmpty + s, kConsumerThreads / 32);
    }
    cutlass::arch::fence_barrier_init();
  }
  static constexpr int barriers_at(bool tiles) { return tiles ? kTileBarriersAt : kBarriersAt; }
  // A walk's shared memory: with bias tiles, or with two Q buffers, or neither.
  static constexpr int smem_bytes(bool tiles, bool two_q) {
    return tiles ? kTileSmemBytes : two_q ? kTwoQSmemBytes : kSmemBytes;
  }
};

// The TMA descriptors of Q, K and V: (feature, row, head, batch), boxes of 64
// features x kBlockM (Q) or kBlockN (K, V) rows, 128-byte swizzled as the
// tiles' atoms; and of a bias with rows, where its walk runs.
struct ForwardSm90Maps {
  CUtensorMap q, k, v;
  CUtensorMap bias;  // (key, row, bias head, batch), boxes of 64 keys x kBlockM rows
};

}  // namespace dmattn::cuda
