"""The test oracle: the spec (docs/spec.md) §2-§4 written out in plain torch, independent of dmattn.

Every (B, H, Sq, Sk) quantity is materialised; that is fine at test sizes.
"""

import math

import torch


def _heads(t, heads):
    """Broadcast a (B|1, H|Hk|1, ...) tensor's head dim to `heads` (query head h reads h // (H / n))."""
    n = t.shape[1]
    return t.repeat_interleave(heads // n, dim=1) if n != heads else t


def allowed_mask(B, H, sq, sk, mask=None, causal=False, sliding_window=None, device="cpu"):
    """mask & causal & window as a (B, H, sq, sk) bool tensor (bottom-right aligned)."""
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    allowed = torch.ones(B, H, sq, sk, dtype=torch.bool, device=device)
    if mask is not None:
        allowed = allowed & _heads(mask.to(device), H).expand(B, H, sq, sk)
    if causal:
        allowed = allowed & (j <= i)
    if sliding_window is not None:
        left, right = sliding_window
        if left >= 0:
            allowed = allowed & (j >= i - left)
        if right >= 0:
            allowed = allowed & (j <= i + right)
    return allowed


def topk_selection(bias, allowed, w):
    """SPEC §3: per row, the w allowed keys of largest bias; ties go to the larger key index."""
    sk = bias.shape[-1]
    reversed_keys = torch.arange(sk - 1, -1, -1, device=bias.device)
    values = bias.masked_fill(~allowed, -math.inf)[..., reversed_keys]
    # A stable sort of the keys in reverse order puts the larger index first among equal values.
    order = reversed_keys[torch.sort(values, dim=-1, descending=True, stable=True).indices]
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(sk, device=bias.device).expand_as(order))
    return allowed & (rank < w)


def attention(q, k, v, mask=None, bias=None, scale=None, softcap=0.0, causal=False, sliding_window=None,
              keep_window_size=None, dtype=torch.float64):
    """Returns out (B, Sq, H, D) and lse (B, H, Sq), computed in `dtype`; differentiable in q, k, v, bias."""
    B, sq, H, D = q.shape
    sk = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k, v = (_heads(t.transpose(1, 2), H) for t in (k, v))
    s = torch.einsum("bihd,bhjd->bhij", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    allowed = allowed_mask(B, H, sq, sk, mask, causal, sliding_window, q.device)
    if bias is not None:
        full_bias = _heads(bias.to(dtype), H).expand(B, H, sq, sk)
        s = s + full_bias
        allowed = allowed & (full_bias.detach() != -math.inf)  # SPEC §2: a bias of -inf excludes like the mask
        if keep_window_size is not None:
            allowed = topk_selection(full_bias.detach(), allowed, keep_window_size)
    empty_row = ~allowed.any(-1, keepdim=True)
    # Rows without an allowed key: lse = -inf, out = 0, and no gradient (the where()s keep NaN out).
    logits = torch.where(empty_row, 0.0, torch.where(allowed, s, -math.inf))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    p = torch.where(allowed, torch.exp(s - torch.where(empty_row, 0.0, lse)), 0.0)
    out = torch.einsum("bhij,bhjd->bihd", p, v)
    return out, torch.where(empty_row, -math.inf, lse).squeeze(-1)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, bias=None, dtype=torch.float64, **options):
    """Per-sequence `attention` of packed tensors; bias (total_k, Hb) is key-only."""
    outs, lses = [], []
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        seq_bias = None if bias is None else bias[k0:k1].transpose(0, 1)[None, :, None, :]
        out, lse = attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], bias=seq_bias, dtype=dtype, **options)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)
