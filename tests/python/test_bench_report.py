"""bench/bench_gpu.py off the GPU: the allowed-pair counts behind its TFLOP/s and ideal ratios, and the
report's targets from given timings (the plots left out)."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

import dmattn  # noqa: F401 (registers torch.ops.dmattn)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_gpu  # noqa: E402
import bench_report  # noqa: E402


@pytest.mark.parametrize("sq,sk", [(1, 9), (7, 7), (5, 12), (12, 5)])
@pytest.mark.parametrize("window", [None, (2, 0), (0, 3), (3, 1), (-1, 2)])
@pytest.mark.parametrize("keep", [None, 1, 3])
def test_allowed_per_row_counts_the_mask(sq, sk, window, keep):
    spec = bench_gpu.Spec("case", sq=sq, sk=sk, window=window, keep=keep)
    rows, keys = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    diagonal = rows + sk - sq
    allowed = keys <= diagonal if spec.causal else torch.ones(sq, sk, dtype=torch.bool)
    if window is not None:
        left, right = window
        allowed &= (keys >= diagonal - left) if left >= 0 else True
        allowed &= (keys <= diagonal + right) if right >= 0 else True
    expected = allowed.sum(1)
    if keep is not None:
        expected = expected.clamp(max=keep)
    assert torch.equal(bench_gpu.allowed_per_row(torch, spec), expected)


def _results(suite, ours_over_peers):
    """Timings of every case of a suite: each peer 1 ms (fwd) and 3 ms (fwd+bwd), dmattn that times the factor."""
    rows = []
    for spec in bench_gpu.SUITES[suite]:
        for system in spec.systems:
            for mode, ms in (("fwd", 1.0), ("fwd+bwd", 3.0)):
                if system == "dmattn":
                    ms *= ours_over_peers
                rows.append(dict(case=spec.case, batch=spec.batch, sq=spec.sq, sk=spec.keys, system=system, mode=mode,
                                 ms=ms, tflops=1.0, peak_mib=1.0))
                if spec.graph and system == "dmattn":
                    rows[-1]["graph_ms"] = ms
    meta = dict(date="d", device="gpu", torch="t", cuda="c", commit="abc", copy_gbps=1000.0,
                dmattn=dict(version="v", cuda_architectures="90a", head_dims="64,128"))
    return dict(meta=meta, rows=rows)


@pytest.mark.parametrize("factor,met", [(2.0, "no"), (0.5, "yes")])
def test_peer_targets_follow_the_timings(monkeypatch, tmp_path, factor, met):
    monkeypatch.setattr(bench_report, "plot", lambda suites, out_dir: None)
    bench_report.report({"shapes": _results("shapes", factor), "topk": _results("topk", factor)}, tmp_path)
    text = (tmp_path / "performance.md").read_text()
    for spec in bench_gpu.SHAPES + [s for s in bench_gpu.TOPK if s.keep is not None]:  # dense: a column of top-k's
        assert f"| {spec.case} |" in text
    # Every row against a peer measured factor x that peer.
    for row in ("D=128, 32/8 heads, S=16384, fwd | <= 1.0x SDPA cuDNN", "D=64, 16/4 heads, B=16, S=2048, fwd+bwd",
                "sliding window (1023, 0) + key bias, S=16384, fwd+bwd | <= 1.0x FlexAttention"):
        line = next(line for line in text.splitlines() if line.startswith(f"| {row}"))
        assert line.endswith(f"| {factor:.2f}x | {met} |"), line
    # dmattn against its own calls: the same factor on both sides, ratio 1.
    line = next(line for line in text.splitlines() if line.startswith("| key bias, varlen 8 x 2048, fwd |"))
    assert "| 1.00x | yes |" in line


def test_topk_fraction_and_ideal():
    suite = _results("topk", 1.0)
    for row in suite["rows"]:  # top-k at a quarter of dense, a fifth as CUDA graphs
        if "keep" in row["case"]:
            row["ms"] /= 4
            if "graph_ms" in row:
                row["graph_ms"] /= 5
    text = "\n".join(bench_report.topk_report(suite))
    line = next(line for line in text.splitlines() if line.startswith("| key bias, keep 1024, S=4096 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3] == "0.25" and cells[6] == "0.25" and cells[7] == "0.20 / 0.20", cells
    spec = next(s for s in bench_gpu.TOPK if s.case == "key bias, keep 1024, S=4096")
    kept = bench_gpu.allowed_per_row(torch, spec).sum()
    causal = bench_gpu.allowed_per_row(torch, dataclasses.replace(spec, keep=None)).sum()
    assert cells[8] == f"{float(kept / causal):.3f}"
    # Longer rows are not graphed: no graph fractions.
    line = next(line for line in text.splitlines() if line.startswith("| key bias, keep 1024, S=16384 |"))
    assert [c.strip() for c in line.strip("|").split("|")][7] == ""


def test_topk_fill_column():
    suite = _results("topk", 1.0)
    for row in suite["rows"]:
        if "keep" in row["case"] and row["mode"] == "fwd":
            row["fill"] = 0.625
    text = "\n".join(bench_report.topk_report(suite))
    line = next(line for line in text.splitlines() if line.startswith("| key bias, keep 1024, S=4096 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[9] == "0.625" and cells[10] == "1", cells


@pytest.mark.parametrize("rows,block_m,block_n", [(300, 128, 64), (257, 32, 16), (64, 128, 64), (1000, 128, 1)])
@pytest.mark.parametrize("keep", [1, 7, 40])
def test_forward_fill_counts_the_walked_tiles(rows, block_m, block_n, keep):
    """forward_fill against a brute force over the blocks, on dmattn's own selection (CPU, a random key bias
    with ties, two selection heads)."""
    gen = torch.Generator().manual_seed(rows + keep)
    q, k = torch.randn(2, rows, 4, 8, generator=gen), torch.randn(2, rows, 2, 8, generator=gen)
    bias = torch.randint(0, 5, (2, 2, 1, rows), generator=gen).float()
    intervals = torch.ops.dmattn.select(q, k, None, None, bias, list(bias.shape), True, -1, -1, keep)
    useful = walked = 0
    for selection in intervals.reshape(-1, rows, 2):
        spans = [(max(s, 0), min(e, rows)) for s, e in selection.tolist()]
        useful += sum(max(e - s, 0) for s, e in spans)
        for i0 in range(0, rows, block_m):
            i1 = min(i0 + block_m, rows)
            union = sum(1 for s, e in spans if s < e and s < i1 and e > i0)
            walked += (i1 - i0) * -(-union // block_n) * block_n
    assert useful == sum(min(i + 1, keep) for i in range(rows)) * intervals.shape[0] * intervals.shape[1]
    assert bench_gpu.forward_fill(torch, intervals, rows, block_m, block_n) == pytest.approx(useful / walked)


def test_portable_ratios():
    """The portable table: dmattn over FA2 (measured beside the 99 KiB runs) and the key bias over no bias."""
    suite = _results("portable", 1.5)
    for row in suite["rows"]:
        if row["case"].endswith("key bias"):
            row["ms"] *= 1.1
    text = "\n".join(bench_report.portable_report(suite))
    for cap in (99, 163):
        line = next(line for line in text.splitlines() if line.startswith(f"| {cap} KiB | D=64, 32/8 heads, S=16384 |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2:] == ["1.50", "4.50", "1.00", "3.00", "1.50x", "1.50x", "1.65", "4.95", "1.10x, 1.10x"], cells


def test_load_reads_the_single_table_format(tmp_path):
    old = dict(meta=dict(date="d"), rows=[dict(case="no mask", sq=1, sk=1)])
    (tmp_path / "performance.json").write_text(json.dumps(old))
    assert bench_gpu.load(tmp_path / "performance.json") == {"main": old}
    assert bench_gpu.load(tmp_path / "missing.json") == {}


def test_shape_groups_gather_the_host_bound_rows_of_a_shape():
    groups = bench_gpu.shape_groups(bench_gpu.TOPK)
    expected = ["key bias, S=2048"] + [f"key bias, keep {w}, S=2048" for w in (256, 1024, 2048)]
    assert [s.case for s in groups[0]] == expected
    assert all(len(g) == 1 for g in groups if not g[0].graph)
    assert [s.case for g in groups for s in g] == [s.case for s in bench_gpu.TOPK]


def test_measure_group_interleaves_rounds_and_keeps_the_median(monkeypatch):
    """A group's cases are measured round robin, ROUNDS times, and each row is the round of median time."""
    group = bench_gpu.shape_groups(bench_gpu.TOPK)[0][:2]
    calls, times = [], iter([5.0, 6.0, 1.0, 2.0, 9.0, 8.0, 7.0, 3.0, 4.0, 4.5, 0.5, 1.5])
    monkeypatch.setattr(bench_gpu, "Case", lambda torch, spec: type("C", (), dict(spec=spec, allowed=1))())
    monkeypatch.setattr(bench_gpu, "topk_fill", lambda torch, case: 0.5)

    def fake_measure(torch, case, system, grad, reference):
        calls.append((case.spec.case, grad))
        return dict(ms=next(times)), None

    monkeypatch.setattr(bench_gpu, "measure", fake_measure)
    rows = bench_gpu.measure_group(torch, "topk", group, None)
    names = [s.case for s in group]
    assert calls == [(n, g) for _ in range(bench_gpu.ROUNDS) for n in names for g in (False, True)]
    # per (case, mode) the rounds' times: dense fwd 5, 9, 4 -> 5; dense fwd+bwd 6, 8, 4.5 -> 6;
    # keep fwd 1, 7, 0.5 -> 1; keep fwd+bwd 2, 3, 1.5 -> 2
    assert [(r["case"], r["mode"], r["ms"], r["rounds"]) for r in rows] == [
        (names[0], "fwd", 5.0, 3), (names[0], "fwd+bwd", 6.0, 3),
        (names[1], "fwd", 1.0, 3), (names[1], "fwd+bwd", 2.0, 3)]
    assert "fill" not in rows[0] and rows[2]["fill"] == 0.5


