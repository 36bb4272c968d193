"""Our HTTP server over the embedded engine (``python -m areal_lite.engines.server``), answering like
an SGLang server and like vLLM's OpenAI server (docs/protocol.md).

``app.py`` builds the server and starts it, over the command line of ``server_args.py``; beside it,
one module per family of routes: SGLang's ``/generate`` (``generate_routes.py``) and its
information, control and weight-update routes (``sglang_routes.py``), the OpenAI routes
(``openai_routes.py``: what their requests share is read by ``openai_request.py``, their answers
written by ``openai_answers.py``; the Responses API in ``responses_routes.py``; streaming in
``streaming.py``), vLLM's token-in-token-out route (``tokens_routes.py``) and RL control routes
(``vllm_routes.py``), SGLang's LoRA routes (``lora_routes.py``); what they share is in
``common.py``. It serves the embedded engine's `Scheduler` and never imports a train engine.
"""
