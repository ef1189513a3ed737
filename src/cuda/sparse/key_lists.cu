// Key lists of a mask and/or a top-k selection (KeyLists): per query block the
// keys that some row of the block may see and per row a bit for each listed
// key, which the sm80 forward and the backward's dq walk follow instead of
// scanning every key. A mask takes pack_mask then gather_mask_keys; top-k takes
// list_topk_keys (intervals) or mark_topk then list_topk_chunk (thresholds).
#include "key_lists.h"

#include <algorithm>
#include <cstdint>

#include "../common/check.h"
#include "../common/element.cuh"
#include "../common/warp.cuh"

namespace dmattn::cuda {
namespace {

// Pre-pass 1, one CTA per (64-key tile at col0, rows [row0, row0 + rows) of a
// query block): one warp a row, 32 keys a lane step. A pair is allowed when the
// key is in the row's range and allowed(i, col) (the mask or the top-k test).
// Writes each row's allowed keys as bits (unless bits is null) and in any_out
// (two words) the keys some row may see. Tiles that the causal band, the window
// or the key range keep from every row are not read.
template <int kThreads, class Allowed>
__device__ void mark_tile(const KeyListParams& p, std::int64_t sq, std::int64_t sk, std::int64_t row0, int rows,
                          std::int64_t col0, Allowed allowed, std::uint32_t* bits, std::uint32_t* any_out) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t offset = sk - sq;
  const KeyRange tile_keys = keys_of_queries(p.band, offset, sk, row0, row0 + rows - 1);
  if (rows <= 0 || col0 >= tile_keys.end || col0 + 64 <= tile_keys.first) {
    if (threadIdx.x < 2) any_out[threadIdx.x] = 0;
    return;
  }
  std::uint32_t any[2] = {0, 0};
#pragma unroll 4
  for (int r = warp; r < rows; r += kWarps) {
    const std::int64_t i = row0 + r;
    const KeySpan keys = keys_of_query(p.band, offset, sk, i);
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const std::int64_t col = col0 + 32 * w + lane;
      const std::uint32_t word = __ballot_sync(0xffffffff, col >= keys.lo && col <= keys.hi && allowed(i, col));
      if (bits != nullptr && lane == 0) bits[r * p.bits_sr + w] = word;
      any[w] |= word;
    }
  }
  __shared__ std::uint32_t block_any[2];
  if (threadIdx.x < 2) block_any[threadIdx.x] = 0;
  __syncthreads();
  if (lane < 2) atomicOr(&block_any[lane], any[lane]);
  __syncthreads();
  if (threadIdx.x < 2) any_out[threadIdx.x] = block_any[threadIdx.x];
}

// The indices t of the set bits of the words any_word(0 .. words - 1),
// ascending (a block-wide prefix sum over the words' popcounts): emit(at, t)
// for the at-th of them. Returns their count. any_word is called by every
// thread (with w >= words too: it returns 0 there).
template <int kThreads, class AnyWord, class Emit>
__device__ std::int64_t compact_bits(std::int64_t words, AnyWord any_word, Emit emit) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ int warp_total[kWarps];
  std::int64_t total = 0;
  for (std::int64_t w0 = 0; w0 < words; w0 += kThreads) {
    const std::int64_t w = w0 + threadIdx.x;
    const std::uint32_t word = any_word(w);
    const int count = __popc(word);
    const int prefix = warp_inclusive_sum(count, lane);
    if (lane == 31) warp_total[warp] = prefix;
    __syncthreads();
    std::int64_t before = total;
    for (int j = 0; j < warp; ++j) before += warp_total[j];
    for (int j = 0; j < kWarps; ++j) total += warp_total[j];
    __syncthreads();
    std::int64_t at = before + prefix - count;
    // The warp places its bits by whichever takes fewer steps: each lane its
    // own word's bits in turn (scattered stores), or the warp one word at a
    // time, lane b its bit b (contiguous stores).
    const std::uint32_t words_set = __ballot_sync(0xffffffff, word != 0);
    if (__popc(words_set) <= static_cast<int>(__reduce_max_sync(0xffffffff, static_cast<unsigned>(count)))) {
      for (std::uint32_t left = words_set; left != 0; left &= left - 1) {
        const int k = __ffs(left) - 1;
        const std::uint32_t its = __shfl_sync(0xffffffff, word, k);
        const std::int64_t its_at = __shfl_sync(0xffffffff, at, k);
        if ((its >> lane) & 1u) emit(its_at + __popc(its & ((1u << lane) - 1)), 32 * (w - lane + k) + lane);
      }
    } else {
      for (std::uint32_t bitsleft = word; bitsleft != 0; bitsleft &= bitsleft - 1, ++at)
        emit(at, 32 * w + __ffs(bitsleft) - 1);
    }
  }
  return total;
}

