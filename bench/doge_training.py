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

With a keep window the stock selection (torch.topk) breaks ties between equal
bias values arbitrarily, and ties are common: in the first layer a key's bias
depends only on its token, and the sequences repeat tokens. SPEC 3 gives a tie
to the more recent key. So a third run trains the eager model with its top-k
replaced by one that follows SPEC 3 (a stable sort of the keys, most recent
first); that is the curve dmattn must match, the stock one is shown beside it.
"""

import argparse
import copy
import json
import math
import pathlib
import time
import types

import torch
from transformers import DogeConfig, DogeForCausalLM
from transformers.models.doge.modeling_doge import DogeAttention

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


def _spec_dynamic_mask(self, hidden_states, dt_states, keep_window_size=2048, attention_mask=None):
    """DogeAttention.prepare_dynamic_mask with SPEC 3's tie rule: of equal biases the larger key index is kept."""
    mask = self.stock_dynamic_mask(hidden_states, dt_states, keep_window_size=dt_states.shape[-1],
                                   attention_mask=attention_mask)
    if mask.shape[-1] <= keep_window_size:
        return mask
    # A stable descending sort of the keys in reverse order puts the most recent of equal biases first.
    order = torch.sort(mask.flip(-1), dim=-1, descending=True, stable=True).indices[..., :keep_window_size]
    keep = torch.zeros_like(mask, dtype=torch.bool).scatter(-1, mask.shape[-1] - 1 - order, True)
    return mask.masked_fill(~keep, torch.finfo(mask.dtype).min)


def spec_ties(model):
    """Makes every DogeAttention of `model` select its keys with SPEC 3's tie rule, in place."""
    for layer in model.modules():
        if isinstance(layer, DogeAttention):
            layer.stock_dynamic_mask = layer.prepare_dynamic_mask
            layer.prepare_dynamic_mask = types.MethodType(_spec_dynamic_mask, layer)
    return model


def train(model, data, lr):
    """The losses and the seconds of each AdamW step over `data` (synchronised after every step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, seconds = [], []
    torch.cuda.synchronize()
    for ids in data:
        start = time.perf_counter()
        ids = ids.cuda()
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return losses, seconds


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
    sparse = args.keep_window < SEQ
    ours = use_dmattn_for_doge(copy.deepcopy(eager))
    stock = copy.deepcopy(eager) if sparse else None
    if sparse:
        spec_ties(eager)
    data = batches(args.steps)
    eager_losses, eager_s = train(eager, data, args.lr)
    ours_losses, ours_s = train(ours, data, args.lr)
    eager_s, ours_s = sum(eager_s), sum(ours_s)
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
    if sparse:
        result["eager_stock_ties"], stock_s = train(stock, data, args.lr)
        result["seconds"]["eager_stock_ties"] = sum(stock_s)
        result["eager_tie_rule"] = "SPEC 3 (stable sort, most recent key first); eager_stock_ties: torch.topk"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"doge-training-keep{args.keep_window}" if sparse else "doge-training"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"eager  first {eager_losses[0]:.4f} last {eager_losses[-1]:.4f}  ({eager_s:.1f} s)")
    if sparse:
        stock_losses = result["eager_stock_ties"]
        print(f"eager, torch.topk ties: first {stock_losses[0]:.4f} last {stock_losses[-1]:.4f}")
    print(f"dmattn first {ours_losses[0]:.4f} last {ours_losses[-1]:.4f}  ({ours_s:.1f} s)")
    print(f"max |diff| {result['max_abs_diff']:.4f} (relative {result['max_rel_diff']:.4f}), NaN: {result['nan']}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(eager_losses, label="eager, SPEC 3 ties" if sparse else "eager (stock attention)")
    if sparse:
        ax.plot(result["eager_stock_ties"], label="eager, stock torch.topk ties", linestyle=":")
    ax.plot(ours_losses, label="dmattn (CUDA)", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    keep = f", keep_window_size {args.keep_window}" if sparse else ""
    ax.set_title(f"tiny Doge, bf16{keep}, {result['device']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)


if __name__ == "__main__":
    main()
