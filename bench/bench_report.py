"""bench_gpu.py's report: performance.md (a table per suite with its date, device and commit, the targets
of the issues and whether each is met, the seed project's published numbers beside ours) and the plots,
from the suites' results ({name: {meta, rows}}, as performance.json holds them).

    python3 bench/bench_gpu.py report DIR/performance.json --out docs
"""

import dataclasses
from pathlib import Path

from bench_gpu import (ALL, DECODE_BATCH, DECODE_KEYS, FILL_KEYS, FILL_ROWS, FWD_BWD_FLOP_FACTOR, GRAPH_KEYS,
                       PORTABLE, PORTABLE_SHAPES, ROUNDS, SCALING_W, SHAPES, SUITES, TOP_K, TOPK, allowed_per_row,
                       measured_at)

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
TARGETS = [  # (case, S, measure, target, comparison): the main suite's targets, against dmattn's forward
    ("no mask", 16384, "fwd TFLOP/s", 330, ">="),
    ("key bias", 16384, "fwd TFLOP/s", 320, ">="),
    ("key bias + top-1024 mask", 16384, "fwd ms", 8, "<="),
    ("decode", DECODE_KEYS, "fwd GB/s", 2000, ">="),
]


def fmt(row, key, digits):
    return "" if row is None or key not in row else f"{row[key]:.{digits}f}"


class Rows:
    """Lookup of one suite's results by (case, sq, sk, system, mode)."""

    def __init__(self, rows):
        self.rows = rows
        self.index = {(r["case"], r["sq"], r["sk"], r.get("system"), r.get("mode")): r for r in rows}

    def get(self, spec, system, mode, key="ms"):
        row = self.index.get((spec.case, spec.sq, spec.keys, system, mode))
        return None if row is None or key not in row else row[key]


def header(title, meta, lines):
    return [f"## {title}", "",
            f"- date: {meta['date']}; device: {meta['device']}; commit: {meta['commit']} (dmattn "
            f"{meta['dmattn']['version']}, CUDA archs {meta['dmattn']['cuda_architectures']}, head dims "
            f"{meta['dmattn']['head_dims']}); torch {meta['torch']}, CUDA {meta['cuda']}", ""] + lines


def measured_apart(suite):
    """Lines naming the rows measured on another device, date, commit or build than the suite's header (rows
    measured before the build's head dims were recorded name the first three)."""
    meta = suite["meta"]
    here = {None, measured_at(meta), measured_at(meta, build=False)}  # None: rows that name no place
    apart = sorted({f"- {r['case']}: {r['measured']}" for r in suite["rows"] if r.get("measured") not in here})
    return ["", "Measured apart from the header's run:", ""] + apart if apart else []


def skipped(rows):
    def where(r):
        return r["case"] if "S=" in r["case"] else f"{r['case']}, S={r['sq']}"

    lines = [f"- {where(r)}, {r['system']}, {r['mode']}: {r['skip']}" for r in rows if "skip" in r and "system" in r]
    lines += [f"- {where(r)}: {r['skip']}" for r in rows if "system" not in r]
    notes = sorted({f"{r['system']}: {n}" for r in rows if "notes" in r for n in r["notes"]})
    return (["", "Skipped (the reason each system gave):", ""] + (lines or ["- nothing"]) +
            (["", "Notes:", ""] + [f"- {n}" for n in notes] if notes else []))


