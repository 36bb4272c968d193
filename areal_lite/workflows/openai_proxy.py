"""A recording OpenAI chat-completions endpoint in front of an `InferenceEngine`, for agents.

An agent written against the ``openai`` SDK (directly, or through a framework on top of it such as
the ``openai-agents`` SDK) is handed `RecordingProxy.client()`: a real ``openai.AsyncOpenAI`` whose
HTTP transport hands each request to the proxy in this process instead of a socket. The proxy
renders the request's messages and tools with the policy's chat template, generates through
``engine.agenerate`` and answers as our server's ``/v1/chat/completions`` does (Hermes tool calls,
docs/protocol.md), reading the request with the same code (`areal_lite.openai_format.chat`). It
keeps every call's tokens, log-probabilities and policy versions.

Trajectories. A call whose rendered prompt text starts with the whole text of a trajectory recorded
so far (its prompts and the model's outputs) extends that trajectory: the engine is sent that
trajectory's tokens followed by the tokens of the rest of the text, so the model sees its own
earlier tokens (never a re-tokenization of them), and the trajectory stays one sequence in which
only generated tokens are trained on. A call that extends none (the first one; one after a template
rewrote history, e.g. dropped earlier reasoning; a sub-agent's separate conversation; a reply the
template writes back differently from what the model wrote) starts a new trajectory, its prompt
tokenized afresh. Every trajectory is therefore exactly what the model saw and produced, whatever
the framework or the template does, and every generated token is in exactly one trajectory.

Sampling is the workflow's `GenerationConfig`; a request's ``temperature``, ``top_p``, ``top_k``,
``stop`` and ``min_tokens`` override it (the log-probabilities stay the policy's own, at temperature
1), its ``max_tokens`` can only lower the budget. A request's ``seed`` is accepted and not used:
the episodes of a group must sample independently, whatever seed their harness sends. ``n`` above 1
is refused (an episode's samples are separate episodes), as are ``top_logprobs`` (the engines
report the sampled token's log-probability only) and the options no areal-lite engine honours.

Routes: ``/v1/chat/completions``, ``/v1/completions`` (a text prompt continued as it is, no chat
template) and ``/v1/responses`` (OpenAI's Responses API, read as the chat request it stands for by
`areal_lite.openai_format.responses`, what the ``openai-agents`` SDK's default model calls), plain
or streamed, and ``/v1/models``; errors are OpenAI's error object. The
proxy answers in process (`client`), or over HTTP for programs in other processes
(`areal_lite.workflows.proxy_server`).
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import GenerationConfig, ModelRequest, ModelResponse
from areal_lite.openai_format.chat import (
    BadRequest,
    TokenBytes,
    assistant_message,
    bool_field,
    chat_finish_reason,
    chat_tools,
    error_body,
    float_field,
    int_field,
    max_completion_tokens,
    refuse_unsupported,
    render_chat,
    shaping_fields,
    stop_strings,
    token_usage,
)
from areal_lite.openai_format.responses import (
    ResponseEvents,
    chat_body,
    finished_response,
    new_response_id,
    wants_logprobs,
)
from areal_lite.openai_format.tool_calls import ToolCall, parse_tool_calls
from areal_lite.workflows.trajectory import TokenTrace

if TYPE_CHECKING:
    import httpx
    import openai

MODEL_NAME = "areal-lite-policy"
"""What ``/v1/models`` lists. Requests may name any model: every call goes to the policy."""


class BudgetExhausted(BadRequest):
    """A call past the episode's budget (``max_calls``, ``max_context_tokens``): answered with a
    400, which the agent's SDK raises; the workflow then ends the episode."""


@dataclass
class RecordedCall:
    """One chat call as the engine saw it."""

    prompt_ids: list[int]
    response: ModelResponse
    trajectory: int
    """Index of the trajectory it belongs to (`RecordingProxy.traces`)."""
    extended: bool
    """It continued that trajectory (rather than starting it)."""


