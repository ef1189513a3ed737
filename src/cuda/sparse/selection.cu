// Top-k selection of SPEC 3 on the GPU (see selection.h). Semantics follow
// src/cpu/selection.cpp exactly: a key j of row i is selected iff it is allowed
// and fewer than w allowed keys of the row beat it, where k beats j iff
// (bias_k, k) > (bias_j, j) (larger bias, ties to the larger key index).
#include "selection.h"

#include "../dispatch.h"
#include "select.cuh"

namespace dmattn::cuda {

namespace {

// The layout of p's selection by `mode`: its heads and entries, no arrays.
DeviceSelection selection_layout(const Problem& p, DeviceSelection::Mode mode) {
  DeviceSelection sel;
  sel.mode = mode;
  sel.heads = p.topk_heads();
  sel.group = p.heads / sel.heads;
  sel.per_head = sel.mode == DeviceSelection::kIntervals ? p.seqlen_k : p.seqlen_q;
  return sel;
}

topk::Params params_of(const Problem& p, const DeviceSelection& sel) {
  topk::Params params;
  params.bias = p.bias, params.mask = p.mask;
  params.heads = sel.heads, params.group = sel.group;
  params.bias_group = p.heads / p.bias_shape.heads;
  params.mask_group = p.heads / p.mask_shape.heads;
  params.seqlen_q = p.seqlen_q, params.seqlen_k = p.seqlen_k;
  params.cu_seqlens_q = p.cu_seqlens_q, params.cu_seqlens_k = p.cu_seqlens_k;
  params.band = Band{p.causal, p.window_left, p.window_right};
  params.w = p.keep_window_size;
  return params;
}

}  // namespace

DeviceSelection select_topk(const Problem& p, DeviceSelection::Mode mode, cudaStream_t stream) {
  DeviceSelection sel = selection_layout(p, mode);
  const topk::Params params = params_of(p, sel);
  const std::int64_t entries = p.batch * sel.heads * sel.per_head;
  if (entries == 0) return sel;
  if (sel.mode == DeviceSelection::kIntervals) {
    check_cuda(cudaMallocAsync(reinterpret_cast<void**>(&sel.intervals), entries * sizeof(KeyRows), stream),
               "cudaMallocAsync");
    topk::select_intervals(params, p.batch, device_info(p.device.index).sms, sel.intervals, stream);
  } else {
    check_cuda(cudaMallocAsync(reinterpret_cast<void**>(&sel.thresholds), entries * sizeof(RowThreshold), stream),
               "cudaMallocAsync");
    topk::select_thresholds(params, entries, sel.thresholds, stream);
  }
  return sel;
}

DeviceSelection given_selection(const Problem& p) {
  DeviceSelection sel = selection_layout(p, DeviceSelection::kIntervals);
  sel.given = true;
  sel.intervals = reinterpret_cast<KeyRows*>(p.topk_intervals);
  return sel;
}

void write_intervals(const Problem& p, cudaStream_t stream) {
  const DeviceSelection sel = selection_layout(p, DeviceSelection::kIntervals);
  if (p.batch * sel.heads * p.seqlen_k == 0) return;
  topk::select_intervals(params_of(p, sel), p.batch, device_info(p.device.index).sms,
                         reinterpret_cast<KeyRows*>(p.topk_intervals), stream);
}

void free_selection(DeviceSelection& sel, cudaStream_t stream) {
  if (sel.intervals != nullptr && !sel.given) check_cuda(cudaFreeAsync(sel.intervals, stream), "cudaFreeAsync");
  if (sel.thresholds != nullptr) check_cuda(cudaFreeAsync(sel.thresholds, stream), "cudaFreeAsync");
  sel.intervals = nullptr;
  sel.thresholds = nullptr;
}

}  // namespace dmattn::cuda
