"""PyTorch ops: dmattn's forward and backward as torch.library custom ops.

`attention` and `varlen_attention` are the native functions. They call the ops
`dmattn::fwd` / `dmattn::bwd` (and `dmattn::varlen_fwd` / `dmattn::varlen_bwd`),
which have fake (meta) kernels and autograd formulas, so autograd,
`torch.compile(fullgraph=True)` and CUDA-graph capture see one opaque op each
way, with no graph break and no host synchronisation. An eager call of plain
tensors (no torch.compile, no dispatch mode: `_eager`) runs the same op bodies
and autograd formula without the dispatcher (`_direct`), which saves about
0.1 ms of host time an op: what a small call's launches would wait on.

Top-k, planned once: where a backward will follow and the keep window's
selection is per-key row intervals (`_plans_topk`), `dmattn::select` (or
`dmattn::varlen_select`) selects first, and the forward and the backward both
take its intervals (the autograd context keeps them, O(Sk) int32 pairs a
selection head), so that the backward does not select again.

Outputs are allocated here (so the fake kernels can describe them) and written
by the core in place; every tensor is passed as a zero-copy DLPack capsule. On
CUDA the core runs on the caller's current stream (and makes q's device current
itself). The fake kernels allocate the same outputs and run the core's own
validation on the tensors' metadata (`dmattn._C.check_*`), so that tracing
(torch.compile, FakeTensorMode) raises what the call would raise.

Errors: the core's ValueError / TypeError / NotImplementedError; before it, the
public functions check what only Python can get wrong (a tensor, bool or int
argument of another type) with one helper, in the core's message format
"dmattn: <argument>: expected <expected>, got <actual>".

Broadcasting: a mask or bias dimension of stride 0 (an `expand`ed view) is read
as a broadcast dimension of size 1, so an expanded key-only bias
(B, Hb, Sq, Sk) with a stride-0 query dimension is handled as (B, Hb, 1, Sk):
nothing of size Sq * Sk is read or allocated for it, and its gradient is
computed in the reduced shape and returned as an expanded view of the bias's
shape (each aliased element holding an equal share, so that what reaches the
tensor it was expanded from is exact). The mask gets no gradient; the lse output
is not differentiable.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import has_hint, size_hint
from torch.utils.dlpack import to_dlpack

from . import _C
from ._args import checked

__all__ = ["attention", "varlen_attention"]

def _broadcast_shape(t: Optional[Tensor]) -> Optional[List[int]]:
    """The shape the core reads: 1 in every dimension that `t` broadcasts (stride 0)."""
    if t is None:
        return None
    return [1 if stride == 0 else size for size, stride in zip(t.shape, t.stride())]


def _reduce(t: Optional[Tensor], shape: Optional[List[int]]) -> Optional[Tensor]:
    """View `t` in its broadcast `shape` (the first element along each broadcast dim)."""
    if t is None:
        return None
    for dim, size in enumerate(shape):
        if size == 1 and t.shape[dim] != 1:
            t = t.narrow(dim, 0, 1)
    return t


def _lse_dtype(q: Tensor) -> torch.dtype:
    # float64 inputs keep a float64 lse, so that the float64 backward stays exact.
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _new_lse(q: Tensor, varlen: bool) -> Tensor:
    """The lse output for q: (B, H, Sq), or (H, total_q) varlen. A q of another rank gets an empty
    placeholder: the core rejects q (naming it) before it looks at lse."""
    if q.dim() != (3 if varlen else 4):
        return q.new_empty(0, dtype=_lse_dtype(q))
    return q.new_empty((q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1]),
                       dtype=_lse_dtype(q))


def _stream(q: Tensor) -> int:
    """The caller's current stream on q's device (0 on the CPU)."""
    return torch.cuda.current_stream(q.device).cuda_stream if q.device.type == "cuda" else 0


def _dl(t):
    """A DLPack capsule of tensor t (anything else, e.g. None, as it is), from torch's C exporter. Handed
    the tensor itself, nanobind calls Tensor.__dlpack__, whose stream handshake (Python: 3 to 5 us a
    tensor on an H100 host, docs/kernels.md) the core does not need: it runs on the stream it is given."""
    return to_dlpack(t.detach()) if isinstance(t, Tensor) else t


def _options(scale, softcap, causal, window_left, window_right, keep_window_size, deterministic):
    return dict(scale=scale, softcap=softcap, causal=causal, window_left=window_left,
                window_right=window_right, keep_window_size=keep_window_size, deterministic=deterministic)


def _select_options(causal, window_left, window_right, keep_window_size):
    return dict(causal=causal, window_left=window_left, window_right=window_right, keep_window_size=keep_window_size)


def _run(entry: str, q: Tensor, args, options) -> None:
    """A real kernel: the core's `entry` (dmattn._C.forward, ...) on args, on the caller's stream."""
    getattr(_C, entry)(*map(_dl, args), stream=_stream(q), **options)


def _meta(t, meta_as: str = "cpu"):
    """What the core's check_* take for a tensor: dtype name, device type and index, shape, strides;
    anything else as it is. Symbolic sizes are read as their example values, without adding a guard. A
    meta-device tensor is checked as a `meta_as` one (`_check`)."""
    if not isinstance(t, Tensor):
        return size_hint(t) if isinstance(t, torch.SymInt) else t
    device = meta_as if t.device.type == "meta" else t.device.type
    return (str(t.dtype).removeprefix("torch."), device, t.device.index or 0, [size_hint(n) for n in t.shape],
            [size_hint(n) for n in t.stride()])


def _check(entry: str, args, options) -> None:
    """A fake kernel's validation: the core's check_<entry> on the metadata of args, which raises what
    the real kernel would (but for the cu_seqlens values, which only the real one reads). Sizes without
    an example value (data-dependent ones) leave the check to the real kernel."""
    tensors = [t for t in args if isinstance(t, Tensor)]
    sizes = [n for t in tensors for n in (*t.shape, *t.stride())]
    sizes += [n for n in (*args, *options.values()) if isinstance(n, torch.SymInt)]
    # Meta tensors alone (shape inference) are checked as CPU ones, the backend that takes every valid input.
    # Beside tensors on a device they stay "meta", which the core refuses naming them: the dispatcher runs
    # this fake kernel for such a call, whose outputs on the device would be returned uninitialised.
    meta_as = "cpu" if all(t.device.type == "meta" for t in tensors) else "meta"
    if all(has_hint(n) for n in sizes):
        getattr(_C, "check_" + entry)(*(_meta(t, meta_as) for t in args),
                                      **{key: _meta(n, meta_as) for key, n in options.items()})


def _fake(call, entry: str):
    """A fake kernel: the new outputs of `call` (an op's `_*_call`), after the core's validation of `entry`
    (`_check`) on the metadata of its arguments."""
    def fake(*inputs):
        outputs, args, options = call(*inputs)
        _check(entry, args, options)
        return outputs
    return fake


def _last_dim_contiguous(t: Tensor) -> Tensor:
    # clone, not contiguous(): an empty expanded tensor counts as contiguous with its stride-0 last dim.
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.clone(memory_format=torch.contiguous_format)


def _broadcast_grad(dbias: Tensor, bias: Tensor) -> Tensor:
    """The gradient of `bias` from `dbias`, its sum over the dims that `bias` broadcasts.

    The elements of a stride-0 dim alias one element of the tensor the bias was
    expanded from; each gets an equal share of the sum, so what reaches that
    tensor (through expand's backward, which sums) is exactly dbias.
    """
    aliases = 1
    for reduced, size in zip(dbias.shape, bias.shape):
        if reduced != size:
            aliases *= size
    return (dbias / aliases if aliases > 1 else dbias).expand(bias.shape)


# --------------------------------------------------------------------------- top-k selection


def _new_intervals(q: Tensor, batch, keys, heads) -> Tensor:
    """The intervals output of a selection: int32 (batch, heads, keys, 2) on q's device."""
    return q.new_empty((batch, heads, keys, 2), dtype=torch.int32)


def _selection_heads(mask_shape: Optional[List[int]], bias_shape: Optional[List[int]], head_dim: int):
    """Hs = max(bias heads, mask heads) (Problem::topk_heads) from the heads dimension of the shapes."""
    return max(1 if shape is None else shape[head_dim] for shape in (mask_shape, bias_shape))


def _plans_topk(backward: bool, keep_window_size: Optional[int], keys, window_left: int, key_only: bool) -> bool:
    """Whether a call selects its top-k once, for its forward and its backward: a keep window below the keys
    whose selection per-key row intervals express (Problem::topk_as_intervals: a bias and at most a mask
    constant along queries (`key_only`), no left window), and a backward to follow (`backward`). A forward
    alone selects inside its op, where the backend picks per-row thresholds for a few query rows (decode)."""
    return (backward and key_only and keep_window_size is not None and keep_window_size < keys
            and window_left < 0)


def _backward_follows(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd will differentiate a call of `tensors`: grad mode on and one of them requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# The tensor types whose calls may skip the dispatcher (`_eager`), and functorch's test for its wrappers
# (vmap's and grad's tensors, of type Tensor too).
_PLAIN = (Tensor, torch.nn.Parameter)
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _eager(*tensors: Optional[Tensor]) -> bool:
    """Whether a call runs its ops' bodies directly (`_*_impl`, the forward under `_direct`) instead of through
    the dispatcher, which costs about 0.1 ms of host time an op (the custom op's Python autograd wrapper, its
    argument defaults, the dynamo guard around its kernel): a small call's launches then wait on Python. The
    same kernels either way; the ops where anything may see them: under torch.compile, under a dispatch mode
    (FakeTensorMode, functionalization, tracing), for tensor subclasses, under torch.func transforms, or with
    a meta tensor (the ops' fake kernels)."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and all(t is None or (type(t) in _PLAIN and not _functorch_wrapped(t) and t.device.type != "meta")
                    for t in tensors))


def _direct(impl, setup_context, backward, backward_impl):
    """The apply of an autograd.Function running `impl` (a forward op's body) with the op's own autograd formula
    (`setup_context`, `backward`), whose backward calls `backward_impl` (the backward op's body): the ops of
    `_eager` calls."""
    class Direct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            outputs = impl(*inputs)
            setup_context(ctx, inputs, outputs)
            return outputs

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads, bwd=backward_impl)

    return Direct.apply


def _select_impl(
    q: Tensor, k: Tensor,
    mask: Optional[Tensor], mask_shape: Optional[List[int]],
    bias: Optional[Tensor], bias_shape: Optional[List[int]],
    causal: bool, window_left: int, window_right: int, keep_window_size: int,
) -> Tensor:
    intervals, args, options = _select_call(q, k, mask, mask_shape, bias, bias_shape, causal, window_left,
                                            window_right, keep_window_size)
    _run("select_topk", q, args, options)
    return intervals


def _select_call(q, k, mask, mask_shape, bias, bias_shape, *options):
    """dmattn::select's new intervals (B, Hs, Sk, 2), and the arguments and options of its core call. q and k
    are read for their shapes, dtypes and devices alone: expanded views of one element do (the ring's)."""
    batch, keys = (q.shape[0], k.shape[1]) if q.dim() == 4 and k.dim() == 4 else (0, 0)
    intervals = _new_intervals(q, batch, keys, _selection_heads(mask_shape, bias_shape, 1))
    return intervals, (q, k, _reduce(mask, mask_shape), _reduce(bias, bias_shape), intervals), _select_options(*options)


_select = torch.library.custom_op("dmattn::select", mutates_args=())(_select_impl)
_select.register_fake(_fake(_select_call, "select_topk"))


# --------------------------------------------------------------------------- batched


def _fwd_impl(
    q: Tensor, k: Tensor, v: Tensor,
    mask: Optional[Tensor], mask_shape: Optional[List[int]],
    bias: Optional[Tensor], bias_shape: Optional[List[int]],
    topk_intervals: Optional[Tensor],
    scale: Optional[float], softcap: float, causal: bool, window_left: int, window_right: int,
    keep_window_size: Optional[int], deterministic: bool,
) -> Tuple[Tensor, Tensor]:
    outputs, args, options = _fwd_call(q, k, v, mask, mask_shape, bias, bias_shape, topk_intervals, scale, softcap,
                                       causal, window_left, window_right, keep_window_size, deterministic)
    _run("forward", q, args, options)
    return outputs


def _fwd_call(q, k, v, mask, mask_shape, bias, bias_shape, topk_intervals, *options):
    """dmattn::fwd's new outputs, and the arguments and options of its core call."""
    out, lse = q.new_empty(q.shape), _new_lse(q, varlen=False)
    args = (q, k, v, _reduce(mask, mask_shape), _reduce(bias, bias_shape), out, lse, topk_intervals)
    return (out, lse), args, _options(*options)


_fwd = torch.library.custom_op("dmattn::fwd", mutates_args=())(_fwd_impl)
_fwd.register_fake(_fake(_fwd_call, "forward"))


def _bwd_impl(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
    mask: Optional[Tensor], mask_shape: Optional[List[int]],
    bias: Optional[Tensor], bias_shape: Optional[List[int]],
    topk_intervals: Optional[Tensor], out: Tensor, lse: Tensor,
    scale: Optional[float], softcap: float, causal: bool, window_left: int, window_right: int,
    keep_window_size: Optional[int], deterministic: bool, bias_grad: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    outputs, args, options = _bwd_call(dout, q, k, v, mask, mask_shape, bias, bias_shape, topk_intervals, out, lse,
                                       scale, softcap, causal, window_left, window_right, keep_window_size,
                                       deterministic, bias_grad)
    _run("backward", q, args, options)
    return outputs


def _new_grads(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], bias_shape, bias_grad: bool):
    """dq, dk, dv, and dbias in the bias's broadcast shape (an empty tensor without bias_grad)."""
    dbias = bias.new_empty(bias_shape) if bias_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _bwd_call(dout, q, k, v, mask, mask_shape, bias, bias_shape, topk_intervals, out, lse, *options_and_bias_grad):
    """dmattn::bwd's new outputs, and the arguments and options of its core call."""
    *options, bias_grad = options_and_bias_grad
    dq, dk, dv, dbias = grads = _new_grads(q, k, v, bias, bias_shape, bias_grad)
    args = (q, k, v, _reduce(mask, mask_shape), _reduce(bias, bias_shape), out, _last_dim_contiguous(dout), lse,
            dq, dk, dv, dbias if bias_grad else None, topk_intervals)
    return grads, args, _options(*options)


_bwd = torch.library.custom_op("dmattn::bwd", mutates_args=())(_bwd_impl)
_bwd.register_fake(_fake(_bwd_call, "backward"))


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, mask, mask_shape, bias, bias_shape, topk_intervals, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, bias, topk_intervals, out, lse)
    ctx.mask_shape, ctx.bias_shape, ctx.options = mask_shape, bias_shape, options
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse, bwd=_bwd):
    q, k, v, mask, bias, topk_intervals, out, lse = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[5]
    dq, dk, dv, dbias = bwd(dout, q, k, v, mask, ctx.mask_shape, bias, ctx.bias_shape, topk_intervals, out, lse,
                            *ctx.options, bias_grad)
    dbias = _broadcast_grad(dbias, bias) if bias_grad else None
    return (dq, dk, dv, None, None, dbias, None, None) + (None,) * len(ctx.options)


_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)
_fwd_direct = _direct(_fwd_impl, _fwd_setup_context, _fwd_backward, _bwd_impl)


# --------------------------------------------------------------------------- varlen


def _varlen_select_impl(
    q: Tensor, k: Tensor,
    bias: Optional[Tensor], bias_shape: Optional[List[int]],
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    causal: bool, window_left: int, window_right: int, keep_window_size: int,
) -> Tensor:
    intervals, args, options = _varlen_select_call(q, k, bias, bias_shape, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                   max_seqlen_k, causal, window_left, window_right, keep_window_size)
    _run("varlen_select_topk", q, args, options)
    return intervals


def _varlen_select_call(q, k, bias, bias_shape, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options):
    """dmattn::varlen_select's new intervals (sequences, Hb, max_seqlen_k, 2), and its core call."""
    sequences = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q.dim() == 1 else 0
    intervals = _new_intervals(q, max(sequences, 0), max_seqlen_k, _selection_heads(None, bias_shape, 1))
    args = (q, k, _reduce(bias, bias_shape), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, intervals)
    return intervals, args, _select_options(*options)


_varlen_select = torch.library.custom_op("dmattn::varlen_select", mutates_args=())(_varlen_select_impl)
_varlen_select.register_fake(_fake(_varlen_select_call, "varlen_select_topk"))


def _varlen_fwd_impl(
    q: Tensor, k: Tensor, v: Tensor,
    bias: Optional[Tensor], bias_shape: Optional[List[int]],
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    topk_intervals: Optional[Tensor],
    scale: Optional[float], softcap: float, causal: bool, window_left: int, window_right: int,
    keep_window_size: Optional[int], deterministic: bool,
) -> Tuple[Tensor, Tensor]:
    outputs, args, options = _varlen_fwd_call(q, k, v, bias, bias_shape, cu_seqlens_q, cu_seqlens_k,
                                              max_seqlen_q, max_seqlen_k, topk_intervals, scale, softcap, causal,
                                              window_left, window_right, keep_window_size, deterministic)
    _run("varlen_forward", q, args, options)
    return outputs


def _varlen_fwd_call(q, k, v, bias, bias_shape, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     topk_intervals, *options):
    """dmattn::varlen_fwd's new outputs, and the arguments and options of its core call."""
    out, lse = q.new_empty(q.shape), _new_lse(q, varlen=True)
    args = (q, k, v, _reduce(bias, bias_shape), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse,
            topk_intervals)
    return (out, lse), args, _options(*options)


_varlen_fwd = torch.library.custom_op("dmattn::varlen_fwd", mutates_args=())(_varlen_fwd_impl)
_varlen_fwd.register_fake(_fake(_varlen_fwd_call, "varlen_forward"))


def _varlen_bwd_impl(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
    bias: Optional[Tensor], bias_shape: Optional[List[int]],
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    topk_intervals: Optional[Tensor], out: Tensor, lse: Tensor,
    scale: Optional[float], softcap: float, causal: bool, window_left: int, window_right: int,
    keep_window_size: Optional[int], deterministic: bool, bias_grad: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    outputs, args, options = _varlen_bwd_call(dout, q, k, v, bias, bias_shape, cu_seqlens_q, cu_seqlens_k,
                                              max_seqlen_q, max_seqlen_k, topk_intervals, out, lse, scale, softcap,
                                              causal, window_left, window_right, keep_window_size, deterministic,
                                              bias_grad)
    _run("varlen_backward", q, args, options)
    return outputs


def _varlen_bwd_call(dout, q, k, v, bias, bias_shape, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     topk_intervals, out, lse, *options_and_bias_grad):
    """dmattn::varlen_bwd's new outputs, and the arguments and options of its core call."""
    *options, bias_grad = options_and_bias_grad
    dq, dk, dv, dbias = grads = _new_grads(q, k, v, bias, bias_shape, bias_grad)
    args = (q, k, v, _reduce(bias, bias_shape), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out,
            _last_dim_contiguous(dout), lse, dq, dk, dv, dbias if bias_grad else None, topk_intervals)
    return grads, args, _options(*options)


_varlen_bwd = torch.library.custom_op("dmattn::varlen_bwd", mutates_args=())(_varlen_bwd_impl)
_varlen_bwd.register_fake(_fake(_varlen_bwd_call, "varlen_backward"))


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, bias, bias_shape, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk_intervals, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, topk_intervals, out, lse)
    ctx.bias_shape, ctx.max_seqlens, ctx.options = bias_shape, (max_seqlen_q, max_seqlen_k), options
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, dout, _dlse, bwd=_varlen_bwd):
    q, k, v, bias, cu_seqlens_q, cu_seqlens_k, topk_intervals, out, lse = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = bwd(dout, q, k, v, bias, ctx.bias_shape, cu_seqlens_q, cu_seqlens_k,
                            *ctx.max_seqlens, topk_intervals, out, lse, *ctx.options, bias_grad)
    dbias = _broadcast_grad(dbias, bias) if bias_grad else None
    return (dq, dk, dv, dbias) + (None,) * (6 + len(ctx.options))


_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)
_varlen_fwd_direct = _direct(_varlen_fwd_impl, _varlen_setup_context, _varlen_backward, _varlen_bwd_impl)


# --------------------------------------------------------------------------- public functions


def _window(sliding_window) -> Tuple[int, int]:
    if sliding_window is None:
        return -1, -1
    try:
        left, right = sliding_window
    except (TypeError, ValueError):
        raise ValueError(
            f"dmattn: sliding_window: expected a pair (left, right) (-1 = unbounded), got {sliding_window!r}"
        ) from None
    return checked("sliding_window.left", left, int), checked("sliding_window.right", right, int)


def _common(scale, softcap, causal, sliding_window, keep_window_size, deterministic, return_lse):
    """The options of the ops, checked (return_lse is checked only)."""
    checked("return_lse", return_lse, bool)
    softcap = checked("softcap", softcap, float, optional=True)
    return (
        checked("scale", scale, float, optional=True),
        0.0 if softcap is None else softcap,
        checked("causal", causal, bool),
        *_window(sliding_window),
        checked("keep_window_size", keep_window_size, int, optional=True),
        checked("deterministic", deterministic, bool),
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    softcap: float = 0.0,
    causal: bool = False,
    sliding_window: Optional[Tuple[int, int]] = None,
    keep_window_size: Optional[int] = None,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Attention with a boolean mask, an additive (trainable) bias and a top-k keep window.

    Args:
        q: (B, Sq, H, D). k, v: (B, Sk, Hk, D), H % Hk == 0. Last dim contiguous,
            other strides free. float16/bfloat16 (CUDA and CPU), float32/float64 (CPU).
        mask: bool, 4-D, broadcastable to (B, H, Sq, Sk) (each dim full, Hk for
            heads, or 1); True = may attend. Expanded (stride-0) views are fine.
        bias: float (q's dtype or float32), 4-D, broadcastable like the mask.
            Differentiable; its gradient has the bias's own shape.
        scale: multiplies q.k (default 1/sqrt(D)).
        softcap: s = softcap * tanh(s / softcap) before the bias (0 = off).
        causal: key j <= i + Sk - Sq (bottom-right aligned).
        sliding_window: (left, right), -1 = unbounded.
        keep_window_size: keep the w allowed keys of largest bias per row (ties to
            the larger key index); needs a bias.
        deterministic: bitwise reproducible dq as well.
        return_lse: also return lse (B, H, Sq), float32 (float64 for float64
            inputs); -inf for rows with no allowed key. Not differentiable.

    Returns:
        out (B, Sq, H, D), or (out, lse) with return_lse.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        checked(name, t, Tensor)
    checked("mask", mask, Tensor, optional=True)
    checked("bias", bias, Tensor, optional=True)
    options = _common(scale, softcap, causal, sliding_window, keep_window_size, deterministic, return_lse)
    mask_shape, bias_shape = _broadcast_shape(mask), _broadcast_shape(bias)
    causal, window_left, window_right, keep_window_size = options[2:6]
    key_only = bias is not None and all(shape is None or (len(shape) == 4 and shape[2] == 1)
                                        for shape in (mask_shape, bias_shape))
    eager = _eager(q, k, v, mask, bias)
    intervals = None
    if q.dim() == 4 and k.dim() == 4 and _plans_topk(_backward_follows(q, k, v, bias), keep_window_size,
                                                     k.shape[1], window_left, key_only):
        intervals = (_select_impl if eager else _select)(q, k, mask, mask_shape, bias, bias_shape, causal,
                                                         window_left, window_right, keep_window_size)
    out, lse = (_fwd_direct if eager else _fwd)(q, k, v, mask, mask_shape, bias, bias_shape, intervals, *options)
    return (out, lse) if return_lse else out


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    bias: Optional[Tensor] = None,
    *,
    scale: Optional[float] = None,
    softcap: float = 0.0,
    causal: bool = False,
    sliding_window: Optional[Tuple[int, int]] = None,
    keep_window_size: Optional[int] = None,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Variable-length `attention`: sequences packed along the token dimension.

    Args:
        q: (total_q, H, D). k, v: (total_k, Hk, D).
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,), cumulative lengths from 0.
        max_seqlen_q, max_seqlen_k: Python ints >= every sequence's length (no
            device-to-host copy is made to find them).
        bias: key-only (total_k, Hb), Hb in {H, Hk, 1}. Differentiable.
        Other options as in `attention`.

    Returns:
        out (total_q, H, D), or (out, lse) with lse (H, total_q).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        checked(name, t, Tensor)
    checked("bias", bias, Tensor, optional=True)
    options = _common(scale, softcap, causal, sliding_window, keep_window_size, deterministic, return_lse)
    bias_shape = _broadcast_shape(bias)
    max_seqlen_q, max_seqlen_k = checked("max_seqlen_q", max_seqlen_q, int), checked("max_seqlen_k", max_seqlen_k, int)
    causal, window_left, window_right, keep_window_size = options[2:6]
    eager = _eager(q, k, v, bias, cu_seqlens_q, cu_seqlens_k)
    intervals = None
    if _plans_topk(_backward_follows(q, k, v, bias), keep_window_size, max_seqlen_k, window_left,
                   bias is not None):
        intervals = (_varlen_select_impl if eager else _varlen_select)(
            q, k, bias, bias_shape, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left,
            window_right, keep_window_size)
    out, lse = (_varlen_fwd_direct if eager else _varlen_fwd)(
        q, k, v, bias, bias_shape, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, intervals, *options)
    return (out, lse) if return_lse else out
