// CUDA timings (moved from the GPU check): forward TFLOP/s at B=1, H=32,
// Hk=8, D=128, bf16, causal, and forward + backward times at S=16384 (D=192,
// 256 at S=8192 where DMATTN_HEAD_DIMS has them), top-k fill, decode.
//
//   dmattn_bench_cuda [--all]   every line
//   dmattn_bench_cuda --topk    the top-k (w = 1024) forward + backward line alone
//   dmattn_bench_cuda --decode  the decode lines alone (dense, top-k)
//   dmattn_bench_cuda --wide    the head dim 192 / 256 lines alone (where compiled)
//   dmattn_bench_cuda --dense   the D = 128 fwd + bwd lines (no mask, key-only bias) alone
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cpu/selection.h"
#include "device.h"
#include "dmattn/dmattn.h"
#include "problem.h"
#include "tensor.h"

namespace {

using namespace dmattn_gpu_test;

// Mean time of one call in ms (CUDA events, after warm-up).
template <class F>
float time_call(F&& call, int iters) {
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "event");
  check_cuda(cudaEventCreate(&stop), "event");
  for (int i = 0; i < 3; ++i) call();
  check_cuda(cudaEventRecord(start), "record");
  for (int i = 0; i < iters; ++i) call();
  check_cuda(cudaEventRecord(stop), "record");
  check_cuda(cudaEventSynchronize(stop), "sync");
  float ms = 0.0f;
  check_cuda(cudaEventElapsedTime(&ms, start, stop), "elapsed");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / iters;
}

// Mean time of one forward in ms.
float time_forward(const dmattn::Inputs& in, const DeviceTensor& out, const DeviceTensor& lse,
                   const dmattn::Options& o, int iters) {
  return time_call([&] { dmattn::forward(in, out.view(), lse.view(), o); }, iters);
}

// Fill of the top-k walks from the CPU's exact selection (causal key-only bias
// `bias` of (1, heads, 1, S)): the dq key lists (128 rows, 64 keys a step) and
// the dk/dv key groups, each key's interval cut at multiples of `segment` rows
// (0: not cut), the pieces of a segment sorted by end, then strips of `strip`
// groups by start, 128 pieces a group walking 32-row tiles.
void print_topk_fill(const HostTensor& bias, std::int64_t w, std::size_t strip, std::int64_t segment) {
  const Shape shape = bias.shape();
  const std::int64_t heads = shape[1], S = shape[3];
  dmattn::Problem p;
  p.batch = 1, p.heads = heads, p.kv_heads = heads, p.head_dim = 8;
  p.seqlen_q = p.seqlen_k = S;
  const dmattn::TensorView view = bias.view();
  p.bias = {view.data, view.dtype, view.stride[0], view.stride[1], 0, view.stride[3]};
  p.bias_shape = {1, heads, 1, S};
  p.causal = true;
  p.keep_window_size = w;
  const dmattn::cpu::Selection sel = dmattn::cpu::select_topk(p);
  const std::int64_t L = segment > 0 ? segment : S;
  double useful = 0, dq_work = 0, dkv_work = 0, pieces = 0, groups = 0;
  using Piece = std::pair<std::int64_t, std::int64_t>;  // rows [first, second) of a key within a segment
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t j = 0; j < S; ++j) useful += static_cast<double>(sel.interval(0, h, j).end - sel.interval(0, h, j).start);
    for (std::int64_t i0 = 0; i0 < S; i0 += 128) {
      std::int64_t listed = 0;
      for (std::int64_t j = 0; j < S; ++j) {
        const auto& r = sel.interval(0, h, j);
        listed += r.end > r.start && r.start < i0 + 128 && r.end > i0;
      }
      dq_work += static_cast<double>(std::min<std::int64_t>(128, S - i0) * ((listed + 63) / 64 * 64));
    }
    for (std::int64_t s0 = 0; s0 < S; s0 += L) {
      std::vector<Piece> cut;
      for (std::int64_t j = 0; j < S; ++j) {
        const auto& r = sel.interval(0, h, j);
        const std::int64_t lo = std::max<std::int64_t>(r.start, s0), hi = std::min<std::int64_t>(r.end, s0 + L);
        if (lo < hi) cut.emplace_back(lo, hi);
      }
      pieces += static_cast<double>(cut.size());
      std::stable_sort(cut.begin(), cut.end(), [](const Piece& a, const Piece& b) { return a.second < b.second; });
      for (std::size_t g = 0; g < cut.size(); g += 128 * strip)
        std::stable_sort(cut.begin() + g, cut.begin() + std::min(cut.size(), g + 128 * strip),
                         [](const Piece& a, const Piece& b) { return a.first < b.first; });
      for (std::size_t g = 0; g < cut.size(); g += 128) {
        std::int64_t lo = S, hi = 0;
        for (std::size_t e = g; e < std::min(cut.size(), g + 128); ++e)
          lo = std::min(lo, cut[e].first), hi = std::max(hi, cut[e].second);
        dkv_work += 128.0 * static_cast<double>((hi + 31) / 32 - lo / 32) * 32;
        groups += 1;
      }
    }
  }
  double keys = 0;
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t j = 0; j < S; ++j) keys += sel.interval(0, h, j).end > sel.interval(0, h, j).start;
  const double dense = static_cast<double>(heads) * S * (S + 1) / 2;
  std::printf("  fill (useful / computed entries): dq key lists %.3f, dk/dv key groups (segments of %lld rows, strips of "
              "%zu) %.3f; computed / dense causal: dq %.3f, dk/dv %.3f; selected / dense causal %.3f; pieces a selected "
              "key %.3f, groups a head %.1f\n",
              useful / dq_work, static_cast<long long>(L), strip, useful / dkv_work, dq_work / dense, dkv_work / dense,
              useful / dense, pieces / keys, groups / static_cast<double>(heads));
}

