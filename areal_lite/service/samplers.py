"""The service's sampling sessions: what each samples from (a snapshot), and the generators and
adapters that serve them.

Every LoRA snapshot of a base model is an adapter in that base model's one `Generator`, loaded
when first sampled (from the snapshot's tensors, or from its ``sampler_weights`` directory) and
dropped when no sampling session uses it any more; a full fine-tuning snapshot gets a `Generator`
of its own, at most ``max_full_samplers`` of them loaded at once. A run's unnamed snapshots
(``save_weights_and_get_sampling_client``) are kept for its last ``unnamed_snapshots_per_run``
saves: each one holds a copy of the adapter in memory. Used from the engine thread only.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

from safetensors.torch import load_file

from areal_lite.service.config import ServiceConfig
from areal_lite.service.runs import BaseModel, Snapshot, Storage, dtype_of, remove_scratch
from areal_lite.service.sampler import Generator


@dataclass
class SamplerSession:
    """A sampling session: what it samples from, and under which adapter name."""

    sampling_session_id: str
    session_id: str
    snapshot: Snapshot
    key: str
    """Its adapter's name in the base model's generator (or its full generator's key)."""
    model_path: str | None = None
    clients: int = 1


class Samplers:
    """Every sampling session, by id, and the generators that serve them."""

    def __init__(self, cfg: ServiceConfig, bases: dict[str, BaseModel], storage: Storage) -> None:
        self.cfg, self.bases, self.storage = cfg, bases, storage
        self.sessions: dict[str, SamplerSession] = {}
        self._full: OrderedDict[str, Generator] = OrderedDict()
        self._unnamed: dict[str, list[str]] = {}
        """Per run, its unnamed snapshots' sampling sessions, oldest first."""

    def get(self, sid: str) -> SamplerSession | None:
        return self.sessions.get(sid)

    def add(self, sampler: SamplerSession, unnamed_of: str | None = None) -> None:
        """Register ``sampler``; an unnamed snapshot of run ``unnamed_of`` releases the run's
        oldest beyond the last few."""
        self.sessions[sampler.sampling_session_id] = sampler
        if unnamed_of is not None:
            kept = self._unnamed.setdefault(unnamed_of, [])
            kept.append(sampler.sampling_session_id)
            while len(kept) > self.cfg.unnamed_snapshots_per_run:
                self.drop(kept.pop(0))

    def drop(self, sid: str) -> None:
        """Forget a sampling session, and its adapter or generator once no other session uses it."""
        sampler = self.sessions.pop(sid, None)
        if sampler is None or any(s.key == sampler.key for s in self.sessions.values()):
            return
        if sampler.snapshot.kind == "lora" and "generator" in vars(self.bases[sampler.snapshot.base]):
            self.bases[sampler.snapshot.base].generator.drop_adapter(sampler.key)
        self._full.pop(sampler.key, None)
        remove_scratch(sampler.snapshot, self.storage)

    def generator(self, sampler: SamplerSession) -> tuple[Generator, str | None]:
        """The generator and the adapter (None: its own weights) ``sampler`` samples with,
        loading them when needed."""
        snap = sampler.snapshot
        if snap.kind == "base":
            return self.bases[snap.base].generator, None
        if snap.kind == "lora":
            gen = self.bases[snap.base].generator
            if not gen.has_adapter(sampler.key):
                tensors = snap.tensors
                if tensors is None:
                    assert snap.directory is not None
                    tensors = load_file(os.path.join(snap.directory, "adapter_model.safetensors"))
                assert snap.adapter_config is not None
                gen.add_adapter(sampler.key, snap.adapter_config, tensors)
            return gen, sampler.key
        gen = self._full.get(sampler.key)
        if gen is None:
            while len(self._full) >= self.cfg.max_full_samplers:
                self._full.popitem(last=False)
            assert snap.directory is not None
            gen = Generator(snap.directory, dtype_of(self.cfg), seed=self.cfg.seed)
            self._full[sampler.key] = gen
        self._full.move_to_end(sampler.key)
        return gen, None
