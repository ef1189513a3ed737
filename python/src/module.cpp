// dmattn._C: the C++ API over DLPack arrays (torch, NumPy, JAX, CuPy, ...).
//
// Every array is taken as a zero-copy view: nothing is converted, copied or made
// contiguous here, and outputs (out, lse, dq, dk, dv, dbias) are allocated by the
// caller and written in place. The GIL is released while the core runs. For CUDA
// arrays the caller passes its stream (a cudaStream_t as an int; 0 = the legacy
// default stream), on which the core enqueues its work.
//
// Each entry point has a check_ twin (check_forward, ...) over array metadata
// alone, tuples (dtype name, device type, device index, shape, strides): it runs
// the core's validation of the call (dmattn::check_forward, ...) and
// nothing else, for shape inference without data (torch's fake kernels).
//
// dmattn::Error becomes ValueError (Kind::kValue), TypeError (Kind::kType) or
// NotImplementedError (Kind::kUnsupported: valid input this build or device
// cannot run, e.g. CUDA arrays before the CUDA kernels exist), with the core's
// message "dmattn: <argument>: expected <expected>, got <actual>".
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "dmattn/dmattn.h"

namespace nb = nanobind;

namespace {

using In = nb::ndarray<nb::ro>;  // an input: read-only arrays are accepted
using Out = nb::ndarray<>;       // an output: must be writable
// An array's metadata: dtype name ("float32", as dmattn::dtype_name), device type
// ("cpu" or "cuda"), device index, shape and strides (in elements).
using Meta = std::tuple<std::string, std::string, int, std::vector<std::int64_t>, std::vector<std::int64_t>>;
using dmattn::DType;
using dmattn::Error;
using dmattn::TensorView;

// An entry point over metadata validates only.
template <typename Array>
constexpr bool kCheckOnly = std::is_same_v<Array, Meta>;

// What a dtype error expects: any dtype the core takes, or int32 for cu_seqlens.
constexpr const char* kAnyDType = "a dtype dmattn takes (float16, bfloat16, float32, float64, bool or int32)";
constexpr const char* kCuSeqlensDType = "int32 (cumulative sequence lengths)";

// "int64", "uint8", "complex64", "bool", ...: a DLPack dtype in words (dmattn's names for its dtypes).
std::string dlpack_name(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
  if (static_cast<Code>(t.code) == Code::Bool && t.bits == 8 && t.lanes == 1) return "bool";
  const char* kind = nullptr;
  switch (static_cast<Code>(t.code)) {
    case Code::Int: kind = "int"; break;
    case Code::UInt: kind = "uint"; break;
    case Code::Float: kind = "float"; break;
    case Code::Bfloat: kind = "bfloat"; break;
    case Code::Complex: kind = "complex"; break;
    case Code::Bool: kind = "bool"; break;
    default: return "DLPack type code " + std::to_string(t.code) + " (" + std::to_string(t.bits) + " bits)";
  }
  std::string name = kind + std::to_string(t.bits);
  return t.lanes == 1 ? name : name + "x" + std::to_string(t.lanes);
}

DType to_dtype(const std::string& dtype, const std::string& name, const char* expected) {
  for (DType d : {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64, DType::kBool, DType::kInt32})
    if (dtype == dmattn::dtype_name(d)) return d;
  throw Error(Error::Kind::kType, name + ".dtype", expected, dtype);
}

// The view of an array with `ndim` dimensions, dimension d of size size(d) and stride stride(d).
template <typename Size, typename Stride>
TensorView make_view(const std::string& name, void* data, DType dtype, dmattn::Device device, std::size_t ndim,
                     Size size, Stride stride) {
  if (ndim > static_cast<std::size_t>(dmattn::kMaxRank))
    throw Error(Error::Kind::kValue, name, "at most " + std::to_string(dmattn::kMaxRank) + " dimensions",
                std::to_string(ndim) + " dimensions");
  TensorView t;
  t.data = data, t.dtype = dtype, t.device = device;
  t.ndim = static_cast<int>(ndim);
  for (int d = 0; d < t.ndim; ++d) t.shape[d] = size(d), t.stride[d] = stride(d);
  return t;
}

template <typename Array>
TensorView view(const Array& a, const std::string& name, const char* dtypes = kAnyDType) {
  const DType dtype = to_dtype(dlpack_name(a.dtype()), name, dtypes);
  dmattn::Device device;
  if (a.device_type() == nb::device::cpu::value) {
    device = {dmattn::DeviceType::kCPU, 0};
  } else if (a.device_type() == nb::device::cuda::value) {
    device = {dmattn::DeviceType::kCUDA, a.device_id()};
  } else {
    throw Error(Error::Kind::kValue, name + ".device", "a cpu or cuda array",
                "DLPack device type " + std::to_string(a.device_type()));
  }
  // DLPack strides count elements, as TensorView's do.
  return make_view(name, const_cast<void*>(static_cast<const void*>(a.data())), dtype, device, a.ndim(),
                   [&](int d) { return static_cast<std::int64_t>(a.shape(d)); }, [&](int d) { return a.stride(d); });
}

TensorView view(const Meta& a, const std::string& name, const char* dtypes = kAnyDType) {
  const auto& [dtype_name, device_type, device_index, shape, stride] = a;
  const DType dtype = to_dtype(dtype_name, name, dtypes);
  dmattn::Device device;
  if (device_type == "cpu") {
    device = {dmattn::DeviceType::kCPU, 0};
  } else if (device_type == "cuda") {
    device = {dmattn::DeviceType::kCUDA, device_index};
  } else {
    throw Error(Error::Kind::kValue, name + ".device", "a cpu or cuda array", device_type);
  }
  if (stride.size() != shape.size())
    throw Error(Error::Kind::kValue, name + ".stride", std::to_string(shape.size()) + " strides (one per dimension)",
                std::to_string(stride.size()));
  return make_view(name, nullptr, dtype, device, shape.size(), [&](int d) { return shape[d]; },
                   [&](int d) { return stride[d]; });
}

template <typename Array>
std::optional<TensorView> view(const std::optional<Array>& a, const std::string& name) {
  if (!a) return std::nullopt;
  return view(*a, name);
}

struct OptionArgs {
  std::optional<double> scale;
  double softcap;
  bool causal;
  std::int64_t window_left, window_right;
  std::optional<std::int64_t> keep_window_size;
  bool deterministic;
  std::uintptr_t stream;

