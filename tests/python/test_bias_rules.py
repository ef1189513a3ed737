"""The bias rules of the spec on every device: a bias entry of -inf excludes its entry exactly as the
mask does (a row of only -inf gives out 0, lse -inf and no gradient; SPEC §2), and a bias constant along
keys has a gradient of exactly zero (SPEC §4)."""

import math

import pytest
import torch

import dmattn
import reference

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _skip_unsupported(device, dtype):
    if device == "cuda" and dtype not in (torch.float16, torch.bfloat16):
        pytest.skip("CUDA takes float16 and bfloat16 only (SPEC §1)")


def _qkv(B, sq, sk, H, Hk, D, dtype, device):
    return [torch.randn(B, s, h, D, dtype=dtype, device=device).requires_grad_()
            for s, h in ((sq, H), (sk, Hk), (sk, Hk))]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 1, 1, 1), (1, 4, 1, 1), (2, 2, 13, 1), (2, 4, 13, "expand")])
def test_key_constant_bias_gradient_is_exactly_zero(shape, dtype, device):
    _skip_unsupported(device, dtype)
    B, sq, sk, H, Hk, D = 2, 13, 70, 4, 2, 16
    q, k, v = _qkv(B, sq, sk, H, Hk, D, dtype, device)
    expand = shape[3] == "expand"
    leaf = torch.randn(*shape[:3], 1, dtype=torch.float32, device=device).requires_grad_()
    bias = leaf.expand(*shape[:3], sk) if expand else leaf
    out = dmattn.attention(q, k, v, bias=bias, causal=True)
    out.backward(torch.randn_like(out))
    assert leaf.grad is not None and torch.count_nonzero(leaf.grad) == 0, leaf.grad
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", [dict(causal=True), dict(softcap=5.0), dict(causal=True, keep_window_size=5)],
                         ids=["causal", "softcap", "topk"])
def test_negative_infinity_bias_excludes_like_the_mask(options, dtype, device):
    _skip_unsupported(device, dtype)
    B, sq, sk, H, Hk, D = 2, 24, 40, 4, 2, 16
    q, k, v = _qkv(B, sq, sk, H, Hk, D, dtype, device)
    values = torch.randn(B, Hk, sq, sk)
    values[torch.rand(B, Hk, sq, sk) < 0.3] = -math.inf
    values[:, :, 1::5] = -math.inf  # rows with no key left
    bias = values.to(device, dtype).requires_grad_()
    out, lse = dmattn.attention(q, k, v, bias=bias, return_lse=True, **options)
    dout = torch.randn_like(out)
    out.backward(dout)

    def run_reference(ref_dtype):
        inputs = [t.detach().cpu().to(ref_dtype).requires_grad_() for t in (q, k, v, bias)]
        ref_out, _ = reference.attention(*inputs[:3], None, inputs[3], dtype=ref_dtype, **options)
        ref_out.backward(dout.cpu().to(ref_dtype))
        return [ref_out] + [t.grad for t in inputs]

    exact, naive = run_reference(torch.float64), run_reference(dtype)
    for name, got, ref, low in zip(("out", "dq", "dk", "dv", "dbias"), (out, q.grad, k.grad, v.grad, bias.grad),
                                   exact, naive):
        got = got.cpu().double()
        assert torch.isfinite(got).all(), f"{name}: not finite"
        error = (got - ref).abs().max().item()
        if dtype in (torch.float16, torch.bfloat16):  # SPEC §5: 2x the naive error in the dtype
            bound = 2 * (low.double() - ref).abs().max().item() + 1e-5
        else:
            bound = (1e-12 if dtype == torch.float64 else 1e-5) * ref.abs().max().item()
        assert error <= bound, f"{name}: {error} > {bound}"

    empty = torch.zeros(B, H, sq, dtype=torch.bool)
    empty[:, :, 1::5] = True
    assert (lse.cpu()[empty] == -math.inf).all()
    rows = empty.permute(0, 2, 1)  # (B, Sq, H)
    assert torch.count_nonzero(out.detach().cpu()[rows]) == 0
    assert torch.count_nonzero(q.grad.cpu()[rows]) == 0
    excluded = torch.isinf(values)
    assert torch.count_nonzero(bias.grad.cpu()[excluded]) == 0