// Decode: one query row over Sk keys; bound by reading K and V. B=4 at 128k
// keys is the case of the GB/s target, and of the top-k decode target: a
// key-only bias (B, 8, 1, Sk) with keep_window_size 2048 (selection included)
// under 1/4 of the dense decode's time.
void bench_decode() {
  Rng rng;
  const std::int64_t H = 32, Hk = 8, D = 128;
  auto random = [&](HostTensor& t) { t.fill([&](std::int64_t) { return rng.uniform(-1.0, 1.0); }); };
  for (const auto& [Bd, Sk] : {std::pair<std::int64_t, std::int64_t>{1, 16384}, {4, 131072}}) {
    HostTensor q(DType::kBFloat16, {Bd, 1, H, D}), k(DType::kBFloat16, {Bd, Sk, Hk, D}),
        v(DType::kBFloat16, {Bd, Sk, Hk, D}), bias(DType::kBFloat16, {Bd, Hk, 1, Sk});
    random(q), random(k), random(v), random(bias);
    HostTensor out(DType::kBFloat16, {Bd, 1, H, D}), lse(DType::kFloat32, {Bd, H, 1});
    const DeviceTensor dq(q), dk(k), dv(v), db(bias), dout(out), dlse(lse);
    const float ms = time_forward({dq.view(), dk.view(), dv.view(), std::nullopt, std::nullopt}, dout, dlse, {}, 50);
    const double bytes = 2.0 * Bd * Sk * Hk * D * 2;
    std::printf("bench bf16 decode B=%lld Sq=1 H=32 Hk=8 D=128 Sk=%lld  %.4f ms  %.0f GB/s of K and V\n",
                static_cast<long long>(Bd), static_cast<long long>(Sk), ms, bytes / (ms * 1e-3) / 1e9);
    if (Bd != 4) continue;
    const float biased = time_forward({dq.view(), dk.view(), dv.view(), std::nullopt, db.view()}, dout, dlse, {}, 50);
    std::printf("bench bf16 decode B=%lld Sq=1 H=32 Hk=8 D=128 Sk=%lld key-only bias (B, 8, 1, Sk)  %.4f ms  %.0f GB/s "
                "of K and V\n",
                static_cast<long long>(Bd), static_cast<long long>(Sk), biased, bytes / (biased * 1e-3) / 1e9);
    dmattn::Options o;
    o.keep_window_size = 2048;
    const float topk = time_forward({dq.view(), dk.view(), dv.view(), std::nullopt, db.view()}, dout, dlse, o, 50);
    std::printf("bench bf16 decode B=%lld Sq=1 H=32 Hk=8 D=128 Sk=%lld key-only bias (B, 8, 1, Sk), keep_window_size "
                "2048  %.4f ms  (%.3f of the dense decode, %.3f of it with the bias; target < 0.25)\n",
                static_cast<long long>(Bd), static_cast<long long>(Sk), topk, topk / ms, topk / biased);
  }
}

