"""Ulysses: all-to-alls from sequence shards to head shards, dmattn on whole rows of a share of the heads."""

import contextlib
import functools
import math
from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops import _plans_topk
from ._base import _head_chunk, _shape, _wait


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
            mask_c, bias_c = _head_chunk(mask_h, 1, c, chunks), _head_chunk(bias_h, 1, c, chunks)
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
            mask_c, bias_c = _head_chunk(mask_h, 1, c, chunks), _head_chunk(bias_h, 1, c, chunks)
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