def main_report(suite):
    meta, rows = suite["meta"], Rows(suite["rows"])
    lines = header("Main table: D=128, 32/8 heads, S = 4096 and 16384, decode", meta, [
        f"B=1, 32 query heads, 8 kv heads, D=128, bf16, causal; decode: B={DECODE_BATCH}, Sq=1, Sk={DECODE_KEYS}. "
        f"Key bias: (B, 8, 1, S). Top-{TOP_K} mask: a (B, 8, S, S) bool tensor of the {TOP_K} keys of largest bias "
        "in every causal row, built once with torch.topk and given to every system (dmattn: as `mask` with the "
        "bias; SDPA: folded into a materialised (B, 32, S, S) bias with -inf; Flex: a mask_mod reading it). ms: "
        "median of CUDA-event times after a warm-up. TFLOP/s: 4 * D * allowed (query, key) pairs (fwd+bwd: "
        f"{FWD_BWD_FLOP_FACTOR} times that). GB/s (decode): bytes of K and V / time. Peak: the most memory a system "
        "held beyond the shared inputs over its warm-up and timed calls: two outputs alive at once, its "
        "materialised bias or block mask, its workspace; fwd+bwd adds the gradients. max |d|: largest absolute "
        "difference of a peer's forward output from dmattn's.",
        "",
        "| case | S | system | fwd ms | fwd TFLOP/s | fwd GB/s | fwd peak MiB | fwd+bwd ms | fwd+bwd TFLOP/s "
        "| fwd+bwd peak MiB | max abs d vs dmattn | reference: H200, others, not re-run (fwd / fwd+bwd ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"])
    for spec in SUITES["main"]:
        length = spec.keys if spec.decode else spec.sq
        for system in ALL:
            fwd = rows.index.get((spec.case, spec.sq, spec.keys, system, "fwd"))
            bwd = rows.index.get((spec.case, spec.sq, spec.keys, system, "fwd+bwd"))
            if fwd is None and bwd is None:
                continue
            cells = []
            for mode, row, keys in (("fwd", fwd, (("ms", 2), ("tflops", 1), ("gbps", 0), ("peak_mib", 0))),
                                    ("fwd+bwd", bwd, (("ms", 2), ("tflops", 1), ("peak_mib", 0)))):
                if row is not None and "skip" in row:
                    cells += ["skipped"] + [""] * (len(keys) - 1)
                elif row is None:
                    cells += ["n/a (inference case)" if mode == "fwd+bwd" else ""] + [""] * (len(keys) - 1)
                else:
                    cells += [fmt(row, key, digits) for key, digits in keys]
            diff = "" if system == "dmattn" else fmt(fwd, "max_abs_diff_vs_dmattn", 4)
            seed = "; ".join(f"{label} {value}" for label, value, ours in SEED_REFERENCE.get(spec.case, [])
                             if ours == system and length == 16384)
            lines.append(f"| {spec.case} | {length} | {system} | " + " | ".join(cells) + f" | {diff} | {seed} |")
    lines += skipped(suite["rows"]) + measured_apart(suite)
    lines += ["", "Where dmattn stands against the targets (forward):", "",
              "| case | S | measure | target | dmattn |", "|---|---|---|---|---|"]
    for kind, length, what, target, op in TARGETS:
        key = {"fwd TFLOP/s": "tflops", "fwd ms": "ms", "fwd GB/s": "gbps"}[what]
        spec = next(s for s in SUITES["main"] if s.case == kind and max(s.sq, s.keys) == length)
        value = rows.get(spec, "dmattn", "fwd", key)
        lines.append(f"| {kind} | {length} | {what} | {op} {target} | "
                     f"{'not measured' if value is None else f'{value:.1f}'} |")
    lines += ["", f"Top-k scaling at w = {SCALING_W} (B=1): each step's time ratio over its S ratio (linear: 1).", "",
              "| S | fwd ms | fwd+bwd ms | fwd+bwd peak MiB | fwd step / S step | fwd+bwd step / S step |",
              "|---|---|---|---|---|---|"]
    previous = None
    for spec in (s for s in SUITES["main"] if s.case == f"key bias, keep {SCALING_W}"):
        now = (spec.sq, rows.get(spec, "dmattn", "fwd"), rows.get(spec, "dmattn", "fwd+bwd"))
        steps = ["", ""]
        if previous is not None:
            steps = [f"{b / a / (now[0] / previous[0]):.2f}" if a and b else "" for a, b in zip(previous[1:], now[1:])]
        peak = rows.get(spec, "dmattn", "fwd+bwd", "peak_mib")
        cells = ["" if x is None else f"{x:.2f}" for x in now[1:]] + ["" if peak is None else f"{peak:.0f}"]
        lines.append(f"| {spec.sq} | " + " | ".join(cells + steps) + " |")
        previous = now
    lines += ["", "Reference: the seed project's numbers (DESIGN.md), measured on one H200 by others, S=16384, "
              "fwd ms / fwd+bwd ms; not re-run here.", "", "| case | system | fwd ms / fwd+bwd ms |", "|---|---|---|"]
    for kind, entries in SEED_REFERENCE.items():
        lines += [f"| {kind} | {label} | {value} |" for label, value, _ in entries]
    return lines + ["", "![main table: fwd TFLOP/s and decode GB/s](performance.png)", ""]


