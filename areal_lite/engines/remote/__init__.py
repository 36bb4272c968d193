"""Clients of generation servers on the network: `RemoteEngine` (``client.py``: what every client
shares: partial rollouts, retries on another server, pause and weight updates fanned out), its
protocols `RemoteSGLangEngine` (``sglang.py``) and `RemoteVLLMEngine` (``vllm.py``), the
`ServerFleet` they talk through (``fleet.py``: HTTP calls, routing, which servers are alive) and
the extension vLLM's workers load for weight updates (``vllm_worker.py``).
"""
