// CUDA backend: plans a validated Problem (dispatch.h: the kernels of every
// step, or a refusal, before anything is enqueued), enqueues its top-k
// selection (unless given), then runs the planned instantiation's launcher; the
// top-k intervals alone (select_topk); and the device guard, scratch pool, side
// stream and zero fill around them.
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "../backend.h"
#include "bwd/finish.h"
#include "common/check.h"
#include "dispatch.h"
#include "sparse/selection.h"

namespace dmattn {
namespace {

using cuda::check_cuda;

// Makes `device` current for the duration of a call, restoring the caller's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    changed_ = previous_ != device;
    if (changed_) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// A call's scratch (the backward's float32 dq sums and row statistics, the
// top-k selection, key lists and groups) is stream-ordered: cudaMallocAsync
// from the device's default memory pool, freed by cudaFreeAsync once enqueued.
// CUDA returns such a pool's free memory to the device at every
// synchronization unless told to keep it, so a call after a synchronization
// (a training step's loss.item(), a decode step's sampling) mapped its scratch
// anew: on an H100 host a fwd+bwd right after a synchronization was enqueued
// in 1.93 ms at S = 2048 with top-k, 0.95 with the pool keeping it (dense 1.30
// and 0.64; top-k at S = 16384 2.59 and 1.71). So the pool keeps up to
// kScratchCached bytes across synchronizations, set once a device; a
// threshold already higher (the application's or another library's) is left
// as it is, and free scratch beyond it is still returned. Best effort: a
// device whose pool cannot be queried keeps CUDA's behaviour (its error
// cleared, so that no later check reports it).
constexpr std::uint64_t kScratchCached = std::uint64_t{1} << 30;
void keep_scratch_cached(int device) {
  static std::mutex mutex;
  static std::vector<bool> done;
  const std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<std::size_t>(device) < done.size() && done[device]) return;
  if (done.size() <= static_cast<std::size_t>(device)) done.resize(device + 1, false);
  done[device] = true;
  cudaMemPool_t pool = nullptr;
  std::uint64_t threshold = 0;
  if (cudaDeviceGetDefaultMemPool(&pool, device) != cudaSuccess ||
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  if (threshold >= kScratchCached) return;
  threshold = kScratchCached;
  if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold) != cudaSuccess) cudaGetLastError();
}

