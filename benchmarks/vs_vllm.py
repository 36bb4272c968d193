"""Generation against vLLM's CPU build: our embedded engine, our server and a real vLLM server on the
same model, the same requests and the same thread count, side by side in one run.

Workload of one pass at concurrency ``C``: ``--waves x C`` requests, at most ``C`` in flight (the
first ``C`` sent at once, each later one as soon as one finishes); prompts of random token ids of
mixed lengths (16-256 tokens), outputs of mixed lengths (32-128 tokens), temperature 1, eos
ignored so that every request produces exactly its tokens. Every pass has fresh prompts (vLLM's
prefix cache finds nothing from an earlier pass) and every side gets the same passes.

Sides, each at ``--threads`` threads (``torch.set_num_threads`` in this process for the embedded
engine, ``OMP_NUM_THREADS`` for the servers):

- ``engine``: the embedded engine (`Scheduler`) in this process, `generate` from asyncio tasks.
- ``server``: our server, started with the launcher's command line (``launcher.backend=areal``),
  over streamed ``/v1/completions`` (prompt as token ids, ``ignore_eos``).
- ``vllm``: vLLM's OpenAI server, started with the launcher's command line (``backend=vllm``:
  vLLM's CPU settings, eager mode; ``--vllm-compile`` lets it compile its graph), same requests
  through the same client. vLLM's Python comes from ``$AREAL_LITE_VLLM_PYTHON`` or the
  checkout's ``.venv-vllm`` (``make install-vllm``). ``--vllm-preload`` puts the Intel OpenMP
  library of vLLM's environment in ``LD_PRELOAD``, as vLLM's CPU docs advise.

Columns: output tokens/s; its fraction of the roofline (the least time the pass's prefill and
decode FLOPs, and its weights read once per decode step, could take at the limits measured right
before the pass, in the pass's dtype; 1.0 = at the limit); time to first token: the median over
the pass's requests, and the first wave's fraction (its ``C`` prompts' prefill at the limit over
the time the last of them got its first token). A side's figure is its best pass (``--repeats``),
its fraction that pass's. The sides run at the same time and take turns pass by pass, so that a
load change on a shared machine falls on all of them alike. The limits are
`roofline.measure_limits` (sampled ``SETTLE_S`` after the previous pass; a 1024^3 matmul in the
dtype, a 256 MiB copy).

Models: ``20m`` (the roofline's 20M Qwen2: hidden 384, 10 layers, 6 heads of 64, 512 tokens of
vocabulary, built here) and ``smollm2`` (SmolLM2-135M-Instruct, `smollm2_dir`: ``make
real-model`` installs what it needs). Dtypes: ``float32`` and ``bfloat16`` (default: both where
the CPU computes bf16 natively, else fp32 only).

    OMP_NUM_THREADS=1 python benchmarks/vs_vllm.py [--models 20m,smollm2] [--concurrency 16,64]
        [--dtypes float32,bfloat16] [--threads 1] [--repeats 2] [--sides engine,server,vllm] [--quick]

``--quick`` (about 10 minutes on 2 cores, most of it vLLM's start-up): SmolLM2 only, in the one
dtype the engine picks by default on this CPU (``auto``: bf16 where native, else fp32), one pass
per side of one wave; any option given beside it wins.

The last line is ``RESULT bf16=native|emulated threads=<n> <model>_<dtype>_c<C>_<side>_over_vllm=<tokens/s
ratio> ...`` (the CPU's name and kind are printed above the table).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import torch

from areal_lite.api.config import LocalEngineConfig, RecoverConfig
from areal_lite.api.experiment_config import LauncherConfig
from areal_lite.cpu.precision import cpu_kind, native_bf16
from areal_lite.cpu.threads import release_openmp_threads
from areal_lite.engines.local.request import SamplingParams
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.launcher.commands import server_command, vllm_python
from areal_lite.launcher.plan import LaunchPlan
from areal_lite.launcher.processes import is_healthy, spawn, stop
from areal_lite.utils.distributed import find_free_port

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import MODELS, Limits, Shape, measure_limits

CONTEXT = 512
PROMPT_LEN = (16, 256)
OUTPUT_LEN = (32, 128)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STARTUP_TIMEOUT_S = 900.0
SETTLE_S = 2.0
"""Pause before each pass's limit sample: vLLM's processes kept one CPU busy for 1-1.5 s after
their last response (2 threads, SmolLM2, 2026-11-27), which read the next limit low (85-134
against 270-389 GFLOP/s in bf16) and slowed the next side's start."""


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


@dataclass
class Pass:
    """What one pass measured."""

    seconds: float
    tokens: int
    ttfts: list[float]
    wave_ttft: float
    """Seconds until the last request of the first wave had its first token."""
    fraction: float = 0.0
    ttft_fraction: float = 0.0


