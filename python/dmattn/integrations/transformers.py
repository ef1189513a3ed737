"""Hugging Face transformers integration.

Importing this module registers the attention implementation "dmattn" with
transformers' AttentionInterface and AttentionMaskInterface, so that a model
written against the attention interface runs on dmattn, Doge models included:

    import dmattn.integrations.transformers
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="dmattn")

Masks. The mask function hands the attention function the 2-D padding mask as it
is: causality and sliding windows are options of the dmattn call, never an
(Sq, Sk) tensor. (Custom mask functions, e.g. packed sequences detected from
position ids, are not represented; pass a 4-D mask for those.) A 4-D mask, which
transformers hands on as it is when a model is given one, is the whole mask, as in
eager attention: no causality or window is added to it. A bool one attends where
True. A float one is additive, as eager attention adds it to the logits: its
finite values are added (it is passed as the bias, so a learnable mask gets its
gradient) and its -inf and dtype-minimum entries are excluded (the mask
`attention_mask > finfo(dtype).min`). Other dtypes and ranks raise.

Doge. DogeAttention.forward builds its dynamic mask itself, as a (B, H, Sq, Sk)
float tensor (a top-k over the key bias of every query row), before it calls the
attention function: no attention function can avoid that tensor, only the forward
can. So this module replaces DogeAttention.forward, at class level, with a forward
that runs the stock code unless the layer's config says "dmattn". With "dmattn"
(however it was set: `attn_implementation="dmattn"` when the model is built or
loaded, `set_attn_implementation`, or `use_dmattn_for_doge`), it computes only the
key-only bias (B, Hk, 1, Sk), exp(A * softplus(dt_proj(v))) of every key (cached
keys included) as the stock code does, and hands it to dmattn with
`keep_window_size`, `causal=True` and the padding mask as (B, 1, 1, Sk) bool: the
selection costs O(Sk) per head and nothing of size Sq * Sk exists. (A 4-D float
mask given to a Doge model is read as the stock Doge code reads it: 0 attends,
anything else is excluded.)
"""

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface
from transformers.models.doge import modeling_doge

from .._args import checked
from ..ops import attention

__all__ = ["ATTN_IMPLEMENTATION", "dmattn_attention_forward", "dmattn_mask", "use_dmattn_for_doge"]

ATTN_IMPLEMENTATION = "dmattn"


def dmattn_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                **kwargs) -> Optional[Tensor]:
    """transformers mask function: the (B, kv_length) bool padding mask, or None."""
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def _attention_mask(attention_mask: Optional[Tensor]):
    """A transformers attention mask checked, and whether it is the whole mask: a (B, Sk) padding mask as
    (B, 1, 1, Sk) bool (not whole: causality and windows are options), a 4-D bool or float mask as it is."""
    if checked("attention_mask", attention_mask, Tensor, optional=True) is None:
        return None, False
    if attention_mask.dim() == 2:
        return attention_mask[:, None, None, :].bool(), False
    if attention_mask.dim() != 4:
        raise ValueError(f"dmattn: attention_mask: expected rank 2 (B, Sk) or 4 (B, H, Sq, Sk), "
                         f"got rank {attention_mask.dim()}")
    if attention_mask.dtype != torch.bool and not attention_mask.is_floating_point():
        raise TypeError(f"dmattn: attention_mask.dtype: expected bool or a float dtype for a 4-D mask, "
                        f"got {str(attention_mask.dtype).removeprefix('torch.')}")
    return attention_mask, True


def _sliding_window(window: Optional[int]):
    # transformers' window of size w: key j is seen from rows i with i - w < j (< i + w without causality).
    return None if window is None else (window - 1, window - 1)


def _check_dropout(dropout: float):
    if dropout:
        raise ValueError(f"dmattn: dropout: expected 0.0 (dmattn has no attention dropout), got {dropout}")


