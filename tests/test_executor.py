"""WorkflowExecutor: the staleness bound (as a pure property, and end to end with an engine whose
requests are released by events), dynamic sampling, workflow errors, timeouts, rollout_batch."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from collections import Counter
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.io import ModelRequest, ModelResponse
from areal_lite.api.workflow import RolloutWorkflow
from areal_lite.core import StalenessManager, WorkflowError, WorkflowExecutor
from areal_lite.workflows.trajectory import check_trajectory, from_response


class GatedEngine:
    """A fake inference engine: every request parks until a controller coroutine releases it.

    The controller releases a random parked request, but never the oldest while others are parked,
    so old requests become stragglers, the case the staleness bound is about. It always releases
    something while requests are parked, so nothing deadlocks. No sleeps: it reacts to arrivals.
    The first output token carries the version at the start, the last the version at release
    (as an interrupted-and-resumed generation would).
    """

    def __init__(self, seed: int = 0, spare_oldest: float = 0.9) -> None:
        self.version = 0
        self.rng = random.Random(seed)
        self.spare_oldest = spare_oldest
        self.parked: list[asyncio.Future[None]] = []
        self.running = 0
        self.peak_running = 0
        self.started_at_version: Counter[int] = Counter()
        self.hold: set[int] = set()
        """Request numbers the controller never releases (until `release_held`)."""
        self._held: dict[int, asyncio.Future[None]] = {}
        self._n = 0
        self._changed: asyncio.Event | None = None
        self._controller: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def get_version(self) -> int:
        return self.version

    def set_version(self, v: int) -> None:
        self.version = v

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        if self._controller is None:
            self.loop = asyncio.get_running_loop()
            self._changed = asyncio.Event()
            self._controller = self.loop.create_task(self._control())
        n, self._n = self._n, self._n + 1
        start = self.version
        self.started_at_version[start] += 1
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if n in self.hold:
            self._held[n] = fut
        else:
            self.parked.append(fut)
            self._changed.set()
        try:
            await fut
        finally:
            self.running -= 1
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=[7, 8, 9],
            output_logprobs=[-0.5, -0.25, -1.0],
            output_versions=[start, start, self.version],
            stop_reason="length",
            rid=req.rid,
        )

    async def _control(self) -> None:
        assert self._changed is not None
        while True:
            await self._changed.wait()
            self._changed.clear()
            while self.parked:
                if len(self.parked) == 1 or self.rng.random() > self.spare_oldest:
                    i = 0
                else:
                    i = self.rng.randrange(1, len(self.parked))
                self.parked.pop(i).set_result(None)
                await asyncio.sleep(0)  # a yield, not a delay: lets completions and admissions run

    def release_held(self) -> None:
        def go() -> None:
            for fut in self._held.values():
                fut.set_result(None)
            self._held.clear()

        assert self.loop is not None
        self.loop.call_soon_threadsafe(go)

    def close(self) -> None:
        if self._controller is not None and self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._controller.cancel)


class OneShot(RolloutWorkflow):
    """One request per episode; reward = the item's ``r``; raises on items with ``boom``."""

    async def arun_episode(self, engine, data: dict[str, object]) -> TensorDict | None:
        if data.get("boom"):
            raise ValueError("boom")
        if data.get("reject"):
            return None
        resp = await engine.agenerate(ModelRequest(input_ids=[1, 2, int(data["i"]) % 50 + 3]))
        return from_response(resp, reward=float(data.get("r", 0.0)), item=float(data["i"]))


def make(engine, **cfg) -> WorkflowExecutor:
    """An executor running workflows over ``engine`` in this process (as the controller does)."""

    async def run_episode(workflow: RolloutWorkflow, data: dict[str, object]) -> TensorDict | None:
        return await workflow.arun_episode(engine, data)

    ex = WorkflowExecutor(InferenceEngineConfig(**cfg), run_episode, version=engine.get_version())
    ex.initialize()
    return ex


def advance(ex: WorkflowExecutor, engine: GatedEngine, version: int) -> None:
    """The trainer's set_version: the engine tags new tokens with it, the executor admits for it."""
    engine.set_version(version)
    ex.set_version(version)


def loader(n: int, batch: int, **extra):
    return [[{"i": i + j, **extra} for j in range(batch)] for i in range(0, n, batch)]


# --------------------------------------------------------------------------- staleness, pure


