#include "validate.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace dmattn {
namespace {

using Kind = Error::Kind;

std::string shape_str(const TensorView& t) {
  std::ostringstream s;
  s << "(";
  for (int d = 0; d < t.ndim; ++d) s << (d ? ", " : "") << t.shape[d];
  s << (t.ndim == 1 ? ",)" : ")");
  return s.str();
}

std::string device_str(const Device& d) {
  return d.type == DeviceType::kCPU ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

bool same_device(const Device& a, const Device& b) {
  return a.type == b.type && (a.type == DeviceType::kCPU || a.index == b.index);
}

bool is_float(DType t) {
  return t == DType::kFloat16 || t == DType::kBFloat16 || t == DType::kFloat32 || t == DType::kFloat64;
}

// Named dimension sizes used in messages, e.g. "8 (H)".
struct Dim {
  std::int64_t size;
  const char* name;
};

std::string dim_str(Dim d) { return std::to_string(d.size) + " (" + d.name + ")"; }

// Checks of one tensor argument, each throwing with the argument's name.
class Arg {
 public:
  Arg(const TensorView& t, std::string name) : t_(t), name_(std::move(name)) {}

  const Arg& rank(int n, const char* layout) const {
    if (t_.ndim != n)
      throw Error(Kind::kValue, name_, "rank " + std::to_string(n) + " " + layout,
                  "rank " + std::to_string(t_.ndim) + " with shape " + shape_str(t_));
    for (int d = 0; d < n; ++d) {
      if (t_.shape[d] < 0)
        throw Error(Kind::kValue, name_ + ".shape[" + std::to_string(d) + "]", "a size >= 0",
                    std::to_string(t_.shape[d]));
      if (t_.stride[d] < 0)
        throw Error(Kind::kValue, name_ + ".stride[" + std::to_string(d) + "]", "a stride >= 0",
                    std::to_string(t_.stride[d]));
    }
    return *this;
  }

  const Arg& dtype(DType want, const char* why) const {
    if (t_.dtype != want)
      throw Error(Kind::kType, name_ + ".dtype", std::string(dtype_name(want)) + " " + why,
                  dtype_name(t_.dtype));
    return *this;
  }

  const Arg& device(const Device& want) const {
    if (!same_device(t_.device, want))
      throw Error(Kind::kValue, name_ + ".device", device_str(want) + " (the device of q)",
                  device_str(t_.device));
    return *this;
  }

  const Arg& dim(int d, Dim want) const {
    if (t_.shape[d] != want.size)
      throw Error(Kind::kValue, name_ + ".shape[" + std::to_string(d) + "]", dim_str(want),
                  std::to_string(t_.shape[d]) + " (shape " + shape_str(t_) + ")");
    return *this;
  }

  // Size of dim d must be one of `options` (1 included as a broadcast).
  const Arg& broadcast_dim(int d, std::initializer_list<Dim> options) const {
    for (const Dim& o : options)
      if (t_.shape[d] == o.size) return *this;
    std::string want;
    std::size_t i = 0;
    for (const Dim& o : options) want += (i++ ? (i == options.size() ? " or " : ", ") : "") + dim_str(o);
    throw Error(Kind::kValue, name_ + ".shape[" + std::to_string(d) + "]", want + " to broadcast",
                std::to_string(t_.shape[d]) + " (shape " + shape_str(t_) + ")");
  }

  // The feature dimension must be contiguous (stride 1) unless it has one element.
  const Arg& last_dim_contiguous() const {
    const int d = t_.ndim - 1;
    if (t_.shape[d] > 1 && t_.stride[d] != 1)
      throw Error(Kind::kValue, name_ + ".stride[" + std::to_string(d) + "]",
                  "1 (the last dimension contiguous)", std::to_string(t_.stride[d]));
    return *this;
  }

  // An output may not write one element through two indices of a broadcast dim
  // (an empty output writes nothing, whatever its strides).
  const Arg& writable() const {
    if (t_.numel() == 0) return *this;
    for (int d = 0; d < t_.ndim; ++d)
      if (t_.shape[d] > 1 && t_.stride[d] == 0)
        throw Error(Kind::kValue, name_ + ".stride[" + std::to_string(d) + "]",
                    "a non-zero stride (an output cannot be a broadcast view)", "0");
    return *this;
  }

  // Row-major contiguous (a dimension of one element may have any stride).
  const Arg& contiguous() const {
    std::int64_t expected = 1;
    for (int d = t_.ndim - 1; d >= 0; --d) {
      if (t_.shape[d] > 1 && t_.stride[d] != expected)
        throw Error(Kind::kValue, name_ + ".stride[" + std::to_string(d) + "]",
                    std::to_string(expected) + " (a contiguous tensor)", std::to_string(t_.stride[d]));
      expected *= t_.shape[d];
    }
    return *this;
  }

  const Arg& same_shape_as(const TensorView& ref, const std::string& ref_name) const {
    bool same = t_.ndim == ref.ndim;
    for (int d = 0; same && d < t_.ndim; ++d) same = t_.shape[d] == ref.shape[d];
    if (!same)
      throw Error(Kind::kValue, name_ + ".shape", shape_str(ref) + " (the shape of " + ref_name + ")",
                  shape_str(t_));
    return *this;
  }

 private:
  const TensorView& t_;
  std::string name_;
};

// A call that runs reads or writes every non-empty tensor it is given (absent ones: nullptr).
// (A rank beyond kMaxRank is left to the rank checks.)
void check_data(Reads reads, std::initializer_list<std::pair<const TensorView*, const char*>> tensors) {
  if (reads == Reads::kMetadata) return;
  for (const auto& [t, name] : tensors)
    if (t != nullptr && t->data == nullptr && t->ndim <= kMaxRank && t->numel() > 0)
      throw Error(Kind::kValue, std::string(name) + ".data", "a non-null pointer", "nullptr");
}

const TensorView* present(const std::optional<TensorView>& t) { return t ? &*t : nullptr; }

// The bytes [first, last] a non-empty view spans, and whether its elements fill
// them (`dense`: its dims, sorted by stride, nest without a gap; broadcast and
// size-1 dims left out).
struct Span {
  std::uintptr_t first = 0, last = 0;
  bool dense = true;
};
Span span_of(const TensorView& t) {
  std::array<std::pair<std::int64_t, std::int64_t>, kMaxRank> dims{};  // (stride, size)
  int n = 0;
  std::int64_t extent = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] <= 1 || t.stride[d] == 0) continue;
    dims[n++] = {t.stride[d], t.shape[d]};
    extent += (t.shape[d] - 1) * t.stride[d];
  }
  for (int i = 1; i < n; ++i)  // by stride (an insertion sort: at most kMaxRank dims)
    for (int j = i; j > 0 && dims[j] < dims[j - 1]; --j) std::swap(dims[j], dims[j - 1]);
  Span s;
  std::int64_t next = 1;
  for (int i = 0; i < n; ++i) s.dense = s.dense && dims[i].first == next, next = dims[i].first * dims[i].second;
  const auto size = static_cast<std::int64_t>(dtype_size(t.dtype));
  s.first = reinterpret_cast<std::uintptr_t>(t.data);
  s.last = s.first + static_cast<std::uintptr_t>((extent + 1) * size - 1);
  return s;
}

