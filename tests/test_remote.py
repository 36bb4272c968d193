"""The clients of generation servers, each against two of our servers on 127.0.0.1 (which speak
both protocols): `RemoteSGLangEngine` and `RemoteVLLMEngine` pass the same tests. Log-probabilities
equal to HF's, routing, weight updates from a 2-rank torchrun FSDPEngine trainer (disk and gloo
broadcast; with SGLang's protocol also LoRA adapter updates), an update in the middle of long generations, a server killed mid-run, and the
weight-update group formed again without a dead server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.io import GenerationConfig, ModelRequest, ParamSpec, WeightUpdateMeta
from areal_lite.engines.remote.client import RemoteEngine
from areal_lite.engines.remote.sglang import RemoteSGLangEngine
from areal_lite.engines.remote.vllm import RemoteVLLMEngine
from areal_lite.utils.distributed import CustomGroup, find_free_port, init_custom_process_group
from areal_lite.utils.tiny import build_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from inference_servers import perturbed_copy, running_on, start_servers, stop_servers
from test_fsdp import torchrun

TRAINER = Path(__file__).parent / "scripts" / "inference_trainer.py"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("remote") / "m"), hidden_size=32, num_layers=2, vocab_size=260)


CLIENTS = {"sglang": RemoteSGLangEngine, "vllm": RemoteVLLMEngine}


@pytest.fixture(scope="module", params=sorted(CLIENTS))
def kind(request: pytest.FixtureRequest) -> str:
    """The protocol under test; the module's tests run for one, then for the other."""
    return request.param


@pytest.fixture(scope="module")
def servers(model_path: str, kind: str):
    """Two servers shared by one protocol's tests (starting one costs seconds); tests reset their
    weights, and the test that kills one runs last."""
    procs, addresses = start_servers(model_path, 2)
    yield procs, addresses
    stop_servers(procs)


def reset_weights(engine: RemoteEngine, model_path: str) -> None:
    engine.update_weights(WeightUpdateMeta(type="disk", path=model_path, version=0)).result()


def client(addresses: list[str], kind: str, request_timeout: float = 60) -> RemoteEngine:
    config = InferenceEngineConfig(addresses=addresses, request_timeout=request_timeout, setup_timeout=60)
    engine = CLIENTS[kind](config)
    engine.initialize()
    return engine


def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0, :-1]
    return logp.gather(1, ids[0, 1:, None])[len(prompt) - 1 :, 0]


async def probe(address: str) -> None:
    """A one-token request: admitted after everything queued before it (FIFO)."""
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
    async with aiohttp.ClientSession() as s, s.post(f"http://{address}/generate", json=body) as r:
        assert r.status == 200


async def post(address: str, path: str, body: dict) -> int:
    async with aiohttp.ClientSession() as s, s.post(f"http://{address}{path}", json=body) as r:
        return r.status


async def running_on_every_server(addresses: list[str]) -> None:
    for a in addresses:
        while not await running_on(a):
            await asyncio.sleep(0.005)


async def generating_on_every_server(addresses: list[str]) -> None:
    """Wait until every server runs a request, then until those have tokens (a probe queued
    behind them is answered)."""
    await running_on_every_server(addresses)
    await asyncio.gather(*[probe(a) for a in addresses])


def assert_switched_models(req: ModelRequest, resp, model, new_model, n: int) -> None:
    """``n`` tokens, the first from version 0 (scored by ``model``), the rest from version 1."""
    switch = resp.output_versions.index(1)
    assert 0 < switch < n and resp.output_versions == [0] * switch + [1] * (n - switch)
    lp = torch.tensor(resp.output_logprobs)
    torch.testing.assert_close(
        lp[:switch], hf_logprobs(model, req.input_ids, resp.output_tokens)[:switch], atol=1e-4, rtol=0
    )
    torch.testing.assert_close(
        lp[switch:], hf_logprobs(new_model, req.input_ids, resp.output_tokens)[switch:], atol=1e-4, rtol=0
    )


