#!/usr/bin/env python3
"""GPU benchmark: dmattn against torch SDPA and FlexAttention, same inputs, one process.

Cases (issue 4, item 6): B=1, 32 query heads, 8 kv heads, D=128, bf16, causal,
S in {4096, 16384}: no mask; key-only bias (B, 8, 1, S); key-only bias plus a
(B, 8, S, S) bool mask holding the top-1024 keys of every row (by the causal-
masked bias); and decode (Sq=1, Sk=131072, B=4), without and with the key bias.
Top-k cases (issue 6), dmattn only (no peer selects keys per row from a bias:
the top-1024 mask case is what they run instead): the key bias with
keep_window_size = 1024 at S = 16384 (selection included in every call), the
same with w = 2048 at S = 16384, 65536 and 131072 (scaling in S at fixed w),
and decode (Sq=1, Sk=131072, B=4) with w = 2048 against dmattn's dense decode.

Systems: dmattn; torch SDPA with one backend forced (flash, cuDNN, efficient;
a bias or mask is given to SDPA as a materialised (B, 32, Sq, Sk) additive
bias with -inf where a key is not allowed); FlexAttention (torch.compile,
score_mod adding the key bias, block mask for causal or reading the bool mask).
A system that errors or runs out of memory is skipped with the reason.

Reported per call: median ms over several timed reps (CUDA events, after a
warm-up), TFLOP/s counted on allowed entries only (4 * D * allowed (query, key)
pairs summed over batch and query heads; fwd+bwd counts 3.5 times that), GB/s
of K and V read for decode, and the peak memory a system allocates beyond the
shared inputs (what it builds for itself, a materialised bias or a block mask,
included). The max |difference| of each peer's output from dmattn's is recorded
as a check.

    python3 bench/bench_gpu.py run --out DIR [--deadline EPOCH] [--commit SHA] [--only TEXT]
    python3 bench/bench_gpu.py report DIR/performance.json --out docs

`run` writes DIR/performance.json after every case, then the markdown table
DIR/performance.md and the plot DIR/performance.png; `report` rewrites
the last two from a JSON. Past --deadline, what is left is recorded as not run;
--only runs the cases whose name contains TEXT (e.g. "keep": the top-k cases).
"""

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
GROUP = HEADS // KV_HEADS
TOP_K = 1024
SCALING_W = 2048
DECODE_BATCH, DECODE_KEYS = 4, 131072
FWD_BWD_FLOP_FACTOR = 3.5  # backward = 2.5 forwards (five matrix products against two)
CASES = [  # (kind, batch, query length, key length): the long ones first, so a deadline cuts the short ones
    ("no mask", 1, 16384, 16384),
    ("key bias", 1, 16384, 16384),
    ("key bias + top-1024 mask", 1, 16384, 16384),
    ("decode", DECODE_BATCH, 1, DECODE_KEYS),
    ("decode + key bias", DECODE_BATCH, 1, DECODE_KEYS),
    ("key bias, keep 1024", 1, 16384, 16384),
    ("key bias, keep 2048", 1, 16384, 16384),
    ("key bias, keep 2048", 1, 65536, 65536),
    ("key bias, keep 2048", 1, 131072, 131072),
    ("decode + key bias, keep 2048", DECODE_BATCH, 1, DECODE_KEYS),
    ("no mask", 1, 4096, 4096),
    ("key bias", 1, 4096, 4096),
    ("key bias + top-1024 mask", 1, 4096, 4096),
]
SYSTEMS = ["dmattn", "SDPA flash", "SDPA cuDNN", "SDPA efficient", "FlexAttention"]
# DESIGN.md: one H200, B=1, 32/8 heads, D=128, bf16, causal, S=16384, fwd ms / fwd+bwd ms; measured by
# others on the seed project (flash-dmattn) and its peers, not re-run here.
SEED_REFERENCE = {  # case: [(label, fwd ms / fwd+bwd ms, the system of ours it sits beside or None)]
    "no mask": [("seed CUDA (FA2-based)", "6.94 / 24.6", "dmattn"), ("seed Triton", "6.57 / 53.8", None),
                ("FlexAttention", "5.24 / 19.6", "FlexAttention"), ("SDPA flash (FA2)", "6.42 / 24.4", "SDPA flash"),
                ("SDPA cuDNN", "3.39 / 13.4", "SDPA cuDNN")],
    "key bias": [("seed CUDA (FA2-based)", "7.92 / 30.0", "dmattn"), ("seed Triton", "8.29 / 73.0", None),
                 ("FlexAttention", "5.86 / 26.8", "FlexAttention"),
                 ("SDPA materialised bias", "63.9 / 181 (34 GB)", "SDPA efficient")],
    "key bias + top-1024 mask": [("seed CUDA (FA2-based)", "13.5 / 47.2 (+ an O(S^2) mask built outside)",
                                  "dmattn"),
                                 ("seed Triton", "12.3 / 115", None),
                                 ("FlexAttention", "out of memory", "FlexAttention"),
                                 ("SDPA materialised bias", "66.8 / 181", "SDPA efficient")],
}
TARGETS = [  # (case, S, measure, target, comparison): the H100 targets of the issue, reported against dmattn's forward
    ("no mask", 16384, "fwd TFLOP/s", 330, ">="),
    ("key bias", 16384, "fwd TFLOP/s", 320, ">="),
    ("key bias + top-1024 mask", 16384, "fwd ms", 8, "<="),
    ("decode", DECODE_KEYS, "fwd GB/s", 2000, ">="),
]
TOPK_TARGETS = [  # issue 6 (H200 numbers; the H100 is slower)
    ("key bias, keep 1024", 16384, "fwd+bwd ms, selection included", 6, "<="),
]


