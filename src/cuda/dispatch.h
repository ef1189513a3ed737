// The one place that decides what runs for a call: from a validated Problem and
// the device (architecture, opt-in shared memory, the compiled head dims) the
// dispatch builds the kernel parameters and picks the kernel of every step, or
// refuses the call (Error::kUnsupported), before anything is enqueued, the
// top-k selection included. The launchers (fwd/launch.cuh, bwd/launch.cuh)
// follow the plan and decide nothing. The table of what runs where is
// dispatch.cu's plan_forward and plan_backward (docs/architecture.md).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "../problem.h"
#include "params.h"
#include "sparse/selection.h"

namespace dmattn::cuda {

// What the dispatch needs to know of a GPU: its attributes, queried once a
// device, under the emulation settings, read at every call (an invalid value
// is Error::kValue naming the variable):
//   DMATTN_SMEM_LIMIT=<KiB>  caps smem_optin (99: an RTX 3090 / 4090 or L40,
//                            163: an A100), so that a larger GPU runs the
//                            tiles a smaller one would get
//   DMATTN_PORTABLE=1        the sm80-class kernels only (sm90a false)
struct DeviceInfo {
  int arch = 0;        // compute capability, 10 major + minor (90: H100, H200)
  int sms = 0;         // streaming multiprocessors
  int smem_optin = 0;  // bytes of dynamic shared memory a block may opt in to (capped)
  bool smem_capped = false;  // DMATTN_SMEM_LIMIT lowered smem_optin
  // The Hopper kernels can run: an sm_90 device, a build with sm_90a code
  // (DMATTN_CUDA_ARCHS), the driver's TMA descriptor encoder, and no DMATTN_PORTABLE=1.
  bool sm90a = false;
  // DMATTN_LIST_BLOCKS (1, 2, 4 or 8): the query blocks a CTA of the top-k
  // interval lists takes, whatever the shape (a test setting: the lists are the
  // same at every value); 0: unset, picked per call (sparse/key_lists.cu).
  int list_cta_blocks = 0;
};
// The device's DeviceInfo under the emulation settings (the current device must be `device`).
DeviceInfo device_info(int device);

enum class ForwardKernel {
  kSm90,        // Hopper: D' = 64 or 128 (D <= D'), wgmma and TMA, a mask by tile classes (fwd/kernel_sm90.cuh)
  kSm80,        // sm80-class, 128 query rows a CTA (64 above D = 128) (fwd/kernel_sm80.cuh)
  kSm80Decode,  // sm80-class, 64 query rows a CTA, deeper K/V pipeline: few query rows
  kSm80KeySplit,  // sm80-class, 16 query rows a CTA, the warps over the keys: at most 16 query rows
};

struct ForwardPlan;
using ForwardRun = void (*)(const ForwardPlan& plan, cudaStream_t stream);

struct ForwardPlan {
  bool empty = false;  // nothing to write (no batch entry or no query row)
  // The kernel parameters, complete but for the top-k selection's arrays
  // (set by the backend once it is enqueued) and the launcher's scratch.
  ForwardParams params;
  DeviceSelection::Mode selection = DeviceSelection::kNone;  // the top-k selection enqueued first
  bool selection_given = false;  // ... or the caller's intervals (Problem::topk_intervals): nothing to select
  int head_dim = 0;  // the instantiation: the smallest compiled head dim >= D
  ForwardKernel kernel = ForwardKernel::kSm80;
  int block_m = 0;          // query rows a CTA of the kernel
  bool key_lists = false;   // the key-list passes run first (a mask and/or top-k)
  bool mask_tiles = false;  // the Hopper forward's mask pass runs first (its tile classes and bits)
  bool bias_tiles = false;  // the Hopper forward loads a full bias by tiles (ForwardWalk::kRowBias)
  // The Hopper forward's warp-specialized walks: this many CTAs (the GPU's
  // whole load) take the query blocks in turn (heuristics.h
  // forward_sm90_persistent); 0: a CTA a query block.
  int persistent_ctas = 0;
  const char* why_not_sm90 = nullptr;  // why the Hopper forward does not run (nullptr: it does)
  ForwardRun run = nullptr;  // the instantiation's launcher
};

enum class DkvKernel {
  kSm90,        // Hopper dk/dv, dense walk (bwd/kernel_sm90.cuh)
  kSm90Groups,  // Hopper dk/dv over top-k key groups
  kSm90RowBias,  // Hopper dk/dv, dense walk with a bias that has rows (its tiles, dbias a tile at a time)
  kSm80,        // sm80-class dk/dv (bwd/kernel_sm80.cuh), also over key groups or mask tiles
  kSm80Dense,   // sm80-class dk/dv of the dense walk, 64-query steps (bwd/dkv_sm80.cuh)
};
// The sm80-class dk/dv kernels, whose dq sums are rows of (batch, head) (BackwardParams::dq_blocks false).
constexpr bool sm80_dkv(DkvKernel k) { return k == DkvKernel::kSm80 || k == DkvKernel::kSm80Dense; }

struct BackwardPlan;
using BackwardRun = void (*)(const BackwardPlan& plan, cudaStream_t stream);

struct BackwardPlan {
  bool empty = false;  // nothing to run (no batch entry)
  // The kernel parameters (dq by atomics or not, the dbias reduction), complete
  // but for the top-k selection and key groups (set by the backend) and the
  // launcher's scratch.
  BackwardParams params;
  DeviceSelection::Mode selection = DeviceSelection::kNone;
  bool selection_given = false;  // the caller's intervals (Problem::topk_intervals): nothing to select
  int batch = 0;
  int head_dim = 0;  // the instantiation (a wider one where only it has a Hopper dk/dv kernel: plan_backward)
  DkvKernel dkv = DkvKernel::kSm80;
  // The small tile of the sm80-class dq and dk/dv kernels (bwd/config.cuh
  // backward_tile; kSm80Dense: heuristics.h dkv_sm80_dense_tile) where the
  // large one does not fit the device's shared memory.
  bool small_dq = false, small_dkv = false;
  int dbias_slices = 0;      // float32 slices of dbias that reduce_bias_grad sums (0: written directly)
  bool ordered_dq = false;   // dq summed in order (deterministic): the Hopper dk/dv kernel's turn counters
  bool bias_tiles = false;   // the Hopper row-bias walk loads a full bias by tiles (DkvWalk::kBiasTiles)
  bool key_lists = false;    // the dq walk follows key lists (a mask and/or top-k)
  bool mask_tiles = false;   // the dk/dv walk skips empty mask tiles (a mask without top-k intervals;
                             // the Hopper one with the mask's bits)
  bool sort_groups = false;  // top-k intervals: key groups sorted by their rows (sparse/selection.h group_keys)
  bool split_groups = false;  // ... and cut at row segments
  const char* why_not_sm90 = nullptr;  // why the Hopper dk/dv kernel does not run (nullptr: it does)
  BackwardRun run = nullptr;
};

// The plans of a call on `device` (device_info(p.device.index)), or
// Error::kUnsupported naming what this build or device lacks. Nothing but the
// sm80-class forward's occupancy, queried where its grid leaves SMs idle (the
// split-KV count), reads the GPU: the rest of the table is a function of p and
// `device`, which tests/test_dispatch.cpp checks on emulated devices without
// one. The current device must be p.device.
ForwardPlan plan_forward(const Problem& p, const DeviceInfo& device);
BackwardPlan plan_backward(const Problem& p, const DeviceInfo& device);
// A plan in words: the kernel and walk of each step, the top-k selection, and
// why the Hopper kernel does not run where it does not.
std::string describe(const ForwardPlan& plan);
std::string describe(const BackwardPlan& plan);
// With DMATTN_LOG_PLAN=1 (read at every call; 0 or unset: off, anything else
// is Error::kValue naming it), prints each plan's description to stderr the
// first time it occurs in the process.
void report(const ForwardPlan& plan);
void report(const BackwardPlan& plan);
// select_topk (the intervals alone, sparse/selection.h write_intervals): refused
// as every call is below compute capability 8.0; nothing else to choose.
void plan_select(const Problem& p);

// The launchers, one instantiation per compiled (dtype, head dim) and
// direction (generated from fwd/instance.cu.in and bwd/instance.cu.in).
template <class Element, int kHeadDim>
struct ForwardInstance {
  // CTAs of the sm80-class kernel an SM holds (its shared-memory limit raised
  // on the current device), for the split-KV count.
  static int ctas_per_sm(ForwardKernel kernel);
  static void run(const ForwardPlan& plan, cudaStream_t stream);
};
template <class Element, int kHeadDim>
struct BackwardInstance {
  static void run(const BackwardPlan& plan, cudaStream_t stream);
};

}  // namespace dmattn::cuda
