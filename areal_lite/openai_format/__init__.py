"""OpenAI's wire formats, read and written once for everything that speaks them: our server's
OpenAI routes (`areal_lite.engines.server`) and the agent workflows' recording proxy
(`areal_lite.workflows.openai_proxy`): chat-completions requests (``chat.py``), the Responses API
(``responses.py``) and tool calls in generated text (``tool_calls.py``)."""