@dataclass
class Figure:
    side: str
    passes: list[Pass] = field(default_factory=list)

    @property
    def best(self) -> Pass:
        return max(self.passes, key=lambda p: p.tokens / p.seconds)


def make_passes(n_passes: int, n: int, vocab: int, seed: int) -> list[list[Request]]:
    rng = random.Random(seed)
    return [
        [
            Request([rng.randrange(3, vocab) for _ in range(rng.randint(*PROMPT_LEN))], rng.randint(*OUTPUT_LEN))
            for _ in range(n)
        ]
        for _ in range(n_passes)
    ]


def bounds(shape: Shape, reqs: list[Request], concurrency: int, limits: Limits, itemsize: int) -> tuple[float, float]:
    """(least seconds for the whole pass, least seconds to prefill the first wave) at ``limits``."""
    weights = itemsize * shape.matmul_params

    def prefill_flops(rs: list[Request]) -> float:
        return sum(shape.token_flops(t + 1) for r in rs for t in range(len(r.prompt)))

    decode = sum(shape.token_flops(len(r.prompt) + t + 1) for r in reqs for t in range(r.max_tokens - 1))
    steps = sum(r.max_tokens for r in reqs) / concurrency  # decode steps if every step ran C rows
    kv = sum(shape.kv_bytes(len(r.prompt) + t + 1, itemsize) for r in reqs for t in range(r.max_tokens - 1))
    whole = limits.seconds(prefill_flops(reqs) + decode, steps * weights + kv)
    return whole, limits.seconds(prefill_flops(reqs[:concurrency]), weights)


async def _bounded(reqs: list[Request], concurrency: int, one) -> tuple[list[tuple[float, int]], float]:
    """Run ``one(request) -> (ttft, tokens)`` over ``reqs`` with at most ``concurrency`` in flight,
    in order; returns the per-request results and the wall seconds."""
    sem = asyncio.Semaphore(concurrency)

    async def run(r: Request) -> tuple[float, int]:
        async with sem:
            return await one(r)

    t0 = time.perf_counter()
    results = await asyncio.gather(*[run(r) for r in reqs])
    return results, time.perf_counter() - t0


def _pass_of(results: list[tuple[float, int]], seconds: float, reqs: list[Request], concurrency: int) -> Pass:
    tokens = sum(n for _, n in results)
    expected = sum(r.max_tokens for r in reqs)
    if tokens != expected:
        raise RuntimeError(f"the side produced {tokens} tokens, {expected} were asked for")
    ttfts = [t for t, _ in results]
    return Pass(seconds, tokens, ttfts, max(ttfts[:concurrency]))


def engine_pass(scheduler: Scheduler, reqs: list[Request], concurrency: int) -> Pass:
    async def one(r: Request) -> tuple[float, int]:
        res = await scheduler.generate(r.prompt, SamplingParams(max_new_tokens=r.max_tokens, ignore_eos=True))
        return res.ttft, len(res.output_ids)

    results, seconds = asyncio.run(_bounded(reqs, concurrency, one))
    return _pass_of(results, seconds, reqs, concurrency)


