// Top-k selection on the GPU (see selection.h). Semantics follow
// src/cpu/selection.cpp exactly: a key j of row i is selected iff it is allowed
// and fewer than w allowed keys of the row beat it, where k beats j iff
// (bias_k, k) > (bias_j, j) (larger bias, ties to the larger key index).
#include "selection.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/agent/single_pass_scan_operators.cuh>
#include <stdexcept>
#include <string>

namespace dmattn::cuda {
namespace {

constexpr int kThreads = 256;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("dmattn: top-k selection: ") + what + ": " + cudaGetErrorString(err));
}

int ceil_log2(std::int64_t n) {
  int bits = 0;
  while ((std::int64_t{1} << bits) < n) ++bits;
  return bits;
}

unsigned blocks_for(std::int64_t threads) { return static_cast<unsigned>((threads + kThreads - 1) / kThreads); }

// What the kernels read of a Problem; selection head s of batch b reads the
// bias and mask of query head s * group.
struct Params {
  Operand bias, mask;  // mask.data == nullptr: no mask
  std::int64_t heads = 0, group = 1, bias_group = 1, mask_group = 1;
  std::int64_t seqlen_q = 0, seqlen_k = 0;
  const std::int32_t* cu_seqlens_q = nullptr;
  const std::int32_t* cu_seqlens_k = nullptr;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  std::int64_t w = 0;
};

// One sequence of a batch entry: global starts and local lengths.
struct Sequence {
  std::int64_t qs, ks, sq, sk;
};

__device__ Sequence sequence(const Params& p, std::int64_t b) {
  if (p.cu_seqlens_q == nullptr) return {0, 0, p.seqlen_q, p.seqlen_k};
  return {p.cu_seqlens_q[b], p.cu_seqlens_k[b], p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b],
          p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b]};
}

// First row that may see key j (causal and right window, bottom-right aligned).
__device__ std::int64_t first_row(const Params& p, const Sequence& s, std::int64_t j) {
  std::int64_t r = 0;
  if (p.causal) r = max(r, j - (s.sk - s.sq));
  if (p.window_right >= 0) r = max(r, j - (s.sk - s.sq) - p.window_right);
  return min(r, s.sq);
}

__device__ float load_bias(const Operand& bias, std::int64_t offset) {
  switch (bias.dtype) {
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(bias.data)[offset]);
    case DType::kBFloat16:
      return __uint_as_float(std::uint32_t{static_cast<const std::uint16_t*>(bias.data)[offset]} << 16);
    default:
      return static_cast<const float*>(bias.data)[offset];
  }
}

__device__ bool load_mask(const Operand& mask, std::int64_t offset) {
  return mask.data == nullptr || static_cast<const std::uint8_t*>(mask.data)[offset] != 0;
}

// Order-preserving unsigned image of a float: a > b iff bits(a) > bits(b); -0 and +0 are one value.
__device__ std::uint32_t order_bits(float x) {
  const std::uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ float from_order_bits(std::uint32_t e) {
  return __uint_as_float((e & 0x80000000u) ? (e & 0x7FFFFFFFu) : ~e);
}

// The same order on the bias dtype's own bits: 16 for float16 and bfloat16
// (sign-magnitude like float32), 32 for float32. Fewer sort bits.
int order_width(DType dtype) { return dtype == DType::kFloat32 ? 32 : 16; }

__device__ std::uint32_t order_key(const Operand& bias, std::int64_t offset) {
  if (bias.dtype == DType::kFloat32) return order_bits(static_cast<const float*>(bias.data)[offset]);
  std::uint32_t h = static_cast<const std::uint16_t*>(bias.data)[offset];
  if (h == 0x8000u) h = 0;
  return (h & 0x8000u) ? (~h & 0xFFFFu) : (h | 0x8000u);
}

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

__global__ void interval_keys(Params p, Chunk c, std::uint64_t* keys) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= c.items()) return;
  const std::int64_t t = i / c.n, j = i % c.n, g = c.g0 + t;
  const std::int64_t b = g / p.heads, h = (g % p.heads) * p.group;
  const Sequence s = sequence(p, b);
  std::uint32_t order = c.masked();
  if (j < s.sk &&
      load_mask(p.mask, b * p.mask.sb + h / p.mask_group * p.mask.sh + (s.ks + j) * p.mask.sc))
    order = ~order_key(p.bias, b * p.bias.sb + h / p.bias_group * p.bias.sh + (s.ks + j) * p.bias.sc) & c.masked();
  const std::uint64_t low = (std::uint64_t{1} << c.kb) - 1;
  keys[i] = (static_cast<std::uint64_t>(t) << (c.ob + c.kb)) | (std::uint64_t{order} << c.kb) |
            (low - static_cast<std::uint64_t>(j));
}

// Wavelet matrix over each segment's sorted key indices (kb levels; level l
// splits on bit kb - 1 - l; the next level's order is the stable partition,
// zeros first). Level l is, per word of 32 positions, the bits and the ones
// before the word in its segment: one 8-byte load per rank.
struct Wavelet {
  uint2* levels;  // [kb][words]: {bits, ones before}

