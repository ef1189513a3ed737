// dmattn._C: the C++ API over DLPack arrays (torch, NumPy, JAX, CuPy, ...).
//
// Every array is taken as a zero-copy view: nothing is converted, copied or made
// contiguous here, and outputs (out, lse, dq, dk, dv, dbias) are allocated by the
// caller and written in place. The GIL is released while the core runs. For CUDA
// arrays the caller passes its stream (a cudaStream_t as an int; 0 = the legacy
// default stream), on which the core enqueues its work.
//
// dmattn::Error becomes ValueError (Kind::kValue), TypeError (Kind::kType) or
// NotImplementedError (Kind::kUnsupported: valid input this build or device
// cannot run, e.g. CUDA arrays before the CUDA kernels exist), with the core's
// message "dmattn: <argument>: expected <expected>, got <actual>".
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>

#include "dmattn/dmattn.h"

namespace nb = nanobind;

namespace {

using In = nb::ndarray<nb::ro>;  // an input: read-only arrays are accepted
using Out = nb::ndarray<>;       // an output: must be writable
using dmattn::DType;
using dmattn::Error;
using dmattn::TensorView;

// "int64", "uint8", "complex64", ...: a DLPack dtype in words, for messages.
std::string dlpack_name(nb::dlpack::dtype t) {
  using Code = nb::dlpack::dtype_code;
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

DType to_dtype(nb::dlpack::dtype t, const std::string& name) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(t.code);
  if (t.lanes == 1) {
    if (code == Code::Float && t.bits == 16) return DType::kFloat16;
    if (code == Code::Float && t.bits == 32) return DType::kFloat32;
    if (code == Code::Float && t.bits == 64) return DType::kFloat64;
    if (code == Code::Bfloat && t.bits == 16) return DType::kBFloat16;
    if (code == Code::Bool && t.bits == 8) return DType::kBool;
    if (code == Code::Int && t.bits == 32) return DType::kInt32;
  }
  throw Error(Error::Kind::kType, name + ".dtype",
              "a dtype dmattn takes (float16, bfloat16, float32, float64, bool or int32)", dlpack_name(t));
}

template <typename Array>
TensorView view(const Array& a, const std::string& name) {
  TensorView t;
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.dtype = to_dtype(a.dtype(), name);
  if (a.device_type() == nb::device::cpu::value) {
    t.device = {dmattn::DeviceType::kCPU, 0};
  } else if (a.device_type() == nb::device::cuda::value) {
    t.device = {dmattn::DeviceType::kCUDA, a.device_id()};
  } else {
    throw Error(Error::Kind::kValue, name + ".device", "a cpu or cuda array",
                "DLPack device type " + std::to_string(a.device_type()));
  }
  if (a.ndim() > static_cast<std::size_t>(dmattn::kMaxRank))
    throw Error(Error::Kind::kValue, name, "at most " + std::to_string(dmattn::kMaxRank) + " dimensions",
                std::to_string(a.ndim()) + " dimensions");
  t.ndim = static_cast<int>(a.ndim());
  for (int d = 0; d < t.ndim; ++d) {
    t.shape[d] = static_cast<std::int64_t>(a.shape(d));
    t.stride[d] = a.stride(d);  // DLPack strides count elements, as TensorView's do
  }
  return t;
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

void forward(In q, In k, In v, std::optional<In> mask, std::optional<In> bias, Out out, std::optional<Out> lse,
             std::optional<double> scale, double softcap, bool causal, std::int64_t window_left,
             std::int64_t window_right, std::optional<std::int64_t> keep_window_size, bool deterministic,
             std::uintptr_t stream) {
  const dmattn::Inputs in{view(q, "q"), view(k, "k"), view(v, "v"), view(mask, "mask"), view(bias, "bias")};
  const TensorView o = view(out, "out");
  const std::optional<TensorView> l = view(lse, "lse");
  const dmattn::Options opts =
      OptionArgs{scale, softcap, causal, window_left, window_right, keep_window_size, deterministic, stream}
          .options(lse.has_value());
  nb::gil_scoped_release release;
  dmattn::forward(in, o, l, opts);
}

void backward(In q, In k, In v, std::optional<In> mask, std::optional<In> bias, In out, In dout, In lse, Out dq,
              Out dk, Out dv, std::optional<Out> dbias, std::optional<double> scale, double softcap, bool causal,
              std::int64_t window_left, std::int64_t window_right, std::optional<std::int64_t> keep_window_size,
              bool deterministic, std::uintptr_t stream) {
  const dmattn::Inputs in{view(q, "q"), view(k, "k"), view(v, "v"), view(mask, "mask"), view(bias, "bias")};
  const dmattn::Gradients grads{view(dq, "dq"), view(dk, "dk"), view(dv, "dv"), view(dbias, "dbias")};
  const TensorView o = view(out, "out"), d = view(dout, "dout"), l = view(lse, "lse");
  const dmattn::Options opts =
      OptionArgs{scale, softcap, causal, window_left, window_right, keep_window_size, deterministic, stream}
          .options(true);
  nb::gil_scoped_release release;
  dmattn::backward(in, o, d, l, grads, opts);
}

dmattn::VarlenLayout layout(In cu_seqlens_q, In cu_seqlens_k, std::int64_t max_seqlen_q,
                            std::int64_t max_seqlen_k) {
  return {view(cu_seqlens_q, "cu_seqlens_q"), view(cu_seqlens_k, "cu_seqlens_k"), max_seqlen_q, max_seqlen_k};
}

void varlen_forward(In q, In k, In v, std::optional<In> bias, In cu_seqlens_q, In cu_seqlens_k,
                    std::int64_t max_seqlen_q, std::int64_t max_seqlen_k, Out out, std::optional<Out> lse,
                    std::optional<double> scale, double softcap, bool causal, std::int64_t window_left,
                    std::int64_t window_right, std::optional<std::int64_t> keep_window_size, bool deterministic,
                    std::uintptr_t stream) {
  const dmattn::Inputs in{view(q, "q"), view(k, "k"), view(v, "v"), std::nullopt, view(bias, "bias")};
  const dmattn::VarlenLayout lay = layout(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const TensorView o = view(out, "out");
  const std::optional<TensorView> l = view(lse, "lse");
  const dmattn::Options opts =
      OptionArgs{scale, softcap, causal, window_left, window_right, keep_window_size, deterministic, stream}
          .options(lse.has_value());
  nb::gil_scoped_release release;
  dmattn::varlen_forward(in, lay, o, l, opts);
}

void varlen_backward(In q, In k, In v, std::optional<In> bias, In cu_seqlens_q, In cu_seqlens_k,
                     std::int64_t max_seqlen_q, std::int64_t max_seqlen_k, In out, In dout, In lse, Out dq, Out dk,
                     Out dv, std::optional<Out> dbias, std::optional<double> scale, double softcap, bool causal,
                     std::int64_t window_left, std::int64_t window_right,
                     std::optional<std::int64_t> keep_window_size, bool deterministic, std::uintptr_t stream) {
  const dmattn::Inputs in{view(q, "q"), view(k, "k"), view(v, "v"), std::nullopt, view(bias, "bias")};
  const dmattn::VarlenLayout lay = layout(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const dmattn::Gradients grads{view(dq, "dq"), view(dk, "dk"), view(dv, "dv"), view(dbias, "dbias")};
  const TensorView o = view(out, "out"), d = view(dout, "dout"), l = view(lse, "lse");
  const dmattn::Options opts =
      OptionArgs{scale, softcap, causal, window_left, window_right, keep_window_size, deterministic, stream}
          .options(true);
  nb::gil_scoped_release release;
  dmattn::varlen_backward(in, lay, o, d, l, grads, opts);
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

  const auto in = [](const char* name) { return nb::arg(name).noconvert(); };
  const auto opt = [](const char* name) { return nb::arg(name).noconvert().none(); };
  def_entry(m, "forward", &forward,
            "forward(q, k, v, mask, bias, out, lse, *, options): writes out (like q) and lse "
            "((B, H, Sq) float32, or float64 for float64 inputs; None to skip).",
            in("q"), in("k"), in("v"), opt("mask"), opt("bias"), in("out"), opt("lse"));
  def_entry(m, "backward", &backward,
            "backward(q, k, v, mask, bias, out, dout, lse, dq, dk, dv, dbias, *, options): writes dq, dk, dv "
            "and dbias (shaped like bias: the sum over every dimension the bias broadcasts; None to skip).",
            in("q"), in("k"), in("v"), opt("mask"), opt("bias"), in("out"), in("dout"), in("lse"), in("dq"),
            in("dk"), in("dv"), opt("dbias"));
  def_entry(m, "varlen_forward", &varlen_forward,
            "varlen_forward(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, "
            "*, options): q (total_q, H, D), k and v (total_k, Hk, D), bias (total_k, Hb), lse (H, total_q).",
            in("q"), in("k"), in("v"), opt("bias"), in("cu_seqlens_q"), in("cu_seqlens_k"),
            nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), in("out"), opt("lse"));
  def_entry(m, "varlen_backward", &varlen_backward,
            "varlen_backward(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, dout, "
            "lse, dq, dk, dv, dbias, *, options).",
            in("q"), in("k"), in("v"), opt("bias"), in("cu_seqlens_q"), in("cu_seqlens_k"),
            nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), in("out"), in("dout"), in("lse"), in("dq"),
            in("dk"), in("dv"), opt("dbias"));
  m.def("build_info", &build_info,
        "Which backends this build holds: version, cuda (bool), cuda_architectures, head_dims.");
}
