#!/usr/bin/env python3
"""Trains a small Doge model with sequence parallelism (dmattn.distributed), under torchrun.

    torchrun --nproc_per_node=2 examples/doge_sequence_parallel.py [--mode ulysses|ring] [--seq 16384]
        [--keep-window 2048] [--steps 10] [--check]

Every rank holds the whole model and 1/P of every sequence (`shard_sequence` of the
token ids, the position ids and the labels, shifted on the whole sequence first):
embeddings, norms, MLPs and the loss work token by token on the shard, and each
DogeAttention runs on `dmattn.distributed.attention` over the group, its key-only
bias and keep window included. The loss is summed over the local tokens and divided
by the global token count, so the parameter gradients are partial sums: they are
all-reduced (summed) over the group before the optimizer step, as data parallelism
would. Both modes run Doge's top-k exactly (--keep-window 0: dense).

NCCL on GPUs (bf16), gloo on CPUs (float32). With --check, rank 0 also computes the
first step's loss on the whole sequence in one process and prints both.
"""

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import DogeConfig, DogeForCausalLM

from dmattn import distributed as sp
from dmattn.integrations.transformers import use_dmattn_for_doge


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=sp.MODES, default="ulysses")
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--keep-window", type=int, default=2048, help="0: dense (every key kept)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rank, world = dist.get_rank(), dist.get_world_size()

    config = DogeConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                        keep_window_size=args.keep_window or args.seq, max_position_embeddings=args.seq)
    torch.manual_seed(0)  # the same initial weights on every rank
    stock = DogeForCausalLM(config).to(device, dtype)
    model = sp.use_sequence_parallel_for_doge(copy.deepcopy(stock), mode=args.mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shard = lambda t: sp.shard_sequence(t, 1, mode=args.mode)  # noqa: E731
    cycle = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(0))

    for step in range(args.steps):
        # Walks along one fixed random cycle of the vocabulary from random starts: each
        # token determines the next, a toy language the model learns in a few steps.
        generator = torch.Generator().manual_seed(step)  # the same batch on every rank
        start = torch.randint(config.vocab_size, (args.batch, 1), generator=generator)
        ids = cycle[(start + torch.arange(args.seq)) % config.vocab_size].to(device)
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        positions = torch.arange(args.seq, device=device).expand(args.batch, -1)
        tokens = args.batch * (args.seq - 1)

        logits = model(shard(ids), position_ids=shard(positions), use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), shard(labels).flatten(), reduction="sum") / tokens
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step}: loss {total.item():.4f} ({args.mode}, {world} ranks, S={args.seq})", flush=True)
        if step == 0 and args.check and rank == 0:
            with torch.no_grad():
                whole = use_dmattn_for_doge(stock)(ids, position_ids=positions, use_cache=False).logits
                reference = F.cross_entropy(whole.flatten(0, 1).float(), labels.flatten(), reduction="sum") / tokens
            print(f"step 0 on one process: loss {reference.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