  // Ones before position pos (0..n) of segment t at level l.
  __device__ std::int64_t rank1(const Chunk& c, int l, std::int64_t t, std::int64_t pos) const {
    if (pos == 0) return 0;
    if (pos == c.n) return c.n - c.zeros(l);
    const uint2 word = levels[l * c.words() + (t * c.n + pos) / 32];
    return word.y + __popc(word.x & ((1u << (pos % 32)) - 1));
  }
  // The k-th smallest (k >= 1) key index among sorted positions [0, r) of segment t.
  __device__ std::int64_t kth_smallest(const Chunk& c, std::int64_t t, std::int64_t r, std::int64_t k) const {
    std::int64_t lo = 0, hi = r, value = 0;
    for (int l = 0; l < c.kb; ++l) {
      const std::int64_t ones_lo = rank1(c, l, t, lo), ones_hi = rank1(c, l, t, hi);
      const std::int64_t zeros = (hi - lo) - (ones_hi - ones_lo);
      if (k <= zeros) {
        lo -= ones_lo, hi -= ones_hi;
      } else {
        k -= zeros;
        lo = c.zeros(l) + ones_lo, hi = c.zeros(l) + ones_hi;
        value |= std::int64_t{1} << (c.kb - 1 - l);
      }
    }
    return value;
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

// Key at sorted position r of its head: it has r beaters; rows stop selecting it
// at the first row that sees the w-th smallest beater index.
__global__ void key_intervals(Params p, Chunk c, Wavelet wm, const std::uint64_t* keys, KeyRows* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= c.items()) return;
  const std::uint64_t key = keys[i];
  const std::int64_t t = i / c.n, r = i % c.n, j = key_index(c, key), g = c.g0 + t;
  if (j >= p.seqlen_k) return;  // padding of the chunk layout
  KeyRows rows{0, 0};
  if (((key >> c.kb) & c.masked()) != c.masked()) {
    const Sequence s = sequence(p, g / p.heads);
    const std::int64_t start = first_row(p, s, j);
    const std::int64_t end = r < p.w ? s.sq : first_row(p, s, wm.kth_smallest(c, t, r, p.w));
    if (start < end) rows = {static_cast<std::int32_t>(start), static_cast<std::int32_t>(end)};
  }
  out[g * p.seqlen_k + j] = rows;
}

// Scratch: O(n log n) bits per head (the levels), 24 bytes per key besides.
void select_intervals(const Params& p, std::int64_t batch, KeyRows* out, cudaStream_t stream) {
  const std::int64_t total = batch * p.heads;
  Chunk full;
  full.n = (std::max<std::int64_t>(p.seqlen_k, 1) + 31) / 32 * 32;
  full.kb = std::max(ceil_log2(full.n), 1);
  full.ob = order_width(p.bias.dtype);
  // Segment ids take the top bits of the 64-bit sort key; items are counted in int.
  full.segments = std::min({total, std::int64_t{1} << (64 - full.ob - full.kb), std::int64_t{INT_MAX} / full.n});
  Chunk last = full;
  last.segments = total % full.segments == 0 ? full.segments : total % full.segments;
  const auto sort_bits = [](const Chunk& c) { return c.ob + c.kb + ceil_log2(c.segments); };

  std::size_t sort_bytes = 0;
  for (const Chunk& c : {full, last}) {
    std::size_t bytes = 0;
    check(cub::DeviceRadixSort::SortKeys(nullptr, bytes, static_cast<const std::uint64_t*>(nullptr),
                                         static_cast<std::uint64_t*>(nullptr), static_cast<int>(c.items()), 0,
                                         sort_bits(c), stream),
          "radix sort size");
    sort_bytes = std::max(sort_bytes, bytes);
  }
  const int tiles = static_cast<int>(full.segments * full.tiles());
  std::size_t state_bytes = 0;
  check(TileState::AllocationSize(tiles, state_bytes), "tile state size");
  const auto aligned = [](std::size_t bytes) { return (bytes + 255) / 256 * 256; };
  state_bytes = aligned(state_bytes);
  const auto items = static_cast<std::size_t>(full.items()), words = static_cast<std::size_t>(full.words());
  const std::size_t sizes[] = {items * 8, items * 8, items * 4, items * 4, full.kb * words * sizeof(uint2),
                               full.kb * state_bytes, sort_bytes};
  std::size_t scratch_bytes = 0;
  for (std::size_t s : sizes) scratch_bytes += aligned(s);
  char* scratch = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&scratch), scratch_bytes, stream), "cudaMallocAsync");
  char* at = scratch;
  const auto take = [&](std::size_t bytes) {
    char* r = at;
    at += aligned(bytes);
    return r;
  };
  auto* keys_in = reinterpret_cast<std::uint64_t*>(take(sizes[0]));
  auto* keys = reinterpret_cast<std::uint64_t*>(take(sizes[1]));
  auto* values = reinterpret_cast<std::uint32_t*>(take(sizes[2]));
  auto* next = reinterpret_cast<std::uint32_t*>(take(sizes[3]));
  const Wavelet wm{reinterpret_cast<uint2*>(take(sizes[4]))};
  char* states = take(sizes[5]);
  void* sort_temp = take(sizes[6]);

  for (std::int64_t g0 = 0; g0 < total; g0 += full.segments) {
    Chunk c = g0 + full.segments >= total ? last : full;
    c.g0 = g0;
    const unsigned blocks = blocks_for(c.items());
    interval_keys<<<blocks, kThreads, 0, stream>>>(p, c, keys_in);
    std::size_t bytes = sort_bytes;
    check(cub::DeviceRadixSort::SortKeys(sort_temp, bytes, keys_in, keys, static_cast<int>(c.items()), 0,
                                         sort_bits(c), stream),
          "radix sort");
    const int chunk_tiles = static_cast<int>(c.segments * c.tiles());
    init_tile_states<<<dim3((chunk_tiles + kThreads - 1) / kThreads, c.kb), kThreads, 0, stream>>>(
        states, state_bytes, chunk_tiles);
    for (int l = 0; l < c.kb; ++l) {
      TileState state;
      check(state.Init(chunk_tiles, states + l * state_bytes, state_bytes), "tile state");
      wavelet_level<<<chunk_tiles, kLevelThreads, 0, stream>>>(c, l, state, wm, keys, values, next);
      std::swap(values, next);
    }
    key_intervals<<<blocks, kThreads, 0, stream>>>(p, c, wm, keys, out);
    check(cudaGetLastError(), "interval kernels");
  }
  check(cudaFreeAsync(scratch, stream), "cudaFreeAsync");
}

