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

Ring: the k, v, mask and bias shards travel around the ring (P - 1 hops, each
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

import contextlib
import functools
import math
import types
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .ops import _broadcast_shape, _common, _plans_topk, _reduce, checked

__all__ = ["MODES", "attention", "gather_sequence", "shard_sequence", "use_sequence_parallel_for_doge"]

MODES = ("ulysses", "ring")


def _error(argument: str, expected: str, actual) -> ValueError:
    return ValueError(f"dmattn: {argument}: expected {expected}, got {actual}")


def _process_group(group):
    """(group, rank in it, its size); the default group when `group` is None."""
    if not (dist.is_available() and dist.is_initialized()):
        raise _error("group", "an initialized torch.distributed process group", "torch.distributed not initialized")
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    if rank < 0:
        raise _error("group", "a process group that holds this rank", f"one without global rank {dist.get_rank()}")
    return group, rank, dist.get_world_size(group)


def _check_mode(mode):
    if mode not in MODES:
        raise _error("mode", " or ".join(repr(m) for m in MODES), repr(mode))


# --------------------------------------------------------------------------- layouts


def _chunks(rank: int, size: int, mode: str) -> Tuple[int, List[int]]:
    """(number of equal chunks of the sequence, the chunks rank `rank` holds in order)."""
    return (size, [rank]) if mode == "ulysses" else (2 * size, [rank, 2 * size - 1 - rank])


def shard_sequence(x: Tensor, dim: int = 1, *, group=None, mode: str = "ulysses") -> Tensor:
    """This rank's shard of `x`, a tensor of the whole sequence along `dim`, in `mode`'s
    layout (a view for "ulysses", a copy for "ring"). No communication.

    E.g. input ids (B, S) with dim=1, position ids, or a key-only bias (B, Hk, 1, S)
    with dim=3. S must split into P ("ulysses") or 2P ("ring") equal chunks.
    """
    _check_mode(mode)
    _, rank, size = _process_group(group)
    count, _ = _chunks(rank, size, mode)
    if x.shape[dim] % count:
        raise _error(f"x.shape[{dim}]", f"a sequence length divisible by {count} ({mode} over {size} ranks)",
                     x.shape[dim])
    return _shard(x, dim, rank, size, mode)


def _shard(x: Tensor, dim: int, rank: int, size: int, mode: str) -> Tensor:
    """Rank `rank`'s shard of the whole-sequence `x` (a view for "ulysses", a copy for "ring")."""
    count, mine = _chunks(rank, size, mode)
    pieces = x.chunk(count, dim)
    return pieces[mine[0]] if len(mine) == 1 else torch.cat([pieces[c] for c in mine], dim)


def gather_sequence(x: Tensor, dim: int = 1, *, group=None, mode: str = "ulysses") -> Tensor:
    """The whole sequence from every rank's shard `x` (in `mode`'s layout) along `dim`,
    on every rank: the inverse of `shard_sequence`. An all-gather; not differentiable."""
    _check_mode(mode)
    group, rank, size = _process_group(group)
    return _start_gather(x, dim, group, size, mode)()


def _start_gather(x: Tensor, dim: int, group, size: int, mode: str):
    """Starts the all-gather of `gather_sequence`; calling the result waits for it (on
    CUDA: makes the current stream wait) and returns the whole sequence."""
    x = x.detach().contiguous()
    shards = [torch.empty_like(x) for _ in range(size)]
    request = dist.all_gather(shards, x, group=group, async_op=True)

    def finish() -> Tensor:
        nonlocal request
        request.wait()
        request = None  # it holds the received shards
        pieces: List[Optional[Tensor]] = [None] * _chunks(0, size, mode)[0]
        for r, shard in enumerate(shards):
            held = _chunks(r, size, mode)[1]
            for c, piece in zip(held, shard.chunk(len(held), dim)):
                pieces[c] = piece
        shards.clear()
        return torch.cat(pieces, dim)

    return finish


# --------------------------------------------------------------------------- shared helpers


def _wait(requests):
    for request in requests:
        request.wait()


def _shape(t: Optional[Tensor]) -> Optional[List[int]]:
    return None if t is None else list(t.shape)


# --------------------------------------------------------------------------- Ulysses


def _all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group, size: int) -> Tensor:
    """Splits `x` into `size` pieces along scatter_dim, sends piece i to rank i, and
    concatenates the pieces received along gather_dim in rank order (not differentiable)."""
    pieces = x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces, group=group)
    # received[i] is rank i's piece; every original dim d sits at d + 1.
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


