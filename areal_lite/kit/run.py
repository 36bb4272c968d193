"""What happens around each training step, written once for every example: `RunKit` (the HF
checkpoint, the recover checkpoint, the evaluation and the statistics after each step; the engines'
start and the resume from a recover checkpoint before the first; their end after the last),
`sync_weights` (the weight-sync sequence, one line in the loop), `mean_reward` and `HeldOutScore`
(a held-out score, before, during and after training); before all that, `load_config_and_seed`
and `job_start_time`."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torchdata.stateful_dataloader import StatefulDataLoader

from areal_lite.api.config_loader import load_config
from areal_lite.api.engine import TrainEngine
from areal_lite.api.experiment_config import BaseExperimentConfig, RLExperimentConfig
from areal_lite.api.io import FinetuneSpec, WeightUpdateMeta
from areal_lite.api.workflow import RolloutWorkflow
from areal_lite.core.controller import RolloutController
from areal_lite.kit.ranks import print_rank0
from areal_lite.utils.evaluator import Evaluator
from areal_lite.utils.recover import ATTEMPT_ENV, RecoverHandler
from areal_lite.utils.saver import Saver
from areal_lite.utils.stats import StatsTracker
from areal_lite.utils.stats_logger import StatsLogger
from areal_lite.utils.step import StepInfo

T = TypeVar("T")


class PolicyActor(Protocol):
    """What `RunKit.rl_step` calls on an actor (`areal_lite.actors.ppo.PPOActor` has it)."""

    def compute_advantages(self, data: TensorDict) -> None: ...

    def ppo_update(self, data: TensorDict) -> dict[str, float]: ...

    def step_lr_scheduler(self) -> None: ...


C = TypeVar("C", bound=BaseExperimentConfig)


def load_config_and_seed(argv: list[str], config_cls: type[C]) -> C:
    """The script's config (`areal_lite.api.config_loader.load_config` of ``argv``), with torch's
    generator seeded from its ``seed`` before anything is built."""
    cfg = load_config(argv, config_cls)
    torch.manual_seed(cfg.seed)
    return cfg


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


class HeldOutScore:
    """The mean reward of ``workflow`` over the held-out ``items`` (`mean_reward`; with a greedy
    workflow and a verifier, the held-out accuracy): call it for the score before and after
    training, and pass `evaluate` to `RunKit.end_step`, which logs the score as ``name`` when due.
    Collective, as `mean_reward`."""

    def __init__(
        self, rollout: RolloutController, workflow: RolloutWorkflow, items: list[dict[str, object]], name: str
    ) -> None:
        self.rollout = rollout
        self.workflow = workflow
        self.items = items
        self.name = name

    def __call__(self) -> float:
        return mean_reward(self.rollout, self.workflow, self.items)

    def evaluate(self) -> dict[str, float]:
        """The score under its name, as `RunKit.end_step` logs it."""
        return {self.name: self()}


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
    A script calls `start` before its loop, `end_step` after each step and `finish` after the last.
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
        self.resumed: dict[str, object] = {}
        self.kept: dict[str, object] = {}
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

    def start(self) -> dict[str, object] | None:
        """Initialise ``engine`` and ``others`` for the run (their LR schedules span `total_steps`),
        connect ``engine`` to the rollout engine, then `resume`; returns what `resume` returns."""
        self.engine.initialize(self.finetune_spec)
        if self.rollout is not None:
            assert self.weight_meta is not None
            self.engine.connect_engine(self.rollout.engine, self.weight_meta)
        for other, _ in self.others.values():
            other.initialize(self.finetune_spec)
        return self.resume()

    def once(self, name: str, measure: Callable[[], T]) -> T:
        """``measure()`` on a fresh run (e.g. the held-out score before training); a resumed run
        gets the value its recover checkpoint kept under ``name`` instead. Every recover checkpoint
        keeps it. Call it after `start`."""
        value = self.resumed[name] if name in self.resumed else measure()
        self.kept[name] = value
        return value  # type: ignore[return-value]

    def resume(self) -> dict[str, object] | None:
        """Load the last recover checkpoint, if recovery is on and one exists: engines, data
        position, logger state; the rollout side gets the recovered weights and version and
        replays the prompts that were in flight. Sets `start_step`; returns what the checkpoint
        kept (the values of `once`, the rollout controller's state), or None for a fresh run. A
        fresh start that is a launcher's restart (``AREAL_LITE_ATTEMPT`` > 0) pushes the initial
        weights and version to the rollout side, which may hold the failed attempt's."""
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
        self.resumed = dict(info.extra)
        print_rank0(f"[areal-lite] resumed after step {self.start_step}")
        return info.extra

    def rl_step(
        self,
        actor: PolicyActor,
        workflow: RolloutWorkflow,
        global_step: int,
        *,
        should_accept: Callable[[TensorDict], bool] | None = None,
    ) -> tuple[TensorDict, dict[str, float]]:
        """The body of `examples/quickstart.py`'s loop, for scripts whose step is that one: a batch
        from the rollout controller (``workflow``; ``should_accept`` filters its trajectories), the
        actor's advantages, PPO update and LR step, then the new weights to the rollout side as
        version ``global_step + 1``; each stage timed. Returns the batch and the update's
        statistics for `end_step`."""
        if self.rollout is None or self.weight_meta is None:
            raise ValueError("rl_step needs a RunKit made with a rollout controller and its weight_meta")
        with self.timer("rollout"):
            batch = self.rollout.prepare_batch(self.dataloader, workflow=workflow, should_accept=should_accept)
        with self.timer("train"):
            actor.compute_advantages(batch)
            stats = actor.ppo_update(batch)
            actor.step_lr_scheduler()
        with self.timer("weight_sync"):
            sync_weights(self.rollout, self.engine, self.weight_meta, version=global_step + 1)
        return batch, stats

    def end_step(
        self,
        global_step: int,
        stats: dict[str, float],
        *,
        evaluate: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        """After step ``global_step``: save, dump a recover checkpoint (with the values `once`
        kept), evaluate when due (``evaluate()`` returns named scores) and log. Collective over the
        trainer's ranks. After a SIGTERM the recover checkpoint is written whatever its frequency,
        the evaluation skipped, and the process exits with 143."""
        step = StepInfo.at(global_step, self.steps_per_epoch)
        self.saver.save(self.engine, step, tokenizer=self.tokenizer, last=global_step + 1 == self.total_steps)
        state = dict(self.kept)
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

    def finish(self, result: str | None = None) -> None:
        """After the last step: `close` the loggers, destroy the rollout controller (with its
        engine), ``engine`` and ``others``, then print ``RESULT <result>`` on rank 0: the run's one
        line for the tests and the benchmark tables to read. Engines the run does not hold (a frozen
        reference) are the script's to destroy."""
        self.close()
        if self.rollout is not None:
            self.rollout.destroy()
        self.engine.destroy()
        for other, _ in self.others.values():
            other.destroy()
        if result is not None:
            print_rank0(f"RESULT {result}")
