"""The zigzag ring: K/V/mask/bias shards passed around, blocks merged by their log-sum-exp; top-k fused."""

import math
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._base import _chunks, _head_chunk, _shape, _shard, _start_gather, _wait


class _Ring:
    """Point-to-point exchange with the ring neighbours of this rank in `group`."""

    def __init__(self, group, rank, size):
        self.group, self.rank, self.size = group, rank, size
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def shift(self, tensors: List[Tensor]) -> Tuple[List[Tensor], list]:
        """Starts sending `tensors` (contiguous) to the next rank and receiving the
        previous rank's into new buffers; returns the buffers and the requests to wait on."""
        if self.size == 1:
            return tensors, []
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for tag, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for tag, t in enumerate(received)]
        return received, dist.batch_isend_irecv(ops)

    def swap(self, shards: List[Tensor]) -> List[Tensor]:
        """Sends shards[j] (contiguous, one shape) to rank j of the group for every j other than
        this rank, and returns what each rank j sent this one, at index j (shards[rank] there)."""
        received = [t if j == self.rank else torch.empty_like(t) for j, t in enumerate(shards)]
        ops = []
        for j in range(self.size):
            if j != self.rank:
                peer = dist.get_global_rank(self.group, j)
                ops += [dist.P2POp(dist.isend, shards[j], peer, self.group), dist.P2POp(dist.irecv, received[j], peer,
                                                                                          self.group)]
        _wait(dist.batch_isend_irecv(ops) if ops else [])
        return received


