// GPU check of the top-k selection: src/cuda/selection.cu against the CPU
// selection of src/cpu/selection.cpp on the same Problem, entry for entry and
// exactly (intervals: start and end; thresholds: value and key).
//
//   dmattn_gpu_selection_check            the whole matrix
//   dmattn_gpu_selection_check --small    a few small cases (for compute-sanitizer)
//   dmattn_gpu_selection_check --bench    selection time, B=1, H=32, Hk=8, causal, w=1024,
//                                         bf16 bias (1, 8, 1, S) and (1, 8, S, S); decode:
//                                         B=4, Sq=1, bias (4, 8, 1, 131072), w=2048
//
// Problems are built directly (no q, k, v: the selection reads only the bias,
// the mask and the geometry). Bias and mask are tests/tensor.h host tensors in
// random layouts (sliced, or permuted so that the key stride is not 1), copied
// to the device with the same strides. Prints one line per case and
// "N passed, M failed"; exits 1 on failure.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/selection.h"
#include "cuda/sparse/selection.h"
#include "tensor.h"

using dmattn::DType;
using dmattn::Problem;
using dmattn_test::HostTensor;
using dmattn_test::Rng;

namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DeviceBuffer = std::unique_ptr<void, CudaFree>;

enum class Values { kRandom, kFewDistinct, kConstant, kExtremes, kCount };
enum class MaskKind { kNone, kKeyPadding, kKeyPaddingPerHead, kPerRow, kCount };

const char* values_name(Values v) {
  static const char* names[] = {"random", "few-distinct", "constant", "extremes"};
  return names[static_cast<int>(v)];
}
const char* mask_name(MaskKind m) {
  static const char* names[] = {"none", "(B,1,1,Sk)", "(B,Hk,1,Sk)", "(B,1,Sq,Sk)"};
  return names[static_cast<int>(m)];
}

struct Case {
  std::int64_t batch = 1, heads = 2, kv_heads = 1, sq = 1, sk = 1, w = 1;
  std::int64_t bias_batch = 1, bias_heads = 1;
  bool bias_per_row = false;
  DType dtype = DType::kFloat32;
  Values values = Values::kRandom;
  MaskKind mask = MaskKind::kNone;
  bool causal = false;
  std::int64_t left = -1, right = -1;

  std::string str() const {
    char s[320];
    std::snprintf(s, sizeof s,
                  "B=%lld H=%lld Hk=%lld Sq=%lld Sk=%lld w=%lld bias=(%lld,%lld,%s,Sk) %s %s mask=%s%s window=(%lld,%lld)",
                  (long long)batch, (long long)heads, (long long)kv_heads, (long long)sq, (long long)sk, (long long)w,
                  (long long)bias_batch, (long long)bias_heads, bias_per_row ? "Sq" : "1", dmattn::dtype_name(dtype),
                  values_name(values), mask_name(mask), causal ? " causal" : "", (long long)left, (long long)right);
    return s;
  }
};

// A host operand in a random layout and its device copy with the same strides.
struct Mirrored {
  HostTensor host;
  DeviceBuffer device;
  dmattn::Operand view(bool on_device) const {
    const dmattn::TensorView v = host.view();
    dmattn::Operand op;
    op.dtype = v.dtype;
    op.data = on_device ? device.get() : v.data;
    std::int64_t* strides[] = {&op.sb, &op.sh, &op.sr, &op.sc};
    for (int d = 0; d < 4; ++d) *strides[d] = v.shape[d] == 1 ? 0 : v.stride[d];
    return op;
  }
};

