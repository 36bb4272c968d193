"""`RemoteVLLMEngine` against two real vLLM servers (vLLM's CPU build without a GPU), started once
for the module with the launcher's own command line (tests/scripts/vllm_servers.py). Marked
``vllm``: `make test-vllm` builds vLLM's venv and runs them.

Generation with versions, log-probabilities equal to a HF forward, samples of one prompt, stop
tokens; generations aborted by a weight update in their middle and resumed on the new weights;
disk and chunked broadcast updates from FSDP trainers of 1 and 2 ranks; an update that does not fit
the served model failing its trainer within seconds with the server's error while the servers keep
their weights; a server killed mid-run (last: it takes one server down)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.io import GenerationConfig, ModelRequest, WeightUpdateMeta
from areal_lite.engines.remote.vllm import RemoteVLLMEngine
from areal_lite.utils.tiny import build_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from inference_servers import perturbed_copy
from test_fsdp import torchrun
from vllm_servers import TINY, generating_on, start_vllm_servers, stop_vllm_servers, tiny_vllm_model

pytestmark = pytest.mark.vllm

SCRIPTS = Path(__file__).parent / "scripts"
LONG = 3000
"""Tokens of each generation that a test interrupts: vLLM decodes this model at about 2000 tokens/s
on one thread, so 4 requests of 400 tokens could end on a server before a poll saw them running
(that failed CI once); 4 x 3000 take seconds."""
CONTEXT = 4096


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("vllm") / "m")
    return tiny_vllm_model(path, CONTEXT)


@pytest.fixture(scope="module")
def servers(model_path: str, tmp_path_factory: pytest.TempPathFactory):
    procs, addresses = start_vllm_servers(model_path, 2, str(tmp_path_factory.mktemp("vllm_logs")), CONTEXT)
    try:
        yield procs, addresses
    finally:
        stop_vllm_servers(procs)


@pytest.fixture(scope="module")
def model(model_path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_path).eval()


def client(addresses: list[str], model_path: str) -> RemoteVLLMEngine:
    """A client of the servers, which it first puts back on ``model_path``'s weights (version 0)."""
    engine = RemoteVLLMEngine(InferenceEngineConfig(addresses=addresses, request_timeout=120, setup_timeout=120))
    engine.initialize()
    engine.update_weights(WeightUpdateMeta(type="disk", path=model_path, version=0)).result()
    return engine


def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0, :-1]
    return logp.gather(1, ids[0, 1:, None])[len(prompt) - 1 :, 0]


def assert_scored_by(model: torch.nn.Module, req: ModelRequest, resp, start: int = 0, end: int | None = None) -> None:
    lp = torch.tensor(resp.output_logprobs)[start:end]
    hf = hf_logprobs(model, req.input_ids, resp.output_tokens)[start:end]
    torch.testing.assert_close(lp, hf, atol=1e-4, rtol=0)


def generate(engine: RemoteVLLMEngine, reqs: list[ModelRequest]):
    async def run():
        return await asyncio.gather(*[engine.agenerate(r) for r in reqs])

    return asyncio.run(run())