@dataclass(eq=False)
class _Trajectory:
    trace: TokenTrace
    text: str
    """The text ``trace.input_ids`` stand for: rendered prompts and the model's decoded outputs."""
    busy: bool = False
    """A call on it is generating; a concurrent call cannot extend it and starts its own."""


class RecordingProxy:
    """One episode's OpenAI endpoint: answers chat calls with ``engine`` and records them.

    Args:
        engine: the rollout engine (only ``agenerate`` is called).
        tokenizer: the policy's HF tokenizer with a chat template.
        gconfig: the sampling of each call (``n_samples`` is ignored).
        max_calls: calls allowed; later ones are refused with `BudgetExhausted`.
        max_context_tokens: a call whose prompt leaves no room below this is refused with
            `BudgetExhausted`, and generation stops at it (None = the engine's own limit).
        template_kwargs: passed to the chat template (e.g. ``enable_thinking``); a request's
            ``chat_template_kwargs`` override them.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: object,
        gconfig: GenerationConfig,
        *,
        max_calls: int = 32,
        max_context_tokens: int | None = None,
        template_kwargs: dict[str, object] | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer)
        self.gconfig = gconfig.new(n_samples=1)
        self.max_calls = max_calls
        self.max_context_tokens = max_context_tokens
        self.template_kwargs = template_kwargs or {}
        self.calls: list[RecordedCall] = []
        self.exhausted: BudgetExhausted | None = None
        """Set when a call was refused for the budget: the episode ended there."""
        self.error: Exception | None = None
        """Set when a generation failed: the episode cannot be trusted and fails."""
        self._trajectories: list[_Trajectory] = []

    @property
    def traces(self) -> list[TokenTrace]:
        """The recorded trajectories, in the order they started."""
        return [t.trace for t in self._trajectories]

    async def chat_completion(self, body: dict[str, object]) -> dict[str, object]:
        """Answer one chat-completions request body with OpenAI's chat completion object."""
        refuse_unsupported(body)
        if int_field(body, "top_logprobs", 0):
            raise BadRequest(
                "top_logprobs is not recorded: the proxy reports the sampled token's log-probability only",
                param="top_logprobs",
            )
        tools = chat_tools(body)
        text = render_chat(self.tokenizer, body, **self.template_kwargs)
        resp, gconfig = await self._generate_recorded(body, text)
        return self._completion(body, resp, gconfig.stop, tools is not None)

    async def text_completion(self, body: dict[str, object]) -> dict[str, object]:
        """Answer one (legacy) completions request body, ``/v1/completions``: the prompt is text
        the policy continues as it is (no chat template), recorded like a chat call; ``logprobs``
        0 reports the sampled tokens' log-probabilities (more alternatives are not recorded)."""
        refuse_unsupported(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be one string: the samples of a prompt are separate episodes", param="prompt")
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs != 0):
            raise BadRequest(
                "logprobs must be 0 or absent: the proxy reports the sampled token's log-probability only",
                param="logprobs",
            )
        resp, gconfig = await self._generate_recorded(body, prompt)
        text = self._cut_at_stop(self._decode(resp.output_tokens, skip_special=True), resp, gconfig.stop)
        choice: dict[str, object] = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": _finish_reason(resp),
        }
        if logprobs is not None:
            tokens = [self._decode([t], skip_special=False) for t in resp.output_tokens]
            offsets = list(itertools.accumulate((len(t) for t in tokens), initial=len(prompt)))[:-1]
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(resp.output_logprobs),
                                  "top_logprobs": None, "text_offset": offsets}  # fmt: skip
        return _completion_object("cmpl", "text_completion", body, choice, resp)

    async def _generate_recorded(self, body: dict[str, object], text: str) -> tuple[ModelResponse, GenerationConfig]:
        """Generate a continuation of the prompt ``text`` (a trajectory's text, extended, or a new
        one) and record it: the tokens, log-probabilities and versions the call produced."""
        if int_field(body, "n", 1) != 1:
            raise BadRequest("n must be 1: the samples of a prompt are separate episodes")
        bool_field(body, "stream", False)
        if len(self.calls) >= self.max_calls:
            raise self._exhaust(f"this episode's {self.max_calls} model calls are used up")
        extended = self._extended_by(text)
        context = self._encode(text[len(extended.text) :] if extended else text)
        prompt = (list(extended.trace.input_ids) if extended else []) + context
        gconfig = self._sampling(body, len(prompt))
        if extended:
            extended.busy = True
        try:
            resp = await self.engine.agenerate(ModelRequest(input_ids=prompt, gconfig=gconfig))
        finally:
            if extended:
                extended.busy = False
        traj = extended or _Trajectory(TokenTrace([]), "")
        if extended is None:
            self._trajectories.append(traj)
        traj.trace.add_context(context)
        traj.trace.add_generated(resp)
        traj.text = text + self._decode(resp.output_tokens, skip_special=False)
        index = next(i for i, t in enumerate(self._trajectories) if t is traj)
        self.calls.append(RecordedCall(prompt, resp, index, extended is not None))
        return resp, gconfig

    def client(self) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` whose requests this proxy answers in process (no socket)."""
        import httpx
        import openai

        transport = httpx.MockTransport(self._handle)  # httpx's in-process transport
        return openai.AsyncOpenAI(
            base_url="http://areal-lite-proxy/v1",
            api_key="areal-lite",
            max_retries=0,
            http_client=httpx.AsyncClient(transport=transport),
        )

    # ------------------------------------------------------------------ internals

    def _exhaust(self, message: str) -> BudgetExhausted:
        self.exhausted = BudgetExhausted(message)
        return self.exhausted

    def _extended_by(self, text: str) -> _Trajectory | None:
        """The trajectory with the longest text that ``text`` starts with, if any is free."""
        fits = [t for t in self._trajectories if not t.busy and text.startswith(t.text)]
        return max(fits, key=lambda t: len(t.text), default=None)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(  # type: ignore[attr-defined]
            ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
        )

    def _sampling(self, body: dict[str, object], prompt_len: int) -> GenerationConfig:
        g = self.gconfig
        budget = g.max_new_tokens
        asked = max_completion_tokens(body)
        if asked is not None:
            if asked < 1:
                raise BadRequest(f"max_tokens must be >= 1, got {asked}")
            budget = min(budget, asked)
        if self.max_context_tokens is not None:
            room = self.max_context_tokens - prompt_len
            if room < 1:
                raise self._exhaust(
                    f"This model's maximum context length is {self.max_context_tokens} tokens; "
                    f"the conversation has {prompt_len}."
                )
            budget = min(budget, room)
        temperature = float_field(body, "temperature", 0.0 if g.greedy else g.temperature)
        top_k = int_field(body, "top_k", g.top_k)
        shaping = {k: v for k, v in shaping_fields(body).items() if body.get(k) is not None}
        if shaping.pop("logit_bias", None):
            raise BadRequest("logit_bias is not supported by the recording proxy", param="logit_bias")
        return g.new(
            **shaping,
            max_new_tokens=budget,
            min_new_tokens=min(int_field(body, "min_tokens", g.min_new_tokens), budget),
            greedy=temperature < 1e-6,
            temperature=temperature if temperature >= 1e-6 else g.temperature,
            top_p=float_field(body, "top_p", g.top_p),
            top_k=-1 if top_k == 0 else top_k,  # vLLM: 0 or -1 = every token
            stop=[*g.stop, *stop_strings(body)],
        )

    def _completion(
        self, body: dict[str, object], resp: ModelResponse, stop: list[str], with_tools: bool
    ) -> dict[str, object]:
        text = self._cut_at_stop(self._decode(resp.output_tokens, skip_special=True), resp, stop)
        content, calls = parse_tool_calls(text) if with_tools else (text, [])
        choice: dict[str, object] = {
            "index": 0,
            "message": assistant_message(content, calls),
            "logprobs": None,
            "finish_reason": chat_finish_reason(_finish_reason(resp), calls),
        }
        if bool_field(body, "logprobs", False):
            entries = []
            for token, logprob in zip(resp.output_tokens, resp.output_logprobs):
                s = self._decode([token], skip_special=False)
                entries.append(
                    {"token": s, "logprob": logprob, "bytes": self.token_bytes(token, s), "top_logprobs": []}
                )
            choice["logprobs"] = {"content": entries}
        out = _completion_object("chatcmpl", "chat.completion", body, choice, resp)
        if bool_field(body, "return_token_ids", False):
            out["prompt_token_ids"] = resp.input_tokens
            choice["token_ids"] = resp.output_tokens
        return out

    @staticmethod
    def _cut_at_stop(text: str, resp: ModelResponse, stop: list[str]) -> str:
        """``text`` up to the first stop string it matched, as servers return it."""
        if resp.stop_reason != "stop":
            return text
        cuts = [text.index(s) for s in stop if s in text]
        return text[: min(cuts)] if cuts else text

    async def responses(self, body: dict[str, object]) -> dict[str, object]:
        """Answer one Responses API request body (``/v1/responses``) with OpenAI's response
        object: the request is read as the chat request it stands for and recorded like one."""
        chat = chat_body(body)
        out = await self.chat_completion(chat)
        [choice] = out["choices"]  # type: ignore[misc]
        message = choice["message"]
        calls = [
            ToolCall(c["function"]["name"], c["function"]["arguments"], c["id"]) for c in message.get("tool_calls", [])
        ]
        logprobs = choice["logprobs"]["content"] if choice["logprobs"] and wants_logprobs(body) else None
        use: dict[str, int] = out["usage"]  # type: ignore[assignment]
        return finished_response(
            body,
            new_response_id(),
            str(out["model"]),
            message["content"] or "",
            calls,
            logprobs,
            finish=str(choice["finish_reason"]),
            prompt_tokens=use["prompt_tokens"],
            output_tokens=use["completion_tokens"],
            item_id=f"msg_{uuid.uuid4().hex}",
        )

    async def handle(self, method: str, path: str, content: bytes) -> tuple[int, str, bytes]:
        """One HTTP request to the proxy: (status, content type, body). Routes: ``GET
        /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/chat/completions``, ``POST
        /v1/completions`` and ``POST /v1/responses`` (plain or ``stream: true``); every error is
        OpenAI's error object."""
        json_type = "application/json"

        def error(
            message: str, status: int, param: str | None = None, code: str | None = None
        ) -> tuple[int, str, bytes]:
            return status, json_type, json.dumps(error_body(message, status, param, code)).encode()

        model = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "areal-lite"}
        route = path[path.index("/v1/") + 3 :] if "/v1/" in path else path
        if method == "GET" and route == "/models":
            return 200, json_type, json.dumps({"object": "list", "data": [model]}).encode()
        if method == "GET" and route.startswith("/models/"):
            return 200, json_type, json.dumps({**model, "id": route.removeprefix("/models/")}).encode()
        handlers = {
            "/chat/completions": self.chat_completion,
            "/completions": self.text_completion,
            "/responses": self.responses,
        }
        if route not in handlers:
            return error(f"{method} {path} is not a route of the recording proxy", 404, code="unknown_url")
        if method != "POST":
            return error(f"{method} is not allowed on {path}: use POST", 405)
        try:
            body = json.loads(content or b"{}")
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            out = await handlers[route](body)
        except json.JSONDecodeError as e:
            return error(f"malformed JSON: {e}", 400)
        except BadRequest as e:
            return error(str(e), e.status, e.param, e.code)
        except Exception as e:  # noqa: BLE001 - the engine failed: the workflow re-raises it
            self.error = e
            return error(f"generation failed: {type(e).__name__}: {e}", 500)
        if not body.get("stream"):
            return 200, json_type, json.dumps(out).encode()
        if route == "/responses":
            return 200, "text/event-stream", _response_events(body, out)
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        if route == "/completions":
            return 200, "text/event-stream", _completion_sse(out, include_usage)
        return 200, "text/event-stream", _sse(out, include_usage)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        import httpx

        status, content_type, content = await self.handle(request.method, request.url.path, request.content)
        return httpx.Response(status, headers={"content-type": content_type}, content=content)


def _finish_reason(resp: ModelResponse) -> str:
    """OpenAI's ``finish_reason`` of a generation: stop, length, or abort (interrupted)."""
    return {"stop": "stop", "length": "length"}.get(resp.stop_reason, "abort")


def _completion_object(
    id_prefix: str, kind: str, body: dict[str, object], choice: dict[str, object], resp: ModelResponse
) -> dict[str, object]:
    """A completion object of ``kind`` (``text_completion``, ``chat.completion``) with one choice."""
    return {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": body.get("model") or MODEL_NAME,
        "choices": [choice],
        "usage": token_usage(resp.input_len, resp.output_len),
    }


def _response_events(body: dict[str, object], out: dict[str, object]) -> bytes:
    """A response object as the server-sent events of a streamed response."""
    events = ResponseEvents(body, str(out["id"]), str(out["model"]))
    parts = events.start()
    message = next((item for item in out["output"] if item["type"] == "message"), None)  # type: ignore[union-attr]
    text = message["content"][0]["text"] if message else ""  # type: ignore[index]
    logprobs = message["content"][0].get("logprobs") if message else None  # type: ignore[index]
    calls = [ToolCall(i["name"], i["arguments"], i["call_id"]) for i in out["output"] if i["type"] == "function_call"]  # type: ignore[union-attr]
    parts += events.text(text, logprobs)
    finish = "length" if out["status"] == "incomplete" else "stop"
    parts += events.finish(text, calls, logprobs, finish, out["usage"])  # type: ignore[arg-type]
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in parts)


def _sse(out: dict[str, object], include_usage: bool) -> bytes:
    """A chat completion as server-sent chunks: the role and content, the tool calls, the finish
    reason, the usage when asked for (OpenAI's chunk shapes, as our server streams them)."""
    head = {"id": out["id"], "object": "chat.completion.chunk", "created": out["created"], "model": out["model"]}
    [choice] = out["choices"]  # type: ignore[misc]
    message = choice["message"]
    chunks = [{"index": 0, "delta": {"role": "assistant", "content": message["content"] or ""},
               "logprobs": choice["logprobs"], "finish_reason": None}]  # fmt: skip
    if "tool_calls" in message:
        calls = [{"index": j, **c} for j, c in enumerate(message["tool_calls"])]
        chunks.append({"index": 0, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None})
    chunks.append({"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]})
    events = [{**head, "choices": [c]} for c in chunks]
    if include_usage:
        events.append({**head, "choices": [], "usage": out["usage"]})
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def _completion_sse(out: dict[str, object], include_usage: bool) -> bytes:
    """A text completion as server-sent chunks: the text, then the finish reason, the usage when
    asked for (the ``text_completion`` chunks OpenAI's completions stream)."""
    head = {"id": out["id"], "object": "text_completion", "created": out["created"], "model": out["model"]}
    [choice] = out["choices"]  # type: ignore[misc]
    chunks = [{**choice, "finish_reason": None}, {"index": 0, "text": "", "logprobs": None,
              "finish_reason": choice["finish_reason"]}]  # fmt: skip
    events = [{**head, "choices": [c]} for c in chunks]
    if include_usage:
        events.append({**head, "choices": [], "usage": out["usage"]})
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