Mirrored make_operand(DType dtype, const dmattn_test::Shape& shape, Rng& rng,
                     const std::function<double(std::int64_t)>& draw) {
  dmattn_test::Layout layout;
  layout.sliced = rng.bernoulli(0.5);
  layout.permuted = rng.bernoulli(0.3);
  Mirrored op{HostTensor(dtype, shape, layout, /*last_dim_contiguous=*/false), nullptr};
  op.host.fill(draw);
  // Bytes from element 0 (the lowest address) to the last element of the view.
  const dmattn::TensorView v = op.host.view();
  std::int64_t extent = 1;
  for (int d = 0; d < v.ndim; ++d) extent += (v.shape[d] - 1) * v.stride[d];
  const std::size_t bytes = static_cast<std::size_t>(extent) * dmattn::dtype_size(dtype);
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, std::max<std::size_t>(bytes, 16)), "cudaMalloc");
  op.device.reset(p);
  check_cuda(cudaMemcpy(p, v.data, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  return op;
}

double draw_value(const Case& c, Rng& rng, double constant, const std::vector<double>& few) {
  switch (c.values) {
    case Values::kRandom: return rng.uniform(-4.0, 4.0);
    case Values::kFewDistinct: return few[static_cast<std::size_t>(rng.integer(0, 3))];
    case Values::kConstant: return constant;
    default: {
      const double u = rng.uniform(0.0, 1.0);
      if (u < 0.3) return dmattn_test::lowest(c.dtype);
      if (u < 0.5) return c.dtype == DType::kFloat16 ? -65504.0 : -1e30;
      if (u < 0.55) return -std::numeric_limits<double>::infinity();
      return rng.uniform(-2.0, 2.0);
    }
  }
}

struct Result {
  bool pass = false;
  std::string detail;
};

// The operands of a case and its Problem on the host (for the CPU) and on the device.
struct Built {
  Mirrored bias;
  std::unique_ptr<Mirrored> mask;
  Problem host, device;
};

Built build(const Case& c, Rng& rng, cudaStream_t stream) {
  const std::int64_t bias_rows = c.bias_per_row ? c.sq : 1;
  const double constant = rng.uniform(-1.0, 1.0);
  const std::vector<double> few = {-1.0, -0.0, 0.0, 2.0};
  Built t{make_operand(c.dtype, {c.bias_batch, c.bias_heads, bias_rows, c.sk}, rng,
                       [&](std::int64_t) { return draw_value(c, rng, constant, few); }),
          nullptr, {}, {}};
  dmattn::BroadcastShape mask_shape;
  if (c.mask != MaskKind::kNone) {
    const bool per_row = c.mask == MaskKind::kPerRow;
    mask_shape = {c.batch, c.mask == MaskKind::kKeyPaddingPerHead ? c.kv_heads : 1, per_row ? c.sq : 1, c.sk};
    // Key padding: a random valid length per (b, head) with a few holes; per row: random.
    std::vector<std::int64_t> valid(static_cast<std::size_t>(mask_shape.batch * mask_shape.heads));
    for (auto& v : valid) v = rng.integer(0, c.sk);
    t.mask = std::make_unique<Mirrored>(make_operand(
        DType::kBool, {mask_shape.batch, mask_shape.heads, mask_shape.rows, c.sk}, rng, [&](std::int64_t idx) {
          if (per_row) return rng.bernoulli(0.7) ? 1.0 : 0.0;
          const std::int64_t j = idx % c.sk, bh = idx / c.sk;
          return j < valid[static_cast<std::size_t>(bh)] && !rng.bernoulli(0.1) ? 1.0 : 0.0;
        }));
  }

  Problem& p = t.host;
  p.batch = c.batch, p.heads = c.heads, p.kv_heads = c.kv_heads, p.head_dim = 8;
  p.seqlen_q = c.sq, p.seqlen_k = c.sk;
  p.bias = t.bias.view(false);
  p.bias_shape = {c.bias_batch, c.bias_heads, bias_rows, c.sk};
  if (t.mask) p.mask = t.mask->view(false), p.mask_shape = mask_shape;
  p.causal = c.causal;
  p.window_left = c.left, p.window_right = c.right;
  p.keep_window_size = c.w;
  t.device = p;
  t.device.bias = t.bias.view(true);
  if (t.mask) t.device.mask = t.mask->view(true);
  t.device.device = {dmattn::DeviceType::kCUDA, 0};
  t.device.stream = stream;
  return t;
}

// The GPU selection of p by the mode the dispatch plans (Problem::topk_by_intervals), on p's stream.
dmattn::cuda::DeviceSelection select_on_gpu(const Problem& p) {
  const auto mode = p.topk_by_intervals() ? dmattn::cuda::DeviceSelection::kIntervals
                                          : dmattn::cuda::DeviceSelection::kThresholds;
  return dmattn::cuda::select_topk(p, mode, static_cast<cudaStream_t>(p.stream));
}

Result compare(const Case& c, const Built& t, cudaStream_t stream) {
  const dmattn::cpu::Selection want = dmattn::cpu::select_topk(t.host);
  dmattn::cuda::DeviceSelection got = select_on_gpu(t.device);
  const bool intervals = got.mode == dmattn::cuda::DeviceSelection::kIntervals;
  if ((want.mode == dmattn::cpu::Selection::kIntervals) != intervals)
    return {false, "mode differs from the CPU's"};
  const std::size_t entries = static_cast<std::size_t>(c.batch * got.heads * got.per_head);
  std::vector<dmattn::cuda::KeyRows> rows(intervals ? entries : 0);
  std::vector<dmattn::cuda::RowThreshold> thresholds(intervals ? 0 : entries);
  if (intervals)
    check_cuda(cudaMemcpyAsync(rows.data(), got.intervals, entries * sizeof rows[0], cudaMemcpyDeviceToHost, stream),
               "copy intervals");
  else
    check_cuda(cudaMemcpyAsync(thresholds.data(), got.thresholds, entries * sizeof thresholds[0],
                               cudaMemcpyDeviceToHost, stream),
               "copy thresholds");
  dmattn::cuda::free_selection(got, stream);
  check_cuda(cudaStreamSynchronize(stream), "selection");

  std::int64_t wrong = 0, used = 0, limited = 0;  // keys selected by some row / before the last row; limited rows
  std::string first;
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t h = 0; h < c.heads; ++h)
      for (std::int64_t i = 0; i < got.per_head; ++i) {
        const auto at = static_cast<std::size_t>(got.index(b, h, i));
        char msg[200] = "";
        if (intervals) {
          const auto& e = want.interval(b, h, i);
          const auto& g = rows[at];
          used += e.end > e.start;
          limited += e.end > e.start && e.end < c.sq;
          if (e.start != g.start || e.end != g.end)
            std::snprintf(msg, sizeof msg, "b=%lld h=%lld key %lld: cpu [%lld, %lld) gpu [%d, %d)", (long long)b,
                          (long long)h, (long long)i, (long long)e.start, (long long)e.end, g.start, g.end);
        } else {
          const auto& e = want.threshold(b, h, i);
          const auto& g = thresholds[at];
          limited += e.key >= 0;
          if (e.value != static_cast<double>(g.value) || e.key != g.key)
            std::snprintf(msg, sizeof msg, "b=%lld h=%lld row %lld: cpu (%.9g, %lld) gpu (%.9g, %d)", (long long)b,
                          (long long)h, (long long)i, e.value, (long long)e.key, static_cast<double>(g.value), g.key);
        }
        if (msg[0] != '\0' && wrong++ == 0) first = msg;
      }
  char summary[160];
  const long long entries_all = static_cast<long long>(c.batch * c.heads * got.per_head);
  if (intervals)
    std::snprintf(summary, sizeof summary, "intervals: %lld of %lld keys selected, %lld of them not up to the last row",
                  (long long)used, entries_all, (long long)limited);
  else
    std::snprintf(summary, sizeof summary, "thresholds: %lld of %lld rows limited by top-k", (long long)limited,
                  entries_all);
  if (wrong == 0) return {true, summary};
  return {false, std::string(summary) + "; " + std::to_string(wrong) + " wrong, first " + first};
}