// Pre-pass 2 for one query block (`block` = z * mask_blocks + m), its list:
// the keys key_at(t) of the set bits t of compact_bits at mask_keys, and
// their count at mask_counts; a key past keys_stride would be dropped (the
// sizes exclude it). Returns the count.
template <int kThreads, class AnyWord, class KeyAt>
__device__ int list_keys(const KeyListParams& p, std::int64_t block, std::int64_t words, AnyWord any_word,
                         KeyAt key_at) {
  std::int32_t* keys = p.mask_keys + block * p.keys_stride;
  const std::int64_t total = compact_bits<kThreads>(words, any_word, [&](std::int64_t at, std::int64_t t) {
    if (at < p.keys_stride) keys[at] = key_at(t);
  });
  const int listed = static_cast<int>(min(total, p.keys_stride));
  if (threadIdx.x == 0) p.mask_counts[block] = listed;
  __syncthreads();
  return listed;
}

// The list of list_keys, then the bits of the block's `rows` rows (from bits0):
// each warp writes the bits of one row at a time over the list, 32 slots a word
// and kGroup words at once: slot t of row r is allowed(r, key t). Every read of
// a group precedes its writes and a slot t <= its key, so `allowed` may read
// the row's key-indexed bits in place.
template <int kThreads, class AnyWord, class Allowed>
__device__ void list_block_keys(const KeyListParams& p, std::int64_t block, std::int64_t words_in, AnyWord any_word,
                                int rows, std::uint32_t* bits0, Allowed allowed) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int32_t* keys = p.mask_keys + block * p.keys_stride;
  const int listed = list_keys<kThreads>(p, block, words_in, any_word,
                                          [](std::int64_t t) { return static_cast<std::int32_t>(t); });
  constexpr int kGroup = 8;  // words a step: their reads go out together
  const int words = (listed + 63) / 64 * 2;
  for (int w0 = 0; w0 < words; w0 += kGroup) {
    int key[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const int t = 32 * (w0 + j) + lane;
      key[j] = t < listed ? keys[t] : -1;
    }
    for (int r = warp; r < rows; r += kWarps) {
      bool ok[kGroup];
#pragma unroll
      for (int j = 0; j < kGroup; ++j) ok[j] = key[j] >= 0 && allowed(r, key[j]);
      std::uint32_t* bits = bits0 + r * p.bits_sr;
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        const std::uint32_t word = __ballot_sync(0xffffffff, ok[j]);
        if (lane == 0 && w0 + j < words) bits[w0 + j] = word;
      }
    }
  }
}

// Whether the pre-passes skip their work (KeyLists::build_if).
__device__ inline bool skip_lists(const KeyLists& p) { return p.build_if != nullptr && *p.build_if == 0; }

// Mask pre-pass 1. Block (n, m, z) reads the mask of keys 64 n .. 64 n + 63 for
// the rows of query block m of slice z, one warp a row and 32 bytes at once,
// into each row's key-indexed bits and `key_any` (bits_sr words a block). The
// mask takes no varlen: rows and keys are the batched ones.
template <int kBlockM, int kThreads>
__global__ void __launch_bounds__(kThreads) pack_mask(const KeyListParams p, int mask_heads, std::uint32_t* key_any) {
  if (skip_lists(p)) return;
  const int n = blockIdx.x;
  const std::int64_t row0 = std::int64_t{blockIdx.y} * kBlockM;
  const int rows = static_cast<int>(min(std::int64_t{kBlockM}, p.seqlen_q - row0));
  const int mb = blockIdx.z / mask_heads, mh = blockIdx.z % mask_heads;
  const auto* mask = static_cast<const std::uint8_t*>(p.mask.data) + element_at(p.mask, mb, mh, 0, 0);
  mark_tile<kThreads>(
      p, p.seqlen_q, p.seqlen_k, row0, rows, std::int64_t{n} * 64,
      [&](std::int64_t i, std::int64_t col) { return mask[i * p.mask.sr + col * p.mask.sc] != 0; },
      p.mask_bits + (std::int64_t{blockIdx.z} * p.seqlen_q + row0) * p.bits_sr + 2 * n,
      key_any + (std::int64_t{blockIdx.z} * p.mask_blocks + blockIdx.y) * p.bits_sr + 2 * n);
}

