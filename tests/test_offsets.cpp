// 64-bit offsets (SPEC 6): element offsets past 2^31 work. A mask and a bias
// whose batch stride exceeds 2^31 elements live in lazily zeroed allocations
// (only the touched pages become resident); the result must equal the same call
// with compact copies of them.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "dmattn/dmattn.h"

namespace {

using dmattn::DType;
using dmattn::TensorView;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

TEST(Offsets, MaskAndBiasPast2To31Elements) {
  constexpr std::int64_t B = 2, S = 37, H = 2, D = 8;
  constexpr std::int64_t kBig = (std::int64_t{1} << 31) + 5;  // batch stride in elements
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal;
  std::vector<float> q(B * S * H * D), k(q.size()), v(q.size()), out_big(q.size()), out_compact(q.size());
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = normal(rng);

  std::unique_ptr<bool, FreeDeleter> mask_big(static_cast<bool*>(std::calloc(kBig + S, sizeof(bool))));
  std::unique_ptr<float, FreeDeleter> bias_big(static_cast<float*>(std::calloc(kBig + S, sizeof(float))));
  ASSERT_TRUE(mask_big && bias_big) << "could not reserve the sparse test buffers";
  std::vector<char> mask_compact(B * S);
  std::vector<float> bias_compact(B * S);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t j = 0; j < S; ++j) {
      mask_compact[b * S + j] = mask_big.get()[b * kBig + j] = (rng() % 4) != 0;
      bias_compact[b * S + j] = bias_big.get()[b * kBig + j] = normal(rng);
    }

  dmattn::Options opt;
  opt.causal = true;
  opt.return_lse = false;
  const TensorView qv = TensorView::contiguous(q.data(), DType::kFloat32, {B, S, H, D});
  const TensorView kv = TensorView::contiguous(k.data(), DType::kFloat32, {B, S, H, D});
  const TensorView vv = TensorView::contiguous(v.data(), DType::kFloat32, {B, S, H, D});
  dmattn::forward({qv, kv, vv, TensorView::strided(mask_big.get(), DType::kBool, {B, 1, 1, S}, {kBig, 0, 0, 1}),
                   TensorView::strided(bias_big.get(), DType::kFloat32, {B, 1, 1, S}, {kBig, 0, 0, 1})},
                  TensorView::contiguous(out_big.data(), DType::kFloat32, {B, S, H, D}), std::nullopt, opt);
  dmattn::forward({qv, kv, vv, TensorView::contiguous(mask_compact.data(), DType::kBool, {B, 1, 1, S}),
                   TensorView::contiguous(bias_compact.data(), DType::kFloat32, {B, 1, 1, S})},
                  TensorView::contiguous(out_compact.data(), DType::kFloat32, {B, S, H, D}), std::nullopt, opt);
  EXPECT_EQ(0, std::memcmp(out_big.data(), out_compact.data(), out_big.size() * sizeof(float)))
      << "batch 1 read through a 2^31+ element offset differs from the compact call";
}

}  // namespace