def test_generation_logprobs_routing_and_mid_generation_update(servers, kind: str, model_path: str, tmp_path) -> None:
    _, addresses = servers
    engine = client(addresses, kind)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    try:
        reset_weights(engine, model_path)
        reqs = [
            ModelRequest(input_ids=[3 + i, 50, 7 + i], gconfig=GenerationConfig(max_new_tokens=5 + i, ignore_eos=True))
            for i in range(12)
        ]

        async def first_round():
            return await asyncio.gather(*[engine.agenerate(r) for r in reqs])

        for req, resp in zip(reqs, asyncio.run(first_round())):
            assert resp.output_len == req.gconfig.max_new_tokens and resp.stop_reason == "length"
            assert resp.output_versions == [0] * resp.output_len
            torch.testing.assert_close(
                torch.tensor(resp.output_logprobs),
                hf_logprobs(model, req.input_ids, resp.output_tokens),
                atol=1e-4,
                rtol=0,
            )
        assert {engine.fleet.assigned_server(r.rid) for r in reqs} == set(addresses)  # least loaded spreads them
        again = ModelRequest(input_ids=[1, 2], gconfig=GenerationConfig(max_new_tokens=2), rid=reqs[0].rid)
        asyncio.run(engine.agenerate(again))
        assert engine.fleet.assigned_server(again.rid) == engine.fleet.assigned_server(reqs[0].rid)

        new_model = perturbed_copy(model_path, str(tmp_path / "v1"))
        long = [
            ModelRequest(input_ids=[9, 10 + i], gconfig=GenerationConfig(max_new_tokens=300, ignore_eos=True))
            for i in range(4)
        ]

        async def update_mid_generation():
            tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in long]
            await generating_on_every_server(addresses)
            update = engine.update_weights(WeightUpdateMeta(type="disk", path=str(tmp_path / "v1"), version=1))
            await asyncio.wrap_future(update)
            return await asyncio.gather(*tasks)

        for req, resp in zip(long, asyncio.run(update_mid_generation())):
            assert_switched_models(req, resp, model, new_model, 300)
        assert engine.get_version() == 1
    finally:
        engine.destroy()


def test_generation_past_the_context_ends_there_as_in_the_embedded_engine(servers, kind: str, model_path: str) -> None:
    """Servers refuse prompt + max_new_tokens past the context (a 400 from SGLang and vLLM); the
    client reads the context length once and asks for no more than fits, so a long episode ends
    with ``length`` at the context, alone or in a batch, and a prompt that fills it is an error."""
    _, addresses = servers
    engine = client(addresses, kind)
    try:
        reset_weights(engine, model_path)
        assert engine.context_len == 512  # the tiny model's max_position_embeddings
        g = GenerationConfig(max_new_tokens=50, min_new_tokens=50, ignore_eos=True)
        prompt = [5 + i % 200 for i in range(507)]
        one = asyncio.run(engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g)))
        assert (one.output_len, one.stop_reason) == (5, "length")

        async def group():
            return await engine.agenerate_batch([ModelRequest(input_ids=p, gconfig=g) for p in (prompt, prompt[:-2])])

        assert [(r.output_len, r.stop_reason) for r in asyncio.run(group())] == [(5, "length"), (7, "length")]
        with pytest.raises(ValueError, match="the context length is 512"):
            asyncio.run(engine.agenerate(ModelRequest(input_ids=[5] * 512, gconfig=g)))
    finally:
        engine.destroy()


def test_batch_requests_go_to_one_server_and_resume_across_an_update(
    servers, kind: str, model_path: str, tmp_path
) -> None:
    """agenerate_batch (a GRPO group) sends one batch request; its generations, interrupted by a
    weight update, resume as batch requests again and end with tokens of both versions, each
    scored right."""
    _, addresses = servers
    engine = client(addresses, kind)
    calls = []
    post = engine._post_generate

    async def counted(idx, path, payload, count=1):
        calls.append(count)
        return await post(idx, path, payload, count)

    engine._post_generate = counted
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    new_model = perturbed_copy(model_path, str(tmp_path / "v1"))
    try:
        reset_weights(engine, model_path)
        gconfig = GenerationConfig(max_new_tokens=200, ignore_eos=True)
        groups = [[ModelRequest(input_ids=[6, 20 + g], gconfig=gconfig) for _ in range(4)] for g in range(2)]

        async def update_mid_generation():
            tasks = [asyncio.ensure_future(engine.agenerate_batch(group)) for group in groups]
            await generating_on_every_server(addresses)
            await asyncio.wrap_future(
                engine.update_weights(WeightUpdateMeta(type="disk", path=str(tmp_path / "v1"), version=1))
            )
            return await asyncio.gather(*tasks)

        results = asyncio.run(update_mid_generation())
        servers_used = []
        for group, resps in zip(groups, results):
            assert [r.rid for r in resps] == [r.rid for r in group]
            assert len({engine.fleet.assigned_server(r.rid) for r in group}) == 1  # one batch, one server
            servers_used.append(engine.fleet.assigned_server(group[0].rid))
            for req, resp in zip(group, resps):
                assert resp.stop_reason == "length"
                assert_switched_models(req, resp, model, new_model, 200)
        assert sorted(servers_used) == sorted(addresses)  # the second group went to the idle server
        assert len({tuple(r.output_tokens) for r in results[0]}) > 1  # samples, not copies
        # The samples of a group generate in step, so each group resumes as one batch call.
        assert calls == [4, 4, 4, 4], calls
    finally:
        engine.destroy()