# --------------------------------------------------------------------------- inputs


class Case:
    """The shared inputs of one case: q (B, Sq, H, D), k and v (B, Sk, Hk, D), the key bias and the mask."""

    def __init__(self, torch, kind, batch, sq, sk):
        self.kind, self.batch, self.sq, self.sk = kind, batch, sq, sk
        self.decode = kind.startswith("decode")
        self.keep = int(kind.rsplit(" ", 1)[1]) if "keep" in kind else None
        self.causal = not self.decode  # one query row at the end sees every key: causal changes nothing
        gen = torch.Generator(device="cuda").manual_seed(0)
        opts = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
        self.q = torch.randn(batch, sq, HEADS, HEAD_DIM, **opts)
        self.k = torch.randn(batch, sk, KV_HEADS, HEAD_DIM, **opts)
        self.v = torch.randn(batch, sk, KV_HEADS, HEAD_DIM, **opts)
        self.bias = torch.randn(batch, KV_HEADS, 1, sk, **opts) if "bias" in kind else None
        self.mask = None
        if "top" in kind:
            allowed = torch.ones(sq, sk, device="cuda", dtype=torch.bool).tril()
            scores = self.bias.expand(batch, KV_HEADS, sq, sk).masked_fill(~allowed, float("-inf"))
            keys = scores.topk(TOP_K, dim=-1).indices
            del scores
            self.mask = torch.zeros(batch, KV_HEADS, sq, sk, device="cuda", dtype=torch.bool)
            self.mask.scatter_(-1, keys, True).logical_and_(allowed)
            del keys, allowed
            self.allowed = GROUP * int(self.mask.sum())
        elif self.keep is not None:  # row i keeps min(w, its allowed keys)
            w, offset = self.keep, sk - sq
            allowed_keys = torch.arange(sq, dtype=torch.int64) + offset + 1 if self.causal else torch.full((sq,), sk)
            self.allowed = batch * HEADS * int(allowed_keys.clamp(max=w).sum())
        elif self.causal:
            self.allowed = batch * HEADS * sq * (sq + 1) // 2
        else:
            self.allowed = batch * HEADS * sq * sk
        self.dout = torch.randn(batch, sq, HEADS, HEAD_DIM, **opts)

    def leaves(self, grad):
        """q, k, v and the bias as tensors of their own (autograd leaves when grad)."""
        return [None if t is None else t.detach().requires_grad_(grad) for t in (self.q, self.k, self.v, self.bias)]

    def dense_bias(self, torch, bias):
        """The (B, H, Sq, Sk) additive bias SDPA takes: the key bias, -inf where a key is not allowed."""
        shape = (self.batch, KV_HEADS, self.sq, self.sk)
        allowed = self.mask
        if allowed is None and self.causal:
            allowed = torch.ones(self.sq, self.sk, device="cuda", dtype=torch.bool).tril()
        dense = bias.expand(shape) if bias is not None else torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
        if allowed is not None:
            dense = dense.masked_fill(~allowed, float("-inf"))
        return dense.repeat_interleave(GROUP, dim=1)

    def bytes_kv(self):
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


