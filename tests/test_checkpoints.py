"""Checkpoints lose nothing: written atomically with a checksum of every file, a damaged latest copy
(truncated, corrupted, a few bytes overwritten inside a file that looks whole) reported and the
previous one used, a failed write (a full disk, a read-only file system: real tmpfs mounts in a
mount namespace) named and leaving the previous copy intact, and a checkpoint on SIGTERM."""

from __future__ import annotations

import errno
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from areal_lite.api.config import RecoverConfig
from areal_lite.utils import recover as recover_module
from areal_lite.utils.recover import RecoverHandler
from areal_lite.utils.saver import (
    CHECKSUMS,
    CheckpointDamaged,
    CheckpointWriteError,
    checkpoint_problem,
    intact_checkpoint,
    write_atomically,
)
from areal_lite.utils.step import StepInfo

HERE = os.path.dirname(os.path.abspath(__file__))


def weights_writer(value: float):
    def write(directory: str) -> None:
        os.makedirs(os.path.join(directory, "engine"))
        torch.save({"w": torch.full((256,), value)}, os.path.join(directory, "engine", "model.pt"))
        with open(os.path.join(directory, "state.json"), "w") as f:
            json.dump({"value": value}, f)

    return write


def loaded(directory: str) -> float:
    return float(torch.load(os.path.join(directory, "engine", "model.pt"))["w"][0])


def overwrite_inside(path: str, at: float = 0.6, data: bytes = b"\x7f\x7f\x7f\x7f") -> None:
    """Change a few bytes in the middle of ``path``: its size and its structure stay as they were."""
    with open(path, "r+b") as f:
        f.seek(int(os.path.getsize(path) * at))
        f.write(data)


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda p: overwrite_inside(p), "engine/model.pt does not match its checksum (truncated or overwritten)"),
        (
            lambda p: os.truncate(p, os.path.getsize(p) // 2),
            "engine/model.pt does not match its checksum (truncated or overwritten)",
        ),
        (os.remove, "engine/model.pt is missing"),
    ],
)
def test_damage_to_a_checkpoint_is_found(tmp_path, damage, problem: str) -> None:
    path = str(tmp_path / "ckpt")
    write_atomically(path, weights_writer(1.0))
    listed = (tmp_path / "ckpt" / CHECKSUMS).read_text().splitlines()
    assert [line.split("  ")[1] for line in listed] == ["engine/model.pt", "state.json"]
    assert checkpoint_problem(path) is None
    damage(os.path.join(path, "engine", "model.pt"))
    assert checkpoint_problem(path) == problem


def test_a_damaged_latest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, caplog) -> None:
    path = str(tmp_path / "ckpt")
    for value in (1.0, 2.0, 3.0):
        write_atomically(path, weights_writer(value), keep_previous=True)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.prev"], "the latest and the previous one"
    assert loaded(intact_checkpoint(path)) == 3.0  # type: ignore[arg-type]
    overwrite_inside(os.path.join(path, "engine", "model.pt"))
    with caplog.at_level(logging.ERROR, logger="areal_lite.utils.saver"):
        chosen = intact_checkpoint(path)
    assert chosen == path + ".prev" and loaded(chosen) == 2.0
    assert f"checkpoint {path} is damaged: engine/model.pt does not match its checksum" in caplog.text
    overwrite_inside(os.path.join(path + ".prev", "state.json"), at=0.5, data=b"9")
    with pytest.raises(CheckpointDamaged, match="no intact copy of checkpoint"):
        intact_checkpoint(path)


def test_a_failed_write_names_its_cause_and_keeps_the_previous_checkpoint(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    write_atomically(path, weights_writer(1.0), keep_previous=True)

    def full_disk(directory: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointWriteError, match=r"cannot write checkpoint .*ckpt: the disk is full"):
        write_atomically(path, full_disk, keep_previous=True)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], "nothing half-written is left"
    assert loaded(intact_checkpoint(path)) == 1.0  # type: ignore[arg-type]


def in_mount_namespace(
    mounts: str, command: list[str], timeout: float = 120, **env: str
) -> subprocess.CompletedProcess:
    """``command`` run after the shell's ``mounts`` in a mount namespace of its own (no root needed)."""
    if shutil.which("unshare") is None:
        pytest.fail("these tests need util-linux's unshare")
    return subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", f"{mounts} && exec {shlex.join(command)}"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        check=False,
    )


TINY_FS = """
import sys, torch
from areal_lite.utils.saver import CheckpointWriteError, intact_checkpoint, write_atomically
def small(d):
    torch.save({"w": torch.zeros(1000)}, d + "/model.pt")
def big(d):
    torch.save({"w": torch.zeros(100_000)}, d + "/model.pt")  # 400 kB on a 64 kB file system
for root in sys.argv[1:]:
    if root.endswith("full"):
        write_atomically(root + "/ckpt", small, keep_previous=True)
    try:
        write_atomically(root + "/ckpt", big, keep_previous=True)
    except CheckpointWriteError as e:
        print("ERROR", e)
    print("INTACT", intact_checkpoint(root + "/ckpt"))
"""


