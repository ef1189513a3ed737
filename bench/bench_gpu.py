#!/usr/bin/env python3
"""GPU benchmark: dmattn against torch SDPA and FlexAttention, same inputs, one process.

Four suites, each a list of cases (Spec below) with the systems that can run them:

- main: B=1, 32 query heads, 8 kv heads, D=128, bf16, causal, S in {4096, 16384}: no mask; a key-only
  bias (B, 8, 1, S); the key bias plus a (B, 8, S, S) bool mask holding the top-1024 keys of every row
  (by the causal-masked bias); decode (Sq=1, Sk=131072, B=4) without and with the key bias; dmattn's own
  top-k (keep_window_size, selection included in every call) at S = 16384 to 131072.
- shapes: the training shapes of the Hopper issue (head dims 64-256, short sequences in large batches,
  packed varlen, softcap, deterministic, a random bool mask, the seed's flash_dmattn_func with a top-1024
  mask, a full 4-D bias with its gradient, a sliding window), each beside its best peer and the target.
- topk: dmattn's top-k against its own dense path on the same shape and bias, for S in {2048 .. 65536}
  and w in {256, 1024, 2048}, batched, varlen, D=64 and S=131072, with the ideal work ratio and the fill
  efficiency of the forward's gathered key tiles (forward_fill).
- portable: the sm80-class kernels forced on this GPU (DMATTN_PORTABLE=1) under the shared memory of an
  RTX 4090 / L40 (DMATTN_SMEM_LIMIT=99) and of an A100 (163), D in {64, 128}, 32/8 heads, B=16 x 2048 and
  B=1 x 16384, without a bias and with a key bias, against SDPA flash (FA2, mma.sync code too).

Systems: dmattn; torch SDPA with one backend forced (flash = FA2, cuDNN, efficient; a bias or mask is
given to SDPA as a materialised (B, H, Sq, Sk) additive bias with -inf where a key is not allowed);
FlexAttention (torch.compile; score_mod adds the bias and applies softcap, mask_mod holds causal, the
window and the bool mask). A system that errors or runs out of memory is skipped with the reason.

Reported per call: median ms over several timed reps (CUDA events, after a warm-up), TFLOP/s counted on
allowed entries only (4 * D * allowed (query, key) pairs; fwd+bwd counts 3.5 times that), GB/s of K and
V read for decode, and the peak memory a system allocates beyond the shared inputs (a materialised bias
or a block mask included). The max |difference| of each peer's output from dmattn's is recorded as a
check.

    python3 bench/bench_gpu.py run --out DIR [--suite main,shapes,topk,portable] [--deadline EPOCH] [--commit SHA]
                                   [--only TEXT]
    python3 bench/bench_gpu.py report DIR/performance.json --out docs

`run` writes DIR/performance.json after every case (keeping the suites it does not run from an existing
JSON there), then DIR/performance.md and the plots (bench_report.py); `report` rewrites the last from a JSON. Past
--deadline, what is left is recorded as not run; --only runs the cases whose name contains TEXT.
"""

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Optional, Tuple

from bench_systems import MAKERS

