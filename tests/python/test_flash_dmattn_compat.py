"""The flash-dmattn compatible functions: signature, defaults and argument handling."""

import inspect

import pytest
import torch

import dmattn
import reference
from dmattn.flash_dmattn_compat import flash_dmattn_func, flash_dmattn_varlen_func


def _qkv(B=2, sq=6, sk=8, H=4, Hk=2, D=8):
    return (torch.randn(B, sq, H, D, dtype=torch.float64), torch.randn(B, sk, Hk, D, dtype=torch.float64),
            torch.randn(B, sk, Hk, D, dtype=torch.float64))


def test_signatures_match_flash_dmattn():
    assert list(inspect.signature(flash_dmattn_func).parameters) == [
        "query", "key", "value", "attn_mask", "attn_bias", "softmax_scale", "is_causal", "softcap", "deterministic",
        "return_attn_probs"]
    assert list(inspect.signature(flash_dmattn_varlen_func).parameters) == [
        "query", "key", "value", "attn_mask", "attn_bias", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
        "max_seqlen_k", "softmax_scale", "is_causal", "softcap", "deterministic", "return_attn_probs", "block_table"]
    for f in (flash_dmattn_func, flash_dmattn_varlen_func):
        defaults = [p.default for p in inspect.signature(f).parameters.values() if p.default is not inspect.Parameter.empty]
        assert all(d is None for d in defaults)


def test_defaults_are_plain_non_causal_attention():
    q, k, v = _qkv()
    torch.testing.assert_close(flash_dmattn_func(q, k, v), dmattn.attention(q, k, v), rtol=0, atol=0)


def test_positional_arguments_in_flash_dmattn_order():
    q, k, v = _qkv()
    mask = torch.rand(2, 1, 6, 8) < 0.7
    bias = torch.randn(2, 2, 1, 8, dtype=torch.float64)
    out, lse, probs = flash_dmattn_func(q, k, v, mask, bias, 0.25, True, 3.0, False, True)
    expected, expected_lse = dmattn.attention(q, k, v, mask, bias, scale=0.25, causal=True, softcap=3.0,
                                              return_lse=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)
    assert probs is None


@pytest.mark.parametrize("mask_shape,bias_shape", [
    ((2, 4, 6, 8), (2, 4, 6, 8)),
    ((2, 2, 6, 8), (2, 2, 6, 8)),
    ((2, 1, 1, 8), (2, 2, 1, 8)),
    ((1, 1, 6, 8), (1, 1, 1, 8)),
])
def test_mask_and_bias_shapes(mask_shape, bias_shape):
    q, k, v = _qkv()
    mask = torch.rand(mask_shape) < 0.7
    bias = torch.randn(bias_shape, dtype=torch.float64, requires_grad=True)
    out = flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)
    ref_bias = bias.detach().clone().requires_grad_()
    ref, _ = reference.attention(q, k, v, mask, ref_bias, causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(bias.grad, ref_bias.grad, rtol=1e-10, atol=1e-12)


def test_non_bool_mask_means_nonzero_attends():
    q, k, v = _qkv()
    mask = torch.rand(2, 1, 6, 8) < 0.6
    torch.testing.assert_close(flash_dmattn_func(q, k, v, attn_mask=mask.to(torch.float64)),
                               flash_dmattn_func(q, k, v, attn_mask=mask), rtol=0, atol=0)


def test_non_contiguous_head_dim_is_copied():
    q, k, v = _qkv(D=16)
    strided = [t[..., ::2] for t in (q, k, v)]
    torch.testing.assert_close(flash_dmattn_func(*strided),
                               dmattn.attention(*(t.contiguous() for t in strided)), rtol=0, atol=0)


def test_errors_come_from_the_core():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^dmattn: bias\.shape\[1\]: expected 4 \(H\), 2 \(Hk\) or 1"):
        flash_dmattn_func(q, k, v, attn_bias=torch.randn(2, 3, 1, 8, dtype=torch.float64))


def _varlen_inputs():
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32)
    q = torch.randn(9, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(13, 2, 8, dtype=torch.float64) for _ in range(2))
    return q, k, v, cu_q, cu_k


def test_varlen_matches_native():
    q, k, v, cu_q, cu_k = _varlen_inputs()
    bias = torch.randn(13, 2, dtype=torch.float64)
    out, lse, probs = flash_dmattn_varlen_func(q, k, v, None, bias, cu_q, cu_k, 5, 7, 0.5, True, None, None, True)
    expected, expected_lse = dmattn.varlen_attention(q, k, v, cu_q, cu_k, 5, 7, bias, scale=0.5, causal=True,
                                                     return_lse=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)
    assert probs is None


@pytest.mark.parametrize("argument,error", [
    (dict(attn_mask=torch.ones(2, 4, 5, 7, dtype=torch.bool)), NotImplementedError),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), NotImplementedError),
    (dict(max_seqlen_q=None), ValueError),
    (dict(cu_seqlens_k=None), ValueError),
])
def test_varlen_unsupported_arguments(argument, error):
    q, k, v, cu_q, cu_k = _varlen_inputs()
    kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=7)
    kwargs.update(argument)
    with pytest.raises(error, match="^dmattn: "):
        flash_dmattn_varlen_func(q, k, v, **kwargs)
