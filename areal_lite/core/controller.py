"""The rollout controller: what the training loop holds on the rollout side.

A `RolloutController` is built over an `InferenceEngine` and owns everything that is not
generation: the `WorkflowExecutor` that runs workflows under the staleness bound, the optional
`EpisodeWorker` child that runs them off the trainer's interpreter lock, and the order in which a
pause, a resume or a new policy version reaches each of them. The engine keeps generation, weight
updates, its version and the pausing of generation; it never sees the controller.

    rollout = make_rollout_controller(...)                      # a RolloutController, initialised
    batch = rollout.prepare_batch(dataloader, workflow=workflow)
    rollout.pause(); actor.update_weights(meta); rollout.set_version(step + 1); rollout.resume()

The controller tells the executor the version when it changes (no polling), and a pause reaches
the executor (no new rollouts), then the child's engine (its aborted generations wait), then the
engine (the servers stop); a resume goes the other way round.

Every batch it hands out can be recorded (`record_to`) and a recording handed out again instead of
generating (`replay_from`): `areal_lite.core.recording`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tensordict import TensorDict

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.engine import AcceptFn, InferenceEngine
from areal_lite.api.workflow import RolloutWorkflow
from areal_lite.core.episode_worker import EngineFactory, EpisodeWorker
from areal_lite.core.executor import WorkflowExecutor
from areal_lite.core.recording import BatchKind, BatchRecorder, BatchReplay
from areal_lite.cpu import freeze_startup_objects

logger = logging.getLogger(__name__)


class RolloutController:
    """Runs rollout workflows over ``engine`` for a training loop.

    ``engine_factory`` builds the engine of the child process that runs the workflows when
    ``config.episode_process`` is set (the trainer's ``engine`` then only controls the servers and
    receives weight updates); an embedded engine has none, so it refuses that option.
    """

    def __init__(
        self, engine: InferenceEngine, config: InferenceEngineConfig, engine_factory: EngineFactory | None = None
    ) -> None:
        if config.episode_process and engine_factory is None:
            raise ValueError(
                f"rollout.episode_process=true runs workflows in a child process, which cannot reach "
                f"{type(engine).__name__} in this one: use rollout servers (launcher.backend=areal or sglang)"
            )
        self.engine = engine
        self.config = config
        self._engine_factory = engine_factory
        self._episodes: EpisodeWorker | None = None
        self._executor: WorkflowExecutor | None = None
        self._recorder: BatchRecorder | None = None
        self._replay: BatchReplay | None = None

    # ----------------------------------------------------------------- lifecycle

    def initialize(self) -> None:
        """Initialise the engine, start the episode child (if configured) and the executor."""
        self.engine.initialize()
        if self.config.episode_process:
            assert self._engine_factory is not None
            self._episodes = EpisodeWorker(self.config, self._engine_factory)
            self._episodes.control("version", self.engine.get_version()).result()
            run_episode = self._episodes.run_episode
        else:
            engine = self.engine

            async def run_episode(workflow: RolloutWorkflow, data: dict[str, object]) -> TensorDict | None:
                return await workflow.arun_episode(engine, data)

        self._executor = WorkflowExecutor(self.config, run_episode, version=self.engine.get_version())
        self._executor.initialize()
        freeze_startup_objects()

    def destroy(self) -> None:
        """Stop the executor (cancelling running rollouts), the child and the engine."""
        if self._executor is not None:
            self._executor.destroy()
            self._executor = None
        if self._episodes is not None:
            self._episodes.close()
            self._episodes = None
        self.engine.destroy()

    @property
    def executor(self) -> WorkflowExecutor:
        if self._executor is None:
            raise RuntimeError("call initialize() before running rollouts")
        return self._executor

    # ----------------------------------------------------------------- record and replay

    def record_to(self, directory: str) -> None:
        """Write every batch handed out from now on to ``directory`` (`BatchRecorder`)."""
        self._recorder = BatchRecorder(directory)

    def replay_from(self, directory: str) -> None:
        """Hand out the batches recorded in ``directory`` instead of running workflows: `submit`
        is ignored and nothing is generated (`BatchReplay`)."""
        self._replay = BatchReplay(directory)

    def _hand_out(self, kind: BatchKind, produce: Callable[[], TensorDict]) -> TensorDict:
        if self._replay is not None:
            return self._replay.read(kind, self.get_version())
        batch = produce()
        if self._recorder is not None:
            staleness = self.last_batch_staleness if kind == "train" else []
            self._recorder.write(kind, batch, self.get_version(), staleness)
        return batch

    # ----------------------------------------------------------------- rollouts

    def submit(self, data: dict[str, object], workflow: RolloutWorkflow, should_accept: AcceptFn | None = None) -> None:
        """Queue one rollout of ``workflow`` on ``data``; it starts when the staleness bound admits
        it. A finished trajectory for which ``should_accept`` returns False is dropped (dynamic
        sampling) and does not count towards `wait`."""
        if self._replay is None:
            self.executor.submit(data, workflow, should_accept)

    def wait(self, count: int, timeout: float | None = None) -> TensorDict:
        """Block until ``count`` accepted trajectories are ready; return them concatenated and
        padded (oldest first). Raises TimeoutError after ``timeout`` seconds."""
        return self._hand_out("train", lambda: self.executor.wait(count, timeout=timeout))

    def rollout_batch(
        self, data: list[dict[str, object]], workflow: RolloutWorkflow, should_accept: AcceptFn | None = None
    ) -> TensorDict:
        """Run ``workflow`` on every item of ``data`` now, outside the staleness accounting (e.g.
        evaluation), and return the accepted trajectories in the order of ``data``."""
        return self._hand_out("eval", lambda: self.executor.rollout_batch(data, workflow, should_accept))

    def prepare_batch(
        self, dataloader: object, workflow: RolloutWorkflow, should_accept: AcceptFn | None = None
    ) -> TensorDict:
        """Keep the rollout pipeline full from ``dataloader`` (an iterable of lists of items,
        cycled across epochs) and return the next training batch: the trajectories of
        ``consumer_batch_size`` accepted episodes, within the staleness bound."""
        return self._hand_out("train", lambda: self.executor.prepare_batch(dataloader, workflow, should_accept))  # type: ignore[arg-type]

    # ----------------------------------------------------------------- weight-update sequence

    def pause(self) -> None:
        """Stop admitting rollouts and pause generation (interrupted generations resume after
        `resume`, each token keeping the version that produced it)."""
        self.executor.pause()
        if self._episodes is not None:
            self._episodes.control("pause", None).result()
        self.engine.pause()

    def resume(self) -> None:
        """Undo `pause`."""
        self.engine.resume()
        if self._episodes is not None:
            self._episodes.control("resume", None).result()
        self.executor.resume()

    def set_version(self, version: int) -> None:
        """The policy is now at ``version``: new tokens are tagged with it and the staleness bound
        admits rollouts for it."""
        self.engine.set_version(version)
        if self._episodes is not None:
            self._episodes.control("version", version).result()
        self.executor.set_version(version)

    def get_version(self) -> int:
        return self.engine.get_version()

    # ----------------------------------------------------------------- state and statistics

    def state_dict(self) -> dict[str, object]:
        """The prompts drawn but not consumed yet and the run's counters, for a recover checkpoint;
        the position in a recording or a replay."""
        state = self.executor.state_dict()
        for key, log in (("recorded", self._recorder), ("replayed", self._replay)):
            if log is not None:
                state[key] = log.index
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Replay a checkpoint's unconsumed prompts before new ones; continue its counters and its
        recording or replay where it was."""
        self.executor.load_state_dict(state)
        for key, log in (("recorded", self._recorder), ("replayed", self._replay)):
            if log is not None and key in state:
                log.index = int(state[key])  # type: ignore[call-overload]

    def stats(self) -> dict[str, float]:
        """Episode counters and the staleness of the last consumed batch, for the stats logger (in a
        replay: the batches replayed and the recorded staleness)."""
        if self._replay is None:
            return self.executor.stats()
        last = self._replay.last_staleness
        return {
            "rollout/replayed": float(self._replay.index),
            "rollout/staleness_max": float(max(last, default=0)),
            "rollout/staleness_mean": float(sum(last) / len(last)) if last else 0.0,
        }

    @property
    def last_batch_staleness(self) -> list[int]:
        """Per trajectory of the last batch: the version then minus its oldest token's version."""
        if self._replay is not None:
            return self._replay.last_staleness
        return self.executor.last_batch_staleness

    @property
    def episode_worker_pid(self) -> int | None:
        """The pid of the child running the workflows (``rollout.episode_process``), if any."""
        return None if self._episodes is None else self._episodes.pid
