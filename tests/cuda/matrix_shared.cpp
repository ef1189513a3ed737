// What the forward and backward check matrices share: tags, the broadcast
// shapes of a mask or bias, the top-k and varlen settings, the given-
// selection cases, the bias magnitude sweep, the head dim 64 copies and the
// Hopper mask cases (declared in check.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "device.h"

namespace dmattn_gpu_test {

std::string dtype_tag(DType d) { return d == DType::kBFloat16 ? "bf16" : d == DType::kFloat16 ? "fp16" : "f32"; }

// Every broadcast shape of a mask/bias of (B, H, Sq, Sk) with kv heads Hk.
std::vector<Shape> broadcast_shapes(std::int64_t B, std::int64_t H, std::int64_t Hk, std::int64_t Sq, std::int64_t Sk) {
  std::vector<Shape> shapes;
  for (std::int64_t b : {B, std::int64_t{1}})
    for (std::int64_t h : {H, Hk, std::int64_t{1}})
      for (std::int64_t r : {Sq, std::int64_t{1}})
        for (std::int64_t k : {Sk, std::int64_t{1}}) shapes.push_back({b, h, r, k});
  return shapes;
}

// Top-k settings shared by the forward and the backward matrices (case i of a
// kind; sizes and heads are the caller's). Per-row biases (thresholds): bias
// heads Hk / H, a float32 bias (i = 2), permuted (i = 1), a mask from i = 2.
void topk_per_row(Case& c, int i) {
  c.options.causal = i != 1;
  c.options.keep_window_size = i == 3 ? 1 : 100;
  c.bias_shape = {c.B, i % 2 ? c.H : c.Hk, c.Sq, c.Sk};
  c.bias_dtype = i == 2 ? DType::kFloat32 : c.dtype;
  c.bias_layout.permuted = i == 1;
  if (i >= 2) c.mask_shape = {1, i == 2 ? c.H : 1, c.Sq, c.Sk}, c.mask_density = 0.5;
}
// A key padding mask (folded into the intervals) of one head (i = 0) or H.
void topk_padding(Case& c, int i) {
  c.options.causal = true;
  c.options.keep_window_size = 128;
  c.mask_pattern = Case::MaskPattern::kKeyPadding;
  c.mask_shape = {c.B, i ? c.H : 1, 1, c.Sk};
  c.bias_shape = {c.B, c.Hk, 1, c.Sk};
}
// Varlen with a key-only bias of (total_k, Hb): intervals (i = 0) or, with a
// left window, thresholds (i = 1).
void topk_varlen(Case& c, int i) {
  c.seqlens_q = {1, 300, 0, 130}, c.seqlens_k = {7, 500, 5, 130};
  c.bias_shape = {642, i ? c.H : 1};
  c.options.causal = true;
  c.options.keep_window_size = 50;
  if (i) c.options.sliding_window = {80, 0};
}

// Varlen on the Hopper kernels (D = 64 or 128, the caller's; more than 64
// query rows): lengths off the tiles, an empty sequence, one of a single row
// without keys, sq < sk and sq > sk; a key-only bias of (total_k, Hb), Hb by
// i: causal, bias of one head (i = 0); window (50, 20), Hk heads (i = 1);
// causal top-k 64 (intervals: the dk/dv key groups), H heads (i = 2).
void hopper_varlen(Case& c, int i) {
  c.seqlens_q = {300, 0, 129, 1, 65}, c.seqlens_k = {300, 7, 200, 0, 130};
  c.bias_shape = {637, i == 0 ? 1 : i == 1 ? c.Hk : c.H};
  c.options.causal = i != 1;
  if (i == 1) c.options.sliding_window = {50, 20};
  if (i == 2) c.options.keep_window_size = 64;
}

// Calls given their top-k selection (Case::given_intervals), forward and
// backward alike, named by what they cover: a key-only bias of Hk heads, causal
// (key lists, key groups); a padding mask of H heads (H selection heads);
// varlen; 1 and 8 query rows (the selection given is intervals however few the
// rows); w >= Sk (applied, not dropped); a right window, not causal, ties; more
// than one 1024-row segment (keys cut into pieces); the Hopper dk/dv kernel's
// key groups (bf16, D = 128, one batch entry, no mask).
std::vector<Case> given_interval_cases() {
  std::vector<Case> cases;
  const auto add = [&](const char* what, std::int64_t sq, std::int64_t sk, DType dtype, std::int64_t w) {
    Case c;
    c.name = what;
    c.dtype = c.bias_dtype = dtype;
    c.B = 2, c.Sq = sq, c.Sk = sk, c.H = 8, c.Hk = 2;
    c.options.causal = true;
    c.options.keep_window_size = w;
    c.bias_shape = {c.B, c.Hk, 1, c.Sk};
    c.given_intervals = true;
    cases.push_back(c);
    return &cases.back();
  };
  add("key-only bias", 1000, 1000, DType::kBFloat16, 100);
  topk_padding(*add("padding mask heads H", 700, 900, DType::kFloat16, 128), 1);
  topk_varlen(*add("varlen", 1, 1, DType::kBFloat16, 50), 0);
  add("one row", 1, 3000, DType::kFloat16, 200);
  add("eight rows", 8, 2000, DType::kBFloat16, 300);
  add("w>=Sk", 650, 777, DType::kFloat16, 5000);
  Case* r = add("right window 30 not causal, four bias values (ties)", 650, 777, DType::kBFloat16, 50);
  r->options.causal = false, r->options.sliding_window = {-1, 30};
  r->bias_lo = 0.0, r->bias_hi = 4.0, r->bias_quantum = 1.0;
  add("pieces", 3000, 2500, DType::kFloat16, 256);
  Case* h = add("Hopper key groups", 2048, 2048, DType::kBFloat16, 256);
  h->B = 1, h->H = 4, h->bias_shape = {1, h->Hk, 1, h->Sk};
  return cases;
}

// The bias magnitude sweep (SPEC 2 and 5), forward and backward alike:
// magnitudes (ordinary; -1e30; the bias dtype's lowest; -inf exclusions, with
// every fourth bias row wholly -inf; -1e30 and lowest mixed; all of them mixed
// with ordinary values) x every broadcast shape of the bias x top-k off / on
// (w = 7: per-key intervals for query-broadcast biases, per-row thresholds
// otherwise) x fp16 / bf16 q, the bias in q's dtype on even shapes and float32
// on odd ones, causal on every other shape. 40 queries over 600 keys in 8
// (b, h) slices: few CTAs, so the forward splits the keys (split-KV), whose
// merge once lost the sums of huge tied logits.
std::vector<Case> bias_magnitude_sweep(const std::string& prefix) {
  const double ordinary = std::numeric_limits<double>::quiet_NaN();
  struct Magnitude {
    const char* name;
    std::vector<double> mix;  // kLowest: the bias dtype's lowest value
    bool excluded_rows;
  };
  constexpr double kLowest = -1.0;
  const Magnitude magnitudes[] = {{"ordinary", {}, false},
                                  {"-1e30", {-1e30}, false},
                                  {"lowest", {kLowest}, false},
                                  {"-inf", {-kInf, ordinary}, true},
                                  {"-1e30+lowest", {-1e30, kLowest}, false},
                                  {"mixed", {ordinary, -1e30, kLowest, -kInf}, false}};
  std::vector<Case> cases;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16})
    for (const Magnitude& m : magnitudes)
      for (std::int64_t w : {0, 7}) {
        int form = 0;
        for (const Shape& shape : broadcast_shapes(2, 4, 2, 40, 600)) {
          Case c;
          c.dtype = dtype;
          c.B = 2, c.H = 4, c.Hk = 2, c.Sq = 40, c.Sk = 600;
          c.bias_shape = shape;
          c.bias_dtype = form % 2 == 0 ? dtype : DType::kFloat32;
          c.bias_mix = m.mix;
          for (double& x : c.bias_mix)
            if (x == kLowest) x = dmattn_test::lowest(c.bias_dtype);
          c.excluded_rows = m.excluded_rows;
          c.options.causal = form % 2 == 0;
          if (w > 0) c.options.keep_window_size = w;
          c.name = prefix + "bias magnitude " + m.name + (w > 0 ? " top-k 7 " : " ") + dtype_tag(dtype) +
                   " B2 Sq40 Sk600 H4/2 bias " + dtype_tag(c.bias_dtype) + " " + dmattn_test::shape_str(shape) +
                   (c.options.causal ? " causal" : "");
          cases.push_back(c);
          ++form;
        }
      }
  return cases;
}