// ---- thresholds ------------------------------------------------------------
// Row `row` = (b, s, i) of the selection: the keys [lo, hi) that causal and the
// windows leave it, and where its bias and mask rows start (global key 0).
struct RowSpan {
  std::int64_t lo = 0, hi = 0, bias = 0, mask = 0;
};

__device__ RowSpan row_span(const Params& p, std::int64_t row) {
  const std::int64_t g = row / p.seqlen_q, i = row % p.seqlen_q;
  const std::int64_t b = g / p.heads, h = (g % p.heads) * p.group;
  const Sequence s = sequence(p, b);
  RowSpan r;
  if (i >= s.sq) return r;
  const std::int64_t offset = s.sk - s.sq;
  r.lo = p.window_left < 0 ? 0 : min(max(i + offset - p.window_left, std::int64_t{0}), s.sk);
  r.hi = s.sk;
  if (p.causal) r.hi = min(r.hi, i + offset + 1);
  if (p.window_right >= 0) r.hi = min(r.hi, i + offset + p.window_right + 1);
  r.hi = max(r.hi, r.lo);
  r.bias = b * p.bias.sb + h / p.bias_group * p.bias.sh + (s.qs + i) * p.bias.sr + s.ks * p.bias.sc;
  r.mask = b * p.mask.sb + h / p.mask_group * p.mask.sh + (s.qs + i) * p.mask.sr + s.ks * p.mask.sc;
  return r;
}

// The threshold of a row that keeps every allowed key.
__device__ RowThreshold keep_all() { return {-__int_as_float(0x7F800000), -1}; }

// One CTA per (b, s, row): radix select, 8 bits per pass from the top, of the
// w-th largest key (order_bits(bias_ij) << kbits | j) among the row's allowed keys.
__global__ void __launch_bounds__(kThreads) row_thresholds(Params p, int kbits, RowThreshold* out) {
  using Scan = cub::BlockScan<std::uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ std::uint32_t hist[256];
  __shared__ std::uint64_t found;  // the digits chosen so far
  __shared__ std::int64_t rank;    // rank of the sought key among the candidates left (1 = largest)

  const std::int64_t row = blockIdx.x;
  const RowSpan r = row_span(p, row);
  RowThreshold result = keep_all();
  if (r.hi - r.lo > p.w) {
    const int top = (32 + kbits + 7) / 8 * 8;
    if (threadIdx.x == 0) found = 0, rank = p.w;
    std::uint64_t known = 0;  // the bits that `found` holds
    bool selecting = true;
    for (int shift = top - 8; shift >= 0 && selecting; shift -= 8) {
      hist[threadIdx.x] = 0;
      __syncthreads();
      const std::uint64_t prefix = found;
      const std::int64_t k = rank;
      for (std::int64_t j = r.lo + threadIdx.x; j < r.hi; j += kThreads) {
        if (!load_mask(p.mask, r.mask + j * p.mask.sc)) continue;
        const std::uint64_t key = std::uint64_t{order_bits(load_bias(p.bias, r.bias + j * p.bias.sc))} << kbits |
                                  static_cast<std::uint64_t>(j);
        if ((key & known) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
      }
      __syncthreads();
      // Thread x holds digit 255 - x: inclusive sums count the candidates from the top.
      const std::uint32_t count = hist[255 - threadIdx.x];
      std::uint32_t above = 0, candidates = 0;
      Scan(scan_storage).InclusiveSum(count, above, candidates);
      if (shift == top - 8 && candidates <= p.w) {
        selecting = false;  // at most w allowed keys: the row keeps them all (same on every thread)
      } else if (above >= k && above - count < k) {
        found = prefix | std::uint64_t{255u - threadIdx.x} << shift;
        rank = k - (above - count);
      }
      known |= std::uint64_t{255} << shift;
      __syncthreads();
    }
    if (selecting) result = {from_order_bits(static_cast<std::uint32_t>(found >> kbits)),
                             static_cast<std::int32_t>(found & ((std::uint64_t{1} << kbits) - 1))};
  }
  if (threadIdx.x == 0) out[row] = result;
}

// Few long rows (decode): each row's keys in chunks of kSearchChunk, one CTA a
// chunk, one kernel a pass. The key of j is order_key(bias_j) (order_width
// bits; ties among equal values are resolved by index afterwards); a thread
// holds kSearchItems of its chunk's keys in registers, loaded at once. Digit
// passes, 8 bits from the top: every CTA adds the histogram of its chunk's
// candidates (the allowed keys matching the digits found so far) into the
// row's, and the CTA that takes the row's last ticket picks the digit that
// holds the w-th strongest key and that key's rank among the candidates of
// the digit. After the last digit, the value V of the w-th strongest key is
// known and its rank k among the keys of value V: the tie pass counts those
// per chunk, and its last CTA finds, from the last chunk down, the chunk and
// then the key: the k-th largest index of value V (ties go to the larger index).
constexpr int kSearchItems = 16;
constexpr std::int64_t kSearchChunk = std::int64_t{kThreads} * kSearchItems;

struct RowSearch {
  std::uint32_t prefix;  // the digits found so far
  std::uint32_t rank;    // rank of the sought key among the candidates (1 = strongest)
  std::uint32_t done;    // the row keeps every allowed key (at most w): out is written
  std::uint32_t ticket;  // CTAs of the pass that have finished
};

struct Search {
  RowSearch* rows = nullptr;
  std::uint32_t* counts = nullptr;  // per row `stride` words: the digit histogram, then the tie counts per chunk
  std::int64_t stride = 0;
};

// Whether this CTA is the last of the row's gridDim.x CTAs to finish the pass;
// its global writes before the call are then visible to the last one.
__device__ bool last_of_row(std::uint32_t* ticket) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// Chunk x of row `row`: its keys [begin, end), and whether the row needs a
// search (more than w keys in its range).
struct ChunkOf {
  RowSpan span;
  std::int64_t begin = 0, end = 0;
  bool search = false;
};

__device__ ChunkOf chunk_of(const Params& p, std::int64_t row, std::int64_t x) {
  ChunkOf c;
  c.span = row_span(p, row);
  c.search = c.span.hi - c.span.lo > p.w;
  c.begin = min(c.span.hi, c.span.lo + x * kSearchChunk);
  c.end = min(c.span.hi, c.begin + kSearchChunk);
  return c;
}

// The thread's keys of chunk c: item k is key begin + k * kThreads + threadIdx.x,
// its order key in key[k] and bit k of the result set when it is an allowed key.
__device__ std::uint32_t load_chunk(const Params& p, const ChunkOf& c, std::uint32_t (&key)[kSearchItems]) {
  std::uint32_t valid = 0;
#pragma unroll
  for (int k = 0; k < kSearchItems; ++k) {
    const std::int64_t j = c.begin + k * kThreads + threadIdx.x;
    key[k] = 0;
    if (j < c.end && load_mask(p.mask, c.span.mask + j * p.mask.sc)) {
      key[k] = order_key(p.bias, c.span.bias + j * p.bias.sc);
      valid |= 1u << k;
    }
  }
  return valid;
}

// Digit pass with 8 bits at `shift` (first: the top digit, every allowed key a candidate).
__global__ void __launch_bounds__(kThreads) search_digit(Params p, Search sc, int shift, bool first,
                                                         RowThreshold* out) {
  const std::int64_t row = blockIdx.y;
  const ChunkOf c = chunk_of(p, row, blockIdx.x);
  if (!c.search) {
    if (first && blockIdx.x == 0 && threadIdx.x == 0) out[row] = keep_all();
    return;
  }
  RowSearch& state = sc.rows[row];
  if (!first && state.done) return;
  const std::uint64_t prefix = first ? 0 : state.prefix;
  const std::uint32_t k = first ? static_cast<std::uint32_t>(p.w) : state.rank;
  __shared__ std::uint32_t hist[256];
  hist[threadIdx.x] = 0;
  std::uint32_t key[kSearchItems];
  const std::uint32_t valid = load_chunk(p, c, key);
  __syncthreads();
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int item = 0; item < kSearchItems; ++item) {
    std::uint32_t digit = 256;  // none
    if ((valid >> item & 1u) && (std::uint64_t{key[item]} >> (shift + 8)) == (prefix >> (shift + 8)))
      digit = key[item] >> shift & 255u;
    const unsigned peers = __match_any_sync(0xffffffffu, digit);  // one shared atomic per distinct digit
    if (digit < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], static_cast<std::uint32_t>(__popc(peers)));
  }
  __syncthreads();
  std::uint32_t* const row_hist = sc.counts + row * sc.stride;
  if (hist[threadIdx.x] != 0) atomicAdd(&row_hist[threadIdx.x], hist[threadIdx.x]);
  if (!last_of_row(&state.ticket)) return;
  using Scan = cub::BlockScan<std::uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  // Thread x holds digit 255 - x (read and cleared for the next pass): inclusive sums count from the top.
  const std::uint32_t count = atomicExch(&row_hist[255 - threadIdx.x], 0u);
  std::uint32_t above = 0, candidates = 0;
  Scan(scan_storage).InclusiveSum(count, above, candidates);
  if (first && candidates <= p.w) {
    if (threadIdx.x == 0) state.done = 1, out[row] = keep_all();
  } else if (above >= k && above - count < k) {
    state.prefix = static_cast<std::uint32_t>(prefix | std::uint64_t{255u - threadIdx.x} << shift);
    state.rank = k - (above - count);
  }
  if (threadIdx.x == 0) state.ticket = 0;
}