@settings(max_examples=300, deadline=None)
@given(
    eta=st.sampled_from([0, 1, 2]),
    bs=st.integers(1, 4),
    extra_conc=st.integers(0, 8),
    rounds=st.lists(st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=4), min_size=1, max_size=60),
)
def test_staleness_manager_bound_and_liveness(eta: int, bs: int, extra_conc: int, rounds) -> None:
    """Rounds of: admit what the bound allows, finish some rollouts (mostly the newest, so old
    ones straggle; accepted or rejected), consume every full batch at once. Every consumed batch
    at step t holds only rollouts admitted at versions >= t - eta, concurrency never exceeds its
    cap, and the bound never blocks with nothing left to wait for."""
    max_conc = bs + extra_conc
    m = StalenessManager(bs, eta, max_conc, queue_size=16 * bs)
    version = 0
    running: list[int] = []  # admission versions
    ready: list[int] = []
    for finishes in rounds:
        for _ in range(m.capacity(version, len(ready))):
            m.on_admit(version)
            running.append(version)
        assert m.running == len(running) <= max_conc
        assert m.accepted + m.running <= (eta + version + 1) * bs
        for pick, accept in finishes:
            if running:
                v = running.pop(-1 - pick % len(running))
                m.on_finish(v, accept)
                if accept:
                    ready.append(v)
        while len(ready) >= bs:
            batch, ready = ready[:bs], ready[bs:]
            assert min(batch) >= version - eta, (batch, version)
            version += 1
        assert m.capacity(version, len(ready)) > 0 or running, "the bound blocks with nothing running"


def test_straggler_blocks_admission_that_would_break_the_bound() -> None:
    """eta=1, B=1: X (admitted at v0) still runs after batch 0; AReaL's rule would admit another
    rollout at v1 whose early finish puts X in batch 2 (staleness 2). Ours admits none."""
    m = StalenessManager(batch_size=1, max_head_offpolicyness=1, max_concurrent=8, queue_size=16)
    m.on_admit(0)  # X
    m.on_admit(0)  # Y
    m.on_finish(0, accepted=True)  # Y finishes, consumed as batch 0; version becomes 1
    assert (1 + 1 + 1) * 1 - (m.accepted + m.running) == 1  # what the current-version rule allows
    assert m.capacity(version=1, ready=0) == 0
    m.on_finish(0, accepted=True)  # X, consumed as batch 1: staleness 1
    assert m.capacity(version=1, ready=1) == 1  # a rollout for batch 2 may start at v1 (eta = 1)


def test_resumed_run_counts_from_its_version() -> None:
    m = StalenessManager(batch_size=2, max_head_offpolicyness=0, max_concurrent=8, queue_size=32)
    assert m.capacity(version=5, ready=0) == 2
    m.on_admit(5)
    assert m.accepted == 10 and m.capacity(version=5, ready=0) == 1


# --------------------------------------------------------------------------- staleness, end to end


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), bs=st.integers(1, 3))
@pytest.mark.parametrize("eta", [0, 1, 2])
def test_executor_staleness_bound_end_to_end(eta: int, seed: int, bs: int) -> None:
    """prepare_batch over a trainer loop against a straggler-making engine: each batch consumed
    at step t has token versions >= t - eta; capacity and concurrency are never exceeded."""
    engine = GatedEngine(seed=seed)
    max_conc = 3 * bs
    ex = make(engine, consumer_batch_size=bs, max_head_offpolicyness=eta, max_concurrent_rollouts=max_conc)
    try:
        data = loader(64, bs)
        for step in range(8):
            batch = ex.prepare_batch(data, OneShot())
            check_trajectory(batch)
            assert batch.batch_size[0] == bs
            produced = batch["versions"][batch["loss_mask"].bool()]
            assert int(produced.min()) >= step - eta
            assert max(ex.last_batch_staleness) <= eta
            advance(ex, engine, step + 1)
        assert engine.peak_running <= max_conc
        for v in range(engine.version + 1):
            started = sum(c for u, c in engine.started_at_version.items() if u <= v)
            assert started <= (eta + v + 1) * bs
        assert sum(ex.staleness_histogram.values()) == 8 * bs
    finally:
        engine.close()
        ex.destroy()


