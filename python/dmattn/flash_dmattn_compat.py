"""Drop-in replacements for flash-dmattn's `flash_dmattn_func` and `flash_dmattn_varlen_func`.

    from dmattn.flash_dmattn_compat import flash_dmattn_func, flash_dmattn_varlen_func

takes the place of `from flash_dmattn import flash_dmattn_func` with the same
argument names, defaults and return values:

- `attn_mask`: True = may attend; a non-bool mask is read as `attn_mask != 0`.
  `attn_mask` and `attn_bias` are broadcastable to (B, H, Sq, Sk) with heads in
  {H, Hk, 1} and queries in {Sq, 1}, as in flash-dmattn.
- `deterministic=None` means True, as in flash-dmattn.
- `return_attn_probs=True` returns `(out, softmax_lse, None)`: the attention
  probabilities are never materialised (they would be (B, H, Sq, Sk)).
- q, k and v whose last dimension is not contiguous are copied, as flash-dmattn
  does; masks and biases of any strides are used in place.

Errors are those of `dmattn.attention` (ValueError / TypeError with the core's
message, NotImplementedError for what this build cannot run); an argument of the
wrong Python type is named as flash-dmattn names it (`query`, `is_causal`, ...).
"""

from typing import Optional

import torch
from torch import Tensor

from ._args import checked
from .ops import attention, varlen_attention

__all__ = ["flash_dmattn_func", "flash_dmattn_varlen_func"]


def _contiguous_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _inputs_and_options(query, key, value, attn_bias, softmax_scale, is_causal, softcap, deterministic,
                        return_attn_probs):
    """query, key and value with a contiguous last dimension, and dmattn's options, after checking the
    types of the arguments both functions share."""
    tensors = [_contiguous_last(checked(name, t, Tensor))
               for name, t in (("query", query), ("key", key), ("value", value))]
    checked("attn_bias", attn_bias, Tensor, optional=True)
    checked("return_attn_probs", return_attn_probs, bool, optional=True)
    is_causal = checked("is_causal", is_causal, bool, optional=True)
    deterministic = checked("deterministic", deterministic, bool, optional=True)
    options = dict(scale=checked("softmax_scale", softmax_scale, float, optional=True),
                   softcap=checked("softcap", softcap, float, optional=True) or 0.0,
                   causal=False if is_causal is None else is_causal,
                   deterministic=True if deterministic is None else deterministic, return_lse=True)
    return tensors, options


def _result(out: Tensor, lse: Tensor, return_attn_probs: Optional[bool]):
    return (out, lse, None) if return_attn_probs else out


def flash_dmattn_func(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    attn_bias: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    is_causal: Optional[bool] = None,
    softcap: Optional[float] = None,
    deterministic: Optional[bool] = None,
    return_attn_probs: Optional[bool] = None,
):
    """flash-dmattn's `flash_dmattn_func` on dmattn.

    query (B, Sq, H, D), key and value (B, Sk, Hk, D); attn_mask (bool) and
    attn_bias broadcastable to (B, H, Sq, Sk). Returns out (B, Sq, H, D), or
    (out, softmax_lse (B, H, Sq), None) with return_attn_probs.
    """
    tensors, options = _inputs_and_options(query, key, value, attn_bias, softmax_scale, is_causal, softcap,
                                           deterministic, return_attn_probs)
    if checked("attn_mask", attn_mask, Tensor, optional=True) is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask != 0
    out, lse = attention(*tensors, attn_mask, attn_bias, **options)
    return _result(out, lse, return_attn_probs)


def flash_dmattn_varlen_func(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    attn_bias: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    is_causal: Optional[bool] = None,
    softcap: Optional[float] = None,
    deterministic: Optional[bool] = None,
    return_attn_probs: Optional[bool] = None,
    block_table: Optional[Tensor] = None,
):
    """flash-dmattn's `flash_dmattn_varlen_func` on dmattn.

    query (total_q, H, D), key and value (total_k, Hk, D), int32 cu_seqlens_q and
    cu_seqlens_k (B + 1,), max_seqlen_q and max_seqlen_k as Python ints. The bias
    is key-only, (total_k, Hb) with Hb in {H, Hk, 1}; a per-query mask or bias
    and paged KV (`block_table`) are not supported. Returns out (total_q, H, D),
    or (out, softmax_lse (H, total_q), None) with return_attn_probs.
    """
    if attn_mask is not None:
        raise NotImplementedError(
            "dmattn: attn_mask: expected None for varlen (give a key-only attn_bias (total_k, Hb) "
            "or use flash_dmattn_func), got a mask tensor"
        )
    if block_table is not None:
        raise NotImplementedError("dmattn: block_table: expected None (paged KV is not supported), got a tensor")
    for name, value_ in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                         ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value_ is None:
            raise ValueError(f"dmattn: {name}: expected a value for varlen attention, got None")
    tensors, options = _inputs_and_options(query, key, value, attn_bias, softmax_scale, is_causal, softcap,
                                           deterministic, return_attn_probs)
    out, lse = varlen_attention(*tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, attn_bias,
                                **options)
    return _result(out, lse, return_attn_probs)
