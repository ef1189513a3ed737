// Top-k by per-row thresholds: the w-th strongest allowed (bias, key) pair of
// each row, one CTA a row, or for few long rows (decode) one CTA a chunk of a
// row and one kernel a digit (selection.h).
#include <algorithm>
#include <climits>
#include <cub/block/block_scan.cuh>

#include "select.cuh"

namespace dmattn::cuda::topk {
namespace {

// ---- thresholds ------------------------------------------------------------
// Row `row` = (b, s, i) of the selection: the keys [lo, hi) that causal and the
// windows leave it, and where its bias and mask rows start (global key 0).
struct RowSpan {
  std::int64_t lo = 0, hi = 0, bias = 0, mask = 0;
};

__device__ RowSpan row_span(const Params& p, std::int64_t row) {
  const std::int64_t g = row / p.seqlen_q, i = row % p.seqlen_q;
  const std::int64_t b = g / p.heads, h = (g % p.heads) * p.group;
  const Sequence s(p, b);
  RowSpan r;
  if (i >= s.sq) return r;
  const KeyRange keys = keys_of_queries(p.band, s.offset(), s.sk, i, i);
  r.lo = min(keys.first, s.sk);
  r.hi = max(keys.end, r.lo);
  r.bias = element_at(p.bias, b, h / p.bias_group, s.qs + i, s.ks);
  r.mask = element_at(p.mask, b, h / p.mask_group, s.qs + i, s.ks);
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
        const float value = load_as_float(p.bias.data, p.bias.dtype, r.bias + j * p.bias.sc);
        const std::uint64_t key = std::uint64_t{order_bits(value)} << kbits | static_cast<std::uint64_t>(j);
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
    const float value = load_as_float(p.bias.data, p.bias.dtype, target.span.bias + j * p.bias.sc);
    out[row] = {value, static_cast<std::int32_t>(j)};
  }
  if (threadIdx.x == 0) state.ticket = 0;
}

// Rows of more than one chunk take the chunked search when there are at most
// kSearchRows of them (its scratch: a 256-bin histogram a row); more rows take
// one CTA each (row_thresholds), which fill the GPU anyway.
constexpr std::int64_t kSearchRows = 4096;

}  // namespace

void select_thresholds(const Params& p, std::int64_t rows, RowThreshold* out, cudaStream_t stream) {
  const std::int64_t chunks = (p.seqlen_k + kSearchChunk - 1) / kSearchChunk;
  if (chunks < 2 || rows > kSearchRows) {
    row_thresholds<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(p, std::max(ceil_log2(p.seqlen_k), 1), out);
    check_cuda(cudaGetLastError(), "row_thresholds");
    return;
  }
  Search sc;
  sc.stride = std::max<std::int64_t>(256, chunks);
  const std::size_t state_bytes = static_cast<std::size_t>(rows) * sizeof(RowSearch);
  const std::size_t bytes = state_bytes + static_cast<std::size_t>(rows * sc.stride) * 4;
  char* scratch = nullptr;
  check_cuda(cudaMallocAsync(reinterpret_cast<void**>(&scratch), bytes, stream), "cudaMallocAsync");
  check_cuda(cudaMemsetAsync(scratch, 0, bytes, stream), "cudaMemsetAsync");
  sc.rows = reinterpret_cast<RowSearch*>(scratch);
  sc.counts = reinterpret_cast<std::uint32_t*>(scratch + state_bytes);
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(rows));
  const int width = order_width(p.bias.dtype);
  for (int shift = width - 8; shift >= 0; shift -= 8)
    search_digit<<<grid, kThreads, 0, stream>>>(p, sc, shift, shift == width - 8, out);
  search_ties<<<grid, kThreads, 0, stream>>>(p, sc, out);
  check_cuda(cudaGetLastError(), "threshold search");
  check_cuda(cudaFreeAsync(scratch, stream), "cudaFreeAsync");
}

}  // namespace dmattn::cuda::topk
