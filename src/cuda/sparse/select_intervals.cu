// Top-k by per-key row intervals (Problem::topk_by_intervals): per selection
// head, the keys sorted by (bias, index) descending and a wavelet matrix over
// the sorted indices give each key the rows that keep it (selection.h).
#include <algorithm>
#include <climits>
#include <cub/agent/single_pass_scan_operators.cuh>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "../common/scratch.h"
#include "../common/warp.cuh"
#include "../heuristics.h"
#include "select.cuh"

namespace dmattn::cuda::topk {
namespace {

// ---- intervals -------------------------------------------------------------
// A chunk holds `segments` selection heads (b, s) starting at g0, each padded to
// n keys (n % 32 == 0, n <= 2^kb). Sort key of key j of local segment t, with
// ob = order_width(bias dtype):
//   t << (ob + kb) | ~order_key(bias_j) << kb | (2^kb - 1 - j)     (ob-bit field)
// so an ascending sort lists each head's keys strongest first (ties: larger j
// first), and keys no row may see (masked, or past the sequence; order field
// all ones) last. Every j in [0, n) appears once per segment.
constexpr int kLevelThreads = 512, kLevelItems = 4;
constexpr int kTile = kLevelThreads * kLevelItems;  // positions per CTA when building a wavelet level
using TileState = cub::ScanTileState<std::uint32_t>;

struct Chunk {
  std::int64_t g0 = 0, segments = 0, n = 0;
  int kb = 0, ob = 32;
  __host__ __device__ std::uint32_t masked() const { return static_cast<std::uint32_t>((std::uint64_t{1} << ob) - 1); }
  __host__ __device__ std::int64_t items() const { return segments * n; }
  __host__ __device__ std::int64_t words() const { return items() / 32; }
  __host__ __device__ std::int64_t tiles() const { return (n + kTile - 1) / kTile; }  // per segment
  // Zeros of level l: the segment holds every value of [0, n) once, so this is
  // the count of v < n whose bit kb - 1 - l is clear.
  __device__ std::int64_t zeros(int l) const {
    const int b = kb - 1 - l;
    return (n >> (b + 1) << b) + min(n & ((std::int64_t{2} << b) - 1), std::int64_t{1} << b);
  }
};

__device__ std::int64_t key_index(const Chunk& c, std::uint64_t key) {
  const std::uint64_t low = (std::uint64_t{1} << c.kb) - 1;
  return static_cast<std::int64_t>(low - (key & low));
}

// The keys of selection head g: strength(j) is key j's bias's order_key, 0
// where no row may see it (masked, or past the sequence). A key of strength 0
// is never kept and beats no key of greater strength (a bias whose order key
// is 0, a NaN, counts as masked, in both interval methods).
struct HeadKeys {
  std::int64_t bias = 0, mask = 0, sk = 0;  // the head's first key's elements; its keys
  __device__ HeadKeys(const Params& p, std::int64_t g) {
    const std::int64_t b = g / p.heads, h = (g % p.heads) * p.group;
    const Sequence s(p, b);
    bias = element_at(p.bias, b, h / p.bias_group, 0, s.ks), mask = element_at(p.mask, b, h / p.mask_group, 0, s.ks);
    sk = s.sk;
  }
  __device__ std::uint32_t strength(const Params& p, std::int64_t j) const {
    if (j >= sk) return 0;
    const bool seen = load_mask(p.mask, mask + j * p.mask.sc);
    const std::uint32_t order = order_key(p.bias, bias + j * p.bias.sc);
    return seen ? order : 0;  // both loads issued at once
  }
};

// The sort key of key j (< c.n) of local segment t.
__device__ std::uint64_t sort_key(const Params& p, const Chunk& c, std::int64_t t, std::int64_t j) {
  const std::uint32_t order = ~HeadKeys(p, c.g0 + t).strength(p, j) & c.masked();
  const std::uint64_t low = (std::uint64_t{1} << c.kb) - 1;
  return (static_cast<std::uint64_t>(t) << (c.ob + c.kb)) | (std::uint64_t{order} << c.kb) |
         (low - static_cast<std::uint64_t>(j));
}

__global__ void interval_keys(Params p, Chunk c, std::uint64_t* keys) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < c.items()) keys[i] = sort_key(p, c, i / c.n, i % c.n);
}