FWD_BWD_FLOP_FACTOR = 3.5  # backward = 2.5 forwards (five matrix products against two)
TOP_K = 1024
SCALING_W = 2048
DECODE_BATCH, DECODE_KEYS = 4, 131072
SDPA = ("SDPA flash", "SDPA cuDNN", "SDPA efficient")
ALL = ("dmattn",) + SDPA + ("FlexAttention",)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One case: the shapes and options every system of `systems` runs on the same inputs."""

    case: str
    batch: int = 1
    sq: int = 16384
    sk: int = 0  # 0: sq
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    bias: str = ""  # "": none, "key": (B, Hk, 1, Sk), "full": (B, Hk, Sq, Sk); differentiable
    mask: str = ""  # "": none, "top": the top-1024 keys of each row by the bias, "random": ~50% of the keys
    keep: Optional[int] = None  # dmattn's keep_window_size
    varlen: int = 0  # sequences of sq tokens packed along the tokens (batch 1)
    softcap: float = 0.0
    deterministic: bool = False
    window: Optional[Tuple[int, int]] = None
    api: str = "attention"  # or "flash_dmattn_func" (the seed's entry point)
    smem_cap: int = 0  # KiB: dmattn's sm80-class kernels forced, the shared memory capped (0: the device's own)
    graph: bool = False  # dmattn also timed as a replayed CUDA graph (the GPU's time, without the host's)
    together: str = ""  # consecutive specs of one label: measured in interleaved rounds (a target's ratio of them)
    systems: Tuple[str, ...] = ALL

    @property
    def keys(self):
        return self.sk or self.sq

    @property
    def decode(self):
        return self.sq == 1

    @property
    def causal(self):
        return not self.decode  # one query row at the end sees every key: causal changes nothing

    @property
    def group(self):
        return self.heads // self.kv_heads


def _main_suite():
    dense = ("key bias", "key bias + top-1024 mask")
    cases = [Spec("no mask"), Spec("key bias", bias="key"), Spec(dense[1], bias="key", mask="top")]
    cases += [Spec("decode", batch=DECODE_BATCH, sq=1, sk=DECODE_KEYS),
              Spec("decode + key bias", batch=DECODE_BATCH, sq=1, sk=DECODE_KEYS, bias="key")]
    cases += [Spec("key bias, keep 1024", bias="key", keep=1024, systems=("dmattn",))]
    cases += [Spec(f"key bias, keep {SCALING_W}", sq=s, bias="key", keep=SCALING_W, systems=("dmattn",))
              for s in (16384, 65536, 131072)]
    cases += [Spec(f"decode + key bias, keep {SCALING_W}", batch=DECODE_BATCH, sq=1, sk=DECODE_KEYS, bias="key",
                   keep=SCALING_W, systems=("dmattn",))]
    cases += [Spec("no mask", sq=4096), Spec("key bias", sq=4096, bias="key"),
              Spec(dense[1], sq=4096, bias="key", mask="top")]
    return cases


PEERS = ("dmattn", "SDPA cuDNN", "SDPA flash")  # FlexAttention only where it is the row's peer: it compiles
SHAPES = [  # the Hopper issue's table, in its order
    Spec("D=128, 32/8 heads, S=16384", systems=PEERS),
    Spec("D=128, 32/8 heads, B=16, S=2048", batch=16, sq=2048, systems=PEERS),
    Spec("D=64, 32/8 heads, S=16384", head_dim=64, systems=PEERS),
    Spec("D=64, 16/4 heads, B=16, S=2048", batch=16, sq=2048, heads=16, kv_heads=4, head_dim=64, systems=PEERS),
    *(Spec(f"D={d}, 32/8 heads, S=8192", sq=8192, head_dim=d, systems=PEERS) for d in (96, 192, 256)),
    Spec("key bias, varlen 8 x 2048", sq=2048, varlen=8, bias="key", systems=("dmattn",), together="varlen"),
    Spec("key bias, B=8, S=2048", batch=8, sq=2048, bias="key", systems=("dmattn",), together="varlen"),
    Spec("key bias, S=16384", bias="key", systems=("dmattn",), together="options"),
    Spec("softcap 30 + key bias, S=16384", bias="key", softcap=30.0, systems=("dmattn",), together="options"),
    Spec("deterministic, key bias, S=16384", bias="key", deterministic=True, systems=("dmattn",),
         together="options"),
    Spec("bool mask ~50% + key bias, (1, 8, 8192, 8192)", sq=8192, bias="key", mask="random",
         systems=("dmattn", "FlexAttention")),
    Spec("flash_dmattn_func, top-1024 mask + key bias, S=16384", bias="key", mask="top", api="flash_dmattn_func",
         systems=("dmattn",)),
    Spec("no bias, S=8192", sq=8192, systems=("dmattn",), together="full bias"),
    Spec("full 4-D bias (1, 8, 8192, 8192) with dbias", sq=8192, bias="full", systems=("dmattn",),
         together="full bias"),
    Spec("sliding window (1023, 0) + key bias, S=16384", bias="key", window=(1023, 0),
         systems=("dmattn", "FlexAttention")),
]
# Rows that are short enough for the host to bound a call (its Python, autograd and CUDA calls take longer than
# its kernels) are also timed as a replayed CUDA graph, as torch.compile(mode="reduce-overhead") or a captured
# training step runs them: the GPU's time alone.
GRAPH_KEYS = 4096
ROUNDS = 3  # rounds of such a shape's rows (shape_groups)
# Each dense row comes right before the top-k rows of its shape: those of at most GRAPH_KEYS keys are measured
# together in rounds (shape_groups).
TOPK = [
    *(spec for s in (2048, 4096, 8192, 16384, 65536) for spec in (
        Spec(f"key bias, S={s}", sq=s, bias="key", systems=("dmattn",), graph=s <= GRAPH_KEYS),
        *(Spec(f"key bias, keep {w}, S={s}", sq=s, bias="key", keep=w, systems=("dmattn",), graph=s <= GRAPH_KEYS)
          for w in (256, 1024, 2048)))),
    Spec("key bias, B=4, S=8192", batch=4, sq=8192, bias="key", systems=("dmattn",)),
    Spec("key bias, keep 1024, B=4, S=8192", batch=4, sq=8192, bias="key", keep=1024, systems=("dmattn",)),
    Spec("key bias, varlen 4 x 8192", sq=8192, varlen=4, bias="key", systems=("dmattn",)),
    Spec("key bias, keep 1024, varlen 4 x 8192", sq=8192, varlen=4, bias="key", keep=1024, systems=("dmattn",)),
    Spec("key bias, D=64, S=16384", head_dim=64, bias="key", systems=("dmattn",)),
    Spec("key bias, keep 1024, D=64, S=16384", head_dim=64, bias="key", keep=1024, systems=("dmattn",)),
    Spec("key bias, keep 2048, S=32768", sq=32768, bias="key", keep=2048, systems=("dmattn",)),
    Spec("key bias, keep 2048, S=131072", sq=131072, bias="key", keep=2048, systems=("dmattn",)),
]
PORTABLE_SHAPES = (("D=128, 32/8 heads, B=16, S=2048", dict(batch=16, sq=2048)),
                   ("D=128, 32/8 heads, S=16384", {}),
                   ("D=64, 32/8 heads, B=16, S=2048", dict(batch=16, sq=2048, head_dim=64)),
                   ("D=64, 32/8 heads, S=16384", dict(head_dim=64)))
PORTABLE = [Spec(f"{cap} KiB, {name}{bias}", smem_cap=cap, bias=bias and "key",
                 systems=("dmattn",) if bias or cap != 99 else ("dmattn", "SDPA flash"), **shape)
            for cap in (99, 163) for name, shape in PORTABLE_SHAPES for bias in ("", ", key bias")]
SUITES = {"main": _main_suite(), "shapes": SHAPES, "topk": TOPK, "portable": PORTABLE}

# --------------------------------------------------------------------------- inputs


def allowed_per_row(torch, spec):
    """(Sq,) counts of the keys each query row may attend by causal, the window and the keep window."""
    rows = torch.arange(spec.sq, dtype=torch.int64)
    last = rows + (spec.keys - spec.sq) if spec.causal else torch.full_like(rows, spec.keys - 1)
    first = torch.zeros_like(rows)
    if spec.window is not None:
        left, right = spec.window
        diagonal = rows + (spec.keys - spec.sq)
        first = (diagonal - left).clamp(min=0) if left >= 0 else first
        last = torch.minimum(last, diagonal + right) if right >= 0 else last
    count = (last.clamp(max=spec.keys - 1) - first + 1).clamp(min=0)
    return count.clamp(max=spec.keep) if spec.keep is not None else count


# The granule of the fill efficiency: query blocks of 128 rows (both forward kernels) walking the union of
# their selected keys in tiles of 64 (the sm80 gathered walk's, and a whole fraction of the Hopper one's 128).
FILL_ROWS, FILL_KEYS = 128, 64


def forward_fill(torch, intervals, rows, block_m=FILL_ROWS, block_n=FILL_KEYS):
    """Fill efficiency of a gathered top-k forward from its selection: per-key row intervals (..., Sk, 2)
    (dmattn's select, rows [start, end) that keep each key) over `rows` query rows. The selected (query, key)
    pairs over the pairs of the key tiles the query blocks walk: each block of block_m rows takes the union
    of the keys whose rows meet it, padded to whole tiles of block_n keys (1: no padding, no key outside a
    row's selection). Counted with a difference array over the blocks: O(Sk) a selection head."""
    start, end = intervals[..., 0].long().clamp(min=0), intervals[..., 1].long().clamp(max=rows)
    live = end > start
    useful = int((end - start).clamp(min=0).sum())
    blocks = -(-rows // block_m)
    first = torch.div(start, block_m, rounding_mode="floor").masked_fill(~live, blocks)
    after = (torch.div(end - 1, block_m, rounding_mode="floor") + 1).masked_fill(~live, blocks)
    edges = torch.zeros(*intervals.shape[:-2], blocks + 1, dtype=torch.long, device=intervals.device)
    edges.scatter_add_(-1, first, live.long()).scatter_add_(-1, after, -live.long())
    union = edges[..., :blocks].cumsum(-1)  # keys in each block's list
    block_rows = torch.full((blocks,), block_m, dtype=torch.long, device=intervals.device)
    block_rows[-1] = rows - (blocks - 1) * block_m
    walked = int((block_rows * (-(-union // block_n)) * block_n).sum())
    return useful / walked if walked else 1.0


def topk_fill(torch, case):
    """forward_fill of a top-k case's own selection (its bias, causal, its keep window)."""
    s = case.spec
    bias_shape = list(case.bias.shape)
    intervals = torch.ops.dmattn.select(case.q, case.k, None, None, case.bias, bias_shape, s.causal, -1, -1, s.keep)
    return forward_fill(torch, intervals, s.sq)


class Case:
    """The shared inputs of one spec: q (B, Sq, H, D), k and v (B, Sk, Hk, D) (varlen: the tokens of every
    sequence packed, (B * Sq, ...)), the bias, the bool mask, dout, and the count of allowed pairs."""

    def __init__(self, torch, spec):
        self.spec = s = spec
        gen = torch.Generator(device="cuda").manual_seed(0)
        opts = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
        batch = s.varlen or s.batch
        self.q = torch.randn(batch, s.sq, s.heads, s.head_dim, **opts)
        self.k = torch.randn(batch, s.keys, s.kv_heads, s.head_dim, **opts)
        self.v = torch.randn(batch, s.keys, s.kv_heads, s.head_dim, **opts)
        self.bias = None
        if s.bias:
            self.bias = torch.randn(batch, s.kv_heads, 1 if s.bias == "key" else s.sq, s.keys, **opts)
        self.mask = None
        causal = torch.ones(s.sq, s.keys, device="cuda", dtype=torch.bool).tril(s.keys - s.sq)
        if s.mask == "top":
            scores = self.bias.expand(batch, s.kv_heads, s.sq, s.keys).masked_fill(~causal, float("-inf"))
            keys = scores.topk(TOP_K, dim=-1).indices
            del scores
            self.mask = torch.zeros(batch, s.kv_heads, s.sq, s.keys, device="cuda", dtype=torch.bool)
            self.mask.scatter_(-1, keys, True).logical_and_(causal)
            del keys
        elif s.mask == "random":
            self.mask = torch.rand(batch, s.kv_heads, s.sq, s.keys, device="cuda", generator=gen) < 0.5
        if self.mask is not None:
            self.allowed = s.group * int((self.mask & causal).sum())
        else:
            self.allowed = batch * s.heads * int(allowed_per_row(torch, s).sum())
        del causal
        self.dout = torch.randn(batch, s.sq, s.heads, s.head_dim, **opts)

    def leaves(self, grad):
        """q, k, v and the bias as tensors of their own (autograd leaves when grad)."""
        return [None if t is None else t.detach().requires_grad_(grad) for t in (self.q, self.k, self.v, self.bias)]

    def dense_bias(self, torch, bias):
        """The (B, H, Sq, Sk) additive bias SDPA takes: the bias, -inf where a key is not allowed."""
        s = self.spec
        shape = (s.batch, s.kv_heads, s.sq, s.keys)
        allowed = self.mask
        if s.causal:
            causal = torch.ones(s.sq, s.keys, device="cuda", dtype=torch.bool).tril(s.keys - s.sq)
            allowed = causal if allowed is None else allowed & causal
        dense = bias.expand(shape) if bias is not None else torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
        if allowed is not None:
            dense = dense.masked_fill(~allowed, float("-inf"))
        return dense.repeat_interleave(s.group, dim=1)

    def bytes_kv(self):
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


# --------------------------------------------------------------------------- systems
# bench_systems.py: MAKERS[system](torch, case, grad) -> (fn, notes); fn() runs one forward (grad=False) or
# forward+backward (grad=True) and returns the output (B, Sq, H, D); whatever the maker builds (a materialised
# bias, a block mask) counts in the system's memory.


# --------------------------------------------------------------------------- measuring


def median_ms(torch, fn, budget_ms=400.0, min_reps=3, max_reps=50):
    """Median of per-call CUDA-event times after a warm-up; as many reps as fit the budget, within bounds."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    torch.cuda.synchronize()
    reps = int(min(max_reps, max(min_reps, budget_ms / max(start.elapsed_time(stop), 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events), reps


def graph_ms(torch, fn):
    """median_ms of fn captured once in a CUDA graph and replayed (warmed up on a side stream first, as torch's
    capture recipe asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms, _ = median_ms(torch, graph.replay)
    del graph
    return ms


def short(err):
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200] if text else ''}"


def measure(torch, case, system, grad, reference):
    """One system on one case, one mode: a result dict (ms, rates, peak memory, diff) or one with 'skip',
    and dmattn's forward output (the reference of the other systems' outputs)."""
    free(torch)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    kept = None
    try:
        fn, notes = MAKERS[system](torch, case, grad)
        out = fn()
        ms, reps = median_ms(torch, fn)
        result = dict(ms=ms, reps=reps, peak_mib=(torch.cuda.max_memory_allocated() - base) / 2**20, notes=notes)
        flops = 4 * case.spec.head_dim * case.allowed * (FWD_BWD_FLOP_FACTOR if grad else 1)
        result["tflops"] = flops / ms / 1e9
        if case.spec.decode:
            result["gbps"] = case.bytes_kv() / ms / 1e6
        if case.spec.graph and system == "dmattn":
            result["graph_ms"] = graph_ms(torch, fn)
        if not grad and system == "dmattn":
            kept = out
        elif not grad and reference is not None:
            result["max_abs_diff_vs_dmattn"] = float((out.float() - reference.float()).abs().max())
        del fn, out
    except torch.OutOfMemoryError:
        result = {"skip": "out of memory"}
    except Exception as err:  # noqa: BLE001 - any failure of a peer is reported, not fatal
        result = {"skip": short(err)}
    free(torch)
    return result, kept


def copy_gbps(torch):
    """The device's copy bandwidth (read + write bytes / time of a 4 GiB copy): the full bias's floor."""
    src = torch.empty(2**31, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms, _ = median_ms(torch, lambda: dst.copy_(src))
    return 2 * 2**32 / ms / 1e6  # the buffers go with the frame; every measurement frees the cache first


def free(torch):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def git_commit(root):
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load(path):
    """The JSON's suites ({name: {meta, rows}}); a JSON of the single-table format is the main suite."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data["suites"] if "suites" in data else {"main": data}


def measured_at(meta, build=True):
    """Where a row was measured: device, date, commit and (build) the build's head dims."""
    here = f"{meta['device']}, {meta['date']}, {meta['commit']}"
    return f"{here}, head dims {meta['dmattn']['head_dims']}" if build else here


def shape_groups(specs):
    """The specs in order as lists measured together, in ROUNDS interleaved rounds: consecutive specs of one
    shape whose calls the host bounds (`graph`), or of one `together` label (rows a target compares, whose
    ratio a slow stretch of the GPU would otherwise skew); any other spec is a list of its own."""
    groups = []
    for spec in specs:
        last = groups[-1][0] if groups else None
        if last is not None and ((spec.graph and last.graph and _shape(last) == _shape(spec)) or
                                 (spec.together and spec.together == last.together)):
            groups[-1].append(spec)
        else:
            groups.append([spec])
    return groups


def _shape(spec):
    return spec.batch, spec.sq, spec.keys, spec.varlen, spec.head_dim, spec.heads, spec.kv_heads


def measure_group(torch, suite, group, deadline):
    """The rows of a group of shape_groups: each (case, system, mode) measured once a round, rounds interleaving
    the group's cases (so that a slow stretch of the host weighs on every case of a fraction alike), the row of
    the round with the median time kept."""
    cases = [Case(torch, spec) for spec in group]
    fills = [topk_fill(torch, case) if suite == "topk" and case.spec.keep is not None else None for case in cases]
    rounds = ROUNDS if len(group) > 1 else 1
    results = {}
    for _ in range(rounds):
        for case in cases:
            reference = None
            for system in case.spec.systems:
                for grad in (False, True):
                    if grad and case.spec.decode:
                        continue  # inference only
                    if deadline and time.time() > deadline:
                        result = {"skip": "not run: deadline reached"}
                    else:
                        result, kept = measure(torch, case, system, grad, reference)
                        reference = kept if kept is not None else reference
                    results.setdefault((case.spec.case, system, grad), []).append(result)
    rows = []
    for case, fill in zip(cases, fills):
        s = case.spec
        where = dict(case=s.case, batch=s.batch, sq=s.sq, sk=s.keys) | ({} if fill is None else dict(fill=fill))
        for system in s.systems:
            for grad in (False, True):
                if (s.case, system, grad) not in results:
                    continue
                timed = sorted((r for r in results[s.case, system, grad] if "ms" in r), key=lambda r: r["ms"])
                result = timed[len(timed) // 2] if timed else results[s.case, system, grad][0]
                if rounds > 1:
                    result = dict(result, rounds=rounds)
                rows.append(dict(where, allowed=case.allowed, system=system, mode="fwd+bwd" if grad else "fwd",
                                 **result))
    return rows


def run(args):
    import torch

    import dmattn

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    suites = load(out_dir / "performance.json")
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                commit=args.commit or git_commit(Path(__file__).resolve().parent.parent),
                dmattn=dmattn.build_info())
    print(f"benchmark: {meta}", flush=True)
    for name in args.suite.split(","):
        # --only re-measures some cases: the suite's other rows stay, each row keeps the device and date it was
        # measured on (the report names those that differ from the suite's).
        kept = [r for r in suites.get(name, {}).get("rows", []) if args.only and args.only not in r["case"]]
        results = suites[name] = dict(meta=dict(suites[name]["meta"] if kept else meta), rows=kept)
        if name == "shapes":
            results["meta"]["copy_gbps"] = copy_gbps(torch)
        for group in shape_groups([spec for spec in SUITES[name] if not args.only or args.only in spec.case]):
            if args.deadline and time.time() > args.deadline:
                results["rows"] += [dict(case=spec.case, batch=spec.batch, sq=spec.sq, sk=spec.keys,
                                         skip="not run: deadline reached") for spec in group]
                continue
            started = time.time()
            for row in measure_group(torch, name, group, args.deadline):
                row["measured"] = measured_at(meta)
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
            free(torch)
            print(f"{name}: {', '.join(spec.case for spec in group)}: {time.time() - started:.1f} s", flush=True)
            (out_dir / "performance.json").write_text(json.dumps(dict(suites=suites), indent=1))
    from bench_report import report  # the report reads this module's suites

    report(suites, out_dir)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="measure, then write the JSON, the table and the plots")
    p_run.add_argument("--out", default=os.environ.get("OUT", "docs"))
    p_run.add_argument("--suite", default=",".join(SUITES),
                       help="comma-separated suites: main, shapes, topk, portable")
    p_run.add_argument("--deadline", type=float, default=0.0, help="epoch seconds after which nothing new starts")
    p_run.add_argument("--commit", default=os.environ.get("DMATTN_COMMIT", ""))
    p_run.add_argument("--only", default="", help="run only the cases whose name contains this text")
    p_report = sub.add_parser("report", help="rewrite the table and the plots from a JSON")
    p_report.add_argument("json")
    p_report.add_argument("--out", default="docs")
    args = parser.parse_args()
    if args.command == "run":
        unknown = set(args.suite.split(",")) - set(SUITES)
        if unknown:
            parser.error(f"--suite: expected names from {sorted(SUITES)}, got {sorted(unknown)}")
        run(args)
    else:
        from bench_report import report

        report(load(Path(args.json)), args.out)


if __name__ == "__main__":
    main()