// Tie pass: the key of value `prefix` with the rank-th largest index.
__global__ void __launch_bounds__(kThreads) search_ties(Params p, Search sc, RowThreshold* out) {
  using Scan = cub::BlockScan<std::uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ std::uint32_t chunk_total, found_chunk, found_rest;
  const std::int64_t row = blockIdx.y;
  const ChunkOf c = chunk_of(p, row, blockIdx.x);
  RowSearch& state = sc.rows[row];
  if (!c.search || state.done) return;
  const std::uint32_t value = state.prefix, k = state.rank;
  std::uint32_t key[kSearchItems];
  const auto ties_of = [&](std::uint32_t valid) {  // bit k: item k is a key of value V
    std::uint32_t ties = 0;
#pragma unroll
    for (int item = 0; item < kSearchItems; ++item)
      if ((valid >> item & 1u) && key[item] == value) ties |= 1u << item;
    return ties;
  };
  std::uint32_t ties = ties_of(load_chunk(p, c, key));
  if (threadIdx.x == 0) chunk_total = 0;
  __syncthreads();
  if (ties != 0) atomicAdd(&chunk_total, static_cast<std::uint32_t>(__popc(ties)));
  __syncthreads();
  std::uint32_t* const chunk_ties = sc.counts + row * sc.stride;
  if (threadIdx.x == 0) chunk_ties[blockIdx.x] = chunk_total;
  if (!last_of_row(&state.ticket)) return;
  // The chunk holding the sought key: from the last chunk down, kThreads chunks a step.
  std::uint32_t before = 0;
  for (std::int64_t top = std::int64_t{gridDim.x} - 1; top >= 0; top -= kThreads) {
    const std::int64_t at = top - threadIdx.x;
    const std::uint32_t n = at >= 0 ? __ldcg(&chunk_ties[at]) : 0u;
    std::uint32_t upto = 0, total = 0;
    Scan(scan_storage).InclusiveSum(n, upto, total);
    if (n > 0 && before + upto >= k && before + upto - n < k)
      found_chunk = static_cast<std::uint32_t>(at), found_rest = k - (before + upto - n);
    __syncthreads();
    if (before + total >= k) break;
    before += total;
  }
  // In that chunk, from its last key down: the item, then the thread.
  const ChunkOf target = chunk_of(p, row, found_chunk);
  const std::uint32_t rest = found_rest;
  ties = ties_of(load_chunk(p, target, key));
  before = 0;
  int item = kSearchItems - 1;
  for (; item > 0; --item) {
    const auto n = static_cast<std::uint32_t>(__syncthreads_count(ties >> item & 1u));
    if (before + n >= rest) break;
    before += n;
  }
  // Thread x scans the tie bit of thread kThreads - 1 - x: inclusive sums count from the top.
  __shared__ std::uint32_t flags[kThreads];
  flags[threadIdx.x] = ties >> item & 1u;
  __syncthreads();
  const std::uint32_t flag = flags[kThreads - 1 - threadIdx.x];
  std::uint32_t upto = 0;
  Scan(scan_storage).InclusiveSum(flag, upto);
  if (flag != 0 && before + upto == rest) {
    const std::int64_t j = target.begin + std::int64_t{item} * kThreads + (kThreads - 1 - threadIdx.x);
    out[row] = {load_bias(p.bias, target.span.bias + j * p.bias.sc), static_cast<std::int32_t>(j)};
  }
  if (threadIdx.x == 0) state.ticket = 0;
}