// Wavelet matrix over each segment's sorted key indices (kb levels; level l
// splits on bit kb - 1 - l; the next level's order is the stable partition,
// zeros first). Level l is, per word of 32 positions, the bits and the ones
// before the word in its segment: one 8-byte load per rank.
struct Wavelet {
  uint2* levels;  // [kb][words]: {bits, ones before}

  // Ones before position pos (0..n) of segment t at level l; I: the index type
  // (int within one CTA's head of at most kFusedKeys keys, else int64).
  template <class I>
  __device__ I rank1(const Chunk& c, int l, I t, I pos) const {
    if (pos == 0) return 0;
    if (pos == static_cast<I>(c.n)) return static_cast<I>(c.n - c.zeros(l));
    const uint2 word = levels[l * static_cast<I>(c.words()) + (t * static_cast<I>(c.n) + pos) / 32];
    return static_cast<I>(word.y) + __popc(word.x & ((1u << (pos % 32)) - 1));
  }
  // The k-th smallest (k >= 1) key index among sorted positions [0, r[i]) of
  // segment t, for N prefixes at once: their chains of dependent loads overlap.
  template <int N, class I>
  __device__ void kth_smallest(const Chunk& c, I t, const I (&r)[N], I k, I (&value)[N]) const {
    I lo[N], hi[N], rest[N];
#pragma unroll
    for (int i = 0; i < N; ++i) lo[i] = 0, hi[i] = r[i], rest[i] = k, value[i] = 0;
    for (int l = 0; l < c.kb; ++l) {
      const I zeros_l = static_cast<I>(c.zeros(l)), bit = I{1} << (c.kb - 1 - l);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const I ones_lo = rank1(c, l, t, lo[i]), ones_hi = rank1(c, l, t, hi[i]);
        const I zeros = (hi[i] - lo[i]) - (ones_hi - ones_lo);
        if (rest[i] <= zeros) {
          lo[i] -= ones_lo, hi[i] -= ones_hi;
        } else {
          rest[i] -= zeros;
          lo[i] = zeros_l + ones_lo, hi[i] = zeros_l + ones_hi;
          value[i] |= bit;
        }
      }
    }
  }
};

// One level per launch: a CTA takes kTile positions of one segment, counts the
// ones before each position, writes the level's words and counts and scatters
// the values into the next level's order. Item k of thread x is position
// k * kLevelThreads + x of the tile, so each warp holds one word per item; one
// block scan of the items' bits packed in 16-bit fields counts within the tile,
// and a single-pass scan over tiles (decoupled look-back over the segment's
// earlier CTAs; the segment's first CTA starts the chain) adds the tiles before.
// Level 0 reads the sorted keys; `next` is unused at the last level.
__global__ void __launch_bounds__(kLevelThreads) wavelet_level(Chunk c, int l, TileState state, Wavelet wm,
                                                               const std::uint64_t* keys,
                                                               const std::uint32_t* values, std::uint32_t* next) {
  using Scan = cub::BlockScan<std::uint64_t, kLevelThreads>;
  using Prefix = cub::TilePrefixCallbackOp<std::uint32_t, ::cuda::std::plus<>, TileState>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ typename Prefix::TempStorage prefix_storage;
  __shared__ std::uint32_t tile_prefix;
  const int tile = blockIdx.x, shift = c.kb - 1 - l;
  const std::int64_t t = tile / c.tiles(), first = tile % c.tiles() * kTile;
  std::uint32_t v[kLevelItems];
  std::uint64_t bits = 0;
  for (int k = 0; k < kLevelItems; ++k) {
    const std::int64_t pos = first + k * kLevelThreads + threadIdx.x, i = t * c.n + pos;
    v[k] = 0;
    if (pos < c.n) v[k] = l == 0 ? static_cast<std::uint32_t>(key_index(c, keys[i])) : values[i];
    bits |= std::uint64_t{(v[k] >> shift) & 1u} << (16 * k);
  }
  std::uint64_t before = 0, rows = 0;  // per item: ones before the thread in its row; ones per row
  Scan(scan_storage).ExclusiveSum(bits, before, rows);
  if (threadIdx.x < 32) {
    std::uint32_t total = 0;
    for (int k = 0; k < kLevelItems; ++k) total += (rows >> (16 * k)) & 0xFFFFu;
    if (tile % c.tiles() == 0) {
      if (threadIdx.x == 0) {
        state.SetInclusive(tile, total);
        tile_prefix = 0;
      }
    } else {
      Prefix prefix(state, prefix_storage, ::cuda::std::plus<>{}, tile);
      const std::uint32_t earlier = prefix(total);
      if (threadIdx.x == 0) tile_prefix = earlier;
    }
  }
  __syncthreads();
  std::uint32_t row_start = tile_prefix;
  for (int k = 0; k < kLevelItems; ++k) {
    const std::int64_t pos = first + k * kLevelThreads + threadIdx.x, i = t * c.n + pos;
    if (pos < c.n) {  // whole warps: n % 32 == 0
      const std::uint32_t bit = (bits >> (16 * k)) & 1u;
      const std::uint32_t ones = row_start + static_cast<std::uint32_t>((before >> (16 * k)) & 0xFFFFu);
      const std::uint32_t word = __ballot_sync(0xFFFFFFFFu, bit);
      if (threadIdx.x % 32 == 0) wm.levels[l * c.words() + i / 32] = make_uint2(word, ones);
      if (l + 1 < c.kb) next[t * c.n + (bit ? c.zeros(l) + ones : pos - ones)] = v[k];
    }
    row_start += static_cast<std::uint32_t>((rows >> (16 * k)) & 0xFFFFu);
  }
}