def dmattn_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                             scaling: Optional[float] = None, dropout: float = 0.0, softcap: Optional[float] = None,
                             sliding_window: Optional[int] = None, is_causal: Optional[bool] = None, **kwargs):
    """transformers attention function: query (B, H, Sq, D), key and value (B, Hk, Sk, D).

    Returns (out (B, Sq, H, D), None): dmattn never materialises attention weights.
    """
    _check_dropout(dropout)
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("dmattn: s_aux: expected None (attention sinks are not supported), got a tensor")
    mask, whole = _attention_mask(attention_mask)
    bias = None
    if mask is not None and mask.is_floating_point():
        # Additive: the finite entries are added as a bias (float32 unless the mask has q's dtype), the others excluded.
        bias = mask if mask.dtype in (query.dtype, torch.float32) else mask.float()
        mask = mask > torch.finfo(mask.dtype).min
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mask, bias,
                    scale=scaling, softcap=softcap, causal=causal and not whole,
                    sliding_window=None if whole else _sliding_window(sliding_window))
    return out, None


_stock_doge_attention_forward = modeling_doge.DogeAttention.forward


def _doge_attention_forward(self, hidden_states: Tensor, position_embeddings, attention_mask: Optional[Tensor] = None,
                            past_key_values=None, **kwargs):
    """DogeAttention.forward: on dmattn, with the dynamic mask as its key-only bias and keep window, when
    the layer's config says "dmattn"; the stock forward otherwise."""
    if self.config._attn_implementation != ATTN_IMPLEMENTATION:
        return _stock_doge_attention_forward(self, hidden_states, position_embeddings, attention_mask,
                                             past_key_values, **kwargs)
    return doge_dmattn_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values)


def doge_dmattn_forward(self, hidden_states: Tensor, position_embeddings, attention_mask: Optional[Tensor] = None,
                        past_key_values=None, attend=attention):
    """The dmattn forward of a DogeAttention layer; `attend` is the attention function it calls (dmattn's
    `attention`, or a sequence-parallel one of the same signature)."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = modeling_doge.apply_rotary_pos_emb(query, key, cos, sin)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)

    # dt of every key (cached ones included): (B, Sk, Hk) -> key-only bias (B, Hk, 1, Sk).
    dt = self.dt_proj(value.transpose(1, 2).reshape(value.shape[0], value.shape[2], -1))
    bias = torch.exp(self.A * F.softplus(dt)).transpose(1, 2).unsqueeze(2)

    _check_dropout(self.attention_dropout if self.training else 0.0)
    mask, whole = _attention_mask(attention_mask)
    if mask is not None and mask.is_floating_point():
        mask = mask == 0  # as the stock code reads a float mask
    out = attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mask, bias,
                 scale=self.scaling, causal=not whole,
                 sliding_window=None if whole else _sliding_window(self.config.sliding_window),
                 keep_window_size=self.keep_window_size)
    return self.o_proj(out.reshape(*input_shape, -1)), None


def use_dmattn_for_doge(model):
    """Runs every DogeAttention of `model` (e.g. a DogeForCausalLM) on dmattn, in place; returns the model.

    The same as building or loading the model with `attn_implementation="dmattn"`: the model gets its own
    copy of its config (models built from one config object share it, and stay as they are), whose
    attention implementation is set to "dmattn". Weights, state dict and generation are unchanged.
    """
    if not any(isinstance(m, modeling_doge.DogeAttention) for m in model.modules()):
        raise ValueError(f"dmattn: model: expected a model with DogeAttention layers, got {type(model).__name__}")
    copies = {}  # deepcopy's memo: the id of each object of the config (sub-configs too) -> its copy
    copy.deepcopy(model.config, copies)
    for module in model.modules():
        if hasattr(module, "config"):
            module.config = copies.get(id(module.config), module.config)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


modeling_doge.DogeAttention.forward = _doge_attention_forward
AttentionInterface.register(ATTN_IMPLEMENTATION, dmattn_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, dmattn_mask)
