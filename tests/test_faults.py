"""Faults on the rollout side, with our real servers on 127.0.0.1: a server that hangs (SIGSTOP) is
set aside from generations, pauses and weight updates after a bounded time, reported in one line,
and rejoins with the current weights and version when it answers again (SIGCONT); while no server
is left, generations wait for one and say so."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
import urllib.request

import pytest

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.io import GenerationConfig, ModelRequest, WeightUpdateMeta
from areal_lite.engines.remote.sglang import RemoteSGLangEngine
from areal_lite.utils.tiny import build_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from inference_servers import perturbed_copy, start_servers, stop_servers

CONTROL_TIMEOUT = 5.0  # not less: a busy server on a loaded 2-core machine must still pass its checks


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("faults") / "m"), hidden_size=32, num_layers=2, vocab_size=260)


@pytest.fixture(scope="module")
def servers(model_path: str):
    """Two of our servers, shared by the tests (each start costs seconds); a test that stops one
    lets it go on before it ends."""
    procs, addresses = start_servers(model_path, 2)
    yield procs, addresses
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
    stop_servers(procs)


def get(address: str, path: str) -> dict:
    import json

    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as r:
        return json.loads(r.read())


def first_weights(address: str) -> list[float]:
    import json

    body = json.dumps({"name": "lm_head.weight", "truncate_size": 4}).encode()
    req = urllib.request.Request(
        f"http://{address}/get_weights_by_name", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def generate(engine: RemoteSGLangEngine, n: int, tokens: int = 8) -> list:
    g = GenerationConfig(max_new_tokens=tokens, temperature=1.0, ignore_eos=True)

    async def go() -> list:
        return await asyncio.gather(
            *(engine.agenerate(ModelRequest(input_ids=[1, 2, 3 + i], gconfig=g)) for i in range(n))
        )

    return asyncio.run(go())


def wait_until(condition, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.mark.parametrize(
    ("control_timeout", "request_timeout"),
    [(CONTROL_TIMEOUT, 3600.0), (2 * CONTROL_TIMEOUT, 4.0)],
    ids=["default-request-timeout", "request-timeout-below-control-timeout"],
)
def test_a_hung_server_is_set_aside_then_rejoins_with_the_current_weights(
    servers, model_path: str, tmp_path, caplog, control_timeout: float, request_timeout: float
) -> None:
    """Also with a request timeout below the control timeout (issue 53: 15 s and 30 s), where the
    pause used to fail with a message-less TimeoutError at the request timeout, before the health
    watch set the hung server aside: the pause sets it aside itself and goes on."""
    procs, addresses = servers
    config = InferenceEngineConfig(
        addresses=addresses, setup_timeout=60, control_timeout=control_timeout, request_timeout=request_timeout
    )
    engine = RemoteSGLangEngine(config)
    caplog.set_level(logging.WARNING, logger="areal_lite.engines")
    try:
        engine.initialize()
        assert len(generate(engine, 4)) == 4
        new_dir = str(tmp_path / "v1")
        perturbed_copy(model_path, new_dir, seed=round(request_timeout))  # unlike what the servers hold
        before = first_weights(addresses[1])

        procs[1].send_signal(signal.SIGSTOP)
        # Generations in flight on the hung server go elsewhere once it is set aside.
        results: list = []
        worker = threading.Thread(target=lambda: results.extend(generate(engine, 8, tokens=16)))
        worker.start()
        t0 = time.monotonic()
        engine.pause()  # its pause waits on the hung server until the monitor sets it aside
        engine.update_weights(WeightUpdateMeta(type="disk", path=new_dir, version=1)).result()
        engine.set_version(1)
        engine.resume()
        took = time.monotonic() - t0
        assert took < 4 * control_timeout + 5, f"the weight update waited {took:.1f}s on the hung server"
        worker.join(timeout=60)
        assert len(results) == 8 and all(len(r.output_tokens) == 16 for r in results)
        assert engine.fleet.live() == [0]
        set_aside = [
            r.getMessage() for r in caplog.records if "gets no requests, pauses or weight updates" in r.getMessage()
        ]
        assert len(set_aside) == 1 and addresses[1] in set_aside[0] and "unresponsive" in set_aside[0]
        retried = [r.getMessage() for r in caplog.records if "retrying elsewhere" in r.getMessage()]
        assert not any("Error: )" in m for m in retried), f"a failure without its cause: {retried}"
        assert first_weights(addresses[0]) != before

        procs[1].send_signal(signal.SIGCONT)
        wait_until(lambda: engine.fleet.live() == [0, 1], 30, "the server rejoining")
        assert get(addresses[1], "/model_info")["weight_version"] == "1"
        assert first_weights(addresses[1]) == first_weights(addresses[0]), "it rejoined with the current weights"
        assert any("is back after" in r.getMessage() for r in caplog.records)
        assert len(generate(engine, 4)) == 4
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
        engine.destroy()


def test_generations_wait_for_the_only_server_and_say_so(servers, caplog, monkeypatch) -> None:
    """The only server hangs for a while: the generations in flight wait for it (a line is said
    while waiting), then finish on it once it answers again."""
    from areal_lite.engines.remote import fleet as server_fleet

    monkeypatch.setattr(server_fleet, "WAITING_LINE_SECONDS", 1.0)
    procs, addresses = servers[0][:1], servers[1][:1]
    config = InferenceEngineConfig(addresses=addresses, setup_timeout=60, control_timeout=CONTROL_TIMEOUT)
    engine = RemoteSGLangEngine(config)
    caplog.set_level(logging.WARNING, logger="areal_lite.engines")
    try:
        engine.initialize()
        results: list = []
        procs[0].send_signal(signal.SIGSTOP)
        worker = threading.Thread(target=lambda: results.extend(generate(engine, 4, tokens=8)))
        worker.start()
        wait_until(lambda: engine.fleet.live() == [], 4 * CONTROL_TIMEOUT + 5, "the hung server set aside")
        wait_until(
            lambda: any("no rollout server is available" in r.getMessage() for r in caplog.records), 10, "a line"
        )
        procs[0].send_signal(signal.SIGCONT)
        worker.join(timeout=60)
        assert len(results) == 4 and engine.fleet.live() == [0]
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
        engine.destroy()


def test_a_restart_before_the_first_checkpoint_gives_the_servers_the_initial_weights(tmp_path, monkeypatch) -> None:
    """The servers outlive a failed trainer and keep the weights and version it pushed to them; a
    restart that finds no recover checkpoint pushes its initial ones (version 0) before it trains."""
    from areal_lite.api.experiment_config import RLExperimentConfig
    from areal_lite.kit import RunKit
    from areal_lite.utils.recover import ATTEMPT_ENV

    calls: list[tuple[str, object]] = []

    class Engine:
        def get_version(self) -> int:
            return 0

        def set_version(self, v: int) -> None:
            calls.append(("engine.set_version", v))

        def update_weights(self, meta: WeightUpdateMeta) -> None:
            calls.append(("engine.update_weights", meta.type))

    class Rollout:
        def pause(self) -> None:
            calls.append(("rollout.pause", None))

        def set_version(self, v: int) -> None:
            calls.append(("rollout.set_version", v))

        def resume(self) -> None:
            calls.append(("rollout.resume", None))

    cfg = RLExperimentConfig()
    cfg.cluster.fileroot = str(tmp_path)
    cfg.recover.mode = "auto"
    cfg.stats_logger.wandb_mode = "disabled"
    cfg.total_train_steps = 3

    def start(attempt: str) -> list[tuple[str, object]]:
        calls.clear()
        monkeypatch.setenv(ATTEMPT_ENV, attempt)
        meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "w"))
        run = RunKit(cfg, Engine(), [[{}]], rollout=Rollout(), weight_meta=meta)  # type: ignore[arg-type]
        assert run.resume() is None and run.start_step == 0
        return list(calls)

    assert start("0") == [], "a first start leaves the servers as the launcher started them"
    assert start("1") == [
        ("rollout.pause", None),
        ("engine.set_version", 0),
        ("engine.update_weights", "disk"),
        ("rollout.set_version", 0),
        ("rollout.resume", None),
    ]


def test_a_hung_server_rejoins_distributed_updates_with_the_next_group(
    servers, model_path: str, tmp_path, caplog
) -> None:
    """With broadcast updates a returning server cannot load the last update from disk: it waits,
    saying so, and the next update forms a group with it again, so that it gets those weights."""
    from dataclasses import replace

    from areal_lite.api.io import ParamSpec
    from areal_lite.utils.distributed import find_free_port, init_custom_process_group

    procs, addresses = servers
    config = InferenceEngineConfig(addresses=addresses, setup_timeout=60, control_timeout=CONTROL_TIMEOUT)
    engine = RemoteSGLangEngine(config)
    caplog.set_level(logging.WARNING, logger="areal_lite.engines")
    meta = WeightUpdateMeta(type="distributed", backend="gloo")

    def form_group():
        meta.master_port = find_free_port()
        joined = engine.init_weights_update_group(meta)
        group = init_custom_process_group(
            "gloo", meta.master_address, meta.master_port, 0, meta.world_size, meta.group_name, timeout=60
        )
        joined.result(timeout=60)
        return group

    def broadcast(group, version: int) -> None:
        new = perturbed_copy(model_path, str(tmp_path / f"v{version}"))
        state = {n: p.detach().clone() for n, p in new.named_parameters()}
        specs = [ParamSpec(n, tuple(t.shape), "float32") for n, t in state.items()]
        engine.pause()
        loaded = engine.update_weights(replace(meta, param_specs=specs, version=version))
        for t in state.values():
            group.broadcast(t)
        loaded.result(timeout=60)
        engine.set_version(version)
        engine.resume()

    try:
        engine.initialize()
        form_group()
        assert meta.world_size == 3
        procs[1].send_signal(signal.SIGSTOP)
        wait_until(lambda: engine.fleet.live() == [0], 4 * CONTROL_TIMEOUT + 5, "the hung server set aside")
        assert not engine.weight_update_group_intact()
        broadcast(form_group(), 1)
        assert meta.world_size == 2

        procs[1].send_signal(signal.SIGCONT)
        wait_until(lambda: any("rejoins with the next weight update" in r.getMessage() for r in caplog.records), 30, "")
        assert engine.fleet.live() == [0] and engine.fleet.returning() == [1], "not with version 0's weights"
        assert not engine.weight_update_group_intact()
        broadcast(form_group(), 2)
        assert meta.world_size == 3 and engine.fleet.live() == [0, 1]
        assert [get(a, "/model_info")["weight_version"] for a in addresses] == ["2", "2"]
        assert first_weights(addresses[1]) == first_weights(addresses[0])
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
        engine.destroy()