def test_a_checkpoint_on_a_full_or_read_only_file_system(tmp_path) -> None:
    """torch.save on a full disk fails with ``unexpected pos`` and no errno; the cause is named all
    the same, as a read-only file system is. 64 kB tmpfs mounts, in a mount namespace of our own
    (no root needed), one full (with a checkpoint in it already) and one read-only."""
    full, read_only = tmp_path / "full", tmp_path / "read-only"
    full.mkdir()
    read_only.mkdir()
    mounts = f"mount -t tmpfs -o size=64k tmpfs {full} && mount -t tmpfs -o size=64k,ro tmpfs {read_only}"
    proc = in_mount_namespace(mounts, [sys.executable, "-c", TINY_FS, str(full), str(read_only)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    errors = [line for line in lines if line.startswith("ERROR")]
    assert errors[0].startswith(f"ERROR cannot write checkpoint {full}/ckpt: the disk is full"), errors
    assert errors[1] == f"ERROR cannot write checkpoint {read_only}/ckpt: the file system of {read_only} is read-only"
    intact = [line for line in lines if line.startswith("INTACT")]
    assert intact == [f"INTACT {full}/ckpt", "INTACT None"], "the previous checkpoint is still the one found"


class FileEngine:
    """The part of a train engine that recovery uses: a version, and a state saved to a file."""

    def __init__(self) -> None:
        self.version = 0
        self.saved = 0

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    def save(self, meta) -> None:
        os.makedirs(meta.path, exist_ok=True)
        with open(os.path.join(meta.path, "weights"), "w") as f:
            f.write(str(self.version))
        self.saved += 1

    def load(self, meta) -> None:
        with open(os.path.join(meta.path, "weights")) as f:
            self.version = int(f.read())


def test_sigterm_writes_a_checkpoint_after_the_step_and_asks_to_stop(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(recover_module, "_stop_signal", None)
    monkeypatch.setattr(recover_module, "_catching", False)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop_after_a_step(tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)  # pytest's own again


def stop_after_a_step(tmp_path) -> None:
    handler = RecoverHandler(RecoverConfig(mode="auto", freq_steps=100), str(tmp_path))
    engine = FileEngine()
    step = StepInfo.first(10)
    assert not handler.dump(engine, step) and not handler.stop_requested, "not due"  # type: ignore[arg-type]
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's repeat of the launcher's: the same request
    time.sleep(0.1)
    engine.version = 2
    assert handler.dump(engine, step.next()) and handler.stop_requested  # type: ignore[arg-type]
    info = RecoverHandler(RecoverConfig(mode="auto"), str(tmp_path)).load(FileEngine())  # type: ignore[arg-type]
    assert info is not None and info.last_step.global_step == 1 and info.version == 2


@pytest.mark.slow
def test_sigterm_then_a_damaged_checkpoint_under_the_launcher(tmp_path) -> None:
    """2 FSDP ranks under the local launcher (tests/scripts/recover_train.py, a checkpoint every 4
    steps). SIGTERM mid-run: the launcher forwards it, both ranks finish the step, write its
    checkpoint and exit. Then a few bytes inside the newest checkpoint's weights are overwritten:
    the next launch names the damage, resumes from the previous checkpoint and finishes."""
    from areal_lite.utils.tiny import build_tiny_model

    model = build_tiny_model(
        str(tmp_path / "model"), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=256
    )
    out_dir = tmp_path / "out" / "areal-lite" / "trial0"
    cmd = [
        sys.executable, "-m", "areal_lite.launcher.local", os.path.join(HERE, "scripts", "recover_train.py"),
        f"actor.path={model}", f"cluster.fileroot={tmp_path / 'out'}", "launcher.trainer_nproc=2",
        "train_dataset.batch_size=2", "dataset_size=48", "recover.mode=auto", "recover.freq_steps=4",
        "stats_logger.console=false", "stats_logger.wandb_mode=disabled", "stats_logger.plot_keys=[loss]",
        "step_seconds=0.5",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    records = out_dir / "consumed_rank0.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not (records.exists() and len(records.read_text().splitlines()) >= 6):
            assert launcher.poll() is None, launcher.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 6"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        log = launcher.communicate(timeout=120)[0].decode()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 128 + signal.SIGTERM, log[-3000:]
    trained = [json.loads(line)["step"] for line in records.read_text().splitlines()]
    ckpt = out_dir / "recover" / "checkpoint"
    state = torch.load(ckpt / "state_rank0.pt", weights_only=False)
    assert state["step"]["global_step"] == trained[-1] > 5, "the checkpoint is of the last step trained"
    previous = torch.load(ckpt.parent / "checkpoint.prev" / "state_rank0.pt", weights_only=False)
    assert previous["step"]["global_step"] == 3 + 4 * ((trained[-1] - 3 - 1) // 4)
    assert "stopping: recover checkpoint written after step" in log

    shard = max((ckpt / "engine").glob("*.distcp"), key=os.path.getsize)
    overwrite_inside(str(shard))
    proc = subprocess.run(cmd[:-1], env=env, capture_output=True, text=True, timeout=300, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert f"checkpoint {ckpt} is damaged: engine/{shard.name} does not match its checksum" in log
    assert "using the previous checkpoint" in log
    steps = [json.loads(line)["step"] for line in records.read_text().splitlines()]
    resumed = steps[len(trained) :]
    assert resumed == list(range(previous["step"]["global_step"] + 1, 12)), "resumed after the previous checkpoint"


def test_recover_checkpoints_of_a_train_engine_on_a_small_file_system(tmp_path) -> None:
    """Issue 53: a recover folder on a 20 MiB file system, where a copy of the checkpoint takes
    12.5 MiB (a hidden-128, 4-layer model with Adam's state). The first copy is written and says
    what copies need; the second, which would not fit beside it, is refused before it is written;
    and on an 8 MiB file system torch.distributed.checkpoint's own failure (torch.save's ``unexpected
    pos``, wrapped in a BaseException that used to escape the checkpoint's error handling with six
    tracebacks) is named the same way. Each failure is one line naming the space, and the stop file
    holds it: the launcher does not restart the trainer."""
    from areal_lite.api.errors import STOP_FILE_ENV, read_stop_file
    from areal_lite.utils.tiny import build_tiny_model

    model = build_tiny_model(
        str(tmp_path / "model"), hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=256
    )
    small, medium, stop_file = tmp_path / "small", tmp_path / "medium", tmp_path / "stop"
    small.mkdir()
    medium.mkdir()
    mounts = f"mount -t tmpfs -o size=8m tmpfs {small} && mount -t tmpfs -o size=20m tmpfs {medium}"
    script = os.path.join(HERE, "scripts", "full_disk_recover.py")
    proc = in_mount_namespace(
        mounts, [sys.executable, script, model, str(small), str(medium)], timeout=300, **{STOP_FILE_ENV: str(stop_file)}
    )
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr[-3000:]
    assert "CheckpointException" not in proc.stderr, "torch.distributed.checkpoint's error is not what is raised"
    errors = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 2, out
    in_small, in_medium = errors
    assert in_small.startswith(f"ERROR cannot write checkpoint {small}/recover/checkpoint: the disk is full (")
    assert "free of 8.0 MiB on" in in_small and "of this copy were written" in in_small
    assert "cluster.fileroot" in in_small
    assert in_medium.startswith(f"ERROR cannot write checkpoint {medium}/recover/checkpoint: the disk is full (")
    assert "free of 20.0 MiB" in in_medium and "a copy takes 12." in in_medium and "24." in in_medium
    said = [line for line in out.splitlines() if line.startswith("[areal-lite] checkpoint")]
    assert len(said) == 1 and "a copy takes 12." in said[0] and "the next copy will not fit" in said[0], out
    assert [line for line in out.splitlines() if line.startswith("WROTE")] == ["WROTE ['checkpoint']"]
    assert read_stop_file(str(stop_file)) == "CheckpointWriteError: " + in_medium.removeprefix("ERROR ")


ROOM_FS = """
import os, sys, torch
from areal_lite.utils.saver import intact_checkpoint, write_atomically
def write(value):
    def w(d):
        torch.save({"w": torch.full((6000,), value)}, d + "/model.pt")  # about 24 kB
    return w
root = sys.argv[1]
for value in (1.0, 2.0, 3.0):
    write_atomically(root + "/ckpt", write(value), keep_previous=True)
    print("COPIES", sorted(os.listdir(root)), flush=True)
print("LATEST", float(torch.load(intact_checkpoint(root + "/ckpt") + "/model.pt")["w"][0]))
"""


def test_the_previous_checkpoint_makes_room_for_the_next_where_three_copies_do_not_fit(tmp_path) -> None:
    """A 64 kB file system holds two copies of a 24 kB checkpoint, not three: the third write
    removes the previous copy first, saying so, and the run goes on with the current copy as the
    fallback while it writes."""
    root = tmp_path / "room"
    root.mkdir()
    proc = in_mount_namespace(f"mount -t tmpfs -o size=64k tmpfs {root}", [sys.executable, "-c", ROOM_FS, str(root)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line for line in lines if line.startswith("COPIES")] == [
        "COPIES ['ckpt']",
        "COPIES ['ckpt', 'ckpt.prev']",
        "COPIES ['ckpt', 'ckpt.prev']",
    ]
    removed = [line for line in lines if "the previous one is removed first" in line]
    assert len(removed) == 1 and f"{root}/ckpt" in removed[0], proc.stdout
    assert lines[-1] == "LATEST 3.0"
