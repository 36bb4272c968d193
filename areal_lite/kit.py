"""The scaffolding every example script shares, written once; the training loop stays in each script.

- `make_train_engine` and `make_rollout`: the train engine and the `RolloutController` the config
  asks for (``actor.backend``; ``launcher.backend`` with ``weight_update``).
- `rank_dataloader`: a resumable data loader over this data-parallel rank's share of the data;
  `on_rank0_first` and `print_rank0` for the work and the output that one rank does for all.
- `sync_weights`: the weight-sync sequence (pause, push, version, resume), one line in the loop.
- `RunKit`: after each step, the HF checkpoint, the recover checkpoint, the evaluation and the
  statistics; before the first, the resume from a recover checkpoint.

A script reads::

    rollout, weight_meta = make_rollout(cfg, model_dir)
    actor = PPOActor(cfg.actor, make_train_engine(cfg.actor))
    dataloader = rank_dataloader(items, cfg.train_dataset, actor.engine, seed=cfg.seed)
    run = RunKit(cfg, actor.engine, dataloader, tokenizer=tokenizer, rollout=rollout, weight_meta=weight_meta)
    actor.engine.initialize(run.finetune_spec)
    actor.engine.connect_engine(rollout.engine, weight_meta)
    run.resume()
    for global_step in range(run.start_step, run.total_steps):
        batch = rollout.prepare_batch(dataloader, workflow=workflow)
        ...
        sync_weights(rollout, actor.engine, weight_meta, version=global_step + 1)
        run.end_step(global_step, stats, evaluate=...)
    run.close()
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from areal_lite.api.config import DatasetConfig, TrainEngineConfig
from areal_lite.api.engine import TrainEngine
from areal_lite.api.experiment_config import BaseExperimentConfig, RLExperimentConfig
from areal_lite.api.io import FinetuneSpec, WeightUpdateMeta
from areal_lite.api.workflow import RolloutWorkflow
from areal_lite.core.controller import RolloutController
from areal_lite.utils.dataloader import stateful_dataloader
from areal_lite.utils.evaluator import Evaluator
from areal_lite.utils.recover import ATTEMPT_ENV, RecoverHandler
from areal_lite.utils.saver import Saver
from areal_lite.utils.stats import StatsTracker
from areal_lite.utils.stats_logger import StatsLogger
from areal_lite.utils.step import StepInfo

logger = logging.getLogger("areal_lite.kit")


def make_train_engine(config: TrainEngineConfig) -> TrainEngine:
    """An uninitialised `FSDPEngine` or `MegatronEngine` for ``config.backend``, so swapping
    backends is one config line. The backends are imported lazily: megatron-core is optional."""
    if config.backend == "fsdp":
        from areal_lite.engines.train.fsdp import FSDPEngine

        return FSDPEngine(config)
    if config.backend == "megatron":
        from areal_lite.engines.train.megatron import MegatronEngine

        return MegatronEngine(config)
    raise ValueError(f"backend must be fsdp or megatron, got {config.backend!r}")


def _is_rank0() -> bool:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def rollout_dtype(cfg: RLExperimentConfig) -> str | None:
    """The dtype the rollout engine generates in, as far as the config says: ``local_engine.dtype``
    for the embedded engine and our server (a ``--dtype`` in ``launcher.server_args`` wins for the
    server), a ``--dtype`` in ``launcher.server_args`` for SGLang and vLLM; None when unknown."""
    backend = cfg.launcher.backend
    args = cfg.launcher.server_args
    given = None
    for flag, value in zip(args, [*args[1:], ""]):
        if flag == "--dtype":
            given = value
        elif flag.startswith("--dtype="):
            given = flag.partition("=")[2]
    if backend == "local":
        return cfg.local_engine.dtype
    if backend == "areal":
        return given or cfg.local_engine.dtype
    return given


def check_dtypes(cfg: RLExperimentConfig) -> tuple[str, str | None]:
    """The trainer's compute dtype (``actor.dtype``, ``auto`` resolved on this machine) and the
    rollout engine's (`rollout_dtype`); a warning naming both when they differ. Different dtypes
    give the same weights different log-probabilities (0.65 nats apart at worst, measured on a
    135M model in bf16 against fp32): every update then sees that mismatch as off-policyness
    (the trainer's ``mismatch/*`` statistics)."""
    from areal_lite.cpu import compute_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trainer = str(compute_dtype(cfg.actor.dtype, device)).removeprefix("torch.")
    rollout = rollout_dtype(cfg)
    resolved = None if rollout in (None, "auto") else rollout
    if resolved is not None and resolved != trainer and _is_rank0():
        where = "local_engine.dtype=" if cfg.launcher.backend in ("local", "areal") else "launcher.server_args --dtype "
        logger.warning(
            "the trainer computes in %s (actor.dtype=%s) but the rollout engine generates in %s (%s%s): their "
            "log-probabilities of the same tokens differ, which the updates see as off-policyness (mismatch/* "
            "statistics); set both to one dtype",
            trainer,
            cfg.actor.dtype,
            resolved,
            where,
            resolved,
        )
    return trainer, resolved


def make_rollout(cfg: RLExperimentConfig, model_dir: str | None = None) -> tuple[RolloutController, WeightUpdateMeta]:
    """An initialised `RolloutController` for ``cfg.launcher.backend`` and the `WeightUpdateMeta`
    that reaches its engine.

    ``local`` generates in this process (`LocalInferenceEngine` on ``model_dir``, default
    ``cfg.actor.path``; weights copied in place). ``areal`` and ``sglang`` talk to the servers the
    launcher started (``cfg.rollout.addresses``) with `RemoteSGLangEngine`, ``vllm`` with
    `RemoteVLLMEngine`; weights go through the disk, a process group, or the memory of this machine
    (``cfg.weight_update``: disk, distributed, ipc).
    With ``actor.lora`` on, requests name the trained adapter. Every trainer rank generates its own share of
    the rollouts, but only rank 0 controls the servers (pauses, versions, weights); the other
    ranks' clients follow.
    """
    check_dtypes(cfg)
    if cfg.launcher.backend == "local":
        from areal_lite.engines.local.engine import LocalInferenceEngine

        engine = LocalInferenceEngine(replace(cfg.local_engine, path=model_dir or cfg.actor.path))
        rollout = RolloutController(engine, cfg.rollout)
        meta = WeightUpdateMeta(type="in_process")
    else:
        from areal_lite.engines.local.engine import ADAPTER as POLICY_ADAPTER
        from areal_lite.engines.remote.sglang import RemoteSGLangEngine
        from areal_lite.engines.remote.vllm import RemoteVLLMEngine

        client = RemoteVLLMEngine if cfg.launcher.backend == "vllm" else RemoteSGLangEngine
        control = _is_rank0()
        adapter = POLICY_ADAPTER if cfg.actor.lora.enabled else None  # the name requests give the trained adapter
        factory = functools.partial(client, cfg.rollout, control_servers=False, adapter_name=adapter)
        rollout = RolloutController(
            client(cfg.rollout, control_servers=control, adapter_name=adapter), cfg.rollout, factory
        )
        if cfg.weight_update == "distributed":
            backend = "nccl" if torch.cuda.is_available() else "gloo"  # GPU tensors by NCCL, else gloo
            meta = WeightUpdateMeta(type="distributed", backend=backend, world_size=1 + len(cfg.rollout.addresses))
        elif cfg.weight_update == "disk":
            meta = WeightUpdateMeta(type="disk", path=os.path.join(cfg.output_dir, "weight_update"))
        elif cfg.weight_update == "ipc":
            meta = WeightUpdateMeta(type="ipc")
        else:
            raise ValueError(f"weight_update must be disk, distributed or ipc, got {cfg.weight_update!r}")
    rollout.initialize()
    return rollout, meta


def rank_dataloader(
    items: Sequence[object],
    dataset: DatasetConfig,
    engine: TrainEngine,
    *,
    seed: int,
    collate_fn: Callable[[list[object]], object] | None = None,
) -> StatefulDataLoader:
    """A resumable loader over this data-parallel rank's share of ``items`` (ranks never share an
    item), ``dataset.batch_size`` items per rank and step. Joins ``engine``'s process group first."""
    engine.create_process_group()
    extra = {} if collate_fn is None else {"collate_fn": collate_fn}
    world = engine.data_parallel_world_size
    loader = stateful_dataloader(
        items,
        batch_size=dataset.batch_size,
        shuffle=dataset.shuffle,
        seed=seed,
        rank=engine.data_parallel_rank,
        world_size=world,
        **extra,  # type: ignore[arg-type]
    )
    if len(loader) == 0:
        where = f" ({dataset.path})" if dataset.path else ""
        raise ValueError(
            f"the training data{where} has {len(items)} items, fewer than one batch of "
            f"batch_size={dataset.batch_size} x {world} data-parallel ranks"
        )
    return loader


def on_rank0_first(engine: TrainEngine, prepare: Callable[[], object]) -> None:
    """Run ``prepare`` (e.g. build a model directory that every rank then loads) on trainer rank 0
    while the other ranks wait for it. Joins ``engine``'s process group first."""
    engine.create_process_group()
    if dist.get_rank() == 0:
        prepare()
    dist.barrier()


def job_start_time(output_dir: str) -> float:
    """When this run began (``time.time()``), across the launcher's prepare run, restarts and
    recoveries: recorded in ``output_dir/started_at`` by the first call of the run."""
    path = os.path.join(output_dir, "started_at")
    if not os.path.exists(path):  # every rank may get here: the first rename wins, whole
        os.makedirs(output_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(repr(time.time()))
        os.replace(tmp, path)
    with open(path) as f:
        return float(f.read())


def print_rank0(*args: object) -> None:
    """``print`` on trainer rank 0 only (every rank runs the script)."""
    if _is_rank0():
        print(*args, flush=True)


def sync_weights(rollout: RolloutController, engine: TrainEngine, meta: WeightUpdateMeta, version: int) -> None:
    """Push ``engine``'s weights to the rollout side as policy ``version``: rollouts pause, the
    weights (tagged with their version) load, new tokens carry ``version``, rollouts resume.
    Collective over the trainer's ranks."""
    rollout.pause()
    engine.set_version(version)
    engine.update_weights(meta)
    rollout.set_version(version)
    rollout.resume()


def mean_reward(rollout: RolloutController, workflow: RolloutWorkflow, items: list[dict[str, object]]) -> float:
    """Mean reward of ``workflow`` over ``items``, run now outside the staleness accounting: with a
    greedy workflow and a verifier, the held-out accuracy. Under several trainer ranks each rank
    runs its share of ``items`` and the sums are reduced (collective: every rank calls it)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    share = items[rank::world]
    rewards = (
        rollout.rollout_batch(share, workflow)["rewards"].double() if share else torch.zeros(0, dtype=torch.float64)
    )
    totals = torch.tensor([rewards.sum().item(), float(len(rewards))], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(totals)
    return float(totals[0] / totals[1])


def _record_or_replay(cfg: RLExperimentConfig, rollout: RolloutController) -> None:
    """``record_batches`` / ``replay_batches``: the run's controller records or replays this
    rank's batches (``rank<r>/`` of the directory)."""
    if cfg.record_batches and cfg.replay_batches:
        raise ValueError("record_batches and replay_batches are both set: a run records or replays, not both")
    shard = f"rank{dist.get_rank() if dist.is_initialized() else 0}"
    if cfg.replay_batches:
        rollout.replay_from(os.path.join(cfg.replay_batches, shard))
    elif cfg.record_batches:
        rollout.record_to(os.path.join(cfg.record_batches, shard))


class RunKit:
    """What happens around each training step: saving, recovery, evaluation and logging.

    ``engine`` is the model being trained (saved as HF checkpoints and recovered); ``others`` are
    further trained engines (e.g. a critic) that recover with it. With a ``rollout`` controller, a
    resumed run pushes the recovered weights and version to it and replays the prompts that were
    in flight at the checkpoint, and each step logs the rollout counters and staleness. An RL
    config's ``record_batches`` makes the controller record every batch it hands out, and
    ``replay_batches`` makes it hand out a recording instead of generating. ``data_stats`` (the
    rows used and left out, `areal_lite.utils.datasets.Rows.stats`) go into every step's statistics.
    """

    def __init__(
        self,
        cfg: BaseExperimentConfig,
        engine: TrainEngine,
        dataloader: StatefulDataLoader,
        *,
        tokenizer: object | None = None,
        rollout: RolloutController | None = None,
        weight_meta: WeightUpdateMeta | None = None,
        others: dict[str, TrainEngine] | None = None,
        data_stats: dict[str, float] | None = None,
    ) -> None:
        if rollout is not None and weight_meta is None:
            raise ValueError("a RunKit with a rollout controller needs the weight_meta that reaches it")
        self.engine = engine
        self.dataloader = dataloader
        self.tokenizer = tokenizer
        self.rollout = rollout
        self.weight_meta = weight_meta
        self.steps_per_epoch = len(dataloader)
        self.total_steps = cfg.total_train_steps or cfg.total_train_epochs * self.steps_per_epoch
        self.start_step = 0
        self.saver = Saver(cfg.saver, cfg.output_dir)
        self.evaluator = Evaluator(cfg.evaluator)
        self.recover = RecoverHandler(cfg.recover, cfg.output_dir)
        self.others = {
            name: (other, RecoverHandler(cfg.recover, os.path.join(cfg.output_dir, name)))
            for name, other in (others or {}).items()
        }
        self.stats_logger = StatsLogger(
            cfg.stats_logger, cfg.output_dir, total_steps=self.total_steps, run_name=cfg.experiment_name, run_config=cfg
        )
        self.tracker = StatsTracker()
        self.data_stats = dict(data_stats or {})
        if rollout is not None and isinstance(cfg, RLExperimentConfig):
            _record_or_replay(cfg, rollout)

    @property
    def finetune_spec(self) -> FinetuneSpec:
        """The run's length for the LR schedule: ``total_steps`` batches (``total_train_steps``
        may end the run before or after the epochs)."""
        return FinetuneSpec(total_train_epochs=1, dataset_size=self.total_steps, train_batch_size=1)

    def timer(self, name: str) -> AbstractContextManager[None]:
        """Time a stage of the step (``timing/<name>`` in the statistics)."""
        return self.tracker.timer(name)

    def resume(self) -> dict[str, object] | None:
        """Load the last recover checkpoint, if recovery is on and one exists: engines, data
        position, logger state; the rollout side gets the recovered weights and version and
        replays the prompts that were in flight. Sets `start_step`; returns the ``extra`` that
        `end_step` saved, or None for a fresh run. A fresh start that is a launcher's restart
        (``AREAL_LITE_ATTEMPT`` > 0) pushes the initial weights and version to the rollout side,
        which may hold the failed attempt's."""
        info = self.recover.load(self.engine, dataloader=self.dataloader, stats_logger=self.stats_logger)
        for other, handler in self.others.values():
            handler.load(other)
        if info is None:
            if self.rollout is not None and int(os.environ.get(ATTEMPT_ENV, "0")) > 0:
                # A restart before the first recover checkpoint: the servers may hold the weights
                # and version that the failed attempt pushed to them. Start them over too.
                assert self.weight_meta is not None
                print_rank0(
                    "[areal-lite] restarted before the first checkpoint: the rollout side gets the initial weights"
                )
                sync_weights(self.rollout, self.engine, self.weight_meta, self.engine.get_version())
            return None
        if self.rollout is not None:
            assert self.weight_meta is not None
            sync_weights(self.rollout, self.engine, self.weight_meta, info.version)
            if "rollout" in info.extra:
                self.rollout.load_state_dict(info.extra["rollout"])  # type: ignore[arg-type]
        self.start_step = info.next_step.global_step
        print_rank0(f"[areal-lite] resumed after step {self.start_step}")
        return info.extra

    def end_step(
        self,
        global_step: int,
        stats: dict[str, float],
        *,
        evaluate: Callable[[], dict[str, float]] | None = None,
        extra: dict[str, object] | None = None,
    ) -> None:
        """After step ``global_step``: save, dump a recover checkpoint (with ``extra``, which
        `resume` returns), evaluate when due (``evaluate()`` returns named scores) and log.
        Collective over the trainer's ranks. After a SIGTERM the recover checkpoint is written
        whatever its frequency, the evaluation skipped, and the process exits with 143."""
        step = StepInfo.at(global_step, self.steps_per_epoch)
        self.saver.save(self.engine, step, tokenizer=self.tokenizer, last=global_step + 1 == self.total_steps)
        state = dict(extra or {})
        if self.rollout is not None:
            state["rollout"] = self.rollout.state_dict()
        self.recover.dump(self.engine, step, dataloader=self.dataloader, stats_logger=self.stats_logger, extra=state)
        for other, handler in self.others.values():
            handler.dump(other, step)
        stopping = self.recover.stop_requested
        scores = self.evaluator.evaluate(evaluate, step) if evaluate is not None and not stopping else None
        rollout_stats: dict[str, float] = {}
        if self.rollout is not None:
            self.tracker.dist("rollout/staleness", self.rollout.last_batch_staleness)
            rollout_stats = self.rollout.stats()
        self.stats_logger.commit(
            global_step, stats, rollout_stats, self.tracker.export(), scores or {}, self.data_stats
        )
        if stopping:
            self.close()
            raise SystemExit(128 + signal.SIGTERM)

    def close(self) -> None:
        """Finish the loggers (curves, wandb)."""
        self.stats_logger.close()
