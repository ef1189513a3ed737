"""Errors of the core surface as ValueError / TypeError / NotImplementedError with the core's message."""

import re

import pytest
import torch

import dmattn


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


@pytest.mark.parametrize("case", CASES)
def test_core_errors_surface_with_the_core_message(case):
    make, options, error, message = CASES[case]
    with pytest.raises(error, match="^" + re.escape(message)):
        dmattn.attention(*make(), **options)


def test_backward_op_errors_name_the_argument():
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = dmattn.attention(q, k, v)
    with pytest.raises(ValueError, match="dout"):
        torch.ops.dmattn.bwd(torch.randn(2, 5, 4, 7), q.detach(), k.detach(), v.detach(), None, None, None, None,
                             out.detach(), torch.zeros(2, 4, 5), None, 0.0, False, -1, -1, None, False, False)
    assert q.grad is None


VARLEN_CASES = {
    "cu_seqlens_int64": (dict(cu_q=torch.tensor([0, 3, 6])), TypeError,
                         "dmattn: cu_seqlens_q.dtype: expected a dtype dmattn takes (float16, bfloat16, float32, "
                         "float64, bool or int32), got int64"),
    "cu_seqlens_decreasing": (dict(cu_q=torch.tensor([0, 4, 3, 6], dtype=torch.int32),
                                   cu_k=torch.tensor([0, 4, 5, 6], dtype=torch.int32), max_q=4), ValueError,
                              "dmattn: cu_seqlens_q[2]: expected non-decreasing values"),
    "cu_seqlens_last": (dict(cu_q=torch.tensor([0, 3, 5], dtype=torch.int32)), ValueError,
                        "dmattn: cu_seqlens_q[2]: expected 6 (total_q), got 5"),
    "max_seqlen_small": (dict(max_q=2), ValueError, "dmattn: max_seqlen_q: expected >= every sequence length"),
    "bias_rank": (dict(bias=torch.randn(6, 2, 1)), ValueError, "dmattn: bias: expected rank 2 (total_k, Hb)"),
}


@pytest.mark.parametrize("case", VARLEN_CASES)
def test_varlen_errors(case):
    args, error, message = VARLEN_CASES[case]
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    q = torch.randn(6, 4, 8)
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    with pytest.raises(error, match="^" + re.escape(message)):
        dmattn.varlen_attention(q, k, v, args.get("cu_q", cu), args.get("cu_k", cu), args.get("max_q", 3), 3,
                                args.get("bias"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tensors_on_different_devices():
    q, k, v = _qkv(dtype=torch.float16)
    with pytest.raises(ValueError, match=re.escape("dmattn: k.device: expected cuda:0 (the device of q), got cpu")):
        dmattn.attention(q.cuda(), k, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_float32_is_a_type_error():
    with pytest.raises(TypeError, match=re.escape("dmattn: q.dtype: expected float16 or bfloat16 on CUDA")):
        dmattn.attention(*(t.cuda() for t in _qkv()))