def test_measured_apart_names_rows_of_another_build():
    suite = _results("topk", 1.0)
    here = "gpu, d, abc"
    for row, measured in zip(suite["rows"], (here, f"{here}, head dims 64,128", f"{here}, head dims 64,128,192,256")):
        row["measured"] = measured
    lines = bench_report.measured_apart(suite)
    assert lines[3:] == [f"- {suite['rows'][2]['case']}: {here}, head dims 64,128,192,256"], lines


def test_rows_a_target_compares_are_measured_together():
    groups = {tuple(s.case for s in g) for g in bench_gpu.shape_groups(bench_gpu.SHAPES)}
    assert ("key bias, varlen 8 x 2048", "key bias, B=8, S=2048") in groups
    assert ("key bias, S=16384", "softcap 30 + key bias, S=16384", "deterministic, key bias, S=16384") in groups
    assert ("no bias, S=8192", "full 4-D bias (1, 8, 8192, 8192) with dbias") in groups
    assert ("D=128, 32/8 heads, S=16384",) in groups  # a row with its peers only
    topk = bench_gpu.shape_groups(bench_gpu.TOPK)
    assert [s.case for s in topk[0]] == ["key bias, S=2048"] + [f"key bias, keep {w}, S=2048" for w in (256, 1024, 2048)]
    assert all(len(g) == 1 for g in topk if g[0].sq > bench_gpu.GRAPH_KEYS)
