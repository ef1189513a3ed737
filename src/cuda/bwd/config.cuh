// The backward kernels' configurations: tile shapes, shared-memory layouts and
// sizes of the sm80-class dq and dk/dv kernels (bwd/kernel_sm80.cuh) and of
// the Hopper dk/dv kernel (bwd/kernel_sm90.cuh), from heuristics.h, and the
// Hopper kernel's dq blocks. The dispatch reads their sizes without
// instantiating a kernel.
#pragma once

#include <cuda.h>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "../common/sm90.cuh"
#include "../heuristics.h"
#include "../sparse/selection.h"

namespace dmattn::cuda {

// The shared-memory layout of a CTA of the dq kernel (key_rows false) or the
// dk/dv kernel with `tile` (bf16 and fp16 alike), in elements and floats:
//   rows      two row tiles (dq: Q, dO; dk/dv: K, V), rows x D each
//   columns   two buffers of two column tiles (dq: K, V; dk/dv: Q, dO), step x D
//   stats     row statistics (max, inv, delta): dq of its rows, dk/dv of a
//             step's columns in two buffers
//   add       the staged tile (bias / allowed term; dk/dv: then dS^T for dq by
//             atomics and the dS kept for dbias), rows x add_ld floats, a
//             key-only bias of the step's keys (rows floats), and with the
//             column split the key dbias sums one warp hands the other (rows)
//   then 16 bytes a row: dq, the list bits of the rows (two buffers of 64-bit
//   words); dk/dv, the keys of the rows and their intervals.
struct BackwardLayout {
  int split;     // warps a row block: 2 with the feature or the column split
  bool columns;  // the column split (heuristics.h backward_column_split)
  int stat_floats, keep_ds_at, add_ld, bytes;
};
constexpr BackwardLayout backward_layout(int head_dim, bool key_rows, BackwardTile tile) {
  BackwardLayout l{};
  l.split = 16 * kBackwardWarps / tile.rows;
  l.columns = backward_column_split(head_dim, key_rows, tile);
  l.stat_floats = key_rows ? 6 * tile.step : 3 * tile.rows;
  // dk/dv: dS^T (Element, two buffers of `step` queries) from float column
  // `step` on; with the feature split both warps of a row block read the
  // staged term, so the stager keeps dS behind the dS^T buffers instead of
  // over it. Rows 4 words past a multiple of 32: fewer bank conflicts.
  l.keep_ds_at = key_rows && l.split > 1 && !l.columns ? 2 * tile.step : 0;
  const int used = key_rows ? std::max(2 * tile.step, l.keep_ds_at + tile.step) : tile.step;
  l.add_ld = (used + 31) / 32 * 32 + 4;
  const int floats = l.stat_floats + tile.rows * l.add_ld + (l.columns ? 2 : 1) * tile.rows;
  l.bytes = (2 * tile.rows + 4 * tile.step) * head_dim * 2 + floats * 4 + tile.rows * 16;
  return l;
}

// The tile of the dq kernel (key_rows false) or the dk/dv kernel: the large
// one, or with `small` the first candidate that is valid and fits kSmemSm86
// (heuristics.h), else the large one.
constexpr BackwardTile backward_tile(int head_dim, bool key_rows, bool small) {
  const BackwardTile large = backward_large_tile(head_dim, key_rows);
  if (small)
    for (const BackwardTile tile : {large, BackwardTile{large.rows, 32}, BackwardTile{64, 32}})
      if (backward_tile_valid(head_dim, key_rows, tile) && backward_layout(head_dim, key_rows, tile).bytes <= kSmemSm86)
        return tile;
  return large;
}

// The sm80-class dq kernel (kKeyRows false) or dk/dv kernel with a tile of
// kRows rows and kStep columns (BackwardKernelConfig: the large or the small one).
template <class Element_, int kHeadDim_, bool kKeyRows_, int kRows_, int kStep_>
struct BackwardConfig {
  using Element = Element_;
  static_assert(sizeof(Element) == 2, "16-bit elements (backward_layout)");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kKeyRows = kKeyRows_;  // dk/dv (the CTA's rows are keys) or dq
  static constexpr BackwardTile kTile{kRows_, kStep_};
  static constexpr BackwardLayout kLayout = backward_layout(kHeadDim, kKeyRows, kTile);
  static constexpr int kWarps = kBackwardWarps;
  static constexpr int kThreads = kWarps * 32;
  // 64 rows: warps w and w + kMmaWarps own the same 16 rows (4-warp MMAs).
  // Feature split: both compute the same S, dP, P and dS tiles over the whole
  // head dim (only the first one stages dS), and each keeps the accumulators
  // of its half of the features (kAccDim). Column split (dk/dv): each computes
  // those of its half of the step's columns (kWarpStep from column0 w /
  // kMmaWarps * kWarpStep) and the accumulators of all features over them,
  // the second warp's added into the first's at the end.
  static constexpr int kSplit = kLayout.split;
  static constexpr bool kColumnSplit = kLayout.columns;
  static constexpr int kFeatureSplit = kColumnSplit ? 1 : kSplit;
  static constexpr int kMmaWarps = kWarps / kSplit, kMmaThreads = kMmaWarps * 32;
  static constexpr int kAccDim = kHeadDim / kFeatureSplit;
  static constexpr int kBlockRows = kTile.rows;  // the CTA's own rows: keys (dk/dv) or queries (dq)
  static_assert(kHeadDim <= 256 && backward_compiled(kHeadDim), "a head dim with a CUDA backward");
  static_assert(backward_tile_valid(kHeadDim, kKeyRows, kTile) && 16 * kMmaWarps == kBlockRows, "16 rows a warp");
  // A top-k key group (selection.h, kKeyGroupKeys keys) is walked by
  // kGroupBlocks CTAs, each over the group's rows with its share of the keys.
  static constexpr int kGroupBlocks = kKeyGroupKeys / kBlockRows;
  static_assert(kGroupBlocks * kBlockRows == kKeyGroupKeys, "a key group splits into whole CTAs");
  static constexpr int kStep = kTile.step;  // columns a step: queries (dk/dv) or keys (dq)
  static constexpr int kWarpStep = kColumnSplit ? kStep / 2 : kStep;  // a warp's columns of a step
  static constexpr bool kPairedSdp = backward_paired_sdp(kHeadDim);
  static constexpr int kSmemRow = kAccDim % 64 == 0 ? 64 : 32;  // a feature half is whole atoms (D = 192: 3 of 32)
  static constexpr int kSwizzleBits = kSmemRow == 64 ? 3 : 2;
  using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, cute::SM80_16x8x16_F32F16F16F32_TN,
                                   cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<MmaOp>, cute::Layout<cute::Shape<cute::Int<kMmaWarps>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<kBlockRows>, cute::_16, cute::_16>>;
  using SmemAtom = decltype(cute::composition(
      cute::Swizzle<kSwizzleBits, 3, 3>{},
      cute::Layout<cute::Shape<cute::_8, cute::Int<kSmemRow>>, cute::Stride<cute::Int<kSmemRow>, cute::_1>>{}));
  using SmemLayoutRows = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockRows>, cute::Int<kHeadDim>>{}));
  using SmemLayoutCols = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kStep>, cute::Int<kHeadDim>>{}));
  // A warp's columns of a column tile as (column, feature), the B operand of
  // A0 B0^T and A1 B1^T, and seen as (feature, column), a thread's kAccDim
  // features: the B operand of dS B0 and P B1. The column half c starts
  // kWarpStep * kSmemRow elements on, the feature half f kStep * kAccDim
  // (whole swizzle atoms, so the offsets commute with the swizzle).
  using SmemLayoutWarpCols = decltype(cute::composition(
      SmemLayoutCols{}, cute::make_layout(cute::Shape<cute::Int<kWarpStep>, cute::Int<kHeadDim>>{},
                                          cute::Stride<cute::_1, cute::Int<kStep>>{})));
  using SmemLayoutColsT = decltype(cute::composition(
      SmemLayoutCols{}, cute::make_layout(cute::Shape<cute::Int<kAccDim>, cute::Int<kWarpStep>>{},
                                          cute::Stride<cute::Int<kStep>, cute::_1>{})));
  static_assert(kWarpStep % 16 == 0, "a warp's columns are whole k-steps of dS B0");
  static_assert(!kColumnSplit || (kBlockRows * kHeadDim * 4 <= 4 * kStep * kHeadDim * 2),
                "the column split adds the accumulators through the column buffers");
  using LdsmAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using LdsmAtomT = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;

  static constexpr int kRowElems = kBlockRows * kHeadDim, kColElems = kStep * kHeadDim;
  static constexpr int kStatFloats = kLayout.stat_floats;
  static constexpr int kKeepDsAt = kLayout.keep_ds_at;  // dk/dv: the dS tile kept for dbias
  static constexpr int kAddLd = kLayout.add_ld;
  static_assert(kAddLd % 32 == 4, "rows of the staged tile 4 banks apart");
  static_assert((kStatFloats + kBlockRows * kAddLd + kBlockRows) % 2 == 0,
                "the per-row words behind the floats are 8-byte aligned");
  static constexpr int kSmemBytes = kLayout.bytes;

  // dq by atomics (BackwardParams::dq_acc), dk/dv kernel: dQ of a step (kStep
  // queries x D) = dS^T K, 2 x 4 warps over the output (16 queries x 16 columns
  // an MMA tile, so head dims that are multiples of 64). dS^T is staged as
  // Element in the columns of tile_add that the dk/dv kernel leaves free (it
  // stages kStep of kAddLd), two buffers (by the step's buf) so that the
  // product of a step can run after the barrier that opens the next one: key
  // r's queries at r * kDsLd + kDsAt + buf * kStep elements, 16-byte rows
  // kAddLd words apart, so that ldmatrix and the stores hit every bank once.
  static constexpr bool kAtomicDq = kKeyRows && backward_atomic_dq(kHeadDim);
  static constexpr int kDsLd = 2 * kAddLd, kDsAt = 2 * kStep;
  static_assert(!kKeyRows || kDsAt + 2 * kStep <= kDsLd, "two dS^T buffers fit in the unused columns of tile_add");
  using TiledMmaDq = cute::TiledMMA<cute::MMA_Atom<MmaOp>, cute::Layout<cute::Shape<cute::_2, cute::_4, cute::_1>>,
                                    cute::Tile<cute::Int<kStep>, cute::_64, cute::_16>>;
  static_assert(!kKeyRows || kStep % 32 == 0, "dk/dv: two warps of 16 queries a step, or twice that");
  // dS^T as (query, key), and the CTA's key rows as (feature, key): A and B of dS^T K.
  using SmemLayoutDsT = cute::Layout<cute::Shape<cute::Int<kStep>, cute::Int<kBlockRows>>, cute::Stride<cute::_1, cute::Int<kDsLd>>>;
  using SmemLayoutRowsT = decltype(cute::composition(
      SmemLayoutRows{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockRows>>{}, cute::GenRowMajor{})));
};

