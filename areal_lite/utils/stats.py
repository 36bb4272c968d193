"""Per-step statistics, recorded anywhere in a training step and reduced across ranks once.

Each rank records what it saw; `StatsTracker.export` gathers every rank's records (one
``all_gather_object`` of small Python values, so ranks may have recorded different keys without
deadlocking a per-key collective) and reduces them by kind:

============  ================================  ==============================================
method        exported keys                     reduction
============  ================================  ==============================================
``scalar``    ``name``                          mean over all observations of all ranks
``stat``      ``name/mean, /std, /min, /max``   over all elements (optionally masked) of all ranks
``total``     ``name``                          sum over ranks (token counts)
``timer``     ``timing/name``                   seconds summed within a rank, max over ranks
``dist``      ``name/mean, /min, /max``         plus the raw values for a histogram (staleness)
============  ================================  ==============================================
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class StepStats:
    """One step's reduced statistics: scalars, and raw values for histograms."""

    scalars: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class _Moments:
    count: float = 0.0
    total: float = 0.0
    sq_total: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf

    def add(self, other: _Moments) -> None:
        self.count += other.count
        self.total += other.total
        self.sq_total += other.sq_total
        self.lo = min(self.lo, other.lo)
        self.hi = max(self.hi, other.hi)


class StatsTracker:
    """Collects one step's statistics on this rank; `export` reduces them and starts afresh."""

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self._means: dict[str, list[float]] = {}
        self._moments: dict[str, _Moments] = {}
        self._totals: dict[str, float] = {}
        self._timers: dict[str, float] = {}
        self._dists: dict[str, list[float]] = {}

    def scalar(self, **values: float) -> None:
        """Record one observation of each named value (exported as their mean)."""
        for name, value in values.items():
            self._means.setdefault(name, []).append(float(value))

    def stat(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Record the elements of ``values`` (those where ``mask`` is true) for mean/std/min/max."""
        v = values.detach().float().flatten()
        if mask is not None:
            v = v[mask.flatten().bool()]
        if v.numel() == 0:
            return
        m = _Moments(float(v.numel()), float(v.sum()), float((v * v).sum()), float(v.min()), float(v.max()))
        self._moments.setdefault(name, _Moments()).add(m)

    def total(self, **values: float) -> None:
        """Add to named counters that are summed over ranks (tokens, samples)."""
        for name, value in values.items():
            self._totals[name] = self._totals.get(name, 0.0) + float(value)

    def dist(self, name: str, values: Iterable[float] | torch.Tensor) -> None:
        """Record values whose distribution is logged as a histogram (e.g. staleness)."""
        flat = values.flatten().tolist() if isinstance(values, torch.Tensor) else list(values)
        self._dists.setdefault(name, []).extend(float(x) for x in flat)

    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Add the seconds spent inside the block to ``timing/<name>``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{name}"
            self._timers[key] = self._timers.get(key, 0.0) + time.perf_counter() - start

    def _local(self) -> dict[str, object]:
        return {
            "means": {k: (sum(v), len(v)) for k, v in self._means.items()},
            "moments": self._moments,
            "totals": self._totals,
            "timers": self._timers,
            "dists": self._dists,
        }

    def export(self, group: dist.ProcessGroup | None = None) -> StepStats:
        """Reduce this step's records over the ranks of ``group`` (all ranks when torch.distributed
        is initialised; collective then) and clear them."""
        local = self._local()
        if dist.is_available() and dist.is_initialized():
            gathered: list[dict[str, object]] = [{} for _ in range(dist.get_world_size(group))]
            dist.all_gather_object(gathered, local, group=group)
        else:
            gathered = [local]
        self._clear()
        return _reduce(gathered)


def _reduce(parts: list[dict[str, object]]) -> StepStats:
    means: dict[str, tuple[float, int]] = {}
    moments: dict[str, _Moments] = {}
    totals: dict[str, float] = {}
    timers: dict[str, float] = {}
    dists: dict[str, list[float]] = {}
    for part in parts:
        for k, (s, n) in part["means"].items():  # type: ignore[attr-defined]
            s0, n0 = means.get(k, (0.0, 0))
            means[k] = (s0 + s, n0 + n)
        for k, m in part["moments"].items():  # type: ignore[attr-defined]
            moments.setdefault(k, _Moments()).add(m)
        for k, v in part["totals"].items():  # type: ignore[attr-defined]
            totals[k] = totals.get(k, 0.0) + v
        for k, v in part["timers"].items():  # type: ignore[attr-defined]
            timers[k] = max(timers.get(k, 0.0), v)
        for k, v in part["dists"].items():  # type: ignore[attr-defined]
            dists.setdefault(k, []).extend(v)
    out = StepStats()
    out.scalars.update({k: s / n for k, (s, n) in means.items()})
    for k, m in moments.items():
        mean = m.total / m.count
        out.scalars[f"{k}/mean"] = mean
        out.scalars[f"{k}/std"] = math.sqrt(max(m.sq_total / m.count - mean * mean, 0.0))
        out.scalars[f"{k}/min"] = m.lo
        out.scalars[f"{k}/max"] = m.hi
    out.scalars.update(totals)
    out.scalars.update(timers)
    for k, values in dists.items():
        if values:
            out.scalars[f"{k}/mean"] = sum(values) / len(values)
            out.scalars[f"{k}/min"] = min(values)
            out.scalars[f"{k}/max"] = max(values)
            out.histograms[k] = values
    return out