using Named = std::pair<const TensorView*, const char*>;

// A call that runs writes each output where no other argument lies: an output
// sharing memory with an input (or another output) would overwrite what the
// call still reads, a silently wrong result. Refused where both views fill the
// bytes they span and those intersect (they then share an element for sure);
// views with gaps (two halves of one buffer's last dim, say) are let through.
void check_disjoint(Reads reads, std::initializer_list<Named> outputs, const std::vector<Named>& inputs) {
  if (reads == Reads::kMetadata) return;
  const auto checked = [](const TensorView* t) { return t != nullptr && t->data != nullptr && t->numel() > 0; };
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    if (!checked(o->first)) continue;
    const Span a = span_of(*o->first);
    if (!a.dense) continue;
    const auto refuse_overlap = [&](const Named& x) {
      if (!checked(x.first) || x.first->device.type != o->first->device.type ||
          x.first->device.index != o->first->device.index)
        return;
      const Span b = span_of(*x.first);
      if (b.dense && a.first <= b.last && b.first <= a.last)
        throw Error(Kind::kValue, o->second, "memory of its own (no other argument's)",
                    std::string("a view overlapping ") + x.second);
    };
    for (const Named& x : inputs) refuse_overlap(x);
    for (auto x = outputs.begin(); x != o; ++x) refuse_overlap(*x);
  }
}

