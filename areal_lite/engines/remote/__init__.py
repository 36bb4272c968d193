"""Clients of generation servers on the network: `RemoteEngine` (``client.py``: what every client
shares: partial rollouts, retries on another server, pause and weight updates fanned out), its
protocols `RemoteSGLangEngine` (``sglang.py``) and `RemoteVLLMEngine` (``vllm.py``), the
`ServerFleet` they talk through (``fleet.py``: HTTP calls, routing, which servers are alive) and
the extension vLLM's workers load for weight updates (``vllm_worker.py``).

``from areal_lite.engines.remote import RemoteSGLangEngine`` loads only the module it names.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RemoteEngine": "areal_lite.engines.remote.client",
    "RemoteSGLangEngine": "areal_lite.engines.remote.sglang",
    "RemoteVLLMEngine": "areal_lite.engines.remote.vllm",
    "ServerFleet": "areal_lite.engines.remote.fleet",
}

__all__ = ["RemoteEngine", "RemoteSGLangEngine", "RemoteVLLMEngine", "ServerFleet"]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
