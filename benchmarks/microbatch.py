"""Fill ratio of micro-batches: balanced first-fit-decreasing vs a naive sequential split.

fill = real tokens / (token budget x number of micro-batches). Fewer, fuller micro-batches mean
fewer forward/backward passes for the same data. Lengths are drawn from long-tailed distributions
(log-normal and Pareto), as RL completions are. Usage: python benchmarks/microbatch.py
"""

from __future__ import annotations

import argparse

import numpy as np

from areal_lite.utils.data import allocate_balanced, allocate_sequential


def fill(lengths: list[int], bins: list[list[int]], budget: int) -> float:
    return sum(lengths) / (budget * len(bins))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=50, help="random batches per distribution")
    parser.add_argument("--batch-size", type=int, default=256, help="sequences per batch")
    parser.add_argument("--budget", type=int, default=8192, help="max_tokens_per_mb")
    parser.add_argument("--granularity", type=int, default=8, help="GRPO group size kept together")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    max_len = args.budget // args.granularity
    dists = {
        "lognormal(5,0.8)": lambda n: rng.lognormal(5.0, 0.8, n),
        "pareto(1.5)*40": lambda n: (rng.pareto(1.5, n) + 1) * 40,
        "uniform(16,1024)": lambda n: rng.uniform(16, 1024, n),
    }
    rows = []
    for name, draw in dists.items():
        fb, fn, nb, nn = [], [], [], []
        for _ in range(args.batches):
            lengths = np.clip(draw(args.batch_size), 1, max_len).astype(int).tolist()
            b = allocate_balanced(lengths, args.budget, 1, args.granularity)
            s = allocate_sequential(lengths, args.budget, args.granularity)
            fb.append(fill(lengths, b, args.budget))
            fn.append(fill(lengths, s, args.budget))
            nb.append(len(b))
            nn.append(len(s))
        rows.append((name, float(np.mean(fb)), float(np.mean(fn)), float(np.mean(nb)), float(np.mean(nn))))
    print(
        f"budget={args.budget} tokens, {args.batch_size} sequences/batch, groups of {args.granularity}, {args.batches} batches each"
    )
    print(f"{'lengths':<20}{'fill balanced':>15}{'fill naive':>12}{'mbs balanced':>14}{'mbs naive':>11}")
    for name, a, b, c, d in rows:
        print(f"{name:<20}{a:>15.3f}{b:>12.3f}{c:>14.1f}{d:>11.1f}")
    fb = np.mean([r[1] for r in rows])
    fn = np.mean([r[2] for r in rows])
    print(f"RESULT fill_balanced={fb:.3f} fill_naive={fn:.3f}")


if __name__ == "__main__":
    main()
