"""Sandbox throughput: runs per second with many runs at once, per isolation backend.

Rows: ``run``, one `Sandbox.run` of a short program (``print(sum(range(10**5)))``); ``grade``, one
`CodeGrader` call on an honest solution with ``tests`` (the program and the tests, as a trainer
grades a code completion). ``--parallel`` runs at once (``max_parallel``), ``--runs`` of each, per
backend available here (``unshare`` as root, ``bwrap`` when installed). Every run must succeed;
the figure is wall-clock runs per second over the batch, so it counts the set-up of each sandbox
(namespaces, mounts, the memory cgroup where there is one) and the interpreter's start.
Each backend runs with a memory cgroup per run where one can be made (the default) and without
(``<backend>, no cgroup``): what the cgroup costs. The last line is
``RESULT <backend>_run_per_s=... <backend>_grade_per_s=... <backend>_nocgroup_run_per_s=...``.

Run: ``.venv/bin/python benchmarks/sandbox.py [--runs 256 --parallel 64]`` (as root, or with
bubblewrap installed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import time

from areal_lite.rewards.code import CodeGrader
from areal_lite.rewards.sandbox import Sandbox, SandboxLimits

PROGRAM = "print(sum(range(10**5)))\n"
SOLUTION = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add('a', 'b') == 'ab'\n"


def backends() -> list[str]:
    found = []
    if os.geteuid() == 0 and shutil.which("unshare"):
        found.append("unshare")
    if shutil.which("bwrap"):
        found.append("bwrap")
    return found


async def timed(jobs: list) -> float:
    start = time.perf_counter()
    await asyncio.gather(*jobs)
    return time.perf_counter() - start


async def measure(sandbox: Sandbox, runs: int, parallel: int) -> dict[str, float]:
    grader = CodeGrader(sandbox)

    async def run_once() -> None:
        result = await sandbox.run(PROGRAM)
        assert result.ok and result.stdout == "4999950000\n", result

    async def grade_once() -> None:
        assert await grader("", SOLUTION, [], [], tests=TESTS) == 1.0, sandbox.stats()

    await timed([run_once() for _ in range(parallel)])  # warm the page cache and the interpreter
    run_s = await timed([run_once() for _ in range(runs)])
    grade_s = await timed([grade_once() for _ in range(runs)])
    return {"run": runs / run_s, "grade": runs / grade_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=256, help="runs of each kind per backend")
    parser.add_argument("--parallel", type=int, default=64, help="runs at once")
    args = parser.parse_args()
    with open("/proc/cpuinfo") as f:
        cpu = "Zen 4 / AVX-512 BF16" if "avx512_bf16" in f.read() else platform.processor()
    print(f"CPU: {cpu}, {os.cpu_count()} cores; {args.runs} runs of each kind, {args.parallel} at once")
    print(f"{'sandbox':<22}{'run/s':>10}{'grade/s':>10}")
    result = []
    for backend in backends():
        for cgroup in (None, False):  # the default (a cgroup where one can be made), and none
            limits = SandboxLimits(timeout=60.0)
            try:
                sandbox = Sandbox(limits, backend=backend, max_parallel=args.parallel, memory_cgroup=cgroup)
            except TypeError:  # a version of the sandbox without the option: its default only
                if cgroup is False:
                    continue
                sandbox = Sandbox(limits, backend=backend, max_parallel=args.parallel)
            with_cgroup = getattr(sandbox, "memory_cgroup", False)
            if cgroup is False and not result[-1].startswith(backend + "_grade"):
                continue  # the default row had no cgroup either
            rates = asyncio.run(measure(sandbox, args.runs, args.parallel))
            name = backend if with_cgroup else f"{backend}, no cgroup"
            print(f"{name:<22}{rates['run']:>10.1f}{rates['grade']:>10.1f}")
            key = backend if with_cgroup else f"{backend}_nocgroup"
            result += [f"{key}_run_per_s={rates['run']:.1f}", f"{key}_grade_per_s={rates['grade']:.1f}"]
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