def test_eta_zero_is_synchronous() -> None:
    """With eta = 0 nothing is admitted for step t+1 before version t+1 is set."""
    engine = GatedEngine()
    ex = make(engine, consumer_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=16)
    try:
        data = loader(40, 2)
        for step in range(4):
            ex.prepare_batch(data, OneShot())
            assert sum(engine.started_at_version.values()) == 2 * (step + 1)
            assert engine.started_at_version[step] == 2
            advance(ex, engine, step + 1)
    finally:
        engine.close()
        ex.destroy()


def test_prepare_batch_refills_the_pipeline_before_returning() -> None:
    """Even when a full batch is already waiting, prepare_batch first submits what the bound
    admits at the new version, so rollout goes on while the caller trains."""
    engine = GatedEngine(spare_oldest=0.0)
    ex = make(engine, consumer_batch_size=1, max_head_offpolicyness=1, max_concurrent_rollouts=4)
    try:
        data = loader(200, 1)
        ex.prepare_batch(data, OneShot())  # admits 2 at version 0, returns 1
        with ex._cond:  # the second one finishes too: a full batch is waiting
            ex._cond.wait_for(lambda: len(ex._ready) == 1 and ex.staleness.running == 0)
        advance(ex, engine, 1)
        ex.prepare_batch(data, OneShot())
        s = ex.stats()
        assert s["rollout/accepted"] + s["rollout/running"] + s["rollout/queued"] == (1 + 1 + 1) * 1
    finally:
        engine.close()
        ex.destroy()


def test_not_advancing_the_version_is_an_error_not_a_hang() -> None:
    engine = GatedEngine()
    ex = make(engine, consumer_batch_size=2, max_head_offpolicyness=0)
    try:
        data = loader(40, 2)
        ex.prepare_batch(data, OneShot())
        with pytest.raises(RuntimeError, match="set_version"):
            ex.prepare_batch(data, OneShot())
    finally:
        engine.close()
        ex.destroy()


# --------------------------------------------------------------------------- sampling and errors


def test_dynamic_sampling_keeps_going_until_a_full_batch() -> None:
    engine = GatedEngine()
    ex = make(engine, consumer_batch_size=4, max_head_offpolicyness=0, max_concurrent_rollouts=4)
    try:
        data = [[{"i": i, "r": float(i % 3 == 0)} for i in range(k, k + 4)] for k in range(0, 400, 4)]
        batch = ex.prepare_batch(data, OneShot(), should_accept=lambda t: bool(t["rewards"][0] > 0))
        assert batch.batch_size[0] == 4
        assert (batch["rewards"] == 1.0).all()
        assert ex.totals["rejected"] >= 6  # four accepted need at least items 0..9, six of them rejected
    finally:
        engine.close()
        ex.destroy()


def test_workflow_error_raises_with_its_input() -> None:
    engine = GatedEngine()
    ex = make(engine, consumer_batch_size=2, on_workflow_error="raise")
    try:
        ex.submit({"i": 0}, OneShot())
        ex.submit({"i": 1, "boom": True}, OneShot())
        with pytest.raises(WorkflowError, match="'boom': True") as info:
            ex.wait(2, timeout=60)
        assert info.value.data == {"i": 1, "boom": True}
        assert isinstance(info.value.cause, ValueError)
        assert ex.totals["failed"] == 1
    finally:
        engine.close()
        ex.destroy()


class Malformed(RolloutWorkflow):
    """Returns a trajectory that breaks the data contract as the item says."""

    async def arun_episode(self, engine, data: dict[str, object]) -> TensorDict | None:
        traj = await OneShot().arun_episode(engine, data)
        assert traj is not None
        if data["break"] == "drop":
            del traj["logprobs"]
        elif data["break"] == "shape":
            traj["loss_mask"] = traj["loss_mask"][:, :-1]
        else:
            return {"input_ids": traj["input_ids"]}  # type: ignore[return-value]
        return traj


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("drop", r"Malformed returned a trajectory that breaks the data contract: it lacks key 'logprobs'"),
        ("shape", r"Malformed returned a trajectory .*: 'loss_mask' has shape \[1, 5\], expected \[1, 6\]"),
        ("dict", r"Malformed must return a TensorDict or None, got dict"),
    ],
)
def test_a_malformed_trajectory_is_reported_with_the_key(how: str, message: str) -> None:
    engine = GatedEngine()
    ex = make(engine, consumer_batch_size=1)
    try:
        ex.submit({"i": 0, "break": how}, Malformed())
        with pytest.raises(WorkflowError, match=message):
            ex.wait(1, timeout=60)
    finally:
        engine.close()
        ex.destroy()


