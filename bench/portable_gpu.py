#!/usr/bin/env python3
"""Speed proxy of the portable (sm80-class) kernels: dmattn against torch SDPA's
flash backend (FlashAttention 2, mma.sync code too), same inputs, one process.

Shapes (issue 19): head dims 64 and 128 at B = 16, S = 2048 and B = 1, S = 16384;
32 query heads, 8 kv heads, bf16, causal. dmattn runs without a bias and with a
key-only bias (B, 8, 1, S) that takes its gradient; FA2 without one. fwd and
fwd+bwd, the median of CUDA-event times after a warm-up (bench_gpu.median_ms).

On a Hopper GPU, DMATTN_PORTABLE=1 (and DMATTN_SMEM_LIMIT=99 or 163) makes
dmattn run the kernels (and tiles) of an sm80-class GPU:

    DMATTN_PORTABLE=1 DMATTN_SMEM_LIMIT=99 python3 bench/portable_gpu.py [--json FILE]
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import median_ms  # noqa: E402

HEADS, KV_HEADS = 32, 8
SHAPES = [(16, 2048), (1, 16384)]  # (B, S)
HEAD_DIMS = [64, 128]


def run_case(torch, dmattn, batch, seqlen, head_dim):
    """fwd and fwd+bwd ms of dmattn (no bias, key-only bias) and of SDPA flash at one shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    q, k, v = rand(batch, seqlen, HEADS, head_dim), rand(batch, seqlen, KV_HEADS, head_dim), rand(batch, seqlen, KV_HEADS, head_dim)
    bias = rand(batch, KV_HEADS, 1, seqlen)
    dout = torch.randn_like(q)

    def dmattn_call(with_bias):
        return lambda: dmattn.attention(q, k, v, bias=bias if with_bias else None, causal=True)

    def flash_call():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # (B, H, S, D) views of the same memory
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            ).transpose(1, 2)

    def with_backward(call):
        def run():
            q.grad = k.grad = v.grad = bias.grad = None
            call().backward(dout)
        return run

    row = {"B": batch, "S": seqlen, "D": head_dim}
    for name, call in [("dmattn", dmattn_call(False)), ("dmattn key bias", dmattn_call(True)), ("FA2", flash_call)]:
        with torch.no_grad():
            row[f"{name} fwd"] = median_ms(torch, call)[0]
        row[f"{name} fwd+bwd"] = median_ms(torch, with_backward(call))[0]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args()
    import torch
    import dmattn

    settings = {name: os.environ.get(name, "") for name in ("DMATTN_PORTABLE", "DMATTN_SMEM_LIMIT")}
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, settings {settings}")
    rows = []
    for head_dim in HEAD_DIMS:
        for batch, seqlen in SHAPES:
            row = run_case(torch, dmattn, batch, seqlen, head_dim)
            rows.append(row)
            print(
                f"D={head_dim:3d} B={batch:2d} S={seqlen:5d}  fwd ms: dmattn {row['dmattn fwd']:.3f}  "
                f"FA2 {row['FA2 fwd']:.3f}  key bias {row['dmattn key bias fwd']:.3f} "
                f"(+{100 * (row['dmattn key bias fwd'] / row['dmattn fwd'] - 1):.1f}%)  |  fwd+bwd ms: "
                f"dmattn {row['dmattn fwd+bwd']:.3f}  FA2 {row['FA2 fwd+bwd']:.3f}  key bias "
                f"{row['dmattn key bias fwd+bwd']:.3f} (+{100 * (row['dmattn key bias fwd+bwd'] / row['dmattn fwd+bwd'] - 1):.1f}%)",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
