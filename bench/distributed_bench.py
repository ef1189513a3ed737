#!/usr/bin/env python3
"""Sequence-parallel dmattn (dmattn.distributed) on the GPUs of one host, under torchrun.

    torchrun --standalone --nproc_per_node=2 bench/distributed_bench.py check [--seq 2048] [--head-chunks 8,16]
    torchrun --standalone --nproc_per_node=2 bench/distributed_bench.py time [--seq 131072] [--reps 3] \
        [--topk-reps 10] [--head-chunks 8,16]
    torchrun --standalone --nproc_per_node=2 bench/distributed_bench.py profile [--seq 131072] [--mode ring] \
        [--keep-window 2048] [--top 14]
    python3 bench/distributed_bench.py report DIR

Shapes: B=1, 32 query heads, 8 kv heads, D=128, bf16, causal, a key-only bias
(1, 8, 1, S) in bf16 with a gradient; dense, and with keep_window_size (256 in the
check, 2048 in the timing). Modes: Ulysses (its default head chunks, and a row for each
count in --head-chunks, e.g. 8,16: smaller chunks, less memory) and ring (its top-k
selected once for the whole sequence, from the all-gathered bias; its default head
groups, and a row for each count in --head-chunks that divides the 8 kv heads).

check: every rank draws the same whole-sequence inputs, runs its shard, and rank 0
gathers the output and every gradient (dq, dk, dv, dbias) and compares them with a
float64 reference (tests/python/reference.py on the GPU) under SPEC 5's rule: max
abs error <= 2 x the error of the same computation done naively in bf16 + 1e-5. The
single-GPU dmattn error is printed beside it.

--modes (check and time) picks the parallel modes (default both).

time: fwd+bwd of one step, the median of --reps (--topk-reps with a keep window: those
steps are ~13x shorter, and a one-off stall weighs more) after a warm-up; "one GPU" is the
whole sequence on rank 0 alone (the other ranks wait), Ulysses and ring the shards on
every rank (a step ends when the slowest rank ends). Per mode: the peak memory of
each GPU and the bytes each rank sends per step (forward, backward; formulas in
`volume`). Peak memory is torch.cuda.max_memory_allocated (what PyTorch's allocator
holds: the caller's tensors and everything the ops return or allocate through torch),
and beside it the high-water mark of the CUDA memory pool that dmattn's core takes its
scratch from (cudaMallocAsync: the backward's float32 dq sums, key lists and groups),
which PyTorch does not see; the two peaks need not fall at the same moment. If the
one-GPU run at --seq runs out of memory, S is halved (with a message) until it fits,
and every mode runs at that S.

profile: one fwd+bwd step of --mode (keep window --keep-window, 0 for dense) under
torch.profiler on every rank after two warm-ups: each rank's GPU kernels by time, and
the step's wall time per rank (the time one rank spends waiting for the other shows
as the difference), printed rank by rank and written to DIR/distributed-profile.txt.

Each command writes DIR/distributed-{check,time}.json when OUT (= DIR) is set;
`report DIR` prints the short table of both.
"""

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

B, HEADS, KV_HEADS, HEAD_DIM = 1, 32, 8, 128
DEVICE = "cuda"
MODES = ("ulysses", "ring")