// The matrix: every (Sk, w, causal shape) of the brief, with dtype, values and
// mask cycling through all their combinations and the rest drawn at random.
std::vector<Case> matrix(Rng& rng, bool small) {
  const std::vector<std::int64_t> interval_sk =
      small ? std::vector<std::int64_t>{7, 65, 1000} : std::vector<std::int64_t>{1, 7, 63, 65, 1000, 4095, 4096, 4097, 65537};
  const std::vector<std::int64_t> threshold_sk =
      small ? std::vector<std::int64_t>{7, 300} : std::vector<std::int64_t>{1, 7, 63, 65, 1000, 4095};
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  std::vector<Case> cases;
  int counter = 0;
  const auto base = [&](std::int64_t sk, std::int64_t w, int shape) {
    Case c;
    const int n = counter++;
    c.dtype = dtypes[n % 3];
    c.values = static_cast<Values>(n / 3 % static_cast<int>(Values::kCount));
    c.batch = rng.integer(1, 2);
    const bool four = rng.bernoulli(0.5);
    c.heads = four ? 4 : 2, c.kv_heads = four ? 2 : 1;
    const std::int64_t head_choices[] = {1, c.kv_heads, c.heads};
    c.bias_heads = head_choices[rng.integer(0, 2)];
    c.bias_batch = rng.bernoulli(0.5) ? c.batch : 1;
    c.sk = sk;
    c.w = w < 0 ? sk + rng.integer(0, 3) : w;
    c.causal = shape > 0;
    c.sq = shape == 1 ? std::max<std::int64_t>(1, sk / 2 + 1) : shape == 3 ? sk + 1 + sk / 7 : sk;
    if (shape == 1 && sk > 1) c.sq = std::min(c.sq, sk - 1);
    return c;
  };
  const std::int64_t windows[] = {1, 7, 64, -1};  // -1: w >= Sk
  for (std::int64_t sk : interval_sk)
    for (std::int64_t w : windows)
      for (int shape = 0; shape < 4; ++shape) {  // 0: not causal, 1: Sq < Sk, 2: Sq = Sk, 3: Sq > Sk
        Case c = base(sk, w, shape);
        c.mask = static_cast<MaskKind>(counter / 15 % 3);
        if (counter % 5 == 0) c.right = rng.integer(0, 9);
        cases.push_back(c);
      }
  // Many selection heads (64 bias heads): the counted selection at B = 1 and
  // 1000 keys, the sort per head at B = 2 and 4095 (heuristics.h
  // counted_selection; the cases above count).
  if (!small)
    for (std::int64_t sk : {std::int64_t{1000}, std::int64_t{4095}}) {
      Case c = base(sk, 300, 2);
      c.batch = c.bias_batch = sk < 4095 ? 1 : 2, c.heads = c.kv_heads = c.bias_heads = 64;
      cases.push_back(c);
    }
  for (std::int64_t sk : threshold_sk)
    for (std::int64_t w : windows)
      for (int shape = 0; shape < 4; ++shape) {
        Case c = base(sk, w, shape);
        c.sq = std::min<std::int64_t>(c.sq, 1100);
        switch (counter % 4) {  // what makes the selection per row
          case 0: c.bias_per_row = true, c.mask = static_cast<MaskKind>(counter / 4 % 3); break;
          case 1: c.mask = MaskKind::kPerRow; break;
          case 2: c.left = rng.integer(0, std::max<std::int64_t>(1, sk / 3)); break;
          default:
            c.bias_per_row = true, c.mask = MaskKind::kPerRow;
            c.left = rng.integer(0, sk), c.right = rng.integer(0, 5);
        }
        cases.push_back(c);
      }
  // Few rows over many keys (decode, Sq <= 16): the chunked search, ties across
  // chunks (constant and four-valued biases), w >= the allowed keys, masks,
  // per-row biases, left windows (rows of different key ranges).
  const std::vector<std::int64_t> few_sq = small ? std::vector<std::int64_t>{1, 3} : std::vector<std::int64_t>{1, 3, 16};
  const std::vector<std::int64_t> few_sk =
      small ? std::vector<std::int64_t>{5000} : std::vector<std::int64_t>{2049, 9000, 40000, 131072};
  const std::int64_t few_w[] = {1, 700, 2048, -1};
  for (std::int64_t sq : few_sq)
    for (std::int64_t sk : few_sk)
      for (std::int64_t w : few_w) {
        Case c = base(sk, w, 0);
        c.sq = sq, c.causal = counter % 2 == 0;
        if (w < 0) c.w = sk - counter % 3;  // at least the allowed keys, or one less
        switch (counter % 5) {
          case 0: c.mask = MaskKind::kKeyPadding; break;
          case 1: c.bias_per_row = true; break;
          case 2: c.mask = MaskKind::kPerRow; break;
          case 3: c.left = rng.integer(sk / 2, sk); break;
          default: break;
        }
        cases.push_back(c);
      }
  return cases;
}

