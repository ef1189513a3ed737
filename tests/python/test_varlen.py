"""dmattn.varlen_attention against the per-sequence float64 reference."""

import pytest
import torch

import dmattn
import reference

SEQUENCES = {
    "equal": ([7, 7], [7, 7]),
    "ragged_with_empty": ([5, 0, 9, 1], [5, 3, 12, 6]),
    "decode": ([1, 1, 1], [4, 17, 9]),
}
OPTION_SETS = {
    "plain": dict(),
    "causal_topk": dict(causal=True, keep_window_size=3),
    "window_softcap": dict(sliding_window=(2, 1), softcap=4.0, scale=0.5),
}


# (options, bias heads): no bias, a shared bias, one per kv head, one per query head.
COMBINATIONS = [(name, heads) for name in OPTION_SETS for heads in (None, 1, 2, 4)
                if heads is not None or "keep_window_size" not in OPTION_SETS[name]]


@pytest.mark.parametrize("options,bias_heads", COMBINATIONS, ids=lambda x: str(x))
@pytest.mark.parametrize("lengths", SEQUENCES, ids=str)
def test_varlen_matches_reference(lengths, options, bias_heads, device):
    options = OPTION_SETS[options]
    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    len_q, len_k = SEQUENCES[lengths]
    cu_q = torch.tensor([0] + len_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + len_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 4, 8, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(int(cu_k[-1]), 2, 8, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    bias = None
    if bias_heads is not None:
        bias = torch.randn(int(cu_k[-1]), bias_heads, dtype=dtype, device=device, requires_grad=True)

    out, lse = dmattn.varlen_attention(q, k, v, cu_q.to(device), cu_k.to(device), max(len_q), max(len_k), bias,
                                       return_lse=True, **options)
    dout = torch.randn_like(out)
    out.backward(dout)

    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref_bias = None if bias is None else bias.detach().cpu().double().requires_grad_()
    ref_out, ref_lse = reference.varlen_attention(*leaves, cu_q, cu_k, ref_bias, **options)
    ref_out.backward(dout.cpu().double())
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.cpu().double(), ref_out, **tolerance)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, **tolerance)
    for got, ref in zip((q, k, v, bias), leaves + [ref_bias]):
        if ref is not None:
            torch.testing.assert_close(got.grad.cpu().double(), ref.grad, **tolerance)


def test_varlen_expanded_bias_heads():
    """A (total_k, Hb) bias expanded over heads is read as (total_k, 1); its gradient stays exact."""
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    q = torch.randn(10, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(10, 2, 8, dtype=torch.float64) for _ in range(2))
    small = torch.randn(10, 1, dtype=torch.float64, requires_grad=True)
    dmattn.varlen_attention(q, k, v, cu, cu, 6, 6, small, causal=True, keep_window_size=2).sum().backward()
    expected = small.grad.clone()
    small.grad = None
    dmattn.varlen_attention(q, k, v, cu, cu, 6, 6, small.expand(10, 4), causal=True, keep_window_size=2).sum().backward()
    torch.testing.assert_close(small.grad, expected, rtol=1e-12, atol=1e-12)
