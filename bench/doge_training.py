"""Trains a tiny Doge model in bf16 (weights, activations and AdamW state) on the
GPU twice from the same weights and batches: once with stock eager attention, once on dmattn (forward and backward
through the CUDA kernels, the dynamic mask as a learnable key-only bias), and
writes both loss curves.

    python bench/doge_training.py --out DIR [--steps 50] [--keep-window W]

Writes DIR/doge-training.json (both curves, the largest difference) and, when
matplotlib is installed, DIR/doge-training.png; with --keep-window W below the
sequence length (256) DIR/doge-training-keepW.{json,png}. Both runs use the
model's keep_window_size: the stock model selects the top W keys of every row
from its (B, H, Sq, Sk) bias, dmattn from the key-only bias on the GPU (the
selection, the gathered forward and the backward of issue 6). The default W
(512) is wider than the sequence: every key is kept, dense attention.
"""

import argparse
import copy
import json
import math
import pathlib
import time

import torch
from transformers import DogeConfig, DogeForCausalLM

from dmattn.integrations.transformers import use_dmattn_for_doge

VOCAB, SEQ, BATCH = 512, 256, 8


def batches(steps, seed=0):
    """Arithmetic token sequences (random start and stride 1..7, 10% noise): the stride is read from the context."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        stride = torch.randint(1, 8, (BATCH, 1), generator=g)
        ids = (start + stride * torch.arange(SEQ)) % VOCAB
        noise = torch.rand(ids.shape, generator=g) < 0.1
        ids = torch.where(noise, torch.randint(0, VOCAB, ids.shape, generator=g), ids)
        out.append(ids)
    return out


def train(model, data, lr):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for ids in data:
        ids = ids.cuda()
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    return losses, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--keep-window", type=int, default=2 * SEQ)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = DogeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=32, keep_window_size=args.keep_window,
                        max_position_embeddings=2 * SEQ, attn_implementation="eager")
    eager = DogeForCausalLM(config).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for layer in eager.model.layers:
            layer.self_attn.A.normal_()
    ours = use_dmattn_for_doge(copy.deepcopy(eager))
    data = batches(args.steps)
    eager_losses, eager_s = train(eager, data, args.lr)
    ours_losses, ours_s = train(ours, data, args.lr)
    diffs = [abs(a - b) for a, b in zip(eager_losses, ours_losses)]
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "config": dict(vocab=VOCAB, seq=SEQ, batch=BATCH, layers=4, heads=8, kv_heads=4, head_dim=32,
                       dtype="bfloat16", steps=args.steps, lr=args.lr, keep_window_size=args.keep_window),
        "eager": eager_losses,
        "dmattn": ours_losses,
        "max_abs_diff": max(diffs),
        "max_rel_diff": max(d / abs(a) for d, a in zip(diffs, eager_losses)),
        "nan": any(math.isnan(x) for x in eager_losses + ours_losses),
        "seconds": {"eager": eager_s, "dmattn": ours_s},
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "doge-training" if args.keep_window >= SEQ else f"doge-training-keep{args.keep_window}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"eager  first {eager_losses[0]:.4f} last {eager_losses[-1]:.4f}  ({eager_s:.1f} s)")
    print(f"dmattn first {ours_losses[0]:.4f} last {ours_losses[-1]:.4f}  ({ours_s:.1f} s)")
    print(f"max |diff| {result['max_abs_diff']:.4f} (relative {result['max_rel_diff']:.4f}), NaN: {result['nan']}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(eager_losses, label="eager (stock attention)")
    ax.plot(ours_losses, label="dmattn (CUDA)", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    keep = f", keep_window_size {args.keep_window}" if args.keep_window < SEQ else ""
    ax.set_title(f"tiny Doge, bf16{keep}, {result['device']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)


if __name__ == "__main__":
    main()