// What a call reads: q, k and v (select_topk: their shapes alone, `tokens` false), the
// mask, the bias, given top-k intervals and cu_seqlens.
std::vector<Named> inputs_of(const Inputs& in, const VarlenLayout* layout, bool tokens = true) {
  return {{tokens ? &in.q : nullptr, "q"},
          {tokens ? &in.k : nullptr, "k"},
          {tokens ? &in.v : nullptr, "v"},
          {present(in.mask), "mask"},
          {present(in.bias), "bias"},
          {present(in.topk_intervals), "topk_intervals"},
          {layout ? &layout->cu_seqlens_q : nullptr, "cu_seqlens_q"},
          {layout ? &layout->cu_seqlens_k : nullptr, "cu_seqlens_k"}};
}

// Stride of a possibly broadcast dim: 0 when its size is 1.
std::int64_t bstride(const TensorView& t, int d) { return t.shape[d] == 1 ? 0 : t.stride[d]; }

Operand token_operand(const TensorView& t, bool varlen) {
  Operand o{t.data, t.dtype};
  if (varlen) {
    o.sr = t.stride[0], o.sh = t.stride[1], o.sc = t.stride[2];
  } else {
    o.sb = t.stride[0], o.sr = t.stride[1], o.sh = t.stride[2], o.sc = t.stride[3];
  }
  return o;
}

// Sizes of the problem as read from q and k.
struct Sizes {
  std::int64_t B, Sq, Sk, H, Hk, D;
};

void check_options(const Options& o, const Inputs& in) {
  if (o.scale && !std::isfinite(*o.scale))
    throw Error(Kind::kValue, "scale", "a finite number", std::to_string(*o.scale));
  if (!(o.softcap >= 0.0) || !std::isfinite(o.softcap))
    throw Error(Kind::kValue, "softcap", "a finite number >= 0 (0 = off)", std::to_string(o.softcap));
  if (o.sliding_window.left < -1)
    throw Error(Kind::kValue, "sliding_window.left", ">= -1 (-1 = unbounded)",
                std::to_string(o.sliding_window.left));
  if (o.sliding_window.right < -1)
    throw Error(Kind::kValue, "sliding_window.right", ">= -1 (-1 = unbounded)",
                std::to_string(o.sliding_window.right));
  if (o.keep_window_size) {
    if (*o.keep_window_size <= 0)
      throw Error(Kind::kValue, "keep_window_size", "a key count > 0 (or none)",
                  std::to_string(*o.keep_window_size));
    if (!in.bias)
      throw Error(Kind::kValue, "keep_window_size",
                  "a bias to select keys by (top-k needs a bias)", "no bias");
  }
}

// Checks cu_seqlens (of `entries` entries where given: cu_seqlens_q's), and its values when
// they are on the host and may be read; returns the number of sequences.
std::int64_t check_cu_seqlens(const TensorView& cu, const char* name, std::int64_t total,
                              const char* total_name, std::int64_t max_seqlen,
                              const char* max_name, const Device& device, Reads reads,
                              std::optional<std::int64_t> entries = std::nullopt) {
  Arg(cu, name).rank(1, "(B + 1,)").dtype(DType::kInt32, "(cumulative sequence lengths)").device(device);
  if (cu.shape[0] < 1) throw Error(Kind::kValue, std::string(name) + ".shape[0]", "B + 1 >= 1", "0");
  if (entries && cu.shape[0] != *entries)
    throw Error(Kind::kValue, std::string(name) + ".shape[0]",
                std::to_string(*entries) + " (the length of cu_seqlens_q)", std::to_string(cu.shape[0]));
  if (max_seqlen < 0)
    throw Error(Kind::kValue, max_name, "a length >= 0", std::to_string(max_seqlen));
  if (device.type != DeviceType::kCPU || reads == Reads::kMetadata) return cu.shape[0] - 1;
  const auto* p = static_cast<const std::int32_t*>(cu.data);
  const std::int64_t s = cu.stride[0];
  if (p[0] != 0)
    throw Error(Kind::kValue, std::string(name) + "[0]", "0", std::to_string(p[0]));
  for (std::int64_t b = 0; b + 1 < cu.shape[0]; ++b) {
    const std::int64_t len = std::int64_t{p[(b + 1) * s]} - p[b * s];
    const std::string at = std::string(name) + "[" + std::to_string(b + 1) + "]";
    if (len < 0)
      throw Error(Kind::kValue, at, "non-decreasing values (>= " + std::to_string(p[b * s]) + ")",
                  std::to_string(p[(b + 1) * s]));
    if (len > max_seqlen)
      throw Error(Kind::kValue, max_name,
                  ">= every sequence length (sequence " + std::to_string(b) + " has " +
                      std::to_string(len) + ")",
                  std::to_string(max_seqlen));
  }
  const std::int64_t last = p[(cu.shape[0] - 1) * s];
  if (last != total)
    throw Error(Kind::kValue, std::string(name) + "[" + std::to_string(cu.shape[0] - 1) + "]",
                std::to_string(total) + " (" + total_name + ")", std::to_string(last));
  return cu.shape[0] - 1;
}