def volume(mode, P, S, H=HEADS, Hk=KV_HEADS, D=HEAD_DIM, element=2, bias_heads=KV_HEADS, bias_batch=1,
           bias_element=2, accumulator=4, chunks=1, topk=False):
    """Bytes each rank sends in one step, (forward, backward), for B=1 q/k/v of `element`
    bytes and a key-only bias (bias_batch, bias_heads, 1, S) with a gradient, no mask.

    Ulysses in `chunks` head chunks: every exchange sends (P-1)/P of what it moves; kv and
    bias heads are replicated to lcm(heads, P chunks) first. Forward q, k, v and the bias
    in, out back; backward q, k, v, out and dout in (nothing head-sharded is kept from the
    forward), dq, dk, dv and dbias back.
    Ring: forward P-1 hops of the k, v, bias shard; backward the same P-1 hops plus P
    hops of the dk, dv and dbias accumulators, float32 (their own dtype on two ranks) but
    for the last hop (home), in their own dtype. With a keep window below S (topk) the
    forward adds the all-gather of the bias (its shard to each of the P-1 others), and
    where the blocks fuse (S / 2P a multiple of 128) the forward all-gathers k and v (the
    same bytes as the hops) and the backward all-gathers k and v again and sends each
    other rank its shard of this rank's whole-sequence dk, dv and dbias, in their dtype.
    """
    tokens = B * S // P
    if mode == "ulysses":
        kv, bias = math.lcm(Hk, P * chunks), math.lcm(bias_heads, P * chunks)
        f, bias_bytes = (P - 1) / P, bias_batch * bias * S // P * bias_element
        forward = f * (tokens * (2 * H + 2 * kv) * D * element + bias_bytes)
        backward = f * (tokens * (4 * H + 4 * kv) * D * element + bias_bytes)
        return int(forward), int(backward)
    bias_shard = bias_batch * bias_heads * S // P * bias_element
    shard = tokens * 2 * Hk * D * element + bias_shard
    grads = shard if P <= 2 else (tokens * 2 * Hk * D + bias_batch * bias_heads * S // P) * accumulator
    forward = (P - 1) * (shard + (bias_shard if topk else 0))
    if topk and S // (2 * P) % 128 == 0:
        return forward, (P - 1) * (2 * shard - bias_shard)
    return forward, (P - 1) * (shard + grads) + shard


def _variants(args):
    """(mode, head_chunks) of the parallel rows: each mode of --modes with its defaults, then
    each count of --head-chunks for Ulysses (head chunks) and, where it divides the kv heads,
    the ring (head groups)."""
    counts = [("ulysses", c) for c in args.head_chunks] + [("ring", c) for c in args.head_chunks if KV_HEADS % c == 0]
    return [(mode, None) for mode in args.modes] + [(m, c) for m, c in counts if m in args.modes]


def _label(mode, chunks):
    return mode if chunks is None else f"{mode} C={chunks}"


def _setup():
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return torch, dist


def _inputs(torch, S, seed=0):
    """Whole-sequence leaves (the same on every rank) and a dout."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    randn = functools.partial(torch.randn, device=DEVICE, dtype=torch.bfloat16, generator=g)
    return dict(q=randn(B, S, HEADS, HEAD_DIM), k=randn(B, S, KV_HEADS, HEAD_DIM), v=randn(B, S, KV_HEADS, HEAD_DIM),
                bias=randn(B, KV_HEADS, 1, S), dout=randn(B, S, HEADS, HEAD_DIM))


def _write(name, result):
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / f"distributed-{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")


def _device_info(torch, dist):
    return dict(device=torch.cuda.get_device_name(), gpus=dist.get_world_size(), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d %H:%M"))


# --------------------------------------------------------------------------- check


def check(args):
    torch, dist = _setup()
    import dmattn
    from dmattn import distributed as sp

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
    import reference

    rank, P, S = dist.get_rank(), dist.get_world_size(), args.seq
    rows = []
    cases = [(mode, chunks, w) for mode, chunks in _variants(args) for w in (None, args.keep_window)]
    for seed, (mode, chunks, w) in enumerate(cases):
        name = f"{_label(mode, chunks)} {'dense' if w is None else f'w={w}'}"
        whole = _inputs(torch, S, seed=seed)
        names = ("q", "k", "v", "bias")
        local = {n: sp.shard_sequence(whole[n], 3 if n == "bias" else 1, mode=mode).detach().requires_grad_()
                 for n in names}
        out = sp.attention(local["q"], local["k"], local["v"], bias=local["bias"], causal=True, keep_window_size=w,
                           mode=mode, head_chunks=chunks)
        out.backward(sp.shard_sequence(whole["dout"], mode=mode))
        gathered = dict(out=sp.gather_sequence(out, mode=mode))
        gathered.update({f"d{n}": sp.gather_sequence(local[n].grad, 3 if n == "bias" else 1, mode=mode)
                         for n in names})
        if rank == 0:
            errors = _errors(torch, dmattn, reference, whole, w, gathered)
            rows.append(dict(case=name, **errors, ok=all(e["ok"] for e in errors.values())))
            print(_check_line(rows[-1]), flush=True)
        dist.barrier()
    passed = all(r["ok"] for r in rows)
    if rank == 0:
        _write("check", dict(kind="check", seq=S, **_device_info(torch, dist), rows=rows))
        print(f"check: {'PASS' if passed else 'FAIL'} ({len(rows)} cases, S={S}, P={P})")
    dist.destroy_process_group()
    if not passed:
        sys.exit(1)


def _errors(torch, dmattn, reference, whole, w, gathered):
    """Max abs errors against the float64 reference: sequence-parallel, one-GPU dmattn, naive bf16."""
    names = ("q", "k", "v", "bias")

    def run(fn, **options):
        leaves = {n: whole[n].detach().clone().requires_grad_() for n in names}
        out = fn(leaves["q"], leaves["k"], leaves["v"], bias=leaves["bias"], causal=True, keep_window_size=w,
                 **options)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(whole["dout"].to(out.dtype))
        return dict(out=out.detach(), **{f"d{n}": leaves[n].grad for n in names})

    exact = run(reference.attention, dtype=torch.float64)
    naive = run(reference.attention, dtype=torch.bfloat16)
    single = run(dmattn.attention)
    result = {}
    for key, want in exact.items():
        err = lambda x: (x.double() - want).abs().max().item()  # noqa: E731
        parallel, bound = err(gathered[key]), 2 * err(naive[key]) + 1e-5
        result[key] = dict(parallel=parallel, single=err(single[key]), naive=err(naive[key]), bound=bound,
                           ok=bool(parallel <= bound))
    return result


def _check_line(row):
    parts = [f"{k} {v['parallel']:.2e} (1 GPU {v['single']:.2e}, naive {v['naive']:.2e}){'' if v['ok'] else ' FAIL'}"
             for k, v in row.items() if isinstance(v, dict)]
    return f"{row['case']}: " + "; ".join(parts)


# --------------------------------------------------------------------------- time


def time_steps(args):
    torch, dist = _setup()
    import dmattn
    from dmattn import distributed as sp

    rank = dist.get_rank()
    S = torch.tensor([args.seq], device=DEVICE)
    singles = {}
    if rank == 0:
        S[0], singles = _fit_single(torch, dmattn, args)
    dist.broadcast(S, 0)
    S = int(S.item())
    rows = []
    for w in (None, args.keep_window):
        label = "dense" if w is None else f"w={w}"
        if rank == 0:
            rows.append(dict(case=f"1 GPU {label}", window=w, seq=S, **singles[w], sent_fwd=0, sent_bwd=0))
        for mode, chunks in _variants(args):
            rows.append(_time_parallel(torch, dist, sp, mode, chunks, S, w, _reps(args, w)) |
                        dict(case=f"{_label(mode, chunks)} {label}", window=w, seq=S))
            if rank == 0:
                print(_time_line(rows[-1]), flush=True)
    if rank == 0:
        _write("time", dict(kind="time", seq=S, reps=args.reps, topk_reps=args.topk_reps, **_device_info(torch, dist),
                            rows=rows))
    dist.destroy_process_group()


def _step(attention, leaves, dout):
    for t in leaves.values():
        t.grad = None
    attention(leaves["q"], leaves["k"], leaves["v"], bias=leaves["bias"]).backward(dout)


def _reps(args, window):
    return args.reps if window is None else args.topk_reps


def _measure(torch, step, reps, sync=lambda: None):
    """Seconds of `step` for each of reps after one warm-up, the peak memory of PyTorch's
    allocator and the high-water mark of the core's pool (GiB; None where unreadable)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    pool = _CorePool(torch)
    step()
    times = []
    for _ in range(reps):
        sync()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times, torch.cuda.max_memory_allocated() / 2**30, pool.high()


class _CorePool:
    """The used-memory high-water mark of the current device's default CUDA memory pool,
    where dmattn's core allocates its scratch (cudaMallocAsync), through the driver API;
    reset when made."""

    USED_MEM_HIGH = 8  # CU_MEMPOOL_ATTR_USED_MEM_HIGH

    def __init__(self, torch):
        import ctypes

        self.ctypes, self.pool = ctypes, None
        try:
            self.cuda = ctypes.CDLL("libcuda.so.1")
            device, pool = ctypes.c_int(), ctypes.c_void_p()
            if (self.cuda.cuDeviceGet(ctypes.byref(device), torch.cuda.current_device()) == 0 and
                    self.cuda.cuDeviceGetDefaultMemPool(ctypes.byref(pool), device) == 0):
                zero = ctypes.c_uint64(0)
                if self.cuda.cuMemPoolSetAttribute(pool, self.USED_MEM_HIGH, ctypes.byref(zero)) == 0:
                    self.pool = pool
        except OSError:
            pass

    def high(self):
        value = self.ctypes.c_uint64()
        if self.pool is None or self.cuda.cuMemPoolGetAttribute(self.pool, self.USED_MEM_HIGH,
                                                                self.ctypes.byref(value)) != 0:
            return None
        return value.value / 2**30


def _fit_single(torch, dmattn, args):
    """Rank 0 alone: S and the one-GPU results, S halved after out-of-memory errors."""
    S = args.seq
    while True:
        try:
            return S, _single(torch, dmattn, S, args)
        except torch.cuda.OutOfMemoryError:
            print(f"out of memory at S={S} on one GPU: every mode runs at S={S // 2} instead", flush=True)
        torch.cuda.empty_cache()  # the failed run's tensors went with its frame
        S //= 2
        if S < 4096:
            raise RuntimeError("out of memory at every S down to 4096")


def _single(torch, dmattn, S, args):
    singles = {}
    for w in (None, args.keep_window):
        whole = _inputs(torch, S)
        dout = whole.pop("dout")
        leaves = {n: t.requires_grad_() for n, t in whole.items()}
        attention = functools.partial(dmattn.attention, causal=True, keep_window_size=w)
        times, peak, pool = _measure(torch, functools.partial(_step, attention, leaves, dout), _reps(args, w))
        singles[w] = dict(ms=1e3 * statistics.median(times), peak_gib=[peak], pool_gib=[pool])
        print(_time_line(dict(case=f"1 GPU {'dense' if w is None else f'w={w}'}", seq=S, **singles[w], sent_fwd=0,
                              sent_bwd=0)), flush=True)
        del whole, leaves, dout
        torch.cuda.empty_cache()
    return singles


def _time_parallel(torch, dist, sp, mode, chunks, S, w, reps):
    P = dist.get_world_size()
    whole = _inputs(torch, S)
    local = {n: sp.shard_sequence(t, 3 if n == "bias" else 1, mode=mode).detach().clone() for n, t in whole.items()}
    del whole
    torch.cuda.empty_cache()
    dout = local.pop("dout")
    leaves = {n: t.requires_grad_() for n, t in local.items()}
    attention = functools.partial(sp.attention, causal=True, keep_window_size=w, mode=mode, head_chunks=chunks)
    topk = w is not None and w < S
    chunks_u = sp._ulysses_chunks(HEADS, KV_HEADS, P, chunks, topk) if mode == "ulysses" else 1
    sent_fwd, sent_bwd = volume(mode, P, S, chunks=chunks_u, topk=topk)
    times, peak, pool = _measure(torch, functools.partial(_step, attention, leaves, dout), reps, sync=dist.barrier)
    slowest = torch.tensor(times, device=DEVICE)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    peaks = [None] * P
    dist.all_gather_object(peaks, (peak, pool))
    return dict(ms=1e3 * statistics.median(slowest.tolist()), peak_gib=[p for p, _ in peaks],
                pool_gib=[p for _, p in peaks], sent_fwd=sent_fwd, sent_bwd=sent_bwd)


def _gib(values):
    return "/".join("?" if p is None else f"{p:.2f}" for p in values)


def _time_line(row):
    return (f"{row['case']} S={row['seq']}: {row['ms']:.1f} ms fwd+bwd, peak {_gib(row['peak_gib'])} GiB (core pool "
            f"{_gib(row['pool_gib'])}), sent per rank {row['sent_fwd'] / 2**20:.0f} + {row['sent_bwd'] / 2**20:.0f} "
            "MiB (fwd + bwd)")


# --------------------------------------------------------------------------- profile


def profile(args):
    torch, dist = _setup()
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    from dmattn import distributed as sp

    rank, P, S, mode = dist.get_rank(), dist.get_world_size(), args.seq, args.mode
    w = args.keep_window or None
    whole = _inputs(torch, S)
    local = {n: sp.shard_sequence(t, 3 if n == "bias" else 1, mode=mode).detach().clone() for n, t in whole.items()}
    del whole
    dout = local.pop("dout")
    leaves = {n: t.requires_grad_() for n, t in local.items()}
    step = functools.partial(_step, functools.partial(sp.attention, causal=True, keep_window_size=w, mode=mode),
                             leaves, dout)
    step(), step()
    dist.barrier()
    torch.cuda.synchronize()
    with profiler(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in kernels)
    lines = [f"rank {rank} ({mode}, S={S}, P={P}, {'dense' if w is None else f'w={w}'}): wall {1e3 * wall:.1f} ms, "
             f"GPU {total / 1e3:.1f} ms in {sum(e.count for e in kernels)} kernels"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:args.top]:
        lines.append(f"  {e.self_device_time_total / 1e3:8.3f} ms {100 * e.self_device_time_total / total:5.1f}% "
                     f"x{e.count:<4d} {e.key[:100]}")
    texts = [None] * P
    dist.all_gather_object(texts, "\n".join(lines))
    if rank == 0:
        print("\n".join(texts), flush=True)
        if os.environ.get("OUT"):
            path = Path(os.environ["OUT"]) / "distributed-profile.txt"
            with path.open("a") as f:
                f.write("\n".join(texts) + "\n")
    dist.destroy_process_group()


def _check_table(result):
    lines = [f"| check, S={result['seq']}, {result['gpus']} GPUs: max abs error / bound | out | dq | dk | dv | dbias |",
             "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        cells = [f"{row[k]['parallel']:.1e} / {row[k]['bound']:.1e}" + ("" if row[k]["ok"] else " FAIL")
                 for k in ("out", "dq", "dk", "dv", "dbias")]
        lines.append(f"| {row['case']}: {'PASS' if row['ok'] else 'FAIL'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _time_table(result):
    lines = [f"| fwd+bwd, {result['gpus']} x {result['device']} | S | ms | x one GPU | peak GiB per GPU (x one GPU) "
             "| core pool GiB per GPU | MiB sent per rank fwd / bwd |", "|---|---|---|---|---|---|---|"]
    one_gpu = {row["window"]: row for row in result["rows"] if row["case"].startswith("1 GPU")}
    for row in result["rows"]:
        single = one_gpu[row["window"]]
        peaks = " / ".join(f"{p:.2f} ({p / single['peak_gib'][0]:.2f})" for p in row["peak_gib"])
        lines.append(f"| {row['case']} | {row['seq']} | {row['ms']:.1f} | {single['ms'] / row['ms']:.2f} | {peaks} | "
                     f"{_gib(row.get('pool_gib', []))} | {row['sent_fwd'] / 2**20:.0f} / "
                     f"{row['sent_bwd'] / 2**20:.0f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- report


def report(args):
    """Prints the tables of DIR/distributed-{check,time}.json (those that exist)."""
    for name, table in (("check", _check_table), ("time", _time_table)):
        path = Path(args.dir) / f"distributed-{name}.json"
        if path.exists():
            print("\n" + table(json.loads(path.read_text())))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    chunk_counts = dict(type=lambda text: [int(n) for n in text.split(",") if n], default=[],
                        help="comma-separated Ulysses head_chunks counts, a row each beside the default's")
    c = commands.add_parser("check")
    c.add_argument("--seq", type=int, default=2048)
    c.add_argument("--keep-window", type=int, default=256)
    c.add_argument("--head-chunks", **chunk_counts)
    t = commands.add_parser("time")
    t.add_argument("--seq", type=int, default=131072)
    t.add_argument("--keep-window", type=int, default=2048)
    t.add_argument("--reps", type=int, default=3)
    t.add_argument("--topk-reps", type=int, default=10)
    t.add_argument("--head-chunks", **chunk_counts)
    modes = dict(type=lambda text: [m for m in text.split(",") if m], default=list(MODES),
                 help="comma-separated parallel modes (default ulysses,ring)")
    c.add_argument("--modes", **modes)
    t.add_argument("--modes", **modes)
    f = commands.add_parser("profile")
    f.add_argument("--seq", type=int, default=131072)
    f.add_argument("--mode", default="ring", choices=MODES)
    f.add_argument("--keep-window", type=int, default=2048, help="0: dense")
    f.add_argument("--top", type=int, default=14)
    r = commands.add_parser("report")
    r.add_argument("dir")
    args = parser.parse_args()
    dict(check=check, time=time_steps, profile=profile, report=report)[args.command](args)


if __name__ == "__main__":
    main()
