"""Sequence-parallel attention over torch.distributed: Ulysses and ring.

Every rank of a process group holds one shard of the sequence: q (B, S_local, H, D),
k and v (B, S_local, Hk, D), and optionally a key-only bool mask and a key-only bias
(B or 1, H or Hk or 1, 1, S_local). `attention` returns this rank's rows of the output
(and of lse), and its backward gives every rank the gradients of its own shards,
exactly as one process computing `dmattn.attention` on the whole sequence would
(SPEC.md), up to rounding.

Layouts (`shard_sequence` and `gather_sequence` convert):
- "ulysses": rank r holds the r-th of P contiguous pieces.
- "ring": zigzag. The sequence is cut into 2P chunks and rank r holds chunks r and
  2P - 1 - r, concatenated. Under causal masking every (query chunk, key chunk)
  pair is then full, causal-diagonal with equal lengths, or empty, and every rank
  does the same work.

Ulysses (DeepSpeed-Ulysses): the sequence shards of q, k, v, mask and bias become head
shards of the whole sequence, dmattn runs on them with every option (top-k included:
each rank sees whole rows), and the output goes back to sequence shards. H must be
divisible by P. Each rank's heads are cut into C chunks (`head_chunks`), one call of
dmattn::fwd / dmattn::bwd each, pipelined (`_HeadPipeline`): chunk c + 1's pieces
arrive and chunk c - 1's results go back while chunk c computes. The kv heads (and
the bias's or mask's) are replicated to lcm(heads, P C), virtually for k and v, so
that every chunk is whole kv-head replicas with the query heads that read them; the
gradients of the replicas are summed. With a top-k keep window each chunk selects
once (dmattn::select, per-key row intervals), and its forward and backward take that
selection. Nothing head-sharded of the size of q is kept for the backward, which sends
q, k, v, out and dout again.

Ring, in G head groups (`head_chunks`: kv heads g Hk / G ... with the query heads that
read them), one after the other, so that every temporary holds one group's heads: the
k, v, mask and bias shards travel around the ring (P - 1 hops, each
overlapped with the attention of the block at hand); each block's (out, lse) is
merged into the running output with its log-sum-exp. The backward passes the shards
around again; each block's gradients come from dmattn's backward op given the
block's rows of the merged output, the block's own lse and dout scaled by
exp(lse_block - lse) (`_block_dout`). The block's own lse, not the global one: a
backend may recompute the block's softmax statistics from its keys (the CPU backend
does), which then agree with it. The dk, dv and dbias accumulators travel with their
shard and arrive at their owner after P hops, the last hop in their own dtype. Block
results are summed in float32 (float64 for float64 inputs), or on two ranks, where no
element sums more than two of them, in the inputs' dtype: one op on two computes in
float32 and rounds once, as a float32 sum rounded at the end does
(`_accumulator_dtype`). A top-k keep window below the sequence length is exact: row i's
top-w is chosen over every key, so every rank all-gathers the key-only bias and mask
(one value a key and head) and selects once for the whole sequence (dmattn::select,
per-key row intervals, O(S) a head). The blocks then fuse (`_fuses`): every rank
all-gathers k and v and makes one forward and one backward call of its rows against
the whole sequence's keys, with the intervals of every key restricted to its rows
(`_block_intervals`), and the whole-sequence dk, dv and dbias of every rank are summed
into their owners' shards (`_sum_shards`); no merge, no block dout, and the per-row
passes of the backend once for the rank's rows. Where they cannot fuse, each block's
forward and backward take the intervals of its keys restricted to its rows. The ring
takes no sliding window.

Packed (varlen) sequences are not split across shards: 3-D q is refused.
"""

import functools
import math
import types
from typing import Optional, Tuple

import torch.distributed as dist
from torch import Tensor

from .._args import checked
from ..ops import _broadcast_shape, _common, _reduce
from ._base import MODES, _check_mode, _error, _process_group, gather_sequence, shard_sequence
from ._ring import _Ring, _RingAttention, _selects
from ._ulysses import _HeadPipeline, _UlyssesAttention

__all__ = ["MODES", "attention", "gather_sequence", "shard_sequence", "use_sequence_parallel_for_doge"]