// The configuration of the dq (kKeyRows false) or dk/dv kernel with the large
// or the small tile (one type, one kernel, where the two tiles are the same).
template <class Element, int kHeadDim, bool kKeyRows, bool kSmall>
using BackwardKernelConfig = BackwardConfig<Element, kHeadDim, kKeyRows, backward_tile(kHeadDim, kKeyRows, kSmall).rows,
                                            backward_tile(kHeadDim, kKeyRows, kSmall).step>;

// The sm80-class dk/dv kernel of the dense walk (bwd/dkv_sm80.cuh) with a
// tile of kBlockN keys a CTA and kBuffers buffers (heuristics.h
// dkv_sm80_dense_tile), steps of kBlockM queries. Three tiled MMAs of 8 warps: S and dP (queries x keys) and
// dQ (queries x features) 2 x 4 warps, dK and dV (keys x features) 4 x 2 at
// 128 keys, 2 x 4 at 64; each warp's columns of a tile in pairs of 8, so that
// one ldmatrix x4 loads a k-slice of its B operand.
template <class Element_, int kHeadDim_, int kBlockN_, int kBuffers_>
struct DkvSm80Config {
  using Element = Element_;
  static_assert(sizeof(Element) == 2 && dkv_sm80_dense_head_dim(kHeadDim_), "16-bit elements, D = 64 or 128");
  static constexpr int kHeadDim = kHeadDim_, kBlockM = 64;
  static constexpr int kBlockN = kBlockN_, kBuffers = kBuffers_;
  static constexpr int kThreads = 32 * kBackwardWarps;
  using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, cute::SM80_16x8x16_F32F16F16F32_TN,
                                   cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  template <int kWarpsM>
  using Mma = cute::TiledMMA<cute::MMA_Atom<MmaOp>, cute::Layout<cute::Shape<cute::Int<kWarpsM>, cute::Int<8 / kWarpsM>, cute::_1>>,
                             cute::Tile<cute::Int<16 * kWarpsM>, cute::Int<16 * (8 / kWarpsM)>, cute::_16>>;
  using MmaSdp = Mma<2>;
  using MmaDq = Mma<2>;
  using MmaDkv = Mma<kBlockN / 32>;
  using LdsmAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using LdsmAtomT = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  // Rows of 64 elements in 128-byte swizzled atoms of 8 rows; the transposed
  // views (feature, key), (feature, query) and (key, query) are the operands
  // ldmatrix.trans reads.
  using SmemAtom = decltype(cute::composition(cute::Swizzle<3, 3, 3>{},
                                              cute::Layout<cute::Shape<cute::_8, cute::_64>, cute::Stride<cute::_64, cute::_1>>{}));
  using LayoutKV = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using LayoutQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using LayoutPds = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  using LayoutKt = decltype(cute::composition(
      LayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using LayoutQt = decltype(cute::composition(
      LayoutQ{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
  using LayoutPdsT = decltype(cute::composition(
      LayoutPds{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
  // Elements: K, V, kBuffers of Q and of dO, P, dS; then bytes: kBuffers of
  // the queries' statistics (max, inv, delta), three floats a key (the key
  // dbias sums of the two warps of a column block, the key-only bias).
  static constexpr int kKvElems = kBlockN * kHeadDim, kQElems = kBlockM * kHeadDim, kPdsElems = kBlockM * kBlockN;
  static constexpr int kQAt = 2 * kKvElems, kDoAt = kQAt + kBuffers * kQElems;
  static constexpr int kPAt = kDoAt + kBuffers * kQElems, kDsAt = kPAt + kPdsElems;
  static constexpr int kStatsAt = (kDsAt + kPdsElems) * 2, kStatFloats = 3 * kBlockM;
  static constexpr int kSumsAt = kStatsAt + kBuffers * kStatFloats * 4;
  static constexpr int kSmemBytes = kSumsAt + 3 * kBlockN * 4;
  static_assert(kSmemBytes <= (kBlockN == 64 || kHeadDim == 64 ? kSmemSm86 : 163 * 1024), "the tiles heuristics.h names");
};
// The configuration of the large or the small tile (one type where they are the same).
template <class Element, int kHeadDim, bool kSmall>
using DkvSm80KernelConfig = DkvSm80Config<Element, kHeadDim, dkv_sm80_dense_tile(kHeadDim, kSmall).keys,
                                          dkv_sm80_dense_tile(kHeadDim, kSmall).buffers>;

// The Hopper dk/dv kernel's dq_acc (BackwardParams::dq_blocks) at head dim
// kFeatures: blocks of kRows query rows (the kernel's step, heuristics.h) x
// kFeatures of (b, h) from ((b * heads + h) * blocks of the query length +
// block) * kRows * kFeatures, the float32 sums of one step, added by one bulk
// reduction a warp. The two warpgroups of the step's dQ MMA lie over the rows
// (kRowGroups, kRows = 128) or the features (kColGroups), warpgroup g at row
// group g % kRowGroups and feature group g / kRowGroups, each 64 rows x
// kGroupCols features. Warp w (of 8) holds its dQ accumulators at
// kWarpFloats w in register order, registers 4 j .. 4 j + 3 of lane l at
// 128 j + 4 l. By the wgmma accumulator layout (m64nNk16) these are (row, c),
// (row, c + 1), (row + 8, c), (row + 8, c + 1) with row = its row group's
// first + 16 (w % 4) + l / 4 and c = its feature group's first + 8 j + 2 (l % 4).
template <int kFeatures>
struct DqBlocks {
  static constexpr int kWarps = 8;  // the kernel's
  static constexpr int kRows = dkv_sm90_block_m(kFeatures);
  static constexpr int kRowGroups = kRows / 64, kColGroups = 2 / kRowGroups;
  static constexpr int kGroupCols = kFeatures / kColGroups;
  static constexpr int kWarpFloats = 16 * kGroupCols;  // 64 x kGroupCols over a warpgroup's 4 warps
  static constexpr int kQuads = kRows * kFeatures / 4;
  static_assert(kRowGroups * kColGroups == 2, "two warpgroups");
  // Quad q (4 floats) of a block: its first row and feature, the second pair 8 rows below.
  __device__ static void quad(int q, int* row, int* col) {
    const int w = q / (kWarpFloats / 4), j = q % (kWarpFloats / 4) / 32, l = q % 32, g = w / 4;
    *row = 64 * (g % kRowGroups) + 16 * (w % 4) + l / 4;
    *col = kGroupCols * (g / kRowGroups) + 8 * j + 2 * (l % 4);
  }
};

template <class Element_, int kHeadDim_>
struct DkvSm90Config {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  // Keys a CTA: 64 a warpgroup, or (kSplitFeatures, above D = 128) 64 that
  // both warpgroups walk, each with half the step's queries of S and dP and
  // half the features of dK, dV and dQ.
  static constexpr bool kSplitFeatures = dkv_sm90_split_features(kHeadDim_);
  static constexpr int kBlockN = dkv_sm90_block_n(kHeadDim_);
  static constexpr int kBlockM = dkv_sm90_block_m(kHeadDim);  // queries a step
  static_assert(sm90_backward_head_dim(kHeadDim), "a head dim of the Hopper kernels");
  using Dq = DqBlocks<kHeadDim>;
  static constexpr int kThreads = 32 * Dq::kWarps;

  // K-major 128-byte swizzled tiles (rows of 64 elements), as wgmma reads them;
  // the transposed views (feature or key, row) are the MN-major operands.
  using Atom = decltype(cute::GMMA::Layout_K_SW128_Atom<Element>{});
  using LayoutKV = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using LayoutQ = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using LayoutDs = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}));
  using LayoutKt = decltype(cute::composition(
      LayoutKV{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));
  using LayoutQt = decltype(cute::composition(
      LayoutQ{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>>{}, cute::GenRowMajor{})));
  using LayoutDsT = decltype(cute::composition(
      LayoutDs{}, cute::make_layout(cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}, cute::GenRowMajor{})));

  // S^T, dP^T: 128 keys x kBlockM queries, a warpgroup 64 keys (split: 64
  // keys, the warpgroups over the queries). dK, dV: 128 keys x D, A from
  // registers (split: 64 keys, the warpgroups over the features, P^T and dS^T
  // from shared memory, where both warpgroups' halves meet). dQ: kBlockM
  // queries x D, the warpgroups as DqBlocks lays them out.
  using OverRows = cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>;  // warpgroups over the rows
  using OverCols = cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>;  // ... over the columns
  using DqGroups = cute::Layout<cute::Shape<cute::Int<Dq::kRowGroups>, cute::Int<Dq::kColGroups>, cute::_1>>;
  using MmaSdp = std::conditional_t<kSplitFeatures, WgmmaSS<Element, 64, kBlockM / 2, kHeadDim, OverCols>,
                                    WgmmaSS<Element, 64, kBlockM, kHeadDim, OverRows>>;
  using MmaDkv = std::conditional_t<
      kSplitFeatures,
      WgmmaSS<Element, 64, kHeadDim / 2, kBlockM, OverCols, cute::GMMA::Major::K, cute::GMMA::Major::MN>,
      WgmmaRS<Element, 64, kHeadDim, kBlockM, OverRows, cute::GMMA::Major::MN>>;
  using MmaDq = WgmmaSS<Element, 64, Dq::kGroupCols, kBlockN, DqGroups, cute::GMMA::Major::MN, cute::GMMA::Major::MN>;
  // The walk of bias tiles (DkvWalk::kBiasTiles) keeps dS as the bias tile
  // lies in its buffer, (query, key) in rows of keys: the K-major A of dQ.
  using LayoutDsRows = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{}));
  using MmaDqRows =
      WgmmaSS<Element, 64, Dq::kGroupCols, kBlockN, DqGroups, cute::GMMA::Major::K, cute::GMMA::Major::MN>;

  static constexpr int kKvElems = kBlockN * kHeadDim, kQElems = kBlockM * kHeadDim, kDsElems = kBlockN * kBlockM;
  // K, V, two buffers of Q and dO (a buffer D / 64 TMA boxes of 64 features),
  // two of dS^T, one of dQ (float32, DqBlocks; ordered dq: kOrderedDqBuffers,
  // below), two of the step's row statistics (16 bytes a query), the barriers
  // of the two Q / dO buffers, then 16 bytes a key: its index, its piece's info (KeyPieces) and its rows
  // in the current selection head (key groups). The walk of a bias with rows
  // (DkvWalk::kRowBias) has no key area: its dbias sums over the query heads
  // of a bias head (kDbSumAt, a float a thread's S^T element, kThreads apart)
  // lie there instead, where they fit the 227 KiB of an sm_90 GPU (D = 128;
  // kDbSums), and the dispatch plans the walk at D = 64 only where a kv head's
  // steps never share a dbias tile.
  // Split: P^T (as dS^T) where the dQ buffer lies otherwise (a warp stages its
  // dQ floats in the step's Q and dO buffers, dq_stage).
  static constexpr int kTxBytes = 2 * kQElems * int(sizeof(Element));
  static constexpr int kDsAt = (2 * kKvElems + 4 * kQElems) * int(sizeof(Element));
  static constexpr int kDqAt = kDsAt + 2 * kDsElems * int(sizeof(Element)), kPtAt = kDqAt;
  static constexpr int kDqBytes = kSplitFeatures ? kDsElems * int(sizeof(Element)) : kQElems * int(sizeof(float));
  // dS^T (key, query) as 128-byte swizzle atoms of 64 queries, one after
  // another along the queries (sw128_offset within one).
  static constexpr int kDsAtomBytes = kBlockN * 128;
  static_assert(kBlockM % 64 == 0, "rows of dS^T are whole 128-byte swizzle atom rows");
  static constexpr int kStatsAt = kDqAt + kDqBytes;
  static constexpr int kBarriersAt = kStatsAt + 2 * 16 * kBlockM;
  static constexpr int kKeysAt = kBarriersAt + 16;
  static constexpr int kSmemBytes = kKeysAt + 16 * kBlockN;
  static constexpr int kDbSumAt = kKeysAt, kDbSumBytes = kDsElems * int(sizeof(float));
  static constexpr bool kDbSums = kDbSumAt + kDbSumBytes <= kSmemSm90;
  static constexpr int kRowBiasSmemBytes = kDbSums ? std::max(kSmemBytes, kDbSumAt + kDbSumBytes) : kSmemBytes;
  // Ordered dq (DkvWalk::kOrdered): a dQ-writer warpgroup behind the two MMA
  // warpgroups (its first warp adds the steps' dQ blocks in order; it hands its
  // registers to them, setmaxnreg: 128 x 24 + 256 x 240 = 384 x 168, what the
  // launch bound gives a CTA, one an SM: setmaxnreg.inc takes only registers
  // that a setmaxnreg.dec of the CTA released, and waits for them), and
  // kOrderedDqBuffers dQ buffers: the second over the key area (the dense
  // walk does not use it) where that fits (D = 128; not at D = 64).
  static constexpr int kWriterThreads = 128, kWriterRegs = 24, kMmaRegs = 240;
  static constexpr int threads(bool ordered) { return kThreads + (ordered ? kWriterThreads : 0); }
  static_assert(kWriterThreads * kWriterRegs + kThreads * kMmaRegs <= threads(true) * (65536 / threads(true) / 8 * 8),
                "the MMA warpgroups' registers come from the writer's");
  static constexpr int kDq2At = kKeysAt;
  static constexpr int kOrderedDqBuffers = kDq2At + kQElems * int(sizeof(float)) <= kSmemSm90 ? 2 : 1;
  static constexpr int kOrderedSmemBytes =
      kOrderedDqBuffers == 2 ? std::max(kSmemBytes, kDq2At + kQElems * int(sizeof(float))) : kSmemBytes;
  static_assert(kSplitFeatures || kBlockN == kKeyGroupKeys, "a top-k key group is one CTA");
  static_assert(kBlockM == Dq::kRows, "a step's dQ is one DqBlocks block");
  static_assert(!kSplitFeatures || (Dq::kRowGroups == 1 && 4 * Dq::kWarpFloats * 4 == kQElems * int(sizeof(Element))),
                "split: the dQ floats of a warpgroup's four warps fill one Q or dO buffer");
  static_assert(kSmemBytes <= kSmemSm90, "within the shared memory of an sm_90 GPU");
  // Split: warp w's dQ staging in buffer buf of Q (w < 4) or dO, once both
  // warpgroups' dK and dV MMAs have read them.
  __device__ static float* dq_stage(Element* q_smem, Element* do_smem, int buf, int warp) {
    return reinterpret_cast<float*>((warp < 4 ? q_smem : do_smem) + buf * kQElems) + warp % 4 * Dq::kWarpFloats;
  }
};

// dbias, written directly (no slices), as TMA addresses its tiles: (key, row,
// bias head, batch) of its own shape, so that query head h of batch entry b
// stores at (h / bias_group, b) (a dimension of 1: b or h / bias_group is 0).
inline BiasTileExtent dbias_tile_extent(const BackwardParams& p) { return {{p.db_batch, p.seqlen_q}, p.db_heads}; }

// The TMA descriptors of Q and dO: (feature, row, head, batch), boxes of 64
// features x kBlockM rows, 128-byte swizzled as the tiles' atoms.
struct DkvSm90Maps {
  CUtensorMap q, dout;
  CUtensorMap bias, dbias;  // DkvWalk::kBiasTiles: (key, row, bias head, batch), boxes of 64 keys x kBlockM rows
};

}  // namespace dmattn::cuda
