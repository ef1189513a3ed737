#!/usr/bin/env python3
"""Per-GPU tensor memory of distributed_bench.py's step, from a run on the CPU.

    python3 bench/distributed_memory.py [--seq 1024] [--ranks 2] [--head-chunks 1,2,4,8,16] [--bench-seq 131072]

distributed_bench.py's shapes (B=1, 32 query heads, 8 kv heads, D=128, bf16, causal, a
keep window S / 64, a learnable (1, 8, 1, S) bias) at S = --seq: Ulysses fwd+bwd in
--ranks gloo processes for each head_chunks count and dense with its default, the ring
(its default head groups) with the keep window and dense, and one process on the whole
sequence,
under tests/python/memory_model.py's LiveMemory. As in the bench, the caller holds q,
k, v, the bias and dout, and the output through the backward; each line is the rank
with the highest peak. Every tensor involved
grows as S, so the peaks are printed scaled to --bench-seq: what
torch.cuda.max_memory_allocated reports for the bench's step, without the caching
allocator's rounding and without what the core allocates itself on CUDA
(cudaMallocAsync: the backward's float32 dq sums, B H S D 4 bytes for the heads of one
call, and its key pieces).
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
from memory_model import LiveMemory  # noqa: E402

B, HEADS, KV_HEADS, HEAD_DIM = 1, 32, 8, 128


def _step(attention, seq, generator, shard):
    """(peak bytes of one fwd+bwd, bytes the caller holds, what was alive at the peak)."""
    randn = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.bfloat16)  # noqa: E731
    whole = dict(q=randn(B, seq, HEADS, HEAD_DIM), k=randn(B, seq, KV_HEADS, HEAD_DIM),
                 v=randn(B, seq, KV_HEADS, HEAD_DIM), bias=randn(B, KV_HEADS, 1, seq),
                 dout=randn(B, seq, HEADS, HEAD_DIM))
    held = {n: shard(t, 3 if n == "bias" else 1).clone() for n, t in whole.items()}
    dout = held.pop("dout")
    leaves = {n: t.requires_grad_() for n, t in held.items()}
    with LiveMemory() as memory:
        attention(leaves["q"], leaves["k"], leaves["v"], bias=leaves["bias"]).backward(dout)
    caller = sum(t.numel() * t.element_size() for t in (*leaves.values(), dout))
    return memory.peak, caller, memory.at_peak


def _worker(rank, ranks, store, args, results):
    os.environ["DMATTN_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    from dmattn import distributed as sp

    lines = []
    for chunks in args.head_chunks:
        attention = lambda *a, **kw: sp.attention(*a, **kw, causal=True, keep_window_size=args.seq // 64,  # noqa: E731
                                                  head_chunks=chunks)
        peak, caller, at_peak = _step(attention, args.seq, torch.Generator().manual_seed(0),
                                      lambda t, dim: sp.shard_sequence(t, dim))
        lines.append((f"Ulysses, {ranks} ranks, head_chunks={chunks}", peak, caller, at_peak))
    attention = lambda *a, **kw: sp.attention(*a, **kw, causal=True)  # noqa: E731
    peak, caller, at_peak = _step(attention, args.seq, torch.Generator().manual_seed(0),
                                  lambda t, dim: sp.shard_sequence(t, dim))
    lines.append((f"Ulysses, {ranks} ranks, dense, default head_chunks", peak, caller, at_peak))
    for window, label in ((args.seq // 64, "keep window"), (None, "dense")):
        attention = lambda *a, w=window, **kw: sp.attention(*a, **kw, causal=True, keep_window_size=w,  # noqa: E731
                                                            mode="ring")
        peak, caller, at_peak = _step(attention, args.seq, torch.Generator().manual_seed(0),
                                      lambda t, dim: sp.shard_sequence(t, dim, mode="ring"))
        lines.append((f"ring, {ranks} ranks, {label}", peak, caller, at_peak))
    dist.barrier()
    dist.destroy_process_group()
    torch.save(lines, f"{results}.{rank}")
    os._exit(0)  # gloo's teardown at interpreter exit aborts now and then


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--head-chunks", type=lambda text: [int(n) for n in text.split(",")], default=[1, 2, 4, 8, 16])
    parser.add_argument("--bench-seq", type=int, default=131072)
    args = parser.parse_args()
    import dmattn

    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.pt")
        mp.start_processes(_worker, args=(args.ranks, os.path.join(tmp, "store"), args, results), nprocs=args.ranks,
                           start_method="spawn")
        ranks = [torch.load(f"{results}.{rank}") for rank in range(args.ranks)]
    # Each mode's line of the rank with the highest peak.
    lines = [max(of_ranks, key=lambda line: line[1]) for of_ranks in zip(*ranks)]
    attention = lambda *a, **kw: dmattn.attention(*a, **kw, causal=True, keep_window_size=args.seq // 64)  # noqa: E731
    lines.insert(0, ("one process", *_step(attention, args.seq, torch.Generator().manual_seed(0), lambda t, dim: t)))

    scale = args.bench_seq / args.seq / 2**30
    one = None
    print(f"peak GiB per GPU at S = {args.bench_seq} (run at S = {args.seq} on the CPU, scaled)")
    for name, peak, caller, _ in lines:
        one = one or peak + caller
        print(f"  {name}: {(peak + caller) * scale:.2f} ({caller * scale:.2f} held by the caller; "
              f"{(peak + caller) / one:.2f} x one process)")
    print(f"largest tensors alive at each peak (GiB at S = {args.bench_seq}, besides the caller's inputs):")
    for name, _, _, at_peak in lines:
        print(f"  {name}: " + ", ".join(f"{size * scale:.3f} {what}" for size, what in at_peak[:12]))


if __name__ == "__main__":
    main()