# --------------------------------------------------------------------------- systems
# make(case, grad) -> (fn, notes): fn() runs one forward (grad=False) or forward+backward (grad=True) and
# returns the output (B, Sq, H, D); whatever make builds (a materialised bias, a block mask) counts in the
# system's memory.


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

    q, k, v, bias = case.leaves(grad)

    def forward():
        return dmattn.attention(q, k, v, mask=case.mask, bias=bias, causal=case.causal,
                                keep_window_size=case.keep)

    return (fwd_bwd(torch, forward, [q, k, v, bias], case.dout) if grad else forward), []


def make_sdpa(backend_name):
    def make(torch, case, grad):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        q, k, v, bias = case.leaves(grad)
        notes = []
        attn_mask = None
        if bias is not None or case.mask is not None:
            attn_mask = case.dense_bias(torch, case.bias).requires_grad_(grad)
            notes.append(f"materialised bias {tuple(attn_mask.shape)}, {attn_mask.nbytes / 2**30:.1f} GiB, "
                         "built outside the timed call")
        is_causal = case.causal and attn_mask is None

        def call(repeat_kv):
            kk, vv = (k.repeat_interleave(GROUP, dim=2), v.repeat_interleave(GROUP, dim=2)) if repeat_kv else (k, v)
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
            notes.append("no enable_gqa in this backend: k, v repeated to 32 heads inside the timed call")
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
    q, k, v, bias = case.leaves(grad)
    notes = []
    block_mask = None
    if case.mask is not None:
        mask = case.mask
        block_mask = create_block_mask(lambda b, h, qi, ki: mask[b, h // GROUP, qi, ki], case.batch, HEADS,
                                       case.sq, case.sk, device="cuda", _compile=True)
        notes.append("mask_mod reads the bool mask")
    elif case.causal:
        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, case.sq, case.sk, device="cuda")
    score_mod = None
    if bias is not None:
        def score_mod(score, b, h, qi, ki):
            return score + bias[b, h // GROUP, 0, ki]

    def forward():
        out = _flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                    block_mask=block_mask, enable_gqa=True)
        return out.transpose(1, 2)

    return (fwd_bwd(torch, forward, [q, k, v, bias], case.dout) if grad else forward), notes


MAKERS = {"dmattn": make_dmattn, "SDPA flash": make_sdpa("FLASH_ATTENTION"),
          "SDPA cuDNN": make_sdpa("CUDNN_ATTENTION"), "SDPA efficient": make_sdpa("EFFICIENT_ATTENTION"),
          "FlexAttention": make_flex}


# --------------------------------------------------------------------------- measuring


def median_ms(torch, fn, budget_ms=400.0, min_reps=3, max_reps=20):
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
        flops = 4 * HEAD_DIM * case.allowed * (FWD_BWD_FLOP_FACTOR if grad else 1)
        result["tflops"] = flops / ms / 1e9
        if case.decode:
            result["gbps"] = case.bytes_kv() / ms / 1e6
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


