"""A client's session: the training runs and samplers it made, when it was last heard from, and
the sampled sequences recorded for it (``record_stability_info``, read by ``stable_reinforce``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from areal_lite.service.runs import Recorded
from areal_lite.service.wire import Samples

RECORD_TTL = 24 * 3600.0
"""How long a sampled sequence's recorded stability information stays (the Tinker docs' day)."""


@dataclass
class Session:
    session_id: str
    last_seen: float = field(default_factory=time.monotonic)
    finished: bool = False
    runs: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    recorded: dict[str, Recorded] = field(default_factory=dict)
    """Sampled sequences recorded for stable_reinforce, by sequence id (engine thread only)."""

    def record(self, sequence_ids: list[str], prompt: list[int], samples: Samples) -> None:
        """Record the sampled ``samples`` of ``prompt`` under ``sequence_ids``, and forget the
        records older than `RECORD_TTL` (engine thread)."""
        for seq_id, s in zip(sequence_ids, samples.sequences):
            self.recorded[seq_id] = Recorded(prompt, s.tokens, s.logprobs)
        cutoff = time.time() - RECORD_TTL
        for old in [k for k, r in self.recorded.items() if r.time < cutoff]:
            del self.recorded[old]
