"""Where per-step statistics go: the console (one short line per step under a progress bar, and
the full table every ``full_stats_every`` steps), wandb (offline unless configured) and
tensorboard (every statistic, every step), warnings on the signs of a failing run, and a PNG of
the reward and accuracy curves when the run ends.

On a terminal the short lines scroll above one tqdm bar for the run; anywhere else (a launcher's
log file, CI) there is no bar, and the lines are plain text with no carriage returns or escape
sequences.

Only rank 0 writes anything; on other ranks `StatsLogger.commit` is a no-op, so a script calls it
on every rank after the collective `StatsTracker.export`.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, is_dataclass
from typing import TextIO

import numpy as np
import torch.distributed as dist

from areal_lite.api.config import StatsLoggerConfig
from areal_lite.api.config_loader import check_choices
from areal_lite.utils.stats import StepStats

logger = logging.getLogger("areal_lite.stats")


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _format(value: float) -> str:
    return f"{value:.4g}"


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s" if m else f"{s}s"


def console_line(scalars: dict[str, float], keys: list[str]) -> str:
    """The per-step console line: ``label value`` for each ``label=key`` (or ``key``) of ``keys``
    present in ``scalars``, in order; ``timing/`` keys in seconds."""
    parts = []
    for entry in keys:
        label, _, key = entry.rpartition("=")
        if key in scalars:
            value = scalars[key]
            parts.append(f"{label or key} {value:.3g}{'s' if key.startswith('timing/') else ''}")
    return "  ".join(parts)


def stats_table(scalars: dict[str, float], width: int = 100) -> str:
    """Every statistic, sorted by key, in as many ``key value`` columns as fit in ``width``."""
    items = [(k, _format(v)) for k, v in sorted(scalars.items())]
    if not items:
        return ""
    kw, vw = max(len(k) for k, _ in items), max(len(v) for _, v in items)
    n_cols = max(1, (width + 3) // (kw + vw + 5))
    n_rows = -(-len(items) // n_cols)
    rows = []
    for r in range(n_rows):
        cells = [items[c * n_rows + r] for c in range(n_cols) if c * n_rows + r < len(items)]
        rows.append("   ".join(f"{k:<{kw}}  {v:>{vw}}" for k, v in cells).rstrip())
    return "\n".join(rows)


class _Console:
    """The console side of a `StatsLogger`: on a terminal, lines written above one tqdm bar; on
    anything else, plain lines (with the time left, which the missing bar would have shown)."""

    def __init__(self, stream: TextIO, total: int | None, desc: str) -> None:
        self.stream = stream
        self.total = total
        isatty = getattr(stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, file=stream)
        self._start: tuple[int, float] | None = None
        """(steps done, time) at the first step this console showed: the pace for the time left."""

    @property
    def width(self) -> int:
        return shutil.get_terminal_size((100, 24)).columns if self.tty else 100

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def step(self, done: int, line: str) -> None:
        """Show the line of a step after which ``done`` steps are done."""
        now = time.perf_counter()
        if self._start is None:
            self._start = (done, now)
        if self.bar is not None:
            self.write(f"step {done}  {line}")
            self.bar.n = done
            self.bar.refresh()
            return
        progress = f"step {done}/{self.total}" if self.total else f"step {done}"
        steps, seconds = done - self._start[0], now - self._start[1]
        left = ""
        if self.total and steps > 0 and done < self.total:
            left = f"  eta {_duration(seconds / steps * (self.total - done))}"
        self.write(f"{progress}  {line}{left}")

    def resume_at(self, done: int) -> None:
        if self.bar is not None:
            self.bar.n = done
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StatsLogger:
    """Logs one step's statistics per `commit` and draws the curves at `close`.

    The console (``config.console``; ``stream``, default stdout) gets one line per step of the
    ``config.console_keys`` and, every ``config.full_stats_every`` steps and at the last step,
    the table of every statistic; wandb and tensorboard get every statistic at every step.
    Derived values: ``timing/step`` (seconds since the previous commit) and, when the stats hold
    ``n_tokens``, ``perf/tokens_per_s``. Warnings (`logging` and the `warnings` list): the
    ``reward_std_key`` at 0 for ``collapse_steps`` steps in a row, the KL above ``kl_max`` (the
    ``kl_ref_key``, the KL to the reference, on steps that report it; else the ``kl_key``), and
    any non-finite value.
    """

    def __init__(
        self,
        config: StatsLoggerConfig,
        output_dir: str,
        *,
        total_steps: int | None = None,
        run_name: str = "areal-lite",
        run_config: object | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.config = config
        self.output_dir = output_dir
        self.total_steps = total_steps
        check_choices(config, "stats_logger.")
        self.enabled = _is_rank0()
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.warnings: list[str] = []
        self._collapsed_for = 0
        self._last_commit = time.perf_counter()
        self._console: _Console | None = None
        self._wandb = None
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if config.console:
            self._console = _Console(stream or sys.stdout, total_steps, run_name)
        if config.wandb_mode != "disabled":
            import wandb

            cfg = asdict(run_config) if is_dataclass(run_config) and not isinstance(run_config, type) else None
            self._wandb = wandb.init(
                project=config.wandb_project,
                name=run_name,
                dir=output_dir,
                mode=config.wandb_mode,
                config=cfg,
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
        if self._console is not None:
            self._console.step(step + 1, console_line(scalars, self.config.console_keys))
            every = self.config.full_stats_every
            if every > 0 and ((step + 1) % every == 0 or step + 1 == self.total_steps):
                table = stats_table(scalars, self._console.width - 2).replace("\n", "\n  ")
                self._console.write(f"step {step + 1}, all statistics:\n  {table}")
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
        # With a reference policy the drift from it is what to watch; else the per-update KL.
        key = self.config.kl_ref_key if self.config.kl_ref_key in scalars else self.config.kl_key
        kl = scalars.get(key)
        if kl is not None and kl > self.config.kl_max:
            advice = (
                "the policy has drifted far from the reference; consider a larger KL coefficient or a lower learning rate"
                if key == self.config.kl_ref_key
                else "the policy is moving fast; consider a lower learning rate or a tighter clip"
            )
            self._warn(f"step {step + 1}: {key}={kl:.4g} exceeds {self.config.kl_max}: {advice}")

    def state_dict(self) -> dict[str, object]:
        """The curves so far and the collapse streak, so a resumed run draws the whole run."""
        return {"history": {k: list(v) for k, v in self.history.items()}, "collapsed_for": self._collapsed_for}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.history = {k: [tuple(p) for p in v] for k, v in state["history"].items()}  # type: ignore[union-attr]
        self._collapsed_for = int(state["collapsed_for"])  # type: ignore[arg-type]
        if self._console is not None:
            last = max((p[0] for v in self.history.values() for p in v), default=-1)
            self._console.resume_at(last + 1)

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
        if self._console is not None:
            self._console.close()
            self._console = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        return png
