#!/usr/bin/env python3
"""Where dmattn's time goes: the GPU kernels of one forward + backward of benchmark cases, by time.

Takes the cases of bench_gpu.py's suites whose name contains any of the given texts, runs dmattn's
forward + backward (or the forward alone) on their inputs twice (a warm-up), then once under torch.profiler, and prints per case
the total GPU time and the kernels that take most of it (name, calls, ms, share).

    python3 bench/profile_kernels.py [--top 8] [--forward] TEXT [TEXT ...]

--forward profiles the forward alone (no backward, no gradients).
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench_gpu import SUITES, Case
from bench_systems import make_dmattn


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("texts", nargs="+")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--forward", action="store_true", help="the forward alone")
    args = parser.parse_args()
    specs = {s.case: s for suite in SUITES.values() for s in suite if any(t in s.case for t in args.texts)}
    for spec in specs.values():
        case = Case(torch, spec)
        fn, _ = make_dmattn(torch, case, grad=not args.forward)
        fn(), fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        total = sum(e.self_device_time_total for e in kernels)
        print(f"{spec.case}: {total / 1e3:.3f} ms of GPU time in {sum(e.count for e in kernels)} kernels", flush=True)
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:args.top]:
            print(f"  {e.self_device_time_total / 1e3:8.3f} ms {100 * e.self_device_time_total / total:5.1f}% "
                  f"x{e.count:<3d} {e.key[:110]}", flush=True)
        del case, fn
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