__global__ void init_tile_states(char* states, std::size_t stride, int tiles) {
  TileState state;
  state.Init(tiles, states + blockIdx.y * stride, stride);
  state.InitializeStatus(tiles);
}

// Key j of selection head g: no row keeps it unless `kept`; else rows keep it
// from the first that sees it to the first that sees `beater`, its w-th
// smallest beater index (-1: fewer than w keys beat it).
__device__ void write_key_rows(const Params& p, std::int64_t g, std::int64_t j, bool kept, std::int64_t beater,
                               KeyRows* out) {
  if (j >= p.seqlen_k) return;  // padding of the chunk layout
  KeyRows rows{0, 0};
  if (kept) {
    const Sequence s(p, g / p.heads);
    const std::int64_t start = first_row(p, s, j);
    const std::int64_t end = beater < 0 ? s.sq : first_row(p, s, beater);
    if (start < end) rows = {static_cast<std::int32_t>(start), static_cast<std::int32_t>(end)};
  }
  out[g * p.seqlen_k + j] = rows;
}

// Key `key` at sorted position r of local segment t: it has r beaters.
__device__ void write_sorted_key_rows(const Params& p, const Chunk& c, std::int64_t t, std::int64_t r,
                                      std::uint64_t key, std::int64_t beater, KeyRows* out) {
  write_key_rows(p, c.g0 + t, key_index(c, key), ((key >> c.kb) & c.masked()) != c.masked(), r < p.w ? -1 : beater,
                 out);
}

__global__ void key_intervals(Params p, Chunk c, Wavelet wm, const std::uint64_t* keys, KeyRows* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= c.items()) return;
  const std::int64_t t = i / c.n, r[1] = {i % c.n};
  std::int64_t beater[1] = {0};
  if (r[0] >= p.w) wm.kth_smallest(c, t, r, p.w, beater);
  write_sorted_key_rows(p, c, t, r[0], keys[i], beater[0], out);
}

// Heads of at most kFusedKeys keys: one CTA a head (segment) does it all in
// shared memory, the sort (a block radix sort), the wavelet levels and the
// queries, in one launch instead of kb + 7; at S <= 4096 those launches cost
// more than their work. Thread x holds sorted positions kFusedItems x + k
// (blocked) for the sort and the queries, and positions kFusedThreads k + x
// (striped: a warp a word) for the levels. 1024 threads (the wavelet matrix
// in the sort's shared memory, which it outlives): 47 -> 43 us at S = 2048,
// 63 -> 57 at 4096 (8 heads; H100), where 512 threads left the schedulers
// waiting (0.57 eligible warps). Of the 43 us the queries take 14, the sort
// and the levels the rest. `parts` CTAs share a head where the grid leaves
// SMs idle (heuristics.h fused_selection_parts): each sorts and builds the
// levels, then queries its part of the positions.
constexpr int kFusedThreads = 1024, kFusedItems = 4, kFusedKeys = kFusedThreads * kFusedItems;
constexpr int kFusedWords = kFusedKeys / 32, kFusedLevels = 12;  // 2^12 = kFusedKeys
using FusedSort = cub::BlockRadixSort<std::uint64_t, kFusedThreads, kFusedItems>;