def run(args):
    import torch

    import dmattn

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                commit=args.commit or git_commit(Path(__file__).resolve().parent.parent),
                dmattn=dmattn.build_info())
    print(f"benchmark: {meta}", flush=True)
    results = dict(meta=meta, rows=[])
    for kind, batch, sq, sk in CASES:
        if args.only and args.only not in kind:
            continue
        if args.deadline and time.time() > args.deadline:
            results["rows"].append(dict(case=kind, batch=batch, sq=sq, sk=sk, skip="not run: deadline reached"))
            continue
        started = time.time()
        case = Case(torch, kind, batch, sq, sk)
        reference = None
        for system in SYSTEMS if case.keep is None else ["dmattn"]:
            for grad in (False, True):
                if grad and case.decode:
                    continue  # inference only
                if args.deadline and time.time() > args.deadline:
                    result = {"skip": "not run: deadline reached"}
                else:
                    result, kept = measure(torch, case, system, grad, reference)
                    reference = kept if kept is not None else reference
                row = dict(case=kind, batch=batch, sq=sq, sk=sk, allowed=case.allowed, system=system,
                           mode="fwd+bwd" if grad else "fwd", **result)
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
        del case, reference
        free(torch)
        print(f"case {kind} S={sq}/{sk}: {time.time() - started:.1f} s", flush=True)
        (out_dir / "performance.json").write_text(json.dumps(results, indent=1))
    report(results, out_dir)


# --------------------------------------------------------------------------- report


def fmt(row, key, digits):
    return "" if row is None or key not in row else f"{row[key]:.{digits}f}"