// Rows of more than one chunk take the chunked search when there are at most
// kSearchRows of them (its scratch: a 256-bin histogram a row); more rows take
// one CTA each (row_thresholds), which fill the GPU anyway.
constexpr std::int64_t kSearchRows = 4096;

void select_thresholds(const Params& p, std::int64_t rows, RowThreshold* out, cudaStream_t stream) {
  const std::int64_t chunks = (p.seqlen_k + kSearchChunk - 1) / kSearchChunk;
  if (chunks < 2 || rows > kSearchRows) {
    row_thresholds<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(p, std::max(ceil_log2(p.seqlen_k), 1), out);
    check(cudaGetLastError(), "row_thresholds");
    return;
  }
  Search sc;
  sc.stride = std::max<std::int64_t>(256, chunks);
  const std::size_t state_bytes = static_cast<std::size_t>(rows) * sizeof(RowSearch);
  const std::size_t bytes = state_bytes + static_cast<std::size_t>(rows * sc.stride) * 4;
  char* scratch = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&scratch), bytes, stream), "cudaMallocAsync");
  check(cudaMemsetAsync(scratch, 0, bytes, stream), "cudaMemsetAsync");
  sc.rows = reinterpret_cast<RowSearch*>(scratch);
  sc.counts = reinterpret_cast<std::uint32_t*>(scratch + state_bytes);
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(rows));
  const int width = order_width(p.bias.dtype);
  for (int shift = width - 8; shift >= 0; shift -= 8)
    search_digit<<<grid, kThreads, 0, stream>>>(p, sc, shift, shift == width - 8, out);
  search_ties<<<grid, kThreads, 0, stream>>>(p, sc, out);
  check(cudaGetLastError(), "threshold search");
  check(cudaFreeAsync(scratch, stream), "cudaFreeAsync");
}

// ---- key groups for the backward (dk/dv) ----------------------------------
// What the grouping kernels read: slice z = b * kv_heads + kvh uses selection
// heads [first, last] (those of the query heads of kv head kvh); segment s of
// it holds rows [s * segment_rows, (s + 1) * segment_rows).
struct GroupParams {
  const KeyRows* intervals = nullptr;
  std::int64_t sel_heads = 0, sel_group = 1, group = 1, kv_heads = 1, seqlen_k = 0;
  std::int64_t segments = 1, segment_rows = 0;
  const std::int32_t* cu_seqlens_k = nullptr;
  int end_bits = 32;  // sort key: (slice, segment) << end_bits | end in the segment; all ones: no piece
  __host__ __device__ std::uint64_t no_end() const { return (std::uint64_t{1} << end_bits) - 1; }
  __device__ std::int64_t sk(std::int64_t z) const {
    const std::int64_t b = z / kv_heads;
    return cu_seqlens_k == nullptr ? seqlen_k : cu_seqlens_k[b + 1] - cu_seqlens_k[b];
  }
  __device__ std::int64_t first_head(std::int64_t z) const { return z % kv_heads * group / sel_group; }
  __device__ std::int64_t last_head(std::int64_t z) const { return (z % kv_heads * group + group - 1) / sel_group; }
  __device__ KeyRows at(std::int64_t z, std::int64_t s, std::int64_t j) const {
    return intervals[(z / kv_heads * sel_heads + s) * seqlen_k + j];
  }
  // Key j's piece in segment s: the hull of the slice's intervals within the
  // segment ({0, 0}: no head selects j there); j in the sequence.
  __device__ KeyRows piece(std::int64_t z, std::int64_t s, std::int64_t j) const {
    const std::int64_t lo = s * segment_rows, hi = lo + segment_rows;
    std::int64_t start = hi, end = lo;
    for (std::int64_t h = first_head(z); h <= last_head(z); ++h) {
      const KeyRows r = at(z, h, j);
      const std::int64_t a = max(std::int64_t{r.start}, lo), e = min(std::int64_t{r.end}, hi);
      if (a < e) start = min(start, a), end = max(end, e);
    }
    return start < end ? KeyRows{static_cast<std::int32_t>(start), static_cast<std::int32_t>(end)} : KeyRows{0, 0};
  }
  // Pieces of key j in segments [0, upto) of slice z.
  __device__ std::int32_t pieces_before(std::int64_t z, std::int64_t j, std::int64_t upto) const {
    if (first_head(z) == last_head(z)) {  // one interval: a piece in each segment it meets
      const KeyRows r = at(z, first_head(z), j);
      if (r.end <= r.start) return 0;
      return static_cast<std::int32_t>(max(std::int64_t{0}, min(upto, (r.end - 1) / segment_rows + 1) - r.start / segment_rows));
    }
    std::int64_t from = upto;  // the segment of the earliest start
    for (std::int64_t h = first_head(z); h <= last_head(z); ++h) {
      const KeyRows r = at(z, h, j);
      if (r.end > r.start) from = min(from, r.start / segment_rows);
    }
    std::int32_t n = 0;
    for (std::int64_t s = from; s < upto; ++s) n += piece(z, s, j).end > 0;
    return n;
  }
};

