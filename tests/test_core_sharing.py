"""The training thread's share of the cores beside an in-process engine (`CoreSharing`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

from areal_lite.cpu.threads import CoreSharing
from areal_lite.utils.tiny import build_tiny_model


class Probe(nn.Module):
    """A linear layer that records the thread count its forward and backward ran at."""

    def __init__(self, seen: list[tuple[str, int]]) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(("forward", torch.get_num_threads()))
        if x.requires_grad and torch.is_grad_enabled():  # its gradient is computed by this layer's backward
            x = x * 1.0
            x.register_hook(lambda g: self.seen.append(("backward", torch.get_num_threads())))
        return self.linear(x)


def test_the_count_follows_the_engine_at_every_layer_forward_and_backward() -> None:
    before = torch.get_num_threads()
    seen: list[tuple[str, int]] = []
    layers = nn.Sequential(Probe(seen), Probe(seen))
    busy = [True]
    sharing = CoreSharing(lambda: busy[0], idle_threads=2, busy_threads=1)
    try:
        torch.set_num_threads(2)
        sharing.attach(layers)
        x = torch.randn(4, 8, requires_grad=True)
        out = layers(x)
        busy[0] = False  # the engine finished its batch mid-step: the backward gets both threads
        out.sum().backward()
        assert seen == [("forward", 1), ("forward", 1), ("backward", 2), ("backward", 2)]
        assert sharing.switches == 2
        seen.clear()
        busy[0] = True
        with torch.no_grad():  # a forward without gradients registers no backward hook
            layers(x)
        assert seen == [("forward", 1), ("forward", 1)]
        sharing.detach()
        assert torch.get_num_threads() == 2  # detached: the whole count back
        seen.clear()
        layers(x).sum().backward()
        assert seen == [("forward", 2), ("forward", 2), ("backward", 2), ("backward", 2)]
    finally:
        sharing.detach()
        torch.set_num_threads(before)


def test_a_share_outside_the_count_is_refused() -> None:
    with pytest.raises(ValueError, match="busy_threads"):
        CoreSharing(lambda: True, idle_threads=2, busy_threads=3)
    with pytest.raises(ValueError, match="busy_threads"):
        CoreSharing(lambda: True, idle_threads=2, busy_threads=0)


SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, threading, time, torch
    from tensordict import TensorDict
    from areal_lite.api.config import LocalEngineConfig, TrainEngineConfig, OptimizerConfig
    from areal_lite.api.io import FinetuneSpec, GenerationConfig, ModelRequest, WeightUpdateMeta
    from areal_lite.engines.train.fsdp import FSDPEngine
    from areal_lite.engines.local.engine import LocalInferenceEngine

    torch.set_num_threads(2)
    path, share = sys.argv[1], int(sys.argv[2])
    engine = LocalInferenceEngine(LocalEngineConfig(path=path, num_threads=share))
    engine.initialize()
    train = FSDPEngine(TrainEngineConfig(path=path, optimizer=OptimizerConfig(lr=1e-4)))
    train.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=4, train_batch_size=2))
    train.connect_engine(engine, WeightUpdateMeta(type="in_process"))
    seen = []
    for layer in train.model.hf.base_model.layers:
        layer.register_forward_hook(lambda *a: seen.append(torch.get_num_threads()))
    steps = []  # (start, the engine thread's count) of each engine step
    runner = engine.scheduler._runner
    step = runner.step
    def timed_step(admitted):
        steps.append((time.monotonic(), torch.get_num_threads()))
        return step(admitted)
    runner.step = timed_step
    ids = torch.randint(0, 100, (2, 16))
    batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                        "loss_mask": torch.ones_like(ids)}, batch_size=[2])
    loss = lambda logp, entropy, mb: (-(logp * mb["loss_mask"]).sum() / mb["loss_mask"].sum(), {})
    weight = lambda mb: float(mb["loss_mask"].sum())

    def run():  # a long generation keeps the engine busy
        req = ModelRequest(list(range(1, 9)), GenerationConfig(max_new_tokens=400, min_new_tokens=400))
        asyncio.run(engine.agenerate(req))

    gen = threading.Thread(target=run)
    gen.start()
    deadline = time.monotonic() + 60
    while not engine.busy and time.monotonic() < deadline:
        time.sleep(0.001)
    assert engine.busy, "the engine never started the request"
    t0 = time.monotonic()
    train.train_batch(batch, loss, weight)
    t1 = time.monotonic()
    while_busy = sorted(set(seen))
    gen.join()
    # The steps that began (and so read the trainer's state) while it trained, and whose step
    # before them did too, so that the trainer's start falls in neither.
    inside = sorted({n for (before, _), (t, n) in zip(steps, steps[1:]) if before > t0 and t < t1})
    after = sorted({n for t, n in steps if t > t1 + 0.05})
    print("ENGINE", inside, after)
    seen.clear()
    train.train_batch(batch, loss, weight)
    print("COUNTS", while_busy, sorted(set(seen)), engine.busy)
    train.destroy()
    engine.destroy()
    print("AFTER", torch.get_num_threads())
    """
)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen2"), hidden_size=64, num_layers=2)