__global__ void __launch_bounds__(kFusedThreads) fused_intervals(Params p, Chunk c, int parts, KeyRows* out) {
  __shared__ union {  // the sort's, then the wavelet matrix's
    typename FusedSort::TempStorage sort;
    struct {
      std::uint32_t values[kFusedKeys];
      uint2 levels[kFusedLevels * kFusedWords];
    } wm;
  } storage;
  uint2* const levels = storage.wm.levels;
  __shared__ std::uint32_t word_ones[kFusedWords];
  c.g0 = blockIdx.x / unsigned(parts);
  std::uint64_t keys[kFusedItems];
  for (int k = 0; k < kFusedItems; ++k) {
    const int j = kFusedItems * threadIdx.x + k;
    keys[k] = j < c.n ? sort_key(p, c, 0, j) : std::uint64_t{1} << (c.ob + c.kb);  // past the segment: last
  }
  FusedSort(storage.sort).Sort(keys, 0, c.ob + c.kb + 1);
  __syncthreads();
  for (int k = 0; k < kFusedItems; ++k) {
    const int r = kFusedItems * threadIdx.x + k;
    if (r < c.n) storage.wm.values[r] = static_cast<std::uint32_t>(key_index(c, keys[k]));
  }
  const int words = static_cast<int>(c.words()), lane = threadIdx.x % 32;
  for (int l = 0; l < c.kb; ++l) {
    __syncthreads();
    const int shift = c.kb - 1 - l;
    std::uint32_t v[kFusedItems], word[kFusedItems];
    for (int k = 0; k < kFusedItems; ++k) {
      const int pos = kFusedThreads * k + threadIdx.x;
      if (pos >= c.n) break;  // whole warps: n % 32 == 0
      v[k] = storage.wm.values[pos];
      word[k] = __ballot_sync(0xFFFFFFFFu, (v[k] >> shift) & 1u);
      if (lane == 0) word_ones[pos / 32] = __popc(word[k]);
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // ones before each word: one warp scans the words, kFusedWords / 32 a lane
      constexpr int kPerLane = kFusedWords / 32;
      std::uint32_t own[kPerLane], sum = 0;
      for (int e = 0; e < kPerLane; ++e) {
        const int w = kPerLane * lane + e;
        own[e] = w < words ? word_ones[w] : 0;
        sum += own[e];
      }
      std::uint32_t before = warp_inclusive_sum(sum, lane) - sum;
      for (int e = 0; e < kPerLane; ++e) {
        const int w = kPerLane * lane + e;
        if (w < words) word_ones[w] = before;
        before += own[e];
      }
    }
    __syncthreads();
    const std::int64_t zeros = c.zeros(l);
    for (int k = 0; k < kFusedItems; ++k) {
      const int pos = kFusedThreads * k + threadIdx.x;
      if (pos >= c.n) break;
      const std::uint32_t ones = word_ones[pos / 32] + __popc(word[k] & ((1u << lane) - 1));
      if (lane == 0) levels[l * words + pos / 32] = make_uint2(word[k], word_ones[pos / 32]);
      storage.wm.values[(v[k] >> shift) & 1u ? zeros + ones : pos - ones] = v[k];
    }
  }
  __syncthreads();
  // The thread's keys' w-th smallest beaters at once (a key before position w
  // queries position w instead, in range, and ignores it).
  const int w = static_cast<int>(min(p.w, c.n)), first = kFusedItems * threadIdx.x;
  const int share = static_cast<int>(c.n) / parts, part = static_cast<int>(blockIdx.x % unsigned(parts));
  if (first < part * share || first >= (part + 1) * share) return;  // whole threads: share % kFusedItems == 0
  int r[kFusedItems], beater[kFusedItems];
  for (int k = 0; k < kFusedItems; ++k) r[k] = min(max(first + k, w), static_cast<int>(c.n));
  Wavelet{levels}.kth_smallest(c, 0, r, w, beater);
  for (int k = 0; k < kFusedItems; ++k)
    if (first + k < c.n) write_sorted_key_rows(p, c, 0, first + k, keys[k], beater[k], out);
}

