"""Small ops in a second thread of a process whose main thread has its own OpenMP team.

The embedded engine decodes in its scheduler thread while the trainer's thread waits; both run
parallel torch ops, so libgomp gives each a team of worker threads. Once the process holds more
of them than it has CPUs, libgomp shortens every barrier's spin-wait to 100 iterations and sleeps
on a futex, so each small parallel op pays for waking its workers. `release_openmp_threads`
frees the waiting thread's team. This measures the engine's kind of op (a [32, 384] x [384, 1152]
linear through oneDNN's packed weight, as a 20M model's decode step runs it, and a 512 x 512
matmul) in a second thread at ``--threads`` threads, three ways, alternating over ``--rounds``:

- ``alone``: the main thread never ran a parallel op (one team in the process);
- ``beside``: the main thread ran parallel ops first and keeps its team (docked workers);
- ``released``: the same, with the main thread's team freed before the second thread runs.

Each figure is the best round's median microseconds per op. The last line is
``RESULT beside_over_alone=... released_over_alone=...`` (for the linear; 1.0 is no cost).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/openmp_teams.py [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import torch

from areal_lite.cpu.precision import cpu_kind
from areal_lite.cpu.threads import release_openmp_threads


def ops() -> dict[str, Callable[[], object]]:
    x, w, big = torch.randn(32, 384), torch.randn(1152, 384), torch.randn(512, 512)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    return {
        "linear 32x384x1152 (oneDNN)": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "matmul 512x512x512": lambda: big @ big,
    }


def time_ops(threads: int) -> dict[str, float]:
    """Median microseconds per op of each op, run in the calling thread."""
    torch.set_num_threads(threads)
    out = {}
    for name, fn in ops().items():
        for _ in range(50):
            fn()
        samples = []
        for _ in range(20):
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            samples.append((time.perf_counter() - t0) / 20 * 1e6)
        out[name] = statistics.median(samples)
    return out


def in_thread(threads: int) -> dict[str, float]:
    result: dict[str, float] = {}
    t = threading.Thread(target=lambda: result.update(time_ops(threads)))
    t.start()
    t.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    best: dict[str, dict[str, float]] = {}

    def keep(mode: str, figures: dict[str, float]) -> None:
        for op, us in figures.items():
            best.setdefault(mode, {})[op] = min(us, best.get(mode, {}).get(op, float("inf")))

    for _ in range(args.rounds):
        keep("alone", in_thread(args.threads))  # every earlier team has ended with its thread
        time_ops(args.threads)  # the main thread's team, docked from now on
        keep("beside", in_thread(args.threads))
        release_openmp_threads()
        keep("released", in_thread(args.threads))
    print(f"CPU: {cpu_kind()}; {args.threads} threads per team; best of {args.rounds} rounds, median us per op")
    names = list(best["alone"])
    print(f"{'second thread':<16}" + "".join(f"{n:>30}" for n in names))
    for mode in ("alone", "beside", "released"):
        print(f"{mode:<16}" + "".join(f"{best[mode][n]:>30.1f}" for n in names))
    op = names[0]
    print(
        f"RESULT beside_over_alone={best['beside'][op] / best['alone'][op]:.2f} "
        f"released_over_alone={best['released'][op] / best['alone'][op]:.2f} "
        f"matmul_beside_over_alone={best['beside'][names[1]] / best['alone'][names[1]]:.2f}"
    )


if __name__ == "__main__":
    main()