def shapes_targets(rows, copy_gbps):
    """(row, target, measured, its unit, met) of each line of the Hopper issue's table."""
    spec = {s.case: s for s in SHAPES}

    def ms(case, system="dmattn", mode="fwd"):
        return rows.get(spec[case], system, mode)

    def ratio(a, b):
        return None if a is None or b is None else a / b

    out = []
    for case, fwd_limit, bwd_limit, peer in (
            ("D=128, 32/8 heads, S=16384", 1.0, 1.0, "SDPA cuDNN"),
            ("D=128, 32/8 heads, B=16, S=2048", 1.1, 1.0, "SDPA cuDNN"),
            ("D=64, 32/8 heads, S=16384", 1.1, 1.1, "SDPA cuDNN"),
            ("D=64, 16/4 heads, B=16, S=2048", 1.1, 1.1, "SDPA cuDNN")):
        for mode, limit in (("fwd", fwd_limit), ("fwd+bwd", bwd_limit)):
            r = ratio(ms(case, mode=mode), ms(case, peer, mode))
            out.append((f"{case}, {mode}", f"<= {limit}x {peer}", r, "x", r is not None and r <= limit))
    for d in (96, 192, 256):
        case = f"D={d}, 32/8 heads, S=8192"
        for peer, limit in (("SDPA flash", 1.0), ("SDPA cuDNN", 1.2)):
            r = ratio(ms(case, mode="fwd+bwd"), ms(case, peer, "fwd+bwd"))
            out.append((f"{case}, fwd+bwd", f"<= {limit}x {peer}", r, "x", r is not None and r <= limit))
    for case, base, limit, what in (
            ("key bias, varlen 8 x 2048", "key bias, B=8, S=2048", 1.05, "batched B=8"),
            ("softcap 30 + key bias, S=16384", "key bias, S=16384", 1.15, "the same call without softcap")):
        for mode in ("fwd", "fwd+bwd"):
            r = ratio(ms(case, mode=mode), ms(base, mode=mode))
            out.append((f"{case}, {mode}", f"<= {limit}x {what}", r, "x", r is not None and r <= limit))
    r = ratio(ms("deterministic, key bias, S=16384", mode="fwd+bwd"), ms("key bias, S=16384", mode="fwd+bwd"))
    out.append(("deterministic, key bias, S=16384, fwd+bwd", "<= 1.15x non-deterministic", r, "x",
                r is not None and r <= 1.15))
    for mode in ("fwd", "fwd+bwd"):
        case = "bool mask ~50% + key bias, (1, 8, 8192, 8192)"
        r = ratio(ms(case, mode=mode), ms(case, "FlexAttention", mode))
        out.append((f"{case}, {mode}", "<= 0.9x FlexAttention", r, "x", r is not None and r <= 0.9))
    case = "flash_dmattn_func, top-1024 mask + key bias, S=16384"
    value = ms(case, mode="fwd+bwd")
    out.append((f"{case}, fwd+bwd", "<= 20 ms", value, "ms", value is not None and value <= 20))
    full = spec["full 4-D bias (1, 8, 8192, 8192) with dbias"]
    bias_bytes = full.kv_heads * full.sq * full.keys * 2
    # fwd reads the bias, the backward reads it again and writes dbias: three passes at the copy bandwidth,
    # and at least the same call's time without a bias (the attention itself).
    floor = max(3 * bias_bytes / (copy_gbps * 1e6), ms("no bias, S=8192", mode="fwd+bwd") or 0.0)
    r = ratio(ms(full.case, mode="fwd+bwd"), floor)
    out.append((f"{full.case}, fwd+bwd", f"<= 1.3x max(bias bandwidth floor, no bias) = 1.3 x {floor:.2f} ms", r,
                "x", r is not None and r <= 1.3))
    for mode in ("fwd", "fwd+bwd"):
        case = "sliding window (1023, 0) + key bias, S=16384"
        r = ratio(ms(case, mode=mode), ms(case, "FlexAttention", mode))
        out.append((f"{case}, {mode}", "<= 1.0x FlexAttention", r, "x", r is not None and r <= 1.0))
    return out


