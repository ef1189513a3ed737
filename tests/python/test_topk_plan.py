"""Top-k planned once: attention and varlen_attention with a keep window select once (dmattn::select,
dmattn::varlen_select) for a forward and its backward, both ops take that selection, and the results are
those of the ops that select inside."""

import pytest
import torch

import dmattn
from op_calls import OpCalls

OPTIONS = dict(causal=True, keep_window_size=3)  # as attention passes them to the ops below
OP_OPTIONS = (None, 0.0, True, -1, -1, 3, False)


def _dtype(device):
    """float64 on the CPU; CUDA takes float16 and bfloat16 only (SPEC §1)."""
    return torch.float64 if device == "cpu" else torch.bfloat16


def _batched(device, sq=20):
    dtype = _dtype(device)
    g = torch.Generator().manual_seed(sq)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).to(device)  # noqa: E731
    q, k, v = randn(2, sq, 4, 8), randn(2, 24, 2, 8), randn(2, 24, 2, 8)
    bias = torch.randint(0, 3, (2, 2, 1, 24), generator=g).to(device, dtype)  # ties
    mask = (torch.rand(2, 1, 1, 24, generator=g) < 0.8).to(device)
    return [t.requires_grad_() for t in (q, k, v, bias)], mask


def _grads(out, leaves, dout):
    return torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("sq", [20, 9], ids=["rows", "few_rows"])
def test_attention_selects_once_for_forward_and_backward(device, sq):
    (q, k, v, bias), mask = _batched(device, sq)
    dout = torch.randn_like(q)
    with OpCalls() as ops:
        out = dmattn.attention(q, k, v, mask, bias, **OPTIONS)
        grads = _grads(out, (q, k, v, bias), dout)
    assert ops.names() == ["select", "fwd", "bwd"]
    selection = ops.args("fwd")[7]
    assert selection is not None and selection.dtype == torch.int32 and tuple(selection.shape) == (2, 2, 24, 2)
    assert ops.args("bwd")[8].data_ptr() == selection.data_ptr(), "the backward takes the forward's selection"

    # The ops that select inside: the same results, bitwise where both select by intervals (more than 16
    # rows) on the CPU; with few rows the ops' own selection is per-row thresholds, the same keys in
    # another order, and CUDA sums dq by float32 atomics in any order.
    shapes = (mask, [2, 1, 1, 24], bias, [2, 2, 1, 24], None)
    out_ref, lse_ref = torch.ops.dmattn.fwd(q, k, v, *shapes, *OP_OPTIONS)
    grads_ref = torch.ops.dmattn.bwd(dout, q.detach(), k.detach(), v.detach(), mask, [2, 1, 1, 24], bias.detach(),
                                     [2, 2, 1, 24], None, out_ref.detach(), lse_ref, *OP_OPTIONS, True)
    exact = dict(rtol=0, atol=0) if sq > 16 and device == "cpu" else {}
    torch.testing.assert_close(out, out_ref, **exact)
    for grad, expected in zip(grads, grads_ref):
        torch.testing.assert_close(grad, expected, **exact)


def test_forward_alone_selects_inside(device):
    (q, k, v, bias), mask = _batched(device)
    with torch.no_grad(), OpCalls() as ops:
        dmattn.attention(q, k, v, mask, bias, **OPTIONS)
    assert ops.names() == ["fwd"] and ops.args("fwd")[7] is None


@pytest.mark.parametrize("options", [dict(causal=True, keep_window_size=30), dict(causal=True),
                                     dict(keep_window_size=3, sliding_window=(4, 0))],
                         ids=["window_covers_keys", "no_keep_window", "left_window"])
def test_no_selection_to_plan(device, options):
    (q, k, v, bias), mask = _batched(device)
    with OpCalls() as ops:
        dmattn.attention(q, k, v, mask, bias, **options).sum().backward()
    assert ops.names() == ["fwd", "bwd"] and ops.args("fwd")[7] is None


def test_per_row_bias_is_not_planned(device):
    (q, k, v, _), mask = _batched(device)
    bias = torch.randn(2, 2, 20, 24, dtype=_dtype(device), device=device, requires_grad=True)
    with OpCalls() as ops:
        dmattn.attention(q, k, v, mask, bias, **OPTIONS).sum().backward()
    assert ops.names() == ["fwd", "bwd"]


def test_varlen_attention_selects_once(device):
    cu_q = torch.tensor([0, 20, 20, 37], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 25, 31, 50], dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(0)
    dtype = _dtype(device)
    q = torch.randn(37, 4, 8, generator=g, dtype=dtype).to(device).requires_grad_()
    k, v = (torch.randn(50, 2, 8, generator=g, dtype=dtype).to(device).requires_grad_() for _ in range(2))
    bias = torch.randint(0, 3, (50, 2), generator=g).to(device, dtype).requires_grad_()
    dout = torch.randn_like(q)
    with OpCalls() as ops:
        out = dmattn.varlen_attention(q, k, v, cu_q, cu_k, 20, 25, bias, **OPTIONS)
        grads = _grads(out, (q, k, v, bias), dout)
    assert ops.names() == ["varlen_select", "varlen_fwd", "varlen_bwd"]
    selection = ops.args("varlen_fwd")[9]
    assert tuple(selection.shape) == (3, 2, 25, 2)
    assert ops.args("varlen_bwd")[10].data_ptr() == selection.data_ptr()
    layout = (cu_q, cu_k, 20, 25, None)
    out_ref, lse_ref = torch.ops.dmattn.varlen_fwd(q, k, v, bias, [50, 2], *layout, *OP_OPTIONS)
    grads_ref = torch.ops.dmattn.varlen_bwd(dout, q.detach(), k.detach(), v.detach(), bias.detach(), [50, 2],
                                            *layout, out_ref.detach(), lse_ref, *OP_OPTIONS, True)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    for grad, expected in zip(grads, grads_ref):
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)