def test_workflow_error_skip_counts_and_goes_on() -> None:
    engine = GatedEngine()
    ex = make(engine, consumer_batch_size=3, max_concurrent_rollouts=6, on_workflow_error="skip")
    try:
        data = [[{"i": i, "boom": i % 2 == 1} for i in range(k, k + 3)] for k in range(0, 60, 3)]
        batch = ex.prepare_batch(data, OneShot())
        assert batch.batch_size[0] == 3
        assert ex.totals["failed"] >= 1
        assert ex.stats()["rollout/failed"] == ex.totals["failed"]
    finally:
        engine.close()
        ex.destroy()


def test_wait_times_out_instead_of_hanging() -> None:
    engine = GatedEngine()
    engine.hold = {0}
    ex = make(engine, consumer_batch_size=1)
    try:
        ex.submit({"i": 0}, OneShot())
        with pytest.raises(TimeoutError, match="1 running"):
            ex.wait(1, timeout=0.3)
        engine.release_held()
        assert ex.wait(1, timeout=60)["item"].tolist() == [0.0]
    finally:
        engine.close()
        ex.destroy()


def test_pause_stops_admission_until_resume() -> None:
    engine = GatedEngine()
    ex = make(engine, consumer_batch_size=2, max_concurrent_rollouts=2)
    try:
        ex.pause()
        ex.submit({"i": 0}, OneShot())
        ex.submit({"i": 1}, OneShot())
        with pytest.raises(TimeoutError, match="2 queued, paused=True"):
            ex.wait(2, timeout=0.3)
        assert sum(engine.started_at_version.values()) == 0
        ex.resume()
        assert ex.wait(2, timeout=60).batch_size[0] == 2
    finally:
        engine.close()
        ex.destroy()


def test_rollout_batch_keeps_order_and_stays_outside_the_pipeline() -> None:
    engine = GatedEngine(seed=3)
    ex = make(engine, consumer_batch_size=2, max_concurrent_rollouts=4)
    try:
        items = [{"i": i} for i in range(7)] + [{"i": 99, "reject": True}]
        batch = ex.rollout_batch(items, OneShot())
        assert batch["item"].tolist() == [float(i) for i in range(7)]
        assert ex.staleness.accepted == 0 and ex.totals["rejected"] == 1
        with pytest.raises(WorkflowError):
            ex.rollout_batch([{"i": 0}, {"i": 1, "boom": True}], OneShot())
    finally:
        engine.close()
        ex.destroy()


def test_prepare_batch_cycles_epochs() -> None:
    engine = GatedEngine(seed=1)
    ex = make(engine, consumer_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=8)
    try:
        data = loader(4, 2)  # two batches per epoch
        seen = []
        for step in range(6):
            seen += ex.prepare_batch(data, OneShot())["item"].tolist()
            advance(ex, engine, step + 1)
        assert Counter(seen) == {0.0: 3, 1.0: 3, 2.0: 3, 3.0: 3}
    finally:
        engine.close()
        ex.destroy()


def test_prepare_batch_carries_a_running_rollout_into_the_next_step() -> None:
    engine = GatedEngine()
    engine.hold = {0}
    ex = make(engine, consumer_batch_size=1, max_head_offpolicyness=1, max_concurrent_rollouts=4)
    try:
        data = loader(8, 1)
        first = ex.prepare_batch(data, OneShot())
        assert first["versions"].max().item() == 0
        advance(ex, engine, 1)
        engine.release_held()
        second = ex.prepare_batch(data, OneShot())  # the held rollout, started at version 0
        assert second["versions"][0, -3].item() == 0 and ex.last_batch_staleness == [1]
        assert first["item"].item() != second["item"].item()
    finally:
        engine.close()
        ex.destroy()


def test_destroy_cancels_running_rollouts() -> None:
    engine = GatedEngine()
    engine.hold = {0, 1}
    ex = make(engine, consumer_batch_size=2)
    ex.submit({"i": 0}, OneShot())
    ex.submit({"i": 1}, OneShot())
    waiter_error: list[BaseException] = []

    def waiter() -> None:
        try:
            ex.wait(2)
        except BaseException as e:  # noqa: BLE001
            waiter_error.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    engine.close()
    ex.destroy()
    t.join(timeout=30)
    assert not t.is_alive()
    assert isinstance(waiter_error[0], RuntimeError)


