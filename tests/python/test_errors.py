"""Errors of the core surface as ValueError / TypeError / NotImplementedError with the core's message; the
Python layer's own checks (argument types) use the same format, and the fake kernels raise what the real ones do."""

import re

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dmattn
from dmattn.flash_dmattn_compat import flash_dmattn_func, flash_dmattn_varlen_func


def _qkv(B=2, sq=5, sk=6, H=4, Hk=2, D=8, dtype=torch.float32):
    return (torch.randn(B, sq, H, D, dtype=dtype), torch.randn(B, sk, Hk, D, dtype=dtype),
            torch.randn(B, sk, Hk, D, dtype=dtype))


def _bias(shape=(2, 2, 1, 6), dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


CASES = {
    "q_rank": (lambda: (_qkv()[0][0], *_qkv()[1:]), {}, ValueError, "dmattn: q: expected rank 4"),
    "q_dtype": (lambda: tuple(t.to(torch.int32) for t in _qkv()), {}, TypeError, "dmattn: q.dtype: expected"),
    "k_dtype_differs": (lambda: (_qkv()[0], _qkv()[1].double(), _qkv()[2]), {}, TypeError,
                        "dmattn: k.dtype: expected float32 (the dtype of q), got float64"),
    "heads_not_divisible": (lambda: _qkv(H=4, Hk=3), {}, ValueError, "dmattn: k.shape[2]: expected a divisor of H = 4"),
    "q_last_dim_strided": (lambda: (torch.randn(2, 5, 4, 16)[..., ::2], *_qkv()[1:]), {}, ValueError,
                           "dmattn: q.stride[3]: expected 1"),
    "mask_not_bool": (lambda: (*_qkv(), torch.ones(2, 1, 1, 6)), {}, TypeError, "dmattn: mask.dtype: expected bool"),
    "mask_not_broadcastable": (lambda: (*_qkv(), torch.ones(2, 3, 1, 6, dtype=torch.bool)), {}, ValueError,
                               "dmattn: mask.shape[1]: expected 4 (H), 2 (Hk) or 1 (broadcast)"),
    "bias_int": (lambda: (*_qkv(), None, torch.ones(2, 2, 1, 6, dtype=torch.int32)), {}, TypeError,
                 "dmattn: bias.dtype: expected float32"),
    "bias_keys": (lambda: (*_qkv(), None, _bias((2, 2, 1, 5))), {}, ValueError, "dmattn: bias.shape[3]"),
    "topk_without_bias": (_qkv, dict(keep_window_size=2), ValueError,
                          "dmattn: keep_window_size: expected a bias to select keys by"),
    "topk_zero": (lambda: (*_qkv(), None, _bias()), dict(keep_window_size=0), ValueError,
                  "dmattn: keep_window_size: expected a key count > 0"),
    "window_below_minus_one": (_qkv, dict(sliding_window=(-2, 0)), ValueError,
                               "dmattn: sliding_window.left: expected >= -1"),
    "softcap_negative": (_qkv, dict(softcap=-1.0), ValueError, "dmattn: softcap: expected a finite number >= 0"),
    "window_not_a_pair": (_qkv, dict(sliding_window=3), ValueError, "dmattn: sliding_window: expected a pair"),
}


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize("case", CASES)
def test_core_errors_surface_with_the_core_message(case, fake):
    """The same error from the real kernels and, on fake tensors (torch.compile's tracing), from the fake ones."""
    make, options, error, message = CASES[case]
    with FakeTensorMode() if fake else torch.device("cpu"), pytest.raises(error, match="^" + re.escape(message)):
        dmattn.attention(*make(), **options)


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_backward_op_errors_name_the_argument(fake):
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = dmattn.attention(q, k, v)
    args = [torch.randn(2, 5, 4, 7), q.detach(), k.detach(), v.detach(), out.detach(), torch.zeros(2, 4, 5)]
    with FakeTensorMode(allow_non_fake_inputs=False) if fake else torch.device("cpu") as mode:
        if fake:
            args = [mode.from_tensor(t) for t in args]
        dout, q_, k_, v_, out_, lse = args
        with pytest.raises(ValueError, match=re.escape("dmattn: dout.shape: expected (2, 5, 4, 8) (the shape of q), "
                                                       "got (2, 5, 4, 7)")):
            torch.ops.dmattn.bwd(dout, q_, k_, v_, None, None, None, None, None, out_, lse, None, 0.0, False, -1, -1,
                                 None, False, False)
    assert q.grad is None


VARLEN_CASES = {
    "cu_seqlens_int64": (dict(cu_q=torch.tensor([0, 3, 6])), TypeError,
                         "dmattn: cu_seqlens_q.dtype: expected int32 (cumulative sequence lengths), got int64"),
    "cu_seqlens_float": (dict(cu_k=torch.tensor([0.0, 3.0, 6.0])), TypeError,
                         "dmattn: cu_seqlens_k.dtype: expected int32 (cumulative sequence lengths), got float32"),
    "q_rank": (dict(q=torch.randn(24)), ValueError, "dmattn: q: expected rank 3 (total, heads, head_dim), got rank 1"),
    "cu_seqlens_decreasing": (dict(cu_q=torch.tensor([0, 4, 3, 6], dtype=torch.int32),
                                   cu_k=torch.tensor([0, 4, 5, 6], dtype=torch.int32), max_q=4), ValueError,
                              "dmattn: cu_seqlens_q[2]: expected non-decreasing values"),
    "cu_seqlens_last": (dict(cu_q=torch.tensor([0, 3, 5], dtype=torch.int32)), ValueError,
                        "dmattn: cu_seqlens_q[2]: expected 6 (total_q), got 5"),
    "max_seqlen_small": (dict(max_q=2), ValueError, "dmattn: max_seqlen_q: expected >= every sequence length"),
    "bias_rank": (dict(bias=torch.randn(6, 2, 1)), ValueError, "dmattn: bias: expected rank 2 (total_k, Hb)"),
}


# The cu_seqlens values live on the device: the fake kernels check everything else.
VALUE_CASES = {"cu_seqlens_decreasing", "cu_seqlens_last", "max_seqlen_small"}


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize("case", VARLEN_CASES)
def test_varlen_errors(case, fake):
    if fake and case in VALUE_CASES:
        pytest.skip("checks cu_seqlens values, which only the real kernel reads")
    args, error, message = VARLEN_CASES[case]
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    tensors = [args.get("q", torch.randn(6, 4, 8)), k, v, args.get("cu_q", cu), args.get("cu_k", cu), args.get("bias")]
    with FakeTensorMode() if fake else torch.device("cpu") as mode:
        if fake:
            tensors = [None if t is None else mode.from_tensor(t) for t in tensors]
        q, k, v, cu_q, cu_k, bias = tensors
        with pytest.raises(error, match="^" + re.escape(message)):
            dmattn.varlen_attention(q, k, v, cu_q, cu_k, args.get("max_q", 3), 3, bias)


def _hf_attention(attention_mask):
    from dmattn.integrations.transformers import dmattn_attention_forward

    q, k, v = (t.transpose(1, 2) for t in _qkv())
    return dmattn_attention_forward(torch.nn.Module(), q, k, v, attention_mask)


# The Python layer's checks: what is not a tensor, a bool or an int where one is expected, named as the core names
# its arguments. (Before: AttributeError, IndexError, RuntimeError from the op schema, or a silent conversion.)
PYTHON_CASES = {
    "q_rank_2": (lambda: dmattn.attention(_qkv()[0][0, 0], *_qkv()[1:]), ValueError,
                 "dmattn: q: expected rank 4 (B, S, heads, head_dim), got rank 2"),
    "q_numpy": (lambda: dmattn.attention(_qkv()[0].numpy(), *_qkv()[1:]), TypeError,
                "dmattn: q: expected a torch.Tensor, got numpy.ndarray"),
    "mask_bool": (lambda: dmattn.attention(*_qkv(), True), TypeError,
                  "dmattn: mask: expected a torch.Tensor or None, got bool"),
    "bias_numpy": (lambda: dmattn.attention(*_qkv(), None, _bias().numpy()), TypeError,
                   "dmattn: bias: expected a torch.Tensor or None, got numpy.ndarray"),
    "causal_str": (lambda: dmattn.attention(*_qkv(), causal="no"), TypeError,
                   "dmattn: causal: expected a bool, got str"),
    "causal_int": (lambda: dmattn.attention(*_qkv(), causal=1), TypeError, "dmattn: causal: expected a bool, got int"),
    "deterministic_none": (lambda: dmattn.attention(*_qkv(), deterministic=None), TypeError,
                           "dmattn: deterministic: expected a bool, got NoneType"),
    "return_lse_int": (lambda: dmattn.attention(*_qkv(), return_lse=1), TypeError,
                       "dmattn: return_lse: expected a bool, got int"),
    "keep_window_float": (lambda: dmattn.attention(*_qkv(), None, _bias(), keep_window_size=2.5), TypeError,
                          "dmattn: keep_window_size: expected an int or None, got float"),
    "keep_window_bool": (lambda: dmattn.attention(*_qkv(), None, _bias(), keep_window_size=True), TypeError,
                         "dmattn: keep_window_size: expected an int or None, got bool"),
    "keep_window_huge": (lambda: dmattn.attention(*_qkv(), None, _bias(), keep_window_size=2 ** 64), ValueError,
                         "dmattn: keep_window_size: expected an int in [-2^63, 2^63), got 18446744073709551616"),
    "window_float": (lambda: dmattn.attention(*_qkv(), sliding_window=(2.5, 0)), TypeError,
                     "dmattn: sliding_window.left: expected an int, got float"),
    "scale_str": (lambda: dmattn.attention(*_qkv(), scale="0.5"), TypeError,
                  "dmattn: scale: expected a float or None, got str"),
    "varlen_cu_seqlens_list": (lambda: dmattn.varlen_attention(*(t[0] for t in _qkv(sq=6)), [0, 6], [0, 6], 6, 6),
                               TypeError, "dmattn: cu_seqlens_q: expected a torch.Tensor, got list"),
    "varlen_max_seqlen_float": (
        lambda: dmattn.varlen_attention(*(t[0] for t in _qkv(sq=6)), *[torch.tensor([0, 6], dtype=torch.int32)] * 2,
                                        6.5, 6),
        TypeError, "dmattn: max_seqlen_q: expected an int, got float"),
    "compat_query_numpy": (lambda: flash_dmattn_func(_qkv()[0].numpy(), *_qkv()[1:]), TypeError,
                           "dmattn: query: expected a torch.Tensor, got numpy.ndarray"),
    "compat_attn_mask_bool": (lambda: flash_dmattn_func(*_qkv(), attn_mask=False), TypeError,
                              "dmattn: attn_mask: expected a torch.Tensor or None, got bool"),
    "compat_is_causal_str": (lambda: flash_dmattn_func(*_qkv(), is_causal="yes"), TypeError,
                             "dmattn: is_causal: expected a bool or None, got str"),
    "compat_varlen_max_seqlen_float": (
        lambda: flash_dmattn_varlen_func(*(t[0] for t in _qkv(sq=6)), None, None,
                                         *[torch.tensor([0, 6], dtype=torch.int32)] * 2, 6.0, 6),
        TypeError, "dmattn: max_seqlen_q: expected an int, got float"),
    "hf_mask_int": (lambda: _hf_attention(torch.zeros(2, 1, 5, 6, dtype=torch.int64)), TypeError,
                    "dmattn: attention_mask.dtype: expected bool or a float dtype for a 4-D mask, got int64"),
    "hf_mask_rank_3": (lambda: _hf_attention(torch.zeros(2, 5, 6, dtype=torch.bool)), ValueError,
                       "dmattn: attention_mask: expected rank 2 (B, Sk) or 4 (B, H, Sq, Sk), got rank 3"),
    "hf_mask_numpy": (lambda: _hf_attention(np.ones((2, 6), dtype=bool)), TypeError,
                      "dmattn: attention_mask: expected a torch.Tensor or None, got numpy.ndarray"),
}


@pytest.mark.parametrize("case", PYTHON_CASES)
def test_python_layer_errors_name_the_argument(case):
    call, error, message = PYTHON_CASES[case]
    with pytest.raises(error, match="^" + re.escape(message)):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tensors_on_different_devices():
    q, k, v = _qkv(dtype=torch.float16)
    with pytest.raises(ValueError, match=re.escape("dmattn: k.device: expected cuda:0 (the device of q), got cpu")):
        dmattn.attention(q.cuda(), k, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_float32_is_a_type_error():
    with pytest.raises(TypeError, match=re.escape("dmattn: q.dtype: expected float16 or bfloat16 on CUDA")):
        dmattn.attention(*(t.cuda() for t in _qkv()))


def _call_with_meta(path, argument):
    """attention on CPU q, k, v with `argument` (the mask or the bias) on the meta device, by `path`."""
    q, k, v = _qkv()
    operand = (torch.ones(2, 1, 5, 6, dtype=torch.bool) if argument == "mask" else _bias()).to("meta")
    kwargs = {argument: operand}
    if path == "eager":
        return dmattn.attention(q, k, v, **kwargs)
    if path == "compiled":
        return torch.compile(lambda *a: dmattn.attention(*a, **kwargs), backend="eager", fullgraph=True)(q, k, v)
    mask, bias = kwargs.get("mask"), kwargs.get("bias")
    shape = lambda t: None if t is None else list(t.shape)  # noqa: E731
    return torch.ops.dmattn.fwd(q, k, v, mask, shape(mask), bias, shape(bias), None, None, 0.0, False, -1, -1, None,
                                False)


@pytest.mark.parametrize("argument", ["mask", "bias"])
@pytest.mark.parametrize("path", ["eager", "compiled", "op"])
def test_a_meta_tensor_beside_real_ones_is_refused(path, argument):
    """A meta tensor has no data (a module's buffer left on the meta device, say). Beside CPU tensors it is
    refused, naming it, on every path: the dispatcher would otherwise run the fake kernel for the call and
    return its uninitialised CPU outputs, a silently wrong result. (torch.compile reports the fake kernel's
    error inside its own.)"""
    message = re.escape(f"dmattn: {argument}.device: expected a cpu or cuda array, got meta")
    compiled = path == "compiled"
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError if compiled else ValueError,
                       match=message if compiled else "^" + message):
        _call_with_meta(path, argument)


def test_meta_tensors_give_meta_results():
    """All on the meta device: shapes and dtypes only (the fake kernels), forward and backward, as torch's own ops."""
    q, k, v = (t.to("meta").requires_grad_() for t in _qkv())
    bias = _bias().to("meta").requires_grad_()
    out = dmattn.attention(q, k, v, bias=bias, causal=True)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == q.dtype
    out.sum().backward()
    for t in (q, k, v, bias):
        assert t.grad.device.type == "meta" and t.grad.shape == t.shape


def test_a_meta_bias_beside_real_tensors_is_refused_varlen():
    """The same for the varlen entry point (its key-only bias, or its cu_seqlens, on the meta device)."""
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="^" + re.escape("dmattn: bias.device: expected a cpu or cuda array, got meta")):
        dmattn.varlen_attention(q, k, v, cu, cu, 5, 5, bias=torch.randn(9, 2).to("meta"))
    with pytest.raises(ValueError, match="^" + re.escape("dmattn: cu_seqlens_k.device: expected a cpu or cuda array")):
        dmattn.varlen_attention(q, k, v, cu, cu.to("meta"), 5, 5)
