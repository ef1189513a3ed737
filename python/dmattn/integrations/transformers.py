"""Hugging Face transformers integration.

Importing this module registers the attention implementation "dmattn" with
transformers' AttentionInterface and AttentionMaskInterface, so that a model
written against the attention interface runs on dmattn:

    import dmattn.integrations.transformers
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="dmattn")

The mask function hands the attention function the 2-D padding mask as it is:
causality and sliding windows are options of the dmattn call, never an
(Sq, Sk) tensor. (Custom mask functions, e.g. packed sequences detected from
position ids, are not represented; pass a 4-D bool mask for those.)

Doge models build their dynamic mask inside DogeAttention.forward, as a
(B, H, Sq, Sk) float tensor (a top-k over the key bias of every query row).
`use_dmattn_for_doge(model)` replaces that forward, layer by layer, with one that
computes only the key-only bias (B, Hk, 1, Sk) and hands it to dmattn together
with `keep_window_size`, `causal=True` and the padding mask as (B, 1, 1, Sk)
bool: the selection costs O(Sk) per head and nothing of size Sq * Sk exists.
The bias is what the stock code computes, exp(A * softplus(dt_proj(v))) of
every key, cached keys included.
"""

import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from ..ops import attention

__all__ = ["ATTN_IMPLEMENTATION", "dmattn_attention_forward", "dmattn_mask", "use_dmattn_for_doge"]

ATTN_IMPLEMENTATION = "dmattn"


def dmattn_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                **kwargs) -> Optional[Tensor]:
    """transformers mask function: the (B, kv_length) bool padding mask, or None."""
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def _attention_mask(attention_mask: Optional[Tensor]) -> Optional[Tensor]:
    """The dmattn mask of a transformers attention mask: (B, 1, 1, Sk) for a 2-D padding
    mask, as it is for a 4-D bool mask; a 4-D float mask attends where it is 0."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return attention_mask[:, None, None, :].bool()
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0


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
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                    _attention_mask(attention_mask), scale=scaling, softcap=softcap, causal=causal,
                    sliding_window=_sliding_window(sliding_window))
    return out, None


def _doge_attention_forward(self, hidden_states: Tensor, position_embeddings, attention_mask: Optional[Tensor] = None,
                            past_key_values=None, **kwargs):
    """DogeAttention.forward with the dynamic mask as dmattn's key-only bias and keep window."""
    from transformers.models.doge.modeling_doge import apply_rotary_pos_emb

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)

    # dt of every key (cached ones included): (B, Sk, Hk) -> key-only bias (B, Hk, 1, Sk).
    dt = self.dt_proj(value.transpose(1, 2).reshape(value.shape[0], value.shape[2], -1))
    bias = torch.exp(self.A * F.softplus(dt)).transpose(1, 2).unsqueeze(2)

    _check_dropout(self.attention_dropout if self.training else 0.0)
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                    _attention_mask(attention_mask), bias, scale=self.scaling, causal=True,
                    sliding_window=_sliding_window(self.config.sliding_window),
                    keep_window_size=self.keep_window_size)
    return self.o_proj(out.reshape(*input_shape, -1)), None


def use_dmattn_for_doge(model):
    """Runs every DogeAttention of `model` (e.g. a DogeForCausalLM) on dmattn, in place.

    Sets the model's attention implementation to "dmattn" (so masks are created as
    2-D padding masks) and replaces each DogeAttention's forward. Weights, state
    dict and generation are unchanged. Returns the model.
    """
    from transformers.models.doge.modeling_doge import DogeAttention

    layers = [m for m in model.modules() if isinstance(m, DogeAttention)]
    if not layers:
        raise ValueError(f"dmattn: model: expected a model with DogeAttention layers, got {type(model).__name__}")
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for layer in layers:
        layer.forward = types.MethodType(_doge_attention_forward, layer)
    return model


AttentionInterface.register(ATTN_IMPLEMENTATION, dmattn_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, dmattn_mask)