// Mask pre-pass 2. Block (m, z) lists the keys of `key_any` of query block m and
// rewrites its rows' bits in place, from key-indexed to list-indexed.
template <int kBlockM, int kThreads>
__global__ void __launch_bounds__(kThreads) gather_mask_keys(const KeyListParams p, const std::uint32_t* key_any) {
  if (skip_lists(p)) return;
  const std::int64_t block = std::int64_t{blockIdx.y} * p.mask_blocks + blockIdx.x;
  const std::uint32_t* any = key_any + block * p.bits_sr;
  const std::int64_t row0 = std::int64_t{blockIdx.x} * kBlockM;
  std::uint32_t* const bits0 = p.mask_bits + (std::int64_t{blockIdx.y} * p.seqlen_q + row0) * p.bits_sr;
  list_block_keys<kThreads>(
      p, block, p.bits_sr, [&](std::int64_t w) { return w < p.bits_sr ? any[w] : 0u; },
      static_cast<int>(min(std::int64_t{kBlockM}, p.seqlen_q - row0)), bits0,
      [&](int r, int key) { return ((bits0[r * p.bits_sr + key / 32] >> (key % 32)) & 1u) != 0; });
}

// One top-k list slice: z = b * topk_heads + s (selection head s), or with
// folded query heads (topk_fold) z = b * kv heads + kv head, whose row i is
// query head kv head * topk_fold + i. Its sequence and where its bias, mask and
// selection entries start.
struct TopkSlice {
  std::int64_t sq = 0, sk = 0;     // local lengths
  std::int64_t bias = 0, mask = 0;  // element offsets of local (row 0, key 0)
  std::int64_t sel = 0;             // selection index of local key / row 0
  std::int64_t sel_sr = 1;          // selection entries from one row to the next
};

__device__ inline TopkSlice topk_slice(const KeyListParams& p, int z) {
  TopkSlice s;
  int b = z / p.topk_heads, h = z % p.topk_heads * p.topk_group;  // h: a query head of selection head s
  s.sel = std::int64_t{z} * (p.topk_intervals != nullptr ? p.seqlen_k : p.seqlen_q);
  if (p.topk_fold > 1) {  // one query row (no varlen): the rows' selection heads are one, or one a row
    const int kv_heads = p.topk_heads * p.topk_group / p.topk_fold;
    b = z / kv_heads, h = z % kv_heads;
    s.sel = std::int64_t{b} * p.topk_heads + h * p.topk_fold / p.topk_group;
    s.sel_sr = p.topk_group == 1 ? 1 : 0;
  }
  const Sequence seq(p, b);
  s.sq = seq.sq, s.sk = seq.sk;
  s.bias = element_at(p.bias, b, h / p.bias_group, seq.qs, seq.ks);
  s.mask = element_at(p.mask, b, h / p.mask_group, seq.qs, seq.ks);
  return s;
}

// Thresholds: whether local row i, with key j in its key range, keeps j (the
// mask, if any, and (bias_ij, j) >= the row's threshold).
__device__ bool threshold_keeps(const KeyListParams& p, const TopkSlice& s, std::int64_t i, std::int64_t j) {
  if (p.mask.data != nullptr && static_cast<const std::uint8_t*>(p.mask.data)[s.mask + i * p.mask.sr + j * p.mask.sc] == 0)
    return false;
  const RowThreshold t = p.topk_thresholds[s.sel + i * s.sel_sr];
  const float value = load_as_float(p.bias.data, p.bias.dtype, s.bias + i * p.bias.sr + j * p.bias.sc);
  return value > t.value || (value == t.value && j >= t.key);
}

// Top-k lists of thresholds, in chunks of kListChunkWords words (32 keys a
// word) of a query block's keys, one CTA a chunk: a pass counts and marks, a
// pass lists and writes the bits, so that a long row (decode) spreads over
// many CTAs. Block (x, m, z): chunk x of query block m of slice z.
constexpr int kListChunkWords = 64;

// CTA (x, m, z) of a chunked pass: its slice, block (z, m), first row, first
// word (chunk x) and rows in the block.
struct ListChunk {
  TopkSlice s;
  std::int64_t block, row0, word0;
  int rows;
};
template <int kBlockM>
__device__ ListChunk list_chunk(const KeyListParams& p) {
  const TopkSlice s = topk_slice(p, blockIdx.z);
  const std::int64_t row0 = std::int64_t{blockIdx.y} * kBlockM;
  return {s, std::int64_t{blockIdx.z} * p.mask_blocks + blockIdx.y, row0, std::int64_t{blockIdx.x} * kListChunkWords,
          static_cast<int>(max(std::int64_t{0}, min(std::int64_t{kBlockM}, s.sq - row0)))};
}