def test_generation_versions_logprobs_samples_and_stop_tokens(servers, model_path: str, model) -> None:
    _, addresses = servers
    engine = client(addresses, model_path)
    try:
        reqs = [
            ModelRequest(input_ids=[3 + i, 50, 7 + i], gconfig=GenerationConfig(max_new_tokens=5 + i, ignore_eos=True))
            for i in range(8)
        ]
        for req, resp in zip(reqs, generate(engine, reqs)):
            assert resp.output_len == req.gconfig.max_new_tokens and resp.stop_reason == "length"
            assert resp.output_versions == [0] * resp.output_len
            assert_scored_by(model, req, resp)
        assert {engine.fleet.assigned_server(r.rid) for r in reqs} == set(addresses)

        # A GRPO group: one batch call for 4 samples of one prompt, each scored right.
        group = [ModelRequest(input_ids=[8, 9, 10], gconfig=GenerationConfig(max_new_tokens=12)) for _ in range(4)]
        samples = asyncio.run(engine.agenerate_batch(group))
        assert len({tuple(s.output_tokens) for s in samples}) > 1, "4 samples at temperature 1 all alike"
        for req, resp in zip(group, samples):
            assert_scored_by(model, req, resp)

        greedy = GenerationConfig(max_new_tokens=10, greedy=True, ignore_eos=True)
        free = generate(engine, [ModelRequest(input_ids=[5, 17, 30], gconfig=greedy)])[0]
        stop = free.output_tokens[3]
        first = free.output_tokens.index(stop)
        stopped = generate(engine, [ModelRequest(input_ids=[5, 17, 30], gconfig=greedy.new(stop_token_ids=[stop]))])[0]
        assert stopped.output_tokens == free.output_tokens[: first + 1] and stopped.stop_reason == "stop"

        # The config's penalties and min-p reach vLLM: greedy with a repetition penalty decodes as
        # HF generate does with it, and the log-probabilities stay the model's own.
        req = ModelRequest(input_ids=[5, 17, 30], gconfig=greedy.new(repetition_penalty=1.8, min_p=0.1))
        shaped = generate(engine, [req])[0]
        expected = model.generate(
            torch.tensor([req.input_ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False, repetition_penalty=1.8
        )[0, 3:]
        assert shaped.output_tokens == expected.tolist() != free.output_tokens
        assert_scored_by(model, req, shaped)

        # vLLM refuses prompt + max_tokens past max_model_len; the client asks for what fits.
        assert engine.context_len == CONTEXT
        near = ModelRequest(input_ids=[5] * (CONTEXT - 4), gconfig=GenerationConfig(max_new_tokens=50, ignore_eos=True))
        end = generate(engine, [near])[0]
        assert (end.output_len, end.stop_reason) == (4, "length")
    finally:
        engine.destroy()


def test_generations_aborted_by_an_update_resume_on_the_new_weights(servers, model_path: str, model, tmp_path) -> None:
    """A disk update while 4 long generations run on each server: vLLM aborts them (``/pause``),
    loads, resumes; each ends with tokens of version 0 then 1, each scored by its model."""
    _, addresses = servers
    engine = client(addresses, model_path)
    new_model = perturbed_copy(model_path, str(tmp_path / "v1"))
    n = LONG
    try:
        reqs = [
            ModelRequest(input_ids=[9, 10 + i], gconfig=GenerationConfig(max_new_tokens=n, ignore_eos=True))
            for i in range(8)
        ]

        async def update_mid_generation():
            tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in reqs]
            await asyncio.gather(*[generating_on(a) for a in addresses])
            update = engine.update_weights(WeightUpdateMeta(type="disk", path=str(tmp_path / "v1"), version=1))
            await asyncio.wrap_future(update)
            return await asyncio.gather(*tasks)

        resumed = 0
        for req, resp in zip(reqs, asyncio.run(update_mid_generation())):
            assert resp.output_len == n and len(resp.output_logprobs) == n
            switch = resp.output_versions.index(1) if 1 in resp.output_versions else n
            assert resp.output_versions == [0] * switch + [1] * (n - switch)
            assert_scored_by(model, req, resp, end=switch)
            assert_scored_by(new_model, req, resp, start=switch)
            resumed += 0 < switch < n
        assert resumed >= 2, "no generation was interrupted by the update"
        assert engine.get_version() == 1
    finally:
        engine.destroy()


@pytest.mark.parametrize("mode", ["disk", "distributed"])
def test_update_that_does_not_fit_fails_the_trainer_within_seconds_and_the_servers_keep_their_weights(
    servers, model_path: str, model, tmp_path, mode: str
) -> None:
    """The trainer's model has a wider MLP than the served one: every server refuses the update
    (disk: the directory; distributed: the first chunk that does not fit, received to its end), the
    trainer fails within 10 s with that server's error, and the servers keep serving the previous
    weights, exactly."""
    _, addresses = servers
    engine = client(addresses, model_path)
    try:
        wide = build_tiny_model(str(tmp_path / "wide"), **TINY, intermediate_size=640)  # type: ignore[arg-type]
        cmd = [
            sys.executable,
            str(SCRIPTS / "failing_update_trainer.py"),
            wide,
            ",".join(addresses),
            str(tmp_path),
            mode,
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False
        )
        assert proc.returncode != 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        failed = json.loads((tmp_path / "failed.json").read_text())
        assert failed["seconds"] < 10, failed
        assert any(a in failed["error"] for a in addresses), failed["error"]
        assert "has shape [640, 128], the served model's is [512, 128]" in failed["error"]
        assert "previous weights stay" in failed["error"]
        reqs = [ModelRequest(input_ids=[4, 6 + i], gconfig=GenerationConfig(max_new_tokens=8)) for i in range(8)]
        for req, resp in zip(reqs, generate(engine, reqs)):
            assert_scored_by(model, req, resp)
        assert {engine.fleet.assigned_server(r.rid) for r in reqs} == set(addresses)
    finally:
        engine.destroy()


@pytest.mark.parametrize("nproc", [1, 2])
def test_disk_and_chunked_broadcast_updates_from_fsdp_trainers(servers, model_path: str, tmp_path, nproc: int) -> None:
    """An FSDP trainer of ``nproc`` ranks trains a step and updates both servers by disk, then
    trains again and updates them by gloo broadcast in 64 KiB chunks (a layer's tensors arrive in
    several calls); after each, fresh generations carry the new version and the servers'
    log-probabilities equal the trainer's own forward."""
    _, addresses = servers
    client(addresses, model_path).destroy()
    code, output = torchrun(nproc, SCRIPTS / "inference_trainer.py", model_path, ",".join(addresses), str(tmp_path),
                            "vllm")  # fmt: skip
    assert code == 0, output[-6000:]
    report = json.loads((tmp_path / "trainer.json").read_text())
    assert report["before"]["versions"] == [0] and report["before"]["max_err"] < 1e-4
    assert report["disk"]["versions"] == [1] and report["disk"]["max_err"] < 1e-4
    assert report["broadcast"]["versions"] == [2] and report["broadcast"]["max_err"] < 1e-4


def test_server_killed_mid_run_loses_no_request(servers, model_path: str, model) -> None:
    """Runs last: it kills the first server (its whole process group, vLLM's engine core too)
    while it holds requests (paused in place); they finish on the other, each token scored right,
    and the training loop's control calls go on without it."""
    procs, addresses = servers
    engine = client(addresses, model_path)
    n = LONG
    try:
        reqs = [
            ModelRequest(input_ids=[4, 5 + i], gconfig=GenerationConfig(max_new_tokens=n, ignore_eos=True))
            for i in range(8)
        ]

        async def scenario():
            tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in reqs[:4]]
            group = asyncio.ensure_future(engine.agenerate_batch(reqs[4:]))
            await asyncio.gather(*[generating_on(a) for a in addresses])
            async with aiohttp.ClientSession() as s, s.post(f"http://{addresses[0]}/pause?mode=keep") as r:
                assert r.status == 200, await r.text()
            # A request may finish on the first server before the pause lands (a tiny model is
            # fast); those that had not are the ones the kill must not lose.
            held = {r.rid for r, t in zip(reqs, tasks) if not t.done()}
            on_first = {r.rid for r in reqs if engine.fleet.assigned_server(r.rid) == addresses[0]}
            os.killpg(procs[0].pid, signal.SIGKILL)
            return await asyncio.gather(*tasks) + await group, held & on_first

        results, moved = asyncio.run(scenario())
        assert sorted(r.rid for r in results) == sorted(r.rid for r in reqs)
        for req, resp in zip(reqs, results):
            assert resp.output_len == n and resp.output_versions == [0] * n
            assert_scored_by(model, req, resp)
        assert moved, "no request was held by the killed server: the test proved nothing"
        assert {engine.fleet.assigned_server(rid) for rid in moved} == {addresses[1]}
        engine.pause()
        engine.update_weights(WeightUpdateMeta(type="disk", path=model_path, version=3)).result()
        engine.set_version(3)
        engine.resume()
        after = generate(engine, [ModelRequest(input_ids=[4], gconfig=GenerationConfig(max_new_tokens=3))])[0]
        assert after.output_versions == [3] * after.output_len
    finally:
        engine.destroy()