  dmattn::Options options(bool return_lse) const {
    dmattn::Options o;
    o.scale = scale;
    o.softcap = softcap;
    o.causal = causal;
    o.sliding_window = {window_left, window_right};
    o.keep_window_size = keep_window_size;
    o.deterministic = deterministic;
    o.return_lse = return_lse;
    o.stream = reinterpret_cast<void*>(stream);
    return o;
  }
};

// The entry points, over arrays (In, Out: run) or over metadata (Meta: validate only).
template <typename In, typename Out>
void forward(In q, In k, In v, std::optional<In> mask, std::optional<In> bias, Out out, std::optional<Out> lse,
             std::optional<In> topk_intervals, std::optional<double> scale, double softcap, bool causal,
             std::int64_t window_left, std::int64_t window_right, std::optional<std::int64_t> keep_window_size,
             bool deterministic, std::uintptr_t stream) {
  const dmattn::Inputs in{view(q, "q"),       view(k, "k"),       view(v, "v"),
                          view(mask, "mask"), view(bias, "bias"), view(topk_intervals, "topk_intervals")};
  const TensorView o = view(out, "out");
  const std::optional<TensorView> l = view(lse, "lse");
  const dmattn::Options opts =
      OptionArgs{scale, softcap, causal, window_left, window_right, keep_window_size, deterministic, stream}
          .options(lse.has_value());
  if constexpr (kCheckOnly<In>) {
    dmattn::check_forward(in, nullptr, o, l, opts);
  } else {
    nb::gil_scoped_release release;
    dmattn::forward(in, o, l, opts);
  }
}

template <typename In, typename Out>
void backward(In q, In k, In v, std::optional<In> mask, std::optional<In> bias, In out, In dout, In lse, Out dq,
              Out dk, Out dv, std::optional<Out> dbias, std::optional<In> topk_intervals, std::optional<double> scale,
              double softcap, bool causal, std::int64_t window_left, std::int64_t window_right,
              std::optional<std::int64_t> keep_window_size, bool deterministic, std::uintptr_t stream) {
  const dmattn::Inputs in{view(q, "q"),       view(k, "k"),       view(v, "v"),
                          view(mask, "mask"), view(bias, "bias"), view(topk_intervals, "topk_intervals")};
  const dmattn::Gradients grads{view(dq, "dq"), view(dk, "dk"), view(dv, "dv"), view(dbias, "dbias")};
  const TensorView o = view(out, "out"), d = view(dout, "dout"), l = view(lse, "lse");
  const dmattn::Options opts =
      OptionArgs{scale, softcap, causal, window_left, window_right, keep_window_size, deterministic, stream}
          .options(true);
  if constexpr (kCheckOnly<In>) {
    dmattn::check_backward(in, nullptr, o, d, l, grads, opts);
  } else {
    nb::gil_scoped_release release;
    dmattn::backward(in, o, d, l, grads, opts);
  }
}

template <typename In>
dmattn::VarlenLayout layout(const In& cu_seqlens_q, const In& cu_seqlens_k, std::int64_t max_seqlen_q,
                            std::int64_t max_seqlen_k) {
  return {view(cu_seqlens_q, "cu_seqlens_q", kCuSeqlensDType), view(cu_seqlens_k, "cu_seqlens_k", kCuSeqlensDType),
          max_seqlen_q, max_seqlen_k};
}

template <typename In, typename Out>
void varlen_forward(In q, In k, In v, std::optional<In> bias, In cu_seqlens_q, In cu_seqlens_k,
                    std::int64_t max_seqlen_q, std::int64_t max_seqlen_k, Out out, std::optional<Out> lse,
                    std::optional<In> topk_intervals, std::optional<double> scale, double softcap, bool causal,
                    std::int64_t window_left, std::int64_t window_right, std::optional<std::int64_t> keep_window_size,
                    bool deterministic, std::uintptr_t stream) {
  const dmattn::Inputs in{view(q, "q"),  view(k, "k"),       view(v, "v"),
                          std::nullopt, view(bias, "bias"), view(topk_intervals, "topk_intervals")};
  const dmattn::VarlenLayout lay = layout(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const TensorView o = view(out, "out");
  const std::optional<TensorView> l = view(lse, "lse");
  const dmattn::Options opts =
      OptionArgs{scale, softcap, causal, window_left, window_right, keep_window_size, deterministic, stream}
          .options(lse.has_value());
  if constexpr (kCheckOnly<In>) {
    dmattn::check_forward(in, &lay, o, l, opts);
  } else {
    nb::gil_scoped_release release;
    dmattn::varlen_forward(in, lay, o, l, opts);
  }
}

template <typename In, typename Out>
void varlen_backward(In q, In k, In v, std::optional<In> bias, In cu_seqlens_q, In cu_seqlens_k,
                     std::int64_t max_seqlen_q, std::int64_t max_seqlen_k, In out, In dout, In lse, Out dq, Out dk,
                     Out dv, std::optional<Out> dbias, std::optional<In> topk_intervals, std::optional<double> scale,
                     double softcap, bool causal, std::int64_t window_left, std::int64_t window_right,
                     std::optional<std::int64_t> keep_window_size, bool deterministic, std::uintptr_t stream) {
  const dmattn::Inputs in{view(q, "q"),  view(k, "k"),       view(v, "v"),
                          std::nullopt, view(bias, "bias"), view(topk_intervals, "topk_intervals")};
  const dmattn::VarlenLayout lay = layout(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const dmattn::Gradients grads{view(dq, "dq"), view(dk, "dk"), view(dv, "dv"), view(dbias, "dbias")};
  const TensorView o = view(out, "out"), d = view(dout, "dout"), l = view(lse, "lse");
  const dmattn::Options opts =
      OptionArgs{scale, softcap, causal, window_left, window_right, keep_window_size, deterministic, stream}
          .options(true);
  if constexpr (kCheckOnly<In>) {
    dmattn::check_backward(in, &lay, o, d, l, grads, opts);
  } else {
    nb::gil_scoped_release release;
    dmattn::varlen_backward(in, lay, o, d, l, grads, opts);
  }
}

// select_topk: q and k are read for their shapes, dtypes and devices alone (k stands for v too).
template <typename In, typename Out>
void select_topk(In q, In k, std::optional<In> mask, std::optional<In> bias, Out intervals,
                 std::optional<double> scale, double softcap, bool causal, std::int64_t window_left,
                 std::int64_t window_right, std::optional<std::int64_t> keep_window_size, bool deterministic,
                 std::uintptr_t stream) {
  const dmattn::Inputs in{view(q, "q"), view(k, "k"), view(k, "v"), view(mask, "mask"), view(bias, "bias")};
  const TensorView i = view(intervals, "intervals");
  const dmattn::Options opts =
      OptionArgs{scale, softcap, causal, window_left, window_right, keep_window_size, deterministic, stream}
          .options(false);
  if constexpr (kCheckOnly<In>) {
    dmattn::check_select_topk(in, nullptr, opts, i);
  } else {
    nb::gil_scoped_release release;
    dmattn::select_topk(in, opts, i);
  }
}

template <typename In, typename Out>
void varlen_select_topk(In q, In k, std::optional<In> bias, In cu_seqlens_q, In cu_seqlens_k,
                        std::int64_t max_seqlen_q, std::int64_t max_seqlen_k, Out intervals,
                        std::optional<double> scale, double softcap, bool causal, std::int64_t window_left,
                        std::int64_t window_right, std::optional<std::int64_t> keep_window_size, bool deterministic,
                        std::uintptr_t stream) {
  const dmattn::Inputs in{view(q, "q"), view(k, "k"), view(k, "v"), std::nullopt, view(bias, "bias")};
  const dmattn::VarlenLayout lay = layout(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const TensorView i = view(intervals, "intervals");
  const dmattn::Options opts =
      OptionArgs{scale, softcap, causal, window_left, window_right, keep_window_size, deterministic, stream}
          .options(false);
  if constexpr (kCheckOnly<In>) {
    dmattn::check_select_topk(in, &lay, opts, i);
  } else {
    nb::gil_scoped_release release;
    dmattn::varlen_select_topk(in, lay, opts, i);
  }
}

nb::dict build_info() {
  const dmattn::BuildInfo info = dmattn::build_info();
  nb::dict d;
  d["version"] = info.version;
  d["cuda"] = info.cuda;
  d["cuda_architectures"] = info.cuda_architectures;
  d["head_dims"] = info.head_dims;
  return d;
}

// Binds an entry point: its tensor arguments, then the options as keywords.
template <typename F, typename... Tensors>
void def_entry(nb::module_& m, const char* name, F f, const char* doc, Tensors... tensors) {
  m.def(name, f, tensors..., nb::kw_only(), nb::arg("scale").none() = nb::none(), nb::arg("softcap") = 0.0,
        nb::arg("causal") = false, nb::arg("window_left") = -1, nb::arg("window_right") = -1,
        nb::arg("keep_window_size").none() = nb::none(), nb::arg("deterministic") = false,
        nb::arg("stream") = 0, doc);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "dmattn core over DLPack arrays (zero copy; outputs are preallocated by the caller)";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* type = e.kind() == Error::Kind::kType          ? PyExc_TypeError
                       : e.kind() == Error::Kind::kUnsupported ? PyExc_NotImplementedError
                                                               : PyExc_ValueError;
      PyErr_SetString(type, e.what());
    }
  });

  // Each entry point twice: over arrays, and as check_<name> over Meta tuples (validation only).
  const auto def_both = [&m](const char* name, const char* check_name, auto run, auto check, const char* doc,
                             auto... tensors) {
    def_entry(m, name, run, doc, tensors...);
    def_entry(m, check_name, check,
              "The validation of the entry point of the same name alone, with a Meta tuple (dtype name, device "
              "type, device index, shape, strides) for each array: raises what the call would raise and runs "
              "nothing (cu_seqlens values are not checked).",
              tensors...);
  };
  const auto in = [](const char* name) { return nb::arg(name).noconvert(); };
  const auto opt = [](const char* name) { return nb::arg(name).noconvert().none(); };
  // The top-k selection given (select_topk's intervals), last and optional: None selects it in the call.
  const auto intervals = [] { return nb::arg("topk_intervals").noconvert().none() = nb::none(); };
  def_both("forward", "check_forward", &forward<In, Out>, &forward<Meta, Meta>,
           "forward(q, k, v, mask, bias, out, lse, topk_intervals=None, *, options): writes out (like q) and lse "
           "((B, H, Sq) float32, or float64 for float64 inputs; None to skip).",
           in("q"), in("k"), in("v"), opt("mask"), opt("bias"), in("out"), opt("lse"), intervals());
  def_both("backward", "check_backward", &backward<In, Out>, &backward<Meta, Meta>,
           "backward(q, k, v, mask, bias, out, dout, lse, dq, dk, dv, dbias, topk_intervals=None, *, options): "
           "writes dq, dk, dv and dbias (shaped like bias: the sum over every dimension the bias broadcasts; None "
           "to skip).",
           in("q"), in("k"), in("v"), opt("mask"), opt("bias"), in("out"), in("dout"), in("lse"), in("dq"),
           in("dk"), in("dv"), opt("dbias"), intervals());
  def_both("varlen_forward", "check_varlen_forward", &varlen_forward<In, Out>, &varlen_forward<Meta, Meta>,
           "varlen_forward(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, "
           "topk_intervals=None, *, options): q (total_q, H, D), k and v (total_k, Hk, D), bias (total_k, Hb), "
           "lse (H, total_q).",
           in("q"), in("k"), in("v"), opt("bias"), in("cu_seqlens_q"), in("cu_seqlens_k"),
           nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), in("out"), opt("lse"), intervals());
  def_both("varlen_backward", "check_varlen_backward", &varlen_backward<In, Out>, &varlen_backward<Meta, Meta>,
           "varlen_backward(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, dout, "
           "lse, dq, dk, dv, dbias, topk_intervals=None, *, options).",
           in("q"), in("k"), in("v"), opt("bias"), in("cu_seqlens_q"), in("cu_seqlens_k"),
           nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), in("out"), in("dout"), in("lse"), in("dq"),
           in("dk"), in("dv"), opt("dbias"), intervals());
  def_both("select_topk", "check_select_topk", &select_topk<In, Out>, &select_topk<Meta, Meta>,
           "select_topk(q, k, mask, bias, intervals, *, options): writes the top-k selection as per-key row "
           "intervals, int32 (B, Hs, Sk, 2) with Hs = max(bias heads, mask heads), for forward and backward's "
           "topk_intervals. q and k are read for their shapes, dtypes and devices alone.",
           in("q"), in("k"), opt("mask"), opt("bias"), in("intervals"));
  def_both("varlen_select_topk", "check_varlen_select_topk", &varlen_select_topk<In, Out>,
           &varlen_select_topk<Meta, Meta>,
           "varlen_select_topk(q, k, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, intervals, *, "
           "options): intervals int32 (B, Hb, max_seqlen_k, 2).",
           in("q"), in("k"), opt("bias"), in("cu_seqlens_q"), in("cu_seqlens_k"), nb::arg("max_seqlen_q"),
           nb::arg("max_seqlen_k"), in("intervals"));
  m.def("build_info", &build_info,
        "Which backends this build holds: version, cuda (bool), cuda_architectures, head_dims.");
}