// Sort keys, one thread per (slice, segment, key): (slice, segment) in the top
// bits, then the end of the key's piece there (from the segment's first row)
// in end_bits; no piece (or out of sequence): all ones there.
__global__ void __launch_bounds__(kThreads) group_sort_keys(const GroupParams p, std::int64_t items, std::uint64_t* keys,
                                                            std::int32_t* values) {
  const std::int64_t e = std::int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (e >= items) return;
  const std::int64_t v = e / p.seqlen_k, j = e % p.seqlen_k, z = v / p.segments, s = v % p.segments;
  std::uint64_t end = p.no_end();
  if (j < p.sk(z)) {
    const KeyRows r = p.piece(z, s, j);
    if (r.end > r.start) end = static_cast<std::uint64_t>(r.end - s * p.segment_rows);
  }
  keys[e] = static_cast<std::uint64_t>(v) << p.end_bits | end;
  values[e] = static_cast<std::int32_t>(j);
}

// The number of pieces of each key, one thread per (slice, key).
__global__ void __launch_bounds__(kThreads) count_pieces(const GroupParams p, std::int64_t items, std::int32_t* pieces) {
  const std::int64_t e = std::int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (e >= items) return;
  const std::int64_t z = e / p.seqlen_k, j = e % p.seqlen_k;
  pieces[e] = j < p.sk(z) ? p.pieces_before(z, j, p.segments) : 0;
}

// Strips: after the sort by end, each run of kStripGroups groups of a
// (slice, segment) is sorted again by the start of its pieces (stable; entries
// without a piece stay last). The end alone leaves a group's starts spread
// from the segment's first row to its end; a strip's ends stay close and its
// groups each take a third of its starts. Fill of the dk/dv walk at S =
// 16384, w = 1024, uniform key bias, no segments: 0.622 (end) -> 0.705 (strips
// of 3; 2 and 4 close, 8 back to 0.62: docs/kernels.md).
constexpr int kStripGroups = 3;

// One CTA of kBlock threads per (strip, slice and segment v): kStripGroups
// items a thread, blocked, so that the sorted strip comes back in place; then
// the entries' keys (-1: no piece) and, with rank, the pieces' ranks.
template <int kBlock>
__global__ void __launch_bounds__(kBlock) sort_strips(const GroupParams p, const std::uint64_t* sorted, std::int32_t* order,
                                                      std::int32_t* rank) {
  using Sort = cub::BlockRadixSort<std::uint32_t, kBlock, kStripGroups, std::int32_t>;
  __shared__ typename Sort::TempStorage storage;
  const std::int64_t v = blockIdx.y, z = v / p.segments, s = v % p.segments;
  const std::int64_t pos0 = std::int64_t{blockIdx.x} * kBlock * kStripGroups + threadIdx.x * kStripGroups;
  if ((sorted[v * p.seqlen_k + std::int64_t{blockIdx.x} * kBlock * kStripGroups] & p.no_end()) == p.no_end()) {
    for (int i = 0; i < kStripGroups; ++i)  // a strip past the pieces (most of them with many segments)
      if (pos0 + i < p.seqlen_k) order[v * p.seqlen_k + pos0 + i] = -1;
    return;
  }
  std::uint32_t start[kStripGroups];
  std::int32_t key[kStripGroups];
  for (int i = 0; i < kStripGroups; ++i) {
    const std::int64_t pos = pos0 + i;
    start[i] = 0xffffffffu, key[i] = -1;
    if (pos >= p.seqlen_k || (sorted[v * p.seqlen_k + pos] & p.no_end()) == p.no_end()) continue;
    key[i] = order[v * p.seqlen_k + pos];
    start[i] = static_cast<std::uint32_t>(p.piece(z, s, key[i]).start);
  }
  Sort(storage).Sort(start, key);
  for (int i = 0; i < kStripGroups; ++i) {
    const std::int64_t at = v * p.seqlen_k + pos0 + i;
    if (pos0 + i >= p.seqlen_k) continue;
    order[at] = key[i];
    if (rank != nullptr) rank[at] = key[i] >= 0 ? p.pieces_before(z, key[i], s) : 0;
  }
}

// One CTA per slice z: the groups of its segments in order, each segment's
// groups from its last (the latest ends) to its first; first[z * groups + g]
// = the entry of group g's first piece, -1 past the last group. The slice's
// groups never exceed `groups` (group_keys proves the bound).
__global__ void group_firsts(const GroupParams p, const std::uint64_t* sorted, std::int64_t groups, std::int32_t* first) {
  extern __shared__ std::int64_t seg_first[];  // [segments + 1]: the segments' first group
  const std::int64_t z = blockIdx.x;
  for (std::int64_t s = threadIdx.x; s < p.segments; s += blockDim.x) {
    const std::uint64_t* keys = sorted + (z * p.segments + s) * p.seqlen_k;
    std::int64_t lo = 0, hi = p.seqlen_k;  // the first entry without a piece
    while (lo < hi) {
      const std::int64_t mid = (lo + hi) / 2;
      if ((keys[mid] & p.no_end()) == p.no_end()) hi = mid; else lo = mid + 1;
    }
    seg_first[s + 1] = (lo + kKeyGroupKeys - 1) / kKeyGroupKeys;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    seg_first[0] = 0;
    for (std::int64_t s = 0; s < p.segments; ++s) seg_first[s + 1] += seg_first[s];
  }
  __syncthreads();
  for (std::int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
    std::int64_t s = 0;
    while (s < p.segments && seg_first[s + 1] <= g) ++s;
    first[z * groups + g] = s < p.segments ? static_cast<std::int32_t>((z * p.segments + s) * p.seqlen_k +
                                                                      (seg_first[s + 1] - 1 - g) * kKeyGroupKeys)
                                           : -1;
  }
}

