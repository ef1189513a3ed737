"""How bench_gpu.py calls each system on a case: dmattn (its torch API, varlen, the seed's flash_dmattn_func,
the portable kernels under an emulated shared-memory cap), torch SDPA with one backend forced (a bias or mask
given as a materialised additive bias), FlexAttention (score_mod, mask_mod). Each maker returns (fn, notes):
fn runs the call (the forward, or the forward and the backward to every leaf with a gradient), notes say what
the system needed that the others did not.
"""
import os


def fwd_bwd(torch, forward, leaves, dout):
    """fn() running forward() and the backward to every leaf that wants a gradient."""
    wanted = [t for t in leaves if t is not None and t.requires_grad]

    def fn():
        out = forward()
        torch.autograd.grad(out, wanted, dout)
        return out.detach()

    return fn


def make_dmattn(torch, case, grad):
    import dmattn

    s = case.spec
    q, k, v, bias = case.leaves(grad)
    options = dict(softcap=s.softcap, causal=s.causal, sliding_window=s.window, keep_window_size=s.keep,
                   deterministic=s.deterministic)
    if s.varlen:
        cu = torch.arange(0, s.varlen + 1, device="cuda", dtype=torch.int32) * s.sq
        flat = [t.flatten(0, 1) for t in (q, k, v)]
        flat_bias = None if bias is None else bias[:, :, 0].transpose(1, 2).flatten(0, 1)  # (total_k, Hk)

        def forward():
            return dmattn.varlen_attention(*flat, cu, cu, s.sq, s.sq, flat_bias, **options).view(q.shape)
    elif s.api == "flash_dmattn_func":
        from dmattn.flash_dmattn_compat import flash_dmattn_func

        def forward():
            return flash_dmattn_func(q, k, v, attn_mask=case.mask, attn_bias=bias, is_causal=s.causal,
                                     softcap=s.softcap or None, deterministic=s.deterministic)
    else:
        def forward():
            return dmattn.attention(q, k, v, mask=case.mask, bias=bias, **options)

    fn = fwd_bwd(torch, forward, [q, k, v, bias], case.dout) if grad else forward
    return (emulated(fn, s.smem_cap) if s.smem_cap else fn), []


def emulated(fn, smem_cap):
    """fn run on the sm80-class kernels with `smem_cap` KiB of shared memory (the dispatch reads both settings at
    every call, the backward's too)."""
    settings = dict(DMATTN_PORTABLE="1", DMATTN_SMEM_LIMIT=str(smem_cap))

    def call():
        os.environ.update(settings)
        try:
            return fn()
        finally:
            for name in settings:
                del os.environ[name]

    return call


def make_sdpa(backend_name):
    def make(torch, case, grad):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        s = case.spec
        backend = getattr(SDPBackend, backend_name)
        q, k, v, bias = case.leaves(grad)
        notes = []
        attn_mask = None
        if bias is not None or case.mask is not None:
            attn_mask = case.dense_bias(torch, case.bias).requires_grad_(grad)
            notes.append(f"materialised bias {tuple(attn_mask.shape)}, {attn_mask.nbytes / 2**30:.1f} GiB, "
                         "built outside the timed call")
        is_causal = s.causal and attn_mask is None

        def call(repeat_kv):
            kk, vv = (k.repeat_interleave(s.group, dim=2), v.repeat_interleave(s.group, dim=2)) if repeat_kv else (k, v)
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=attn_mask,
                    is_causal=is_causal, enable_gqa=not repeat_kv)
            return out.transpose(1, 2)

        repeat_kv = False
        try:
            call(False)
        except RuntimeError:
            repeat_kv = True
            notes.append(f"no enable_gqa in this backend: k, v repeated to {s.heads} heads inside the timed call")
        wanted = [q, k, v, attn_mask]
        return (fwd_bwd(torch, lambda: call(repeat_kv), wanted, case.dout) if grad
                else lambda: call(repeat_kv)), notes

    return make


_flex = None


def make_flex(torch, case, grad):
    global _flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex is None:
        torch._dynamo.config.recompile_limit = 64
        _flex = torch.compile(flex_attention, dynamic=False)
    s = case.spec
    q, k, v, bias = case.leaves(grad)
    notes = []
    offset, group, mask = s.keys - s.sq, s.group, case.mask
    left, right = s.window if s.window is not None else (-1, -1)

    def mask_mod(b, h, qi, ki):
        keep = ki <= qi + offset if s.causal else ki >= 0
        if left >= 0:
            keep = keep & (ki >= qi + offset - left)
        if right >= 0:
            keep = keep & (ki <= qi + offset + right)
        return keep & mask[b, h // group, qi, ki] if mask is not None else keep

    block_mask = None
    if s.causal or mask is not None or s.window is not None:
        per_batch = mask is not None
        block_mask = create_block_mask(mask_mod, s.batch if per_batch else None, s.heads if per_batch else None,
                                       s.sq, s.keys, device="cuda", _compile=per_batch)
        if mask is not None:
            notes.append("mask_mod reads the bool mask")
    cap, rows = s.softcap, s.bias == "full"

    def score_mod(score, b, h, qi, ki):
        if cap:
            score = cap * torch.tanh(score / cap)
        if bias is not None:
            score = score + bias[b, h // group, qi if rows else 0, ki]
        return score

    def forward():
        out = _flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    score_mod=score_mod if cap or bias is not None else None, block_mask=block_mask, enable_gqa=True)
        return out.transpose(1, 2)

    return (fwd_bwd(torch, forward, [q, k, v, bias], case.dout) if grad else forward), notes


MAKERS = {"dmattn": make_dmattn, "SDPA flash": make_sdpa("FLASH_ATTENTION"),
          "SDPA cuDNN": make_sdpa("CUDNN_ATTENTION"), "SDPA efficient": make_sdpa("EFFICIENT_ATTENTION"),
          "FlexAttention": make_flex}