def _ring_block(rank: int, src: int, chunk: int, causal: bool):
    """(query rows, key columns, causal) of rank `rank`'s block against the kv shard of
    rank `src`, on zigzag shards of 2 * chunk tokens (chunks rank, 2P-1-rank): slices of
    the shards."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if src == rank:
        return everything, everything, True  # both chunks in order: causal over the shard
    if src < rank:
        return everything, slice(0, chunk), False  # only chunk src precedes our rows (all of it)
    return slice(chunk, None), everything, False  # only our chunk 2P-1-rank sees chunks src, 2P-1-src


def _accumulator_dtype(t: Tensor, size: int) -> torch.dtype:
    """The dtype the ring sums block results of `t`'s dtype in, over `size` ranks: float32
    (float64 for float64), or t's own where no element sums more than two (size <= 2): an
    op on two of them computes in float32 and rounds once, as a float32 sum rounded at the
    end does."""
    if size <= 2:
        return t.dtype
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class _RingAttention(torch.autograd.Function):
    """Ring attention on zigzag shards, in `groups` head groups one after the other: group g
    is kv heads g Hk / G ... (g + 1) Hk / G - 1 with the query heads that read them (and
    the mask's, bias's and selection's heads of those, or all of a tensor of one head), a
    whole ring of its own, so that every temporary (the shard in transit, block outputs
    and gradients, accumulators, the fused call's whole-sequence k, v, dk and dv) holds
    the group's heads only. `options` is dmattn::fwd's option tuple; mask and bias are
    key-only and in their reduced shape (no stride-0 dims). A keep window below the
    sequence length is selected once, for the whole sequence and every head, from the
    all-gathered key-only mask and bias (`_ring_selection`); then, where `_fuses` allows,
    each group's blocks fuse into one call over its all-gathered k and v
    (`_fused_forward`), otherwise each ring block takes its share of the selection
    (`_block_intervals`)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, ring, options, groups):
        chunk, causal = q.shape[1] // 2, options[2]
        ctx.ring, ctx.options, ctx.groups, ctx.fused = ring, options, groups, False
        selection = None
        if _selects(options, ring.size * q.shape[1]):
            mask_all, bias_all = _gather_key_only(mask, bias, ring)
            if _fuses(q, chunk, causal):
                ctx.fused = True
                return _fused_forward(ctx, q, k, v, mask_all, bias_all, ring, options, groups)
            selection = _ring_selection(q, k, mask_all, bias_all, ring.size, options)
        out, lse, block_lse = _Heads(q, 2, groups), [], []
        for g in range(groups):
            q_g, k_g, v_g = (_head_chunk(t, 2, g, groups) for t in (q, k, v))
            mask_g, bias_g, selection_g = (_head_chunk(t, 1, g, groups) for t in (mask, bias, selection))
            lse_g = None
            for block, (k_b, v_b, mask_b, bias_b) in _ring_walk(ring, k_g, v_g, mask_g, bias_g, chunk, causal):
                out_b, lse_b = torch.ops.dmattn.fwd(q_g[:, block.rows], k_b, v_b, mask_b, _shape(mask_b), bias_b,
                                                    _shape(bias_b), _block_intervals(selection_g, block, chunk),
                                                    options[0], options[1], block.causal, *options[3:])
                block_lse.append(lse_b)
                if lse_g is None:
                    acc, lse_g = out_b.to(_accumulator_dtype(q, ring.size)), lse_b.clone()
                else:
                    _merge(acc[:, block.rows], lse_g[..., block.rows], out_b, lse_b)
                del out_b
            out.put(g, acc)
            lse.append(lse_g)
            del acc
        out, lse = out.whole, torch.cat(lse, 1)
        ctx.save_for_backward(q, k, v, mask, bias, selection, out, lse, *block_lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if ctx.fused:
            return _fused_backward(ctx, dout)
        q, k, v, mask, bias, selection, out, lse, *block_lse = ctx.saved_tensors
        ring, options, groups = ctx.ring, ctx.options, ctx.groups
        bias_grad = bias is not None and ctx.needs_input_grad[4]
        chunk, causal, acc = q.shape[1] // 2, options[2], _accumulator_dtype(q, ring.size)
        dq, dk, dv = (_Heads(t, 2, groups) for t in (q, k, v))
        dbias = []
        for g in range(groups):
            q_g, k_g, v_g, out_g, dout_g = (_head_chunk(t, 2, g, groups) for t in (q, k, v, out, dout))
            mask_g, bias_g, selection_g = (_head_chunk(t, 1, g, groups) for t in (mask, bias, selection))
            lse_g = _head_chunk(lse, 1, g, groups)
            owners = [t for t in (k_g, v_g, bias_g if bias_grad else None) if t is not None]
            # dk, dv (and dbias) of the shard at hand travel one hop behind the shard, in the accumulator dtype,
            # and the last hop, home, in their own (rounded as they would be there).
            pending = []
            walk = _ring_walk(ring, k_g, v_g, mask_g, bias_g, chunk, causal)
            lses = block_lse[g * ring.size:(g + 1) * ring.size]
            for step, (lse_b, (block, (k_b, v_b, mask_b, bias_b))) in enumerate(zip(lses, walk)):
                rows, cols = block.rows, block.cols
                dq_b, *grads_b = torch.ops.dmattn.bwd(
                    _block_dout(dout_g[:, rows], lse_b, lse_g[..., rows]), q_g[:, rows], k_b, v_b, mask_b,
                    _shape(mask_b), bias_b, _shape(bias_b), _block_intervals(selection_g, block, chunk),
                    out_g[:, rows], lse_b, options[0], options[1], block.causal, *options[3:], bias_grad)
                grads_b = grads_b[:len(owners)]
                if step == 0:  # the rank's own shard: all its rows and keys
                    dq_acc, grads = dq_b.to(acc), [t.to(acc) for t in grads_b]
                else:
                    dq_acc[:, rows] += dq_b
                    _wait(pending)
                    for t, t_b, keys in zip(grads, grads_b, ((slice(None), cols), (slice(None), cols), (..., cols))):
                        t[keys] += t_b
                del dq_b, grads_b
                if step + 1 == ring.size:
                    grads = [t.to(o.dtype) for t, o in zip(grads, owners)]
                grads, pending = ring.shift(grads)
            dq.put(g, dq_acc)
            del dq_acc
            _wait(pending)
            dk.put(g, grads[0])
            dv.put(g, grads[1])
            dbias += grads[2:]
            del grads
        return dq.whole, dk.whole, dv.whole, None, _join_bias_grads(dbias, bias), None, None, None


class _Heads:
    """A tensor of all heads (dim `dim`, shaped and typed like `like`) put together from its
    head groups' parts: with one group the part itself (cast to like's dtype), else a tensor
    of the whole shape, made at the first part, that each part is copied into."""

    def __init__(self, like: Tensor, dim: int, groups: int):
        self.like, self.dim, self.groups, self.whole = like, dim, groups, None

    def put(self, group: int, part: Tensor):
        if self.groups == 1:
            self.whole = part.to(self.like.dtype)
            return
        if self.whole is None:
            self.whole = self.like.new_empty(self.like.shape)
        _head_chunk(self.whole, self.dim, group, self.groups).copy_(part)


def _join_bias_grads(parts: List[Tensor], bias: Optional[Tensor]) -> Optional[Tensor]:
    """The bias's gradient from its head groups' parts (none: no gradient): their concatenation,
    or, where every group shares the bias's one head, their sum, in float32 (float64 for
    float64) rounded once to the bias's dtype."""
    if not parts:
        return None
    if bias.shape[1] > 1 or len(parts) == 1:
        return torch.cat(parts, 1)
    total = parts[0].to(torch.float64 if bias.dtype == torch.float64 else torch.float32)
    for part in parts[1:]:
        total.add_(part)
    return total.to(bias.dtype)


class _Block(NamedTuple):
    """A ring step's block: this rank's query rows and the key columns of the shard at
    hand (slices of the shards), whether it is causal, and the global chunks its rows
    and its keys are, in order."""
    rows: slice
    cols: slice
    causal: bool
    row_chunks: List[int]
    key_chunks: List[int]


def _ring_walk(ring, k, v, mask, bias, chunk, causal):
    """The ring's steps: yields the block (`_Block`) and the (k, v, mask, bias) of the
    shard at hand restricted to its key columns, while the next shard is on its way; the
    shards go one hop a step."""
    travelling = _travelling(k, v, mask, bias)
    for step in range(ring.size):
        if step + 1 < ring.size:
            received, requests = ring.shift(travelling)
        src = (ring.rank - step) % ring.size
        rows, cols, block_causal = _ring_block(ring.rank, src, chunk, causal)
        held = [_chunks(r, ring.size, "ring")[1] for r in (ring.rank, src)]
        block = _Block(rows, cols, block_causal, *(h[_chunk_slice(part, chunk)] for h, part in zip(held, (rows, cols))))
        yield block, _ring_operands(travelling, mask is not None, bias is not None, cols)
        if step + 1 < ring.size:
            _wait(requests)
            travelling = received


def _chunk_slice(part: slice, chunk: int) -> slice:
    """The chunks of a zigzag shard (two of `chunk` tokens) that the token slice `part` covers."""
    return slice(None if part.start is None else part.start // chunk, None if part.stop is None else part.stop // chunk)


def _selects(options, length: int) -> bool:
    """Whether the ring selects top-k: a keep window below the sequence length `length`."""
    return options[5] is not None and options[5] < length


def _fuses(q: Tensor, chunk: int, causal: bool) -> bool:
    """Whether the ring's top-k blocks fuse into one call (`_fused_forward`). The rank's
    rows, zigzag chunks r and 2P-1-r, newly see up to w selected keys (those of the
    chunks between them) at the second chunk's first row. Under causal masking CUDA's
    key lists hold w + rows - 1 keys a query block (key_lists.cu's bound counts one key
    starting a row) and drop keys past that (dmattn.h), so the call fuses there only
    where no query block (64 or 128 rows) straddles the two chunks: chunk a multiple of
    128. Without causal masking every key starts at row 0; the CPU has no such bound."""
    return not causal or q.device.type != "cuda" or chunk % _LIST_BLOCK_ROWS == 0


_LIST_BLOCK_ROWS = 128  # the largest query block of CUDA's top-k key lists


def _gather_key_only(mask, bias, ring) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The whole sequence's key-only mask and bias on every rank, all-gathered (one value a
    key and head; the mask as uint8: gloo sends no bool)."""
    mask_all, bias_all = (None if t is None else _start_gather(t, 3, ring.group, ring.size, "ring")()
                          for t in (None if mask is None else mask.view(torch.uint8), bias))
    return None if mask_all is None else mask_all.view(torch.bool), bias_all


def _ring_selection(q, k, mask_all, bias_all, size: int, options) -> Tensor:
    """The top-k selection of the whole sequence, per-key row intervals (B, Hs, S, 2), on every
    rank, from the whole sequence's key-only mask and bias: dmattn::select on the whole
    sequence's shapes (q and k as expanded views of one token: it reads their shapes, not
    their data)."""
    length = size * q.shape[1]
    q_all = q[:, :1].expand(q.shape[0], length, *q.shape[2:])
    k_all = k[:, :1].expand(k.shape[0], length, *k.shape[2:])
    return torch.ops.dmattn.select(q_all, k_all, mask_all, _shape(mask_all), bias_all, _shape(bias_all), options[2],
                                   options[3], options[4], options[5])


def _fused_forward(ctx, q, k, v, mask_all, bias_all, ring, options, groups):
    """The ring's top-k forward as one call a head group: this rank's rows against every key
    of the whole sequence, the group's k and v all-gathered in sequence order (the first
    group's while the selection runs, each next group's while the group before computes),
    the mask and bias the whole sequence's, each key's intervals restricted to the rank's
    rows (`_block_intervals`). Under causal masking the call's causal flag lets each row
    see at least its causal keys (the rows end S - L keys before the last), and the
    intervals, which start at their key, cut the rest. Saved: the shards, the gathered
    mask and bias and the intervals (one value a key and head); the backward gathers k
    and v again."""
    chunk, causal = q.shape[1] // 2, options[2]
    kv = _gather_heads(ring, k, v, 0, groups)
    selection = _ring_selection(q, k, mask_all, bias_all, ring.size, options)
    block = _Block(slice(None), slice(None), causal, _chunks(ring.rank, ring.size, "ring")[1],
                   list(range(2 * ring.size)))
    whole = _block_intervals(selection, block, chunk)
    del selection
    intervals = [_head_chunk(whole, 1, g, groups).contiguous() for g in range(groups)]
    del whole
    out, lse = _Heads(q, 2, groups), []
    for g in range(groups):
        k_all, v_all = (gather() for gather in kv)
        kv = _gather_heads(ring, k, v, g + 1, groups)
        mask_g, bias_g = _head_chunk(mask_all, 1, g, groups), _head_chunk(bias_all, 1, g, groups)
        out_g, lse_g = torch.ops.dmattn.fwd(_head_chunk(q, 2, g, groups), k_all, v_all, mask_g, _shape(mask_g),
                                            bias_g, _shape(bias_g), intervals[g], *options)
        del k_all, v_all
        out.put(g, out_g)
        lse.append(lse_g)
        del out_g
    out, lse = out.whole, torch.cat(lse, 1)
    ctx.save_for_backward(q, k, v, mask_all, bias_all, out, lse, *intervals)
    ctx.mark_non_differentiable(lse)
    return out, lse


def _fused_backward(ctx, dout):
    """The backward of `_fused_forward`: one call a head group over its k and v gathered
    again (the next group's while the group computes), then every rank's dk, dv (and
    dbias) of the group's whole sequence summed into their owners' shards (`_sum_shards`)."""
    q, k, v, mask_all, bias_all, out, lse, *intervals = ctx.saved_tensors
    ring, options, groups = ctx.ring, ctx.options, ctx.groups
    bias_grad = bias_all is not None and ctx.needs_input_grad[4]
    dq, dk, dv = (_Heads(t, 2, groups) for t in (q, k, v))
    dbias = []
    kv = _gather_heads(ring, k, v, 0, groups)
    for g in range(groups):
        k_all, v_all = (gather() for gather in kv)
        kv = _gather_heads(ring, k, v, g + 1, groups)
        mask_g, bias_g = _head_chunk(mask_all, 1, g, groups), _head_chunk(bias_all, 1, g, groups)
        q_g, out_g, dout_g = (_head_chunk(t, 2, g, groups) for t in (q, out, dout))
        dq_g, *grads = torch.ops.dmattn.bwd(dout_g, q_g, k_all, v_all, mask_g, _shape(mask_g), bias_g, _shape(bias_g),
                                            intervals[g], out_g,
                                            _head_chunk(lse, 1, g, groups), *options, bias_grad)
        del k_all, v_all
        dq.put(g, dq_g)
        del dq_g
        dk_g, dv_g, *dbias_g = _sum_shards(ring, [(grads.pop(0), 1), (grads.pop(0), 1)] +
                                           ([(grads.pop(0), 3)] if bias_grad else []))
        dk.put(g, dk_g)
        dv.put(g, dv_g)
        dbias += dbias_g
        del dk_g, dv_g, dbias_g
    return dq.whole, dk.whole, dv.whole, None, _join_bias_grads(dbias, bias_all), None, None, None


def _gather_heads(ring, k, v, group: int, groups: int):
    """Starts the all-gathers of head group `group`'s k and v (`_start_gather`; none past the last group)."""
    if group == groups:
        return []
    return [_start_gather(_head_chunk(t, 2, group, groups), 1, ring.group, ring.size, "ring") for t in (k, v)]


def _sum_shards(ring, whole: List[Tuple[Tensor, int]]) -> List[Tensor]:
    """This rank's shard of the sum over the ranks of each (t, its sequence dim) of `whole`:
    every rank sends each other rank its shard of t (`Ring.swap`), and the rank sums the
    P shards of its own in rank order in `_accumulator_dtype` (on two ranks one add, which
    rounds once), in t's dtype. Tensors one at a time, each let go of once its shards are cut."""
    summed = []
    while whole:
        t, dim = whole.pop(0)
        dtype, acc = t.dtype, _accumulator_dtype(t, ring.size)
        shards = [_shard(t, dim, r, ring.size, "ring").contiguous() for r in range(ring.size)]
        del t
        parts = ring.swap(shards)
        del shards
        total = parts[0].to(acc)
        for part in parts[1:]:
            total.add_(part)
        summed.append(total.to(dtype))
    return summed


def _block_intervals(selection: Optional[Tensor], block: _Block, chunk: int) -> Optional[Tensor]:
    """The top-k intervals of a ring block, from the whole sequence's (B, Hs, S, 2): those of
    the block's keys, restricted to its rows and in its row numbering. The block's rows are
    global chunks in ascending order, one after the other; a key's global rows are one
    interval, which meets the chunks between the first and the last it meets in full, so its
    rows in the block are one interval too: from its start in the first chunk it meets to its
    end in the last (start >= end where it meets none: no rows)."""
    if selection is None:
        return None
    keys = torch.cat([selection[:, :, c * chunk:(c + 1) * chunk] for c in block.key_chunks], 2)
    # The key's rows in each of the block's chunks, in block numbering: [i chunk, (i + 1) chunk] for the i-th.
    local = [(keys - (c - i) * chunk).clamp_(i * chunk, (i + 1) * chunk) for i, c in enumerate(block.row_chunks)]
    start, end = local[-1][..., 0], local[0][..., 1]
    for part in local:
        end = torch.where(part[..., 0] < part[..., 1], part[..., 1], end)
    for part in reversed(local):
        start = torch.where(part[..., 0] < part[..., 1], part[..., 0], start)
    return torch.stack((start, end), -1)


def _travelling(k, v, mask, bias) -> List[Tensor]:
    """The tensors that go around the ring, contiguous; the mask as uint8 (gloo sends no bool)."""
    mask = None if mask is None else mask.view(torch.uint8)
    return [t.contiguous() for t in (k, v, mask, bias) if t is not None]


def _ring_operands(travelling, has_mask, has_bias, cols):
    """(k, v, mask, bias) of the shard at hand, restricted to the key columns `cols`."""
    k, v, *rest = travelling
    mask = rest.pop(0).view(torch.bool)[..., cols] if has_mask else None
    bias = rest.pop(0)[..., cols] if has_bias else None
    return k[:, cols], v[:, cols], mask, bias


def _block_dout(dout: Tensor, lse_b: Tensor, lse: Tensor) -> Tensor:
    """dout * exp(lse_b - lse) per row (0 where lse_b = -inf): given it with the merged
    out and its own lse_b, dmattn's backward of a block computes
    P_b (dP_b - delta_b) = exp(l - lse_b) exp(lse_b - lse) (dP - <dout, out>), the
    global dS restricted to the block, and P_b^T dout_b, the block's share of dv."""
    scale = torch.exp(lse_b - torch.where(lse == -math.inf, 0.0, lse))
    return torch.mul(dout, scale.transpose(1, 2).unsqueeze(-1), out=torch.empty_like(dout))  # rounded once


def _merge(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor):
    """out, lse (views into the running result) <- the softmax merge with a block's out_b, lse_b."""
    merged = torch.logaddexp(lse, lse_b)
    base = torch.where(merged == -math.inf, 0.0, merged)  # rows without any key yet: both weights 0
    weight, weight_b = (torch.exp(x - base).transpose(1, 2).unsqueeze(-1) for x in (lse, lse_b))
    torch.addcmul(out * weight, out_b, weight_b, out=out)  # rounded once to out's dtype
    lse.copy_(merged)
