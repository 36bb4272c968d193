"""The engines a config asks for: `make_train_engine` (``actor.backend``) and
`make_rollout_controller` (``launcher.backend`` with ``weight_update``), with the dtype check
between the trainer and the rollout engine (`check_dtypes`)."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import replace

import torch

from areal_lite.api.config import TrainEngineConfig
from areal_lite.api.engine import TrainEngine
from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.api.io import WeightUpdateMeta
from areal_lite.core.controller import RolloutController
from areal_lite.kit.ranks import is_rank0

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
    from areal_lite.cpu.precision import compute_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trainer = str(compute_dtype(cfg.actor.dtype, device)).removeprefix("torch.")
    rollout = rollout_dtype(cfg)
    resolved = None if rollout in (None, "auto") else rollout
    if resolved is not None and resolved != trainer and is_rank0():
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


def make_rollout_controller(
    cfg: RLExperimentConfig, model_dir: str | None = None
) -> tuple[RolloutController, WeightUpdateMeta]:
    """An initialised `RolloutController` for ``cfg.launcher.backend`` and the `WeightUpdateMeta`
    that reaches its engine.

    ``local`` generates in this process (`LocalInferenceEngine` on ``model_dir``, default
    ``cfg.actor.path``; weights copied in place). ``areal`` and ``sglang`` talk to the servers the
    launcher started (``cfg.rollout.addresses``) with `RemoteSGLangEngine`, ``vllm`` with
    `RemoteVLLMEngine`; weights go through the disk or a process group (``cfg.weight_update``).
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
        control = is_rank0()
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
        else:
            raise ValueError(f"weight_update must be disk or distributed, got {cfg.weight_update!r}")
    rollout.initialize()
    return rollout, meta
