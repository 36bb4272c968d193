"""Generation throughput of the embedded engine against HF ``model.generate``, and weight-sync time.

Part 1: 64 requests of mixed prompt (8-64) and output (8-128) lengths on the same tiny model
(hidden 128, 4 layers), and the CPU demo's RL step: 256 requests of 10-20 prompt and 10-30 output
tokens.
The engine serves them concurrently through its continuous-batching scheduler; HF generates them as
one left-padded batch (its fastest mode: one call, every request decoded until the longest ends).
Both sample at temperature 1 with eos ignored, so both produce exactly the requested tokens, and
tokens/s counts only requested tokens.

Part 2: seconds to push the weights of a ~100M-parameter model into a running engine, from disk
(HF safetensors written by the trainer side, then loaded) and by broadcast in a gloo weight-update
group (trainer rank 0 in a thread of this process, the engine at rank 1).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/generation.py [--skip-sync]

On a GPU (``--device cuda``, with ``--skip-sync``: part 2 is a CPU measurement) both sides run on
it, in ``--dtype``, and the engine runs twice: with its decode steps replayed as CUDA graphs (the
default) and eagerly (``cuda_graphs=False``), in the table's ``engine eager`` column. ``--model DIR`` replaces the tiny model with a HF directory's; one holding
only a config and a tokenizer (SmolLM2-135M's, say) gets random weights of that shape.

(One thread: on a loaded 2-core machine, two OpenMP threads per process made HF generation 10x
slower, which would flatter the engine.)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from areal_lite.api.config import LocalEngineConfig
from areal_lite.api.io import ParamSpec, WeightUpdateMeta
from areal_lite.cpu.precision import cpu_kind
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.local.request import SamplingParams
from areal_lite.utils.distributed import find_free_port, init_custom_process_group
from areal_lite.utils.tiny import build_tiny_model, with_random_weights

REPEATS = 5
"""Each throughput is the best of this many runs (``--repeats``), the engine's and HF's alternating
(the machine is shared: the best run is the least disturbed one, and alternation exposes both to
the same load)."""


def make_requests(
    n: int, seed: int, vocab: int, prompt_len: tuple[int, int], output_len: tuple[int, int]
) -> list[tuple[list[int], int]]:
    """``n`` random prompts and output lengths, uniform in the given inclusive ranges."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len)) for _ in range(n)
    ]


def engine_runner(engine: LocalInferenceEngine, requests: list[tuple[list[int], int]]) -> Callable[[], int]:
    """One pass of the engine over ``requests``; returns the tokens generated."""

    async def run() -> int:
        results = await asyncio.gather(
            *[engine.scheduler.generate(p, SamplingParams(max_new_tokens=m, ignore_eos=True)) for p, m in requests]
        )
        return sum(len(r.output_ids) for r in results)

    return lambda: asyncio.run(run())


def hf_runner(model: torch.nn.Module, requests: list[tuple[list[int], int]]) -> Callable[[], int]:
    """One left-padded ``model.generate`` call over ``requests`` (on the model's device); returns
    the requested tokens."""
    pad = model.generation_config.pad_token_id
    width = max(len(p) for p, _ in requests)
    ids = torch.full((len(requests), width), pad)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for i, (p, _) in enumerate(requests):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    max_new = max(m for _, m in requests)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)

    def run() -> int:
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=True, top_k=0
            )
        out.cpu()  # waits for the device
        return sum(m for _, m in requests)

    return run


def best_throughputs(runners: list[Callable[[], int]], repeats: int = REPEATS) -> list[float]:
    """Tokens/s of each runner: best of ``repeats`` alternating runs, after one warm-up run each."""
    best = [0.0] * len(runners)
    for run in runners:
        run()
    for _ in range(repeats):
        for i, run in enumerate(runners):
            t0 = time.perf_counter()
            rate = run() / (time.perf_counter() - t0)
            best[i] = max(best[i], rate)
            print(f"  runner {i}: {rate:.0f} tokens/s", file=sys.stderr, flush=True)
    return best