def test_generations_aborted_by_our_pause_wait_for_the_resume(servers, kind: str, model_path: str) -> None:
    """While this client keeps the servers paused, the generations the pause aborted wait in the
    client instead of queueing again on the paused servers (where they would delay the weight
    update); after the resume they run to the end, scored right."""
    _, addresses = servers
    engine = client(addresses, kind)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    try:
        reset_weights(engine, model_path)
        reqs = [
            ModelRequest(input_ids=[5, 30 + i], gconfig=GenerationConfig(max_new_tokens=200, ignore_eos=True))
            for i in range(4)
        ]

        async def pause_mid_generation():
            tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in reqs]
            await generating_on_every_server(addresses)
            await asyncio.to_thread(engine.pause)
            await asyncio.sleep(0.3)  # the aborted answers are back; before the fix they were resent at once
            busy = [await running_on(a) for a in addresses]
            assert not any(t.done() for t in tasks)
            await asyncio.to_thread(engine.resume)
            return busy, await asyncio.gather(*tasks)

        busy, resps = asyncio.run(pause_mid_generation())
        assert busy == [False, False]
        for req, resp in zip(reqs, resps):
            assert resp.output_len == 200 and resp.output_versions == [0] * 200
            lp = hf_logprobs(model, req.input_ids, resp.output_tokens)
            torch.testing.assert_close(torch.tensor(resp.output_logprobs), lp, atol=1e-4, rtol=0)
    finally:
        engine.destroy()


def test_weight_updates_from_torchrun_fsdp_trainer(servers, kind: str, model_path: str, tmp_path) -> None:
    _, addresses = servers
    engine = client(addresses, kind)
    try:
        reset_weights(engine, model_path)
    finally:
        engine.destroy()
    code, output = torchrun(2, TRAINER, model_path, ",".join(addresses), str(tmp_path), kind)
    assert code == 0, output[-6000:]
    report = json.loads((tmp_path / "trainer.json").read_text())
    assert report["before"]["versions"] == [0] and report["before"]["max_err"] < 1e-4
    assert report["disk"]["versions"] == [1] and report["disk"]["max_err"] < 1e-4
    assert report["broadcast"]["versions"] == [2] and report["broadcast"]["max_err"] < 1e-4
    if kind == "sglang":  # a LoRA trainer: the adapter alone reaches the servers, requests name it
        for key, version in (("lora_connect", 0), ("lora_disk", 3), ("lora_broadcast", 4)):
            assert report[key]["versions"] == [version] and report[key]["max_err"] < 1e-5, (key, report[key])


def test_timed_out_request_moves_to_another_server(servers, kind: str, model_path: str) -> None:
    _, addresses = servers
    engine = client(addresses, kind, request_timeout=2.0)

    try:
        reset_weights(engine, model_path)
        # The first server holds every request (paused); the idle client's first pick is the first server.
        assert asyncio.run(post(addresses[0], "/pause_generation", {"mode": "in_place"})) == 200
        req = ModelRequest(input_ids=[3, 4], gconfig=GenerationConfig(max_new_tokens=6, ignore_eos=True))
        resp = asyncio.run(engine.agenerate(req))
        assert resp.output_len == 6 and engine.fleet.assigned_server(req.rid) == addresses[1]

        async def abandoned_request_dropped() -> None:
            # The server drops the request whose client went away: nothing stays queued there.
            for _ in range(3000):
                if not await running_on(addresses[0]):
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("the abandoned request is still queued on the paused server")

        asyncio.run(abandoned_request_dropped())
        assert asyncio.run(post(addresses[0], "/continue_generation", {})) == 200
    finally:
        engine.destroy()