// topk_only: the top-k fwd + bwd line alone (a short run to profile);
// wide_only: the head dim > 128 lines alone; dense_only: the D = 128
// fwd + bwd lines without a mask and with the key-only bias.
int bench(bool topk_only, bool wide_only, bool dense_only) {
  Rng rng;
  const std::int64_t B = 1, H = 32, Hk = 8, D = 128;
  auto random = [&](HostTensor& t) { t.fill([&](std::int64_t) { return rng.uniform(-1.0, 1.0); }); };
  for (std::int64_t S : {4096, 16384})
    if (!topk_only)
    for (bool with_bias : {false, true}) {
      HostTensor q(DType::kBFloat16, {B, S, H, D}), k(DType::kBFloat16, {B, S, Hk, D}), v(DType::kBFloat16, {B, S, Hk, D});
      random(q), random(k), random(v);
      HostTensor bias(DType::kBFloat16, {B, Hk, 1, S}), out(DType::kBFloat16, {B, S, H, D}), lse(DType::kFloat32, {B, H, S});
      random(bias);
      const DeviceTensor dq(q), dk(k), dv(v), db(bias), dout(out), dlse(lse);
      dmattn::Inputs in{dq.view(), dk.view(), dv.view(), std::nullopt, std::nullopt};
      if (with_bias) in.bias = db.view();
      dmattn::Options o;
      o.causal = true;
      const float ms = time_forward(in, dout, dlse, o, S > 8192 ? 10 : 30);
      const double flops = 4.0 * B * H * D * double(S) * double(S) / 2.0;
      std::printf("bench bf16 B=1 H=32 Hk=8 D=128 causal S=%lld %-14s %.3f ms  %.1f TFLOP/s\n",
                  static_cast<long long>(S), with_bias ? "key-only bias" : "no mask", ms, flops / (ms * 1e-3) / 1e12);
    }
  // Forward + backward at S = 16384 (backward FLOPs counted as 2.5x the
  // forward's): no mask, a learnable key-only bias (B, Hk, 1, S) with its
  // gradient, and below the same with a bool mask or keep_window_size; at
  // D = 192 and 256 (where compiled) S = 8192 without a mask.
  const auto fwd_bwd = [&](const char* what, bool with_bias, const std::optional<dmattn::TensorView>& mask,
                           std::int64_t keep_window, int iters, bool deterministic = false, std::int64_t S = 16384,
                           std::int64_t D = 128) {
    HostTensor q(DType::kBFloat16, {B, S, H, D}), k(DType::kBFloat16, {B, S, Hk, D}), v(DType::kBFloat16, {B, S, Hk, D});
    random(q), random(k), random(v);
    HostTensor bias(DType::kBFloat16, {B, Hk, 1, S}), out(DType::kBFloat16, {B, S, H, D}), lse(DType::kFloat32, {B, H, S});
    random(bias);
    const DeviceTensor dq(q), dk(k), dv(v), db(bias), dout(out), dlse(lse), ddo(q), gq(q), gk(k), gv(v), gb(bias);
    dmattn::Inputs in{dq.view(), dk.view(), dv.view(), mask, std::nullopt};
    dmattn::Gradients g{gq.view(), gk.view(), gv.view(), std::nullopt};
    if (with_bias) in.bias = db.view(), g.dbias = gb.view();
    dmattn::Options o;
    o.causal = true;
    o.deterministic = deterministic;
    if (keep_window > 0) o.keep_window_size = keep_window;
    const float fwd = time_forward(in, dout, dlse, o, iters);
    const float bwd = time_call([&] { dmattn::backward(in, dout.view(), ddo.view(), dlse.view(), g, o); }, iters);
    const double flops = 4.0 * B * H * D * double(S) * double(S) / 2.0;
    std::printf("bench bf16 B=1 H=32 Hk=8 D=%lld causal S=%lld %-14s fwd %.3f ms  bwd %.3f ms (%.1f TFLOP/s)  fwd+bwd %.3f ms\n",
                static_cast<long long>(D), static_cast<long long>(S), what, fwd, bwd, 2.5 * flops / (bwd * 1e-3) / 1e12, fwd + bwd);
    if (keep_window > 0)
      for (const auto& [strip, segment] : {std::pair<std::size_t, std::int64_t>{1, 0}, {3, 0}, {3, 1024}, {3, 2048}})
        print_topk_fill(bias, keep_window, strip, segment);
  };
  const char* topk_line = "key-only bias (B, 8, 1, S), keep_window_size 1024 (TFLOP/s of the dense work)";
  if (topk_only) {
    fwd_bwd(topk_line, true, std::nullopt, 1024, 5);
    return 0;
  }
  const auto wide_lines = [&] {
    for (std::int64_t d : {192, 256})
      if (head_dim_compiled(d)) {
        fwd_bwd("no mask", false, std::nullopt, 0, 5, false, 8192, d);
        fwd_bwd("no mask deterministic (two-kernel dq)", false, std::nullopt, 0, 5, true, 8192, d);
      }
  };
  if (wide_only) return wide_lines(), 0;
  if (dense_only) {
    fwd_bwd("no mask", false, std::nullopt, 0, 5);
    fwd_bwd("key-only bias", true, std::nullopt, 0, 5);
    return 0;
  }
  fwd_bwd("no mask", false, std::nullopt, 0, 5);
  fwd_bwd("no mask deterministic (two-kernel dq)", false, std::nullopt, 0, 5, true);
  fwd_bwd("key-only bias", true, std::nullopt, 0, 5);
  wide_lines();
  {  // A sparse mask: about 1024 random keys a causal row (bench_gpu.py's top-1024 case), with the key bias.
    const std::int64_t S = 4096;
    HostTensor q(DType::kBFloat16, {B, S, H, D}), k(DType::kBFloat16, {B, S, Hk, D}), v(DType::kBFloat16, {B, S, Hk, D});
    random(q), random(k), random(v);
    HostTensor bias(DType::kBFloat16, {B, Hk, 1, S}), mask(DType::kBool, {B, Hk, S, S});
    random(bias);
    mask.fill([&](std::int64_t i) { return rng.uniform(0.0, 1.0) * double(i / S % S + 1) < 1024.0 ? 1.0 : 0.0; });
    HostTensor out(DType::kBFloat16, {B, S, H, D}), lse(DType::kFloat32, {B, H, S});
    const DeviceTensor dq(q), dk(k), dv(v), db(bias), dm(mask), dout(out), dlse(lse);
    dmattn::Options o;
    o.causal = true;
    const float ms = time_forward({dq.view(), dk.view(), dv.view(), dm.view(), db.view()}, dout, dlse, o, 30);
    std::printf("bench bf16 B=1 H=32 Hk=8 D=128 causal S=%lld key-only bias + 1024-a-row mask (B, 8, S, S)  %.3f ms\n",
                static_cast<long long>(S), ms);
  }
  {  // Top-k: keep_window_size 1024 over a key-only bias (selection + listed keys + forward).
    const std::int64_t S = 16384;
    HostTensor q(DType::kBFloat16, {B, S, H, D}), k(DType::kBFloat16, {B, S, Hk, D}), v(DType::kBFloat16, {B, S, Hk, D});
    random(q), random(k), random(v);
    HostTensor bias(DType::kBFloat16, {B, Hk, 1, S}), out(DType::kBFloat16, {B, S, H, D}), lse(DType::kFloat32, {B, H, S});
    random(bias);
    const DeviceTensor dq(q), dk(k), dv(v), db(bias), dout(out), dlse(lse);
    dmattn::Options o;
    o.causal = true;
    o.keep_window_size = 1024;
    const float ms = time_forward({dq.view(), dk.view(), dv.view(), std::nullopt, db.view()}, dout, dlse, o, 10);
    std::printf("bench bf16 B=1 H=32 Hk=8 D=128 causal S=%lld key-only bias (B, 8, 1, S), keep_window_size 1024  %.3f ms\n",
                static_cast<long long>(S), ms);
  }
  // Top-k (the selection in both calls) and a bool top-1024 mask, key-only bias and its gradient.
  fwd_bwd(topk_line, true, std::nullopt, 1024, 5);
  {  // A bool mask of about 1024 random keys a causal row (B, 8, S, S), fwd + bwd.
    const std::int64_t S = 16384;
    std::vector<unsigned char> mask_bytes(static_cast<std::size_t>(B * Hk * S * S));
    for (std::size_t e = 0; e < mask_bytes.size(); ++e) {  // a hash per element: cheap at 2 G elements
      std::uint64_t x = (e + 1) * 0x9E3779B97F4A7C15ull;
      x = (x ^ (x >> 31)) * 0xBF58476D1CE4E5B9ull;
      x ^= x >> 29;
      mask_bytes[e] = (x % static_cast<std::uint64_t>(e / S % S + 1)) < 1024 ? 1 : 0;
    }
    void* mask_dev = nullptr;
    check_cuda(cudaMalloc(&mask_dev, mask_bytes.size()), "cudaMalloc");
    std::unique_ptr<void, decltype(&cudaFree)> mask_owner(mask_dev, cudaFree);
    check_cuda(cudaMemcpy(mask_dev, mask_bytes.data(), mask_bytes.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
    const dmattn::TensorView mask_view =
        dmattn::TensorView::contiguous(mask_dev, DType::kBool, {B, Hk, S, S}, {dmattn::DeviceType::kCUDA, 0});
    fwd_bwd("key-only bias + 1024-a-row bool mask (B, 8, S, S)", true, mask_view, 0, 3);
  }
  bench_decode();
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "properties");
  std::printf("device: %s\n", prop.name);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "--all";
  try {
    if (mode == "--all" || mode == "--topk" || mode == "--wide" || mode == "--dense")
      return bench(mode == "--topk", mode == "--wide", mode == "--dense");
    if (mode == "--decode") return bench_decode(), 0;
    std::fprintf(stderr, "dmattn_bench_cuda: expected --all, --topk, --wide, --dense or --decode, got %s\n", mode.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dmattn_bench_cuda: %s\n", e.what());
    return 2;
  }
}