def _replicas(heads: int, parts: int) -> int:
    """How many times `_replicate_heads` replicates each of `heads` heads for `parts` shares."""
    return parts // math.gcd(heads, parts)


def _replicate_heads(t: Tensor, dim: int, parts: int) -> Tensor:
    """Replicates the heads (dim `dim`) of `t` to lcm(heads, parts), each head h
    becoming heads h * r ... h * r + r - 1: query head i still reads head
    i // (H / heads) (H a multiple of lcm(heads, parts)), and each of `parts` equal
    shares of the heads is whole."""
    repeat = _replicas(t.shape[dim], parts)
    return t.repeat_interleave(repeat, dim=dim) if repeat > 1 else t


def _sum_replicas(t: Tensor, dim: int, heads: int) -> Tensor:
    """The gradient of the `heads` heads that `_replicate_heads` replicated to t.shape[dim]."""
    return t if t.shape[dim] == heads else t.unflatten(dim, (heads, -1)).sum(dim + 1)


def _chunk_heads(t: Optional[Tensor], chunk: int, chunks: int) -> Optional[Tensor]:
    """Chunk `chunk` of `chunks` equal chunks of the heads (dim 1) of a head-layout mask or bias."""
    if t is None:
        return None
    width = t.shape[1] // chunks
    return t.narrow(1, chunk * width, width)


@functools.lru_cache(maxsize=None)
def _side_stream(device: int):
    return torch.cuda.Stream(device=device)


class _Transfer:
    """Messages under way. `wait` (once) makes the current stream (the host on the CPU)
    wait for them and for `event`, runs `finish`, returns `tensors` and lets go of all."""

    def __init__(self, requests, tensors=(), event=None, finish=None):
        self.requests, self.tensors, self.event, self.finish = requests, tensors, event, finish

    def wait(self):
        _wait(self.requests)
        if self.event is not None:
            self.event.wait()
        if self.finish is not None:
            self.finish()
        tensors = self.tensors
        self.requests, self.tensors, self.event, self.finish = [], (), None, None
        return tensors


def _runs(first: int, width: int, repeat: int):
    """The replicated heads first ... first + width - 1 of a tensor whose head h stands for
    the replicas h * repeat ... h * repeat + repeat - 1, as runs (offset among them,
    original head, original heads, replicas of each)."""
    offset = 0
    while offset < width:
        head, skip = divmod(first + offset, repeat)
        whole = 0 if skip else (width - offset) // repeat
        replicas = repeat if whole else min(repeat - skip, width - offset)
        yield offset, head, max(whole, 1), replicas
        offset += max(whole, 1) * replicas