def report(results, out_dir):
    meta, rows = results["meta"], results["rows"]
    index = {(r["case"], r["sq"], r["sk"], r.get("system"), r.get("mode")): r for r in rows}
    skips = [f"{r['case']}, Sq={r['sq']}, Sk={r['sk']}: {r['skip']}" for r in rows if "system" not in r]
    lines = [
        "# GPU benchmark: dmattn against torch SDPA and FlexAttention",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}",
        f"- commit: {meta['commit']} (dmattn {meta['dmattn']['version']}, CUDA archs "
        f"{meta['dmattn']['cuda_architectures']}, head dims {meta['dmattn']['head_dims']})",
        f"- torch {meta['torch']}, CUDA {meta['cuda']}",
        "- produced by `scripts/bench_gpu.sh` (bench/bench_gpu.py): one process, the same inputs for every system",
        "",
        f"B=1, {HEADS} query heads, {KV_HEADS} kv heads, D={HEAD_DIM}, bf16, causal; decode: B={DECODE_BATCH}, "
        f"Sq=1, Sk={DECODE_KEYS}. Key bias: (B, {KV_HEADS}, 1, S). Top-1024 mask: a (B, {KV_HEADS}, S, S) bool "
        "tensor of the 1024 keys of largest bias in every causal row, built once with torch.topk and given to "
        "every system (dmattn: as `mask` with the bias; SDPA: folded into a materialised (B, 32, S, S) bias "
        "with -inf; Flex: a mask_mod reading it). ms: median of CUDA-event times after a warm-up. TFLOP/s: "
        f"4 * D * allowed (query, key) pairs (fwd+bwd: {FWD_BWD_FLOP_FACTOR} times that). GB/s (decode): bytes "
        "of K and V / time. Peak: the most memory a system held beyond the shared inputs over its warm-up and "
        "timed calls: two outputs alive at once (the warm-up's, kept for the check, and a timed call's), its "
        "materialised bias or block mask, its workspace; fwd+bwd adds the gradients. max |d|: largest absolute "
        "difference of a peer's forward output from dmattn's.",
        "",
        "| case | S | system | fwd ms | fwd TFLOP/s | fwd GB/s | fwd peak MiB | fwd+bwd ms | fwd+bwd TFLOP/s "
        "| fwd+bwd peak MiB | max abs d vs dmattn | reference: H200, others, not re-run (fwd / fwd+bwd ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, batch, sq, sk in CASES:
        length = sk if sq == 1 else sq
        for system in SYSTEMS:
            fwd = index.get((kind, sq, sk, system, "fwd"))
            bwd = index.get((kind, sq, sk, system, "fwd+bwd"))
            if fwd is None and bwd is None:
                continue
            cells = []
            for mode, row, keys in (("fwd", fwd, (("ms", 2), ("tflops", 1), ("gbps", 0), ("peak_mib", 0))),
                                    ("fwd+bwd", bwd, (("ms", 2), ("tflops", 1), ("peak_mib", 0)))):
                if row is not None and "skip" in row:
                    skips.append(f"{kind}, S={length}, {system}, {mode}: {row['skip']}")
                    unbuilt = row["skip"].startswith("NotImplementedError")
                    cells += ["n/a" if unbuilt else "skipped"] + [""] * (len(keys) - 1)
                elif row is None:
                    cells += ["n/a (inference case)" if mode == "fwd+bwd" else ""] + [""] * (len(keys) - 1)
                else:
                    cells += [fmt(row, key, digits) for key, digits in keys]
            diff = "" if system == "dmattn" else fmt(fwd, "max_abs_diff_vs_dmattn", 4)
            seed = "; ".join(f"{label} {value}" for label, value, ours in SEED_REFERENCE.get(kind, [])
                             if ours == system and length == 16384)
            lines.append(f"| {kind} | {length} | {system} | " + " | ".join(cells) + f" | {diff} | {seed} |")
    lines += ["", "Skipped (the reason each system gave):", ""]
    lines += [f"- {s}" for s in skips] or ["- nothing"]
    notes = sorted({f"{r['system']}: {n}" for r in rows if "notes" in r for n in r["notes"]})
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    lines += ["", "## Where dmattn stands against the targets (H100, forward)", "",
              "| case | S | measure | target | dmattn |", "|---|---|---|---|---|"]
    for kind, length, what, target, op in TARGETS:
        key = {"fwd TFLOP/s": "tflops", "fwd ms": "ms", "fwd GB/s": "gbps"}[what]
        row = next((r for r in rows if r["case"] == kind and max(r["sq"], r["sk"]) == length
                    and r.get("system") == "dmattn" and r.get("mode") == "fwd" and key in r), None)
        lines.append(f"| {kind} | {length} | {what} | {op} {target} | {fmt(row, key, 1) or 'not measured'} |")
    lines += topk_report(rows)
    lines += ["", "## Reference: the seed project's numbers (DESIGN.md)", "",
              "Measured on one H200 by others, S=16384, fwd ms / fwd+bwd ms; not re-run here.", "",
              "| case | system | fwd ms / fwd+bwd ms |", "|---|---|---|"]
    for kind, entries in SEED_REFERENCE.items():
        lines += [f"| {kind} | {label} | {value} |" for label, value, _ in entries]
    lines += ["", "![fwd TFLOP/s and decode GB/s](performance.png)", ""]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "performance.md").write_text("\n".join(lines))
    plot(results, Path(out_dir) / "performance.png")