// What rules per-key row intervals out for p's top-k (Problem::topk_as_intervals), in words.
std::string not_intervals(const Problem& p) {
  if (p.bias_shape.rows != 1) return "a bias of " + std::to_string(p.bias_shape.rows) + " query rows";
  if (p.mask_shape.rows != 1) return "a mask of " + std::to_string(p.mask_shape.rows) + " query rows";
  return "sliding_window.left = " + std::to_string(p.window_left);
}

// The top-k intervals tensor `t` of p (given, or select_topk's output): a call that
// intervals express, int32 (B, Hs, Sk, 2), contiguous, on q's device.
void check_intervals(const TensorView& t, const std::string& name, const Problem& p, bool varlen,
                     const Options& options) {
  if (!options.keep_window_size)
    throw Error(Kind::kValue, name, "none without keep_window_size (they are a top-k selection)", "a tensor");
  if (!p.topk_as_intervals())
    throw Error(Kind::kValue, name,
                "a call whose top-k per-key row intervals express (a bias constant along queries, at most a key-only "
                "mask, no left sliding window)",
                not_intervals(p));
  Arg(t, name).rank(4, "(B, Hs, Sk, 2)").dtype(DType::kInt32, "(query rows [start, end) a key)").device(p.device);
  Arg(t, name).dim(0, {p.batch, varlen ? "sequences" : "B"})
      .dim(1, {p.topk_heads(), "Hs = max(bias heads, mask heads)"})
      .dim(2, {p.seqlen_k, varlen ? "max_seqlen_k" : "Sk"})
      .dim(3, {2, "start, end"})
      .contiguous();
}

