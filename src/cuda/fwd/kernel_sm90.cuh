// The Hopper forward (sm_90a): warpgroup MMAs (wgmma) and TMA loads for the
// query blocks of head dims up to 64, 128, 192 and 256 (zero-padded) without split-KV,
// batched or varlen, with no bias, a key-only one or (batched, no mask or
// top-k) a full one, softcap, the user's mask and top-k. The dispatch plans it
// where it applies (dispatch.cu forward_sm90_refusal); everything else runs
// forward_kernel (fwd/kernel_sm80.cuh). docs/kernels.md "The Hopper forward"
// tells how it works and what each choice measured.
//
// Two consumer warpgroups own a CTA's 128 query rows, 64 each, and walk key
// tiles of kBlockN (128 at D = 128; 64 at D = 64, two CTAs an SM, and at 192
// and 256), the last first. Tile
// i's S = Q K^T is issued with tile i - 1's O += P V, so that the softmax of
// one runs under the other's MMAs. K and V have two buffers each, an mbarrier
// each that its load completes. Above D = 64 a producer warpgroup issues every
// load into buffers the consumers released (empty barriers) and the consumers
// take turns at issuing their MMAs (named barriers); at D = 64 one thread
// issues the loads and the CTA meets at one barrier a tile. Persistent walks
// (heuristics.h forward_sm90_persistent) take a query block a round, the
// producer loading the next block's Q and first tiles under the last ones
// (the dense walk: into a second Q buffer, and a block's epilogue is written
// under the next block's first S = Q K^T: forward_two_q).
//
// The walks (ForwardWalk), a kernel each so that the dense walk keeps its
// registers: kDense; kRowBias, a full bias whose tile loads by TMA with its K;
// kMasked, the user's mask by tile class (empty tiles skipped, full ones
// untested) and bit; kKeyLists, a block's key list (top-k, with a mask or not),
// a run of consecutive keys loaded by TMA, other keys gathered by cp.async into
// the layout TMA writes. Varlen: the TMA maps span the packed rows; a tile's
// rows or keys past its sequence are masked as past a batched length.
#pragma once

#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
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
#include "../params.h"
#include "block.cuh"
#include "config.cuh"
#include "tile_sm90.cuh"