// Pre-pass 1. Marks in key_any (any_sr words a block) the keys of the chunk
// that some row of the block keeps, and their count in chunk_counts (`chunks`
// a block). Row by row, a thread tests kItems keys, their loads issued at
// once, then one warp ballot per word; rows whose key range misses the chunk
// are skipped.
template <int kBlockM, int kThreads>
__global__ void __launch_bounds__(kThreads) mark_topk(const KeyListParams p, std::int64_t any_sr, int chunks,
                                                      std::uint32_t* key_any, std::int32_t* chunk_counts) {
  constexpr int kWarps = kThreads / 32, kItems = 32 * kListChunkWords / kThreads;
  if (skip_lists(p)) return;
  const auto [s, block, row0, word0, rows] = list_chunk<kBlockM>(p);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ std::uint32_t any[kListChunkWords];
  __shared__ int count;
  for (int w = threadIdx.x; w < kListChunkWords; w += kThreads) any[w] = 0;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  for (int r = 0; r < rows; ++r) {
    const std::int64_t i = row0 + r;
    const KeySpan keys = keys_of_query(p.band, s.sk - s.sq, s.sk, i);
    if (32 * word0 > keys.hi || 32 * (word0 + kListChunkWords) <= keys.lo) continue;  // the whole CTA
    bool keep[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {  // key j is bit `lane` of the chunk's word k * kWarps + warp
      const std::int64_t j = 32 * word0 + k * kThreads + threadIdx.x;
      keep[k] = j >= keys.lo && j <= keys.hi && threshold_keeps(p, s, i, j);
    }
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const std::uint32_t word = __ballot_sync(0xffffffff, keep[k]);
      if (lane == 0 && word != 0) atomicOr(&any[k * kWarps + warp], word);
    }
  }
  __syncthreads();
  for (int w = threadIdx.x; w < kListChunkWords; w += kThreads)
    if (word0 + w < any_sr) {
      key_any[block * any_sr + word0 + w] = any[w];
      atomicAdd(&count, __popc(any[w]));
    }
  __syncthreads();
  if (threadIdx.x == 0) chunk_counts[block * chunks + blockIdx.x] = count;
}

// Pre-pass 2. Lists the chunk's marked keys at their place in the block's list
// (after the keys of the earlier chunks), the block's count from chunk 0, and
// ORs each row's bits for them into mask_bits (zeroed before: a word of the
// list can hold keys of two chunks).
template <int kBlockM, int kThreads>
__global__ void __launch_bounds__(kThreads) list_topk_chunk(const KeyListParams p, std::int64_t any_sr, int chunks,
                                                            const std::uint32_t* key_any,
                                                            const std::int32_t* chunk_counts) {
  constexpr int kWarps = kThreads / 32;
  if (skip_lists(p)) return;
  const auto [s, block, row0, word0, rows] = list_chunk<kBlockM>(p);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ int before, total, warp_keys[kWarps];
  __shared__ std::int32_t keys[32 * kListChunkWords];
  static_assert(kListChunkWords <= kThreads, "one word a thread");
  const std::uint32_t word =
      threadIdx.x < kListChunkWords && word0 + threadIdx.x < any_sr ? key_any[block * any_sr + word0 + threadIdx.x] : 0u;
  if (threadIdx.x == 0) before = 0, total = 0;
  __syncthreads();
  int mine_before = 0, mine_total = 0;
  for (int c = threadIdx.x; c < chunks; c += kThreads) {
    const int n = chunk_counts[block * chunks + c];
    mine_total += n;
    if (c < static_cast<int>(blockIdx.x)) mine_before += n;
  }
  if (mine_total != 0) atomicAdd(&total, mine_total);
  if (mine_before != 0) atomicAdd(&before, mine_before);
  // The chunk's keys in shared memory, ascending: one word a thread, a block-wide prefix of their popcounts.
  int at = warp_inclusive_sum(__popc(word), lane);
  if (lane == 31) warp_keys[warp] = at;
  __syncthreads();
  int listed = 0;
  for (int v = 0; v < kWarps; ++v) {
    if (v < warp) at += warp_keys[v];
    listed += warp_keys[v];
  }
  at -= __popc(word);
  for (std::uint32_t left = word; left != 0; left &= left - 1, ++at)
    keys[at] = static_cast<std::int32_t>(32 * (word0 + threadIdx.x) + __ffs(left) - 1);
  if (blockIdx.x == 0 && threadIdx.x == 0) p.mask_counts[block] = static_cast<int>(min(std::int64_t{total}, p.keys_stride));
  __syncthreads();
  std::int32_t* const list = p.mask_keys + block * p.keys_stride;
  for (int t = threadIdx.x; t < listed; t += kThreads)
    if (before + t < p.keys_stride) list[before + t] = keys[t];
  // Row r's bit for slot before + t: 32 slots a ballot, ORed into the (at most two) list words they meet.
  std::uint32_t* const bits0 = p.mask_bits + (std::int64_t{blockIdx.z} * p.seqlen_q + row0) * p.bits_sr;
  for (int r = warp; r < rows; r += kWarps) {
    const std::int64_t i = row0 + r;
    const KeySpan row_keys = keys_of_query(p.band, s.sk - s.sq, s.sk, i);
    for (int t0 = 0; t0 < listed; t0 += 32) {
      const int t = t0 + lane;
      const std::int64_t slot = before + t;
      const bool ok = t < listed && slot < p.keys_stride && keys[t] >= row_keys.lo && keys[t] <= row_keys.hi &&
                      threshold_keeps(p, s, i, keys[t]);
      const std::uint32_t bits = __ballot_sync(0xffffffff, ok);
      if (lane == 0 && bits != 0) {
        const std::int64_t first = before + t0;
        const int shift = static_cast<int>(first % 32);
        atomicOr(&bits0[r * p.bits_sr + first / 32], bits << shift);
        if (shift != 0 && (bits >> (32 - shift)) != 0) atomicOr(&bits0[r * p.bits_sr + first / 32 + 1], bits >> (32 - shift));
      }
    }
  }
}