def _check_tokens(q: Tensor, k: Tensor, v: Tensor, group):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise _error(name, "a (B, S_local, heads, D) shard (packed varlen sequences cannot be split across ranks)",
                         f"a {t.dim()}-D tensor")
    if dist.get_backend(group) == "nccl" and q.device.type != "cuda":
        raise _error("q.device", "a CUDA tensor (the group's backend is nccl)", q.device)


def _key_only(name: str, t: Optional[Tensor], q: Tensor, k: Tensor) -> Optional[Tensor]:
    """A key-only mask or bias in its reduced shape (stride-0 dims narrowed to size 1)."""
    if t is None:
        return None
    reduced = _reduce(t, _broadcast_shape(t))
    if reduced.dim() != 4 or reduced.shape[2] != 1 or reduced.shape[3] != k.shape[1]:
        raise _error(name, f"a key-only shard (B or 1, heads, 1, {k.shape[1]}) (its query dim of size 1 or stride 0)",
                     tuple(t.shape))
    heads, kv_heads = q.shape[2], k.shape[2]
    if reduced.shape[1] not in (heads, kv_heads, 1):
        raise _error(f"{name}.shape[1]", f"{heads} (H), {kv_heads} (Hk) or 1 (broadcast)", t.shape[1])
    return reduced


def _ulysses_chunks(heads: int, kv_heads: int, size: int, head_chunks, topk: bool) -> int:
    """The number C of head chunks of mode="ulysses": `head_chunks`, checked, or by
    default the largest C up to 8 (up to 4 with a top-k keep window below the keys,
    `topk`) whose kv heads, replicated to lcm(Hk, P C), leave every chunk a whole number
    of query heads a kv head (H divisible by lcm(Hk, P C))."""
    if heads % size:
        raise _error("q.shape[2]", f"a head count divisible by the group size {size} (ulysses splits the heads)", heads)
    if head_chunks is None:
        return max(n for n in range(1, 5 if topk else 9) if heads % math.lcm(kv_heads, size * n) == 0)
    head_chunks = checked("head_chunks", head_chunks, int)
    if head_chunks < 1 or heads % math.lcm(kv_heads, size * head_chunks):
        raise _error("head_chunks", f"None or a count C >= 1 with H = {heads} divisible by lcm(Hk, P C) = "
                     f"lcm({kv_heads}, {size} C) (whole query heads to a kv head in each chunk)", head_chunks)
    return head_chunks


def _ring_groups(kv_heads: int, head_chunks, topk: bool) -> int:
    """The number G of head groups of mode="ring": `head_chunks`, checked (a divisor of Hk: whole
    kv heads a group), or by default the largest divisor of Hk up to 8 (up to 4 with a top-k
    keep window below the keys, `topk`)."""
    if head_chunks is None:
        return max(n for n in range(1, 5 if topk else 9) if kv_heads % n == 0)
    head_chunks = checked("head_chunks", head_chunks, int)
    if head_chunks < 1 or kv_heads % head_chunks:
        raise _error("head_chunks", f"None or a count G >= 1 dividing Hk = {kv_heads} (ring: whole kv heads in each "
                     "head group)", head_chunks)
    return head_chunks