def topk_report(rows):
    """The issue 6 measures: top-k time against its target, scaling in S at fixed w, decode against dense."""
    def get(kind, sq, sk, mode, key):
        row = next((r for r in rows if (r["case"], r["sq"], r["sk"], r.get("system"), r.get("mode")) ==
                    (kind, sq, sk, "dmattn", mode) and key in r), None)
        return None if row is None else row[key]

    lines = ["", "## Top-k (keep_window_size, selection included; issue 6)", "",
             "| case | S | measure | target | dmattn |", "|---|---|---|---|---|"]
    for kind, length, what, target, op in TOPK_TARGETS:
        value = get(kind, length, length, "fwd+bwd", "ms")
        lines.append(f"| {kind} | {length} | {what} | {op} {target} (H200) | "
                     f"{'not measured' if value is None else f'{value:.2f}'} |")
    lines += ["", f"Scaling at w = {SCALING_W} (B=1): each step's time ratio over its S ratio (target: <= 1.3).", "",
              "| S | fwd ms | fwd+bwd ms | fwd+bwd peak MiB | fwd step / S step | fwd+bwd step / S step |",
              "|---|---|---|---|---|---|"]
    previous = None
    for kind, _, sq, sk in CASES:
        if kind != f"key bias, keep {SCALING_W}":
            continue
        now = (sq, get(kind, sq, sk, "fwd", "ms"), get(kind, sq, sk, "fwd+bwd", "ms"))
        steps = ["", ""]
        if previous is not None:
            steps = [f"{b / a / (now[0] / previous[0]):.2f}" if a and b else "" for a, b in zip(previous[1:], now[1:])]
        peak = get(kind, sq, sk, "fwd+bwd", "peak_mib")
        cells = ["" if x is None else f"{x:.2f}" for x in now[1:]] + ["" if peak is None else f"{peak:.0f}"]
        lines.append(f"| {sq} | " + " | ".join(cells + steps) + " |")
        previous = now
    dense = get("decode + key bias", 1, DECODE_KEYS, "fwd", "ms")
    topk = get(f"decode + key bias, keep {SCALING_W}", 1, DECODE_KEYS, "fwd", "ms")
    if dense and topk:
        lines += ["", f"Decode B={DECODE_BATCH}, Sk={DECODE_KEYS}, key bias: dense {dense:.3f} ms, keep {SCALING_W} "
                  f"{topk:.3f} ms, ratio {topk / dense:.3f} (target < 0.25)."]
    return lines


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r.get("mode") == "fwd" and "ms" in r]
    dense = [c for c in CASES if c[2] > 1]
    decode = [c for c in CASES if c[2] == 1]
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw=dict(width_ratios=[3, 1]))
    width = 0.8 / len(SYSTEMS)
    for ax, cases, key, label in ((axes[0], dense, "tflops", "fwd TFLOP/s (allowed entries)"),
                                  (axes[1], decode, "gbps", "decode fwd GB/s (K and V read)")):
        for i, system in enumerate(SYSTEMS):
            values = []
            for kind, _, sq, sk in cases:
                row = next((r for r in rows if (r["case"], r["sq"], r["sk"], r["system"]) == (kind, sq, sk, system)),
                           None)
                values.append(row[key] if row else 0.0)
            ax.bar([j + (i - (len(SYSTEMS) - 1) / 2) * width for j in range(len(cases))], values, width,
                   label=system)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{kind}\nS={sq}" if sq > 1 else kind for kind, _, sq, _ in cases], fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    meta = results["meta"]
    fig.suptitle(f"dmattn vs peers, forward, bf16, 32/8 heads, D=128 - {meta['device']}, {meta['date']}, "
                 f"commit {meta['commit']} (missing bar: skipped)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="measure, then write the JSON, the table and the plot")
    p_run.add_argument("--out", default=os.environ.get("OUT", "docs"))
    p_run.add_argument("--deadline", type=float, default=0.0, help="epoch seconds after which nothing new starts")
    p_run.add_argument("--commit", default=os.environ.get("DMATTN_COMMIT", ""))
    p_run.add_argument("--only", default="", help="run only the cases whose name contains this text")
    p_report = sub.add_parser("report", help="rewrite the table and the plot from a JSON")
    p_report.add_argument("json")
    p_report.add_argument("--out", default="docs")
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    else:
        report(json.loads(Path(args.json).read_text()), args.out)


if __name__ == "__main__":
    main()