// The row bits of a block's interval list (`listed` keys at `keys`, rows [row0,
// row0 + rows), bits from bits0): row r keeps slot t when start <= row0 + r <
// end of the slot's key. A slot's rows in the block are one run, so the word
// of slots [32 w, 32 w + 32) changes from one row to the next only where a run
// starts or ends: per chunk of kIntervalWords words, row 0's words (a ballot a
// word) and, at every row where a run starts or ends inside the block, its
// slot's bit (shared atomic XOR) go into a rows x words table; an XOR prefix
// down each word's column makes the rows' words, stored a row per warp store.
// O(listed + rows x words / 32) work a block instead of rows x words ballots.
constexpr int kIntervalWords = 32;

template <int kBlockM, int kThreads>
__device__ void write_interval_bits(const KeyListParams& p, const KeyRows* intervals, std::int64_t sq,
                                    const std::int32_t* keys, int listed, std::int64_t row0, int rows,
                                    std::uint32_t* bits0) {
  constexpr int kWarps = kThreads / 32, kWordsPerWarp = kIntervalWords / kWarps, kPartRows = kBlockM / kWarps;
  static_assert(kIntervalWords == 32 && kIntervalWords % kWarps == 0 && kBlockM % kWarps == 0, "one word a lane");
  __shared__ alignas(16) std::uint32_t toggles[kBlockM][kIntervalWords];
  __shared__ std::uint32_t part_xor[kWarps][kIntervalWords];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int words = (listed + 63) / 64 * 2;
  for (int w0 = 0; w0 < words; w0 += kIntervalWords) {
    for (int e = threadIdx.x; e < kBlockM * kIntervalWords / 4; e += kThreads)
      reinterpret_cast<uint4*>(&toggles[0][0])[e] = make_uint4(0, 0, 0, 0);
    __syncthreads();
    int key[kWordsPerWarp];  // warp `warp` takes words w0 + warp + kWarps i, lane = the slot's bit
#pragma unroll
    for (int i = 0; i < kWordsPerWarp; ++i) {
      const int t = 32 * (w0 + warp + kWarps * i) + lane;
      key[i] = t < listed ? keys[t] : -1;
    }
    KeyRows run[kWordsPerWarp];
#pragma unroll
    for (int i = 0; i < kWordsPerWarp; ++i) run[i] = key[i] >= 0 ? sequence_rows(intervals[key[i]], sq) : KeyRows{0, 0};
#pragma unroll
    for (int i = 0; i < kWordsPerWarp; ++i) {
      const int w = warp + kWarps * i;
      const int a = static_cast<int>(max(std::int64_t{0}, min(std::int64_t{rows}, run[i].start - row0)));
      const int b = static_cast<int>(max(std::int64_t{0}, min(std::int64_t{rows}, run[i].end - row0)));
      const std::uint32_t first = __ballot_sync(0xffffffff, a == 0 && a < b);  // slots row 0 keeps
      if (lane == 0) toggles[0][w] = first;  // only runs from row 0 toggle row 0
      if (a < b && a > 0) atomicXor(&toggles[a][w], 1u << lane);
      if (a < b && b < rows) atomicXor(&toggles[b][w], 1u << lane);
    }
    __syncthreads();
    // Thread (part, c): rows [part * kPartRows, + kPartRows) of word column c.
    const int c = lane, part = warp;
    std::uint32_t x = 0;
    for (int r = part * kPartRows; r < (part + 1) * kPartRows; ++r) x ^= toggles[r][c], toggles[r][c] = x;
    part_xor[part][c] = x;
    __syncthreads();
    std::uint32_t before = 0;
    for (int q = 0; q < part; ++q) before ^= part_xor[q][c];
    if (w0 + c < words)
      for (int r = part * kPartRows; r < min((part + 1) * kPartRows, rows); ++r)
        bits0[r * p.bits_sr + w0 + c] = toggles[r][c] ^ before;
    __syncthreads();
  }
}