// Head dim 64 has its own instantiation in the default build: every third case
// of a matrix (head dim 128) again at D = 64.
void add_head_dim_64(std::vector<Case>& cases) {
  const std::size_t n = cases.size();
  for (std::size_t i = 0; i < n; i += 3) {
    if (cases[i].D != 128) continue;
    Case c = cases[i];
    c.D = 64;
    const std::size_t at = c.name.find(" D128");
    c.name = at == std::string::npos ? c.name + " D64" : c.name.replace(at, 5, " D64");
    cases.push_back(c);
  }
}

// The Hopper kernels' masks: random (partial tiles), sparse (fully masked
// rows), bands (empty tiles), key padding of (B, Hk, Sq, Sk) (full, empty and
// one partial tile a block) and of (B, 1, 1, Sk) (broadcast over rows), a mask
// broadcast over keys (rows with no allowed key), causal bands off the diagonal
// (Sq < Sk; Sq > Sk with a window) with whole tiles outside them; a key-only
// bias (dbias in the backward), causal or a window. Fewer than 8 key tiles of
// 64: no split-KV.
Case hopper_mask_case(Case c, std::int64_t d, int variant) {
  c.B = 2, c.H = 4, c.Hk = 2, c.D = d;
  c.Sq = variant % 2 ? 300 : 260, c.Sk = variant % 2 ? 440 : 260;
  c.bias_dtype = c.dtype;
  switch (variant) {
    case 0: c.mask_shape = {1, c.H, c.Sq, c.Sk}, c.mask_density = 0.5, c.options.causal = true; break;
    case 1: c.mask_shape = {c.B, 1, c.Sq, c.Sk}, c.mask_density = 0.01; break;
    case 2:
      c.mask_pattern = Case::MaskPattern::kBands, c.mask_shape = {c.B, c.Hk, c.Sq, c.Sk};
      c.options.sliding_window = {100, 20};
      break;
    case 3: c.mask_pattern = Case::MaskPattern::kKeyPadding, c.mask_shape = {c.B, c.Hk, c.Sq, c.Sk}; break;
    case 4:
      c.mask_pattern = Case::MaskPattern::kKeyPadding, c.mask_shape = {c.B, 1, 1, c.Sk};
      c.options.causal = true;
      break;
    case 5: c.mask_shape = {c.B, c.H, c.Sq, 1}, c.mask_density = 0.6; break;
    // Causal with the band off the diagonal: whole mask tiles outside it (their
    // bits set) that the mask pass leaves unread, 128-row tiles past a
    // sequence's last keys (Sq < Sk) and before its first (Sq > Sk, a window).
    case 6:
      c.Sq = 300, c.Sk = 440, c.options.causal = true;
      c.mask_shape = {c.B, c.H, c.Sq, c.Sk}, c.mask_density = 0.6;
      break;
    default:
      c.Sq = 700, c.Sk = 330, c.options.causal = true, c.options.sliding_window = {100, 0};
      c.mask_shape = {1, c.Hk, c.Sq, c.Sk}, c.mask_density = 0.8;
      break;
  }
  const Shape key_bias[3] = {{1, c.Hk, 1, c.Sk}, {c.B, c.H, 1, c.Sk}, {}};
  c.bias_shape = key_bias[variant % 3];
  c.name = "Hopper mask " + std::to_string(variant) + " " + dmattn_test::shape_str(c.mask_shape);
  return c;
}

}  // namespace dmattn_gpu_test