// One CTA of `block` threads per (group g, slice z): the union of the group's
// pieces (unsorted: of its keys' intervals).
__global__ void group_rows(const GroupParams p, const std::int32_t* order, const std::int32_t* first, std::int64_t groups,
                           KeyRows* rows) {
  const std::int64_t z = blockIdx.y;
  __shared__ int lo, hi;
  if (threadIdx.x == 0) lo = INT_MAX, hi = INT_MIN;
  __syncthreads();
  std::int64_t j = -1, s = 0;
  if (first != nullptr) {
    const std::int64_t at = first[z * groups + blockIdx.x];
    if (at >= 0 && at % p.seqlen_k + threadIdx.x < p.seqlen_k)
      j = order[at + threadIdx.x], s = at / p.seqlen_k % p.segments;
  } else {
    j = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
    if (j >= p.sk(z)) j = -1;
  }
  if (j >= 0) {
    const KeyRows r = p.piece(z, s, j);
    if (r.end > r.start) atomicMin(&lo, r.start), atomicMax(&hi, r.end);
  }
  __syncthreads();
  if (threadIdx.x == 0) rows[z * groups + blockIdx.x] = lo < hi ? KeyRows{lo, hi} : KeyRows{0, 0};
}

}  // namespace

DeviceSelection select_topk(const Problem& p) {
  DeviceSelection sel;
  if (p.keep_window_size == 0) return sel;
  if (p.bias.dtype != DType::kFloat32 && p.bias.dtype != DType::kFloat16 && p.bias.dtype != DType::kBFloat16)
    throw Error(Error::Kind::kUnsupported, "bias.dtype", "float32, float16 or bfloat16 for the CUDA top-k",
                dtype_name(p.bias.dtype));
  sel.mode = p.topk_by_intervals() ? DeviceSelection::kIntervals : DeviceSelection::kThresholds;
  sel.heads = std::max(p.bias_shape.heads, p.mask.present() ? p.mask_shape.heads : std::int64_t{1});
  sel.group = p.heads / sel.heads;
  sel.per_head = sel.mode == DeviceSelection::kIntervals ? p.seqlen_k : p.seqlen_q;

  Params params;
  params.bias = p.bias, params.mask = p.mask;
  params.heads = sel.heads, params.group = sel.group;
  params.bias_group = p.heads / p.bias_shape.heads;
  params.mask_group = p.heads / p.mask_shape.heads;
  params.seqlen_q = p.seqlen_q, params.seqlen_k = p.seqlen_k;
  params.cu_seqlens_q = p.cu_seqlens_q, params.cu_seqlens_k = p.cu_seqlens_k;
  params.causal = p.causal;
  params.window_left = p.window_left, params.window_right = p.window_right;
  params.w = p.keep_window_size;

  const auto stream = static_cast<cudaStream_t>(p.stream);
  const std::int64_t entries = p.batch * sel.heads * sel.per_head;
  if (entries == 0) return sel;
  if (sel.mode == DeviceSelection::kIntervals) {
    check(cudaMallocAsync(reinterpret_cast<void**>(&sel.intervals), entries * sizeof(KeyRows), stream),
          "cudaMallocAsync");
    select_intervals(params, p.batch, sel.intervals, stream);
  } else {
    check(cudaMallocAsync(reinterpret_cast<void**>(&sel.thresholds), entries * sizeof(RowThreshold), stream),
          "cudaMallocAsync");
    select_thresholds(params, entries, sel.thresholds, stream);
  }
  return sel;
}

void free_selection(DeviceSelection& sel, cudaStream_t stream) {
  if (sel.intervals != nullptr) check(cudaFreeAsync(sel.intervals, stream), "cudaFreeAsync");
  if (sel.thresholds != nullptr) check(cudaFreeAsync(sel.thresholds, stream), "cudaFreeAsync");
  sel.intervals = nullptr;
  sel.thresholds = nullptr;
}

