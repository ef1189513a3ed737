// dmattn demo: forward + backward of a Doge-like layer (causal, GQA, learnable
// key-only bias A * softplus(dt), top-k keep window) on the best available
// backend, checked against the float64 CPU oracle, with time and memory. With a
// GPU (a CUDA build, DMATTN_DEMO_CUDA) the bf16 run is on the GPU.
#include <sys/resource.h>
#if DMATTN_DEMO_CUDA
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "dmattn/dmattn.h"

namespace {

using dmattn::DType;
using dmattn::TensorView;

constexpr std::int64_t kB = 1, kS = 1024, kH = 8, kHk = 2, kD = 64, kKeep = 256;

std::uint16_t to_bf16(double x) {  // round to nearest, ties to even
  const float f = static_cast<float>(x);
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<std::uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
double from_bf16(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One tensor in float64 and bfloat16 with the same (bf16-rounded) values.
struct Tensor {
  std::vector<std::int64_t> shape;
  std::vector<double> f64;
  std::vector<std::uint16_t> bf16;

  explicit Tensor(std::vector<std::int64_t> s) : shape(std::move(s)) {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    f64.assign(n, std::nan("")), bf16.assign(n, 0x7fc0);
  }
  template <class F>
  void fill(F&& gen) {
    for (std::size_t i = 0; i < f64.size(); ++i) bf16[i] = to_bf16(gen()), f64[i] = from_bf16(bf16[i]);
  }
  TensorView view(bool low) {
    TensorView t;
    t.data = low ? static_cast<void*>(bf16.data()) : static_cast<void*>(f64.data());
    t.dtype = low ? DType::kBFloat16 : DType::kFloat64;
    t.ndim = static_cast<int>(shape.size());
    std::int64_t stride = 1;
    for (int d = t.ndim - 1; d >= 0; --d) t.shape[d] = shape[d], t.stride[d] = stride, stride *= shape[d];
    return t;
  }
  // max |bf16 - f64| and the error of merely rounding f64 to bf16, over all elements.
  std::pair<double, double> errors() const {
    double err = 0, rounding = 0;
    for (std::size_t i = 0; i < f64.size(); ++i) {
      err = std::max(err, std::fabs(from_bf16(bf16[i]) - f64[i]));
      rounding = std::max(rounding, std::fabs(from_bf16(to_bf16(f64[i])) - f64[i]));
    }
    return {err, rounding};
  }
};

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

#if DMATTN_DEMO_CUDA
void check_cuda(cudaError_t err) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + cudaGetErrorString(err));
}
bool gpu_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
// A device copy of a tensor's bf16 values; copy_back() brings them home.
class DeviceCopy {
 public:
  explicit DeviceCopy(Tensor& t) : host_(t) {
    check_cuda(cudaMalloc(&data_, t.bf16.size() * 2));
    check_cuda(cudaMemcpy(data_, t.bf16.data(), t.bf16.size() * 2, cudaMemcpyHostToDevice));
  }
  ~DeviceCopy() { cudaFree(data_); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  TensorView view() const {
    TensorView v = host_.view(true);
    v.data = data_, v.device = {dmattn::DeviceType::kCUDA, 0};
    return v;
  }
  void copy_back() { check_cuda(cudaMemcpy(host_.bf16.data(), data_, host_.bf16.size() * 2, cudaMemcpyDeviceToHost)); }

 private:
  Tensor& host_;
  void* data_ = nullptr;
};
#else
bool gpu_present() { return false; }
#endif

}  // namespace

int main() {
  const dmattn::BuildInfo info = dmattn::build_info();
  const bool gpu = info.cuda && gpu_present();
  std::printf("dmattn %s, CUDA backend: %s\n", info.version, info.cuda ? info.cuda_architectures : "not built");
  std::printf("device: %s\n", gpu ? "cuda:0 for bf16" : "cpu");
  std::printf("problem: B=%lld S=%lld H=%lld Hk=%lld D=%lld, causal, key-only bias A*softplus(dt), keep_window_size=%lld\n",
              (long long)kB, (long long)kS, (long long)kH, (long long)kHk, (long long)kD, (long long)kKeep);

  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<double> normal;
  Tensor q({kB, kS, kH, kD}), k({kB, kS, kHk, kD}), v({kB, kS, kHk, kD}), dout({kB, kS, kH, kD});
  Tensor bias({kB, kHk, 1, kS});
  for (Tensor* t : {&q, &k, &v, &dout}) t->fill([&] { return normal(rng); });
  std::vector<double> A(kHk);
  for (double& a : A) a = -std::exp(normal(rng));  // Doge's A: one per bias head
  std::int64_t n = 0;
  bias.fill([&] { return A[(n++ / kS) % kHk] * std::log1p(std::exp(normal(rng))); });

  Tensor out({kB, kS, kH, kD}), dq({kB, kS, kH, kD}), dk({kB, kS, kHk, kD}), dv({kB, kS, kHk, kD});
  Tensor dbias({kB, kHk, 1, kS});
  std::vector<float> lse32(kB * kH * kS);
  std::vector<double> lse64(kB * kH * kS);
  dmattn::Options opt;
  opt.causal = true;
  opt.keep_window_size = kKeep;

  double ms[2][2] = {};
#if DMATTN_DEMO_CUDA
  if (gpu) {  // bf16 on the GPU: a warm-up call (module loading), then a timed one
    DeviceCopy gq(q), gk(k), gv(v), gdo(dout), gbias(bias), gout(out), gdq(dq), gdk(dk), gdv(dv), gdbias(dbias);
    void* glse = nullptr;
    check_cuda(cudaMalloc(&glse, lse32.size() * 4));
    const dmattn::Inputs in{gq.view(), gk.view(), gv.view(), std::nullopt, gbias.view()};
    const TensorView lse = TensorView::contiguous(glse, DType::kFloat32, {kB, kH, kS}, {dmattn::DeviceType::kCUDA, 0});
    for (int run = 0; run < 2; ++run) {
      const double t0 = now_ms();
      dmattn::forward(in, gout.view(), lse, opt);
      check_cuda(cudaDeviceSynchronize());
      const double t1 = now_ms();
      dmattn::backward(in, gout.view(), gdo.view(), lse, {gdq.view(), gdk.view(), gdv.view(), gdbias.view()}, opt);
      check_cuda(cudaDeviceSynchronize());
      ms[1][0] = t1 - t0, ms[1][1] = now_ms() - t1;
    }
    for (DeviceCopy* t : {&gout, &gdq, &gdk, &gdv, &gdbias}) t->copy_back();
    cudaFree(glse);
  }
#endif
  for (int low = gpu ? 0 : 1; low >= 0; --low) {  // bf16 on the CPU (no GPU), then the float64 oracle
    const dmattn::Inputs in{q.view(low), k.view(low), v.view(low), std::nullopt, bias.view(low)};
    TensorView lse = TensorView::contiguous(low ? static_cast<void*>(lse32.data()) : lse64.data(),
                                            low ? DType::kFloat32 : DType::kFloat64, {kB, kH, kS});
    const double t0 = now_ms();
    dmattn::forward(in, out.view(low), lse, opt);
    const double t1 = now_ms();
    dmattn::backward(in, out.view(low), dout.view(low), lse, {dq.view(low), dk.view(low), dv.view(low), dbias.view(low)},
                     opt);
    ms[low][0] = t1 - t0, ms[low][1] = now_ms() - t1;
  }

  std::printf("bf16 on %s: forward %.2f ms, backward %.2f ms (float64 oracle on the CPU: %.1f / %.1f ms)\n",
              gpu ? "cuda:0" : "cpu", ms[1][0], ms[1][1], ms[0][0], ms[0][1]);
  bool ok = true;
  const std::pair<const char*, const Tensor*> results[] = {
      {"out", &out}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}, {"dbias", &dbias}};
  for (const auto& [name, t] : results) {
    const auto [err, rounding] = t->errors();
    // The bf16 result is the exact one rounded once, plus float32 accumulation and,
    // in the backward, the bf16-rounded out inside delta = <do, o> (as in
    // FlashAttention): a few bf16 roundings of the largest value, at most.
    const bool pass = err <= 4 * rounding + 1e-5;
    ok = ok && pass;
    std::printf("  %-6s max |bf16 - float64| = %.3g  (bf16 rounding of the exact result: %.3g)  %s\n", name, err,
                rounding, pass ? "ok" : "FAIL");
  }
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  const double dense_mib = 4.0 * kB * kH * kS * kS / (1024.0 * 1024.0);
  std::printf("peak resident memory %.1f MiB (one float32 (B, H, S, S) tensor would be %.1f MiB)\n", u.ru_maxrss / 1024.0,
              dense_mib);
  std::printf("%s\n", ok ? "demo: PASS" : "demo: FAIL");
  return ok ? 0 : 1;
}
