// Runs dmattn::forward on a tiny float32 problem and checks the output is finite.
#include <cmath>
#include <cstdio>
#include <vector>

#include <dmattn/dmattn.h>

int main() {
  constexpr std::int64_t B = 1, S = 3, H = 2, D = 4;
  std::vector<float> q(B * S * H * D), k(q.size()), v(q.size()), out(q.size(), NAN), lse(B * H * S, NAN);
  for (std::size_t i = 0; i < q.size(); ++i) {
    q[i] = 0.1f * static_cast<float>(i % 7) - 0.3f;
    k[i] = 0.2f * static_cast<float>(i % 5) - 0.4f;
    v[i] = 0.05f * static_cast<float>(i);
  }
  using dmattn::DType;
  using dmattn::TensorView;
  const dmattn::Inputs in{TensorView::contiguous(q.data(), DType::kFloat32, {B, S, H, D}),
                          TensorView::contiguous(k.data(), DType::kFloat32, {B, S, H, D}),
                          TensorView::contiguous(v.data(), DType::kFloat32, {B, S, H, D}),
                          std::nullopt, std::nullopt};
  dmattn::Options options;
  options.causal = true;
  dmattn::forward(in, TensorView::contiguous(out.data(), DType::kFloat32, {B, S, H, D}),
                  TensorView::contiguous(lse.data(), DType::kFloat32, {B, H, S}), options);
  for (float x : out)
    if (!std::isfinite(x)) {
      std::fprintf(stderr, "non-finite output\n");
      return 1;
    }
  for (float x : lse)
    if (!std::isfinite(x)) {
      std::fprintf(stderr, "non-finite lse\n");
      return 1;
    }
  std::printf("dmattn %s: forward ok\n", dmattn::build_info().version);
  return 0;
}