// Everything about q, k, v, mask, bias, the top-k intervals (`intervals`, named
// `intervals_name`; nullptr: none) and the options; fills the shared part of a
// Problem. The data of q, k and v is the caller's to check (select_topk reads none).
Problem make_problem(const Inputs& in, const VarlenLayout* layout, const Options& options, Reads reads,
                     const TensorView* intervals, const char* intervals_name) {
  const bool varlen = layout != nullptr;
  check_data(reads, {{present(in.mask), "mask"}, {present(in.bias), "bias"},
                     {varlen ? &layout->cu_seqlens_q : nullptr, "cu_seqlens_q"},
                     {varlen ? &layout->cu_seqlens_k : nullptr, "cu_seqlens_k"}, {intervals, intervals_name}});
  const TensorView& q = in.q;
  const Device device = q.device;
  const int rank = varlen ? 3 : 4;
  const char* qkv_layout = varlen ? "(total, heads, head_dim)" : "(B, S, heads, head_dim)";
  Arg(q, "q").rank(rank, qkv_layout).last_dim_contiguous();
  Arg(in.k, "k").rank(rank, qkv_layout).device(device).last_dim_contiguous();
  Arg(in.v, "v").rank(rank, qkv_layout).device(device).last_dim_contiguous();
  if (!is_float(q.dtype))
    throw Error(Kind::kType, "q.dtype", "float16, bfloat16, float32 or float64", dtype_name(q.dtype));
  if (device.type == DeviceType::kCUDA && q.dtype != DType::kFloat16 && q.dtype != DType::kBFloat16)
    throw Error(Kind::kType, "q.dtype", "float16 or bfloat16 on CUDA", dtype_name(q.dtype));
  Arg(in.k, "k").dtype(q.dtype, "(the dtype of q)");
  Arg(in.v, "v").dtype(q.dtype, "(the dtype of q)");

  const int hd = rank - 2, dd = rank - 1;  // head and feature dims
  Sizes s{};
  s.H = q.shape[hd], s.Hk = in.k.shape[hd], s.D = q.shape[dd];
  if (s.H < 1) throw Error(Kind::kValue, "q.shape[" + std::to_string(hd) + "]", "H >= 1 heads", std::to_string(s.H));
  if (s.Hk < 1) throw Error(Kind::kValue, "k.shape[" + std::to_string(hd) + "]", "Hk >= 1 heads", std::to_string(s.Hk));
  if (s.H % s.Hk != 0)
    throw Error(Kind::kValue, "k.shape[" + std::to_string(hd) + "]",
                "a divisor of H = " + std::to_string(s.H) + " (H % Hk == 0)", std::to_string(s.Hk));
  if (s.D < 1) throw Error(Kind::kValue, "q.shape[" + std::to_string(dd) + "]", "head_dim >= 1", "0");
  if (device.type == DeviceType::kCUDA && (s.D > 256 || s.D % 8 != 0))
    throw Error(Kind::kUnsupported, "q.shape[" + std::to_string(dd) + "]",
                "a head_dim <= 256 and divisible by 8 on CUDA", std::to_string(s.D));
  Arg(in.k, "k").dim(dd, {s.D, "head_dim of q"}).dim(hd, {s.Hk, "Hk"});
  Arg(in.v, "v").dim(dd, {s.D, "head_dim of q"}).dim(hd, {s.Hk, "Hk"});

  Problem p;
  if (varlen) {
    const std::int64_t total_q = q.shape[0], total_k = in.k.shape[0];
    Arg(in.v, "v").dim(0, {total_k, "total_k"});
    s.B = check_cu_seqlens(layout->cu_seqlens_q, "cu_seqlens_q", total_q, "total_q",
                           layout->max_seqlen_q, "max_seqlen_q", device, reads);
    check_cu_seqlens(layout->cu_seqlens_k, "cu_seqlens_k", total_k, "total_k", layout->max_seqlen_k, "max_seqlen_k",
                     device, reads, s.B + 1);
    s.Sq = layout->max_seqlen_q, s.Sk = layout->max_seqlen_k;
    p.total_q = total_q, p.total_k = total_k;
    p.cu_seqlens_q = static_cast<const std::int32_t*>(layout->cu_seqlens_q.data);
    p.cu_seqlens_k = static_cast<const std::int32_t*>(layout->cu_seqlens_k.data);
    if (layout->cu_seqlens_q.stride[0] != 1 || layout->cu_seqlens_k.stride[0] != 1)
      throw Error(Kind::kValue, layout->cu_seqlens_q.stride[0] != 1 ? "cu_seqlens_q.stride[0]" : "cu_seqlens_k.stride[0]",
                  "1 (contiguous)", "another stride");
  } else {
    s.B = q.shape[0], s.Sq = q.shape[1], s.Sk = in.k.shape[1];
    Arg(in.k, "k").dim(0, {s.B, "B of q"});
    Arg(in.v, "v").dim(0, {s.B, "B of q"}).dim(1, {s.Sk, "Sk of k"});
  }

  p.batch = s.B, p.heads = s.H, p.kv_heads = s.Hk, p.head_dim = s.D;
  p.seqlen_q = s.Sq, p.seqlen_k = s.Sk;
  p.q = token_operand(q, varlen), p.k = token_operand(in.k, varlen), p.v = token_operand(in.v, varlen);
  p.device = device;
  p.stream = options.stream;

  if (in.mask) {
    const TensorView& m = *in.mask;
    if (varlen)
      throw Error(Kind::kValue, "mask", "no mask for varlen (use a key-only bias and cu_seqlens)", "a mask tensor");
    Arg(m, "mask").rank(4, "(B, H, Sq, Sk) or broadcastable").device(device).dtype(DType::kBool, "(True = may attend)");
    Arg(m, "mask").broadcast_dim(0, {{s.B, "B"}, {1, "broadcast"}})
        .broadcast_dim(1, {{s.H, "H"}, {s.Hk, "Hk"}, {1, "broadcast"}})
        .broadcast_dim(2, {{s.Sq, "Sq"}, {1, "broadcast"}})
        .broadcast_dim(3, {{s.Sk, "Sk"}, {1, "broadcast"}});
    p.mask = Operand{m.data, m.dtype, bstride(m, 0), bstride(m, 1), bstride(m, 2), bstride(m, 3)};
    p.mask_shape = {m.shape[0], m.shape[1], m.shape[2], m.shape[3]};
  }
  if (in.bias) {
    const TensorView& b = *in.bias;
    const char* b_layout = varlen ? "(total_k, Hb)" : "(B, H, Sq, Sk) or broadcastable";
    Arg(b, "bias").rank(varlen ? 2 : 4, b_layout).device(device);
    // On CUDA (q float16 or bfloat16) this leaves float16, bfloat16 and
    // float32: the dtypes whose order the GPU top-k selection sorts by.
    if (b.dtype != q.dtype && b.dtype != DType::kFloat32)
      throw Error(Kind::kType, "bias.dtype",
                  q.dtype == DType::kFloat32 ? std::string("float32 (the dtype of q)")
                                             : std::string("float32 or ") + dtype_name(q.dtype) + " (the dtype of q)",
                  dtype_name(b.dtype));
    if (varlen) {
      Arg(b, "bias").dim(0, {in.k.shape[0], "total_k"})
          .broadcast_dim(1, {{s.H, "H"}, {s.Hk, "Hk"}, {1, "broadcast"}});
      // Keys of different sequences are distinct elements: one bias "batch" per sequence.
      p.bias = Operand{b.data, b.dtype, 0, bstride(b, 1), 0, b.stride[0]};
      p.bias_shape = {s.B, b.shape[1], 1, s.Sk};
    } else {
      Arg(b, "bias").broadcast_dim(0, {{s.B, "B"}, {1, "broadcast"}})
          .broadcast_dim(1, {{s.H, "H"}, {s.Hk, "Hk"}, {1, "broadcast"}})
          .broadcast_dim(2, {{s.Sq, "Sq"}, {1, "broadcast"}})
          .broadcast_dim(3, {{s.Sk, "Sk"}, {1, "broadcast"}});
      p.bias = Operand{b.data, b.dtype, bstride(b, 0), bstride(b, 1), bstride(b, 2), bstride(b, 3)};
      p.bias_shape = {b.shape[0], b.shape[1], b.shape[2], b.shape[3]};
    }
  }

  check_options(options, in);
  p.scale = options.scale ? *options.scale : 1.0 / std::sqrt(static_cast<double>(s.D));
  p.softcap = options.softcap;
  p.causal = options.causal;
  p.window_left = options.sliding_window.left;
  p.window_right = options.sliding_window.right;
  p.deterministic = options.deterministic;
  // A row never sees more than Sk keys, nor more than a left window's width
  // (left + 1 under causal, left + right + 1 with a bounded right): a keep
  // window that wide keeps every allowed key (no top-k), unless the selection
  // is given (its intervals are used as they are).
  std::int64_t widest = p.seqlen_k;
  const std::int64_t right = p.causal ? 0 : p.window_right;
  if (p.window_left >= 0 && right >= 0) widest = std::min(widest, p.window_left + right + 1);
  const std::int64_t keep = options.keep_window_size.value_or(0);
  p.keep_window_size = keep < widest || intervals != nullptr ? keep : 0;
  if (intervals != nullptr) {
    check_intervals(*intervals, intervals_name, p, varlen, options);
    p.topk_intervals = static_cast<std::int32_t*>(intervals->data);
  }
  return p;
}

