"""Start and stop real vLLM servers for the tests marked ``vllm``, with the launcher's own command
line (`areal_lite.launcher.commands.vllm_server_command`: vLLM's venv, our worker extension on its
PYTHONPATH, vLLM's CPU settings without a GPU), each on a free loopback port with one thread.
Servers start together (a start-up takes 70-170 s on 2 cores) and are stopped by process group,
so vLLM's engine-core child goes too."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time

import aiohttp

from areal_lite.api.config import RecoverConfig
from areal_lite.api.experiment_config import LauncherConfig
from areal_lite.launcher.commands import vllm_python, vllm_server_command
from areal_lite.launcher.plan import LaunchPlan
from areal_lite.launcher.processes import is_healthy, spawn, stop
from areal_lite.utils.distributed import find_free_port
from areal_lite.utils.tiny import build_tiny_model

STARTUP_TIMEOUT_S = 600.0
TINY = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 260}
"""A tiny model vLLM serves: head size 32 (vLLM's CPU attention takes 32, 64, 80, 96, 112, 128 and
more, not our usual 8)."""


def tiny_vllm_model(path: str, context: int) -> str:
    """Build `TINY` at ``path`` with a context of ``context`` tokens; returns the path."""
    return build_tiny_model(path, **TINY, max_position_embeddings=context)  # type: ignore[arg-type]


def start_vllm_servers(
    model_path: str, n: int, log_dir: str, max_model_len: int = 512, extra_args: list[str] | None = None
) -> tuple[list[subprocess.Popen], list[str]]:
    """Start ``n`` vLLM servers on ``model_path`` (with ``extra_args`` on their command lines) and
    wait until each answers /health (their output goes to ``log_dir/vllm<i>.log``). Returns
    (processes, host:port list)."""
    launcher = LauncherConfig(backend="vllm", server_args=["--max-model-len", str(max_model_len), *(extra_args or [])])
    python = vllm_python(launcher)
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        raise RuntimeError(
            f"no vLLM in {python} ({probe.stderr.strip()[-300:]}): run `make test-vllm`, which builds .venv-vllm, "
            "or set AREAL_LITE_VLLM_PYTHON to a Python with vLLM"
        )
    plan = LaunchPlan("-", None, [], launcher, RecoverConfig(), model_path, log_dir)
    os.makedirs(log_dir, exist_ok=True)
    procs: list[subprocess.Popen] = []
    addresses: list[str] = []
    logs: list[str] = []
    try:
        for i in range(n):
            port = find_free_port()
            logs.append(os.path.join(log_dir, f"vllm{i}.log"))
            cmd = vllm_server_command(plan, port, base_gpu_id=i, host="127.0.0.1")
            procs.append(spawn(cmd, cores=[], env={**os.environ, "OMP_NUM_THREADS": "1"}, log_path=logs[-1]))
            addresses.append(f"127.0.0.1:{port}")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        pending = set(range(n))
        while pending:
            for i in sorted(pending):
                if procs[i].poll() is not None:
                    with open(logs[i], errors="replace") as f:
                        raise RuntimeError(f"vLLM server {addresses[i]} exited; its log ends:\n{f.read()[-4000:]}")
                if is_healthy(addresses[i]):
                    pending.discard(i)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"vLLM servers {[addresses[i] for i in pending]} not healthy in {STARTUP_TIMEOUT_S} s"
                )
            time.sleep(0.5)
    except BaseException:
        stop(procs, grace=5.0)
        raise
    return procs, addresses


def stop_vllm_servers(procs: list[subprocess.Popen]) -> None:
    stop(procs, grace=10.0)


async def metrics(address: str, *names: str) -> list[float]:
    """vLLM's Prometheus metrics from one scrape of ``/metrics``, each summed over its label sets
    (``vllm:num_requests_running``)."""
    async with aiohttp.ClientSession() as s, s.get(f"http://{address}/metrics") as r:
        text = await r.text()
    return [
        sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))
        for name in names
    ]


async def generating_on(address: str, timeout: float = 120.0) -> None:
    """Wait until ``address`` runs requests that have produced tokens since the call. The tiny
    test model decodes about 2000 tokens/s on one thread: give each request thousands of tokens,
    or they may end before a poll sees them."""
    deadline = time.monotonic() + timeout
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total")
    running, waiting, start = await metrics(address, *names)
    tokens = start
    while time.monotonic() < deadline:
        running, waiting, tokens = await metrics(address, *names)
        if running > 0 and tokens > start:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(
        f"{address} ran no generation in {timeout} s (last seen: {running:.0f} requests running, "
        f"{waiting:.0f} waiting, {tokens - start:.0f} tokens generated since the call)"
    )
