"""Start and stop areal-lite SGLang-protocol servers (``python -m areal_lite.engines.server``) for
tests: each on a free loopback port, one thread each, stopped (and killed if need be) afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import aiohttp
import torch

from areal_lite.utils.distributed import find_free_port


def start_servers(
    model_path: str, n: int, extra_args: list[str] | None = None, timeout: float = 180.0
) -> tuple[list[subprocess.Popen], list[str]]:
    """Start ``n`` servers and wait until each answers /health. Returns (processes, host:port list)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, addresses, logs = [], [], []
    try:
        for _ in range(n):
            port = find_free_port()
            cmd = [
                sys.executable,
                "-m",
                "areal_lite.engines.server",
                "--model-path",
                model_path,
                "--port",
                str(port),
                *(extra_args or []),
            ]
            # A file, not a pipe: nobody reads the log while the server runs.
            log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            logs.append(log)
            addresses.append(f"127.0.0.1:{port}")
        deadline = time.monotonic() + timeout
        for proc, address in zip(procs, addresses):
            while True:
                if proc.poll() is not None:
                    log = logs[procs.index(proc)]
                    log.seek(0)
                    raise RuntimeError(f"server {address} exited: {log.read().decode()[-3000:]}")
                try:
                    with urllib.request.urlopen(f"http://{address}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server {address} did not become healthy")
                time.sleep(0.2)
    except BaseException:
        stop_servers(procs)
        raise
    return procs, addresses


def stop_servers(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def running_on(address: str) -> bool:
    """Whether the server has a request queued or running (flush_cache refuses then)."""
    async with aiohttp.ClientSession() as s, s.post(f"http://{address}/flush_cache") as r:
        return r.status == 400


def perturbed_copy(model_path: str, out: str, seed: int = 0) -> torch.nn.Module:
    """A copy of the model with noise (drawn from ``seed``) added to every weight, saved to ``out``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return model


def with_bos(path: str) -> None:
    """Make the tokenizer at ``path`` start what it encodes with a BOS token (``<|endoftext|>``),
    as Llama's does: a completion's text prompt then counts it (vLLM's ``add_special_tokens``
    defaults to true there, and SGLang encodes text with it), a chat's does not (false there:
    the template writes its own start)."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    bos = "<|endoftext|>"
    template = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.convert_tokens_to_ids(bos))]
    )
    tok.backend_tokenizer.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    tok.bos_token = bos
    tok.save_pretrained(path)
    assert AutoTokenizer.from_pretrained(path).encode("ab")[0] == tok.convert_tokens_to_ids(bos)
