// The forward check matrix: sizes, dtypes, head dims, GQA, mask and bias
// broadcasts and layouts, options, top-k, varlen, the bias magnitude sweep.
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

// The Hopper forward's key-list walk (top-k, a mask, or both), GQA (4 or 8
// query heads over 2 kv heads), rows x keys given (sizes with fewer than 8 key
// tiles of 64 or a grid of at least 132 CTAs: no split-KV): intervals, causal,
// w above the first blocks' keys (their lists are runs of consecutive keys,
// loaded by TMA; later ones gathered) (0); thresholds with a random mask of
// rows (1); thresholds from a left window, a float32 bias (2); intervals, not
// causal, w = 20 (scattered keys, every tile gathered) (3); varlen
// (hopper_varlen 1: a window, a key-only bias of Hk heads) with thresholds (4).
constexpr int kHopperTopkVariants = 5;
Case hopper_topk_case(Case c, std::int64_t d, int variant, std::int64_t sq, std::int64_t sk) {
  c.B = 2, c.Hk = 2, c.D = d;
  c.Sq = sq, c.Sk = sk;
  c.bias_dtype = variant == 2 ? DType::kFloat32 : c.dtype;
  c.bias_shape = {variant == 1 ? c.B : 1, variant == 1 ? c.H : c.Hk, 1, c.Sk};
  c.options.causal = variant != 3;
  c.options.keep_window_size = variant == 0 ? 200 : variant == 3 ? 20 : 60;
  if (variant == 1) c.mask_shape = {c.B, 1, c.Sq, c.Sk}, c.mask_density = 0.5;
  if (variant == 2) c.options.sliding_window = {150, 0};
  if (variant == 4) hopper_varlen(c, 1), c.Sq = c.Sk = 1, c.options.keep_window_size = 40;
  const char* what[] = {"intervals", "thresholds + mask", "thresholds window", "intervals scattered",
                        "varlen thresholds"};
  c.name = std::string("Hopper top-k ") + what[variant];
  return c;
}