KeyGroups group_keys(const DeviceSelection& sel, std::int64_t batch, std::int64_t heads, std::int64_t kv_heads,
                     std::int64_t seqlen_q, std::int64_t seqlen_k, const std::int32_t* cu_seqlens_k, std::int64_t w,
                     bool sort, bool split, cudaStream_t stream) {
  constexpr int block = kKeyGroupKeys;
  GroupParams p;
  p.intervals = sel.intervals;
  p.sel_heads = sel.heads, p.sel_group = sel.group, p.group = heads / kv_heads, p.kv_heads = kv_heads;
  p.seqlen_k = seqlen_k, p.cu_seqlens_k = cu_seqlens_k;
  KeyGroups g;
  const std::int64_t slices = batch * kv_heads, key_groups = (seqlen_k + block - 1) / block;
  g.groups = key_groups;
  if (slices * seqlen_k == 0) return g;
  // Segments of kKeySegmentRows rows, or of a multiple of it so that there are
  // at most kMaxKeySegments (the sort has an item a key and segment), where the
  // sort's items and grid fit; else one segment, or unsorted.
  const auto fits = [&](std::int64_t segments, std::int64_t rows) {
    return slices * segments * seqlen_k <= INT_MAX && slices * segments <= 65535 &&
           ceil_log2(rows + 2) + ceil_log2(slices * segments) <= 64;
  };
  p.segments = 1, p.segment_rows = std::max<std::int64_t>(seqlen_q, 1);
  sort = sort && fits(1, p.segment_rows);
  if (split && sort && seqlen_q > kKeySegmentRows) {
    const std::int64_t base = (seqlen_q + kKeySegmentRows - 1) / kKeySegmentRows;  // segments of kKeySegmentRows
    const std::int64_t rows = kKeySegmentRows * ((base + kMaxKeySegments - 1) / kMaxKeySegments);
    const std::int64_t segments = (seqlen_q + rows - 1) / rows;
    if (fits(segments, rows)) p.segments = segments, p.segment_rows = rows;
  }
  p.end_bits = ceil_log2(std::min(seqlen_q, p.segment_rows) + 2);  // ends 1..rows and the all-ones value
  g.segments = p.segments, g.segment_rows = p.segment_rows;
  const std::int64_t items = slices * p.segments * seqlen_k;
  if (sort) {
    // The dk/dv grid: a bound on the groups of a slice, known without reading
    // the selection (no host sync). Proof: a key's piece in segment s exists
    // iff one of the slice's selection heads selects the key in a row of s. For
    // one head, key j's rows are one interval [start, end); it meets 1 + c
    // segments, c the segment boundaries r (r a multiple of segment_rows,
    // start < r < end) it crosses, and a key crossing r is selected by row r,
    // which selects at most min(w, seqlen_k) keys. So a head has at most
    // seqlen_k + (segments - 1) min(w, seqlen_k) pieces (varlen: fewer rows and
    // keys), the slice at most `pieces` below (a piece of the hull is a piece of
    // one of its heads), and at most seqlen_k in each segment. Segment s takes
    // ceil(n_s / 128) groups; summed over the segments that is at most
    // ceil(sum n_s / 128) + segments - 1, and at most segments ceil(seqlen_k /
    // 128).
    std::int64_t slice_heads = 1;  // most selection heads of a slice's query heads
    for (std::int64_t kvh = 0; kvh < kv_heads; ++kvh)
      slice_heads = std::max(slice_heads, (kvh * p.group + p.group - 1) / sel.group - kvh * p.group / sel.group + 1);
    const std::int64_t pieces = std::min(p.segments * seqlen_k,
                                         slice_heads * (seqlen_k + (p.segments - 1) * std::min(w, seqlen_k)));
    g.groups = std::min(p.segments * key_groups, (pieces + block - 1) / block + p.segments - 1);
  }
  const int sort_bits = p.end_bits + ceil_log2(slices * p.segments);
  std::size_t sort_bytes = 0;
  if (sort)
    check(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const std::uint64_t*>(nullptr),
                                          static_cast<std::uint64_t*>(nullptr), static_cast<const std::int32_t*>(nullptr),
                                          static_cast<std::int32_t*>(nullptr), static_cast<int>(items), 0,
                                          sort_bits, stream),
          "radix sort size");
  const auto aligned = [](std::size_t bytes) { return (bytes + 255) / 256 * 256; };
  const auto n = static_cast<std::size_t>(items), keys = static_cast<std::size_t>(slices * seqlen_k);
  const std::size_t group_entries = static_cast<std::size_t>(slices * g.groups);
  const std::size_t rows_bytes = aligned(group_entries * sizeof(KeyRows));
  const std::size_t sorted_bytes =
      sort ? aligned(n * 4) + (p.segments > 1 ? aligned(n * 4) : 0) + aligned(keys * 4) + aligned(group_entries * 4) : 0;
  char* memory = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&memory), rows_bytes + sorted_bytes, stream), "cudaMallocAsync");
  g.rows = reinterpret_cast<KeyRows*>(memory);
  if (sort) {
    char* at = memory + rows_bytes;
    g.order = reinterpret_cast<std::int32_t*>(at), at += aligned(n * 4);
    if (p.segments > 1) g.rank = reinterpret_cast<std::int32_t*>(at), at += aligned(n * 4);
    g.pieces = reinterpret_cast<std::int32_t*>(at), at += aligned(keys * 4);
    g.first = reinterpret_cast<std::int32_t*>(at);
    char* scratch = nullptr;
    const std::size_t sizes[] = {aligned(n * 8), aligned(n * 8), aligned(n * 4), aligned(sort_bytes)};
    check(cudaMallocAsync(reinterpret_cast<void**>(&scratch), sizes[0] + sizes[1] + sizes[2] + sizes[3], stream),
          "cudaMallocAsync");
    auto* keys_in = reinterpret_cast<std::uint64_t*>(scratch);
    auto* keys_out = reinterpret_cast<std::uint64_t*>(scratch + sizes[0]);
    auto* values_in = reinterpret_cast<std::int32_t*>(scratch + sizes[0] + sizes[1]);
    void* temp = scratch + sizes[0] + sizes[1] + sizes[2];
    group_sort_keys<<<blocks_for(items), kThreads, 0, stream>>>(p, items, keys_in, values_in);
    count_pieces<<<blocks_for(slices * seqlen_k), kThreads, 0, stream>>>(p, slices * seqlen_k, g.pieces);
    check(cub::DeviceRadixSort::SortPairs(temp, sort_bytes, keys_in, keys_out, values_in, g.order,
                                          static_cast<int>(items), 0, sort_bits, stream),
          "radix sort");
    const std::int64_t strips = (seqlen_k + block * kStripGroups - 1) / (block * kStripGroups);
    sort_strips<block><<<dim3(static_cast<unsigned>(strips), static_cast<unsigned>(slices * p.segments)), block, 0, stream>>>(
        p, keys_out, g.order, g.rank);
    group_firsts<<<static_cast<unsigned>(slices), kThreads, static_cast<std::size_t>(p.segments + 1) * 8, stream>>>(
        p, keys_out, g.groups, g.first);
    check(cudaFreeAsync(scratch, stream), "cudaFreeAsync");
  }
  group_rows<<<dim3(static_cast<unsigned>(g.groups), static_cast<unsigned>(slices)), block, 0, stream>>>(p, g.order, g.first,
                                                                                                         g.groups, g.rows);
  check(cudaGetLastError(), "key group kernels");
  return g;
}

void free_groups(KeyGroups& groups, cudaStream_t stream) {
  if (groups.rows != nullptr) check(cudaFreeAsync(groups.rows, stream), "cudaFreeAsync");
  groups = KeyGroups{};
}

}  // namespace dmattn::cuda
