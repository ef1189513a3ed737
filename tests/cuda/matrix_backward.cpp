// The backward check matrix: dq, dk, dv and dbias over the bias and mask
// broadcast forms, GQA, options, top-k (key lists, key groups, pieces,
// thresholds), varlen, head dims above 128, the deterministic pairs and the
// Hopper dk/dv kernel's walks (masks, softcap, varlen, a bias with rows).
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

#include "backward_cases.h"
#include "check.h"
#include "device.h"

namespace dmattn_gpu_test {

using namespace backward_cases;

std::vector<Case> backward_matrix(bool small) {
  std::vector<Case> cases;
  int n = 0;
  auto make = [&](const std::string& what, std::int64_t sq, std::int64_t sk, std::int64_t h, std::int64_t hk) {
    Case c;
    c.dtype = n % 2 ? DType::kFloat16 : DType::kBFloat16;
    c.bias_dtype = c.dtype;
    c.B = 1 + n % 2, c.Sq = sq, c.Sk = sk, c.H = h, c.Hk = hk;
    c.name = "bwd " + what;
    ++n;
    return c;
  };
  auto finish = [](Case c) {
    c.name += " " + dtype_tag(c.dtype) +
              (c.varlen() ? std::string(" varlen") : " B" + std::to_string(c.B) + " Sq" + std::to_string(c.Sq) + " Sk" + std::to_string(c.Sk)) +
              " H" + std::to_string(c.H) + "/" + std::to_string(c.Hk) + " D" + std::to_string(c.D) +
              (c.options.causal ? " causal" : "");
    if (!c.bias_shape.empty()) c.name += " bias " + dtype_tag(c.bias_dtype) + " " + dmattn_test::shape_str(c.bias_shape) + " " + dmattn_test::layout_str(c.bias_layout);
    if (!c.mask_shape.empty()) c.name += " mask " + dmattn_test::shape_str(c.mask_shape) + " " + dmattn_test::layout_str(c.mask_layout);
    return c;
  };
  if (small) {
    Case a = make("small", 65, 200, 4, 2);
    a.options.causal = true;
    a.bias_shape = {1, 2, 1, 200};
    a.mask_shape = {a.B, 1, 65, 200};
    cases.push_back(finish(a));
    Case b = make("small", 130, 70, 4, 1);
    b.bias_shape = {b.B, 1, 130, 70};
    b.options.softcap = 5.0;
    cases.push_back(finish(b));
    Case v = make("small", 1, 1, 4, 2);
    v.seqlens_q = {5, 70}, v.seqlens_k = {9, 130};
    v.bias_shape = {139, 1};
    v.options.causal = true;
    cases.push_back(finish(v));
    for (bool per_row : {false, true}) {  // top-k: key groups (intervals), thresholds with a mask
      Case t = make(per_row ? "small top-k 20 per-row bias + mask" : "small top-k 20", 150, 200, 4, 2);
      t.options.causal = true;
      t.options.keep_window_size = 20;
      t.bias_shape = per_row ? Shape{t.B, t.Hk, t.Sq, t.Sk} : Shape{1, t.Hk, 1, t.Sk};
      if (per_row) t.mask_shape = {t.B, 1, t.Sq, t.Sk};
      cases.push_back(finish(t));
    }
    Case pieces = make("small top-k 64 pieces", 2100, 2100, 2, 1);  // keys cut at 1024-row segments
    pieces.B = 1;
    pieces.options.causal = true;
    pieces.options.keep_window_size = 64;
    pieces.bias_shape = {1, 1, 1, pieces.Sk};
    cases.push_back(finish(pieces));
    Case given = pieces;  // the same, its selection given (the CPU's select_topk)
    given.given_intervals = true;
    given.name += " given intervals";
    cases.push_back(given);
    // Past 16 segments of 1024 rows and 4096 keys: segments of 2048 rows, 4096 entries each (key_groups.cu)
    Case compact = make("small top-k 64 compact segments", 16400, 4150, 1, 1);
    compact.B = 1;
    compact.options.causal = true;
    compact.options.keep_window_size = 64;
    compact.bias_shape = {1, 1, 1, compact.Sk};
    cases.push_back(finish(compact));
    Case gqa = make("small top-k 100 pieces mask heads H", 1500, 1300, 4, 2);  // two selection heads a kv head
    gqa.options.causal = true;
    gqa.options.keep_window_size = 100;
    gqa.mask_density = 0.7;
    gqa.mask_shape = {gqa.B, gqa.H, 1, gqa.Sk};
    gqa.bias_shape = {gqa.B, gqa.Hk, 1, gqa.Sk};
    cases.push_back(finish(gqa));
    // Past 4096 keys, count_pieces lists each segment's pieces; two selection heads a kv head.
    Case listed = make("small top-k 64 listed pieces, selection heads H", 2100, 4300, 2, 1);
    listed.B = 1;
    listed.options.causal = true;
    listed.options.keep_window_size = 64;
    listed.bias_shape = {1, listed.H, 1, listed.Sk};
    cases.push_back(finish(listed));
    // The Hopper dk/dv kernel's path (no mask, key-only bias, D = 128): a
    // partial key block, a causal offset and a window edge inside the tiles.
    Case hk = make("small key bias window", 200, 130, 4, 2);
    hk.bias_shape = {1, 2, 1, 130};
    hk.options.causal = true;
    hk.options.sliding_window = {40, 0};
    cases.push_back(finish(hk));
    Case det = a;  // the two-kernel path (the cases above take dq by atomics)
    det.options.deterministic = true;
    det.name += " deterministic";
    cases.push_back(det);
    for (std::int64_t d : {128, 64}) {  // ordered dq on the Hopper dk/dv kernel: 3 key blocks a query block
      Case o = make("small ordered dq key bias", 100, 300, 4, 2);
      o.D = d;
      o.options.deterministic = true;
      o.bias_shape = {o.B, o.Hk, 1, o.Sk};
      cases.push_back(finish(o));
      Case ow = hk;
      ow.D = d;
      ow.options.deterministic = true;
      ow.name = "bwd small ordered dq key bias window";
      cases.push_back(finish(ow));
    }
    for (Case& c : wide_head_cases(make, true)) cases.push_back(finish(c));
    add_head_dim_64(cases);
    hk.D = 64;  // the Hopper dk/dv kernel at D = 64 (its 128-query steps)
    cases.push_back(finish(hk));
    Case cap = hk;  // ... with softcap
    cap.name = "bwd small softcap 30 key bias window";
    cap.options.softcap = 30.0, cap.options.scale = 0.3;
    cases.push_back(finish(cap));
    for (std::int64_t d : {96, 40}) {  // ... at head dims padded to 128 and 64 (TMA's zeros)
      Case pad = hk;
      pad.name = "bwd small key bias window padded", pad.D = d;
      cases.push_back(finish(pad));
    }
    for (std::int64_t d : {128, 64}) {  // the Hopper dk/dv kernel over packed sequences: dense, key groups
      Case v = make("small Hopper varlen", 1, 1, 4, 2);
      v.D = d;
      hopper_varlen(v, d == 128 ? 0 : 2);
      cases.push_back(finish(v));
    }
    for (std::int64_t d : {128, 64})
      for (int variant : {0, 3}) {
        const Case m = hopper_mask_case(make("", 1, 1, 4, 2), d, variant);
        cases.push_back(finish(m));
        cases.back().name = "bwd small " + cases.back().name;
      }
    for (std::int64_t d : {128, 64})  // the walk of a bias with rows: dbias direct, summed in the CTA, slices
      for (int variant : {0, 1, 2, 6}) {
        Case r = row_bias_case(make, d, variant, 150, 200);
        r.name = "bwd small row bias";
        cases.push_back(finish(r));
      }
    // The dense sm80-class dk/dv kernel's walk (under DMATTN_PORTABLE: 64-query
    // steps over 128 or 64 keys): partial key and query blocks, Sq > Sk not
    // causal with a key bias per query head (its dbias summed a head at a
    // time), a window open on both sides without a bias, and one bias over
    // batch entries and kv heads (dbias in float32 slices).
    for (std::int64_t d : {128, 64}) {
      Case heads = make("small dense key bias per query head", 300, 170, 4, 2);
      heads.D = d;
      heads.bias_shape = {heads.B, heads.H, 1, heads.Sk};
      cases.push_back(finish(heads));
      Case window = make("small dense window both sides", 200, 260, 4, 1);
      window.D = d;
      window.options.sliding_window = {30, 20};
      cases.push_back(finish(window));
      Case shared = make("small dense one key bias, slices", 190, 190, 4, 2);
      shared.D = d, shared.B = 2;
      shared.options.causal = true;
      shared.bias_shape = {1, 1, 1, shared.Sk};
      cases.push_back(finish(shared));
    }
    Case t = make("small Hopper dbias tiles", 150, 200, 8, 2);  // the sums of 4 query heads stored by TMA
    t.B = 2, t.bias_shape = {t.B, t.Hk, t.Sq, t.Sk};
    t.options.causal = true;
    cases.push_back(finish(t));
    return cases;
  }
  // Sizes, GQA and MQA, causal or not.
  const std::int64_t sizes[][2] = {{1, 1}, {1, 7}, {7, 1}, {7, 7}, {63, 65}, {65, 63}, {127, 127}, {1000, 1000}, {1, 1000}, {5, 3000}, {1000, 63}};
  const std::int64_t heads[3][2] = {{8, 2}, {4, 4}, {8, 1}};
  for (auto& s : sizes)
    for (bool causal : {false, true}) {
      Case c = make("sizes", s[0], s[1], heads[n % 3][0], heads[n % 3][1]);
      c.options.causal = causal;
      cases.push_back(finish(c));
    }
  for (std::int64_t d : {8, 32, 64, 72, 96, 120}) {  // below 64 and 128: padded on the Hopper kernels
    Case c = make("head_dim", 65, 130, 4, 2);
    c.D = d;
    c.options.causal = true;
    c.bias_shape = {1, 2, 1, 130};
    cases.push_back(finish(c));
  }
  // Every broadcast form of the bias (dbias reductions) and of the mask, in every layout.
  int form = 0;
  for (const Shape& s : broadcast_shapes(2, 8, 2, 65, 127)) {
    Case c = bias_form_case(make, s, form);
    if (form % 4 == 3) {
      const Shape full = {2, 8, 65, 127};
      for (int d = 0; d < 4; ++d) c.bias_layout.expanded[d] = s[d] == 1, c.bias_shape[d] = full[d];
    }
    cases.push_back(finish(c));
    Case m = make("mask form", 65, 127, 8, 2);
    m.B = 2;
    m.mask_shape = s;
    m.mask_layout = c.bias_layout;
    m.mask_shape = c.bias_shape;
    m.options.causal = form % 2 == 1;
    cases.push_back(finish(m));
    ++form;
  }
  // Mask and bias together; sparse masks with fully masked rows.
  for (double density : {0.9, 0.3, 0.02}) {
    Case c = make("mask+bias density " + std::to_string(density).substr(0, 4), 127, 200, 4, 2);
    c.mask_shape = {c.B, c.H, c.Sq, c.Sk};
    c.bias_shape = {c.B, c.Hk, 1, c.Sk};
    c.mask_density = density;
    cases.push_back(finish(c));
  }
  // Structured masks (empty and full tiles), long sequences with a key-only bias.
  for (int variant = 0; variant < 2; ++variant) {
    Case c = make("mask bands", 1000, 777, 4, 2);
    c.B = 2;
    c.mask_pattern = variant ? Case::MaskPattern::kKeyPadding : Case::MaskPattern::kBands;
    c.mask_shape = variant ? Shape{c.B, 1, 1, c.Sk} : Shape{c.B, c.Hk, c.Sq, c.Sk};
    c.bias_shape = {1, c.H, 1, c.Sk};
    c.options.causal = variant == 0;
    cases.push_back(finish(c));
  }
  // Windows (a single allowed key with (0, 0)), softcap and scale, Sq != Sk both ways.
  const std::int64_t windows[][2] = {{16, 0}, {0, 16}, {30, -1}, {0, 0}};
  for (auto& w : windows)
    for (int flip = 0; flip < 2; ++flip) {
      Case c = make("window (" + std::to_string(w[0]) + "," + std::to_string(w[1]) + ")", flip ? 300 : 65, flip ? 65 : 300, 4, 2);
      c.options.sliding_window = {w[0], w[1]};
      c.options.causal = flip == 0;
      c.bias_shape = {1, c.Hk, 1, c.Sk};
      cases.push_back(finish(c));
    }
  // Long causal walks of the Hopper dk/dv kernel: many 64-query steps a head,
  // a bias shared by all heads (dbias summed over kv heads through slices).
  for (int flip = 0; flip < 2; ++flip) {
    Case c = make("long key bias", flip ? 2100 : 2047, flip ? 1500 : 2047, 4, 2);
    c.B = 1;
    c.options.causal = true;
    c.bias_shape = {1, 1, 1, c.Sk};
    cases.push_back(finish(c));
  }
  for (double cap : {5.0, 30.0}) {
    Case c = make("softcap " + std::to_string(static_cast<int>(cap)) + " scale 0.3", 100, 257, 4, 2);
    c.options.softcap = cap, c.options.scale = 0.3, c.options.causal = cap > 10;
    c.bias_shape = {c.B, 1, c.Sq, c.Sk};
    cases.push_back(finish(c));
  }
  // softcap on the Hopper dk/dv kernel's path (D = 128 and 64, no bias or a
  // key-only one), logits near the cap (scale 0.3) and partial tiles.
  for (std::int64_t d : {128, 64})
    for (double cap : {5.0, 30.0}) {
      Case c = make("softcap " + std::to_string(static_cast<int>(cap)) + " scale 0.3", 300, 257, 4, 2);
      c.D = d;
      c.options.softcap = cap, c.options.scale = 0.3, c.options.causal = cap > 10;
      if (d == 128) c.bias_shape = {1, c.Hk, 1, c.Sk};
      cases.push_back(finish(c));
    }
  // Layouts of q, k, v, out and the gradients: sliced (the scalar path) and permuted.
  for (int l = 0; l < 4; ++l) {
    Case c = make("layout", 130, 190, 4, 2);
    c.qkv_layout.sliced = l & 1, c.qkv_layout.permuted = l & 2;
    c.out_layout = c.qkv_layout;
    c.options.causal = true;
    cases.push_back(finish(c));
  }
  // Varlen with a key-only bias of every head count.
  const std::vector<std::vector<std::int64_t>> seqs_q = {{1, 65, 0, 130}, {200}, {7, 7, 7}, {128, 1, 300}};
  const std::vector<std::vector<std::int64_t>> seqs_k = {{7, 200, 5, 130}, {200}, {1, 63, 0}, {128, 300, 64}};
  for (std::size_t i = 0; i < seqs_q.size(); ++i) {
    Case c = make("varlen #" + std::to_string(i), 1, 1, 4, 2);
    c.seqlens_q = seqs_q[i], c.seqlens_k = seqs_k[i];
    std::int64_t total = 0;
    for (auto s : c.seqlens_k) total += s;
    const std::int64_t hb[3] = {1, c.Hk, c.H};
    c.bias_shape = {total, hb[i % 3]};
    c.bias_dtype = i % 2 ? DType::kFloat32 : c.dtype;
    c.bias_layout.sliced = i % 2;
    c.options.causal = i % 2 == 0;
    if (i == 3) c.options.sliding_window = {40, 10};
    cases.push_back(finish(c));
  }
  // Extreme biases: -1e30 and the dtype's lowest, constant (every key ties: the
  // float32 lse cannot hold max + log(n)) and random, with single allowed keys
  // (window (0, 0)) and fully masked rows (causal, Sq > Sk).
  const double lowest_bf16 = -3.3895313892515355e38, lowest_f32 = -3.4028234663852886e38;
  struct Extreme {
    double lo, hi;
    DType dtype;
  };
  for (const Extreme& e : {Extreme{-1e30, -1e30, DType::kFloat32}, Extreme{-1e30, -5e29, DType::kFloat32},
                           Extreme{lowest_bf16, lowest_bf16, DType::kBFloat16}, Extreme{lowest_f32, lowest_f32, DType::kFloat32},
                           Extreme{1e30, 1e30, DType::kFloat32}})
    for (int shape = 0; shape < 3; ++shape) {
      Case c = make("extreme bias " + std::to_string(e.lo).substr(0, 8), 130, 100, 4, 2);
      c.dtype = DType::kBFloat16;
      c.bias_dtype = e.dtype;
      c.bias_lo = e.lo, c.bias_hi = e.hi;
      c.bias_shape = shape == 0 ? Shape{1, 1, c.Sq, c.Sk} : Shape{c.B, c.Hk, 1, c.Sk};
      c.options.causal = shape != 1;
      if (shape == 2) c.options.sliding_window = {0, 0};
      c.name += shape == 2 ? " window (0,0)" : "";
      cases.push_back(finish(c));
    }
  {  // every row's statistics recomputed by the dq kernel, over more query blocks than the GPU has SMs
    Case c = make("extreme bias -1e30, every row recomputed, many query blocks", 520, 200, 16, 2);
    c.B = 2;
    c.dtype = DType::kBFloat16;
    c.bias_dtype = DType::kFloat32;
    c.bias_lo = c.bias_hi = -1e30;
    c.bias_shape = {c.B, c.Hk, 1, c.Sk};
    cases.push_back(finish(c));
  }
  for (Case& c : bias_magnitude_sweep("bwd ")) cases.push_back(c);
  for (Case& c : topk_backward_cases(make)) cases.push_back(finish(c));
  for (Case& c : deterministic_pairs(make)) cases.push_back(finish(c));
  for (Case& c : ordered_dq_cases(make)) cases.push_back(finish(c));
  for (Case& c : wide_head_cases(make, false)) cases.push_back(finish(c));
  add_head_dim_64(cases);
  for (std::int64_t d : {128, 64})
    for (int variant = 0; variant < kHopperMaskVariants; ++variant) {
      const Case m = hopper_mask_case(make("", 1, 1, 4, 2), d, variant);
      cases.push_back(finish(m));
      cases.back().name = "bwd " + cases.back().name;
    }
  // The Hopper dk/dv kernel at D = 64 (128-query steps): GQA and MQA, lengths
  // off its tiles, a key-only bias and its gradient (per kv head, and shared by
  // every head: summed through slices), a window, permuted q, k, v, dout and
  // the gradients, top-k key groups (cut into pieces over 1024-row segments).
  const auto hopper = [&](const std::string& what, std::int64_t sq, std::int64_t sk, std::int64_t h, std::int64_t hk) {
    Case c = make("Hopper " + what, sq, sk, h, hk);
    c.D = 64;
    return c;
  };
  Case d = hopper("dense", 1500, 1500, 8, 2);
  d.B = 2, d.options.causal = true;
  cases.push_back(finish(d));
  Case kb = hopper("key-only bias", 700, 900, 8, 2);
  kb.B = 2, kb.bias_shape = {kb.B, kb.Hk, 1, kb.Sk};
  cases.push_back(finish(kb));
  Case shared = hopper("key-only bias of one head", 2100, 1500, 8, 2);
  shared.options.causal = true, shared.bias_shape = {1, 1, 1, shared.Sk};
  cases.push_back(finish(shared));
  Case odd = hopper("odd sizes", 65, 63, 8, 1);
  odd.bias_shape = {odd.B, 1, 1, odd.Sk};
  cases.push_back(finish(odd));
  Case win = hopper("window (40,0)", 200, 130, 4, 2);
  win.options.causal = true, win.options.sliding_window = {40, 0}, win.bias_shape = {1, 2, 1, 130};
  cases.push_back(finish(win));
  Case perm = hopper("layout permuted", 777, 777, 8, 2);
  perm.options.causal = true, perm.qkv_layout.permuted = true, perm.out_layout = perm.qkv_layout;
  cases.push_back(finish(perm));
  for (std::int64_t dim : {128, 64})  // over packed sequences, dbias too
    for (int i = 0; i < 3; ++i) {
      Case v = make("Hopper varlen #" + std::to_string(i), 1, 1, 8, 2);
      v.D = dim;
      v.bias_dtype = i == 1 ? DType::kFloat32 : v.dtype;
      hopper_varlen(v, i);
      cases.push_back(finish(v));
    }
  for (std::int64_t dim : {128, 64})  // keys of rows TMA cannot address, then of 16-byte rows (a full bias by tiles)
    for (int v = 0; v < kRowBiasVariants; ++v) {
      const std::int64_t sizes[4][2] = {{300, 257}, {600, 700}, {300, 264}, {600, 520}};
      for (int tiles = 0; tiles < 2; ++tiles)
        cases.push_back(finish(row_bias_case(make, dim, v, sizes[2 * tiles + v % 2][0], sizes[2 * tiles + v % 2][1])));
    }
  // dbias by TMA tiles from the dS buffer (kBiasTiles, dbias written directly): the sums of the query heads
  // of a bias head (GQA and MQA), a window, D = 64 without sums.
  for (int v = 0; v < 4; ++v) {
    const std::int64_t sizes[4][2] = {{300, 264}, {257, 136}, {129, 520}, {200, 136}};
    Case c = make("Hopper dbias tiles", sizes[v][0], sizes[v][1], 8, v == 1 ? 1 : 2);
    c.D = v == 3 ? 64 : 128;
    c.B = v == 1 ? 1 : 2;
    c.bias_shape = v == 3 ? Shape{c.B, c.H, c.Sq, c.Sk} : Shape{c.B, c.Hk, c.Sq, c.Sk};
    c.options.causal = v != 1;
    if (v == 2) c.options.sliding_window = {70, 30};
    cases.push_back(finish(c));
  }
  Case groups = hopper("top-k 256 key groups", 2048, 2048, 4, 2);
  groups.B = 1, groups.options.causal = true, groups.options.keep_window_size = 256;
  groups.bias_shape = {1, groups.Hk, 1, groups.Sk};
  cases.push_back(finish(groups));
  return cases;
}

}  // namespace dmattn_gpu_test
