"""Where per-step statistics go: the console (a line per step under a progress bar), wandb
(offline unless configured), tensorboard, warnings on the signs of a failing run, and a PNG of
the reward and accuracy curves when the run ends.

Only rank 0 writes anything; on other ranks `StatsLogger.commit` is a no-op, so a script calls it
on every rank after the collective `StatsTracker.export`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, is_dataclass

import numpy as np
import torch.distributed as dist

from areal_lite.api.config import StatsLoggerConfig
from areal_lite.utils.stats import StepStats

logger = logging.getLogger("areal_lite.stats")


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _format(value: float) -> str:
    return f"{value:.4g}"


class StatsLogger:
    """Logs one step's statistics per `commit` and draws the curves at `close`.

    Derived values: ``timing/step`` (seconds since the previous commit) and, when the stats hold
    ``n_tokens``, ``perf/tokens_per_s``. Warnings (`logging` and the `warnings` list): the
    ``reward_std_key`` at 0 for ``collapse_steps`` steps in a row, the ``kl_key`` above ``kl_max``,
    and any non-finite value.
    """

    def __init__(
        self,
        config: StatsLoggerConfig,
        output_dir: str,
        *,
        total_steps: int | None = None,
        run_name: str = "areal-lite",
        run_config: object | None = None,
    ) -> None:
        self.config = config
        self.output_dir = output_dir
        self.total_steps = total_steps
        if config.wandb_mode not in ("disabled", "offline", "online"):
            raise ValueError(f"stats_logger.wandb_mode must be disabled, offline or online, got {config.wandb_mode!r}")
        self.enabled = _is_rank0()
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.warnings: list[str] = []
        self._collapsed_for = 0
        self._last_commit = time.perf_counter()
        self._bar = None
        self._wandb = None
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if config.console:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc=run_name, unit="step", dynamic_ncols=True)
        if config.wandb_mode != "disabled":
            import wandb

            cfg = asdict(run_config) if is_dataclass(run_config) and not isinstance(run_config, type) else None
            self._wandb = wandb.init(
                project=config.wandb_project, name=run_name, dir=output_dir, mode=config.wandb_mode, config=cfg,
                reinit="finish_previous",  # a run left open by an earlier logger in this process
            )
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))

    def commit(self, step: int, *stats: dict[str, float] | StepStats) -> None:
        """Log the statistics of the finished step ``step`` (global, from 0), merged left to right."""
        now = time.perf_counter()
        step_seconds, self._last_commit = now - self._last_commit, now
        if not self.enabled:
            return
        scalars: dict[str, float] = {}
        histograms: dict[str, list[float]] = {}
        for s in stats:
            if isinstance(s, StepStats):
                scalars.update(s.scalars)
                histograms.update(s.histograms)
            else:
                scalars.update({k: float(v) for k, v in s.items()})
        scalars["timing/step"] = step_seconds
        if "n_tokens" in scalars and step_seconds > 0:
            scalars["perf/tokens_per_s"] = scalars["n_tokens"] / step_seconds
        for key in self.config.plot_keys:
            if key in scalars:
                self.history.setdefault(key, []).append((step, scalars[key]))
        self._check(step, scalars)
        if self._bar is not None:
            line = " | ".join(f"{k} {_format(v)}" for k, v in sorted(scalars.items()))
            self._bar.write(f"step {step + 1}: {line}")
            self._bar.n = step + 1
            self._bar.refresh()
        if self._wandb is not None:
            import wandb

            payload: dict[str, object] = dict(scalars)
            payload.update({k: wandb.Histogram(v) for k, v in histograms.items() if v})
            self._wandb.log(payload, step=step)
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            for k, v in histograms.items():
                if v:
                    self._tb.add_histogram(k, np.asarray(v), step)
            self._tb.flush()

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        logger.warning(message)

    def _check(self, step: int, scalars: dict[str, float]) -> None:
        bad = sorted(k for k, v in scalars.items() if not math.isfinite(v))
        if bad:
            self._warn(f"step {step + 1}: non-finite statistics {', '.join(bad)}")
        std = scalars.get(self.config.reward_std_key)
        if std is not None:
            self._collapsed_for = self._collapsed_for + 1 if abs(std) < 1e-8 else 0
            if self.config.collapse_steps > 0 and self._collapsed_for == self.config.collapse_steps:
                self._warn(
                    f"step {step + 1}: {self.config.reward_std_key} has been 0 for {self._collapsed_for} steps: every "
                    "sample scores alike, so group-normalised advantages carry no signal (task too easy or too hard, "
                    "or the policy collapsed)"
                )
        kl = scalars.get(self.config.kl_key)
        if kl is not None and kl > self.config.kl_max:
            self._warn(
                f"step {step + 1}: {self.config.kl_key}={kl:.4g} exceeds {self.config.kl_max}: the policy is moving "
                "fast; consider a lower learning rate or a tighter clip"
            )

    def state_dict(self) -> dict[str, object]:
        """The curves so far and the collapse streak, so a resumed run draws the whole run."""
        return {"history": {k: list(v) for k, v in self.history.items()}, "collapsed_for": self._collapsed_for}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.history = {k: [tuple(p) for p in v] for k, v in state["history"].items()}  # type: ignore[union-attr]
        self._collapsed_for = int(state["collapsed_for"])  # type: ignore[arg-type]
        if self._bar is not None:
            last = max((p[0] for v in self.history.values() for p in v), default=-1)
            self._bar.n = last + 1
            self._bar.refresh()

    def plot(self, path: str | None = None) -> str | None:
        """Draw each recorded ``plot_keys`` curve in its own panel; returns the PNG path, or None
        when there is nothing to draw (or on ranks other than 0)."""
        curves = [(k, self.history[k]) for k in self.config.plot_keys if self.history.get(k)]
        if not self.enabled or not curves:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(len(curves), 1, figsize=(6, 2.6 * len(curves)), squeeze=False)
        for ax, (key, points) in zip(axes[:, 0], curves):
            ax.plot([p[0] + 1 for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None)
            ax.set_title(key)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        path = path or os.path.join(self.output_dir, "curves.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> str | None:
        """Draw the curves, close the progress bar, wandb and tensorboard; returns the PNG path."""
        png = self.plot()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        return png