// The words of a scan over intervals: bit t % 32 of word t / 32 (t < n) is set
// when key j (keys[t], or t where keys is null) lies below key_end and its
// rows, as sequence_rows takes them, meet [row0, row1) (0 <= row0 < row1 <=
// sq): start < end, start < row1 and end > row0. keys[t] for t < n is a key of
// the slice; without keys, n is key_end. A warp's lanes take 32 consecutive t at once, kBatch of them a
// lane before any ballot; every load is in bounds and unconditional (t clamped
// below n only in the warp that reaches n), so that they go out together.
// Called by every thread with its own word.
struct IntervalHits {
  const KeyRows* intervals;
  const std::int32_t* keys;
  int n, key_end, row0, row1;

  __device__ std::uint32_t operator()(std::int64_t w) const {
    constexpr int kBatch = 8;
    const int lane = threadIdx.x % 32;
    if (32 * (w - lane) >= n) return 0;  // the whole warp
    const int first = static_cast<int>(32 * (w - lane)) + lane;
    const bool whole = n - (first - lane) >= 32 * 32;
    const KeyRows* const lane_rows = intervals + first;  // t = first + 32 c without keys
    std::uint32_t mine = 0;
    for (int c0 = 0; c0 < 32; c0 += kBatch) {
      KeyRows rows[kBatch];
      bool listed[kBatch];
      if (keys == nullptr && whole) {
#pragma unroll
        for (int c = 0; c < kBatch; ++c) rows[c] = lane_rows[32 * (c0 + c)], listed[c] = true;
      } else {
#pragma unroll
        for (int c = 0; c < kBatch; ++c) {
          const int t = first + 32 * (c0 + c), u = min(t, n - 1);
          const int key = keys != nullptr ? keys[u] : u;
          listed[c] = t < n && key < key_end;
          rows[c] = intervals[key];
        }
      }
#pragma unroll
      for (int c = 0; c < kBatch; ++c) {
        const KeyRows r = rows[c];
        const bool hit = listed[c] && r.start < r.end && r.start < row1 && r.end > row0;
        const std::uint32_t word = __ballot_sync(0xffffffff, hit);
        if (lane == c0 + c) mine = word;
      }
    }
    return mine;
  }
};
__device__ inline IntervalHits interval_hits(const KeyRows* intervals, const std::int32_t* keys, std::int64_t n,
                                             std::int64_t key_end, std::int64_t row0, std::int64_t row1) {
  return {intervals, keys, static_cast<int>(n), static_cast<int>(key_end), static_cast<int>(row0),
          static_cast<int>(row1)};
}

// Keys a CTA of list_topk_keys keeps as its blocks' candidates.
constexpr int kListCandidates = 4096;

