// The valid call of each entry point and the bad cases (validation_calls.h).
#include <limits>

#include "validation_calls.h"

namespace dmattn_test::validation {

Call valid_call(Entry entry, Tensors& t, Rng& rng) {
  Call c;
  c.entry = entry;
  c.tensors = &t, c.rng = &rng;
  const DType f32 = DType::kFloat32;
  const bool varlen = is_varlen(entry), select = is_select(entry);
  // select_topk takes a call whose top-k intervals express: key-only mask and bias.
  const std::int64_t rows = select ? 1 : Sq;
  const Shape q_shape = varlen ? Shape{kTotalQ, H, D} : Shape{B, Sq, H, D};
  const Shape k_shape = varlen ? Shape{kTotalK, Hk, D} : Shape{B, Sk, Hk, D};
  const Shape bias_shape = varlen ? Shape{kTotalK, Hk} : Shape{B, Hk, rows, Sk};
  c.in.q = t.add(f32, q_shape, rng, false).view();
  c.in.k = t.add(f32, k_shape, rng, false).view();
  c.in.v = t.add(f32, k_shape, rng, false).view();
  if (!varlen) c.in.mask = t.add(DType::kBool, {B, 1, rows, Sk}, rng, false).view();
  c.in.bias = t.add(f32, bias_shape, rng, false).view();
  c.out = t.add(f32, q_shape, rng, true).view();
  c.lse = t.add(f32, varlen ? Shape{H, kTotalQ} : Shape{B, H, Sq}, rng, true).view();
  c.dout = t.add(f32, q_shape, rng, false).view();
  c.grads.dq = t.add(f32, q_shape, rng, true).view();
  c.grads.dk = t.add(f32, k_shape, rng, true).view();
  c.grads.dv = t.add(f32, k_shape, rng, true).view();
  c.grads.dbias = t.add(f32, bias_shape, rng, true).view();
  if (varlen) {
    for (const auto* cu : {&kCuQ, &kCuK}) {
      HostTensor& h = t.all.emplace_back(DType::kInt32, Shape{static_cast<std::int64_t>(cu->size())});
      h.fill([&](std::int64_t i) { return (*cu)[i]; });
    }
    c.layout = {t.all[t.all.size() - 2].view(), t.all.back().view(), 3, 3};
  }
  c.intervals = t.add(DType::kInt32, {varlen ? 3 : B, Hk, varlen ? 3 : Sk, 2}, rng, true).view();
  c.options.causal = true;
  c.options.keep_window_size = 2;
  return c;
}

void give_intervals(Call& c) {
  if (!is_varlen(c.entry)) {
    c.in.mask = c.make(DType::kBool, {B, 1, 1, Sk});
    c.in.bias = c.make(DType::kFloat32, {B, Hk, 1, Sk});
    c.grads.dbias = c.make(DType::kFloat32, {B, Hk, 1, Sk});
  }
  c.in.topk_intervals = c.make(DType::kInt32, {is_varlen(c.entry) ? 3 : B, Hk, is_varlen(c.entry) ? 3 : Sk, 2});
}

void move_to(Call& c, Device device, std::int64_t head_dim) {
  for (TensorView* t : {&c.in.q, &c.in.k, &c.in.v, &c.out, &c.dout, &c.grads.dq, &c.grads.dk, &c.grads.dv}) {
    t->device = device;
    t->dtype = DType::kBFloat16;
    t->shape[t->ndim - 1] = head_dim;
  }
  for (auto* t : {&c.in.mask, &c.in.bias, &c.lse, &c.grads.dbias})
    if (*t) (*t)->device = device;
  c.layout.cu_seqlens_q.device = c.layout.cu_seqlens_k.device = device;
}

std::vector<BadCase> bad_cases() {
  const Entry F = Entry::kForward, Bw = Entry::kBackward, VF = Entry::kVarlenForward, VB = Entry::kVarlenBackward,
              S = Entry::kSelect, VS = Entry::kVarlenSelect;
  const DType f32 = DType::kFloat32, f64 = DType::kFloat64;
  return {
      // rank
      {"q_rank", F, [](Call& c) { c.in.q.ndim = 3; }, Kind::kValue, "q",
       "expected rank 4 (B, S, heads, head_dim), got rank 3"},
      {"k_rank", Bw, [](Call& c) { c.in.k.ndim = 3; }, Kind::kValue, "k", "expected rank 4"},
      {"mask_rank", F, [](Call& c) { c.in.mask->ndim = 3; }, Kind::kValue, "mask", "got rank 3"},
      {"bias_rank", F, [](Call& c) { c.in.bias = c.make(f32, {Hk, Sq, Sk}); }, Kind::kValue, "bias",
       "expected rank 4 (B, H, Sq, Sk) or broadcastable, got rank 3"},
      {"lse_rank", F, [](Call& c) { c.lse = c.make(f32, {B * H, Sq}); }, Kind::kValue, "lse",
       "expected rank 3 (B, H, Sq)"},
      {"varlen_q_rank", VF, [](Call& c) { c.in.q = c.make(f32, {1, kTotalQ, H, D}); }, Kind::kValue, "q",
       "expected rank 3 (total, heads, head_dim), got rank 4"},
      {"varlen_bias_rank", VF, [](Call& c) { c.in.bias = c.make(f32, {1, Hk, 1, kTotalK}); }, Kind::kValue,
       "bias", "expected rank 2 (total_k, Hb)"},
      {"varlen_lse_rank", VB, [](Call& c) { c.lse = c.make(f32, {1, H, kTotalQ}); }, Kind::kValue, "lse",
       "expected rank 2 (H, total_q)"},
      {"cu_seqlens_rank", VF, [](Call& c) { c.cu_q() = c.make(DType::kInt32, {1, 4}); }, Kind::kValue,
       "cu_seqlens_q", "expected rank 1 (B + 1,)"},
      // dtype
      {"q_int32", F, [](Call& c) { c.in.q = c.make(DType::kInt32, {B, Sq, H, D}); }, Kind::kType, "q.dtype",
       "expected float16, bfloat16, float32 or float64, got int32"},
      {"q_bool", Bw, [](Call& c) { c.in.q = c.make(DType::kBool, {B, Sq, H, D}); }, Kind::kType, "q.dtype",
       "got bool"},
      {"k_dtype", F, [f64](Call& c) { c.in.k = c.make(f64, {B, Sk, Hk, D}); }, Kind::kType, "k.dtype",
       "expected float32 (the dtype of q), got float64"},
      {"v_dtype", Bw, [](Call& c) { c.in.v = c.make(DType::kBFloat16, {B, Sk, Hk, D}); }, Kind::kType,
       "v.dtype", "expected float32 (the dtype of q), got bfloat16"},
      {"mask_float", F, [f32](Call& c) { c.in.mask = c.make(f32, {B, 1, Sq, Sk}); }, Kind::kType, "mask.dtype",
       "expected bool (True = may attend), got float32"},
      {"bias_int32", F, [](Call& c) { c.in.bias = c.make(DType::kInt32, {B, Hk, Sq, Sk}); }, Kind::kType,
       "bias.dtype", "got int32"},
      {"bias_bool", Bw, [](Call& c) { c.in.bias = c.make(DType::kBool, {B, Hk, Sq, Sk}); }, Kind::kType,
       "bias.dtype", "got bool"},
      {"bias_float64_with_float32_q", F, [f64](Call& c) { c.in.bias = c.make(f64, {B, Hk, Sq, Sk}); },
       Kind::kType, "bias.dtype", "(the dtype of q), got float64"},
      {"varlen_bias_float16", VF, [](Call& c) { c.in.bias = c.make(DType::kFloat16, {kTotalK, Hk}); },
       Kind::kType, "bias.dtype", "got float16"},
      {"lse_float64_with_float32_q", F, [f64](Call& c) { c.lse = c.make(f64, {B, H, Sq}); }, Kind::kType,
       "lse.dtype", "expected float32, got float64"},
      {"out_dtype", F, [f64](Call& c) { c.out = c.make(f64, {B, Sq, H, D}); }, Kind::kType, "out.dtype",
       "expected float32 (the dtype of q), got float64"},
      {"dout_dtype", Bw, [f64](Call& c) { c.dout = c.make(f64, {B, Sq, H, D}); }, Kind::kType, "dout.dtype",
       "got float64"},
      {"dq_dtype", Bw, [f64](Call& c) { c.grads.dq = c.make(f64, {B, Sq, H, D}); }, Kind::kType, "dq.dtype",
       "got float64"},
      {"dbias_dtype", Bw, [f64](Call& c) { c.grads.dbias = c.make(f64, {B, Hk, Sq, Sk}); }, Kind::kType,
       "dbias.dtype", "expected float32 (the dtype of bias), got float64"},
      {"cu_seqlens_dtype", VF, [f32](Call& c) { c.cu_q() = c.make(f32, {4}); }, Kind::kType,
       "cu_seqlens_q.dtype", "expected int32 (cumulative sequence lengths), got float32"},
      // device
      {"k_on_cuda", F, [](Call& c) { c.in.k.device = kCuda0; }, Kind::kValue, "k.device",
       "expected cpu (the device of q), got cuda:0"},
      {"bias_on_other_gpu", F, [](Call& c) { move_to(c, kCuda0), c.in.bias->device = kCuda1; }, Kind::kValue,
       "bias.device", "expected cuda:0 (the device of q), got cuda:1"},
      {"v_on_other_gpu", Bw, [](Call& c) { move_to(c, kCuda0), c.in.v.device = kCuda1; }, Kind::kValue,
       "v.device", "got cuda:1"},
      {"mask_on_cuda", F, [](Call& c) { c.in.mask->device = kCuda0; }, Kind::kValue, "mask.device", "got cuda:0"},
      {"out_on_other_gpu", F, [](Call& c) { move_to(c, kCuda1), c.out.device = kCuda0; }, Kind::kValue,
       "out.device", "expected cuda:1 (the device of q), got cuda:0"},
      {"lse_on_cuda", F, [](Call& c) { c.lse->device = kCuda0; }, Kind::kValue, "lse.device", "got cuda:0"},
      {"dbias_on_cuda", Bw, [](Call& c) { c.grads.dbias->device = kCuda0; }, Kind::kValue, "dbias.device",
       "got cuda:0"},
      {"cu_seqlens_on_cuda", VF, [](Call& c) { c.layout.cu_seqlens_k.device = kCuda0; }, Kind::kValue,
       "cu_seqlens_k.device", "got cuda:0"},
      {"float32_on_cuda", F, [f32](Call& c) { move_to(c, kCuda0), c.in.q.dtype = c.in.k.dtype = c.in.v.dtype = f32; },
       Kind::kType, "q.dtype", "expected float16 or bfloat16 on CUDA, got float32"},
      {"head_dim_12_on_cuda", F, [](Call& c) { move_to(c, kCuda0, 12); }, Kind::kUnsupported, "q.shape[3]",
       "expected a head_dim <= 256 and divisible by 8 on CUDA, got 12"},
      {"head_dim_264_on_cuda", Bw, [](Call& c) { move_to(c, kCuda0, 264); }, Kind::kUnsupported, "q.shape[3]",
       "got 264"},
      // layout
      {"q_last_dim_strided", F, [](Call& c) { c.in.q.stride[3] = 2; }, Kind::kValue, "q.stride[3]",
       "expected 1 (the last dimension contiguous), got 2"},
      {"k_last_dim_strided", Bw, [](Call& c) { c.in.k.stride[3] = 0; }, Kind::kValue, "k.stride[3]", "got 0"},
      {"varlen_v_last_dim_strided", VF, [](Call& c) { c.in.v.stride[2] = 3; }, Kind::kValue, "v.stride[2]",
       "got 3"},
      {"out_last_dim_strided", F, [](Call& c) { c.out.stride[3] = 2; }, Kind::kValue, "out.stride[3]", "got 2"},
      {"dq_last_dim_strided", Bw, [](Call& c) { c.grads.dq.stride[3] = 2; }, Kind::kValue, "dq.stride[3]",
       "got 2"},
      {"negative_stride", F, [](Call& c) { c.in.q.stride[1] = -c.in.q.stride[1]; }, Kind::kValue, "q.stride[1]",
       "expected a stride >= 0"},
      {"negative_size", F, [](Call& c) { c.in.k.shape[1] = -1; }, Kind::kValue, "k.shape[1]",
       "expected a size >= 0, got -1"},
      {"null_data", F, [](Call& c) { c.in.v.data = nullptr; }, Kind::kValue, "v.data",
       "expected a non-null pointer"},
      {"out_broadcast", F, [](Call& c) { c.out.stride[1] = 0; }, Kind::kValue, "out.stride[1]",
       "expected a non-zero stride (an output cannot be a broadcast view), got 0"},
      {"lse_broadcast", F, [](Call& c) { c.lse->stride[2] = 0; }, Kind::kValue, "lse.stride[2]", "got 0"},
      {"dk_broadcast", Bw, [](Call& c) { c.grads.dk.stride[0] = 0; }, Kind::kValue, "dk.stride[0]", "got 0"},
      {"dbias_broadcast", Bw, [](Call& c) { c.grads.dbias->stride[3] = 0; }, Kind::kValue, "dbias.stride[3]",
       "got 0"},
      {"varlen_dbias_broadcast", VB, [](Call& c) { c.grads.dbias->stride[0] = 0; }, Kind::kValue,
       "dbias.stride[0]", "got 0"},
      {"cu_seqlens_strided", VF,
       [](Call& c) {
         const TensorView buffer = c.make(DType::kInt32, {8});
         auto* p = static_cast<std::int32_t*>(buffer.data);
         p[0] = 0, p[2] = 2, p[4] = 2, p[6] = 5;
         c.cu_q() = TensorView::strided(buffer.data, DType::kInt32, {4}, {2});
       },
       Kind::kValue, "cu_seqlens_q.stride[0]", "expected 1 (contiguous)"},
      // sizes and broadcasting
      {"heads_not_divisible", F, [](Call& c) { c.in.k.shape[2] = c.in.v.shape[2] = 3; }, Kind::kValue,
       "k.shape[2]", "expected a divisor of H = 4 (H % Hk == 0), got 3"},
      {"head_dim_0", F, [](Call& c) { c.in.q.shape[3] = c.in.k.shape[3] = c.in.v.shape[3] = c.out.shape[3] = 0; },
       Kind::kValue, "q.shape[3]", "expected head_dim >= 1, got 0"},
      {"no_heads", F, [](Call& c) { c.in.q.shape[2] = 0; }, Kind::kValue, "q.shape[2]", "expected H >= 1 heads"},
      {"k_head_dim", F, [](Call& c) { c.in.k.shape[3] = 4; }, Kind::kValue, "k.shape[3]",
       "expected 8 (head_dim of q), got 4"},
      {"v_heads", Bw, [](Call& c) { c.in.v.shape[2] = 1; }, Kind::kValue, "v.shape[2]", "expected 2 (Hk), got 1"},
      {"k_batch", F, [](Call& c) { c.in.k.shape[0] = 1; }, Kind::kValue, "k.shape[0]", "expected 2 (B of q)"},
      {"v_keys", F, [](Call& c) { c.in.v.shape[1] = 5; }, Kind::kValue, "v.shape[1]", "expected 6 (Sk of k)"},
      {"varlen_v_total", VF, [](Call& c) { c.in.v.shape[0] = 5; }, Kind::kValue, "v.shape[0]",
       "expected 6 (total_k)"},
      {"mask_batch", F, [](Call& c) { c.in.mask->shape[0] = 3; }, Kind::kValue, "mask.shape[0]",
       "expected 2 (B) or 1 (broadcast) to broadcast, got 3"},
      {"mask_heads", F, [](Call& c) { c.in.mask->shape[1] = 3; }, Kind::kValue, "mask.shape[1]",
       "expected 4 (H), 2 (Hk) or 1 (broadcast) to broadcast, got 3"},
      {"mask_queries", Bw, [](Call& c) { c.in.mask->shape[2] = 4; }, Kind::kValue, "mask.shape[2]",
       "expected 5 (Sq) or 1 (broadcast)"},
      {"mask_keys", F, [](Call& c) { c.in.mask->shape[3] = 7; }, Kind::kValue, "mask.shape[3]",
       "expected 6 (Sk) or 1 (broadcast)"},
      {"bias_batch", F, [](Call& c) { c.in.bias->shape[0] = 4; }, Kind::kValue, "bias.shape[0]", "got 4"},
      {"bias_heads", Bw, [](Call& c) { c.in.bias->shape[1] = 8; }, Kind::kValue, "bias.shape[1]", "got 8"},
      {"bias_queries", F, [](Call& c) { c.in.bias->shape[2] = 2; }, Kind::kValue, "bias.shape[2]", "got 2"},
      {"bias_keys", F, [](Call& c) { c.in.bias->shape[3] = 5; }, Kind::kValue, "bias.shape[3]", "got 5"},
      {"varlen_bias_keys", VF, [](Call& c) { c.in.bias->shape[0] = 5; }, Kind::kValue, "bias.shape[0]",
       "expected 6 (total_k)"},
      {"varlen_bias_heads", VB, [](Call& c) { c.in.bias->shape[1] = 3; }, Kind::kValue, "bias.shape[1]",
       "expected 4 (H), 2 (Hk) or 1 (broadcast) to broadcast, got 3"},
      {"out_shape", F, [](Call& c) { c.out.shape[1] = 4; }, Kind::kValue, "out.shape",
       "expected (2, 5, 4, 8) (the shape of q), got (2, 4, 4, 8)"},
      {"lse_shape", F, [](Call& c) { c.lse->shape[2] = 6; }, Kind::kValue, "lse.shape[2]", "expected 5 (Sq)"},
      {"varlen_lse_shape", VF, [](Call& c) { c.lse->shape[1] = 4; }, Kind::kValue, "lse.shape[1]",
       "expected 5 (total_q)"},
      {"dout_shape", Bw, [](Call& c) { c.dout.shape[2] = 2; }, Kind::kValue, "dout.shape", "(the shape of q)"},
      {"dq_shape", Bw, [](Call& c) { c.grads.dq.shape[0] = 1; }, Kind::kValue, "dq.shape", "(the shape of q)"},
      {"dv_shape", Bw, [](Call& c) { c.grads.dv.shape[1] = 1; }, Kind::kValue, "dv.shape", "(the shape of v)"},
      {"dbias_shape", Bw, [f32](Call& c) { c.grads.dbias = c.make(f32, {B, H, Sq, Sk}); }, Kind::kValue,
       "dbias.shape", "expected (2, 2, 5, 6) (the shape of bias), got (2, 4, 5, 6)"},
      {"dbias_without_bias", Bw, [](Call& c) { c.in.bias.reset(), c.options.keep_window_size.reset(); },
       Kind::kValue, "dbias", "expected none (there is no bias)"},
      // options
      {"keep_window_0", F, [](Call& c) { c.options.keep_window_size = 0; }, Kind::kValue, "keep_window_size",
       "expected a key count > 0 (or none), got 0"},
      {"keep_window_negative", Bw, [](Call& c) { c.options.keep_window_size = -3; }, Kind::kValue,
       "keep_window_size", "got -3"},
      {"keep_window_without_bias", F, [](Call& c) { c.in.bias.reset(); }, Kind::kValue, "keep_window_size",
       "expected a bias to select keys by (top-k needs a bias), got no bias"},
      {"varlen_keep_window_without_bias", VB, [](Call& c) { c.in.bias.reset(), c.grads.dbias.reset(); },
       Kind::kValue, "keep_window_size", "top-k needs a bias"},
      {"window_left", F, [](Call& c) { c.options.sliding_window.left = -2; }, Kind::kValue,
       "sliding_window.left", "expected >= -1 (-1 = unbounded), got -2"},
      {"window_right", Bw, [](Call& c) { c.options.sliding_window.right = -5; }, Kind::kValue,
       "sliding_window.right", "got -5"},
      {"softcap_negative", F, [](Call& c) { c.options.softcap = -1.0; }, Kind::kValue, "softcap",
       "expected a finite number >= 0 (0 = off)"},
      {"softcap_nan", F, [](Call& c) { c.options.softcap = std::nan(""); }, Kind::kValue, "softcap", ""},
      {"scale_infinite", F, [](Call& c) { c.options.scale = std::numeric_limits<double>::infinity(); },
       Kind::kValue, "scale", "expected a finite number"},
      {"lse_missing", F, [](Call& c) { c.lse.reset(); }, Kind::kValue, "lse",
       "expected an output tensor (options.return_lse is true), got none"},
      // varlen layout
      {"cu_seqlens_empty", VF, [](Call& c) { c.cu_q().shape[0] = 0; }, Kind::kValue, "cu_seqlens_q.shape[0]",
       "expected B + 1 >= 1"},
      {"cu_seqlens_first", VF,
       [](Call& c) {
         c.cu_q() = c.make(DType::kInt32, {4});
         static_cast<std::int32_t*>(c.cu_q().data)[0] = 1;
         static_cast<std::int32_t*>(c.cu_q().data)[3] = 5;
       },
       Kind::kValue, "cu_seqlens_q[0]", "expected 0, got 1"},
      {"cu_seqlens_decreasing", VF,
       [](Call& c) {
         c.layout.cu_seqlens_k = c.make(DType::kInt32, {4});
         auto* p = static_cast<std::int32_t*>(c.layout.cu_seqlens_k.data);
         p[0] = 0, p[1] = 4, p[2] = 2, p[3] = 6;
         c.layout.max_seqlen_k = 10;
       },
       Kind::kValue, "cu_seqlens_k[2]", "expected non-decreasing values (>= 4), got 2"},
      {"cu_seqlens_last", VB,
       [](Call& c) {
         c.cu_q() = c.make(DType::kInt32, {4});
         auto* p = static_cast<std::int32_t*>(c.cu_q().data);
         p[0] = 0, p[1] = 2, p[2] = 2, p[3] = 4;
       },
       Kind::kValue, "cu_seqlens_q[3]", "expected 5 (total_q), got 4"},
      {"cu_seqlens_lengths_differ", VF,
       [](Call& c) {
         c.layout.cu_seqlens_k = c.make(DType::kInt32, {5});
         auto* p = static_cast<std::int32_t*>(c.layout.cu_seqlens_k.data);
         p[0] = 0, p[1] = 3, p[2] = 4, p[3] = 6, p[4] = 6;
         c.layout.max_seqlen_k = 3;
       },
       Kind::kValue, "cu_seqlens_k.shape[0]", "expected 4 (the length of cu_seqlens_q), got 5"},
      {"cu_seqlens_lengths_differ_before_values", VF,  // the length is the error, not the last value it lacks
       [](Call& c) {
         c.layout.cu_seqlens_k = c.make(DType::kInt32, {3});
         auto* p = static_cast<std::int32_t*>(c.layout.cu_seqlens_k.data);
         p[0] = 0, p[1] = 3, p[2] = 4;
       },
       Kind::kValue, "cu_seqlens_k.shape[0]", "expected 4 (the length of cu_seqlens_q), got 3"},
      {"max_seqlen_q_too_small", VF, [](Call& c) { c.layout.max_seqlen_q = 2; }, Kind::kValue, "max_seqlen_q",
       "expected >= every sequence length (sequence 2 has 3), got 2"},
      {"max_seqlen_k_too_small", VB, [](Call& c) { c.layout.max_seqlen_k = 1; }, Kind::kValue, "max_seqlen_k",
       "(sequence 0 has 3), got 1"},
      {"max_seqlen_negative", VF, [](Call& c) { c.layout.max_seqlen_q = -1; }, Kind::kValue, "max_seqlen_q",
       "expected a length >= 0, got -1"},
      {"varlen_mask", VF, [](Call& c) { c.in.mask = c.make(DType::kBool, {1, 1, kTotalQ, kTotalK}); },
       Kind::kValue, "mask", "expected no mask for varlen"},
      // the top-k selection given (Inputs::topk_intervals)
      {"topk_intervals_dtype", F, [f32](Call& c) { give_intervals(c), c.in.topk_intervals = c.make(f32, {B, Hk, Sk, 2}); },
       Kind::kType, "topk_intervals.dtype", "expected int32 (query rows [start, end) a key), got float32"},
      {"topk_intervals_rank", Bw,
       [](Call& c) { give_intervals(c), c.in.topk_intervals = c.make(DType::kInt32, {B, Hk, 2 * Sk}); }, Kind::kValue,
       "topk_intervals", "expected rank 4 (B, Hs, Sk, 2), got rank 3"},
      {"topk_intervals_batch", F, [](Call& c) { give_intervals(c), c.in.topk_intervals->shape[0] = 1; }, Kind::kValue,
       "topk_intervals.shape[0]", "expected 2 (B), got 1"},
      {"topk_intervals_heads", F, [](Call& c) { give_intervals(c), c.in.topk_intervals->shape[1] = 1; }, Kind::kValue,
       "topk_intervals.shape[1]", "expected 2 (Hs = max(bias heads, mask heads)), got 1"},
      {"topk_intervals_mask_heads", Bw,
       [](Call& c) { give_intervals(c), c.in.mask = c.make(DType::kBool, {B, H, 1, Sk}); }, Kind::kValue,
       "topk_intervals.shape[1]", "expected 4 (Hs = max(bias heads, mask heads)), got 2"},
      {"topk_intervals_keys", Bw, [](Call& c) { give_intervals(c), c.in.topk_intervals->shape[2] = 5; }, Kind::kValue,
       "topk_intervals.shape[2]", "expected 6 (Sk), got 5"},
      {"topk_intervals_pairs", F, [](Call& c) { give_intervals(c), c.in.topk_intervals->shape[3] = 3; }, Kind::kValue,
       "topk_intervals.shape[3]", "expected 2 (start, end), got 3"},
      {"topk_intervals_strided", F, [](Call& c) { give_intervals(c), c.in.topk_intervals->stride[2] = 4; },
       Kind::kValue, "topk_intervals.stride[2]", "expected 2 (a contiguous tensor), got 4"},
      {"topk_intervals_on_cuda", F, [](Call& c) { give_intervals(c), c.in.topk_intervals->device = kCuda0; },
       Kind::kValue, "topk_intervals.device", "expected cpu (the device of q), got cuda:0"},
      {"topk_intervals_null_data", Bw, [](Call& c) { give_intervals(c), c.in.topk_intervals->data = nullptr; },
       Kind::kValue, "topk_intervals.data", "expected a non-null pointer"},
      {"topk_intervals_without_keep_window", F, [](Call& c) { give_intervals(c), c.options.keep_window_size.reset(); },
       Kind::kValue, "topk_intervals", "expected none without keep_window_size (they are a top-k selection)"},
      {"topk_intervals_per_row_bias", Bw,
       [f32](Call& c) { give_intervals(c), c.in.bias = c.grads.dbias = c.make(f32, {B, Hk, Sq, Sk}); }, Kind::kValue,
       "topk_intervals", "expected a call whose top-k per-key row intervals express (a bias constant along queries, "
       "at most a key-only mask, no left sliding window), got a bias of 5 query rows"},
      {"topk_intervals_per_row_mask", F,
       [](Call& c) { give_intervals(c), c.in.mask = c.make(DType::kBool, {B, 1, Sq, Sk}); }, Kind::kValue,
       "topk_intervals", "got a mask of 5 query rows"},
      {"topk_intervals_left_window", F, [](Call& c) { give_intervals(c), c.options.sliding_window.left = 2; },
       Kind::kValue, "topk_intervals", "got sliding_window.left = 2"},
      {"varlen_topk_intervals_sequences", VB, [](Call& c) { give_intervals(c), c.in.topk_intervals->shape[0] = 4; },
       Kind::kValue, "topk_intervals.shape[0]", "expected 3 (sequences), got 4"},
      {"varlen_topk_intervals_keys", VF, [](Call& c) { give_intervals(c), c.in.topk_intervals->shape[2] = 6; },
       Kind::kValue, "topk_intervals.shape[2]", "expected 3 (max_seqlen_k), got 6"},
      // select_topk
      {"select_intervals_heads", S, [](Call& c) { c.intervals.shape[1] = 4; }, Kind::kValue, "intervals.shape[1]",
       "expected 2 (Hs = max(bias heads, mask heads)), got 4"},
      {"select_intervals_dtype", S, [f32](Call& c) { c.intervals = c.make(f32, {B, Hk, Sk, 2}); }, Kind::kType,
       "intervals.dtype", "expected int32"},
      {"select_intervals_broadcast", S, [](Call& c) { c.intervals.stride[0] = 0; }, Kind::kValue,
       "intervals.stride[0]", "expected 24 (a contiguous tensor), got 0"},
      {"select_null_intervals", S, [](Call& c) { c.intervals.data = nullptr; }, Kind::kValue, "intervals.data",
       "expected a non-null pointer"},
      {"select_without_keep_window", S, [](Call& c) { c.options.keep_window_size.reset(); }, Kind::kValue,
       "keep_window_size", "expected a key count (select_topk selects the top-k), got none"},
      {"select_without_bias", S, [](Call& c) { c.in.bias.reset(); }, Kind::kValue, "keep_window_size",
       "top-k needs a bias"},
      {"select_per_row_bias", S, [f32](Call& c) { c.in.bias = c.make(f32, {B, Hk, Sq, Sk}); }, Kind::kValue,
       "intervals", "got a bias of 5 query rows"},
      {"select_given_intervals", S, [](Call& c) { c.in.topk_intervals = c.intervals; }, Kind::kValue,
       "topk_intervals", "expected none (select_topk writes the intervals it selects), got a tensor"},
      {"select_q_dtype", S, [](Call& c) { c.in.q.dtype = DType::kBool; }, Kind::kType, "q.dtype", "got bool"},
      // an output sharing memory with what the call reads (or another output)
      {"out_is_q", F, [](Call& c) { c.out = c.in.q; }, Kind::kValue, "out",
       "expected memory of its own (no other argument's), got a view overlapping q"},
      {"lse_in_out", F, [f32](Call& c) { c.lse = TensorView::contiguous(c.out.data, f32, {B, H, Sq}); },
       Kind::kValue, "lse", "got a view overlapping out"},
      {"dq_is_dout", Bw, [](Call& c) { c.grads.dq = c.dout; }, Kind::kValue, "dq", "got a view overlapping dout"},
      {"dv_is_dk", Bw, [](Call& c) { c.grads.dv = c.grads.dk; }, Kind::kValue, "dv", "got a view overlapping dk"},
      {"dbias_is_bias", Bw, [](Call& c) { c.grads.dbias = c.in.bias; }, Kind::kValue, "dbias",
       "got a view overlapping bias"},
      {"varlen_dk_in_k", VB, [](Call& c) { c.grads.dk = c.in.k; }, Kind::kValue, "dk", "got a view overlapping k"},
      {"select_intervals_in_bias", S,
       [](Call& c) { c.intervals = TensorView::contiguous(c.in.bias->data, DType::kInt32, {B, Hk, Sk, 2}); },
       Kind::kValue, "intervals", "got a view overlapping bias"},
      {"varlen_select_intervals_keys", VS, [](Call& c) { c.intervals.shape[2] = 6; }, Kind::kValue,
       "intervals.shape[2]", "expected 3 (max_seqlen_k), got 6"},
  };
}

}  // namespace dmattn_test::validation