std::vector<Case> forward_matrix(bool small) {
  std::vector<Case> cases;
  const std::int64_t heads[3][2] = {{8, 2}, {4, 4}, {8, 1}};
  int n = 0;
  auto base = [&](std::int64_t sq, std::int64_t sk, DType dt) {
    Case c;
    c.dtype = dt, c.bias_dtype = dt;
    c.Sq = sq, c.Sk = sk;
    c.B = 1 + n % 2;
    c.H = heads[n % 3][0], c.Hk = heads[n % 3][1];
    ++n;
    return c;
  };
  auto name = [](const Case& c, const std::string& what) {
    auto list = [](const std::vector<std::int64_t>& v) {
      std::string s;
      for (auto x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
      return "[" + s + "]";
    };
    const std::string sizes = c.varlen() ? " seqlens q" + list(c.seqlens_q) + " k" + list(c.seqlens_k)
                                         : " B" + std::to_string(c.B) + " Sq" + std::to_string(c.Sq) + " Sk" +
                                               std::to_string(c.Sk);
    return what + " " + dtype_tag(c.dtype) + sizes + " H" + std::to_string(c.H) + "/" + std::to_string(c.Hk) + " D" +
           std::to_string(c.D) + (c.options.causal ? " causal" : "");
  };
  auto num = [](double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", x);
    return std::string(buf);
  };
  if (small) {
    for (bool causal : {false, true}) {
      Case c = base(65, 127, DType::kBFloat16);
      c.options.causal = causal;
      c.mask_shape = {c.B, 1, c.Sq, c.Sk};
      c.bias_shape = {1, c.Hk, 1, c.Sk};
      c.qkv_layout.sliced = causal;
      c.name = name(c, "small mask+bias");
      cases.push_back(c);
    }
    Case m = base(300, 300, DType::kBFloat16);
    m.mask_pattern = Case::MaskPattern::kBands;
    m.mask_shape = {1, m.Hk, m.Sq, m.Sk};
    m.options.causal = true;
    m.name = name(m, "small mask bands");
    cases.push_back(m);
    Case dec = base(2, 600, DType::kBFloat16);
    dec.options.causal = true;
    dec.bias_shape = {1, dec.Hk, 1, dec.Sk};
    dec.name = name(dec, "small decode (split-KV)");
    cases.push_back(dec);
    Case few;  // the key-split tile: a warp whose keys no row sees (not from base: the later cases keep their heads)
    few.dtype = few.bias_dtype = DType::kFloat16;
    few.Sq = 5, few.Sk = 37, few.B = 2, few.H = 8, few.Hk = 2;
    few.options.causal = true;
    few.bias_shape = {1, few.Hk, 1, few.Sk};
    few.name = name(few, "small decode, few keys");
    cases.push_back(few);
    Case v = base(1, 1, DType::kFloat16);
    v.seqlens_q = {5, 70}, v.seqlens_k = {9, 130};
    v.bias_shape = {139, v.Hk};
    v.options.causal = true;
    v.name = name(v, "small varlen");
    cases.push_back(v);
    for (bool per_row : {false, true}) {  // top-k: per-key intervals, per-row thresholds with a mask
      Case t = base(200, 300, DType::kBFloat16);
      t.options.causal = true;
      t.options.keep_window_size = 40;
      t.bias_shape = per_row ? Shape{t.B, t.Hk, t.Sq, t.Sk} : Shape{1, t.Hk, 1, t.Sk};
      if (per_row) t.mask_shape = {t.B, 1, t.Sq, t.Sk};
      t.name = name(t, per_row ? "small top-k 40 per-row bias + mask" : "small top-k 40 key-only bias");
      cases.push_back(t);
    }
    Case td = base(1, 5000, DType::kBFloat16);  // top-k decode: chunked search and lists, heads folded
    td.B = 2, td.H = 8, td.Hk = 2;
    td.options.causal = true;
    td.options.keep_window_size = 300;
    td.bias_shape = {td.B, td.Hk, 1, td.Sk};
    td.name = name(td, "small top-k decode 300");
    cases.push_back(td);
    add_head_dim_64(cases);
    // The Hopper forward: a partial query block and key tile, causal offset; D = 96,
    // 40 and 160 padded (to 128, 64 and 192) with TMA's zeros; 192 and 256
    // where DMATTN_HEAD_DIMS compiles them (check() skips the others).
    for (std::int64_t d : {128, 64, 96, 40, 256, 160}) {
      Case h = base(200, 300, d == 96 ? DType::kFloat16 : DType::kBFloat16);
      h.B = 1, h.H = 4, h.Hk = 2, h.D = d;
      h.options.causal = true;
      h.bias_shape = {1, h.Hk, 1, h.Sk};
      h.name = name(h, "small Hopper key-only bias");
      cases.push_back(h);
      Case v = base(1, 1, DType::kBFloat16);  // the Hopper forward over packed sequences
      v.H = 4, v.Hk = 2, v.D = d;
      hopper_varlen(v, d == 128 ? 0 : 1);
      v.name = name(v, "small Hopper varlen");
      cases.push_back(v);
      for (int variant : {0, 3}) {
        Case m = hopper_mask_case(base(0, 0, DType::kBFloat16), d, variant);
        m.name = name(m, "small " + m.name);
        cases.push_back(m);
      }
      Case f = base(200, 264, DType::kBFloat16);  // a full bias by tiles (Sk % 8 == 0: TMA rows)
      f.B = 2, f.H = 4, f.Hk = 2, f.D = d;
      f.options.causal = d != 64;
      f.bias_shape = {f.B, f.Hk, f.Sq, f.Sk};
      f.name = name(f, "small Hopper full bias tiles");
      cases.push_back(f);
      Case t = base(0, 0, d == 96 ? DType::kFloat16 : DType::kBFloat16);
      t.H = 4;
      t = hopper_topk_case(t, d, d == 128 || d == 256 ? 0 : d == 64 ? 1 : d == 96 ? 3 : d == 160 ? 2 : 4, 260, 300);
      t.name = name(t, "small " + t.name);
      cases.push_back(t);
    }
    // The persistent Hopper forward with CTAs that walk two blocks (160 blocks
    // on 132 SMs) under the sanitizers, its producer staging a key-only bias.
    Case pc = base(130, 130, DType::kBFloat16);
    pc.B = 5, pc.H = 16, pc.Hk = 4, pc.D = 128;
    pc.options.causal = true;
    pc.bias_shape = {pc.B, pc.Hk, 1, pc.Sk};
    pc.name = name(pc, "small Hopper persistent");
    cases.push_back(pc);
    return cases;
  }
  // Sizes: awkward lengths, both dtypes, causal or not.
  const std::int64_t sizes[][2] = {{1, 1},   {1, 7},    {7, 1},     {7, 7},     {63, 65},   {65, 63},
                                   {127, 127}, {1, 1000}, {63, 1000}, {1000, 63}, {1000, 1000}, {127, 4095}};
  for (auto& s : sizes)
    for (DType dt : {DType::kBFloat16, DType::kFloat16})
      for (bool causal : {false, true}) {
        Case c = base(s[0], s[1], dt);
        c.options.causal = causal;
        c.name = name(c, "sizes");
        cases.push_back(c);
      }
  // Head dims below the compiled one are zero-padded.
  for (std::int64_t d : {8, 32, 64, 72, 120})
    for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
      Case c = base(65, 130, dt);
      c.D = d;
      c.options.causal = d % 16 == 0;
      c.name = name(c, "head_dim");
      cases.push_back(c);
    }
  // Every broadcast form of the mask and of the bias, in every layout.
  int form = 0;
  for (const Shape& s : broadcast_shapes(2, 8, 2, 65, 127)) {
    Case c = base(65, 127, form % 2 ? DType::kFloat16 : DType::kBFloat16);
    c.B = 2, c.H = 8, c.Hk = 2;
    c.mask_shape = s;
    c.mask_layout.sliced = form % 3 == 1;
    c.mask_layout.permuted = form % 3 == 2;
    if (form % 4 == 3) {  // the full shape, broadcast dims as stride-0 views
      const Shape full = {2, 8, 65, 127};
      for (int d = 0; d < 4; ++d) c.mask_layout.expanded[d] = s[d] == 1, c.mask_shape[d] = full[d];
    }
    c.options.causal = form % 2 == 0;
    c.name = name(c, "mask " + dmattn_test::shape_str(s) + " " + dmattn_test::layout_str(c.mask_layout));
    cases.push_back(c);
    Case b = c;
    b.mask_shape.clear();
    b.bias_shape = c.mask_shape;
    b.bias_dtype = form % 2 ? DType::kFloat32 : b.dtype;
    b.bias_layout = c.mask_layout;
    b.name = name(b, "bias " + dtype_tag(b.bias_dtype) + " " + dmattn_test::shape_str(s) + " " +
                         dmattn_test::layout_str(b.bias_layout));
    cases.push_back(b);
    ++form;
  }
  // Mask and bias together, sparse masks (fully masked rows), extreme biases.
  for (double density : {0.9, 0.3, 0.02}) {
    Case c = base(127, 200, DType::kBFloat16);
    c.mask_shape = {c.B, c.H, c.Sq, c.Sk};
    c.bias_shape = {c.B, c.Hk, c.Sq, c.Sk};
    c.mask_density = density;
    c.name = name(c, "mask+bias density " + num(density));
    cases.push_back(c);
  }
  // Structured masks: empty tiles are skipped, full tiles skip the mask work.
  for (int variant = 0; variant < 6; ++variant) {
    Case c = base(1000, variant < 3 ? 1000 : 777, variant % 2 ? DType::kFloat16 : DType::kBFloat16);
    c.B = 2, c.H = 4, c.Hk = 2;
    const bool bands = variant % 3 != 2;
    c.mask_pattern = bands ? Case::MaskPattern::kBands : Case::MaskPattern::kKeyPadding;
    c.mask_shape = bands ? Shape{variant == 1 ? 1 : c.B, c.Hk, c.Sq, c.Sk} : Shape{c.B, 1, 1, c.Sk};
    c.options.causal = variant % 2 == 0;
    if (variant == 4) c.options.sliding_window = {300, 0};
    c.bias_shape = variant == 3 ? Shape{1, c.H, 1, c.Sk} : Shape{};
    c.name = name(c, std::string(bands ? "mask bands " : "mask key padding ") + dmattn_test::shape_str(c.mask_shape));
    cases.push_back(c);
  }
  for (double lo : {-1e30, -3e38}) {
    Case c = base(65, 100, DType::kBFloat16);
    c.bias_shape = {1, 1, c.Sq, c.Sk};
    c.bias_dtype = DType::kFloat32;
    c.bias_lo = lo, c.bias_hi = lo * 0.5;
    c.name = name(c, "huge negative bias " + num(lo));
    cases.push_back(c);
  }
  for (Case& c : bias_magnitude_sweep("")) cases.push_back(c);
  // The Hopper forward's full-bias tiles (a bias of q's dtype whose rows TMA
  // addresses: Sk % 8 == 0): each head and batch broadcast, partial query
  // blocks and key tiles, causal or not, a window, softcap, -inf rows and the
  // dtype's lowest; a sliced (misaligned) one takes the sm80 kernel.
  for (std::int64_t d : {128, 64, 192, 256})
    for (int variant = 0; variant < 8; ++variant) {
      Case c = base(variant % 2 ? 300 : 129, variant % 3 ? 264 : 520, variant % 2 ? DType::kFloat16 : DType::kBFloat16);
      c.B = 2, c.H = 4, c.Hk = 2, c.D = d;
      const Shape forms[] = {{c.B, c.H, c.Sq, c.Sk}, {1, c.Hk, c.Sq, c.Sk}, {c.B, 1, c.Sq, c.Sk}, {1, 1, c.Sq, c.Sk}};
      c.bias_shape = forms[variant % 4];
      c.options.causal = variant % 4 != 1;
      if (variant == 3) c.options.sliding_window = {100, 0};
      if (variant == 4) c.options.softcap = 30.0, c.options.scale = 0.3;
      if (variant == 5) c.bias_mix = {-kInf, std::numeric_limits<double>::quiet_NaN()}, c.excluded_rows = true;
      if (variant == 6) c.bias_mix = {dmattn_test::lowest(c.bias_dtype)};
      if (variant == 7) c.bias_layout.sliced = true;
      c.name = name(c, "Hopper full bias tiles #" + std::to_string(variant));
      cases.push_back(c);
    }
  // Options: sliding windows, softcap, scale, with Sq != Sk both ways.
  const std::int64_t windows[][2] = {{16, 0}, {0, 16}, {30, -1}, {-1, 5}, {100, 100}, {0, 0}};
  int w = 0;
  for (auto& win : windows)
    for (auto& s : {std::array<std::int64_t, 2>{65, 300}, std::array<std::int64_t, 2>{300, 65}}) {
      Case c = base(s[0], s[1], w % 2 ? DType::kFloat16 : DType::kBFloat16);
      c.options.sliding_window = {win[0], win[1]};
      c.options.causal = w % 3 == 0;
      c.bias_shape = w % 2 ? Shape{} : Shape{1, c.H, 1, c.Sk};
      c.name = name(c, "window (" + std::to_string(win[0]) + "," + std::to_string(win[1]) + ")");
      cases.push_back(c);
      ++w;
    }
  for (double cap : {5.0, 30.0})
    for (bool causal : {false, true}) {
      Case c = base(100, 257, DType::kBFloat16);
      c.options.softcap = cap;
      c.options.scale = 0.3;
      c.options.causal = causal;
      c.bias_shape = {c.B, 1, c.Sq, c.Sk};
      c.name = name(c, "softcap " + num(cap) + " scale 0.3");
      cases.push_back(c);
    }
  // Layouts of q, k, v and out: sliced (misaligned, the scalar path) and permuted.
  for (int l = 0; l < 4; ++l) {
    Case c = base(130, 190, l % 2 ? DType::kFloat16 : DType::kBFloat16);
    c.qkv_layout.sliced = l & 1;
    c.qkv_layout.permuted = l & 2;
    c.out_layout = c.qkv_layout;
    c.options.causal = true;
    c.mask_shape = {1, 1, 1, c.Sk};
    c.name = name(c, "layout " + dmattn_test::layout_str(c.qkv_layout));
    cases.push_back(c);
  }
  // Varlen with a key-only bias of every head count and both dtypes.
  const std::vector<std::vector<std::int64_t>> seqs_q = {{1, 65, 0, 130}, {200}, {7, 7, 7}, {128, 1, 300}};
  const std::vector<std::vector<std::int64_t>> seqs_k = {{7, 200, 5, 130}, {200}, {1, 63, 0}, {128, 300, 64}};
  for (std::size_t i = 0; i < seqs_q.size(); ++i)
    for (int variant = 0; variant < 2; ++variant) {
      Case c = base(1, 1, variant ? DType::kFloat16 : DType::kBFloat16);
      c.seqlens_q = seqs_q[i], c.seqlens_k = seqs_k[i];
      std::int64_t total_k = 0;
      for (auto s : c.seqlens_k) total_k += s;
      const std::int64_t hb[3] = {1, c.Hk, c.H};
      c.bias_shape = {total_k, hb[(i + variant) % 3]};
      c.bias_dtype = variant ? DType::kFloat32 : c.dtype;
      c.bias_layout.sliced = variant;
      c.options.causal = i % 2 == 0;
      if (i == 3) c.options.sliding_window = {40, variant ? 0 : 10};
      c.name = name(c, "varlen #" + std::to_string(i) + " bias heads " + std::to_string(c.bias_shape[1]));
      cases.push_back(c);
    }
  // Varlen on the Hopper forward, every head dim and both dtypes.
  for (std::int64_t d : {128, 64, 192, 256})
    for (int i = 0; i < 3; ++i) {
      Case c = base(1, 1, i % 2 ? DType::kFloat16 : DType::kBFloat16);
      c.H = 8, c.Hk = 2, c.D = d;
      c.bias_dtype = i == 1 ? DType::kFloat32 : c.dtype;
      hopper_varlen(c, i);
      c.name = name(c, "Hopper varlen #" + std::to_string(i));
      cases.push_back(c);
    }
  // Long: Sq = Sk = 4095 with a key-only bias (a grid of 256 CTAs: no key split),
  // and a windowed 1000 x 4095 (a small grid: split-KV).
  {
    Case c = base(4095, 4095, DType::kBFloat16);
    c.B = 1, c.H = 8, c.Hk = 2;
    c.options.causal = true;
    c.bias_shape = {1, c.Hk, 1, c.Sk};
    c.name = name(c, "long key-only bias");
    cases.push_back(c);
    Case w2 = base(1000, 4095, DType::kFloat16);
    w2.B = 1, w2.H = 2, w2.Hk = 1;
    w2.options.sliding_window = {300, 20};
    w2.mask_shape = {1, 1, w2.Sq, w2.Sk};
    w2.name = name(w2, "long window+mask");
    cases.push_back(w2);
  }
  // Decode: a few query rows over many keys (split-KV and the combine step).
  const std::int64_t decode[][2] = {{1, 65537}, {16, 4095}, {7, 20000}, {3, 9000}};
  for (int i = 0; i < 4; ++i) {
    Case c = base(decode[i][0], decode[i][1], i % 2 ? DType::kFloat16 : DType::kBFloat16);
    c.B = 1 + i % 2, c.H = 8, c.Hk = 2;
    c.options.causal = i != 2;
    if (i == 0) c.bias_shape = {1, c.Hk, 1, c.Sk};
    if (i == 2) c.mask_pattern = Case::MaskPattern::kKeyPadding, c.mask_shape = {c.B, 1, 1, c.Sk};
    if (i == 3) c.options.sliding_window = {2000, 0};
    c.name = name(c, "decode");
    cases.push_back(c);
  }
  // A decode grid of more than one wave (512 CTAs, 18 key blocks): split for
  // whole waves where the GPU holds fewer CTAs at once (3 splits at 396).
  {
    Case c;  // not from base: the later cases keep their heads
    c.dtype = c.bias_dtype = DType::kBFloat16;
    c.B = 32, c.H = c.Hk = 16, c.Sq = 1, c.Sk = 1100;
    c.bias_shape = {c.B, c.Hk, 1, c.Sk};
    c.name = name(c, "decode, a grid of more than one wave");
    cases.push_back(c);
  }
  // Decode with one query row and grouped kv heads: the query heads of a kv head
  // are folded into the rows of one CTA. Per-head, per-kv-head and shared masks
  // and biases, strided q/out, MQA, no lse; a sliding window is not folded.
  const Shape decode_forms[][2] = {{{2, 8, 1, 3000}, {1, 8, 1, 3000}}, {{2, 2, 1, 3000}, {2, 1, 1, 3000}},
                                   {{1, 1, 1, 3000}, {2, 2, 1, 3000}}, {{}, {1, 8, 1, 1}}};
  for (int i = 0; i < 6; ++i) {
    Case c = base(1, 3000, i % 2 ? DType::kFloat16 : DType::kBFloat16);
    c.B = 2, c.H = 8, c.Hk = i == 4 ? 1 : 2;
    c.options.causal = i % 3 != 1;
    if (i < 4) c.mask_shape = decode_forms[i][0], c.bias_shape = decode_forms[i][1];
    if (i == 4) c.bias_shape = {2, 8, 1, 3000};
    c.bias_dtype = i % 2 ? DType::kFloat32 : c.dtype;
    c.qkv_layout.permuted = i == 1, c.out_layout.sliced = i == 2;
    c.with_lse = i != 3;
    if (i == 5) c.options.sliding_window = {700, 0};
    c.name = name(c, "decode, query heads folded" + std::string(i == 5 ? " (window: not folded)" : ""));
    cases.push_back(c);
  }
  // Key-only biases of 16-byte aligned rows, copied 16 bytes at a time with K
  // and V on the 64-row tile: folded decode and 40 causal rows, Sk a multiple
  // of 8 but not of the key tile, each bias dtype; a sliced bias (misaligned)
  // takes the register path.
  for (int i = 0; i < 4; ++i) {
    Case c = base(i == 3 ? 40 : 1, 4104, i == 1 ? DType::kFloat16 : DType::kBFloat16);
    c.B = 2, c.H = 8, c.Hk = 2;
    c.options.causal = i == 3;
    c.bias_shape = {i == 2 ? 1 : c.B, i == 3 ? 1 : c.Hk, 1, c.Sk};
    c.bias_dtype = i == 1 ? DType::kFloat32 : c.dtype;
    c.bias_layout.sliced = i == 2;
    c.name = name(c, std::string("key-only bias chunks") + (i == 2 ? " (sliced: registers)" : ""));
    cases.push_back(c);
  }
  // No lse output, without and with split-KV.
  for (std::int64_t sk : {100, 3000}) {
    Case c = base(3, sk, DType::kBFloat16);
    c.with_lse = false;
    c.options.causal = true;
    c.name = name(c, "no lse");
    cases.push_back(c);
  }
  // Empty problems: no keys (every row fully masked, with or without a mask), no queries.
  for (int variant = 0; variant < 3; ++variant) {
    Case c = base(variant == 2 ? 0 : 5, variant == 2 ? 5 : 0, DType::kBFloat16);
    if (variant == 1) c.mask_shape = {c.B, 1, c.Sq, c.Sk};
    c.name = name(c, variant == 2 ? "no queries" : variant ? "no keys, mask" : "no keys");
    cases.push_back(c);
  }
  // Top-k (keep_window_size = w) against the CPU's selection. Key-only bias:
  // per-key row intervals, the lists bounded by w + 127 keys a block (causal).
  const std::int64_t topk_sizes[][2] = {{300, 1000}, {1000, 1000}, {1000, 300}, {1, 700}, {2048, 2048}};
  for (int i = 0; i < 5; ++i)
    for (bool causal : {true, false}) {
      Case c = base(topk_sizes[i][0], topk_sizes[i][1], causal ? DType::kBFloat16 : DType::kFloat16);
      c.H = 8, c.Hk = 2;  // GQA; bias heads Hk, H or 1
      c.options.causal = causal;
      c.options.keep_window_size = i == 4 ? 256 : 64 + 13 * i;
      c.bias_shape = {i % 2 ? 1 : c.B, i % 3 == 0 ? c.Hk : i % 3 == 1 ? c.H : 1, 1, c.Sk};
      c.bias_dtype = i == 2 ? DType::kFloat32 : c.dtype;
      c.bias_layout.sliced = i == 1, c.bias_layout.permuted = i == 3;
      c.name = name(c, "top-k " + std::to_string(*c.options.keep_window_size) + " key-only bias " +
                           dmattn_test::shape_str(c.bias_shape));
      cases.push_back(c);
    }
  // Lists longer than 4096 keys (w + 127 of them past row w).
  {
    Case c = base(5000, 5000, DType::kBFloat16);
    c.B = 1, c.H = 2, c.Hk = 1;
    c.options.causal = true;
    c.options.keep_window_size = 4500;
    c.bias_shape = {1, 1, 1, c.Sk};
    c.name = name(c, "top-k 4500 key-only bias (long lists)");
    cases.push_back(c);
  }
  // w = 1 and w >= Sk; ties: a constant bias selects a sliding window (ties to
  // the larger key), a bias of four values many ties; right windows; fp32 bias.
  {
    struct TopkVariant {
      const char* what;
      std::int64_t w;
      double lo, hi;
      std::int64_t left, right;
    };
    const TopkVariant variants[] = {{"w=1", 1, -2, 2, -1, -1},          {"w>=Sk", 5000, -2, 2, -1, -1},
                                    {"w=Sk-1", 776, -2, 2, -1, -1},     {"constant bias (ties)", 100, 0.5, 0.5, -1, -1},
                                    {"right window 30", 50, -2, 2, -1, 30}, {"left window 300", 64, -2, 2, 300, -1},
                                    {"window (200,0)", 90, -2, 2, 200, 0}};
    int i = 0;
    for (const TopkVariant& t : variants) {
      Case c = base(650, 777, i % 2 ? DType::kFloat16 : DType::kBFloat16);
      c.B = 2, c.H = 4, c.Hk = 2;
      c.options.causal = t.right < 0;
      c.options.keep_window_size = t.w;
      c.options.sliding_window = {t.left, t.right};
      c.bias_shape = {c.B, c.Hk, 1, c.Sk};
      c.bias_lo = t.lo, c.bias_hi = t.hi;
      c.name = name(c, std::string("top-k ") + t.what);
      cases.push_back(c);
      ++i;
    }
    Case few = base(500, 500, DType::kBFloat16);  // four bias values: heavy ties
    few.options.causal = true;
    few.options.keep_window_size = 33;
    few.bias_shape = {1, 1, 1, few.Sk};
    few.bias_lo = 0.0, few.bias_hi = 4.0;
    few.bias_quantum = 1.0;
    few.name = name(few, "top-k 33 four bias values (ties)");
    cases.push_back(few);
  }
  // Per-row biases and masks: per-row thresholds (any bias head count).
  for (int i = 0; i < 4; ++i) {
    Case c = base(i < 2 ? 400 : 1000, i < 2 ? 1100 : 600, i % 2 ? DType::kFloat16 : DType::kBFloat16);
    c.H = 8, c.Hk = 2;
    topk_per_row(c, i);
    c.name = name(c, "top-k " + std::to_string(*c.options.keep_window_size) + " per-row bias " +
                         dmattn_test::shape_str(c.bias_shape) + (i >= 2 ? " + mask" : ""));
    cases.push_back(c);
  }
  // Top-k with a key padding mask (the mask folded into the intervals), with a
  // per-head mask, and varlen (a key-only bias of (total_k, Hb)).
  for (int i = 0; i < 2; ++i) {
    Case c = base(700, 900, DType::kBFloat16);
    c.B = 2, c.H = 8, c.Hk = 2;
    topk_padding(c, i);
    c.name = name(c, "top-k 128 key-only bias + padding mask " + dmattn_test::shape_str(c.mask_shape));
    cases.push_back(c);
  }
  for (int i = 0; i < 2; ++i) {
    Case c = base(1, 1, i ? DType::kFloat16 : DType::kBFloat16);
    topk_varlen(c, i);
    c.name = name(c, "top-k 50 varlen bias heads " + std::to_string(c.bias_shape[1]) + (i ? " window (80,0)" : ""));
    cases.push_back(c);
  }
  {
    Case c = base(1, 3000, DType::kBFloat16);  // decode with GQA: not folded under top-k
    c.B = 2, c.H = 8, c.Hk = 2;
    c.options.causal = true;
    c.options.keep_window_size = 200;
    c.bias_shape = {2, 2, 1, 3000};
    c.name = name(c, "top-k 200 decode");
    cases.push_back(c);
  }
  // Few query rows over many keys: the chunked threshold search (ties across
  // chunks: constant and four-valued biases), chunked key lists, and at Sq = 1
  // the query heads folded into rows: selection heads Hk (one threshold for the
  // G rows), H (one a row), 1 (MQA too); a key padding mask; w >= the allowed
  // keys; Sq = 3 and 16 with per-row biases.
  struct FewRows {
    const char* what;
    std::int64_t B, Sq, Sk, H, Hk, w;
    Shape bias, mask;
    double quantum, lo, hi;
  };
  const FewRows few_rows[] = {
      {"bias heads Hk", 2, 1, 20000, 8, 2, 700, {2, 2, 1, 20000}, {}, 0, -2, 2},
      {"bias heads H", 2, 1, 9000, 8, 2, 300, {2, 8, 1, 9000}, {}, 0, -2, 2},
      {"bias heads 1, four values (ties)", 1, 1, 9000, 8, 2, 64, {1, 1, 1, 9000}, {}, 1, 0, 4},
      {"MQA, constant bias (ties)", 2, 1, 10000, 8, 1, 1000, {2, 1, 1, 10000}, {}, 0, 0.5, 0.5},
      {"padding mask", 2, 1, 12000, 8, 2, 2048, {2, 2, 1, 12000}, {2, 1, 1, 12000}, 0, -2, 2},
      {"w >= allowed", 1, 1, 5000, 8, 2, 6000, {1, 2, 1, 5000}, {}, 0, -2, 2},
      {"Sq=3 per-row bias", 1, 3, 30000, 8, 2, 2048, {1, 2, 3, 30000}, {}, 0, -2, 2},
      {"Sq=16 four values (ties)", 2, 16, 7000, 4, 2, 500, {2, 2, 1, 7000}, {}, 1, 0, 4},
  };
  for (int i = 0; i < 8; ++i) {
    const FewRows& f = few_rows[i];
    Case c = base(f.Sq, f.Sk, i % 2 ? DType::kFloat16 : DType::kBFloat16);
    c.B = f.B, c.H = f.H, c.Hk = f.Hk;
    c.options.causal = i % 3 != 2;
    c.options.keep_window_size = f.w;
    c.bias_shape = f.bias;
    c.bias_dtype = i == 6 ? DType::kFloat32 : c.dtype;
    c.bias_quantum = f.quantum, c.bias_lo = f.lo, c.bias_hi = f.hi;
    if (!f.mask.empty()) c.mask_pattern = Case::MaskPattern::kKeyPadding, c.mask_shape = f.mask;
    c.name = name(c, std::string("top-k decode ") + f.what);
    cases.push_back(c);
  }
  for (Case& c : given_interval_cases()) {
    c.name = name(c, "top-k given intervals " + c.name);
    cases.push_back(c);
  }
  add_head_dim_64(cases);
  for (std::int64_t d : {128, 64, 192, 256})
    for (int variant = 0; variant < kHopperMaskVariants; ++variant) {
      Case m = hopper_mask_case(base(0, 0, variant % 2 ? DType::kFloat16 : DType::kBFloat16), d, variant);
      m.name = name(m, m.name);
      cases.push_back(m);
    }
  for (std::int64_t d : {128, 64, 192, 256})
    for (int variant = 0; variant < kHopperTopkVariants; ++variant) {
      Case t = base(0, 0, variant % 2 ? DType::kFloat16 : DType::kBFloat16);
      t.H = 8;
      t = hopper_topk_case(t, d, variant, 1100, 1100);  // 9 blocks x 8 heads x 2 = 144 CTAs
      t.name = name(t, t.name);
      cases.push_back(t);
    }
  // The Hopper forward's persistent walks (D = 128, at most 4096 keys: a CTA
  // an SM takes a query block a round): 288 blocks or more, so that each CTA
  // walks two or more one after the other, among them blocks that walk no tile
  // (a mask's bands leave whole rows of tiles empty; varlen: sequences without
  // keys, blocks past a sequence's rows): dense, a key-only bias with softcap,
  // the mask walk, a full bias by tiles, varlen with a window; and the same
  // walks of a CTA a block (more keys): a key-only bias, the mask, a full bias.
  for (int variant = 0; variant < 8; ++variant) {
    Case c = base(300, variant == 3 ? 296 : 300, variant % 2 ? DType::kFloat16 : DType::kBFloat16);
    c.B = 6, c.H = 16, c.Hk = 4, c.D = 128;
    c.options.causal = variant != 1;
    if (variant == 1) c.Sk = 700, c.bias_shape = {c.B, c.Hk, 1, c.Sk}, c.options.softcap = 30.0;
    if (variant == 2) c.mask_pattern = Case::MaskPattern::kBands, c.mask_shape = {c.B, c.Hk, c.Sq, c.Sk};
    if (variant == 3) c.bias_shape = {c.B, c.Hk, c.Sq, c.Sk};
    if (variant == 4) {
      c.seqlens_q = {300, 0, 129, 1, 65, 700, 200, 5, 300}, c.seqlens_k = {300, 7, 200, 0, 130, 700, 0, 9, 260};
      c.bias_shape = {1606, c.Hk};
      c.options.sliding_window = {200, 0};
    }
    if (variant >= 5) {
      c.B = 3, c.H = 32, c.Hk = 8, c.Sq = 129, c.Sk = variant == 7 ? 4104 : 4400;  // 192 CTAs: no key split
      if (variant == 5) c.bias_shape = {c.B, c.Hk, 1, c.Sk};
      if (variant == 6) c.mask_pattern = Case::MaskPattern::kBands, c.mask_shape = {c.B, c.Hk, c.Sq, c.Sk};
      if (variant == 7) c.bias_shape = {c.B, c.Hk, c.Sq, c.Sk};
    }
    c.name = name(c, std::string(variant < 5 ? "Hopper persistent #" : "Hopper one block a CTA #") +
                         std::to_string(variant));
    cases.push_back(c);
  }
  // The Hopper forward at D = 64 (grids of at least 132 CTAs or fewer than 8
  // key tiles: no split-KV): GQA and MQA, lengths off its 128-row and 64-key
  // tiles, a key-only bias (float32 too), softcap, a window, a causal offset,
  // permuted q, k, v and out (TMA strides), and sliced ones (the sm80 kernel).
  struct Hopper {
    const char* what;
    std::int64_t B, Sq, Sk, H, Hk;
    bool causal;
  };
  const Hopper hopper[] = {{"dense", 2, 1500, 1500, 8, 2, true},       {"key-only bias", 2, 700, 400, 8, 2, false},
                           {"softcap 30 key-only bias", 2, 300, 440, 8, 1, true}, {"window (100,0)", 3, 1000, 1000, 8, 2, true},
                           {"layout permuted", 3, 777, 777, 8, 2, true}, {"layout sliced", 3, 777, 777, 8, 2, true}};
  for (int i = 0; i < 6; ++i) {
    const Hopper& t = hopper[i];
    Case c = base(t.Sq, t.Sk, i % 2 ? DType::kFloat16 : DType::kBFloat16);
    c.B = t.B, c.H = t.H, c.Hk = t.Hk, c.D = 64;
    c.options.causal = t.causal;
    if (i == 1 || i == 2) c.bias_shape = {c.B, c.Hk, 1, c.Sk};
    if (i == 1) c.bias_dtype = DType::kFloat32;
    if (i == 2) c.options.softcap = 30.0;
    if (i == 3) c.options.sliding_window = {100, 0};
    if (i >= 4) c.qkv_layout.permuted = i == 4, c.qkv_layout.sliced = i == 5, c.out_layout = c.qkv_layout;
    c.name = name(c, std::string("Hopper ") + t.what);
    cases.push_back(c);
  }
  return cases;
}

}  // namespace dmattn_gpu_test