def bench_sync(workdir: str) -> tuple[int, float, float]:
    """Build a ~100M-parameter model; time a disk update and a broadcast update into an engine."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(
        f"{workdir}/big", hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12, vocab_size=512
    )
    trainer = AutoModelForCausalLM.from_pretrained(path)
    n_params = sum(p.numel() for p in trainer.parameters())
    engine = LocalInferenceEngine(LocalEngineConfig(path=path, max_running_requests=4))
    engine.initialize()

    t0 = time.perf_counter()
    trainer.save_pretrained(f"{workdir}/update")
    engine.update_weights(WeightUpdateMeta(type="disk", path=f"{workdir}/update", version=1)).result()
    disk_s = time.perf_counter() - t0

    meta = WeightUpdateMeta(type="distributed", master_port=find_free_port(), version=2)
    joined = engine.init_weights_update_group(meta)
    group = init_custom_process_group(
        "gloo", meta.master_address, meta.master_port, 0, meta.world_size, meta.group_name
    )
    joined.result()
    state = trainer.state_dict()
    t0 = time.perf_counter()
    specs = [ParamSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items()]
    fut = engine.update_weights(WeightUpdateMeta(**{**meta.to_json(), "param_specs": specs}))
    for t in state.values():
        group.broadcast(t.contiguous())
    fut.result()
    broadcast_s = time.perf_counter() - t0
    engine.destroy()
    return n_params, disk_s, broadcast_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model", help="a HF directory instead of the tiny model (random weights if it has none)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both sides run")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both sides' dtype")
    parser.add_argument("--skip-sync", action="store_true", help="skip the ~100M-parameter weight-sync part")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed runs per side (the best counts)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        if args.model:
            path = with_random_weights(args.model, f"{workdir}/model")
        else:
            path = build_tiny_model(f"{workdir}/model", hidden_size=args.hidden, num_layers=args.layers, vocab_size=512)
        from transformers import AutoModelForCausalLM

        # On CUDA the engine eager as well (local_engine.cuda_graphs off): what the graphs give.
        graph_modes = [True, False] if args.device == "cuda" else [True]
        engines = [
            LocalInferenceEngine(LocalEngineConfig(path=path, device=args.device, dtype=args.dtype, cuda_graphs=g))
            for g in graph_modes
        ]
        for engine in engines:
            engine.initialize()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device).eval()
        requests = make_requests(args.requests, seed=0, vocab=400, prompt_len=(8, 64), output_len=(8, 128))
        # The CPU demo's RL step: many short requests.
        rl_requests = make_requests(256, seed=1, vocab=400, prompt_len=(10, 20), output_len=(10, 30))
        rows = [
            (
                name,
                best_throughputs([*(engine_runner(e, reqs) for e in engines), hf_runner(model, reqs)], args.repeats),
            )
            for name, reqs in [(f"{args.requests} mixed requests", requests), ("256 short (RL step)", rl_requests)]
        ]
        for engine in engines:
            engine.destroy()
        where = torch.cuda.get_device_name() if args.device == "cuda" else cpu_kind()
        shape = args.model or f"hidden {args.hidden}, {args.layers} layers"
        print(f"{where}; {args.dtype}; {shape}")
        eager_column = f"{'engine eager':>14}" if len(engines) > 1 else ""
        print(f"{'tokens/s':<28}{'engine':>10}{eager_column}{'HF generate':>13}{'ratio':>8}")
        for name, tps in rows:
            eager = f"{tps[1]:>14.0f}" if len(engines) > 1 else ""
            print(f"{name:<28}{tps[0]:>10.0f}{eager}{tps[-1]:>13.0f}{tps[0] / tps[-1]:>8.2f}")
        (engine_tps, *_, hf_tps), (rl_engine_tps, *_, rl_hf_tps) = rows[0][1], rows[1][1]
        result = (
            f"RESULT engine_over_hf_generate={engine_tps / hf_tps:.2f} engine_tokens_per_s={engine_tps:.0f} "
            f"hf_tokens_per_s={hf_tps:.0f} rl_step_engine_over_hf={rl_engine_tps / rl_hf_tps:.2f}"
        )
        if len(engines) > 1:
            result += f" graphs_over_eager={engine_tps / rows[0][1][1]:.2f} rl_graphs_over_eager={rl_engine_tps / rows[1][1][1]:.2f}"
        if not args.skip_sync:
            n_params, disk_s, broadcast_s = bench_sync(workdir)
            print(f"{'weight sync':<28}{'seconds':>12}   ({n_params / 1e6:.0f}M parameters, fp32)")
            print(f"{'disk':<28}{disk_s:>12.2f}")
            print(f"{'gloo broadcast':<28}{broadcast_s:>12.2f}")
            result += f" sync_disk_s={disk_s:.2f} sync_broadcast_s={broadcast_s:.2f} sync_params_m={n_params / 1e6:.0f}"
        print(result)


if __name__ == "__main__":
    main()