// Few heads of at most kCountedKeys keys (heuristics.h counted_selection):
// no sort; each key counts its beaters in index order, and the w-th is its
// beater. O(n^2) compares a head, spread over the GPU where the sort of
// fused_intervals would leave most SMs idle for tens of microseconds. A CTA
// takes 64 keys of a head (lane l of every warp: keys l and l + 32); warp x
// counts their beaters in its share of the head's 32-key chunks, a chunk's
// two counts packed in a register (16 bits each), the warps' totals meet in
// shared memory, and the warp where a key's count reaches w finds the key that
// makes it in that chunk. Key k beats key j before j with a greater strength,
// after j with one at least as great: v > u, or v > u - 1 (a kept key's u is
// at least 1).
constexpr int kCountedWarps = 8, kCountedThreads = 32 * kCountedWarps, kCountedKeys = kMaxCountedSelectionKeys;
constexpr int kCountedLaneKeys = 2, kCountedCtaKeys = 32 * kCountedLaneKeys, kCountBits = 32 / kCountedLaneKeys;
constexpr unsigned kCountMask = (1u << kCountBits) - 1;
constexpr int kCountedWarpChunks = (kCountedKeys / 32 + kCountedWarps - 1) / kCountedWarps;

// n + the keys of v at most t: sub.cc's carry is t >= v.
__device__ __forceinline__ unsigned at_most(unsigned n, std::uint32_t t, uint4 v) {
  asm("{\n\t.reg .u32 d;\n\t"
      "sub.cc.u32 d, %1, %2;\n\taddc.u32 %0, %0, 0;\n\t"
      "sub.cc.u32 d, %1, %3;\n\taddc.u32 %0, %0, 0;\n\t"
      "sub.cc.u32 d, %1, %4;\n\taddc.u32 %0, %0, 0;\n\t"
      "sub.cc.u32 d, %1, %5;\n\taddc.u32 %0, %0, 0;\n\t}"
      : "+r"(n)
      : "r"(t), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
  return n;
}

// Whether key k (strength v) beats key j (strength u).
__device__ __forceinline__ bool beats(int k, std::uint32_t v, int j, std::uint32_t u) {
  return k < j ? v > u : k > j && v >= u;
}

__global__ void __launch_bounds__(kCountedThreads) counted_intervals(Params p, int n, KeyRows* out) {
  constexpr int kT = kCountedLaneKeys;
  __shared__ __align__(16) std::uint32_t strength[kCountedKeys];
  __shared__ int totals[kT][kCountedWarps][32];
  const int parts = (n + kCountedCtaKeys - 1) / kCountedCtaKeys, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t g = blockIdx.x / parts;
  const HeadKeys head(p, g);
  for (int k0 = threadIdx.x; k0 < n; k0 += 4 * kCountedThreads) {  // four keys' loads in flight
    std::uint32_t v[4];
    for (int e = 0; e < 4; ++e) v[e] = head.strength(p, k0 + e * kCountedThreads);
    for (int e = 0; e < 4; ++e)
      if (k0 + e * kCountedThreads < n) strength[k0 + e * kCountedThreads] = v[e];
  }
  __syncthreads();
  const int first = static_cast<int>(blockIdx.x % parts) * kCountedCtaKeys, own = first / 32;  // key t's chunk: own + t
  int j[kT];
  std::uint32_t u[kT];
  for (int t = 0; t < kT; ++t) j[t] = first + 32 * t + lane, u[t] = j[t] < n ? strength[j[t]] : 0u;
  const int chunks = n / 32, begin = warp * chunks / kCountedWarps, end = (warp + 1) * chunks / kCountedWarps;
  // Key t's own chunk is first counted as if after it (v >= u), then
  // corrected: it does not beat itself, and keys before it beat it only with
  // a greater strength.
  unsigned counts[kCountedWarpChunks];  // field t (kCountBits): key t's beaters in chunk begin + i
#pragma unroll
  for (int i = 0; i < kCountedWarpChunks; ++i) {
    const int c = begin + i;
    counts[i] = 0;
    if (c >= end) continue;
    std::uint32_t below[kT];
    unsigned not_beaten[kT];
    for (int t = 0; t < kT; ++t) below[t] = c < own + t ? u[t] : u[t] - 1, not_beaten[t] = 0;
    for (int e = 0; e < 32; e += 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(strength + 32 * c + e);
      for (int t = 0; t < kT; ++t) not_beaten[t] = at_most(not_beaten[t], below[t], v);
    }
    for (int t = 0; t < kT; ++t) counts[i] |= (32u - not_beaten[t]) << (kCountBits * t);
  }
  for (int t = 0; t < kT; ++t) {
    const int c = own + t;
    if (c < begin || c >= end || u[t] == 0) continue;  // a kept key's own count holds itself: no borrow
    unsigned ties = 1;
    for (int k = 32 * c; k < j[t]; ++k) ties += strength[k] == u[t];
#pragma unroll
    for (int i = 0; i < kCountedWarpChunks; ++i)
      if (begin + i == c) counts[i] -= ties << (kCountBits * t);
  }
  int total[kT] = {};
#pragma unroll
  for (int i = 0; i < kCountedWarpChunks; ++i)
    for (int t = 0; t < kT; ++t) total[t] += (counts[i] >> (kCountBits * t)) & kCountMask;
  for (int t = 0; t < kT; ++t) totals[t][warp][lane] = total[t];
  __syncthreads();
  const int w = static_cast<int>(min(p.w, std::int64_t{n} + 1));
#pragma unroll
  for (int t = 0; t < kT; ++t) {
    if (j[t] >= n) continue;
    int before = 0, all = 0;
    for (int x = 0; x < kCountedWarps; ++x) {
      before += x < warp ? totals[t][x][lane] : 0;
      all += totals[t][x][lane];
    }
    if (u[t] == 0 || all < w) {  // not kept, or fewer than w beaters: written once, by warp 0
      if (warp == 0) write_key_rows(p, g, j[t], u[t] != 0, -1, out);
      continue;
    }
    if (before >= w || before + total[t] < w) continue;  // the w-th beater is in another warp's chunks
    int chunk = -1, need = w - before;
#pragma unroll
    for (int i = 0; i < kCountedWarpChunks; ++i)
      if (chunk < 0 && begin + i < end) {
        const int count = static_cast<int>((counts[i] >> (kCountBits * t)) & kCountMask);
        if (need <= count)
          chunk = begin + i;
        else
          need -= count;
      }
    unsigned bits = 0;  // the chunk's beaters of key t, then the need-th of them
#pragma unroll
    for (int e = 0; e < 32; e += 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(strength + 32 * chunk + e);
      const int k = 32 * chunk + e;
      bits |= unsigned{beats(k, v.x, j[t], u[t])} << e | unsigned{beats(k + 1, v.y, j[t], u[t])} << (e + 1) |
              unsigned{beats(k + 2, v.z, j[t], u[t])} << (e + 2) | unsigned{beats(k + 3, v.w, j[t], u[t])} << (e + 3);
    }
    for (; need > 1; --need) bits &= bits - 1;
    write_key_rows(p, g, j[t], true, 32 * chunk + __ffs(bits) - 1, out);
  }
}

}  // namespace