void check_like(const TensorView& t, const std::string& name, const TensorView& ref, const std::string& ref_name) {
  Arg(t, name).rank(ref.ndim, ("(the rank of " + ref_name + ")").c_str()).same_shape_as(ref, ref_name).device(ref.device).last_dim_contiguous().writable();
  Arg(t, name).dtype(ref.dtype, ("(the dtype of " + ref_name + ")").c_str());
}

Operand lse_operand(const TensorView& lse, const std::string& name, const Problem& p, const TensorView& q,
                    bool varlen) {
  Arg a(lse, name);
  if (varlen) {
    a.rank(2, "(H, total_q)").dim(0, {p.heads, "H"}).dim(1, {q.shape[0], "total_q"});
  } else {
    a.rank(3, "(B, H, Sq)").dim(0, {p.batch, "B"}).dim(1, {p.heads, "H"}).dim(2, {p.seqlen_q, "Sq"});
  }
  a.device(q.device).writable();
  if (lse.dtype != DType::kFloat32 && !(lse.dtype == DType::kFloat64 && q.dtype == DType::kFloat64))
    throw Error(Kind::kType, name + ".dtype",
                q.dtype == DType::kFloat64 ? "float32 or float64" : "float32", dtype_name(lse.dtype));
  Operand o{lse.data, lse.dtype};
  if (varlen) {
    o.sh = lse.stride[0], o.sr = lse.stride[1];
  } else {
    o.sb = lse.stride[0], o.sh = lse.stride[1], o.sr = lse.stride[2];
  }
  return o;
}

}  // namespace

