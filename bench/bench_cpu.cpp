// CPU benchmark: forward and backward time and peak memory of one call per case.
// Each case runs in a child process so that its peak resident memory is its own.
//
//   dmattn_bench_cpu [S ...]      (default S = 2048)
//
// Problem: B=1, H=8, Hk=2, D=128, float32, causal, key-only bias (1, 2, 1, S),
// dense and with keep_window_size=256.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "dmattn/dmattn.h"

namespace {

constexpr std::int64_t kB = 1, kH = 8, kHk = 2, kD = 128;

struct Case {
  const char* name;
  std::int64_t keep;  // 0: dense
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

long peak_rss_kb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

// Runs one case; prints a table row. Executed in a child process.
void run_case(const Case& c, std::int64_t S, int reps) {
  using dmattn::DType;
  using dmattn::TensorView;
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal;
  auto fill = [&](std::vector<float>& x) {
    for (float& e : x) e = normal(rng);
  };
  std::vector<float> q(kB * S * kH * kD), k(kB * S * kHk * kD), v(k.size()), bias(kB * kHk * S);
  std::vector<float> out(q.size()), dout(q.size()), lse(kB * kH * S), dq(q.size()), dk(k.size()), dv(k.size()),
      dbias(bias.size());
  fill(q), fill(k), fill(v), fill(bias), fill(dout);
  const long rss_inputs = peak_rss_kb();

  dmattn::Inputs in{TensorView::contiguous(q.data(), DType::kFloat32, {kB, S, kH, kD}),
                    TensorView::contiguous(k.data(), DType::kFloat32, {kB, S, kHk, kD}),
                    TensorView::contiguous(v.data(), DType::kFloat32, {kB, S, kHk, kD}),
                    std::nullopt,
                    TensorView::contiguous(bias.data(), DType::kFloat32, {kB, kHk, 1, S})};
  const TensorView o = TensorView::contiguous(out.data(), DType::kFloat32, {kB, S, kH, kD});
  const TensorView l = TensorView::contiguous(lse.data(), DType::kFloat32, {kB, kH, S});
  const dmattn::Gradients g{TensorView::contiguous(dq.data(), DType::kFloat32, {kB, S, kH, kD}),
                            TensorView::contiguous(dk.data(), DType::kFloat32, {kB, S, kHk, kD}),
                            TensorView::contiguous(dv.data(), DType::kFloat32, {kB, S, kHk, kD}),
                            TensorView::contiguous(dbias.data(), DType::kFloat32, {kB, kHk, 1, S})};
  dmattn::Options opt;
  opt.causal = true;
  if (c.keep > 0) opt.keep_window_size = c.keep;

  double fwd = 1e30, bwd = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    dmattn::forward(in, o, l, opt);
    fwd = std::min(fwd, seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    dmattn::backward(in, o, TensorView::contiguous(dout.data(), DType::kFloat32, {kB, S, kH, kD}), l, g, opt);
    bwd = std::min(bwd, seconds_since(t0));
  }
  // Dense-equivalent causal FLOPs: 4 * B * H * D * S^2 / 2 forward.
  const double allowed = c.keep > 0 ? std::min<double>(c.keep, S) * S - 0.5 * std::min<double>(c.keep, S) * std::min<double>(c.keep, S)
                                    : 0.5 * S * S;
  const double gflop = 4.0 * kB * kH * kD * allowed / 1e9;
  const long extra_kb = peak_rss_kb() - rss_inputs;
  std::printf("| %-22s | %6lld | %9.1f | %9.1f | %8.1f | %14.1f | %23.1f |\n", c.name, static_cast<long long>(S),
              fwd * 1e3, bwd * 1e3, gflop / fwd, extra_kb / 1024.0,
              4.0 * kB * kH * S * S / (1024.0 * 1024.0));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::int64_t> lengths;
  for (int a = 1; a < argc; ++a) lengths.push_back(std::atoll(argv[a]));
  if (lengths.empty()) lengths.push_back(2048);
  const Case cases[] = {{"causal + key-only bias", 0}, {"  + keep_window_size=256", 256}};
  std::printf("dmattn CPU benchmark: B=%lld H=%lld Hk=%lld D=%lld float32, threads=%s, best of 3\n",
              static_cast<long long>(kB), static_cast<long long>(kH), static_cast<long long>(kHk),
              static_cast<long long>(kD), std::getenv("DMATTN_NUM_THREADS") ? std::getenv("DMATTN_NUM_THREADS") : "all");
  std::printf("| case                   |      S |  fwd (ms) |  bwd (ms) | fwd GFLOP/s | peak extra (MiB) | one fp32 (H,S,S) (MiB) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  for (std::int64_t S : lengths) {
    for (const Case& c : cases) {
      const pid_t pid = fork();
      if (pid == 0) {
        run_case(c, S, 3);
        std::_Exit(0);
      }
      int status = 0;
      waitpid(pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return 1;
    }
  }
  return 0;
}
