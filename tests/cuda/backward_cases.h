// The backward check matrix's case builders (matrix_backward.cpp alone includes
// this): top-k, the deterministic pairs, ordered dq, the bias forms, head dims
// above 128 and the Hopper row-bias walk, each over a `make` that gives a base case.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "check.h"

namespace dmattn_gpu_test::backward_cases {

// Top-k backward cases (keep_window_size), mirroring the forward's: key-only
// biases (intervals: dq key lists, dk/dv key groups) causal with Sq < Sk, = Sk,
// > Sk and not causal, bias heads 1 / Hk / H, bias batch 1 / B; w = 1, w >= Sk,
// w = Sk - 1; ties (constant and four-valued biases); right and left windows;
// per-row biases and masks (thresholds); key padding masks; varlen; odd sizes;
// more than one 1024-row segment (keys cut into pieces); a bias broadcast over
// keys (dbias summed over keys: contiguous key groups).
template <class Make>
std::vector<Case> topk_backward_cases(Make&& make) {
  std::vector<Case> cases;
  const std::int64_t sizes[][2] = {{300, 1000}, {1000, 1000}, {1000, 300}, {1, 700}, {65, 65}, {7, 7}, {1, 1}};
  for (int i = 0; i < 7; ++i)
    for (bool causal : {true, false}) {
      Case c = make("top-k key-only bias", sizes[i][0], sizes[i][1], 4, 2);
      c.options.causal = causal;
      c.options.keep_window_size = i >= 4 ? 3 + i : 64 + 13 * i;
      c.bias_shape = {i % 2 ? 1 : c.B, i % 3 == 0 ? c.Hk : i % 3 == 1 ? c.H : 1, 1, c.Sk};
      c.bias_dtype = i == 2 ? DType::kFloat32 : c.dtype;
      c.bias_layout.sliced = i == 1, c.bias_layout.permuted = i == 3;
      c.name += " w" + std::to_string(*c.options.keep_window_size);
      cases.push_back(c);
    }
  struct Variant {
    const char* what;
    std::int64_t w;
    double lo, hi, quantum;
    std::int64_t left, right;
  };
  const Variant variants[] = {{"w=1", 1, -2, 2, 0, -1, -1},
                              {"w>=Sk", 5000, -2, 2, 0, -1, -1},
                              {"w=Sk-1", 776, -2, 2, 0, -1, -1},
                              {"constant bias (ties)", 100, 0.5, 0.5, 0, -1, -1},
                              {"four bias values (ties)", 33, 0, 4, 1, -1, -1},
                              {"right window 30", 50, -2, 2, 0, -1, 30},
                              {"left window 300", 64, -2, 2, 0, 300, -1},
                              {"window (200,0)", 90, -2, 2, 0, 200, 0}};
  for (const Variant& t : variants) {
    // w = 1: p = 1 on the kept key and dS = p (dp - delta) is float32 rounding
    // noise (zero in float64): dbias's slack of sqrt(n) (run_backward_case).
    Case c = make(std::string("top-k ") + t.what, 650, 777, 4, 2);
    c.B = 2;
    c.options.causal = t.right < 0;
    c.options.keep_window_size = t.w;
    c.options.sliding_window = {t.left, t.right};
    c.bias_shape = {c.B, c.Hk, 1, c.Sk};
    c.bias_lo = t.lo, c.bias_hi = t.hi, c.bias_quantum = t.quantum;
    cases.push_back(c);
  }
  {  // |lse| beyond float32's reach: the dq kernel recomputes the rows' statistics over the key lists
    Case c = make("top-k 100 constant bias -1e30 (rows recomputed)", 650, 777, 4, 2);
    c.options.causal = true;
    c.options.keep_window_size = 100;
    c.bias_shape = {c.B, c.Hk, 1, c.Sk};
    c.bias_dtype = DType::kFloat32;
    c.bias_lo = c.bias_hi = -1e30;
    cases.push_back(c);
  }
  for (int i = 0; i < 4; ++i) {  // per-row biases and masks: thresholds
    Case c = make("top-k per-row bias" + std::string(i >= 2 ? " + mask" : ""), i < 2 ? 300 : 500, i < 2 ? 700 : 400, 4, 2);
    topk_per_row(c, i);
    cases.push_back(c);
  }
  for (int i = 0; i < 2; ++i) {  // key padding masks, folded into the intervals
    Case c = make("top-k 128 + padding mask", 700, 900, 4, 2);
    c.B = 2;
    topk_padding(c, i);
    cases.push_back(c);
  }
  for (int i = 0; i < 2; ++i) {  // varlen: intervals, and thresholds (left window)
    Case c = make(i ? "top-k 50 varlen window (80,0)" : "top-k 50 varlen", 1, 1, 4, 2);
    topk_varlen(c, i);
    cases.push_back(c);
  }
  // More than one 1024-row segment: keys cut into pieces whose sums add up in
  // segment order (Sq not a multiple of 1024, keys over several segments, w = 1
  // and w >= Sk, ties, not causal: every key over every segment).
  struct Pieces {
    const char* what;
    std::int64_t sq, sk, w;
    bool causal;
    double lo, hi, quantum;
  };
  const Pieces pieces[] = {{"top-k pieces", 3000, 3000, 256, true, -2, 2, 0},
                           {"top-k pieces", 2500, 2200, 100, false, -2, 2, 0},
                           {"top-k pieces w=1", 2100, 2100, 1, true, -2, 2, 0},
                           {"top-k pieces w>=Sk", 2100, 1900, 4000, true, -2, 2, 0},
                           {"top-k pieces constant bias (ties)", 2300, 2300, 300, true, 0.5, 0.5, 0},
                           {"top-k pieces four bias values (ties)", 2050, 2050, 700, true, 0, 4, 1},
                           {"top-k pieces of 2048 rows", 16500, 600, 50, false, -2, 2, 0}};  // > 16 segments of 1024
  for (const Pieces& t : pieces) {
    Case c = make(t.what, t.sq, t.sk, 4, 2);
    c.options.causal = t.causal;
    c.options.keep_window_size = t.w;
    c.bias_shape = {c.B, t.causal ? c.Hk : 1, 1, c.Sk};
    c.bias_lo = t.lo, c.bias_hi = t.hi, c.bias_quantum = t.quantum;
    cases.push_back(c);
  }
  {  // GQA, several selection heads a kv head (a random key-only mask of H heads): a piece is the hull over them
    Case c = make("top-k pieces mask heads H", 2200, 2400, 8, 2);
    c.options.causal = true;
    c.options.keep_window_size = 200;
    c.mask_density = 0.7;  // a random key-only mask a query head: different intervals a head
    c.mask_shape = {c.B, c.H, 1, c.Sk};
    c.bias_shape = {c.B, c.Hk, 1, c.Sk};
    cases.push_back(c);
  }
  {  // several bias heads a kv head with dbias: not cut (one key dbias a slot), one CTA a group
    Case c = make("top-k bias heads H not cut", 2100, 2100, 4, 2);
    c.options.causal = true;
    c.options.keep_window_size = 150;
    c.bias_shape = {c.B, c.H, 1, c.Sk};
    cases.push_back(c);
  }
  {  // varlen over several segments, an empty and a one-row sequence
    Case c = make("top-k pieces varlen", 1, 1, 4, 2);
    c.seqlens_q = {2100, 1, 0, 1500}, c.seqlens_k = {2300, 40, 9, 1100};
    c.bias_shape = {3449, c.Hk};
    c.options.causal = true;
    c.options.keep_window_size = 180;
    cases.push_back(c);
  }
  for (int i = 0; i < 2; ++i) {  // few rows over many keys: the chunked threshold search and key lists
    Case c = make(i ? "top-k decode per-row bias" : "top-k decode", i ? 16 : 3, i ? 5000 : 9000, 4, 2);
    c.options.causal = true;
    c.options.keep_window_size = i ? 400 : 1500;
    c.bias_shape = {c.B, c.Hk, i ? c.Sq : 1, c.Sk};
    cases.push_back(c);
  }
  for (Case c : given_interval_cases()) {
    c.name = "bwd top-k given intervals " + c.name;
    cases.push_back(c);
  }
  // More than 4096 keys: the key groups sorted a segment a CTA over rounds of 4096 keys (a selection's
  // pieces are bounded: key_groups.cu group_keys); past 16 segments of 1024 rows too, segments of 2048 rows
  // of 4096 entries each (causal with Sq > Sk: the rows from Sq - Sk on see keys, cut at four segment
  // boundaries; one head, so that the naive oracle runs: check_forward.cpp kNaiveEntries).
  for (const std::int64_t sq : {1030, 16500}) {
    const bool compact = sq > 16384;
    Case c = make(compact ? "top-k compact segments" : "top-k pieces over 4096 keys", sq, 4200, compact ? 1 : 2, 1);
    c.B = 1;
    c.options.causal = true;
    c.options.keep_window_size = 200;
    c.bias_shape = {c.B, c.Hk, 1, c.Sk};
    cases.push_back(c);
  }
  {  // ... the compact segments in varlen
    Case v = make("top-k compact segments varlen", 1, 1, 1, 1);
    v.seqlens_q = {300, 16500}, v.seqlens_k = {200, 4300};
    v.bias_shape = {4500, v.Hk};
    v.options.causal = true;
    v.options.keep_window_size = 150;
    cases.push_back(v);
  }
  {  // ... and given intervals that are no selection of the call (every key in every row), more pieces
     // than that sort takes: they stay in key order
    Case g = make("top-k given intervals of every key, over 4096 keys", 100, 4400, 4, 2);
    g.B = 1;
    g.options.causal = false;
    g.options.keep_window_size = 50;
    g.bias_shape = {g.B, g.Hk, 1, g.Sk};
    g.given_intervals = true, g.given_keep = 4400;
    cases.push_back(g);
  }
  Case keys = make("top-k 50 bias over heads only", 300, 400, 4, 2);  // dbias summed over keys
  keys.B = 2;
  keys.options.causal = true;
  keys.options.keep_window_size = 50;
  keys.bias_shape = {keys.B, keys.Hk, 1, 1};
  cases.push_back(keys);
  return cases;
}

// dq with and without options.deterministic (the two-kernel backward, and dq by
// float32 atomics in the dk/dv kernel): causal GQA, a mask with a per-row bias
// (dbias per element), softcap, varlen, top-k key groups; both must pass.
template <class Make>
std::vector<Case> deterministic_pairs(Make&& make) {
  std::vector<Case> cases;
  for (bool deterministic : {false, true}) {
    const std::string tag = deterministic ? " deterministic" : " atomic dq";
    const auto add = [&](Case c) {
      c.options.deterministic = deterministic;
      cases.push_back(c);
    };
    Case a = make("dq" + tag, 300, 500, 8, 2);
    a.options.causal = true;
    add(a);
    Case m = make("dq mask + bias softcap" + tag, 190, 130, 4, 2);
    m.mask_shape = {m.B, 1, m.Sq, m.Sk};
    m.bias_shape = {m.B, m.Hk, m.Sq, m.Sk};
    m.options.softcap = 20.0;
    add(m);
    Case v = make("dq varlen" + tag, 1, 1, 4, 2);
    v.seqlens_q = {70, 1, 200}, v.seqlens_k = {130, 65, 200};
    v.bias_shape = {395, 2};
    v.options.causal = true;
    add(v);
    Case t = make("dq top-k 40" + tag, 400, 400, 8, 2);
    t.options.causal = true;
    t.options.keep_window_size = 40;
    t.bias_shape = {1, t.Hk, 1, t.Sk};
    add(t);
    Case pc = make("dq top-k 300 pieces" + tag, 2600, 2600, 8, 2);  // keys cut at 1024-row segments
    pc.options.causal = true;
    pc.options.keep_window_size = 300;
    pc.bias_shape = {1, pc.Hk, 1, pc.Sk};
    add(pc);
  }
  return cases;
}

// Deterministic dq on the Hopper dk/dv kernel's dense walk (ordered
// additions, D = 64 and 128): several key blocks a query block (not causal,
// long rows), causal with Sq < Sk and Sq > Sk, windows, GQA and MQA, a
// key-only bias and its gradient (per kv head, per query head, shared by all
// heads through slices), odd lengths, one query row over many key blocks, a
// walk of one step (no dQ buffer used twice).
template <class Make>
std::vector<Case> ordered_dq_cases(Make&& make) {
  std::vector<Case> cases;
  for (std::int64_t d : {128, 64}) {
    const auto ordered = [&](const std::string& what, std::int64_t sq, std::int64_t sk, std::int64_t h, std::int64_t hk) {
      Case c = make("ordered dq " + what, sq, sk, h, hk);
      c.D = d;
      c.options.deterministic = true;
      return c;
    };
    Case a = ordered("key bias", 333, 700, 8, 2);
    a.B = 2, a.bias_shape = {a.B, a.Hk, 1, a.Sk};
    cases.push_back(a);
    Case b = ordered("causal bias of one head", 700, 1000, 8, 1);
    b.options.causal = true, b.bias_shape = {1, 1, 1, b.Sk};
    cases.push_back(b);
    Case c = ordered("causal Sq > Sk head bias", 1000, 650, 4, 2);
    c.options.causal = true, c.bias_shape = {c.B, c.H, 1, c.Sk};
    cases.push_back(c);
    Case w = ordered("window (100,0)", 900, 900, 8, 2);
    w.options.causal = true, w.options.sliding_window = {100, 0}, w.bias_shape = {1, w.Hk, 1, w.Sk};
    cases.push_back(w);
    Case w2 = ordered("window (64,200)", 1000, 500, 4, 4);
    w2.options.sliding_window = {64, 200};
    cases.push_back(w2);
    Case odd = ordered("odd sizes", 65, 63, 8, 2);
    odd.options.causal = true, odd.bias_shape = {odd.B, odd.Hk, 1, odd.Sk};
    cases.push_back(odd);
    Case row = ordered("one row", 1, 1000, 4, 2);
    row.bias_shape = {row.B, row.Hk, 1, row.Sk};
    cases.push_back(row);
    Case one = ordered("one step a key block", 64, 700, 4, 4);  // the dQ writer's hand-off without reuse
    one.bias_shape = {one.B, one.Hk, 1, one.Sk};
    cases.push_back(one);
  }
  return cases;
}

// Backward case `form` of the bias broadcast forms (2 x 8/2 heads, 65 x 127):
// bias of shape s, float32 every third, sliced or permuted, causal every other.
template <class Make>
Case bias_form_case(Make&& make, const Shape& s, int form) {
  Case c = make("bias form", 65, 127, 8, 2);
  c.B = 2;
  c.bias_shape = s;
  c.bias_dtype = form % 3 == 0 ? DType::kFloat32 : c.dtype;
  c.bias_layout.sliced = form % 3 == 1;
  c.bias_layout.permuted = form % 3 == 2;
  c.options.causal = form % 2 == 0;
  return c;
}

// Head dims above 128 (the backward's feature split: 64-key CTAs, two warps a
// row block, half a top-k key group a CTA), D = 192 and 256 where
// DMATTN_HEAD_DIMS compiles them (check() skips the others): the bias and
// mask broadcast forms (every dbias reduction), GQA and MQA, causal, a window,
// layouts, varlen, top-k key groups (keys cut into pieces too) and thresholds, an extreme
// bias (the dq statistics pass), the deterministic pairs. `small`: the few
// that compute-sanitizer runs.
template <class Make>
std::vector<Case> wide_head_cases(Make&& make, bool small) {
  std::vector<Case> cases;
  for (std::int64_t d : {192, 256}) {
    const std::string tag = "D" + std::to_string(d) + " ";
    const auto wide = [&](const std::string& what, std::int64_t sq, std::int64_t sk, std::int64_t h, std::int64_t hk) {
      Case c = make(tag + what, sq, sk, h, hk);
      c.D = d;
      return c;
    };
    Case m = wide("mask + bias", 130, 200, 4, 2);
    m.options.causal = true;
    m.mask_shape = {m.B, 1, m.Sq, m.Sk};
    m.bias_shape = {m.B, m.Hk, m.Sq, m.Sk};
    cases.push_back(m);
    Case t = wide("top-k 20", 150, 300, 4, 2);
    t.options.causal = true;
    t.options.keep_window_size = 20;
    t.bias_shape = {1, t.Hk, 1, t.Sk};
    cases.push_back(t);
    Case det = m;
    det.options.deterministic = true;
    det.name += " deterministic";
    cases.push_back(det);
    // The Hopper dk/dv kernel's split walk (64-key CTAs, the warpgroups over
    // the features): a key-only bias with dbias, a window edge and a causal
    // offset inside the tiles; several key blocks and steps without a bias.
    Case kb = wide("key bias window", 200, 130, 4, 2);
    kb.options.causal = true;
    kb.options.sliding_window = {40, 0};
    kb.bias_shape = {1, kb.Hk, 1, kb.Sk};
    cases.push_back(kb);
    Case nb = wide("no bias", 300, 450, 8, 2);
    cases.push_back(nb);
    if (small) continue;
    const std::int64_t sizes[][2] = {{1, 1}, {7, 1}, {65, 63}, {400, 700}, {1, 1000}, {1000, 63}};
    const std::int64_t heads[3][2] = {{8, 2}, {4, 4}, {8, 1}};
    for (int i = 0; i < 6; ++i)
      for (bool causal : {false, true}) {
        Case c = wide("sizes", sizes[i][0], sizes[i][1], heads[i % 3][0], heads[i % 3][1]);
        c.options.causal = causal;
        cases.push_back(c);
      }
    int form = 0;
    for (const Shape& sh : broadcast_shapes(2, 8, 2, 65, 127)) {
      Case c = bias_form_case(wide, sh, form);
      if (form % 2 == 1) c.mask_shape = {sh[0], sh[1], 65, 127};  // a mask of the bias's batch and heads
      cases.push_back(c);
      ++form;
    }
    Case w = wide("window (30,0) softcap 30", 300, 65, 4, 2);
    w.options.sliding_window = {30, 0};
    w.options.softcap = 30.0;
    w.bias_shape = {1, w.Hk, 1, w.Sk};
    cases.push_back(w);
    Case l = wide("layout sliced permuted", 130, 190, 4, 2);
    l.qkv_layout.sliced = true, l.qkv_layout.permuted = true;
    l.out_layout = l.qkv_layout;
    l.options.causal = true;
    cases.push_back(l);
    Case v = wide("varlen", 1, 1, 4, 2);
    v.seqlens_q = {128, 1, 300}, v.seqlens_k = {128, 300, 64};
    v.bias_shape = {492, 2};
    v.options.causal = true;
    cases.push_back(v);
    Case e = wide("extreme bias -1e30", 130, 100, 4, 2);
    e.bias_dtype = DType::kFloat32;
    e.bias_lo = -1e30, e.bias_hi = -1e30;
    e.bias_shape = {1, 1, e.Sq, e.Sk};
    e.options.causal = true;
    cases.push_back(e);
    Case tc = wide("top-k 64 pieces", 2100, 2100, 2, 1);
    tc.B = 1;
    tc.options.causal = true;
    tc.options.keep_window_size = 64;
    tc.bias_shape = {1, 1, 1, tc.Sk};
    cases.push_back(tc);
    Case tr = wide("top-k 100 per-row bias + mask", 300, 1000, 4, 2);
    topk_per_row(tr, 2);
    cases.push_back(tr);
    for (Case& c : deterministic_pairs(wide)) cases.push_back(c);
  }
  return cases;
}

// The Hopper dk/dv kernel's walk of a bias with rows (D = 128 and 64), variant
// v: its bias shape ((B, H, Sq, Sk): dbias direct; (1, Hk, Sq, Sk): the G query
// heads of a kv head summed in the CTA, at D = 64 the sm80 kernel's instead;
// (B, 1, Sq, Sk): one slice a kv head; (B, Hk, Sq, 1): a per-row bias, no
// dbias), GQA, MHA or MQA, causal, non-causal or a window, B = 2 (a bias
// broadcast over batches: a slice a batch entry), lengths off the 128-key and
// 64 / 128-query tiles, float32 and permuted biases (a full bias of q's dtype
// with keys a multiple of 8: by tiles, DkvWalk::kBiasTiles).
constexpr int kRowBiasVariants = 8;
template <class Make>
Case row_bias_case(Make&& make, std::int64_t d, int v, std::int64_t sq, std::int64_t sk) {
  const std::int64_t heads[3][2] = {{8, 2}, {4, 4}, {8, 1}};
  Case c = make("Hopper row bias", sq, sk, heads[v % 3][0], heads[v % 3][1]);
  c.D = d;
  c.B = 2;
  const int form = v % 4;
  c.bias_shape = form == 0   ? Shape{c.B, c.H, c.Sq, c.Sk}
                 : form == 1 ? Shape{1, c.Hk, c.Sq, c.Sk}
                 : form == 2 ? Shape{c.B, 1, c.Sq, c.Sk}
                             : Shape{c.B, c.Hk, c.Sq, 1};
  c.bias_dtype = v % 3 == 2 ? DType::kFloat32 : c.dtype;
  c.bias_layout.permuted = v % 5 == 1;
  c.options.causal = v % 2 == 0;
  if (v == 5) c.options.sliding_window = {70, 30};
  if (v == 6) c.options.sliding_window = {100, 0};
  return c;
}

}  // namespace dmattn_gpu_test::backward_cases
