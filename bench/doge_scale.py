"""Doge training at long context: step time and peak memory of dmattn against transformers' sdpa and eager.

A DogeForCausalLM (hidden 1024, 8 query / 2 kv heads, head dim 128, a few layers, keep_window_size 2048,
bf16 weights, activations and AdamW state) trains on random tokens at each sequence length, batch 1,
once per attention path from the same weights and batches:

- dmattn: `use_dmattn_for_doge` (the key-only dynamic-mask bias, top-k selected on the GPU, O(S * w));
- sdpa and eager: transformers' own paths, which build the (B, H, S, S) dynamic mask and its top-k.

Per path and length: the median step time (forward, backward, AdamW) over the timed steps after a
warm-up, the peak memory of the step, and the losses of every step; a path that runs out of memory is
reported so. At the first length the losses of dmattn and eager (eager's top-k with SPEC 3's tie rule,
bench/doge_training.py) are compared step by step.

    python bench/doge_scale.py --out DIR [--lengths 8192,32768] [--layers 4] [--steps 6]

Writes DIR/doge-scale.json and prints one line per path and length.
"""

import argparse
import json
import pathlib
import statistics

import torch
from transformers import DogeConfig, DogeForCausalLM

from dmattn.integrations.transformers import use_dmattn_for_doge
from doge_training import spec_ties, train

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, KEEP = 4096, 1024, 8, 2, 128, 2048


def model_for(length, layers, implementation, base=None):
    """The model of one path, a copy of `base`'s weights when given."""
    config = DogeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                        head_dim=HEAD_DIM, keep_window_size=KEEP, max_position_embeddings=length,
                        attn_implementation="eager" if implementation == "dmattn" else implementation)
    model = DogeForCausalLM(config).to("cuda", torch.bfloat16)
    if base is not None:
        model.load_state_dict(base.state_dict())
    if implementation == "dmattn":
        return use_dmattn_for_doge(model)
    return spec_ties(model) if implementation == "eager" else model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs")
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="steps a path, the first one a warm-up")
    parser.add_argument("--paths", default="dmattn,sdpa,eager")
    args = parser.parse_args()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  config=dict(vocab=VOCAB, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                              layers=args.layers, keep_window_size=KEEP, batch=1, dtype="bfloat16",
                              optimizer="AdamW lr 1e-3", steps=args.steps), runs=[])
    for n, length in enumerate(int(x) for x in args.lengths.split(",")):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(length)
        data = [torch.randint(0, VOCAB, (1, length), generator=g).cuda() for _ in range(args.steps)]
        base = model_for(length, args.layers, "sdpa").cpu()  # the weights every path starts from
        losses = {}
        for path in args.paths.split(","):
            run = dict(length=length, path=path)
            try:
                model = model_for(length, args.layers, path, base)
                torch.cuda.reset_peak_memory_stats()
                losses[path], seconds = train(model, data, 1e-3)
                peak = torch.cuda.max_memory_allocated()
                run.update(losses=losses[path], step_ms=1e3 * statistics.median(seconds[1:] or seconds),
                           peak_gib=peak / 2**30)
            except torch.OutOfMemoryError:
                run["skip"] = "out of memory"
            model = None
            torch.cuda.empty_cache()
            result["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "losses"}), flush=True)
        if n == 0 and "dmattn" in losses and "eager" in losses:
            diffs = [abs(a - b) for a, b in zip(losses["dmattn"], losses["eager"])]
            result["loss_vs_eager"] = dict(length=length, max_abs_diff=max(diffs),
                                           max_rel_diff=max(d / abs(a) for d, a in zip(diffs, losses["eager"])))
            print(f"S={length}: dmattn vs eager loss, largest difference {max(diffs):.4f}", flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "doge-scale.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
