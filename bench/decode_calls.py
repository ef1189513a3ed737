#!/usr/bin/env python3
"""Where a decode call's time goes, as the Python user sees it (one process).

The decode case of bench_gpu.py (B=4, Sq=1, Sk=131072, 32 query / 8 kv heads,
D=128, bf16, key-only bias (B, 8, 1, Sk)): dense, dense with the bias, and the
bias with keep_window_size=2048. Per call:
- event ms: bench_gpu.py's median of per-call CUDA-event times (what the
  benchmark reports: the larger of the GPU time and the host time of a call);
- host us: the host time of one call with the GPU queue not full (the best of
  5 rounds of 20 calls, no synchronisation inside a round);
- for the top-k call, the host time of the core alone: _C.forward handed the
  tensors (nanobind calls Tensor.__dlpack__ on each) and handed DLPack capsules
  (torch.utils.dlpack.to_dlpack, what dmattn.ops passes).

    python3 bench/decode_calls.py
"""

import sys
import time
from pathlib import Path

import torch
from torch.utils.dlpack import to_dlpack

import dmattn
from dmattn import _C

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import median_ms  # noqa: E402

B, SK, H, HK, D, W = 4, 131072, 32, 8, 128, 2048


def host_us(fn, rounds=5, calls=20):
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def main():
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, 1, H, D, device=dev, dtype=dt)
    k = torch.randn(B, SK, HK, D, device=dev, dtype=dt)
    v = torch.randn(B, SK, HK, D, device=dev, dtype=dt)
    bias = torch.randn(B, HK, 1, SK, device=dev, dtype=dt)
    calls = {
        "decode": lambda: dmattn.attention(q, k, v),
        "decode + key bias": lambda: dmattn.attention(q, k, v, bias=bias),
        f"decode + key bias, keep {W}": lambda: dmattn.attention(q, k, v, bias=bias, keep_window_size=W),
    }
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, fn in calls.items():
        ms, reps = median_ms(torch, fn)
        print(f"{name:32s} event {ms:.4f} ms (median of {reps})  host {host_us(fn):7.1f} us a call")
    out, lse = torch.empty_like(q), torch.empty(B, H, 1, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    core = {
        "tensors (Tensor.__dlpack__)": lambda: _C.forward(q, k, v, None, bias, out, lse, keep_window_size=W,
                                                          stream=stream),
        "capsules (to_dlpack)": lambda: _C.forward(to_dlpack(q), to_dlpack(k), to_dlpack(v), None, to_dlpack(bias),
                                                   to_dlpack(out), to_dlpack(lse), keep_window_size=W, stream=stream),
    }
    for name, fn in core.items():
        print(f"_C.forward top-k, {name:28s} host {host_us(fn):7.1f} us a call")


if __name__ == "__main__":
    main()