int check(bool small) {
  Rng rng;
  std::printf("%s\n", rng.trace().c_str());
  cudaStream_t stream;
  check_cuda(cudaStreamCreate(&stream), "stream");
  int passed = 0, failed = 0;
  for (const Case& c : matrix(rng, small)) {
    Result r;
    try {
      r = compare(c, build(c, rng, stream), stream);
    } catch (const std::exception& e) {
      r = {false, std::string("exception: ") + e.what()};
    }
    (r.pass ? passed : failed)++;
    std::printf("%s %s: %s\n", r.pass ? "PASS" : "FAIL", c.str().c_str(), r.detail.c_str());
  }
  check_cuda(cudaStreamDestroy(stream), "stream");
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

// Time of the selection (allocations included), launched on a stream and
// replayed as a CUDA graph, checked against the CPU first.
int bench() {
  Rng rng;
  cudaStream_t stream;
  check_cuda(cudaStreamCreate(&stream), "stream");
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "event");
  check_cuda(cudaEventCreate(&stop), "event");
  int failed = 0;
  std::vector<Case> cases;
  for (std::int64_t s : {16384, 65536, 131072}) {  // intervals: key-only bias (1, 8, 1, S)
    Case c;
    c.heads = 32, c.kv_heads = 8, c.bias_heads = 8;
    c.sq = c.sk = s, c.w = 1024, c.causal = true, c.dtype = DType::kBFloat16;
    cases.push_back(c);
  }
  for (std::int64_t batch : {1, 4, 16})  // short rows: B x (1, 8, 1, S), w = 256
    for (std::int64_t s : {1024, 2048, 4096}) {
      Case c = cases[0];
      c.batch = c.bias_batch = batch, c.sq = c.sk = s, c.w = 256;
      cases.push_back(c);
    }
  Case rows = cases[0];  // thresholds: per-row bias (1, 8, S, S)
  rows.sq = rows.sk = 2048, rows.bias_per_row = true;
  cases.push_back(rows);
  Case decode = cases[0];  // thresholds, chunked: decode B=4, bias (4, 8, 1, 131072), w = 2048
  decode.batch = decode.bias_batch = 4, decode.sq = 1, decode.sk = 131072, decode.w = 2048, decode.causal = false;
  cases.push_back(decode);
  for (const Case& c : cases) {
    const Built t = build(c, rng, stream);
    const Result r = compare(c, t, stream);
    failed += !r.pass;
    // Mean time per call of `enqueue` on the stream, after a warm-up.
    const auto time_ms = [&](const std::function<void()>& enqueue) {
      constexpr int kWarmup = 3, kReps = 20;
      for (int rep = 0; rep < kWarmup; ++rep) enqueue();
      check_cuda(cudaEventRecord(start, stream), "record");
      for (int rep = 0; rep < kReps; ++rep) enqueue();
      check_cuda(cudaEventRecord(stop, stream), "record");
      check_cuda(cudaEventSynchronize(stop), "sync");
      float ms = 0;
      check_cuda(cudaEventElapsedTime(&ms, start, stop), "elapsed");
      return ms / kReps;
    };
    const auto select_with = [&](const Problem& p) {
      dmattn::cuda::DeviceSelection sel = select_on_gpu(p);
      dmattn::cuda::free_selection(sel, stream);
    };
    const auto select = [&] { select_with(t.device); };
    const float stream_ms = time_ms(select);
    // w = Sk: the same work without the w-th-beater queries (every key has fewer than w beaters).
    Problem all_keys = t.device;
    all_keys.keep_window_size = c.sk;
    const float no_query_ms = time_ms([&] { select_with(all_keys); });
    // The same call captured into a CUDA graph (no host sync inside, allocations as graph nodes).
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
    select();
    check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
    check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    const float graph_ms = time_ms([&] { check_cuda(cudaGraphLaunch(exec, stream), "graph launch"); });
    check_cuda(cudaGraphExecDestroy(exec), "graph");
    check_cuda(cudaGraphDestroy(graph), "graph");
    std::printf("bench %s: %.3f ms per call, %.3f ms as a CUDA graph, %.3f ms with w = Sk (%s: %s)\n",
                c.str().c_str(), stream_ms, graph_ms, no_query_ms, r.pass ? "PASS" : "FAIL", r.detail.c_str());
  }
  check_cuda(cudaStreamDestroy(stream), "stream");
  return failed == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "--bench") return bench();
    return check(mode == "--small");
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
}