class _HeadPipeline:
    """Moves chunks of heads between the sequence layout every rank holds, (B, L, heads, D)
    with L = S / P, and the head layout one dmattn call takes, (B, S, w, D). Tensors come
    as (tensor, repeat): its heads stand for heads * repeat replicated heads
    (`_replicate_heads`' order), never materialised: packing copies each head into its
    replicas, and the replicas' gradients are summed into it as they arrive. Chunk c of
    such a tensor is, on rank j, replicated heads (j C + c) w ... (j C + c + 1) w - 1,
    w = heads * repeat / (P C). `run` pipelines the chunks: chunk c + 1 arrives and chunk
    c - 1 goes back while chunk c is computed.

    Point-to-point messages (batch_isend_irecv: one per batch row, peer and tensor), each
    a contiguous block, so that a message goes out of or into its final place: received
    pieces are (B, P, L, w, D) buffers, the (B, S, w, D) view of which the dmattn call
    reads; results go out of the call's own (B, S, w, D) outputs. Only the packing of the
    pieces sent (and of the rank's own piece) and the unpacking of the pieces received
    are copies. On CUDA those copies and the messages run on a side stream, ordered with
    the caller's stream by events; on the CPU (gloo) the messages overlap the calls."""

    def __init__(self, group, rank: int, size: int, chunks: int, device: torch.device):
        self.group, self.rank, self.size, self.chunks, self.device = group, rank, size, chunks, device
        self.main = self.side = None  # CUDA streams: the caller's (set by `run`) and the side stream
        self.messages = 0  # tags: every rank numbers the messages of a call alike

    def _on_side(self):
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def _tags(self, count: int) -> int:
        first, self.messages = self.messages, self.messages + count
        return first

    def _heads(self, t: Tensor, repeat: int, rank: int, chunk: int) -> Tuple[int, int]:
        """(first replicated head, count) of chunk `chunk` of t's heads on rank `rank`."""
        width = t.shape[2] * repeat // (self.size * self.chunks)
        return (rank * self.chunks + chunk) * width, width

    def _pack(self, into: Tensor, sources, rank: int, chunk: int):
        """into (B, L, sum of widths, D) <- chunk `chunk` of every source for rank `rank`."""
        start = 0
        for t, repeat in sources:
            first, width = self._heads(t, repeat, rank, chunk)
            for offset, head, heads, replicas in _runs(first, width, repeat):
                place = into.narrow(2, start + offset, heads * replicas).unflatten(2, (heads, replicas))
                place.copy_(t.narrow(2, head, heads).unsqueeze(3))
            start += width

    def _unpack(self, target: Tensor, repeat: int, rank: int, chunk: int, piece: Tensor):
        """Chunk `chunk` of target's heads on rank `rank` <- piece (B, L, w, D), replicas summed
        into their head (target zero-initialised where repeat > 1)."""
        first, width = self._heads(target, repeat, rank, chunk)
        for offset, head, heads, replicas in _runs(first, width, repeat):
            part, place = piece.narrow(2, offset, heads * replicas), target.narrow(2, head, heads)
            if repeat == 1:
                place.copy_(part)
            else:
                place.add_(part.unflatten(2, (heads, replicas)).sum(3))

    def _scatter(self, chunk: int, sources) -> _Transfer:
        """Starts sending chunk `chunk` of the sequence-layout `sources`; waiting on the
        transfer gives their head-layout views."""
        t0 = sources[0][0]
        batch, length, dim = t0.shape[0], t0.shape[1], t0.shape[3]
        widths = [self._heads(t, repeat, self.rank, chunk)[1] for t, repeat in sources]
        first, ops, event = self._tags(batch), [], None
        with self._on_side():
            received = t0.new_empty(batch, self.size, length, sum(widths), dim)
            self._pack(received[:, self.rank], sources, self.rank, chunk)
            if self.side is not None:
                event = self.side.record_event()
                received.record_stream(self.main)
            for j in range(self.size):
                if j != self.rank:
                    packed = t0.new_empty(batch, length, sum(widths), dim)
                    if self.side is not None:
                        # ProcessGroupNCCL lets go of it when the caller's stream waits for the messages: its
                        # memory must not return to the side stream before that wait.
                        packed.record_stream(self.main)
                    self._pack(packed, sources, j, chunk)
                    for b in range(batch):
                        ops.append(dist.P2POp(dist.isend, packed[b], group=self.group, group_peer=j, tag=first + b))
                        ops.append(dist.P2POp(dist.irecv, received[b, j], group=self.group, group_peer=j,
                                              tag=first + b))
            requests = dist.batch_isend_irecv(ops) if ops else []
        views = [received.narrow(3, sum(widths[:i]), w).flatten(1, 2) for i, w in enumerate(widths)]
        return _Transfer(requests, views, event)

    def _gather(self, chunk: int, outputs: List[Tensor], targets) -> _Transfer:
        """Starts sending the head-layout `outputs` (B, S, w, D) of chunk `chunk` back, once
        the caller's stream has computed them; waiting on the transfer on the side stream
        puts what arrived into the sequence-layout `targets`."""
        batch, length = targets[0][0].shape[:2]
        first, ops, arrived = self._tags(len(outputs) * batch), [], []
        if self.side is not None:
            self.side.wait_stream(self.main)
        with self._on_side():
            for i, (x, (target, repeat)) in enumerate(zip(outputs, targets)):
                if self.side is not None:
                    x.record_stream(self.side)
                rows = x.unflatten(1, (self.size, length))
                self._unpack(target, repeat, self.rank, chunk, rows[:, self.rank])
                for j in range(self.size):
                    if j != self.rank:
                        buffer = x.new_empty(batch, length, *x.shape[2:])
                        arrived.append((target, repeat, j, buffer))
                        for b in range(batch):
                            tag = first + i * batch + b
                            ops.append(dist.P2POp(dist.isend, rows[b, j], group=self.group, group_peer=j, tag=tag))
                            ops.append(dist.P2POp(dist.irecv, buffer[b], group=self.group, group_peer=j, tag=tag))
            requests = dist.batch_isend_irecv(ops) if ops else []

        def finish():
            for target, repeat, j, buffer in arrived:
                self._unpack(target, repeat, j, chunk, buffer)

        return _Transfer(requests, finish=finish)

    def run(self, sources, compute, targets):
        """For every chunk c: compute(c, *chunk c of sources in the head layout) on the
        caller's stream, its outputs (B, S, w, D) put into chunk c of targets. Sources and
        targets are (tensor, repeat) pairs."""
        if self.device.type == "cuda":
            self.main, self.side = torch.cuda.current_stream(self.device), _side_stream(self.device.index)
            self.side.wait_stream(self.main)
        # Buffers held at a time: chunk c's received pieces, chunk c + 1's received and sent
        # pieces, chunk c's results and the pieces of them that arrive.
        incoming, returning = self._scatter(0, sources), None
        for c in range(self.chunks):
            if returning is not None:
                with self._on_side():
                    returning.wait()  # chunk c - 1 is home and its buffers free
            views = incoming.wait()  # chunk c's sent pieces free
            incoming = self._scatter(c + 1, sources) if c + 1 < self.chunks else None
            outputs = compute(c, *views)
            del views
            returning = self._gather(c, outputs, targets)
            del outputs
        with self._on_side():
            returning.wait()
        if self.main is not None:
            self.main.wait_stream(self.side)


