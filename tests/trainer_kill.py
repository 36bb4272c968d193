"""The trainer-kill scenario, shared by the local launcher's test (test_recover.py) and the Ray and
Slurm launchers' tests (test_cluster.py): `tests/scripts/recover_train.py` (2 FSDP ranks, a tiny
model) is SIGKILLed after training the first step of epoch 2 and before checkpointing it; the
launcher restarts it, it resumes from the end-of-epoch-1 checkpoint and finishes. `check_resumed`
then pins what only an exact resume gives: the redone step reproduces the killed attempt's loss, and
the final run saw the same batches as an uninterrupted one, every sample once per epoch."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from areal_lite.utils.dataloader import stateful_dataloader

STEPS_PER_EPOCH = 4
EPOCHS = 2
WORLD, BATCH_SIZE, SEED = 2, 2, 3
KILL_STEP = STEPS_PER_EPOCH
DATASET_SIZE = STEPS_PER_EPOCH * BATCH_SIZE * WORLD
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "recover_train.py")


def batches(dl, n: int) -> list[list[int]]:
    """The next ``n`` batches, going into the next epoch when one ends."""
    out: list[list[int]] = []
    it = iter(dl)
    while len(out) < n:
        try:
            out.append(next(it))
        except StopIteration:
            it = iter(dl)
    return out


def overrides(model: str, fileroot: str) -> list[str]:
    """The script's arguments after its path: a run that pauses at `KILL_STEP` on its first attempt."""
    return [f"actor.path={model}", f"cluster.fileroot={fileroot}", f"launcher.trainer_nproc={WORLD}",
            f"train_dataset.batch_size={BATCH_SIZE}", f"total_train_epochs={EPOCHS}", f"dataset_size={DATASET_SIZE}",
            f"seed={SEED}", "recover.mode=auto", "recover.retries=1", "saver.freq_epochs=1", "stats_logger.console=false",
            "stats_logger.wandb_mode=disabled", "stats_logger.plot_keys=[loss]", "actor.optimizer.lr=1e-3",
            f"pause_at_step={KILL_STEP}"]  # fmt: skip


def wait_paused(out_dir: Path, still_running: Callable[[], str | None], timeout: float = 300) -> list[int]:
    """The pids of the paused ranks, once every rank has paused; ``still_running`` returns None
    while the launch is alive, else what to fail with."""
    paused = [out_dir / f"paused_rank{r}" for r in range(WORLD)]
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.read_text() for p in paused):
        failure = still_running()
        assert failure is None, failure
        assert time.monotonic() < deadline, "the trainer never reached the kill step"
        time.sleep(0.1)
    return [int(p.read_text()) for p in paused]


def _expected_ids() -> dict[int, list[list[int]]]:
    """Per step, each rank's sample ids as the data loader deals them in an uninterrupted run."""
    out: dict[int, list[list[int]]] = {}
    for rank in range(WORLD):
        dl = stateful_dataloader(list(range(DATASET_SIZE)), BATCH_SIZE, seed=SEED, rank=rank, world_size=WORLD)
        for step, ids in enumerate(batches(dl, STEPS_PER_EPOCH * EPOCHS)):
            out.setdefault(step, []).append(ids)
    return out


def check_resumed(out_dir: Path, resumed_attempt: int = 1) -> None:
    """The killed run was restarted once (as attempt ``resumed_attempt``), resumed from its
    checkpoint and trained every sample once per epoch."""
    total_steps = STEPS_PER_EPOCH * EPOCHS
    final: dict[int, list[list[int]]] = {}
    for rank in range(WORLD):
        records = [json.loads(line) for line in (out_dir / f"consumed_rank{rank}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["attempt"] == 0] == list(range(KILL_STEP + 1))
        assert sorted({r["attempt"] for r in records}) == [0, resumed_attempt]
        assert [r["step"] for r in records if r["attempt"] == resumed_attempt] == list(range(KILL_STEP, total_steps)), (
            "the restart resumes at the step that was not checkpointed and runs to the same end"
        )
        killed, redone = [
            next(r for r in records if r["step"] == KILL_STEP and r["attempt"] == a) for a in (0, resumed_attempt)
        ]
        assert redone["ids"] == killed["ids"]
        assert redone["loss"] == pytest.approx(killed["loss"], rel=1e-6, abs=1e-7)
        for r in records:  # the last attempt's record of a step is what the final model trained on
            final.setdefault(r["step"], [[] for _ in range(WORLD)])[rank] = r["ids"]
    assert sorted(final) == list(range(total_steps)), "same number of steps as an uninterrupted run"
    assert final == _expected_ids(), "the same batches, step by step, as an uninterrupted run"
    for epoch in range(EPOCHS):
        steps = range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH)
        consumed = sorted(i for s in steps for ids in final[s] for i in ids)
        assert consumed == list(range(DATASET_SIZE)), f"epoch {epoch}: every sample exactly once"
    assert (out_dir / "checkpoints" / f"globalstep{total_steps}" / "model.safetensors").exists()
    assert (out_dir / "curves.png").exists()
