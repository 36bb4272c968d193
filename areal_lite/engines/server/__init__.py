"""Our HTTP server over the embedded engine (``python -m areal_lite.engines.server``), answering like
an SGLang server and like vLLM's OpenAI server (docs/protocol.md).

``app.py`` builds the server and its SGLang-protocol routes; beside it, one module per family of
routes: the OpenAI routes (``openai_routes.py``, the Responses API in ``responses_routes.py``,
streaming in ``streaming.py``), vLLM's token-in-token-out route (``tokens_routes.py``) and RL
control routes (``vllm_routes.py``), SGLang's LoRA routes (``lora_routes.py``); what they share is
in ``common.py``. It serves the embedded engine's `Scheduler` and never imports a train engine.
"""
