"""The engine's sampler against the one it replaced and against ``torch.multinomial``, per decode
step, in a thread of its own as the engine runs it (glibc gives such a thread an arena of its own).

For each [rows, vocabulary] shape, the time and the minor page faults of one call of:

- ``inverse_cdf``: the engine's two-level inverse CDF (float32 block sums, float64 over blocks
  and within the chosen block);
- ``one_level``: the sampler it replaced, one float64 running sum over each whole row (a
  [rows, vocabulary] float64 copy, 78 MB at 64 rows of 151936);
- ``multinomial``: ``torch.multinomial(probs, 1)``, what HF ``generate`` samples with;
- ``read once``: one pass reading the probabilities (``sum``): the memory-bound floor of any
  sampler that looks at every entry.

Then the engine itself (a 1-layer, hidden-32 model with a 151936-token vocabulary, so the step is
mostly sampling) decoding 64 requests, with its sampler and with ``one_level`` swapped in: ms and
page faults per decode step. With ``keep_freed_memory`` held, as the engine holds it on CPU.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sampling.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from areal_lite.cpu.malloc import keep_freed_memory
from areal_lite.cpu.precision import cpu_kind
from areal_lite.engines.local import sampling
from areal_lite.engines.local.sampling import inverse_cdf
from areal_lite.engines.local.sampling import running_sum_sample as one_level

SHAPES = [(32, 512), (64, 49152), (64, 151936), (128, 151936)]


def multinomial(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.multinomial(probs, 1)[:, 0]


def read_once(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return probs.sum(dim=-1)


SAMPLERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "inverse_cdf": inverse_cdf,
    "one_level": one_level,
    "multinomial": multinomial,
    "read once": read_once,
}


def in_thread(fn: Callable[[], object]) -> object:
    """``fn()`` in a new thread (its own glibc arena, as the engine's scheduler thread)."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_samplers(rows: int, vocab: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Median ms and mean page faults per call of each sampler, alternating, after a warm-up."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(rows, vocab, generator=g), dim=-1)
    u = torch.rand(rows, 1, generator=g, dtype=torch.float64)
    times: dict[str, list[float]] = {name: [] for name in SAMPLERS}
    faulted = dict.fromkeys(SAMPLERS, 0)
    for name, fn in SAMPLERS.items():
        fn(probs, u)
    for _ in range(repeats):
        for name, fn in SAMPLERS.items():
            f0, t0 = faults(), time.perf_counter()
            fn(probs, u)
            times[name].append(time.perf_counter() - t0)
            faulted[name] += faults() - f0
    return {name: (statistics.median(times[name]) * 1e3, faulted[name] / repeats) for name in SAMPLERS}


def engine_steps(path: str, sampler: Callable, tokens: int = 24) -> tuple[float, float]:
    """ms and page faults per decode step of 64 requests on the engine, with ``sampler``."""
    from areal_lite.api.config import LocalEngineConfig
    from areal_lite.engines.local.engine import LocalInferenceEngine
    from areal_lite.engines.local.request import SamplingParams

    original = sampling.inverse_cdf
    sampling.inverse_cdf = sampler
    engine = LocalInferenceEngine(LocalEngineConfig(path=path, max_running_requests=64))
    engine.initialize()

    async def batch() -> None:
        params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        await asyncio.gather(*[engine.scheduler.generate([5 + i, 6, 7], params) for i in range(64)])

    try:
        asyncio.run(batch())  # warm-up: the cache and the heap reach the step's size
        f0, t0 = faults(), time.perf_counter()
        for _ in range(3):
            asyncio.run(batch())
        return (time.perf_counter() - t0) / (3 * tokens) * 1e3, (faults() - f0) / (3 * tokens)
    finally:
        engine.destroy()
        sampling.inverse_cdf = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    kept = keep_freed_memory()
    print(f"CPU: {cpu_kind()}; one thread; keep_freed_memory in force: {kept}")
    print(f"{'rows x vocab':<16}" + "".join(f"{name + ' ms':>16}{'faults':>9}" for name in SAMPLERS))
    results = {}
    for rows, vocab in SHAPES:
        r = in_thread(lambda rows=rows, vocab=vocab: time_samplers(rows, vocab, args.repeats))
        results[(rows, vocab)] = r
        cells = "".join(f"{ms:>16.2f}{f:>9.0f}" for ms, f in r.values())  # type: ignore[union-attr]
        print(f"{f'{rows} x {vocab}':<16}{cells}")

    from transformers import AutoModelForCausalLM

    from areal_lite.utils.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(f"{tmp}/m", hidden_size=32, num_layers=1)
        model = AutoModelForCausalLM.from_pretrained(path)
        model.resize_token_embeddings(151936)
        model.save_pretrained(path)
        ours = engine_steps(path, inverse_cdf)
        before = engine_steps(path, one_level)
    print("engine decode step, 64 rows, 151936-token vocabulary (1 layer, hidden 32):")
    print(f"  inverse_cdf {ours[0]:.1f} ms, {ours[1]:.0f} faults; one_level {before[0]:.1f} ms, {before[1]:.0f} faults")
    mid, big = results[(64, 49152)], results[(64, 151936)]
    print(
        f"RESULT one_level_over_ours_64x49152={mid['one_level'][0] / mid['inverse_cdf'][0]:.2f} "
        f"one_level_over_ours_64x151936={big['one_level'][0] / big['inverse_cdf'][0]:.2f} "
        f"multinomial_over_ours_64x151936={big['multinomial'][0] / big['inverse_cdf'][0]:.2f} "
        f"ours_over_read_once_64x151936={big['inverse_cdf'][0] / big['read once'][0]:.2f} "
        f"engine_step_before_over_after={before[0] / ours[0]:.2f}"
    )


if __name__ == "__main__":
    main()