@pytest.mark.parametrize(
    "share, expected, engine",
    [(1, "COUNTS [1] [2] False", "ENGINE [1] [1]"), (0, "COUNTS [1] [2] False", "ENGINE [1] [2]")],
)
def test_the_fsdp_trainer_yields_the_engines_share_while_it_generates(
    tiny_model_dir: str, share: int, expected: str, engine: str
) -> None:
    """The trainer's layers run on 1 thread of 2 while the engine generates, on 2 once it is done.
    An engine with a share of its own (num_threads=1) runs on it throughout; one without runs on
    1 while the trainer computes and on 2 once it is done."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_model_dir, str(share)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert expected in out.stdout, out.stdout
    assert engine in out.stdout, out.stdout
    assert "AFTER 2" in out.stdout


RELEASE = textwrap.dedent(
    """
    import os, time, torch
    from areal_lite.cpu.threads import release_openmp_threads

    def threads(expected=None):
        # A released worker leaves /proc a moment after it is told to exit.
        deadline = time.monotonic() + 5
        while True:
            n = len(os.listdir("/proc/self/task"))
            if expected is None or n == expected or time.monotonic() > deadline:
                return n
            time.sleep(0.01)

    torch.set_num_threads(2)
    base = threads()
    torch.ones(1 << 22).sum()  # a parallel op: this thread's OpenMP team, one worker beside it
    with_team = threads()
    release_openmp_threads()
    released = threads(base)
    release_openmp_threads()  # nothing left to free
    torch.ones(1 << 22).sum()
    print("THREADS", with_team - base, released - base, threads() - base, torch.get_num_threads())
    """
)


def test_a_thread_that_waits_frees_its_openmp_workers_and_gets_them_back() -> None:
    """`release_openmp_threads` ends the calling thread's OpenMP workers (libgomp throttles the
    spin-waits of every team while the process holds more such threads than CPUs); its next
    parallel op starts them again, at the same count."""
    out = subprocess.run([sys.executable, "-c", RELEASE], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "THREADS 1 0 1 2" in out.stdout, out.stdout


def test_the_engine_frees_its_openmp_workers_when_it_goes_idle(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler thread frees its workers once it has nothing to run, so that a trainer in the
    same process computes with the cores' threads to itself; not at every step."""
    import asyncio
    import threading

    from areal_lite.api.config import LocalEngineConfig
    from areal_lite.cpu import threads as cpu_threads
    from areal_lite.engines.local.engine import LocalInferenceEngine
    from areal_lite.engines.local.request import SamplingParams

    calls: list[str] = []
    monkeypatch.setattr(cpu_threads, "release_openmp_threads", lambda: calls.append(threading.current_thread().name))
    engine = LocalInferenceEngine(LocalEngineConfig(path=tiny_model_dir))
    engine.initialize()
    try:
        deadline = time.monotonic() + 30
        while "local-engine-scheduler" not in calls and time.monotonic() < deadline:  # idle from the start
            time.sleep(0.01)
        # The thread that started the engine frees the workers its loading gave it, once.
        assert sorted(calls) == ["MainThread", "local-engine-scheduler"]
        calls.remove("MainThread")

        async def two() -> list:
            sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
            return await asyncio.gather(*[engine.scheduler.generate([5, 6, 7], sp) for _ in range(2)])

        assert all(len(r.output_ids) == 40 for r in asyncio.run(two()))
        deadline = time.monotonic() + 30
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls == ["local-engine-scheduler"] * 2  # once more when idle again, not per step
    finally:
        engine.destroy()