def _check_ring(q: Tensor, k: Tensor, options, size: int):
    if q.shape[1] % 2:
        raise _error("q.shape[1]", f"a local sequence length divisible by 2 (ring: the sequence splits into 2 x {size} "
                     "zigzag chunks)", q.shape[1])
    if k.shape[1] != q.shape[1]:
        raise _error("k.shape[1]", f"{q.shape[1]} (ring: q, k and v shards of one length)", k.shape[1])
    if options[3:5] != (-1, -1):
        raise NotImplementedError(f"dmattn: sliding_window: expected None with mode='ring' (use mode='ulysses'), got "
                                  f"{options[3:5]}")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    *,
    group=None,
    mode: str = "ulysses",
    scale: Optional[float] = None,
    softcap: float = 0.0,
    causal: bool = False,
    sliding_window: Optional[Tuple[int, int]] = None,
    keep_window_size: Optional[int] = None,
    deterministic: bool = False,
    return_lse: bool = False,
    head_chunks: Optional[int] = None,
):
    """Sequence-parallel `dmattn.attention` over the ranks of `group`.

    Every rank of the group calls it with its shard of the sequence, in `mode`'s layout
    (see `shard_sequence`); all shards have the same shapes.

    Args:
        q: (B, S_local, H, D). k, v: (B, Sk_local, Hk, D), H % Hk == 0.
        mask: None or a key-only bool shard, (B or 1, H or Hk or 1, 1, Sk_local) (an
            expanded view with a stride-0 query dim counts as one), e.g. the padding mask.
        bias: None or a key-only float shard shaped like the mask. Differentiable.
        group: the torch.distributed process group (default: the world). NCCL groups
            take CUDA tensors, gloo groups CPU tensors.
        mode: "ulysses" (H divisible by the group size; every option) or "ring"
            (Sk_local == S_local, even; no sliding window).
        head_chunks: "ulysses": the number C of chunks each rank's heads are cut
            into, one dmattn call each; the all-to-alls of one chunk overlap the
            attention of the next, and the buffers in use at a time shrink with C.
            The kv heads (and a key-only mask's and bias's) are replicated to
            lcm(heads, P C), so H must be divisible by lcm(Hk, P C). Default: the
            largest such C up to 8, up to 4 with a top-k keep window below the
            sequence length (whose short calls pay each chunk's fixed costs).
            "ring": the number G of head groups (G divides Hk), one whole ring (or
            fused top-k call) each, one after the other: the ring's temporaries
            hold Hk / G kv heads and their query heads. Default: the largest
            divisor of Hk up to 8, up to 4 with a top-k keep window below the
            sequence length.
        Other options as in `dmattn.attention`; `causal` and `sliding_window` apply to
        the whole sequence.

    Returns:
        out (B, S_local, H, D), or (out, lse) with return_lse, lse (B, H, S_local):
        this rank's rows of the single-process result.
    """
    _check_mode(mode)
    group, rank, size = _process_group(group)
    _check_tokens(q, k, v, group)
    mask, bias = _key_only("mask", mask, q, k), _key_only("bias", bias, q, k)
    options = _common(scale, softcap, causal, sliding_window, keep_window_size, deterministic, return_lse)
    topk = _selects(options, size * k.shape[1])
    if mode == "ulysses":
        chunks = _ulysses_chunks(q.shape[2], k.shape[2], size, head_chunks, topk)
        pipeline = _HeadPipeline(group, rank, size, chunks, q.device)
        return _UlyssesAttention.apply(q, k, v, mask, bias, pipeline, options, return_lse)
    _check_ring(q, k, options, size)
    groups = _ring_groups(k.shape[2], head_chunks, topk)
    out, lse = _RingAttention.apply(q, k, v, mask, bias, _Ring(group, rank, size), options, groups)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- Doge


def use_sequence_parallel_for_doge(model, *, group=None, mode: str = "ulysses"):
    """Runs every DogeAttention of `model` on sequence-parallel dmattn, in place.

    `dmattn.integrations.transformers.use_dmattn_for_doge` first (the key-only bias
    and keep window), then each layer's attention call goes through `attention` over
    `group` in `mode`. Every rank then feeds the model its shard of the sequence
    (`shard_sequence` of input_ids, and of position_ids = arange(S), which the rotary
    embedding needs) and use_cache=False; the rest of a Doge layer works token by
    token. Parameter gradients are partial sums: all-reduce them over the group (as
    data parallelism does). Returns the model.
    """
    from transformers.models.doge.modeling_doge import DogeAttention

    from ..integrations import transformers as adapter

    _check_mode(mode)
    _process_group(group)
    attend = functools.partial(attention, group=group, mode=mode)

    def layer_forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        if past_key_values is not None:
            raise _error("past_key_values", "None under sequence parallelism (call the model with use_cache=False)",
                         type(past_key_values).__name__)
        if kwargs.get("cu_seq_lens_q") is not None:
            raise _error("cu_seq_lens_q", "None (packed sequences cannot be split across ranks)", "a tensor")
        return adapter.doge_dmattn_forward(self, hidden_states, position_embeddings, attention_mask, attend=attend)

    adapter.use_dmattn_for_doge(model)
    for module in model.modules():
        if isinstance(module, DogeAttention):
            module.forward = types.MethodType(layer_forward, module)
    return model