class _UlyssesAttention(torch.autograd.Function):
    """Ulysses over a `_HeadPipeline` of C chunks: k, v and a key-only mask and bias have
    their heads replicated to lcm(heads, P C) (`_replicate_heads`), so that each of the
    P C chunks of the heads is a whole group of kv heads or a whole share of one kv
    head's query heads, and every chunk is one call of dmattn::fwd / dmattn::bwd on the
    whole sequence (a row's top-k is chosen per bias head over every key: the one-process
    selection, made once a chunk where a backward follows, as `dmattn.attention` does).
    Saved for the backward: the caller's sequence shards (q, k, v, the output), the
    head-layout mask and bias (one value a key and head), the chunks' lse and top-k
    selections (O(S) a head); the backward sends q, k, v, out and dout over again instead of keeping
    head-layout copies. The gradients of replicated heads are summed. `options` is
    dmattn::fwd's option tuple; mask and bias are key-only and in their reduced shape."""

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, pipeline, options, return_lse):
        group, size, chunks = pipeline.group, pipeline.size, pipeline.chunks
        parts = size * chunks
        mask_h = bias_h = None
        if mask is not None:
            mask_h = _all_to_all(_replicate_heads(mask, 1, parts).view(torch.uint8), 1, 3, group, size).view(torch.bool)
        if bias is not None:
            bias_h = _all_to_all(_replicate_heads(bias, 1, parts), 1, 3, group, size)
        causal, window_left, window_right, keep_window_size = options[2:6]
        selects = _plans_topk(any(ctx.needs_input_grad[:5]), keep_window_size, size * q.shape[1], window_left,
                              bias is not None)
        out, lses, selections = q.new_empty(q.shape), [], []

        def attend(c, q_c, k_c, v_c):
            mask_c, bias_c = _chunk_heads(mask_h, c, chunks), _chunk_heads(bias_h, c, chunks)
            intervals_c = None
            if selects:
                intervals_c = torch.ops.dmattn.select(q_c, k_c, mask_c, _shape(mask_c), bias_c, _shape(bias_c), causal,
                                                      window_left, window_right, keep_window_size)
            out_c, lse_c = torch.ops.dmattn.fwd(q_c, k_c, v_c, mask_c, _shape(mask_c), bias_c, _shape(bias_c),
                                                intervals_c, *options)
            lses.append(lse_c)
            selections.append(intervals_c)
            return [out_c]

        repeat = _replicas(k.shape[2], parts)
        pipeline.run([(q, 1), (k, repeat), (v, repeat)], attend, [(out, 1)])
        ctx.save_for_backward(q, k, v, out, mask_h, bias_h, *lses, *selections)
        ctx.pipeline, ctx.options = pipeline, options
        ctx.bias_heads = None if bias is None else bias.shape[1]
        if not return_lse:
            return out
        lse = _all_to_all(torch.cat(lses, 1), 2, 1, group, size)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, *_dlse):
        q, k, v, out, mask_h, bias_h, *saved = ctx.saved_tensors
        pipeline, options = ctx.pipeline, ctx.options
        group, size, chunks = pipeline.group, pipeline.size, pipeline.chunks
        lses, selections = saved[:chunks], saved[chunks:]
        bias_grad = bias_h is not None and ctx.needs_input_grad[4]
        repeat = _replicas(k.shape[2], size * chunks)
        dq = q.new_empty(q.shape)
        dk, dv = ((t.new_empty if repeat == 1 else t.new_zeros)(t.shape) for t in (k, v))
        dbias_h = []

        def differentiate(c, q_c, k_c, v_c, out_c, dout_c):
            mask_c, bias_c = _chunk_heads(mask_h, c, chunks), _chunk_heads(bias_h, c, chunks)
            dq_c, dk_c, dv_c, dbias_c = torch.ops.dmattn.bwd(
                dout_c, q_c, k_c, v_c, mask_c, _shape(mask_c), bias_c, _shape(bias_c), selections[c], out_c, lses[c],
                *options, bias_grad)
            dbias_h.append(dbias_c)
            return [dq_c, dk_c, dv_c]

        pipeline.run([(q, 1), (k, repeat), (v, repeat), (out, 1), (dout, 1)], differentiate,
                     [(dq, 1), (dk, repeat), (dv, repeat)])
        dbias = None
        if bias_grad:
            dbias = _sum_replicas(_all_to_all(torch.cat(dbias_h, 1), 3, 1, group, size), 1, ctx.bias_heads)
        return dq, dk, dv, None, dbias, None, None, None