// Top-k pre-pass of intervals. CTA (x, z) lists, for each of its `per_cta`
// query blocks m of slice z (the last CTAs' blocks first: their rows see the
// most keys), the keys some row of the block keeps, and writes its rows' bits
// over the list: key j is listed when [start_j, end_j) meets the block's rows,
// and row i keeps it when start_j <= i < end_j (causal, the right window, a
// key-only mask and the key range are folded into the interval;
// write_interval_bits). Keys [0, key_end) hold every key a row of the block
// may see. With per_cta > 1 the CTA first gathers in shared memory the keys
// whose rows meet any of its blocks' (the candidates: at most topk_list_bound
// of per_cta blocks for a selection), and each block tests those instead of
// every key below its key_end: one scan of the keys for per_cta blocks. Where
// given intervals hold more candidates than kListCandidates, each block scans
// every key as with per_cta = 1; the lists are the same either way.
template <int kBlockM, int kThreads>
__global__ void __launch_bounds__(kThreads, 8) list_topk_keys(const KeyListParams p, int per_cta) {
  if (skip_lists(p)) return;
  const TopkSlice s = topk_slice(p, blockIdx.y);
  const KeyRows* intervals = p.topk_intervals + s.sel;
  const auto key_end_of = [&](std::int64_t row0, std::int64_t rows) -> std::int64_t {
    return rows > 0 ? keys_of_query(p.band, s.sk - s.sq, s.sk, row0 + rows - 1).hi + 1 : 0;
  };
  const auto rows_from = [&](std::int64_t row0, std::int64_t count) {
    return max(std::int64_t{0}, min(count, s.sq - row0));
  };
  const std::int64_t first_block = std::int64_t{gridDim.x - 1 - blockIdx.x} * per_cta;
  const int blocks = static_cast<int>(min(std::int64_t{per_cta}, p.mask_blocks - first_block));
  extern __shared__ std::int32_t candidates[];  // kListCandidates where per_cta > 1
  std::int64_t held = -1;  // candidates held; -1: none
  if (per_cta > 1) {
    const std::int64_t row0 = first_block * kBlockM, rows = rows_from(row0, std::int64_t{blocks} * kBlockM);
    const std::int64_t key_end = key_end_of(row0, rows);
    const std::int64_t found = compact_bits<kThreads>(
        (key_end + 31) / 32, interval_hits(intervals, nullptr, key_end, key_end, row0, row0 + rows),
        [&](std::int64_t at, std::int64_t t) {
          if (at < kListCandidates) candidates[at] = static_cast<std::int32_t>(t);
        });
    if (found <= kListCandidates) held = found;
    __syncthreads();
  }
  for (int k = 0; k < blocks; ++k) {
    const std::int64_t m = first_block + k, block = std::int64_t{blockIdx.y} * p.mask_blocks + m;
    const std::int64_t row0 = m * kBlockM;
    const int rows = static_cast<int>(rows_from(row0, kBlockM));
    const std::int64_t key_end = key_end_of(row0, rows);
    const int listed =
        held >= 0 ? list_keys<kThreads>(p, block, key_end > 0 ? (held + 31) / 32 : 0,
                                        interval_hits(intervals, candidates, held, key_end, row0, row0 + rows),
                                        [&](std::int64_t t) { return candidates[t]; })
                  : list_keys<kThreads>(p, block, (key_end + 31) / 32,
                                        interval_hits(intervals, nullptr, key_end, key_end, row0, row0 + rows),
                                        [](std::int64_t t) { return static_cast<std::int32_t>(t); });
    write_interval_bits<kBlockM, kThreads>(p, intervals, s.sq, p.mask_keys + block * p.keys_stride, listed, row0,
                                           rows, p.mask_bits + (std::int64_t{blockIdx.y} * p.seqlen_q + row0) * p.bits_sr);
  }
}

// The keys a query block of block_m rows can list under top-k (w =
// keep_window_size), a bound the host knows without reading the selection:
// - every row keeps at most w keys: at most min(block_m, Sq) * w, and at most Sk;
// - intervals: a listed key j has start_j < i1 and end_j > i0 (rows [i0, i1)).
//   Those with start_j <= i0 are kept by row i0: at most w. The others start
//   in (i0, i1), and start_j is the first row that sees j (j - (sk - sq), less
//   the right window), one key a row under causal or a right window (at most
//   block_m - 1 of them) and row 0 for every key without either (none);
// - a left window with causal or a right window: the rows see keys [i0 + offset
//   - left, i1 - 1 + offset + right'] (right' = 0 under causal), left + right' +
//   block_m of them.
inline std::int64_t topk_list_bound(const KeyListParams& p, int block_m) {
  const std::int64_t w = p.keep_window_size;
  const Band& band = p.band;
  const bool right_limit = band.causal || band.right >= 0;
  std::int64_t bound = std::min(p.seqlen_k, std::min<std::int64_t>(block_m, p.seqlen_q) * w);
  if (p.topk_intervals != nullptr) bound = std::min(bound, w + (right_limit ? block_m - 1 : 0));
  if (band.left >= 0 && right_limit) bound = std::min(bound, band.left + (band.causal ? 0 : band.right) + block_m);
  return bound;
}

// The query blocks a CTA of list_topk_keys lists, for `lists` blocks in all:
// kListCtaBlocks where a block's scan of the keys outweighs the rest of its
// work (Sk >= 48 x keys_stride: S = 131072 at w = 2048), the grid keeps at
// least kListCtas CTAs and a selection's candidates of those blocks fit
// kListCandidates; else 1. H100, w = 2048 (list pass us at 1 / 2 / 4 / 8
// blocks a CTA): S = 131072 760 / 708 / 644 / 675; S = 65536 246 / 288 / 299 /
// 294; S = 16384, w = 1024 34 / 44 / 59 / 95: below that length the longer
// CTAs cost more than the scans they save.
constexpr int kListCtaBlocks = 4;
constexpr std::int64_t kListCtas = 2048;
inline int list_cta_blocks(const KeyListParams& p, int block_m, std::int64_t lists) {
  if (p.list_cta_blocks > 0) return p.list_cta_blocks;
  const bool scans_dominate = p.seqlen_k >= 48 * p.keys_stride;
  return scans_dominate && lists / kListCtaBlocks >= kListCtas &&
                 topk_list_bound(p, kListCtaBlocks * block_m) <= kListCandidates
             ? kListCtaBlocks
             : 1;
}

