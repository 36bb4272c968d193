"""Workflows in a child process (``rollout.episode_process``), against one of our servers: the same
trajectories as in-process workflows, pauses for weight updates reach the child's generations,
workflow errors and a killed child surface as errors instead of hangs."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import threading
import time

import pytest
import torch

from areal_lite.api.config import InferenceEngineConfig, LocalEngineConfig
from areal_lite.api.io import WeightUpdateMeta
from areal_lite.core import RolloutController, WorkflowError
from areal_lite.core.episode_worker import EpisodeWorker
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.remote.sglang import RemoteSGLangEngine
from areal_lite.utils.tiny import build_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from episode_workflows import Continue, HoldsALock, SignalsProgress, all_exist
from inference_servers import perturbed_copy, running_on, start_servers, stop_servers

LONG = 8000
"""Tokens of a generation that runs for seconds (about 11 s on one thread here)."""


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(
        str(tmp_path_factory.mktemp("episodes") / "m"), hidden_size=32, num_layers=2, vocab_size=260,
        max_position_embeddings=LONG + 64,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(model_path: str):
    procs, addresses = start_servers(model_path, 1)
    yield addresses[0]
    stop_servers(procs)


def controller(address: str, episode_process: bool) -> RolloutController:
    """What `make_rollout_controller` builds for servers: the child's engine generates, the trainer's controls."""
    config = InferenceEngineConfig(
        addresses=[address],
        episode_process=episode_process,
        consumer_batch_size=4,
        request_timeout=60,
        setup_timeout=60,
    )
    follower = functools.partial(RemoteSGLangEngine, config, control_servers=False)
    c = RolloutController(RemoteSGLangEngine(config), config, follower)
    c.initialize()
    return c


def items(n: int, **extra: object) -> list[dict[str, object]]:
    return [{"prompt": [7, 30 + i], **extra} for i in range(n)]


def test_child_workflows_give_the_in_process_trajectories(server: str) -> None:
    here, child = controller(server, False), controller(server, True)
    try:
        assert child.episode_worker_pid not in (None, os.getpid())
        a = here.rollout_batch(items(6), Continue(12))
        b = child.rollout_batch(items(6), Continue(12))
        assert a.batch_size == b.batch_size == torch.Size([6])
        assert set(a.keys()) == set(b.keys())
        for key in ("input_ids", "attention_mask", "loss_mask", "versions", "rewards"):
            assert torch.equal(a[key], b[key]), key
        torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-5, rtol=0)
    finally:
        here.destroy()
        child.destroy()


def test_a_weight_update_pauses_the_child_generations_and_tags_versions(server: str, model_path: str, tmp_path) -> None:
    """The trainer's pause holds the generations it aborts in the child (the server stays idle
    until the resume); after the update they resume, their new tokens tagged with the new version."""
    perturbed_copy(model_path, str(tmp_path / "v1"))
    e = controller(server, True)
    try:
        e.engine.update_weights(WeightUpdateMeta(type="disk", path=model_path, version=0)).result()
        e.set_version(0)
        out: dict[str, object] = {}
        markers = [str(tmp_path / f"started{i}") for i in range(3)]
        episodes = [{**item, "marker": m} for item, m in zip(items(3), markers)]
        run = threading.Thread(target=lambda: out.update(batch=e.rollout_batch(episodes, SignalsProgress(8, 492))))
        run.start()
        deadline = time.monotonic() + 60
        while not all_exist(markers):  # every episode has produced tokens at version 0
            assert time.monotonic() < deadline, "the child's generations never produced tokens"
            time.sleep(0.01)
        e.pause()
        time.sleep(0.3)  # aborted answers are back in the child by now
        idle_while_paused = not asyncio.run(running_on(server))
        e.engine.update_weights(WeightUpdateMeta(type="disk", path=str(tmp_path / "v1"), version=1)).result()
        e.set_version(1)
        e.resume()
        run.join(timeout=120)
        assert not run.is_alive()
        assert idle_while_paused
        batch, resumed = out["batch"], 0
        for row in range(3):
            versions = batch["versions"][row][batch["loss_mask"][row].bool()].tolist()
            assert len(versions) == 500 and versions[0] == 0 and versions == sorted(versions), versions
            resumed += versions[-1] == 1
        # A generation may end before the pause reaches the child (a 32-wide model under load);
        # the others were held through the update and resumed on the new weights.
        assert resumed >= 1, "no generation was held by the pause: the test proved nothing"
    finally:
        e.destroy()


def test_workflow_errors_and_unpicklable_workflows_are_reported(server: str) -> None:
    e = controller(server, True)
    try:
        with pytest.raises(WorkflowError, match=r"ValueError: bad item \[7, 30\]"):
            e.rollout_batch(items(1, fail=True), Continue(4))
        with pytest.raises(WorkflowError, match="HoldsALock does not pickle"):
            e.rollout_batch(items(1), HoldsALock(4))
        assert e.rollout_batch(items(2), Continue(4)).batch_size == torch.Size([2])  # still serving
    finally:
        e.destroy()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_cancelled_episode_is_cancelled_in_the_child(server: str) -> None:
    """Cancelling `run_episode` (the executor does so when it is destroyed) tells the child, whose
    generation then stops on the server; the result the child may still send is dropped without
    crashing the parent's reader thread, and later episodes run. Closed, the child exits at once."""
    config = InferenceEngineConfig(addresses=[server], request_timeout=60, setup_timeout=60)
    worker = EpisodeWorker(config, functools.partial(RemoteSGLangEngine, config, control_servers=False))

    async def go() -> None:
        task = asyncio.ensure_future(worker.run_episode(Continue(LONG), {"prompt": [7, 30]}))
        while not await running_on(server):
            assert not task.done(), "the episode ended before it was seen generating"
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 3  # left alone, the generation would run for seconds more
        while await running_on(server):
            assert time.monotonic() < deadline, "the child went on generating the cancelled episode"
            await asyncio.sleep(0.05)
        later = worker.run_episode(Continue(4), {"prompt": [7, 31]})
        assert (await asyncio.wait_for(later, 60)) is not None, "the episode after the cancelled one"

    try:
        asyncio.run(go())
    finally:
        t0 = time.monotonic()
        worker.close()
    # told to stop, the child destroys its engine and exits by itself, not killed after a timeout
    assert worker._proc.exitcode == 0 and time.monotonic() - t0 < 5, (worker._proc.exitcode, time.monotonic() - t0)


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_killed_child_fails_rollouts_instead_of_hanging(server: str) -> None:
    e = controller(server, True)
    try:
        pid = e.episode_worker_pid
        assert pid is not None

        def kill_when_running() -> None:
            while not asyncio.run(running_on(server)):
                time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_running)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(WorkflowError, match="episode worker process died"):
            e.rollout_batch(items(4), Continue(300))
        killer.join()
        assert time.monotonic() - t0 < 60
        with pytest.raises(WorkflowError, match="episode worker process died"):
            e.rollout_batch(items(1), Continue(4))
    finally:
        e.destroy()


def test_the_embedded_engine_refuses_episode_processes() -> None:
    with pytest.raises(ValueError, match="episode_process"):
        RolloutController(
            LocalInferenceEngine(LocalEngineConfig(path="unused")), InferenceEngineConfig(episode_process=True)
        )
