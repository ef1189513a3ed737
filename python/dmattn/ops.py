"""PyTorch ops: dmattn's forward and backward as torch.library custom ops.

`attention` and `varlen_attention` are the native functions. They call the ops
`dmattn::fwd` / `dmattn::bwd` (and `dmattn::varlen_fwd` / `dmattn::varlen_bwd`),
which have fake (meta) kernels and autograd formulas, so autograd,
`torch.compile(fullgraph=True)` and CUDA-graph capture see one opaque op each
way, with no graph break and no host synchronisation.

Outputs are allocated here (so the fake kernels can describe them) and written
by the core in place; every tensor is passed as a zero-copy DLPack capsule. On
CUDA the core runs on the caller's current stream (and makes q's device current
itself).

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
from torch.utils.dlpack import to_dlpack

from . import _C

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


def _stream(q: Tensor) -> int:
    """The caller's current stream on q's device (0 on the CPU)."""
    return torch.cuda.current_stream(q.device).cuda_stream if q.device.type == "cuda" else 0


def _dl(t: Optional[Tensor]):
    """A DLPack capsule of t (None stays None), from torch's C exporter. Handed the
    tensor itself, nanobind calls Tensor.__dlpack__, whose stream handshake (Python:
    3 to 5 us a tensor on an H100 host, docs/topk-gpu.md) the core does not need:
    it runs on the stream it is given."""
    return None if t is None else to_dlpack(t.detach())


def _options(scale, softcap, causal, window_left, window_right, keep_window_size, deterministic):
    return dict(scale=scale, softcap=softcap, causal=causal, window_left=window_left,
                window_right=window_right, keep_window_size=keep_window_size, deterministic=deterministic)


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


# --------------------------------------------------------------------------- batched


@torch.library.custom_op("dmattn::fwd", mutates_args=())
def _fwd(
    q: Tensor, k: Tensor, v: Tensor,
    mask: Optional[Tensor], mask_shape: Optional[List[int]],
    bias: Optional[Tensor], bias_shape: Optional[List[int]],
    scale: Optional[float], softcap: float, causal: bool, window_left: int, window_right: int,
    keep_window_size: Optional[int], deterministic: bool,
) -> Tuple[Tensor, Tensor]:
    out = q.new_empty(q.shape)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q))
    _C.forward(_dl(q), _dl(k), _dl(v), _dl(_reduce(mask, mask_shape)), _dl(_reduce(bias, bias_shape)),
               _dl(out), _dl(lse), stream=_stream(q),
               **_options(scale, softcap, causal, window_left, window_right, keep_window_size, deterministic))
    return out, lse


@_fwd.register_fake
def _fwd_fake(q, k, v, mask, mask_shape, bias, bias_shape, scale, softcap, causal, window_left, window_right,
              keep_window_size, deterministic):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q))


@torch.library.custom_op("dmattn::bwd", mutates_args=())
def _bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
    mask: Optional[Tensor], mask_shape: Optional[List[int]],
    bias: Optional[Tensor], bias_shape: Optional[List[int]],
    out: Tensor, lse: Tensor,
    scale: Optional[float], softcap: float, causal: bool, window_left: int, window_right: int,
    keep_window_size: Optional[int], deterministic: bool, bias_grad: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    dbias = bias.new_empty(bias_shape) if bias_grad else q.new_empty(0)
    _C.backward(_dl(q), _dl(k), _dl(v), _dl(_reduce(mask, mask_shape)), _dl(_reduce(bias, bias_shape)),
                _dl(out), _dl(_last_dim_contiguous(dout.detach())), _dl(lse), _dl(dq), _dl(dk), _dl(dv),
                _dl(dbias) if bias_grad else None, stream=_stream(q),
                **_options(scale, softcap, causal, window_left, window_right, keep_window_size, deterministic))
    return dq, dk, dv, dbias


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, mask, mask_shape, bias, bias_shape, out, lse, scale, softcap, causal, window_left,
              window_right, keep_window_size, deterministic, bias_grad):
    dbias = bias.new_empty(bias_shape) if bias_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, mask, mask_shape, bias, bias_shape, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, bias, out, lse)
    ctx.mask_shape, ctx.bias_shape, ctx.options = mask_shape, bias_shape, options
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, mask, bias, out, lse = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[5]
    dq, dk, dv, dbias = _bwd(dout, q, k, v, mask, ctx.mask_shape, bias, ctx.bias_shape, out, lse,
                             *ctx.options, bias_grad)
    dbias = _broadcast_grad(dbias, bias) if bias_grad else None
    return (dq, dk, dv, None, None, dbias, None) + (None,) * len(ctx.options)


_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# --------------------------------------------------------------------------- varlen


@torch.library.custom_op("dmattn::varlen_fwd", mutates_args=())
def _varlen_fwd(
    q: Tensor, k: Tensor, v: Tensor,
    bias: Optional[Tensor], bias_shape: Optional[List[int]],
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    scale: Optional[float], softcap: float, causal: bool, window_left: int, window_right: int,
    keep_window_size: Optional[int], deterministic: bool,
) -> Tuple[Tensor, Tensor]:
    out = q.new_empty(q.shape)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))
    _C.varlen_forward(_dl(q), _dl(k), _dl(v), _dl(_reduce(bias, bias_shape)), _dl(cu_seqlens_q),
                      _dl(cu_seqlens_k), max_seqlen_q, max_seqlen_k, _dl(out), _dl(lse), stream=_stream(q),
                      **_options(scale, softcap, causal, window_left, window_right, keep_window_size,
                                 deterministic))
    return out, lse


@_varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, bias, bias_shape, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                     softcap, causal, window_left, window_right, keep_window_size, deterministic):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))


@torch.library.custom_op("dmattn::varlen_bwd", mutates_args=())
def _varlen_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
    bias: Optional[Tensor], bias_shape: Optional[List[int]],
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    out: Tensor, lse: Tensor,
    scale: Optional[float], softcap: float, causal: bool, window_left: int, window_right: int,
    keep_window_size: Optional[int], deterministic: bool, bias_grad: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    dbias = bias.new_empty(bias_shape) if bias_grad else q.new_empty(0)
    _C.varlen_backward(_dl(q), _dl(k), _dl(v), _dl(_reduce(bias, bias_shape)), _dl(cu_seqlens_q),
                       _dl(cu_seqlens_k), max_seqlen_q, max_seqlen_k, _dl(out),
                       _dl(_last_dim_contiguous(dout.detach())), _dl(lse), _dl(dq), _dl(dk), _dl(dv),
                       _dl(dbias) if bias_grad else None, stream=_stream(q),
                       **_options(scale, softcap, causal, window_left, window_right, keep_window_size,
                                  deterministic))
    return dq, dk, dv, dbias


@_varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, bias, bias_shape, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out,
                     lse, scale, softcap, causal, window_left, window_right, keep_window_size, deterministic,
                     bias_grad):
    dbias = bias.new_empty(bias_shape) if bias_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, bias, bias_shape, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, out, lse)
    ctx.bias_shape, ctx.max_seqlens, ctx.options = bias_shape, (max_seqlen_q, max_seqlen_k), options
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, dout, _dlse):
    q, k, v, bias, cu_seqlens_q, cu_seqlens_k, out, lse = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = _varlen_bwd(dout, q, k, v, bias, ctx.bias_shape, cu_seqlens_q, cu_seqlens_k,
                                    *ctx.max_seqlens, out, lse, *ctx.options, bias_grad)
    dbias = _broadcast_grad(dbias, bias) if bias_grad else None
    return (dq, dk, dv, dbias) + (None,) * (5 + len(ctx.options))


_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


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
    return int(left), int(right)


def _common(scale, softcap, causal, sliding_window, keep_window_size, deterministic):
    return (
        None if scale is None else float(scale),
        0.0 if softcap is None else float(softcap),
        bool(causal),
        *_window(sliding_window),
        None if keep_window_size is None else int(keep_window_size),
        bool(deterministic),
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
    out, lse = _fwd(q, k, v, mask, _broadcast_shape(mask), bias, _broadcast_shape(bias),
                    *_common(scale, softcap, causal, sliding_window, keep_window_size, deterministic))
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
    out, lse = _varlen_fwd(q, k, v, bias, _broadcast_shape(bias), cu_seqlens_q, cu_seqlens_k,
                           int(max_seqlen_q), int(max_seqlen_k),
                           *_common(scale, softcap, causal, sliding_window, keep_window_size, deterministic))
    return (out, lse) if return_lse else out
