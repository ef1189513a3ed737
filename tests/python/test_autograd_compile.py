"""gradcheck in float64, torch.library.opcheck of the ops, torch.compile(fullgraph=True) and CUDA graphs."""

import pytest
import torch

import dmattn

OPTION_SETS = {
    "plain": dict(),
    "causal_key_bias_topk": dict(causal=True, keep_window_size=3),
    "softcap_window_scale": dict(softcap=2.0, sliding_window=(3, 1), scale=0.4),
    "row_bias_topk_deterministic": dict(causal=True, keep_window_size=2, deterministic=True),
}


def _inputs(dtype=torch.float64, device="cpu", B=2, sq=7, sk=9, H=4, Hk=2, D=4, bias_rows=1):
    q = torch.randn(B, sq, H, D, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(B, sk, Hk, D, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(B, sk, Hk, D, dtype=dtype, device=device, requires_grad=True)
    bias = torch.randn(B, Hk, bias_rows, sk, dtype=dtype, device=device, requires_grad=True)
    mask = torch.rand(B, 1, 1, sk, device=device) < 0.8
    return q, k, v, mask, bias


@pytest.mark.parametrize("name", OPTION_SETS)
def test_gradcheck(name):
    options = OPTION_SETS[name]
    q, k, v, mask, bias = _inputs(bias_rows=7 if name.startswith("row") else 1)
    assert torch.autograd.gradcheck(lambda q, k, v, b: dmattn.attention(q, k, v, mask, b, **options),
                                     (q, k, v, bias), eps=1e-6, atol=1e-8)


def test_gradcheck_varlen():
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 12], dtype=torch.int32)
    q = torch.randn(8, 4, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(12, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = torch.randn(12, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: dmattn.varlen_attention(q, k, v, cu_q, cu_k, 5, 6, b, causal=True, keep_window_size=2),
        (q, k, v, bias), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("given", [False, True], ids=["selected", "given_intervals"])
def test_opcheck_batched_ops(given):
    """Schema, fake kernels, autograd registration and AOT dispatch of dmattn::select / dmattn::fwd /
    dmattn::bwd, with the selection given or made inside the ops."""
    q, k, v, mask, bias = _inputs(dtype=torch.float32)
    options = [None, 0.0, True, -1, -1, 3, False]
    select_args = (q, k, mask, [2, 1, 1, 9], bias, [2, 2, 1, 9], True, -1, -1, 3)
    torch.library.opcheck(torch.ops.dmattn.select.default, select_args)
    intervals = torch.ops.dmattn.select(*select_args) if given else None
    assert intervals is None or (intervals.shape, intervals.dtype) == ((2, 2, 9, 2), torch.int32)
    shapes = (mask, [2, 1, 1, 9], bias, [2, 2, 1, 9], intervals)
    torch.library.opcheck(torch.ops.dmattn.fwd.default, (q, k, v, *shapes, *options))
    out, lse = torch.ops.dmattn.fwd(q, k, v, *shapes, *options)
    # The backward op has no autograd formula of its own (no double backward): plain tensors.
    q, k, v, bias, out = (t.detach() for t in (q, k, v, bias, out))
    shapes = (mask, [2, 1, 1, 9], bias, [2, 2, 1, 9], intervals)
    torch.library.opcheck(torch.ops.dmattn.bwd.default, (torch.randn_like(out), q, k, v, *shapes, out, lse, *options,
                                                         True))


@pytest.mark.parametrize("given", [False, True], ids=["selected", "given_intervals"])
def test_opcheck_varlen_ops(given):
    cu_q = torch.tensor([0, 5, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 9], dtype=torch.int32)
    q = torch.randn(8, 4, 8, requires_grad=True)
    k, v = (torch.randn(9, 2, 8, requires_grad=True) for _ in range(2))
    bias = torch.randn(9, 1, requires_grad=True)
    options = [None, 0.0, True, -1, -1, 2, False]
    select_args = (q, k, bias, [9, 1], cu_q, cu_k, 5, 6, True, -1, -1, 2)
    torch.library.opcheck(torch.ops.dmattn.varlen_select.default, select_args)
    intervals = torch.ops.dmattn.varlen_select(*select_args) if given else None
    assert intervals is None or (intervals.shape, intervals.dtype) == ((2, 1, 6, 2), torch.int32)
    args = (q, k, v, bias, [9, 1], cu_q, cu_k, 5, 6, intervals, *options)
    torch.library.opcheck(torch.ops.dmattn.varlen_fwd.default, args)
    out, lse = torch.ops.dmattn.varlen_fwd(*args)
    q, k, v, bias, out = (t.detach() for t in (q, k, v, bias, out))
    torch.library.opcheck(torch.ops.dmattn.varlen_bwd.default,
                          (torch.randn_like(out), q, k, v, bias, [9, 1], cu_q, cu_k, 5, 6, intervals, out, lse,
                           *options, True))


def _loss(q, k, v, mask, bias):
    out, lse = dmattn.attention(q, k, v, mask, bias.expand(-1, -1, q.shape[1], -1), causal=True,
                                keep_window_size=4, return_lse=True)
    return (out.float().square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum(),
            out)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_forward_backward(backend, device):
    dtype = torch.float16 if device == "cuda" else torch.float32
    inputs = _inputs(dtype=dtype, device=device, sq=12, sk=12, D=8)
    eager_loss, eager_out = _loss(*inputs)
    eager_loss.backward()
    eager_grads = [t.grad.clone() for t in inputs if t.requires_grad]
    for t in inputs:
        t.grad = None

    torch._dynamo.reset()
    compiled = torch.compile(_loss, fullgraph=True, backend=backend)
    loss, out = compiled(*inputs)
    loss.backward()
    torch.testing.assert_close(out, eager_out)
    for grad, expected in zip([t.grad for t in inputs if t.requires_grad], eager_grads):
        torch.testing.assert_close(grad, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a GPU")
@pytest.mark.cuda
def test_cuda_graph_capture_forward_backward():
    q, k, v, mask, bias = _inputs(dtype=torch.bfloat16, device="cuda", sq=64, sk=64, D=64)
    static = [t.detach().clone().requires_grad_(t.requires_grad) for t in (q, k, v, mask, bias)]

    def step():
        for t in static:
            t.grad = None
        out = dmattn.attention(*static, causal=True, keep_window_size=16)
        out.float().square().sum().backward()
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    fresh = [torch.randn_like(t) if t.dtype != torch.bool else t for t in (q, k, v, mask, bias)]
    with torch.no_grad():
        for t, new in zip(static, fresh):
            t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    expected = dmattn.attention(*fresh, causal=True, keep_window_size=16)
    torch.testing.assert_close(out, expected)


def _batched_call(keep):
    q, k, v, mask, bias = _inputs(dtype=torch.float32, sq=9, sk=11)
    return (q, k, v, bias), lambda: dmattn.attention(q, k, v, mask, bias, causal=True, keep_window_size=keep)


def _varlen_call(keep):
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    q = torch.randn(12, 4, 8, requires_grad=True)
    k, v = (torch.randn(12, 2, 8, requires_grad=True) for _ in range(2))
    bias = torch.randn(12, 2, requires_grad=True)
    return (q, k, v, bias), lambda: dmattn.varlen_attention(q, k, v, cu, cu, 7, 7, bias, causal=True,
                                                            keep_window_size=keep)


@pytest.mark.filterwarnings("ignore:.*Profiler clears events:UserWarning")
@pytest.mark.parametrize("keep", [None, 3], ids=["dense", "topk"])
@pytest.mark.parametrize("make", [_batched_call, _varlen_call], ids=["batched", "varlen"])
def test_eager_calls_skip_the_dispatcher(make, keep):
    """An eager call runs the ops' bodies without the dispatcher (no dmattn op reaches the profiler) and gives
    bitwise what the ops give (forced by a dispatch mode, OpCalls), forward and every gradient."""
    from op_calls import OpCalls

    leaves, call = make(keep)
    results = []
    for through_ops in (False, True):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            if through_ops:
                with OpCalls() as ops:
                    out = call()
            else:
                out = call()
            grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        dispatched = sorted({e.name for e in prof.events() if e.name.startswith("dmattn::")})
        expected = ["dmattn::bwd", "dmattn::fwd"] if make is _batched_call else ["dmattn::varlen_bwd",
                                                                                 "dmattn::varlen_fwd"]
        if keep is not None:
            expected.append(expected[1].replace("fwd", "select"))
        assert dispatched == (sorted(expected) if through_ops else []), dispatched
        if through_ops:
            assert len(ops.names()) == len(expected) - 1  # the backward op runs after the mode has closed
        results.append((out, *grads))
    for eager, op in zip(*results):
        assert torch.equal(eager, op)


@pytest.mark.filterwarnings("ignore:.*batching rule.*")
def test_vmap_takes_the_ops():
    """torch.func.vmap over attention (functorch-wrapped tensors) goes through the ops (their batching
    fallback): the result of a loop over the mapped dim."""
    q = torch.randn(3, 1, 5, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(1, 2, 1, 6, dtype=torch.float64)
    out = torch.func.vmap(lambda q: dmattn.attention(q, k, v, bias=bias, causal=True))(q)
    expected = torch.stack([dmattn.attention(one, k, v, bias=bias, causal=True) for one in q])
    torch.testing.assert_close(out, expected)