STARTER = textwrap.dedent(
    """
    import os, sys, time, torch
    from areal_lite.api.config import LocalEngineConfig
    from areal_lite.engines.local.engine import LocalInferenceEngine

    torch.set_num_threads(2)
    before = set(os.listdir("/proc/self/task"))
    torch.ones(1 << 22).sum()  # this thread's OpenMP team: a worker beside it
    workers = set(os.listdir("/proc/self/task")) - before
    engine = LocalInferenceEngine(LocalEngineConfig(path=sys.argv[1]))
    engine.initialize()
    deadline = time.monotonic() + 5  # a released worker leaves /proc a moment after
    while workers & set(os.listdir("/proc/self/task")) and time.monotonic() < deadline:
        time.sleep(0.01)
    print("WORKERS", len(workers), len(workers & set(os.listdir("/proc/self/task"))))
    engine.destroy()
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_starting_the_engine_frees_the_starting_threads_openmp_workers(tiny_model_dir: str) -> None:
    """Loading the model runs parallel ops on the thread that starts the engine; its OpenMP workers
    would stay docked (a server's main thread then only serves HTTP) and make libgomp wake the
    scheduler's workers through a futex at every op: at 2 threads on 2 CPUs the decode step ran
    at one thread's speed. The engine frees them once started."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", STARTER, tiny_model_dir],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "WORKERS 1 0" in out.stdout, out.stdout


def _allowed_cores(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/status") as f:
        return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_the_engine_pins_its_scheduler_thread_and_its_workers_to_its_cores(tiny_model_dir: str) -> None:
    """`local_engine.cores`: the scheduler thread runs on those cores only (the threads it starts,
    its OpenMP workers among them, inherit them); the thread that started the engine keeps its own."""
    import asyncio
    import os
    import threading

    from areal_lite.api.config import LocalEngineConfig
    from areal_lite.engines.local.engine import LocalInferenceEngine
    from areal_lite.engines.local.request import SamplingParams

    core = max(os.sched_getaffinity(0))
    before = {int(t) for t in os.listdir("/proc/self/task")}
    mine = _allowed_cores(threading.get_native_id())
    engine = LocalInferenceEngine(LocalEngineConfig(path=tiny_model_dir, cores=[core], num_threads=2))
    engine.initialize()
    try:
        sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
        out = asyncio.run(engine.scheduler.generate(list(range(1, 200)), sp))
        assert len(out.output_ids) == 8
        scheduler = engine.scheduler._thread
        assert scheduler is not None and scheduler.native_id is not None
        assert _allowed_cores(scheduler.native_id) == str(core)
        assert scheduler.native_id in {int(t) for t in os.listdir("/proc/self/task")} - before
        assert _allowed_cores(threading.get_native_id()) == mine
    finally:
        engine.destroy()


def test_cores_this_machine_lacks_are_refused_naming_the_key(tiny_model_dir: str) -> None:
    from areal_lite.api.config import LocalEngineConfig
    from areal_lite.engines.local.engine import LocalInferenceEngine

    engine = LocalInferenceEngine(LocalEngineConfig(path=tiny_model_dir, cores=[4096]))
    with pytest.raises(ValueError, match=r"local_engine.cores=\[4096\]: no core \[4096\]"):
        engine.initialize()
    engine.destroy()