def test_recovery_replays_unconsumed_items_exactly_once() -> None:
    """A checkpoint taken while rollouts run ahead (eta = 2) loses nothing: with the executor's
    state beside the dataloader's position, the items consumed before and after the restart, plus
    those still in flight at the end, are exactly a prefix of the dataloader's stream, once each."""
    from areal_lite.utils.dataloader import stateful_dataloader

    items = [{"i": i} for i in range(24)]
    cfg = {"consumer_batch_size": 2, "max_head_offpolicyness": 2, "max_concurrent_rollouts": 8}

    def make_loader():
        return stateful_dataloader(items, batch_size=2, shuffle=True, seed=3)

    def run(steps: int, start: int, state: dict | None) -> tuple[list[int], dict]:
        engine = GatedEngine(seed=start)
        engine.set_version(start)
        ex = make(engine, **cfg)
        dl = make_loader()
        if state is not None:
            dl.load_state_dict(state["dataloader"])
            ex.load_state_dict(state["executor"])
        seen: list[int] = []
        try:
            for step in range(start, start + steps):
                seen += [int(x) for x in ex.prepare_batch(dl, OneShot())["item"].tolist()]
                advance(ex, engine, step + 1)
            checkpoint = {"dataloader": dl.state_dict(), "executor": ex.state_dict()}
        finally:
            engine.close()
            ex.destroy()
        return seen, checkpoint

    first, checkpoint = run(4, 0, None)
    assert len(checkpoint["executor"]["unconsumed"]) > 0  # rollouts were in flight at the checkpoint
    rest, final = run(8, 4, checkpoint)
    in_flight = [int(d["i"]) for d in final["executor"]["unconsumed"]]
    reference = make_loader()
    stream = [int(d["i"]) for _ in range(2) for batch in reference for d in batch]
    drawn = first + rest + in_flight
    assert Counter(drawn) == Counter(stream[: len(drawn)])
    # The counters continue across the resume: 12 steps of 2 episodes consumed in all.
    assert final["executor"]["totals"]["consumed"] == 24 == final["executor"]["totals"]["accepted"]


def test_staleness_ignores_padding() -> None:
    from areal_lite.core.staleness import trajectory_staleness
    from areal_lite.utils.data import concat_padded

    short = from_response(
        ModelResponse(input_tokens=[1], output_tokens=[5], output_logprobs=[-1.0], output_versions=[7]), 0.0
    )
    long = from_response(
        ModelResponse(input_tokens=[1], output_tokens=[5, 6, 7], output_logprobs=[-1.0] * 3, output_versions=[6, 7, 7]),
        0.0,
    )
    none = from_response(
        ModelResponse(input_tokens=[1, 2], output_tokens=[], output_logprobs=[], output_versions=[]), 0.0
    )
    batch = concat_padded([short, none, long])  # the short row is padded with version 0
    assert trajectory_staleness(batch, 8) == [1, 2]  # the row without generated tokens is skipped


class Affinity(RolloutWorkflow):
    """Records the cores its episodes run on (the executor's thread and what it started)."""

    seen: ClassVar[list[set[int]]] = []

    async def arun_episode(self, engine, data: dict[str, object]) -> TensorDict | None:
        on_loop = os.sched_getaffinity(0)
        in_thread = await asyncio.get_running_loop().run_in_executor(None, os.sched_getaffinity, 0)
        Affinity.seen += [on_loop, in_thread]
        return await OneShot().arun_episode(engine, data)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread pinning is Linux-only")
def test_client_cores_pin_the_executor_threads_not_the_caller() -> None:
    last = (os.cpu_count() or 1) - 1
    mine = os.sched_getaffinity(0)
    engine = GatedEngine()
    ex = make(engine, consumer_batch_size=2, client_cores=[last])
    try:
        assert len(ex.rollout_batch([{"i": 0}, {"i": 1}], Affinity())) == 2
        assert Affinity.seen and all(cores == {last} for cores in Affinity.seen)
        assert os.sched_getaffinity(0) == mine
    finally:
        engine.close()
        ex.destroy()
    with pytest.raises(ValueError, match=r"rollout.client_cores=\[99999\]"):
        make(GatedEngine(), client_cores=[99999])