def shapes_report(suite):
    meta, rows = suite["meta"], Rows(suite["rows"])
    lines = header("Training shapes (the Hopper issue's table)", meta, [
        "bf16, causal, B=1 unless named; key bias (B, Hk, 1, S) with its gradient where named. Peers in the "
        "same process on the same inputs: SDPA cuDNN, SDPA flash (FA2), FlexAttention (score_mod adds the bias "
        "and applies softcap, mask_mod holds causal, the window and the bool mask). ms: median of CUDA-event "
        f"times. Copy bandwidth of this device: {meta.get('copy_gbps', 0):.0f} GB/s.", "",
        "| case | system | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd peak MiB |",
        "|---|---|---|---|---|---|---|"])
    for spec in SHAPES:
        for system in spec.systems:
            fwd = rows.index.get((spec.case, spec.sq, spec.keys, system, "fwd"))
            bwd = rows.index.get((spec.case, spec.sq, spec.keys, system, "fwd+bwd"))
            if fwd is None and bwd is None:
                continue
            cells = []
            for row in (fwd, bwd):
                cells += ["skipped", ""] if row is None or "skip" in row else [fmt(row, "ms", 2), fmt(row, "tflops", 0)]
            lines.append(f"| {spec.case} | {system} | " + " | ".join(cells) + f" | {fmt(bwd, 'peak_mib', 0)} |")
    lines += ["", "Targets:", "", "| row | target | measured | met |", "|---|---|---|---|"]
    for row, target, value, unit, met in shapes_targets(rows, meta.get("copy_gbps", 1.0)):
        shown = "not measured" if value is None else f"{value:.2f} ms" if unit == "ms" else f"{value:.2f}x"
        lines.append(f"| {row} | {target} | {shown} | {'yes' if met else 'no'} |")
    return (lines + skipped(suite["rows"]) + measured_apart(suite) +
            ["", "![training shapes against the best peer](performance-shapes.png)", ""])


def topk_pairs():
    """(top-k spec, the dense spec of the same shape and bias) of the topk suite."""
    dense = {(s.batch, s.sq, s.varlen, s.head_dim): s for s in TOPK if s.keep is None}
    return [(s, dense.get((s.batch, s.sq, s.varlen, s.head_dim))) for s in TOPK if s.keep is not None]