# --------------------------------------------------------------------------- ring


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
    """Ring attention on zigzag shards. `options` is dmattn::fwd's option tuple; mask
    and bias are key-only and in their reduced shape (no stride-0 dims). A keep window
    below the sequence length is selected once, for the whole sequence, from the
    all-gathered key-only mask and bias (`_ring_selection`); then, where `_fuses` allows,
    the blocks fuse into one call over the all-gathered k and v (`_fused_forward`),
    otherwise each ring block takes its share of the selection (`_block_intervals`)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, ring, options):
        chunk, causal = q.shape[1] // 2, options[2]
        ctx.ring, ctx.options, ctx.fused = ring, options, False
        selection = None
        if _selects(options, ring.size * q.shape[1]):
            mask_all, bias_all = _gather_key_only(mask, bias, ring)
            if _fuses(q, chunk, causal):
                ctx.fused = True
                return _fused_forward(ctx, q, k, v, mask_all, bias_all, ring, options)
            selection = _ring_selection(q, k, mask_all, bias_all, ring.size, options)
        out = lse = None
        block_lse = []
        for block, (k_b, v_b, mask_b, bias_b) in _ring_walk(ring, k, v, mask, bias, chunk, causal):
            out_b, lse_b = torch.ops.dmattn.fwd(q[:, block.rows], k_b, v_b, mask_b, _shape(mask_b), bias_b,
                                                _shape(bias_b), _block_intervals(selection, block, chunk),
                                                options[0], options[1], block.causal, *options[3:])
            block_lse.append(lse_b)
            if out is None:
                out, lse = out_b.to(_accumulator_dtype(q, ring.size)), lse_b.clone()
            else:
                _merge(out[:, block.rows], lse[..., block.rows], out_b, lse_b)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, bias, selection, out, lse, *block_lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if ctx.fused:
            return _fused_backward(ctx, dout)
        q, k, v, mask, bias, selection, out, lse, *block_lse = ctx.saved_tensors
        ring, options = ctx.ring, ctx.options
        bias_grad = bias is not None and ctx.needs_input_grad[4]
        chunk, causal, acc = q.shape[1] // 2, options[2], _accumulator_dtype(q, ring.size)
        owners = [t for t in (k, v, bias if bias_grad else None) if t is not None]
        # dk, dv (and dbias) of the shard at hand travel one hop behind the shard, in the
        # accumulator dtype, and the last hop, home, in their own (rounded as they would be there).
        dq = grads = None
        pending = []
        walk = _ring_walk(ring, k, v, mask, bias, chunk, causal)
        for step, (lse_b, (block, (k_b, v_b, mask_b, bias_b))) in enumerate(zip(block_lse, walk)):
            rows, cols = block.rows, block.cols
            dq_b, *grads_b = torch.ops.dmattn.bwd(
                _block_dout(dout[:, rows], lse_b, lse[..., rows]), q[:, rows], k_b, v_b, mask_b, _shape(mask_b),
                bias_b, _shape(bias_b), _block_intervals(selection, block, chunk), out[:, rows], lse_b, options[0],
                options[1], block.causal, *options[3:], bias_grad)
            grads_b = grads_b[:len(owners)]
            if step == 0:  # the rank's own shard: all its rows and keys
                dq, grads = dq_b.to(acc), [g.to(acc) for g in grads_b]
            else:
                dq[:, rows] += dq_b
                _wait(pending)
                for g, g_b, keys in zip(grads, grads_b, ((slice(None), cols), (slice(None), cols), (..., cols))):
                    g[keys] += g_b
            if step + 1 == ring.size:
                grads = [g.to(t.dtype) for g, t in zip(grads, owners)]
            grads, pending = ring.shift(grads)
        _wait(pending)
        dk, dv, *dbias = grads
        return dq.to(q.dtype), dk, dv, None, dbias[0] if bias_grad else None, None, None


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


def _fused_forward(ctx, q, k, v, mask_all, bias_all, ring, options):
    """The ring's top-k forward as one call: this rank's rows against every key of the
    whole sequence, k and v all-gathered in sequence order (while the selection runs),
    the mask and bias the whole sequence's, each key's intervals restricted to the rank's
    rows (`_block_intervals`). Under causal masking the call's causal flag lets each row
    see at least its causal keys (the rows end S - L keys before the last), and the
    intervals, which start at their key, cut the rest. Saved: the shards, the gathered
    mask and bias and the intervals (one value a key and head); the backward gathers k
    and v again."""
    chunk, causal = q.shape[1] // 2, options[2]
    kv = [_start_gather(t, 1, ring.group, ring.size, "ring") for t in (k, v)]
    selection = _ring_selection(q, k, mask_all, bias_all, ring.size, options)
    block = _Block(slice(None), slice(None), causal, _chunks(ring.rank, ring.size, "ring")[1],
                   list(range(2 * ring.size)))
    intervals = _block_intervals(selection, block, chunk)
    del selection
    k_all, v_all = (gather() for gather in kv)
    out, lse = torch.ops.dmattn.fwd(q, k_all, v_all, mask_all, _shape(mask_all), bias_all, _shape(bias_all), intervals,
                                    *options)
    ctx.save_for_backward(q, k, v, mask_all, bias_all, intervals, out, lse)
    ctx.mark_non_differentiable(lse)
    return out, lse


def _fused_backward(ctx, dout):
    """The backward of `_fused_forward`: one call over k and v gathered again, then every
    rank's dk, dv (and dbias) of the whole sequence summed into their owners' shards
    (`_sum_shards`)."""
    q, k, v, mask_all, bias_all, intervals, out, lse = ctx.saved_tensors
    ring, options = ctx.ring, ctx.options
    bias_grad = bias_all is not None and ctx.needs_input_grad[4]
    kv = [_start_gather(t, 1, ring.group, ring.size, "ring") for t in (k, v)]
    k_all, v_all = (gather() for gather in kv)
    dq, *grads = torch.ops.dmattn.bwd(dout, q, k_all, v_all, mask_all, _shape(mask_all), bias_all, _shape(bias_all),
                                      intervals, out, lse, *options, bias_grad)
    del k_all, v_all
    dk, dv, *dbias = _sum_shards(ring, [(grads.pop(0), 1), (grads.pop(0), 1)] +
                                 ([(grads.pop(0), 3)] if bias_grad else []))
    return dq, dk, dv, None, dbias[0] if bias_grad else None, None, None


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


# --------------------------------------------------------------------------- public functions


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


def _ulysses_chunks(heads: int, kv_heads: int, size: int, head_chunks) -> int:
    """The number C of head chunks of mode="ulysses": `head_chunks`, checked, or by
    default the largest C up to 4 whose kv heads, replicated to lcm(Hk, P C), leave every
    chunk a whole number of query heads a kv head (H divisible by lcm(Hk, P C))."""
    if heads % size:
        raise _error("q.shape[2]", f"a head count divisible by the group size {size} (ulysses splits the heads)", heads)
    if head_chunks is None:
        return max(n for n in range(1, 5) if heads % math.lcm(kv_heads, size * n) == 0)
    head_chunks = checked("head_chunks", head_chunks, int)
    if head_chunks < 1 or heads % math.lcm(kv_heads, size * head_chunks):
        raise _error("head_chunks", f"None or a count C >= 1 with H = {heads} divisible by lcm(Hk, P C) = "
                     f"lcm({kv_heads}, {size} C) (whole query heads to a kv head in each chunk)", head_chunks)
    return head_chunks


def _check_ring(q: Tensor, k: Tensor, options, size: int, head_chunks):
    if head_chunks is not None:
        raise _error("head_chunks", "None with mode='ring' (it chunks the heads of mode='ulysses')", head_chunks)
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
        head_chunks: "ulysses" only: the number C of chunks each rank's heads are cut
            into, one dmattn call each; the all-to-alls of one chunk overlap the
            attention of the next, and the buffers in use at a time shrink with C.
            The kv heads (and a key-only mask's and bias's) are replicated to
            lcm(heads, P C), so H must be divisible by lcm(Hk, P C). Default: the
            largest such C up to 4.
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
    if mode == "ulysses":
        chunks = _ulysses_chunks(q.shape[2], k.shape[2], size, head_chunks)
        pipeline = _HeadPipeline(group, rank, size, chunks, q.device)
        return _UlyssesAttention.apply(q, k, v, mask, bias, pipeline, options, return_lse)
    _check_ring(q, k, options, size, head_chunks)
    out, lse = _RingAttention.apply(q, k, v, mask, bias, _Ring(group, rank, size), options)
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

    from .integrations import transformers as adapter

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