def server_pass(address: str, model: str, reqs: list[Request], concurrency: int) -> Pass:
    """Streamed ``/v1/completions`` calls; a request's first token is its first chunk with text."""

    async def go() -> tuple[list[tuple[float, int]], float]:
        timeout = aiohttp.ClientTimeout(total=3600)
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

            async def one(r: Request) -> tuple[float, int]:
                body = {
                    "model": model,
                    "prompt": r.prompt,
                    "max_tokens": r.max_tokens,
                    "temperature": 1.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                t0 = time.perf_counter()
                ttft, tokens = None, 0
                async with session.post(f"http://{address}/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"{address}: HTTP {resp.status}: {(await resp.text())[:500]}")
                    async for line in resp.content:
                        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                            continue
                        chunk = json.loads(line[6:])
                        if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                            ttft = time.perf_counter() - t0
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                if ttft is None:
                    raise RuntimeError(f"{address}: no chunk with text")
                return ttft, tokens

            return await _bounded(reqs, concurrency, one)

    results, seconds = asyncio.run(go())
    return _pass_of(results, seconds, reqs, concurrency)


def start_server(backend: str, path: str, dtype: str, threads: int, log_dir: str, args: argparse.Namespace):
    """A server process started with the launcher's command line, once healthy; (process, address)."""
    launcher = LauncherConfig(backend=backend, vllm_cpu_kvcache_gib=args.vllm_kv_gib)
    engine_args = ["--dtype", dtype, "--context-length", str(CONTEXT)]
    plan = LaunchPlan("-", None, [], launcher, RecoverConfig(), path, log_dir, engine_args=engine_args)
    port = find_free_port()
    cmd = server_command(plan, port, host="127.0.0.1")
    if backend == "vllm" and args.vllm_compile:
        cmd.remove("--enforce-eager")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if backend == "vllm" and args.vllm_preload:
        lib = os.path.join(os.path.dirname(os.path.dirname(vllm_python(launcher))), "lib", "libiomp5.so")
        if not os.path.exists(lib):
            raise FileNotFoundError(f"--vllm-preload: no {lib}")
        env["LD_PRELOAD"] = lib
    log = os.path.join(log_dir, f"{backend}-{dtype}.log")
    proc = spawn(cmd, cores=[], env=env, log_path=log)
    address = f"127.0.0.1:{port}"
    t0 = time.monotonic()
    while not is_healthy(address):
        if proc.poll() is not None:
            with open(log, errors="replace") as f:
                raise RuntimeError(f"{backend} server exited; its log ends:\n{f.read()[-4000:]}")
        if time.monotonic() - t0 > STARTUP_TIMEOUT_S:
            stop([proc])
            raise TimeoutError(f"{backend} server not healthy in {STARTUP_TIMEOUT_S} s (log: {log})")
        time.sleep(1.0)
    print(f"  {backend} server ({dtype}) healthy after {time.monotonic() - t0:.0f} s", flush=True)
    return proc, address


def served_name(address: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


@dataclass
class Side:
    """One side, started: ``run(requests, concurrency)`` measures a pass, ``close()`` stops it."""

    name: str
    run: Callable[[list[Request], int], Pass]
    close: Callable[[], None]


def open_side(side: str, path: str, dtype: str, log_dir: str, args: argparse.Namespace) -> Side:
    """The embedded engine, or a server started with the launcher's command line, warmed up."""
    if side == "engine":
        scheduler = Scheduler(LocalEngineConfig(path=path, dtype=dtype, max_total_tokens=CONTEXT))
        scheduler.start()
        opened = Side(side, lambda reqs, c: engine_pass(scheduler, reqs, c), scheduler.stop)
    else:
        backend = "areal" if side == "server" else "vllm"
        proc, address = start_server(backend, path, dtype, args.threads, log_dir, args)
        name = served_name(address)
        opened = Side(side, lambda reqs, c: server_pass(address, name, reqs, c), lambda: stop([proc], grace=15.0))
    try:
        # First-request costs (lazy set-up, compilation) stay out of the figures.
        opened.run(make_passes(1, 4, args.vocab, seed=99)[0], 4)
    except BaseException:
        opened.close()
        raise
    return opened


def run_sides(
    sides: list[str],
    path: str,
    dtype: str,
    passes: dict[int, list[list[Request]]],
    shape: Shape,
    args: argparse.Namespace,
) -> dict[str, dict[int, Figure]]:
    """Every pass of every concurrency on every side, the sides started together and taking turns
    pass by pass (the order rotating), so that a load change on a shared machine falls on all of
    them alike; each pass right after a sample of the limits."""
    torch_dtype = DTYPES[dtype]
    itemsize = torch.finfo(torch_dtype).bits // 8
    figures = {side: {c: Figure(side) for c in passes} for side in sides}
    opened: list[Side] = []
    with tempfile.TemporaryDirectory() as log_dir:
        try:
            for side in sides:
                opened.append(open_side(side, path, dtype, log_dir, args))
            turn = 0
            for c, reqs_list in passes.items():
                for reqs in reqs_list:
                    for k in range(len(opened)):
                        one = opened[(turn + k) % len(opened)]
                        time.sleep(SETTLE_S)
                        limits = measure_limits(torch_dtype)
                        # The limits' matmul gave this thread an OpenMP team: freed, so that its
                        # docked workers do not slow the embedded engine's (`release_openmp_threads`).
                        release_openmp_threads()
                        p = one.run(reqs, c)
                        whole, wave = bounds(shape, reqs, c, limits, itemsize)
                        p.fraction, p.ttft_fraction = whole / p.seconds, wave / p.wave_ttft
                        figures[one.name][c].passes.append(p)
                        print(
                            f"  {one.name:<7} C={c:<3} {p.tokens / p.seconds:8.1f} tok/s  of roofline {p.fraction:.3f}  "
                            f"ttft p50 {statistics.median(p.ttfts):.2f} s  wave {p.wave_ttft:.2f} s "
                            f"({p.ttft_fraction:.3f})  [{limits.gflops:.0f} GFLOP/s, load {os.getloadavg()[0]:.1f}]",
                            flush=True,
                        )
                    turn += 1
        finally:
            for one in opened:
                one.close()
    return figures


def model_path(name: str, tmp: str) -> str:
    if name == "20m":
        from areal_lite.utils.tiny import build_tiny_model

        return build_tiny_model(
            os.path.join(tmp, "20m"), vocab_size=512, max_position_embeddings=CONTEXT, **MODELS["20M"]
        )
    if name == "smollm2":
        from areal_lite.utils.pretrained import smollm2_dir

        return smollm2_dir()
    raise ValueError(f"unknown model {name!r}: 20m or smollm2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=None, help="default: 20m,smollm2 (--quick: smollm2)")
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument(
        "--dtypes", default=None, help="default: float32,bfloat16 where bf16 is native, else float32 (--quick: one)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=None, help="passes per side and concurrency (2; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="SmolLM2, one dtype, one pass per side (~10 min)")
    parser.add_argument(
        "--waves", type=int, default=None, help="requests per pass = waves x concurrency (2; --quick: 1)"
    )
    parser.add_argument("--sides", default="engine,server,vllm")
    parser.add_argument("--vllm-compile", action="store_true", help="let vLLM compile its graph (no --enforce-eager)")
    parser.add_argument("--vllm-preload", action="store_true", help="LD_PRELOAD vLLM's Intel OpenMP library")
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    args = parser.parse_args()
    native = native_bf16(torch.device("cpu"))
    if args.models is None:
        args.models = "smollm2" if args.quick else "20m,smollm2"
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if args.waves is None:
        args.waves = 1 if args.quick else 2
    if args.dtypes is None:
        both = ["float32", "bfloat16"] if native else ["float32"]
        args.dtypes = both[-1] if args.quick else ",".join(both)
    dtypes = args.dtypes.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"--dtypes: unknown {unknown}; choose from {list(DTYPES)}")
    sides = args.sides.split(",")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_kind()}; {args.threads} thread(s) per side; load {os.getloadavg()[0]:.1f}")
    if "vllm" in sides:
        launcher = LauncherConfig(backend="vllm")
        probe = subprocess.run([vllm_python(launcher), "-c", "import vllm; print(vllm.__version__)"],
                               capture_output=True, text=True, check=False)  # fmt: skip
        if probe.returncode != 0:
            sys.exit(f"no vLLM in {vllm_python(launcher)}: make install-vllm, or set AREAL_LITE_VLLM_PYTHON")
        print(f"vLLM {probe.stdout.strip()} ({vllm_python(launcher)}), {'compiled' if args.vllm_compile else 'eager'}")
    result = [f"bf16={'native' if native else 'emulated'}", f"threads={args.threads}"]
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            path = model_path(model, tmp)
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(path)
            with torch.device("meta"):
                shape = Shape.of(AutoModelForCausalLM.from_config(config))
            for dtype in dtypes:
                print(f"{model} {dtype}", flush=True)
                passes = {
                    c: make_passes(args.repeats, args.waves * c, config.vocab_size, seed=1000 * c) for c in concurrency
                }
                args.vocab = config.vocab_size
                figures = run_sides(sides, path, dtype, passes, shape, args)
                for c in concurrency:
                    peer = figures["vllm"][c].best if "vllm" in figures else None
                    for side in sides:
                        p = figures[side][c].best
                        rate = p.tokens / p.seconds
                        ratio = rate / (peer.tokens / peer.seconds) if peer else float("nan")
                        ttft_ratio = (
                            statistics.median(peer.ttfts) / statistics.median(p.ttfts) if peer else float("nan")
                        )
                        rows.append(
                            f"{model:<8}{dtype:<10}{c:>4}  {side:<8}{rate:>9.1f}{p.fraction:>9.3f}"
                            f"{statistics.median(p.ttfts):>9.2f}{p.ttft_fraction:>9.3f}{ratio:>9.2f}{ttft_ratio:>9.2f}"
                        )
                        if peer and side != "vllm":
                            result.append(f"{model}_{dtype}_c{c}_{side}_over_vllm={ratio:.2f}")
                        result.append(f"{model}_{dtype}_c{c}_{side}_roofline={p.fraction:.3f}")
    print(f"\nCPU: {cpu_kind()}; {args.threads} thread(s); load at the end {os.getloadavg()[0]:.1f}")
    print(f"{'model':<8}{'dtype':<10}{'C':>4}  {'side':<8}{'tok/s':>9}{'of roof':>9}{'ttft s':>9}"
          f"{'wave/rf':>9}{'x vLLM':>9}{'ttft x':>9}")  # fmt: skip
    print("\n".join(rows))
    print("(x vLLM: tokens/s over vLLM's; ttft x: vLLM's median time to first token over this side's)")
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
