// Tile sizes of the CUDA kernels and the launch heuristics, with their
// reasons, in one place: the kernels' configurations (fwd/config.cuh,
// bwd/config.cuh) are built from them and the dispatch (dispatch.cu) decides
// with them.
#pragma once

#include <algorithm>
#include <cstdint>

namespace dmattn::cuda {

// ---- Forward, sm80-class kernel (mma.sync, four warps) ----
constexpr int kForwardWarps = 4;
// 128 query rows up to D = 128: the O accumulator (128 x D floats over 128
// threads) then takes ~128 registers a thread; wider heads halve the rows.
constexpr int forward_block_m(int head_dim) { return head_dim <= 128 ? 128 : 64; }
// Few query rows (decode, and decode with folded query heads) take the
// smallest tile the four warps make over the rows: half the wasted rows of the
// 128-row tile.
constexpr int kForwardDecodeRows = 16 * kForwardWarps;
// At most 16 query rows (one query row with up to 16 query heads folded in)
// take the key-split tile: 16 rows, each warp a quarter of every key tile with
// its own online softmax, the warps' partial rows added at the end. On the
// 64-row tile three of the four warps held no real row of such a call, yet
// each read the whole K and V tile from shared memory and multiplied it.
constexpr int kForwardKeySplitRows = 16;
// 64 keys a tile up to D = 128 (S and P of 128 x 64 next to O of 128 x 128
// just fit at D = 128); above, 32 (the 64-row tile is every call's there). The
// 64-row tile (decode, bound by reading K and V) took 32-key tiles in four
// stages at D = 128 before: two CTAs an SM of 4 warps, each warp running
// every tile's fixed part (barrier, cp.async issue, row reductions) for 32
// keys. 64-key tiles in two stages (the same two CTAs an SM) took decode at
// B = 4, Sk = 131072, 32 / 8 heads 0.741 -> 0.600 ms (H200); 32-key tiles with
// three CTAs an SM 0.635, with four 0.619 (docs/kernels.md).
constexpr int forward_block_n(int head_dim) { return head_dim <= 128 ? 64 : 32; }
// The tiles of a decode call up to D = 128 (kForwardDecodeRows and
// kForwardKeySplitRows; above, the 64-row tile is every call's).
constexpr bool forward_decode_tile(int head_dim, int block_m) {
  return block_m <= kForwardDecodeRows && head_dim <= 128;
}
// K/V stages: the 128-row tile is compute-bound and loads one tile while it
// computes another. The decode tile takes the most stages that leave two CTAs
// an SM: four up to D = 64 (76 KiB a CTA), two at D = 128 (82 KiB; four would
// take 148). Above D = 128 the 64-row tile takes two, so that its CTA fits the
// 99 KiB of sm_86 / sm_89 (D = 256: 97.5 KiB; four stages took 163).
constexpr int forward_stages(int head_dim, int block_m) {
  return forward_decode_tile(head_dim, block_m) && head_dim <= 64 ? 4 : 2;
}

// ---- Hopper kernels (sm_90a: wgmma, TMA): their head dims ----
// Multiples of 64 features (TMA boxes and 128-byte swizzle atoms of 64); a
// head dim between two runs on the next one padded, TMA filling the features
// past it with zeros. The forward at D' = 64, 128, 192 and 256; the dk/dv
// kernel at 64, 128 and 256 (above 128 each warpgroup takes half the features
// as an MMA operand from shared memory: D = 192's 96 are not whole 64-feature
// swizzle atoms; 192 runs on 256's, padded, where 256 is compiled:
// dispatch.cu plan_backward).
constexpr bool sm90_forward_head_dim(int head_dim) { return head_dim % 64 == 0 && head_dim <= 256; }
constexpr bool sm90_backward_head_dim(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

// ---- Forward, Hopper kernel ----
// 128 query rows a CTA (two warpgroups of 64), two K and two V buffers in
// flight. D = 128: key tiles of 128 (O and S take 64 registers a thread each, P
// 32: 240 a consumer thread, 232 in the key-list walk), one CTA an SM. D = 64:
// key tiles of 64 in 128 registers (S 32, P 16, O 32), two CTAs an SM. At D =
// 64 the exponentials cost as much as the MMAs (16 a cycle an SM either way),
// so the overlap decides: against one CTA of 192 x 128 or 128 x 128 tiles (the
// same time), 3.37 -> 2.85 ms (B = 1, 32 / 8 heads, S = 16384, causal; H100).
// D = 192 and 256: key tiles of 64, for the shared memory (Q, two K and two V
// buffers: 144 and 192 KiB; 128-key tiles would need 240 and 320) and the
// registers (O takes 96 and 128 a thread, S 32, P 16), one CTA an SM.
constexpr int kForwardSm90BlockM = 128;
constexpr int forward_sm90_block_n(int head_dim) { return head_dim == 128 ? 128 : 64; }
constexpr int forward_sm90_ctas_per_sm(int head_dim) { return head_dim <= 64 ? 2 : 1; }
// Above D = 64 every walk is warp-specialized. A producer warpgroup
// issues every load (TMA of Q, K and V; the key-only bias) into the two K and
// two V buffers, guarded by full and empty mbarriers, so that the consumer
// warpgroups never meet at a CTA barrier; it hands its registers to them
// (setmaxnreg: 24 and 240, persistent or gathering 40 and 232; 384 threads of one CTA an
// SM). The consumers take turns at issuing their MMAs (named barriers), so
// that one's softmax runs under the other's MMAs (ping-pong): 4.14 -> 3.43 ms
// (0.93x cuDNN's) at B = 1, 32 / 8 heads, S = 16384, 1.34 -> 1.24 at B = 16,
// S = 2048 (causal; H100). Not at D = 64: two CTAs an SM overlap there already, and a producer warpgroup
// would leave the consumers 104 registers (a producer warp: 96, the SM's four
// register files each holding 5 of the 18 warps; both spill). With one CTA an
// SM instead (the registers then fit) it gained nothing on long rows and lost
// on short CTAs, whose prologue and epilogue the second CTA had overlapped
// (H100, forward ms, main in the same call, bf16, causal): 128 x 128 tiles with
// the producer and the ping-pong, B = 1, 32 / 8 heads, S = 16384 2.76-3.01
// against 2.66-2.87, B = 16, 16 / 4 heads, S = 2048 0.52-0.56 against
// 0.445-0.450, key bias S = 16384 3.36-3.45 against 3.20; 192 x 128 with three
// consumer warpgroups (FlashAttention 3's tile; 160 registers a consumer, 260 B
// spilled) 2.67-2.95, 0.54-0.56, 3.19 (docs/kernels.md). The lock step
// already keeps the tensor pipe and the exponentials (XU) 42.6% and 45.4%
// busy, the other two 40.5 / 42.0 and 43.4 / 45.0 (ncu, S = 16384; 16 warps an
// SM against 9 and 13 active). The key-list walk's producer gathers the
// scattered rows with all four warps (the lock step, every thread gathering
// after its MMAs, one CTA barrier a tile, ran 1.2-1.3x longer: H100, key bias,
// w = 1024, S = 4096 0.353 -> 0.304 ms, S = 8192 0.766 -> 0.648, and at
// S >= 16384, where the sm80 gathered walk had been as fast, S = 16384
// 1.52 -> 1.21 and w = 2048, S = 131072 19.5 -> 15.3 against it).
constexpr bool forward_sm90_producer(int head_dim) { return head_dim > 64; }
// The warp-specialized walks (a producer warpgroup) of
// short rows are persistent: one CTA an SM takes a query block a round, and
// the producer loads the next block's Q (once the consumers' last S = Q K^T of
// a block is done) and first K and V tiles while the consumers finish a block
// (its last P V, the epilogue's stores), which a CTA a block leaves exposed
// where a block walks few tiles. H100, bf16, causal, 32 / 8 heads, forward ms,
// a CTA a block (main d8a1856) against this, one run: B = 16, S = 2048
// 1.227 -> 1.142; key bias, B = 8, S = 2048 0.825 -> 0.784, S = 4096
// 0.310 -> 0.295. Longer rows keep a CTA a block: persistent there, key bias,
// S = 8192 1.07 -> 1.13 and S = 16384 4.19 -> 4.55 (the static rounds of long
// blocks drift apart, which the hardware's own order of CTAs avoids). The
// key-list walk is persistent at every length: a block's list holds about w
// keys whatever S is, so its blocks stay short (H100, key bias, forward ms, a
// CTA a block against persistent, two rounds: w = 1024, S = 4096
// 0.300 -> 0.295, S = 16384 1.20 -> 1.16, B = 4 x 8192 2.20 -> 2.08; w = 2048,
// S = 65536 7.29 -> 7.10; S = 8192 within 1%).
constexpr int kForwardPersistentKeys = 4096;
constexpr bool forward_sm90_persistent(int head_dim, bool key_lists, std::int64_t seqlen_k) {
  return forward_sm90_producer(head_dim) && (key_lists || seqlen_k <= kForwardPersistentKeys);
}

// ---- Top-k selection (sparse/select_intervals.cu) ----
// The fused interval selection (at most 4096 keys, a CTA a selection head)
// spends a third of its time on the queries: where the grid leaves SMs idle,
// up to 8 CTAs share a head, each sorting and building the wavelet levels
// again and querying its part of the keys.
constexpr int kMaxFusedSelectionParts = 8;
constexpr int fused_selection_parts(std::int64_t heads, int sms) {
  int parts = 1;
  while (parts < kMaxFusedSelectionParts && heads * parts * 2 <= sms) parts *= 2;
  return parts;
}
// Few heads of at most 4096 keys count each key's beaters instead (no sort,
// O(n^2) compares a head, 64 keys a CTA, each CTA loading the head's n
// strengths): heads x keys x (keys + 1536) up to 3 x 2^26, where the counting
// takes less than the sort's ~35-50 us. H100, key bias, w = 256, ms a call,
// sorted -> counted: 8 heads x 1024 / 2048 / 4096 keys 0.035 -> 0.010,
// 0.038 -> 0.015, 0.047 -> 0.033; 32 heads x 1024 / 2048 / 4096 0.035 ->
// 0.018, 0.039 -> 0.040, 0.050 -> 0.109; 128 x 1024 0.038 -> 0.058.
constexpr int kMaxCountedSelectionKeys = 4096;
constexpr bool counted_selection(std::int64_t heads, std::int64_t keys) {
  return keys <= kMaxCountedSelectionKeys && heads * keys * (keys + 1536) <= (std::int64_t{3} << 26);
}

// ---- Split-KV (forward) ----
// Key splits for a grid of `ctas` CTAs over `key_blocks` key blocks: as many as
// fill the `slots` CTAs the GPU holds at once (one wave: a second, partial wave
// would double the time), at least 4 key blocks a split so that the partials
// stay cheap next to the work, and at most 32. A grid of the decode tiles
// (`whole_waves`: bound by reading K and V) of more than one wave whose last
// wave is at most half full takes the splits, at most 4, that give it the
// fewest waves per unit of work, ceil(ctas s / slots) / s: that wave's CTAs,
// alone on their SMs, read slowly (B = 64, Sk = 4096, 32 / 8 heads: 512 CTAs,
// 1.29 waves, 72% of the H200's DRAM bandwidth; split in 3: 0.295 -> 0.254
// ms). A fuller last wave costs less than the splits' partial rows (1024 CTAs
// split in 3: 0.481 -> 0.491 ms). slots() (a CUDA occupancy query) is asked
// only where the grid leaves SMs idle or (whole_waves) fills them.
template <class Slots>
int choose_splits(std::int64_t ctas, std::int64_t key_blocks, int sms, bool whole_waves, Slots slots) {
  if (key_blocks < 8 || (ctas >= sms && !whole_waves)) return 1;
  const std::int64_t n = slots();
  if (ctas < sms) {
    const std::int64_t want = std::max<std::int64_t>(1, n / ctas);
    return static_cast<int>(std::max<std::int64_t>(1, std::min({want, key_blocks / 4, std::int64_t{32}})));
  }
  const std::int64_t last = ctas % n;  // the last wave's CTAs
  if (ctas <= n || last == 0 || 2 * last > n) return 1;
  const auto waves = [&](std::int64_t splits) { return (ctas * splits + n - 1) / n; };
  int best = 1;
  for (int s = 2; s <= 4 && key_blocks / s >= 4; ++s)
    if (waves(s) * best < waves(best) * s) best = s;
  return best;
}

// ---- Backward, sm80-class kernels (dq; dk, dv and dbias; mma.sync, 8 warps) ----
// Head dims with a CUDA backward (CMakeLists.txt mirrors this): above 128 the
// warps split the features in two halves of whole 32-feature swizzle atoms
// (192 and 256).
constexpr bool backward_compiled(int head_dim) { return head_dim <= 128 || head_dim % 64 == 0; }
constexpr int kBackwardWarps = 8;
// Rows a CTA owns (keys of dk/dv, queries of dq): 16 a warp up to D = 128.
// Above 128 features the accumulators of 16 rows x D a warp (dK and dV: 256
// registers a thread at D = 256) do not fit: two warps then own the same 16
// rows, each the accumulators of half the features (the feature split), and a
// CTA owns 64 rows. The small tiles below take 64 rows too, for the shared
// memory of half the rows: the dq kernel's with the feature split (64-multiple
// head dims), the dk/dv kernel's up to D = 128 with the column split: two warps
// own the same 16 keys, each the S and dP of half a step's queries and dK, dV
// over them (partial sums, added once at the end), so that no product is
// computed twice (the feature split computes S and dP in both warps): at
// D = 128 and 99 KiB fwd+bwd 63.3 -> 59.8 ms (B = 1, 32 / 8 heads,
// S = 16384, causal; H100; the large tile at 163 KiB: 36.9).
constexpr int backward_rows(int head_dim) { return head_dim > 128 ? 64 : 128; }
// Columns a step: the accumulators of 16 x D / split rows a warp (dK and dV,
// or dQ) and the S and dP tiles of 16 x step must fit in 255 registers; the dq
// kernel takes 64 columns up to D = 128, 32 above (within sm_80's 163 KiB).
// dk/dv takes 64 queries up to D = 64, where a step of 32 spent more on the
// step (its barrier, loads and dQ reductions) than on its products, 32 above.
constexpr int backward_dkv_step(int head_dim) { return head_dim > 64 ? 32 : 64; }
constexpr int backward_dq_step(int head_dim) { return head_dim > 128 ? 32 : 64; }
// S and dP in one k-loop (two independent MMA chains): registers for two
// k-slices, which above D = 64 spill: at D = 256 on sm_90a (bf16: 620 / 648 B
// instead of 196 / 252), at D = 128 the large dk/dv tile on sm_80 / 86 / 89
// (404 / 432 B; 0 apart) and the column split's dk/dv walk (64 rows, D > 64)
// on sm_90a (dK and dV accumulators stored and reloaded every step). D = 64
// pairs them without a spill on every architecture.
constexpr bool backward_paired_sdp(int head_dim) { return head_dim <= 64; }
// dq by float32 atomics from the dk/dv kernel (Problem::deterministic false):
// its dQ = dS^T K tiles are 16 queries x 16 features on 2 x 4 warps, 64
// features a pass.
constexpr bool backward_atomic_dq(int head_dim) { return head_dim % 64 == 0; }

// The sm80-class dk/dv kernel of the dense walk (bwd/dkv_sm80.cuh: no mask,
// top-k, softcap, bias with rows or deterministic dq) at head dims 64 and 128:
// a CTA owns `keys` keys and walks 64-query steps, P and dS through shared
// memory, with `buffers` buffers of Q, dO and their statistics (two: a step's
// loads are issued as the step before ends; one: after its dK and dV
// products). The large tile is 128 keys with two buffers (D = 128: 162 KiB,
// an A100's 163; D = 64: 98 KiB, an RTX 4090's 99); the small one, where the
// large does not fit, 64 keys with one (D = 128: 81 KiB).
struct DenseDkvTile {
  int keys, buffers;
};
constexpr bool dkv_sm80_dense_head_dim(int head_dim) { return head_dim == 64 || head_dim == 128; }
constexpr DenseDkvTile dkv_sm80_dense_tile(int head_dim, bool small) {
  return small && head_dim > 64 ? DenseDkvTile{64, 1} : DenseDkvTile{128, 2};
}

// Shared memory a block may opt in to on the smallest GPUs of the sm80 class,
// sm_86 / sm_89 (RTX 3090 / 4090, L40): 99 KiB (an A100 gives 163, an H100 227).
constexpr int kSmemSm86 = 99 * 1024;
// ... and on an sm_90 GPU (H100, H200): 227 KiB.
constexpr int kSmemSm90 = 227 * 1024;
// A backward kernel's tile: rows a CTA owns and columns a step. Each kernel
// has a large tile (the rows and steps above) and a small one: the first of
// (large rows, 32 columns) and (64 rows with a split, 32 columns)
// whose CTA fits kSmemSm86, or the large one where none does (bwd/config.cuh
// backward_tile). The dispatch runs the large tile where the device's opt-in
// limit allows it, else the small one, else refuses the head dim.
struct BackwardTile {
  int rows, step;
};
constexpr BackwardTile backward_large_tile(int head_dim, bool key_rows) {
  return {backward_rows(head_dim), key_rows ? backward_dkv_step(head_dim) : backward_dq_step(head_dim)};
}
// The feature split needs halves of whole 32-feature atoms, the column split
// (dk/dv, 64 rows, D <= 128) steps of two 16-query halves; 16 rows a warp
// without a split need D <= 128 (the accumulators' registers).
constexpr bool backward_column_split(int head_dim, bool key_rows, BackwardTile tile) {
  return key_rows && head_dim <= 128 && 16 * kBackwardWarps / tile.rows == 2;
}
constexpr bool backward_tile_valid(int head_dim, bool key_rows, BackwardTile tile) {
  const int split = 16 * kBackwardWarps / tile.rows;
  if (backward_column_split(head_dim, key_rows, tile)) return tile.step % 32 == 0;
  return (split == 1 && head_dim <= 128) || (split == 2 && head_dim % 64 == 0);
}

// ---- Backward, Hopper dk/dv kernel (sm_90a: wgmma, TMA, bulk reductions) ----
// 128 keys a CTA (a warpgroup 64; one top-k key group) and query steps of 64
// at D = 128 (dK and dV take 128 registers a thread, S and dP 64), 128 at
// D = 64 (dK and dV 64, S and dP 128; 200 B of loop-invariant addresses
// spilled): a step's fixed costs (its barrier, TMA issue, dQ store and
// reduction) over twice the work, backward 7.67 -> 7.05 ms against 64-query
// steps (B = 1, 32 / 8 heads, S = 16384, causal; H100). dQ of a step is one
// float32 block (bwd/config.cuh DqBlocks).
// Above D = 128 the dK and dV accumulators of 128 keys (2 D registers a
// thread) and Q and dO's buffers (256 KiB with K and V at D = 256) do not fit:
// a CTA owns 64 keys (`dkv_sm90_split_features`), each warpgroup computes S
// and dP of half the step's 64 queries, P^T and dS^T meet in shared memory,
// and each keeps dK and dV of half the features (128 registers at D = 256)
// and computes dQ over them, its block staged in the step's Q and dO buffers
// once every MMA of the step is done. The dense walk only (the dispatch plans
// the others on the sm80-class kernel there). H100, D = 256, S = 8192, 32 / 8
// heads, causal: the dk/dv kernel 21.7 ms (sm80-class) -> 9.7 (both
// warpgroups computing all of S and dP) -> 9.55 (split).
constexpr int kDkvSm90BlockN = 128;
constexpr bool dkv_sm90_split_features(int head_dim) { return head_dim > 128; }
constexpr int dkv_sm90_block_n(int head_dim) { return dkv_sm90_split_features(head_dim) ? 64 : kDkvSm90BlockN; }
constexpr int dkv_sm90_block_m(int head_dim) { return head_dim <= 64 ? 128 : 64; }

}  // namespace dmattn::cuda