def test_server_killed_mid_run_loses_no_request(servers, kind: str, model_path: str) -> None:
    procs, addresses = servers
    engine = client(addresses, kind)
    try:
        reqs = [
            ModelRequest(input_ids=[4, 5 + i], gconfig=GenerationConfig(max_new_tokens=150, ignore_eos=True))
            for i in range(16)
        ]

        async def scenario():
            # The doomed server holds its requests (paused in place), so none of them can finish
            # there before it dies, however slowly this test polls on a busy machine.
            assert await post(addresses[0], "/pause_generation", {"mode": "in_place"}) == 200
            # Half as single requests, half as two batch requests (GRPO groups of 4).
            tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in reqs[:8]]
            batches = [asyncio.ensure_future(engine.agenerate_batch(reqs[i : i + 4])) for i in (8, 12)]
            await running_on_every_server(addresses)
            procs[0].send_signal(signal.SIGKILL)
            return await asyncio.gather(*tasks) + [r for group in await asyncio.gather(*batches) for r in group]

        results = asyncio.run(scenario())
        assert sorted(r.rid for r in results) == sorted(r.rid for r in reqs)
        assert all(r.output_len == 150 and r.stop_reason == "length" for r in results)
        assert all(len(r.output_logprobs) == len(r.output_versions) == 150 for r in results)
        assert {engine.fleet.assigned_server(r.rid) for r in reqs} == {addresses[1]}  # all finished on the survivor
        # Control calls skip the dead server: the training loop's weight sync carries on.
        engine.pause()
        engine.update_weights(WeightUpdateMeta(type="disk", path=model_path, version=3)).result()
        engine.set_version(3)
        engine.resume()
        after = asyncio.run(
            engine.agenerate(ModelRequest(input_ids=[4], gconfig=GenerationConfig(max_new_tokens=3, ignore_eos=True)))
        )
        assert after.output_versions == [3] * after.output_len
    finally:
        engine.destroy()


def test_weight_update_group_formed_again_without_a_dead_server(kind: str, model_path: str, tmp_path) -> None:
    """Distributed updates after a server died: the client, which has sent nothing since, tells by
    a connection probe that the group lost a member; the group formed again holds the survivor
    only, and a broadcast through it reaches the survivor's model."""
    procs, addresses = start_servers(model_path, 2)  # its own: one of them is killed
    engine = client(addresses, kind)
    try:
        meta = WeightUpdateMeta(type="distributed", backend="gloo")

        def form_group() -> CustomGroup:
            meta.master_port = find_free_port()
            joined = engine.init_weights_update_group(meta)
            group = init_custom_process_group(
                "gloo", meta.master_address, meta.master_port, 0, meta.world_size, meta.group_name, timeout=60
            )
            joined.result(timeout=60)
            return group

        form_group()
        assert meta.world_size == 3 and engine.weight_update_group_intact()
        procs[1].kill()
        procs[1].wait()
        assert not engine.weight_update_group_intact()
        group = form_group()
        assert meta.world_size == 2

        new = perturbed_copy(model_path, str(tmp_path / "new"))
        state = {n: p.detach().clone() for n, p in new.named_parameters()}
        specs = [ParamSpec(n, tuple(t.shape), "float32") for n, t in state.items()]
        loaded = engine.update_weights(replace(meta, param_specs=specs, version=1))
        for t in state.values():
            group.broadcast(t)
        loaded.result(timeout=60)
        req = ModelRequest(input_ids=[3, 4], gconfig=GenerationConfig(max_new_tokens=4, ignore_eos=True))
        resp = asyncio.run(engine.agenerate(req))
        assert engine.fleet.assigned_server(req.rid) == addresses[0] and resp.output_versions == [1] * 4
        lp = hf_logprobs(new, req.input_ids, resp.output_tokens)
        torch.testing.assert_close(torch.tensor(resp.output_logprobs), lp, atol=1e-4, rtol=0)
    finally:
        engine.destroy()
        stop_servers(procs)
