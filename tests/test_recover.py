"""Recovery: the resumable data loader, atomic checkpoint directories, RNG state, the recover
handler's modes, and (with the real FSDPEngine) a trainer SIGKILLed mid-run that the launcher
restarts and that finishes with every sample consumed exactly once per epoch."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import trainer_kill

from areal_lite.api.config import RecoverConfig
from areal_lite.utils.dataloader import stateful_dataloader
from areal_lite.utils.recover import RecoverHandler, rng_state, set_rng_state
from areal_lite.utils.saver import CheckpointWriteError, resolve_atomic, write_atomically
from areal_lite.utils.step import StepInfo, is_due


@pytest.mark.parametrize("rank", [0, 1])
def test_dataloader_resumes_exactly_at_every_batch(rank: int) -> None:
    make = lambda: stateful_dataloader(list(range(11)), 2, seed=5, rank=rank, world_size=2)
    full = trainer_kill.batches(make(), 6)  # 11 items over 2 ranks -> 5 each -> 2 batches of 2 per epoch
    for k in range(7):
        dl = make()
        trainer_kill.batches(dl, k)
        state = dl.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        assert trainer_kill.batches(resumed, 6 - k) == full[k:], f"resume after {k} batches"


def test_dataloader_shards_each_epoch_disjointly() -> None:
    epochs = []
    for epoch in range(3):
        per_rank = [
            trainer_kill.batches(
                stateful_dataloader(list(range(12)), 3, seed=1, rank=r, world_size=2), 2 * (epoch + 1)
            )[-2:]
            for r in range(2)
        ]
        ids = [i for batches in per_rank for b in batches for i in b]
        assert sorted(ids) == list(range(12)), "every sample once per epoch, no sample on two ranks"
        epochs.append(ids)
    assert epochs[0] != epochs[1] != epochs[2], "each epoch has its own order"


def _writer(value: str):
    return lambda d: open_write(os.path.join(d, "v"), value)


def open_write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_atomic_write_keeps_the_old_copy_when_a_write_fails(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    write_atomically(path, _writer("1"))

    def crash(d: str) -> None:
        open_write(os.path.join(d, "v"), "half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(CheckpointWriteError, match="killed mid-write"):
        write_atomically(path, crash)
    assert resolve_atomic(path) == path
    assert read(os.path.join(path, "v")) == "1"
    write_atomically(path, _writer("2"))
    assert read(os.path.join(path, "v")) == "2"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_crash_between_the_renames_leaves_the_old_copy_found(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    write_atomically(path, _writer("1"))
    os.rename(path, path + ".old")  # the state right after the first rename
    assert resolve_atomic(path) == path + ".old"
    write_atomically(path, _writer("2"))
    assert resolve_atomic(path) == path and not os.path.exists(path + ".old")
    assert resolve_atomic(str(tmp_path / "none")) is None


def test_rng_state_round_trip() -> None:
    state = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[0] == again[0] and first[1] == again[1] and torch.equal(first[2], again[2])


def test_recover_modes(tmp_path) -> None:
    with pytest.raises(ValueError, match="recover.mode"):
        RecoverHandler(RecoverConfig(mode="sometimes"), str(tmp_path))
    engine = object()  # never touched: there is nothing to load
    assert RecoverHandler(RecoverConfig(mode="disabled"), str(tmp_path)).load(engine) is None  # type: ignore[arg-type]
    assert RecoverHandler(RecoverConfig(mode="auto"), str(tmp_path)).load(engine) is None  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        RecoverHandler(RecoverConfig(mode="resume"), str(tmp_path)).load(engine)  # type: ignore[arg-type]
    assert not RecoverHandler(RecoverConfig(mode="disabled"), str(tmp_path)).dump(engine, StepInfo.first(3))  # type: ignore[arg-type]


def test_schedule_is_a_function_of_the_step() -> None:
    steps = [StepInfo.at(g, 4) for g in range(12)]
    assert [s.global_step for s in steps if is_due(s, freq_steps=5)] == [4, 9]
    assert [s.global_step for s in steps if is_due(s, freq_epochs=2)] == [7]
    assert not is_due(steps[0], last=True), "no frequency set means never"
    assert is_due(steps[0], freq_steps=100, last=True)
    assert StepInfo.at(7, 4).next() == StepInfo(epoch=2, epoch_step=0, global_step=8, steps_per_epoch=4)


@pytest.mark.slow  # 2 ranks under the launcher, killed and restarted: `make test-faults` runs it
def test_sigkilled_trainer_resumes_with_each_sample_once_per_epoch(tmp_path) -> None:
    """The trainer (2 FSDP ranks under torchrun, via the local launcher) is SIGKILLed after training
    the first step of epoch 2 and before checkpointing it; the launcher restarts it, it resumes from
    the end-of-epoch-1 checkpoint and finishes (`trainer_kill.check_resumed`)."""
    import signal
    import subprocess
    import sys

    from areal_lite.utils.tiny import build_tiny_model

    model = build_tiny_model(
        str(tmp_path / "model"), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=256
    )
    out_dir = tmp_path / "out" / "areal-lite" / "trial0"
    cmd = [
        sys.executable,
        "-m",
        "areal_lite.launcher.local",
        trainer_kill.SCRIPT,
        *trainer_kill.overrides(model, str(tmp_path / "out")),
    ]
    launcher = subprocess.Popen(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        pids = trainer_kill.wait_paused(
            out_dir, lambda: None if launcher.poll() is None else launcher.communicate()[0].decode()[-3000:]
        )
        os.kill(pids[1], signal.SIGKILL)
        log = launcher.communicate(timeout=300)[0].decode()
        assert launcher.returncode == 0, log[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    trainer_kill.check_resumed(out_dir)


def test_resume_pushes_the_recovered_policy_to_the_inference_engine(tmp_path) -> None:
    import subprocess
    import sys

    from areal_lite.utils.tiny import build_tiny_model

    build_tiny_model(str(tmp_path / "model"), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=256)
    script = os.path.join(os.path.dirname(__file__), "scripts", "recover_push.py")
    proc = subprocess.run(
        [sys.executable, script, str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_evaluator_runs_on_schedule() -> None:
    from areal_lite.api.config import EvaluatorConfig
    from areal_lite.utils.evaluator import Evaluator

    calls: list[int] = []
    ev = Evaluator(EvaluatorConfig(freq_steps=3))
    results = [ev.evaluate(lambda g=g: calls.append(g) or g, StepInfo.at(g, 5)) for g in range(7)]
    assert calls == [2, 5] and results == [None, None, 2, None, None, 5, None]
    assert ev.evaluate(lambda: "final", StepInfo.at(6, 5), last=True) == "final"
    assert Evaluator(EvaluatorConfig()).evaluate(lambda: 1, StepInfo.at(6, 5), last=True) is None