// Scratch: O(n log n) bits per head (the levels), 24 bytes per key besides.
void select_intervals(const Params& p, std::int64_t batch, int sms, KeyRows* out, cudaStream_t stream) {
  const std::int64_t total = batch * p.heads;
  Chunk full;
  full.n = (std::max<std::int64_t>(p.seqlen_k, 1) + 31) / 32 * 32;
  if (counted_selection(total, full.n)) {
    const auto parts = static_cast<unsigned>((full.n + kCountedCtaKeys - 1) / kCountedCtaKeys);
    counted_intervals<<<static_cast<unsigned>(total) * parts, kCountedThreads, 0, stream>>>(p, static_cast<int>(full.n),
                                                                                           out);
    check_cuda(cudaGetLastError(), "counted interval kernel");
    return;
  }
  full.kb = std::max(ceil_log2(full.n), 1);
  full.ob = order_width(p.bias.dtype);
  // Segment ids take the top bits of the 64-bit sort key; items are counted in int.
  full.segments = std::min({total, std::int64_t{1} << (64 - full.ob - full.kb), std::int64_t{INT_MAX} / full.n});
  if (full.n <= kFusedKeys) {
    full.segments = 1;
    const int parts = fused_selection_parts(total, sms);
    static_assert(32 % (kFusedItems * kMaxFusedSelectionParts) == 0, "a part is whole threads of positions (n % 32 == 0)");
    fused_intervals<<<static_cast<unsigned>(total * parts), kFusedThreads, 0, stream>>>(p, full, parts, out);
    check_cuda(cudaGetLastError(), "fused interval kernel");
    return;
  }
  Chunk last = full;
  last.segments = total % full.segments == 0 ? full.segments : total % full.segments;
  const auto sort_bits = [](const Chunk& c) { return c.ob + c.kb + ceil_log2(c.segments); };

  std::size_t sort_bytes = 0;
  for (const Chunk& c : {full, last}) {
    std::size_t bytes = 0;
    check_cuda(cub::DeviceRadixSort::SortKeys(nullptr, bytes, static_cast<const std::uint64_t*>(nullptr),
                                              static_cast<std::uint64_t*>(nullptr), static_cast<int>(c.items()), 0,
                                              sort_bits(c), stream),
               "radix sort size");
    sort_bytes = std::max(sort_bytes, bytes);
  }
  const int tiles = static_cast<int>(full.segments * full.tiles());
  std::size_t state_bytes = 0;
  check_cuda(TileState::AllocationSize(tiles, state_bytes), "tile state size");
  state_bytes = Scratch::aligned(state_bytes);  // a level's tile states
  const auto items = static_cast<std::size_t>(full.items()), words = static_cast<std::size_t>(full.words());
  std::uint64_t *keys_in = nullptr, *keys = nullptr;
  std::uint32_t *values = nullptr, *next = nullptr;
  uint2* levels = nullptr;
  char *states = nullptr, *sort_temp = nullptr;
  Scratch scratch;
  scratch.add(keys_in, items, false), scratch.add(keys, items, false);
  scratch.add(values, items, false), scratch.add(next, items, false);
  scratch.add(levels, full.kb * words, false);
  scratch.add(states, full.kb * state_bytes, false), scratch.add(sort_temp, sort_bytes, false);
  check_cuda(scratch.allocate(stream), "cudaMallocAsync (top-k intervals)");
  const Wavelet wm{levels};

  for (std::int64_t g0 = 0; g0 < total; g0 += full.segments) {
    Chunk c = g0 + full.segments >= total ? last : full;
    c.g0 = g0;
    const unsigned blocks = blocks_for(c.items());
    interval_keys<<<blocks, kThreads, 0, stream>>>(p, c, keys_in);
    std::size_t bytes = sort_bytes;
    check_cuda(cub::DeviceRadixSort::SortKeys(sort_temp, bytes, keys_in, keys, static_cast<int>(c.items()), 0,
                                              sort_bits(c), stream),
               "radix sort");
    const int chunk_tiles = static_cast<int>(c.segments * c.tiles());
    init_tile_states<<<dim3((chunk_tiles + kThreads - 1) / kThreads, c.kb), kThreads, 0, stream>>>(
        states, state_bytes, chunk_tiles);
    for (int l = 0; l < c.kb; ++l) {
      TileState state;
      check_cuda(state.Init(chunk_tiles, states + l * state_bytes, state_bytes), "tile state");
      wavelet_level<<<chunk_tiles, kLevelThreads, 0, stream>>>(c, l, state, wm, keys, values, next);
      std::swap(values, next);
    }
    key_intervals<<<blocks, kThreads, 0, stream>>>(p, c, wm, keys, out);
    check_cuda(cudaGetLastError(), "interval kernels");
  }
  scratch.release(stream);
}

}  // namespace dmattn::cuda::topk
