"""CUDA graph capture: dmattn makes no host syncs and takes its scratch memory
(mask tile classes, split-KV partials, backward workspaces) stream-ordered, so a
captured call replays with new input values and gives exactly the eager result."""

import pytest
import torch

import dmattn

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

# name: (B, Sq, Sk, H, Hk, mask shape, bias shape, keep_window_size). The mask case
# exercises the tile-class pre-pass, the decode case the split-KV partials and their
# combine, the top-k case the selection (with a backward: dmattn::select, its
# intervals given to the forward and the backward).
CASES = {
    "mask_bias": (2, 300, 333, 4, 2, (2, 2, 300, 333), (2, 4, 1, 333), None),
    "decode_split": (1, 1, 8191, 8, 2, None, (1, 2, 1, 8191), None),
    "topk_padding_mask": (2, 300, 333, 4, 2, (2, 1, 1, 333), (2, 2, 1, 333), 40),
}


def _static_inputs(case, requires_grad):
    B, sq, sk, H, Hk, mask_shape, bias_shape, _ = CASES[case]
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, sq, H, 64, device=dev, dtype=dt)
    k = torch.randn(B, sk, Hk, 64, device=dev, dtype=dt)
    v = torch.randn(B, sk, Hk, 64, device=dev, dtype=dt)
    mask = torch.rand(mask_shape, device=dev) < 0.7 if mask_shape else None
    bias = torch.randn(bias_shape, device=dev, dtype=dt) if bias_shape else None
    leaves = [t for t in (q, k, v, bias) if t is not None]
    for t in leaves:
        t.requires_grad_(requires_grad)
    return q, k, v, mask, bias, leaves


def _refill(tensors):
    """New random values in place: a replay must see them."""
    with torch.no_grad():
        for t in tensors:
            if t.dtype == torch.bool:
                t.copy_(torch.rand(t.shape, device=t.device) < 0.7)
            else:
                t.copy_(torch.randn_like(t))


def _warm_up(fn):
    """Runs `fn` on a side stream first, as torch's capture recipe asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_replays_with_new_inputs(case):
    q, k, v, mask, bias, _ = _static_inputs(case, requires_grad=False)

    def call():
        return dmattn.attention(q, k, v, mask=mask, bias=bias, causal=True, keep_window_size=CASES[case][-1],
                                return_lse=True)

    _warm_up(call)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call()
    for _ in range(2):
        _refill([t for t in (q, k, v, mask, bias) if t is not None])
        graph.replay()
        expected_out, expected_lse = call()
        torch.cuda.synchronize()
        assert torch.equal(out, expected_out)
        assert torch.equal(lse, expected_lse)


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_backward_replays_with_new_inputs(case):
    q, k, v, mask, bias, leaves = _static_inputs(case, requires_grad=True)
    grad_out = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def call():
        out = dmattn.attention(q, k, v, mask=mask, bias=bias, causal=True, keep_window_size=CASES[case][-1],
                               deterministic=True)
        return torch.autograd.grad(out, leaves, grad_out)

    _warm_up(call)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = call()
    for _ in range(2):
        _refill([t for t in (q, k, v, mask, bias, grad_out) if t is not None])
        graph.replay()
        expected = call()
        torch.cuda.synchronize()
        for name, got, want in zip("qkvb", grads, expected):
            assert torch.equal(got, want), f"d{name} differs after replay"