namespace dmattn::cuda {

// The forward's walks: every key tile of the band, the user's mask by tile
// class and bit, the key lists (top-k, with a mask or not).
enum class ForwardWalk { kDense, kMasked, kKeyLists, kRowBias };

// The walks with two Q buffers: the persistent dense one, where they fit. Its
// blocks' epilogues then run under the next block's first S = Q K^T (the
// persistent mask walk spilled 80 B so; the key lists' walk, whose producer
// gathers, ran 3% slower at S = 16384, w = 1024 with the shared memory they take).
template <class Config>
constexpr bool forward_two_q(ForwardWalk walk, bool persistent) {
  return persistent && walk == ForwardWalk::kDense && Config::kSecondQ;
}

// kPersistent (a producer walk's): the CTAs take the query blocks in turn
// (heuristics.h forward_sm90_persistent); otherwise a CTA a block.
template <class Config, ForwardWalk kWalk, bool kPersistent>
__global__ void __launch_bounds__(Config::threads(Config::kProducerThreads > 0), Config::kCtasPerSm)
    forward_kernel_sm90(const __grid_constant__ ForwardParams p, const __grid_constant__ ForwardSm90Maps maps) {
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using namespace cute;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN, kHeadDim = Config::kHeadDim;
  using Element = typename Config::Element;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  using cutlass::arch::NamedBarrier;
  constexpr bool kMasked = kWalk == ForwardWalk::kMasked, kLists = kWalk == ForwardWalk::kKeyLists;
  constexpr bool kRowBias = kWalk == ForwardWalk::kRowBias;
  constexpr bool kProducer = Config::kProducerThreads > 0;
  static_assert(kProducer || !kPersistent, "a persistent walk has a producer warpgroup");
  constexpr int kConsumers = Config::kConsumerThreads, kProducers = Config::kProducerThreads;
  // The key-list walk without a producer (D = 64): every thread gathers, the
  // CTA meets at one barrier a tile.
  constexpr bool kGatherAll = kLists && !kProducer;
  // Named barriers (producer walks): warpgroup w waits at kTurn + w for its
  // turn to issue MMAs and passes it at the other's.
  constexpr int kTurn = 0;

  // tid: the consumer thread (the producer's are negative); warp_group and
  // wg (the consumer warpgroup) from a shuffle (canonical_warp_group_idx),
  // which the compiler knows to be warp-uniform, as the role tests are.
  const int tid = static_cast<int>(threadIdx.x) - kProducers, lane = threadIdx.x % 32;
  const int warp_group = cutlass::canonical_warp_group_idx(), wg = warp_group - (kProducer ? 1 : 0);
  const bool has_bias = p.bias.data != nullptr, key_bias = !kRowBias && has_bias;

  extern __shared__ __align__(1024) char smem[];
  auto* q_smem = reinterpret_cast<Element*>(smem);
  // The Q buffers (forward_two_q): the CTA's u-th Q in buffer u % kQBuffers.
  // With two, a block's epilogue waits for the next block's first S = Q K^T
  // to be issued and runs under it (kDeferStore).
  constexpr int kQBuffers = forward_two_q<Config>(kWalk, kPersistent) ? 2 : 1;
  constexpr bool kDeferStore = kQBuffers == 2;
  auto q_buffer = [&](int qb) { return qb == 0 ? q_smem : reinterpret_cast<Element*>(smem + Config::kQ1At); };
  Element* k_smem = q_smem + Config::kQElems;  // two buffers
  Element* v_smem = k_smem + 2 * Config::kKvElems;  // two buffers
  auto* bias_smem = reinterpret_cast<float*>(smem + Config::kBiasAt);  // two buffers
  auto* bias_tiles = reinterpret_cast<Element*>(smem + Config::kBiasAt);  // kRowBias: two buffers
  // The list's keys of iteration j's tile in buffer j % 3 (-1 past the list),
  // staged one iteration ahead of their gathers.
  auto* keys_smem = reinterpret_cast<int*>(smem + Config::kKeysAt);
  auto* bars = reinterpret_cast<std::uint64_t*>(smem + Config::barriers_at(kRowBias));
  std::uint64_t* q_full = bars + Config::kQFull;    // kQBuffers
  std::uint64_t* k_full = bars + Config::kKFull;    // two
  std::uint64_t* v_full = bars + Config::kVFull;    // two
  std::uint64_t* k_empty = bars + Config::kKEmpty;  // two (producer walks)
  std::uint64_t* v_empty = bars + Config::kVEmpty;  // two (producer walks)
  std::uint64_t* q_empty = bars + Config::kQEmpty;  // kQBuffers (persistent walks): its S = Q K^T are done
  auto stage_k = [&](int s) {
    return make_tensor(make_smem_ptr(k_smem + s * Config::kKvElems), typename Config::LayoutKV{});
  };
  auto stage_vt = [&](int s) {
    return make_tensor(make_smem_ptr(v_smem + s * Config::kKvElems), typename Config::LayoutVt{});
  };
  // The barriers, once a CTA (and what the threads staged before).
  auto init_barriers = [&] {
    if (threadIdx.x == 0) Config::template init_barriers<kLists>(bars);
    __syncthreads();
  };
  // The CTA's query blocks (persistent: one a round of gridDim.x blocks,
  // rounds alternately from either end, so that the longest-first order of
  // the blocks evens out over the CTAs; otherwise blockIdx.x), one after the
  // other: the buffers' and barriers' uses count on across them, tile j of
  // the CTA's walk in K and V buffer j % 2 (phase j / 2 % 2), the u-th Q in
  // buffer u % kQBuffers (phase u / kQBuffers % 2), so that the producer loads
  // the next block's Q and first tiles while the consumers finish a block.
  int walked = 0, q_loads = 0;  // tiles walked and Qs loaded so far
  typename Config::MmaS mma_s;
  typename Config::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  // The thread's (row, key) of S: two rows (r and r + 8 of its warp's 16),
  // pairs of adjacent keys, 16 groups of 8 keys; element e = c + 2 half + 4 j.
  auto thread_rows = [&] {
    Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    return cute::array<int, 3>{get<0>(cS(0)), get<0>(cS(2)), get<1>(cS(0))};
  };
  constexpr int kAccS = kBlockN / 2;

  // The logit l is x * unit, x: with neither softcap nor bias the raw product
  // q.k (unit = scale); otherwise the logits themselves (unit = 1). As in
  // forward_kernel, exp(l - max l) = exp2(x c - max x c), c = unit log2 e.
  const float scale = p.scale, softcap = p.softcap;
  const bool logits = has_bias || softcap > 0.0f;
  const float unit = logits ? 1.0f : scale, c_log2 = unit * kLog2e;
  float row_max[2] = {-kInf, -kInf}, row_sum[2] = {0.0f, 0.0f};
  clear(acc_o);
  // A block's start: zero O and the row statistics.
  auto start_block = [&] {
    clear(acc_o);
#pragma unroll
    for (int half = 0; half < 2; ++half) row_max[half] = -kInf, row_sum[half] = 0.0f;
  };
  // kDeferStore: the walked block before's rows and rounded output, written
  // under the next block's first S = Q K^T (tile_sm90.cuh RoundedBlock).
  BlockRows pending_rows;
  decltype(round_block<Config>(acc_o, row_max, row_sum, unit)) pending_out;
  bool has_pending = false;
  auto write_pending = [&] {
    if (!has_pending) return;
    const auto at = thread_rows();
    const int my_row[2] = {at[0], at[1]};
    write_block<Config>(p, pending_rows, pending_out, thr_o, my_row, lane);
    has_pending = false;
  };
  // Block `item`: by every thread, the producer warpgroup and the consumers
  // parting here (kEveryone: a CTA a block, as the compiler then keeps the
  // uniform datapath: a key-only bias at S = 16384 ran 4% slower with the
  // roles parted before the call), or by the producer's first warp
  // (kProducing) or the consumers (kConsuming) of a persistent walk.
  enum Role { kEveryone, kProducing, kConsuming };
  auto walk_block = [&](unsigned item, auto role) {
    constexpr Role kRole = decltype(role)::value;
    const ForwardBlock blk(p, kBlockM, kBlockN, item);
    if (blk.row0 >= blk.sq) return;
    const int qb = q_loads % kQBuffers;  // the block's Q buffer, where it walks
    const int h = blk.h, b = blk.b, hk = h / p.group;
    const std::int64_t row0 = blk.row0, sq = blk.sq, sk = blk.sk, offset = blk.offset;
    const int tile_first = blk.tile_first;
    // The block's tiles that no element of tests (the band's; a list's test its bits alone).
    const TileIndices covered = covered_tiles(p.band, offset, sk, row0, blk.row_last, kBlockN);
    // One tile of `rows` (kBlockM for Q, kBlockN for K and V) from the
    // sequence's row `row` of `map` (its first row: `start`) into dst,
    // completing on `bar` (thread 0).
    const int tma_b = p.token_batch(b);
    auto load = [&](auto rows, const CUtensorMap* map, std::uint64_t* bar, Element* dst, std::int64_t start,
                    std::int64_t row, int head) {
      constexpr int kRows = decltype(rows)::value;
      Barrier::arrive_and_expect_tx(bar, kRows * kHeadDim * int(sizeof(Element)));
      tma_load_rows<kRows, kHeadDim>(bar, static_cast<int>(start + row), head, tma_b, std::pair{map, dst});
    };
    // K of the keys from key0 into buffer s (kRowBias: with the bias tile of
    // the block's rows and those keys, completing on the same barrier).
    const int2 bias_at = bias_tile_coords(p, h, b);
    auto load_k = [&](int s, std::int64_t key0) {
      if constexpr (kRowBias) {
        Barrier::expect_transaction(&k_full[s], Config::kBiasTileElems * int(sizeof(Element)));
        tma_bias_tile<kBlockM, kBlockN>(&maps.bias, &k_full[s], bias_tiles + s * Config::kBiasTileElems,
                                        static_cast<int>(row0), static_cast<int>(key0), bias_at);
      }
      load(Int<kBlockN>{}, &maps.k, &k_full[s], k_smem + s * Config::kKvElems, blk.ks, key0, hk);
    };
    // The key list (kLists): its keys, their count, the bits of the block's
    // first row (unused by the other walks, as the gathers' V rows and the
    // mask's tile classes are by theirs).
    [[maybe_unused]] const std::int32_t* list = blk.mask_keys;
    [[maybe_unused]] const int listed = blk.mask_count;
    [[maybe_unused]] const std::uint32_t* list_bits =
        kLists ? p.mask_bits + (blk.mask_block / p.mask_blocks * p.seqlen_q + row0) * p.bits_sr : nullptr;
    // The K or V rows (`stride` elements apart from `rows`) of keys
    // key_of(pass, r) of a tile's rows r (-1: none) into dst (gather_rows_sw128).
    auto gather = [&](auto threads, int t, const auto& key_of, const Element* rows, std::int64_t stride, Element* dst) {
      const auto row_of = [&](int pass, int r) {
        const int key = key_of(pass, r);
        return key >= 0 ? rows + std::int64_t{key} * stride : nullptr;
      };
      gather_rows_sw128<decltype(threads)::value, kBlockN, kHeadDim>(t, row_of, dst, p.head_dim);
    };
    // The lock-step walk's gathers: the keys staged in buffer s, by the consumers.
    auto gather_staged = [&](const Element* rows, std::int64_t stride, Element* dst, int s) {
      gather(Int<kConsumers>{}, tid, [&](int, int r) { return keys_smem[s * kBlockN + r]; }, rows, stride, dst);
    };
    const auto* k_rows = static_cast<const Element*>(p.k.data) + b * p.k.sb + hk * p.k.sh + blk.ks * p.k.sr;
    [[maybe_unused]] const auto* v_rows =
        static_cast<const Element*>(p.v.data) + b * p.v.sb + hk * p.v.sh + blk.ks * p.v.sr;

    // The walk's key tiles, from tile_end - 1 down, the mask's empty ones left
    // out; partial: the tile's elements test the mask.
    const int mh = h / p.mask_group;
    [[maybe_unused]] const std::uint8_t* classes =
        kMasked ? p.tiles.data + b * p.tiles.sb + mh * p.tiles.sh + row0 / kBlockM * p.tiles.sm : nullptr;
    const std::uint32_t* mask_words = kMasked ? p.packed.words + b * p.packed.sb + mh * p.packed.sh : nullptr;
    struct Tile {
      int n;
      bool partial;
      int key0 = -1;  // a list's tile of the consecutive keys [key0, key0 + kBlockN) (TMA); -1: gathered
      int key = -1;   // the lock-step list walk's key at position t of the tile (thread t < kBlockN), -1 past the list
    };
    using Run = ListRun<kBlockN>;
    // The walk's tile after tile n (n < tile_first: none).
    auto next_tile = [&](int n) {
      if constexpr (kMasked) {
        const ClassedTile t = next_classed_tile<-1>(n - 1, tile_first - 1, [&](int m) { return classes[m]; });
        return Tile{t.at, t.partial};
      } else if constexpr (kLists) {
        const int at = (n - 1) * kBlockN;
        const bool mine = kGatherAll && tid < kBlockN && n - 1 >= tile_first && at + tid < listed;
        return Tile{n - 1, false, Run::of(blk, n - 1).start(), mine ? list[at + tid] : -1};
      } else {
        return Tile{n - 1, false};
      }
    };
    const BiasReader<Element> bias_in(p, b, h / p.bias_group, 0, blk.ks, has_bias);
    // The key-only bias of a key (0 for -1), in float.
    auto key_bias_of = [&](std::int64_t key) { return key < 0 || key >= sk ? 0.0f : bias_in.key(key); };
    // ... of key t < kBlockN of tile n (of a list: the key at its position t,
    // staged in buffer s); the lock-step list walk's thread t stages key t.
    auto bias_of = [&](int n, int s, int t) {
      return key_bias_of(kLists ? keys_smem[s * kBlockN + t] : std::int64_t{n} * kBlockN + t);
    };
    auto fetch_bias = [&](int n, int s) { return !key_bias || tid >= kBlockN ? 0.0f : bias_of(n, s, tid); };
    auto store_key = [&](int s, int key) {
      if (tid < kBlockN) keys_smem[s * kBlockN + tid] = key;
    };
    auto store_bias = [&](int s, float x) {  // the lock-step walks' (the producer stages its walks')
      if (!kProducer && key_bias && tid < kBlockN) bias_smem[s * kBlockN + tid] = x;
    };

    Tensor tSrQ = thr_s.partition_fragment_A(make_tensor(make_smem_ptr(q_buffer(qb)), typename Config::LayoutQ{}));
    const auto at = thread_rows();
    const int my_row[2] = {at[0], at[1]}, col_base = at[2];
    if constexpr (kPersistent && !kDeferStore) start_block();  // (a CTA a block: set above)

    // P of the previous tile, the A operand of O += P V: the accumulator's 16
    // groups of 8 keys are 8 k-slices of 16.
    using ARegs = Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>>;
    Tensor rP = make_tensor<Element>(ARegs{});
    // The key-list walk's TMA loads (not every tile's): the parity of each K
    // and V buffer's next completion (bit s: buffer s), and whether the last
    // iteration's V came by TMA.
    unsigned k_parity = 0, v_parity = 0;
    bool v_loaded = false;
    auto wait_loaded = [&](std::uint64_t* full, unsigned& parity, int s) {
      Barrier::wait(&full[s], (parity >> s) & 1);
      parity ^= 1u << s;
    };
    // O += P V of iteration j (its V in buffer j % 2, loaded with parity j / 2 % 2).
    auto mma_pv = [&](int j) {
      if constexpr (!kGatherAll) {
        Barrier::wait(&v_full[j & 1], (j >> 1) & 1);
        if constexpr (kLists) fence_async_shared();
      }
      if (kGatherAll && v_loaded) wait_loaded(v_full, v_parity, j & 1);
      Tensor tOrV = thr_o.partition_fragment_B(stage_vt(j & 1));
      warpgroup_fence_operand(rP);
      wgmma_batch<false>(mma_o, rP, tOrV, acc_o);
    };

    // Prologue: the walk's tile and the one after it (a list's: their keys).
    Tile cur = next_tile(blk.tile_end);
    Tile next = cur.n >= tile_first ? next_tile(cur.n) : Tile{tile_first - 1, false};
    const bool walks = cur.n >= tile_first;
    if constexpr (kGatherAll) store_key(0, cur.key), store_key(1, next.key);
    if constexpr (kRole == kEveryone) init_barriers();  // a list's keys staged too
    if constexpr (kProducer) {
      if (kRole == kProducing || (kRole == kEveryone && warp_group == 0)) {
        if constexpr (kRole == kEveryone) {  // the producer: its first warp issues the loads (a list's: all four)
          cutlass::arch::warpgroup_reg_dealloc<Config::producer_regs(kLists)>();
          if (!kLists && cutlass::canonical_warp_idx_sync() != 0) return;
        }
        const int t = threadIdx.x;  // the producer thread (a dense walk's: its first warp's)
        // Use u >= 1 of buffer j % 2 (tile j = 2 u + j % 2) waits for the
        // consumers' release of use u - 1 (phase u - 1 of its empty barrier).
        auto acquire = [&](std::uint64_t* empty, int j) {
          if (j >= 2) Barrier::wait(&empty[j & 1], ((j >> 1) & 1) ^ 1);
        };
        // A list walk's producer thread holds the keys of its rows of each
        // tile (GatheredRows: two, and the bias of one), loaded a tile ahead:
        // a tile's gathers load no list entry (docs/kernels.md).
        using Held = GatheredRows<kProducers, kBlockN>;
        static_assert(!kLists || (Held::kPerRow == 2 && Held::kPasses <= 2), "two threads a row, one bias a thread");
        using Keys = HeldKeys<kBlockN, Held>;
        // A list's tile into K (with its bias) or V buffer s, by the whole
        // warpgroup (`held`: the thread's keys of the tile): a run of consecutive
        // keys by TMA (thread 0), any other gathered (each thread's copies
        // arrive on the buffer's full barrier once they land); then each
        // thread's bias and zero stores, made visible to the consumers and
        // their wgmma by its arrival.
        auto fill_list = [&](const Tile& tile, int s, bool keys, const Keys& held) {
          std::uint64_t* full = keys ? &k_full[s] : &v_full[s];
          Element* dst = (keys ? k_smem : v_smem) + s * Config::kKvElems;
          // The bias of the thread's row of pass t % 2 (with one row a thread, 64-key
          // tiles: the even threads'), loaded under the gathers.
          const bool bias_mine = keys && key_bias && t % 2 < Held::kPasses;
          const float bias = bias_mine ? key_bias_of(t % 2 ? held.of[Held::kPasses - 1] : held.of[0]) : 0.0f;
          const auto key_of = [&](int pass, int) { return held.of[pass]; };
          if (tile.key0 >= 0) {
            if (t == 0) {
              Barrier::expect_transaction(full, Config::kKvElems * int(sizeof(Element)));
              tma_load_rows<kBlockN, kHeadDim>(full, static_cast<int>(blk.ks + tile.key0), hk, tma_b,
                                               std::pair{keys ? &maps.k : &maps.v, dst});
            }
          } else {
            gather(Int<kProducers>{}, t, key_of, keys ? k_rows : v_rows, keys ? p.k.sr : p.v.sr, dst);
          }
          if (bias_mine) bias_smem[s * kBlockN + Held::row(t, t % 2)] = bias;
          fence_async_shared();
          cp_async_arrive(full);
          Barrier::arrive(full);
        };
        auto load_v = [&](int j, const Tile& tile, const Keys& held) {
          acquire(v_empty, j);
          if constexpr (kLists)
            fill_list(tile, j & 1, false, held);
          else if (t == 0)
            load(Int<kBlockN>{}, &maps.v, &v_full[j & 1], v_smem + (j & 1) * Config::kKvElems, blk.ks,
                 std::int64_t{tile.n} * kBlockN, hk);
        };
        // Q once the consumers are done with the last one's.
        if (walks) {
          if (q_loads >= kQBuffers) Barrier::wait(&q_empty[qb], ((q_loads - kQBuffers) / kQBuffers) & 1);
          if (t == 0) load(Int<kBlockM>{}, &maps.q, &q_full[qb], q_buffer(qb), blk.qs, row0, h);
          ++q_loads;
        }
        // Tile j's K into buffer j % 2 (its bias first, which the buffer's
        // release frees too), then tile j - 1's V.
        const int first = walked;
        int& j = walked;
        Tile prev{0, false};
        // A list's: the thread's keys of the tile and of the one before.
        [[maybe_unused]] Keys keys = kLists ? Keys::of_tile(blk, cur.n, t) : Keys{}, prev_keys{};
        for (Tile tile = cur; tile.n >= tile_first; ++j) {
          // A list's next tile: its run and the thread's keys loaded here,
          // tested and used after this tile's gathers.
          [[maybe_unused]] const Run run = kLists ? Run::of(blk, tile.n - 1) : Run{};
          [[maybe_unused]] const Keys next_keys = kLists ? Keys::of_tile(blk, tile.n - 1, t) : Keys{};
          acquire(k_empty, j);
          if constexpr (kLists) {
            fill_list(tile, j & 1, true, keys);
          } else {
            if (key_bias) {  // the tile's loads first, then its stores: one load latency a tile
              float x[kBlockN / 32];
#pragma unroll
              for (int u = 0; u < kBlockN / 32; ++u) x[u] = bias_of(tile.n, 0, lane + 32 * u);
#pragma unroll
              for (int u = 0; u < kBlockN / 32; ++u) bias_smem[(j & 1) * kBlockN + lane + 32 * u] = x[u];
            }
            if (lane == 0)
              load_k(j & 1, std::int64_t{tile.n} * kBlockN);
            else
              Barrier::arrive(&k_full[j & 1]);
          }
          if (j > first) load_v(j - 1, prev, prev_keys);
          prev = tile, prev_keys = keys, keys = next_keys;
          if constexpr (kLists)
            tile = Tile{tile.n - 1, false, run.start()};
          else
            tile = next_tile(tile.n);
        }
        if (j > first) load_v(j - 1, prev, prev_keys);
        if constexpr (kLists && !kPersistent) cute::cp_async_wait<0>();  // no thread leaves copies in flight
        return;
      }
      if constexpr (kRole == kEveryone) cutlass::arch::warpgroup_reg_alloc<Config::consumer_regs(kLists)>();
    } else if (tid == 0 && walks) {  // Q and the first tile's K, its bias (the CTA's only block)
      load(Int<kBlockM>{}, &maps.q, &q_full[0], q_smem, blk.qs, row0, h);
      if (!kLists || cur.key0 >= 0) load_k(0, kLists ? cur.key0 : std::int64_t{cur.n} * kBlockN);
    }
    if (walks) {
      if (kGatherAll && cur.key0 < 0) {
        gather_staged(k_rows, p.k.sr, k_smem, 0);
        cute::cp_async_fence();
      }
      store_bias(0, fetch_bias(cur.n, 0));
      Barrier::wait(&q_full[qb], kPersistent ? (q_loads / kQBuffers) & 1 : 0);
    }
    // Iteration i over `tile` (n; `following`: the next iteration's, next_n <
    // tile_first: none); kPipelined (all but the first): with the previous
    // tile's P V. Returns the tile after next_n.
    auto iteration = [&](int i, const Tile& tile, const Tile& following, auto pipelined) {
      constexpr bool kPipelined = decltype(pipelined)::value;
      const int buf = i & 1, n = tile.n, next_n = following.n;
      const int keys_next = (i + 1) % 3;  // a list's keys: tile in buffer i % 3, the next and the one after
      const bool partial = tile.partial;
      // A partial tile's mask words: the thread's two rows, keys [n kBlockN, +
      // kBlockN); a list's: their bits of positions [n kBlockN, + kBlockN), 0
      // past the rows and the list (whose last words may be another row's).
      constexpr int kWords = kBlockN / 32;
      std::uint32_t row_bits[2][kWords];
      const int qrows = clamp_to_tile(sq - row0);
      if (kMasked && partial) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int w = 0; w < kWords; ++w)
            row_bits[half][w] = mask_words[(row0 + my_row[half]) * p.packed.so +
                                           (std::int64_t{n} * kWords + w) * p.packed.si];
      }
      if constexpr (kLists) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int w = 0; w < kWords; ++w) {
            const int word = n * kWords + w;
            row_bits[half][w] =
                my_row[half] < qrows && 32 * word < listed ? list_bits[my_row[half] * p.bits_sr + word] : 0u;
          }
        // This thread's copies of K_n (and V_{n-1}) landed, made visible to wgmma by the barrier.
        if constexpr (kGatherAll) {
          cute::cp_async_wait<0>();
          fence_async_shared();
        }
      }
      if constexpr (!kProducer) __syncthreads();  // tile n's bias is staged; every thread is done with iteration i - 1
      // The lock-step walks: K of next_n and V of n, into the buffers that
      // S_{i-1} and P V_{i-2} used (a list's tiles of scattered keys gathered
      // below, after the MMAs are issued).
      const bool k_next_loads = !kProducer && next_n >= tile_first && (!kLists || following.key0 >= 0);
      const bool v_loads = !kProducer && (!kLists || tile.key0 >= 0);
      if (tid == 0) {
        if (k_next_loads) load_k(buf ^ 1, kLists ? following.key0 : std::int64_t{next_n} * kBlockN);
        if (v_loads)
          load(Int<kBlockN>{}, &maps.v, &v_full[buf], v_smem + buf * Config::kKvElems, blk.ks,
               kLists ? tile.key0 : std::int64_t{n} * kBlockN, hk);
      }
      if constexpr (!kGatherAll) {
        Barrier::wait(&k_full[buf], (i >> 1) & 1);
        if constexpr (kLists) fence_async_shared();  // the producer's gathered rows, for wgmma
      }
      if (kGatherAll && tile.key0 >= 0) wait_loaded(k_full, k_parity, buf);

      // The warpgroups take turns (producer walks), across the CTA's blocks:
      // warpgroup 0 issues first, then each waits for the other's MMAs of the
      // iteration before (persistent, the turns run on across blocks and
      // warpgroup 0 takes warpgroup 1's last at the end; otherwise warpgroup 1
      // passes none after its last MMAs).
      if constexpr (kProducer)
        if (i > 0 || wg == 1) NamedBarrier::sync(kConsumers, kTurn + wg);
      Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
      Tensor tSrK = thr_s.partition_fragment_B(stage_k(buf));
      wgmma_batch<true>(mma_s, tSrQ, tSrK, acc_s);
      if constexpr (kPipelined) mma_pv(i - 1);
      if constexpr (kProducer)
        if (kPersistent || next_n >= tile_first || wg == 0) NamedBarrier::arrive(kConsumers, kTurn + 1 - wg);
      if constexpr (kDeferStore && !kPipelined) write_pending();  // the block before's epilogue, under this S = Q K^T
      if constexpr (kGatherAll) {
        if (next_n >= tile_first && !k_next_loads)
          gather_staged(k_rows, p.k.sr, k_smem + (buf ^ 1) * Config::kKvElems, keys_next);
        if (!v_loads) gather_staged(v_rows, p.v.sr, v_smem + buf * Config::kKvElems, i % 3);
        cute::cp_async_fence();
        v_loaded = v_loads;
      }
      // While they run: the next tile's bias and the tile after it (a list's: its keys).
      const float next_bias = !kProducer && next_n >= tile_first ? fetch_bias(next_n, keys_next) : 0.0f;
      const Tile after = next_n >= tile_first ? next_tile(next_n) : Tile{tile_first - 1, false};
      if constexpr (kPipelined)
        warpgroup_wait<1>();
      else
        warpgroup_wait<0>();

      // The logits (SPEC 1: softcap, then the bias) and the allowed set: a tile
      // wholly inside the band and the keys tests no element (a list's tile
      // tests its bits alone).
      const bool whole = kLists || covered.holds(n);
      // A tested tile's band in its own terms, and its keys inside the sequence.
      const auto tile_band = [&] { return TileBand(p.band, offset, row0, std::int64_t{n} * kBlockN); };
      const auto tile_keys = [&] { return clamp_to_tile(sk - std::int64_t{n} * kBlockN); };
      const float* bias_cols = bias_smem + buf * kBlockN;
      // Each condition is tested once a tile, outside the element loops.
      if (softcap > 0.0f) {
        const float inner = scale / softcap * kTanhArg;
        for_each_element<kAccS>(col_base, [&](int e, int, int) { acc_s(e) = softcap_ex2(acc_s(e) * inner, softcap); });
      }
      if (has_bias) {
        const float pre = softcap > 0.0f ? 1.0f : scale;
        if constexpr (kRowBias) {
          add_bias_tile<Config>(acc_s, bias_tiles + buf * Config::kBiasTileElems, my_row[0], lane, pre);
        } else {
          for_each_element<kAccS>(col_base, [&](int e, int, int kj) { acc_s(e) = fmaf(acc_s(e), pre, bias_cols[kj]); });
        }
      }
      // A tested tile: the band's test; the mask and list walks (most of whose
      // tiles are tested): each row's allowed keys, the band's and the bits',
      // one word a row and 32 keys (allowed.cuh), one bit test an element.
      if constexpr (!kMasked && !kLists) {
        if (!whole) {
          const TileBand band = tile_band();
          const int kcols = tile_keys();
          for_each_element<kAccS>(col_base, [&](int e, int half, int kj) {
            if (!band.allows(my_row[half], kj, qrows, kcols)) acc_s(e) = -kInf;
          });
        }
      } else if (const bool bits = kLists || partial; !whole || bits) {
        // A whole tile whose bits are all set for the warp's 16 rows (a list
        // tile where no row of the warp lacks a listed key) tests nothing.
        bool every = false;
        if (whole) {
          std::uint32_t set = ~0u;
#pragma unroll
          for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int w = 0; w < kWords; ++w) set &= row_bits[half][w];
          every = __all_sync(0xffffffff, set == ~0u);
        }
        if (!every) {
          AllowedWords<kWords> allow;  // a whole tile: every key, the bits'
#pragma unroll
          for (int half = 0; half < 2; ++half)
            allow.set(half, whole ? TileSpan{0, kBlockN} : tile_band().keys_of(my_row[half], qrows, tile_keys()), bits,
                      row_bits[half], col_base);
          for_each_element<kAccS>(col_base, [&](int e, int, int) {
            if (!allow.allows(e)) acc_s(e) = -kInf;
          });
        }
      }
      if constexpr (kProducer) Barrier::arrive(&k_empty[buf]);  // the thread is done with K_n and its bias

      float correction[2];
      bool moved = false;
      tile_softmax(acc_s, row_max, row_sum, correction, moved, c_log2, logits);
      store_bias(buf ^ 1, next_bias);
      if constexpr (kGatherAll) store_key((i + 2) % 3, after.key);

      if constexpr (kPipelined) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(rP);
        if (kProducer && lane == 0) Barrier::arrive(&v_empty[(i - 1) & 1]);  // the warp is done with V_{i-1}
      }
      if (__any_sync(0xffffffff, moved)) {
#pragma unroll
        for (int e = 0; e < size(acc_o); ++e) acc_o(e) *= correction[e / 2 % 2];
      }
      using Convert = cutlass::NumericArrayConverter<Element, float, kAccS>;
      *reinterpret_cast<cutlass::Array<Element, kAccS>*>(raw_pointer_cast(rP.data())) =
          Convert{}(*reinterpret_cast<const cutlass::Array<float, kAccS>*>(raw_pointer_cast(acc_s.data())));
      return after;
    };
    auto step = [&](auto pipelined) {
      const Tile after = iteration(walked++, cur, next, pipelined);
      cur = next, next = after;
    };
    if (walks) {
      step(std::false_type{});
      while (cur.n >= tile_first) step(std::true_type{});
      // Every S = Q K^T of the block is done: the producer may load the next Q.
      if constexpr (kPersistent) Barrier::arrive(&q_empty[qb]), ++q_loads;
      // The last tile's P V.
      if constexpr (kGatherAll) {
        cute::cp_async_wait<0>();
        fence_async_shared();
        __syncthreads();
      }
      mma_pv(walked - 1);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      if (kPersistent && lane == 0) Barrier::arrive(&v_empty[(walked - 1) & 1]);
    }

    if constexpr (kDeferStore) {
      if (walks) {  // written at the next block's first S = Q K^T
        pending_rows = BlockRows::of(blk), pending_out = round_block<Config>(acc_o, row_max, row_sum, unit);
        has_pending = true;
        start_block();
        return;
      }
      write_pending();  // the block before's; this one walks no tile (zeros, lse -inf)
    }
    store_block<Config>(p, BlockRows::of(blk), acc_o, thr_o, row_max, row_sum, my_row, unit, lane);
  };
  // The persistent CTA's blocks, round by round, in one role.
  auto walk_rounds = [&](auto role) {
    const unsigned items = ForwardBlock::count(p, kBlockM);
    for (unsigned round = 0; round * gridDim.x < items; ++round) {
      const unsigned item = round * gridDim.x + (round % 2 ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
      if (item < items) walk_block(item, role);
    }
  };
  if constexpr (kPersistent) {
    init_barriers();
    if (warp_group == 0) {  // the producer: its first warp issues the loads (a list's: all four)
      cutlass::arch::warpgroup_reg_dealloc<Config::producer_regs(true)>();
      if (!kLists && cutlass::canonical_warp_idx_sync() != 0) return;
      walk_rounds(std::integral_constant<Role, kProducing>{});
      if constexpr (kLists) cute::cp_async_wait<0>();  // no thread leaves copies in flight
      return;
    }
    cutlass::arch::warpgroup_reg_alloc<Config::consumer_regs(true)>();
    walk_rounds(std::integral_constant<Role, kConsuming>{});
    if constexpr (kDeferStore) write_pending();  // the last block's epilogue
    if (wg == 0 && walked > 0) NamedBarrier::sync(kConsumers, kTurn);  // warpgroup 1's last turn
  } else {
    walk_block(blockIdx.x, std::integral_constant<Role, kEveryone>{});
  }
#endif
}

}  // namespace dmattn::cuda