// The key lists of build_key_lists for one dtype and block height: per
// list slice the bits of every query row, and per query block the key list,
// its count and the words of the keys any row of it may see (a mask, and top-k
// thresholds). A mask alone keeps a slice per mask head (one for a mask
// broadcast over batches) and full-width lists (bits are key-indexed before the
// in-place rewrite); top-k keeps a slice per selection head and lists of at
// most topk_list_bound keys: no (Sq, Sk) array for a key-only bias.
template <int kBlockM>
void build_lists(KeyListParams& params, int batch, int heads, cudaStream_t stream) {
  constexpr int kThreads = kListThreads;
  const bool topk = params.topk_intervals != nullptr || params.topk_thresholds != nullptr;
  const std::int64_t blocks = (params.seqlen_q + kBlockM - 1) / kBlockM;
  const std::int64_t tiles = (params.seqlen_k + 63) / 64;
  const int mask_heads = heads / params.mask_group;
  std::int64_t slices = 0, any_sr = 0;
  if (topk) {
    const bool folded = params.topk_fold > 1;
    slices = std::int64_t{batch} * (folded ? heads : params.topk_heads);
    params.list_group = folded ? 1 : params.topk_group, params.list_batched = true;
    params.keys_stride = 64 * ((topk_list_bound(params, kBlockM) + 63) / 64);
    params.bits_sr = params.keys_stride / 32;
    any_sr = params.topk_thresholds != nullptr ? 2 * tiles : 0;
  } else {
    params.list_group = params.mask_group, params.list_batched = params.mask.sb != 0;
    slices = std::int64_t{params.list_batched ? batch : 1} * mask_heads;
    params.keys_stride = 64 * tiles;
    params.bits_sr = any_sr = 2 * tiles;
  }
  params.mask_blocks = static_cast<int>(blocks);
  const int chunks = static_cast<int>((any_sr + kListChunkWords - 1) / kListChunkWords);
  const std::int64_t bits_words = slices * params.seqlen_q * params.bits_sr;
  const std::int64_t any_words = slices * blocks * any_sr;
  const std::int64_t key_words = slices * blocks * params.keys_stride;
  const std::int64_t chunk_words = params.topk_thresholds != nullptr ? slices * blocks * chunks : 0;
  const std::int64_t words = bits_words + any_words + key_words + slices * blocks + chunk_words;
  check_cuda(cudaMallocAsync(reinterpret_cast<void**>(&params.mask_bits), static_cast<std::size_t>(words) * 4, stream),
             "cudaMallocAsync (key-list pre-pass)");
  std::uint32_t* const key_any = params.mask_bits + bits_words;
  params.mask_keys = reinterpret_cast<std::int32_t*>(key_any + any_words);
  params.mask_counts = params.mask_keys + key_words;
  if (!topk) {
    const dim3 marks(static_cast<unsigned>(tiles), static_cast<unsigned>(blocks), static_cast<unsigned>(slices));
    const dim3 lists(static_cast<unsigned>(blocks), static_cast<unsigned>(slices));
    pack_mask<kBlockM, kThreads><<<marks, kThreads, 0, stream>>>(params, mask_heads, key_any);
    gather_mask_keys<kBlockM, kThreads><<<lists, kThreads, 0, stream>>>(params, key_any);
    return;
  }
  if (params.topk_intervals != nullptr) {
    const int per_cta = list_cta_blocks(params, kBlockM, blocks * slices);
    const dim3 lists(static_cast<unsigned>((blocks + per_cta - 1) / per_cta), static_cast<unsigned>(slices));
    const std::size_t candidates = per_cta > 1 ? kListCandidates * sizeof(std::int32_t) : 0;
    list_topk_keys<kBlockM, kThreads><<<lists, kThreads, candidates, stream>>>(params, per_cta);
    return;
  }
  std::int32_t* const chunk_counts = params.mask_counts + slices * blocks;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(blocks), static_cast<unsigned>(slices));
  check_cuda(cudaMemsetAsync(params.mask_bits, 0, static_cast<std::size_t>(bits_words) * 4, stream),
             "cudaMemsetAsync (key-list bits)");
  mark_topk<kBlockM, kThreads><<<grid, kThreads, 0, stream>>>(params, any_sr, chunks, key_any, chunk_counts);
  list_topk_chunk<kBlockM, kThreads><<<grid, kThreads, 0, stream>>>(params, any_sr, chunks, key_any, chunk_counts);
}

}  // namespace

void build_key_lists(KeyListParams& params, int block_m, int batch, int heads, cudaStream_t stream) {
  if (block_m == 64)
    build_lists<64>(params, batch, heads, stream);
  else
    build_lists<128>(params, batch, heads, stream);
}

}  // namespace dmattn::cuda
