"""The service's settings (`ServiceConfig`), one documented field each; the command line of
``python -m areal_lite.service`` fills them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServiceConfig:
    """What `areal_lite.service.app.Service` serves and how."""

    models: dict[str, str] = field(default_factory=dict)
    """Base models by the name clients pass as ``base_model`` -> HF model directory. A model's
    name is what the SDK's ``get_tokenizer`` loads, so a directory path (or a name that resolves
    to one from where the client runs) keeps that working offline."""
    workdir: str = "tinker_service"
    """Where checkpoints (``tinker://<run>/weights/<name>`` and ``sampler_weights``) and each
    run's metadata are written; a restarted service reads them back from here."""
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float32"
    """Compute dtype of training and sampling (float32, bfloat16, or auto: bfloat16 where the CPU
    or GPU computes it natively). float32 keeps sampler and trainer log-probabilities equal."""
    lora_alpha: float = 32.0
    """LoRA scale numerator (the adapter's output is multiplied by alpha / rank)."""
    max_tokens_per_mb: int = 8192
    """Token budget of one forward/backward micro-batch."""
    seed: int = 0
    """Seed of adapters created without one and of samples drawn without a seed."""
    api_key: str | None = None
    """When set, every request must carry it (``X-API-Key``, the SDK's ``api_key``); otherwise
    any key is accepted (the SDK insists on one that starts with ``tml-``)."""
    session_timeout: float = 600.0
    """Seconds without a heartbeat or request after which a session ends and its models and
    samplers are released (the SDK heartbeats every 10 s)."""
    poll_timeout: float = 40.0
    """Longest a ``retrieve_future`` call waits for its result before answering ``try_again``."""
    result_ttl: float = 900.0
    """Seconds a finished request's result is kept for ``retrieve_future``."""
    compress_requests: bool = True
    """Tell the SDK to zstd-compress its protobuf ``forward_backward`` bodies."""
    max_sampler_adapters: int = 64
    """LoRA sampler snapshots held in a sampler at once (least recently used dropped first;
    named snapshots are reloaded from disk when asked for again)."""
    unnamed_snapshots_per_run: int = 4
    """Unnamed sampler snapshots (``save_weights_and_get_sampling_client``) kept per run: a newer
    one releases the oldest beyond this many (a named ``save_weights_for_sampler`` stays on disk)."""
    max_full_samplers: int = 2
    """Full fine-tuning sampler snapshots (each a whole model) held at once."""