def topk_report(suite):
    import torch

    meta, rows = suite["meta"], Rows(suite["rows"])
    lines = header("Top-k against dense (the top-k issue's table)", meta, [
        "dmattn only, 32/8 heads, bf16, causal, key bias (B, 8, 1, S) with dbias, selection included in every "
        "call. fraction: top-k time / dense time of the same shape (target: <= 1 everywhere). ideal: allowed "
        "pairs under the keep window / allowed causal pairs (the work ratio a perfect sparse kernel reaches). "
        f"fill: the selected pairs / the pairs of the key tiles the forward walks (each {FILL_ROWS}-row query "
        f"block on the union of its rows' selected keys in tiles of {FILL_KEYS}; bench_gpu.py forward_fill). "
        f"Rows of at most {GRAPH_KEYS} keys, whose calls the host bounds, are measured with their dense row in "
        f"{ROUNDS} interleaved rounds (the round of median time kept), and also as replayed CUDA graphs: graph, "
        "the fractions fwd / fwd+bwd of those times (the GPU's time without the host's).",
        "", "| case | fwd ms | dense fwd ms | fwd fraction | fwd+bwd ms | dense fwd+bwd ms | fwd+bwd fraction "
        "| graph fractions | ideal | fill | fwd+bwd peak MiB |", "|---|---|---|---|---|---|---|---|---|---|---|"])
    for spec, dense in topk_pairs():
        ideal = float(allowed_per_row(torch, spec).sum() / allowed_per_row(torch, dataclasses.replace(
            spec, keep=None)).sum())
        cells, graphed = [], []
        for mode in ("fwd", "fwd+bwd"):
            a = rows.get(spec, "dmattn", mode)
            b = None if dense is None else rows.get(dense, "dmattn", mode)
            cells += ["" if a is None else f"{a:.2f}", "" if b is None else f"{b:.2f}",
                      "" if a is None or b is None else f"{a / b:.2f}"]
            a = rows.get(spec, "dmattn", mode, "graph_ms")
            b = None if dense is None else rows.get(dense, "dmattn", mode, "graph_ms")
            graphed.append(None if a is None or b is None else a / b)
        cells.append(" / ".join(f"{r:.2f}" for r in graphed) if None not in graphed else "")
        peak, fill = rows.get(spec, "dmattn", "fwd+bwd", "peak_mib"), rows.get(spec, "dmattn", "fwd", "fill")
        cells += [f"{ideal:.3f}", "" if fill is None else f"{fill:.3f}", "" if peak is None else f"{peak:.0f}"]
        lines.append(f"| {spec.case} | " + " | ".join(cells) + " |")
    return lines + skipped(suite["rows"]) + measured_apart(suite) + ["", "![top-k time over dense](performance-topk.png)", ""]


def portable_report(suite):
    meta, rows = suite["meta"], Rows(suite["rows"])
    spec = {s.case: s for s in PORTABLE}
    lines = header("Portable kernels (the Ampere/Ada issue's speed proxy)", meta, [
        "dmattn's sm80-class kernels (mma.sync, cp.async) forced on this GPU with the shared memory of an RTX 4090 "
        "/ L40 (99 KiB) or an A100 (163 KiB): the dispatch picks the tiles it would pick there. bf16, causal, "
        "32/8 heads, no bias or a key bias (B, 8, 1, S) with dbias. Peer: SDPA flash (FA2) on the same GPU, "
        "which is mma.sync code too. Targets: dmattn <= FA2, and the key bias <= 1.05x no bias.", "",
        "| shared memory | shape | fwd ms | fwd+bwd ms | FA2 fwd ms | FA2 fwd+bwd ms | fwd / FA2 | fwd+bwd / FA2 "
        "| key bias fwd ms | key bias fwd+bwd ms | key bias / no bias (fwd, fwd+bwd) |",
        "|---|---|---|---|---|---|---|---|---|---|---|"])

    def cell(value, digits=2, suffix=""):
        return "" if value is None else f"{value:.{digits}f}{suffix}"

    for cap in (99, 163):
        for name, _ in PORTABLE_SHAPES:
            plain, biased = spec[f"{cap} KiB, {name}"], spec[f"{cap} KiB, {name}, key bias"]
            peer = spec[f"99 KiB, {name}"]
            ours = [rows.get(plain, "dmattn", m) for m in ("fwd", "fwd+bwd")]
            fa2 = [rows.get(peer, "SDPA flash", m) for m in ("fwd", "fwd+bwd")]
            bias = [rows.get(biased, "dmattn", m) for m in ("fwd", "fwd+bwd")]
            over = [a / b if a and b else None for a, b in zip(ours, fa2)]
            cost = [a / b if a and b else None for a, b in zip(bias, ours)]
            lines.append(f"| {cap} KiB | {name} | " + " | ".join(
                [cell(x) for x in ours + fa2] + [cell(x, suffix="x") for x in over] + [cell(x) for x in bias] +
                [", ".join(cell(x, suffix="x") for x in cost)]) + " |")
    return lines + skipped(suite["rows"]) + measured_apart(suite) + [""]