Problem make_forward_problem(const Inputs& in, const VarlenLayout* layout, const TensorView& out,
                             const std::optional<TensorView>& lse, const Options& options, Reads reads) {
  Problem p = make_problem(in, layout, options, reads, present(in.topk_intervals), "topk_intervals");
  check_data(reads, {{&in.q, "q"}, {&in.k, "k"}, {&in.v, "v"}, {&out, "out"}, {present(lse), "lse"}});
  const bool varlen = layout != nullptr;
  check_like(out, "out", in.q, "q");
  p.out = token_operand(out, varlen);
  if (lse) {
    p.lse = lse_operand(*lse, "lse", p, in.q, varlen);
  } else if (options.return_lse) {
    throw Error(Kind::kValue, "lse", "an output tensor (options.return_lse is true)", "none");
  }
  check_disjoint(reads, {{&out, "out"}, {present(lse), "lse"}}, inputs_of(in, layout));
  return p;
}

Problem make_backward_problem(const Inputs& in, const VarlenLayout* layout, const TensorView& out,
                              const TensorView& dout, const TensorView& lse, const Gradients& grads,
                              const Options& options, Reads reads) {
  Problem p = make_problem(in, layout, options, reads, present(in.topk_intervals), "topk_intervals");
  check_data(reads, {{&in.q, "q"}, {&in.k, "k"}, {&in.v, "v"}, {&out, "out"}, {&dout, "dout"}, {&lse, "lse"},
                     {&grads.dq, "dq"}, {&grads.dk, "dk"}, {&grads.dv, "dv"}, {present(grads.dbias), "dbias"}});
  const bool varlen = layout != nullptr;
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{out, "out"}, {dout, "dout"}}) {
    Arg(t, name).rank(in.q.ndim, "(the rank of q)").same_shape_as(in.q, "q").device(in.q.device).last_dim_contiguous();
    Arg(t, name).dtype(in.q.dtype, "(the dtype of q)");
  }
  p.out = token_operand(out, varlen);
  p.dout = token_operand(dout, varlen);
  p.lse = lse_operand(lse, "lse", p, in.q, varlen);
  check_like(grads.dq, "dq", in.q, "q");
  check_like(grads.dk, "dk", in.k, "k");
  check_like(grads.dv, "dv", in.v, "v");
  p.dq = token_operand(grads.dq, varlen);
  p.dk = token_operand(grads.dk, varlen);
  p.dv = token_operand(grads.dv, varlen);
  if (grads.dbias) {
    if (!in.bias) throw Error(Kind::kValue, "dbias", "none (there is no bias)", "a tensor");
    const TensorView& db = *grads.dbias;
    const TensorView& b = *in.bias;
    Arg(db, "dbias").rank(b.ndim, "(the rank of bias)").same_shape_as(b, "bias").device(in.q.device).writable();
    Arg(db, "dbias").dtype(b.dtype, "(the dtype of bias)");
    p.dbias = varlen ? Operand{db.data, db.dtype, 0, db.stride[1], 0, db.stride[0]}
                     : Operand{db.data, db.dtype, db.stride[0], db.stride[1], db.stride[2], db.stride[3]};
  }
  std::vector<Named> inputs = inputs_of(in, layout);
  inputs.insert(inputs.end(), {{&out, "out"}, {&dout, "dout"}, {&lse, "lse"}});
  check_disjoint(reads, {{&grads.dq, "dq"}, {&grads.dk, "dk"}, {&grads.dv, "dv"}, {present(grads.dbias), "dbias"}},
                 inputs);
  return p;
}

Problem make_select_problem(const Inputs& in, const VarlenLayout* layout, const TensorView& intervals,
                            const Options& options, Reads reads) {
  if (in.topk_intervals)
    throw Error(Kind::kValue, "topk_intervals", "none (select_topk writes the intervals it selects)", "a tensor");
  if (!options.keep_window_size)
    throw Error(Kind::kValue, "keep_window_size", "a key count (select_topk selects the top-k)", "none");
  Problem p = make_problem(in, layout, options, reads, &intervals, "intervals");
  check_disjoint(reads, {{&intervals, "intervals"}}, inputs_of(in, layout, false));
  return p;
}

}  // namespace dmattn
