#!/usr/bin/env python3
"""Fill efficiency of a gather-based top-k forward, from the exact selection.

For a key-only bias under causal masking (Sq = Sk = S) the rows that select key
j form one interval [start_j, end_j) (SPEC 3; src/cpu/selection.cpp computes it
with the same Fenwick rule as below). A query block of BM rows then runs on the
union of the keys whose interval meets the block, gathered and padded to BN:

  useful   = sum over rows of the selected keys      (= sum_j end_j - start_j)
  gather   = sum over query blocks of BM * roundup(|union|, BN)
  tileskip = sum over query blocks of BM * BN * (key tiles holding a union key)

The backward's dk/dv walk groups 128 keys sorted by a key of their interval
and runs each group over the 32-row query tiles that cover its keys' rows
(group_fill; several sort keys compared).

Bias models follow Doge's key-only bias A * softplus(dt) with A = 1 and a few
kinds of dt. Pure Python, no dependencies: python3 bench/topk_fill.py [S] [w]
"""
import math
import random
import sys


def key_intervals(bias, w):
    """Per-key [start, end) under causal with Sq = Sk (ties to the larger index)."""
    n = len(bias)
    order = sorted(range(n), key=lambda j: (bias[j], j), reverse=True)
    tree = [0] * (n + 1)  # Fenwick counts of the keys seen so far (the beaters)
    top = 1 << n.bit_length()
    out = [(0, 0)] * n
    for rank, j in enumerate(order):
        end = n
        if rank >= w:  # first row that sees the w-th smallest beater index
            pos, k, step = 0, w, top
            while step:
                if pos + step <= n and tree[pos + step] < k:
                    pos += step
                    k -= tree[pos]
                step //= 2
            end = pos
        out[j] = (j, end) if j < end else (0, 0)
        i = j + 1
        while i <= n:
            tree[i] += 1
            i += i & -i
    return out


def fill(intervals, bm, bn):
    n = len(intervals)
    useful = sum(e - s for s, e in intervals)
    gather = tileskip = 0
    for i0 in range(0, n, bm):
        i1 = min(i0 + bm, n)
        union = [j for j, (s, e) in enumerate(intervals) if s < i1 and e > i0]
        gather += (i1 - i0) * -(-len(union) // bn) * bn
        tileskip += (i1 - i0) * len({j // bn for j in union}) * bn
    return useful, gather, tileskip


def group_fill(intervals, sort_key, g=128, t=32):
    """dk/dv walk: keys sorted by sort_key(start, end) in groups of g, each group
    over the t-row query tiles covering its keys' rows; returns computed entries."""
    keys = sorted((iv for iv in intervals if iv[1] > iv[0]), key=lambda iv: sort_key(*iv))
    work = 0
    for i in range(0, len(keys), g):
        lo = min(s for s, _ in keys[i:i + g])
        hi = max(e for _, e in keys[i:i + g])
        work += g * ((hi + t - 1) // t - lo // t) * t
    return work


GROUPINGS = {
    "(floor(log2 length), start)": lambda s, e: (int(math.log2(e - s)), s),
    "(floor(2 log2 length), start)": lambda s, e: (int(2 * math.log2(e - s)), s),
    "start": lambda s, e: s,
    "start + end": lambda s, e: s + e,
    "end (the backward's)": lambda s, e: e,
}


def main():
    s = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    w = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    rng = random.Random(0)
    softplus = lambda x: math.log1p(math.exp(-abs(x))) + max(x, 0.0)
    ar, x = [], 0.0
    for _ in range(s):
        x = 0.99 * x + math.sqrt(1 - 0.99**2) * rng.gauss(0, 1)
        ar.append(softplus(x))
    models = {
        "dt iid N(0,1)": [softplus(rng.gauss(0, 1)) for _ in range(s)],
        "dt AR(1), rho 0.99": ar,
        "dt = 4 j/S + N(0,0.5)": [softplus(4 * j / s + rng.gauss(0, 0.5)) for j in range(s)],
        "constant (sliding window)": [1.0] * s,
    }
    dense = s * (s + 1) // 2
    print(f"S={s} w={w} causal; useful entries / dense causal entries = selected fraction")
    print("| bias | BM | selected / dense causal | gather fill | tile-skip fill | gather work / dense causal |")
    print("|---|---|---|---|---|---|")
    for name, bias in models.items():
        intervals = key_intervals(bias, w)
        for bm in (64, 128):
            useful, gather, tileskip = fill(intervals, bm, 64)
            print(f"| {name} | {bm} | {useful / dense:.3f} | {useful / gather:.3f} | {useful / tileskip:.3f} "
                  f"| {gather / dense:.3f} |")
    print("\nBackward dk/dv: groups of 128 sorted keys over 32-row query tiles")
    print("| bias | sort key | fill | work / dense causal |")
    print("|---|---|---|---|")
    for name, bias in models.items():
        intervals = key_intervals(bias, w)
        useful = sum(e - s for s, e in intervals)
        for key_name, key in GROUPINGS.items():
            work = group_fill(intervals, key)
            print(f"| {name} | {key_name} | {useful / work:.3f} | {work / dense:.3f} |")


if __name__ == "__main__":
    main()
