"""What sequence parallelism's two modes share: errors, the process group, the sequence layouts."""

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

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


def _head_chunk(t: Optional[Tensor], dim: int, chunk: int, chunks: int) -> Optional[Tensor]:
    """Chunk `chunk` of `chunks` equal chunks of t's heads (dim `dim`), a view; t itself where it has
    one head (a mask, bias or selection that every head shares)."""
    if t is None or t.shape[dim] == 1:
        return t
    width = t.shape[dim] // chunks
    return t.narrow(dim, chunk * width, width)
