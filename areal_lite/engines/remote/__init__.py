"""Clients of generation servers on the network: `RemoteEngine` (``client.py``: what every client
shares: retries on another server, pause and weight updates fanned out), what a generation has
produced across resumptions (``partial_rollout.py``), its protocols `RemoteSGLangEngine`
(``sglang.py``) and `RemoteVLLMEngine` (``vllm.py``), the `ServerFleet` they talk through
(``fleet.py``: HTTP calls, routing, which servers are alive), the `FleetMonitor` that watches its
servers' health (``monitor.py``) and the extension vLLM's workers load for weight updates
(``vllm_worker.py``).
"""