def report(suites, out_dir):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["# GPU benchmark: dmattn against torch SDPA and FlexAttention", "",
             "Produced by `scripts/bench_gpu.sh` (bench/bench_gpu.py): one process, the same inputs for every "
             "system; each section gives its own date, device and commit.", ""]
    for name, make in (("shapes", shapes_report), ("topk", topk_report), ("portable", portable_report),
                       ("main", main_report)):
        if name in suites:
            lines += make(suites[name])
    (out_dir / "performance.md").write_text("\n".join(lines))
    plot(suites, out_dir)


def save_ratio_plot(fig, ax, title, meta, path):
    """A plot of time ratios: the line at 1, the legend, the title with where it was measured, saved."""
    import matplotlib.pyplot as plt

    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.legend()
    ax.set_title(f"{title}, {meta['device']}, {meta['date']}, commit {meta['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(suites, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "main" in suites:
        rows = Rows(suites["main"]["rows"])
        dense = [s for s in SUITES["main"] if not s.decode and s.keep is None]
        decode = [s for s in SUITES["main"] if s.decode and s.keep is None]
        fig, axes = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw=dict(width_ratios=[3, 1]))
        width = 0.8 / len(ALL)
        for ax, specs, key, label in ((axes[0], dense, "tflops", "fwd TFLOP/s (allowed entries)"),
                                      (axes[1], decode, "gbps", "decode fwd GB/s (K and V read)")):
            for i, system in enumerate(ALL):
                values = [rows.get(s, system, "fwd", key) or 0.0 for s in specs]
                ax.bar([j + (i - (len(ALL) - 1) / 2) * width for j in range(len(specs))], values, width, label=system)
            ax.set_xticks(range(len(specs)))
            ax.set_xticklabels([f"{s.case}\nS={s.sq}" if not s.decode else s.case for s in specs], fontsize=8)
            ax.set_ylabel(label)
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend(fontsize=8)
        meta = suites["main"]["meta"]
        fig.suptitle(f"dmattn vs peers, forward, bf16, 32/8 heads, D=128 - {meta['device']}, {meta['date']}, "
                     f"commit {meta['commit']} (missing bar: skipped)", fontsize=10)
        fig.tight_layout()
        fig.savefig(out_dir / "performance.png", dpi=110)
        plt.close(fig)
    if "shapes" in suites:
        rows = Rows(suites["shapes"]["rows"])
        specs = [s for s in SHAPES if len(s.systems) > 1]
        fig, ax = plt.subplots(figsize=(15, 6))
        for i, mode in enumerate(("fwd", "fwd+bwd")):
            values = []
            for s in specs:
                ours = rows.get(s, "dmattn", mode)
                peers = [v for v in (rows.get(s, p, mode) for p in s.systems if p != "dmattn") if v]
                values.append(ours / min(peers) if ours and peers else 0.0)
            ax.bar([j + (i - 0.5) * 0.4 for j in range(len(specs))], values, 0.4, label=mode)
        ax.set_xticks(range(len(specs)))
        ax.set_xticklabels([s.case.replace(", ", "\n", 2) for s in specs], fontsize=7)
        ax.set_ylabel("dmattn time / best peer's time (lower is better)")
        save_ratio_plot(fig, ax, "training shapes", suites["shapes"]["meta"], out_dir / "performance-shapes.png")
    if "topk" in suites:
        rows = Rows(suites["topk"]["rows"])
        fig, ax = plt.subplots(figsize=(9, 5))
        for w in (256, 1024, 2048):
            pairs = [(s, d) for s, d in topk_pairs() if s.keep == w and s.batch == 1 and not s.varlen
                     and s.head_dim == 128 and d is not None]
            points = [(s.sq, rows.get(s, "dmattn", "fwd+bwd") / rows.get(d, "dmattn", "fwd+bwd")) for s, d in pairs
                      if rows.get(s, "dmattn", "fwd+bwd") and rows.get(d, "dmattn", "fwd+bwd")]
            if points:
                ax.plot(*zip(*points), marker="o", label=f"w = {w}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("S")
        ax.set_ylabel("top-k fwd+bwd time / dense fwd+bwd time")
        save_ratio_plot(fig, ax, "top-k against dense", suites["topk"]["meta"], out_dir / "performance-topk.png")