// A second stream for work that needs none of the caller's stream's recent
// work but what it had enqueued when fork() ran: forked and joined by events,
// so a CUDA graph capture of the caller's stream takes it in. One stream per
// host thread and device (a capture on one thread never takes in another
// thread's work), at the highest priority, so that its kernels take SMs as
// soon as they free, with its two events (a wait takes an event's last record
// when it is enqueued, so they serve every call: two CUDA calls fewer each way
// than events of their own). Unused until fork().
class SideStream {
 public:
  // Work enqueued on the returned stream from now on runs after main's work so far.
  cudaStream_t fork(cudaStream_t main) {
    thread_local ThreadStreams streams;
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    std::vector<Side>& by_device = streams.by_device;
    if (by_device.size() <= static_cast<std::size_t>(device)) by_device.resize(device + 1);
    Side& side = by_device[device];
    if (side.stream == nullptr) {
      int least = 0, greatest = 0;
      check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
      check_cuda(cudaEventCreateWithFlags(&side.forked, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      check_cuda(cudaEventCreateWithFlags(&side.joined, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      check_cuda(cudaStreamCreateWithPriority(&side.stream, cudaStreamNonBlocking, greatest),
                 "cudaStreamCreateWithPriority");
    }
    side_ = &side;
    check_cuda(cudaEventRecord(side.forked, main), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(side.stream, side.forked, 0), "cudaStreamWaitEvent");
    return side.stream;
  }
  // An event that completes with the work enqueued on the side stream so far.
  cudaEvent_t done() {
    check_cuda(cudaEventRecord(side_->joined, side_->stream), "cudaEventRecord");
    return side_->joined;
  }
  // main waits for everything enqueued on the side stream (no-op before fork).
  void join(cudaStream_t main) {
    if (side_ != nullptr) check_cuda(cudaStreamWaitEvent(main, done(), 0), "cudaStreamWaitEvent");
  }

 private:
  struct Side {
    cudaStream_t stream = nullptr;
    cudaEvent_t forked = nullptr, joined = nullptr;
  };
  // A host thread's side streams and their events, destroyed when the thread ends.
  struct ThreadStreams {
    std::vector<Side> by_device;
    ~ThreadStreams() {
      for (const Side& side : by_device) {
        if (side.stream != nullptr) cudaStreamDestroy(side.stream);
        if (side.forked != nullptr) cudaEventDestroy(side.forked);
        if (side.joined != nullptr) cudaEventDestroy(side.joined);
      }
    }
  };
  Side* side_ = nullptr;
};

// Runs launch(), then release() (the stream-ordered frees of its scratch), also
// when launch throws: that error is the one reported.
template <class Launch, class Release>
void launch_then_release(Launch&& launch, Release&& release) {
  try {
    launch();
  } catch (...) {
    try {
      release();
    } catch (...) {
    }
    throw;
  }
  release();
}

// The top-k selection of p as the plan has it (the caller's intervals, or
// selected by the plan's mode on `stream`), handed to the kernels in params.
template <class Plan>
cuda::DeviceSelection select(const Problem& p, const Plan& plan, cudaStream_t stream, cuda::AttentionParams& params) {
  cuda::DeviceSelection sel =
      plan.selection_given ? cuda::given_selection(p) : cuda::select_topk(p, plan.selection, stream);
  params.topk_intervals = sel.intervals, params.topk_thresholds = sel.thresholds;
  params.topk_heads = static_cast<int>(sel.heads), params.topk_group = static_cast<int>(sel.group);
  params.keep_window_size = p.keep_window_size;
  return sel;
}

// Top-k: the selection is computed first, on the stream (no host sync), unless
// the caller gave it; the forward's key-list passes list the selected keys from
// it, and it is freed (stream-ordered) once they are enqueued (a given one is the
// caller's).
void run_forward(const Problem& p) {
  const DeviceGuard guard(p.device.index);
  keep_scratch_cached(p.device.index);
  cuda::ForwardPlan plan = cuda::plan_forward(p, cuda::device_info(p.device.index));
  cuda::report(plan);
  if (plan.empty) return;  // nothing to write
  const auto stream = static_cast<cudaStream_t>(p.stream);
  cuda::DeviceSelection sel;
  launch_then_release(
      [&] {
        if (plan.selection != cuda::DeviceSelection::kNone) sel = select(p, plan, stream, plan.params);
        plan.run(plan, stream);
      },
      [&] { cuda::free_selection(sel, stream); });
}

// Top-k: the selection runs like the forward's and intervals are then grouped
// for the dk/dv walk, both on a side stream forked from the caller's, beside
// row_stats (the launcher waits for them after row_stats: selection_ready);
// then, still on the side stream, beside row_stats, the zeros of dk and dv at
// the keys no group holds (the walk writes the others; 0.35 ms after the walk
// at S = 131072, w = 2048, H100; beside the walk instead, the walk took up to
// 0.5 ms longer at S = 65536). Both are freed on the caller's stream, joined
// first, once the kernels are enqueued.
void run_backward(const Problem& p) {
  const DeviceGuard guard(p.device.index);
  keep_scratch_cached(p.device.index);
  cuda::BackwardPlan plan = cuda::plan_backward(p, cuda::device_info(p.device.index));
  cuda::report(plan);
  if (plan.empty) return;
  cuda::BackwardParams& params = plan.params;
  const auto stream = static_cast<cudaStream_t>(p.stream);
  SideStream side;
  cuda::DeviceSelection sel;
  cuda::KeyGroups groups;
  launch_then_release(
      [&] {
        if (plan.selection != cuda::DeviceSelection::kNone) {
          const cudaStream_t on_side = side.fork(stream);
          sel = select(p, plan, on_side, params);
          if (sel.intervals != nullptr) {
            groups = cuda::group_keys(sel, p.batch, p.heads, p.kv_heads, p.seqlen_q, p.seqlen_k, p.cu_seqlens_q,
                                      p.cu_seqlens_k, p.keep_window_size, plan.sort_groups, plan.split_groups,
                                      on_side);
            params.key_order = groups.order, params.key_rank = groups.rank, params.key_pieces = groups.pieces;
            params.group_first = groups.first, params.group_rows = groups.rows, params.key_groups = groups.groups;
            params.key_segments = groups.segments, params.segment_rows = groups.segment_rows;
            params.segment_entries = groups.entries, params.groups_overflow = groups.overflow;
          }
          params.selection_ready = side.done();
          if (params.key_pieces != nullptr)
            check_cuda(cuda::zero_unselected(params, plan.batch, on_side), "zero_unselected");
        }
        plan.run(plan, stream);
      },
      [&] {
        side.join(stream);
        cuda::free_groups(groups, stream);
        cuda::free_selection(sel, stream);
      });
}

// select_topk: the intervals alone, on the caller's stream.
void run_select(const Problem& p) {
  const DeviceGuard guard(p.device.index);
  keep_scratch_cached(p.device.index);
  cuda::plan_select(p);
  cuda::write_intervals(p, static_cast<cudaStream_t>(p.stream));
}

// Zero bits are +0 in every float dtype: one thread an element, `size` bytes.
struct ZeroView {
  char* data;
  int ndim, size;
  std::int64_t shape[kMaxRank], stride[kMaxRank];
};
__global__ void fill_zeros_kernel(ZeroView t, std::int64_t numel) {
  for (std::int64_t e = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < numel;
       e += std::int64_t{gridDim.x} * blockDim.x) {
    std::int64_t offset = 0, rest = e;
    for (int d = t.ndim - 1; d >= 0; --d) offset += rest % t.shape[d] * t.stride[d], rest /= t.shape[d];
    char* at = t.data + offset * t.size;
    for (int b = 0; b < t.size; ++b) at[b] = 0;
  }
}

void fill_zeros(const TensorView& t, void* stream) {
  const std::int64_t numel = t.numel();
  if (numel == 0) return;
  const DeviceGuard guard(t.device.index);
  ZeroView z{static_cast<char*>(t.data), t.ndim, static_cast<int>(dtype_size(t.dtype)), {}, {}};
  for (int d = 0; d < t.ndim; ++d) z.shape[d] = t.shape[d], z.stride[d] = t.stride[d];
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((numel + 255) / 256, 65536));
  fill_zeros_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(z, numel);
  check_cuda(cudaGetLastError(), "fill_zeros");
}

}  // namespace

const Backend* cuda_backend() {
  static const Backend backend{run_forward, run_backward, run_select, fill_zeros};
  return &backend;
}
}  // namespace dmattn
