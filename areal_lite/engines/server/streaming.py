"""Streaming for the OpenAI-compatible routes: the tokens of several generations merged as the
scheduler produces them, text deltas that are safe to send before a generation ends, server-sent
events, and `respond`, which runs a request's jobs and hands their results to the route's
`Answer`, whole or as the chunks of a stream.

`TextDeltas` turns a growing list of token ids into pieces of text that never need taking back:
a token that ends inside a multi-byte character adds nothing until the character is complete, the
last characters that could still be the start of a stop string (or of a ``<tool_call>`` block,
when tools are offered) are held back, and nothing is sent from a complete one on. A token that
may end the generation (a stop token id, end of sequence) is held back until the next one shows
it did not: as in vLLM, the token a generation stops on is not part of its text. The final text,
cut at its stop string and with its tool calls parsed out, supplies the rest.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Collection, Sequence
from typing import TYPE_CHECKING

from aiohttp import web

from areal_lite.engines.local.images import ImageInputs
from areal_lite.engines.local.request import GenerationResult, SamplingParams, TokenOut
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.openai_format.chat import error_body

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOOL_CALL_START = "<tool_call>"

Job = tuple[list[int], SamplingParams, str]
"""One generation a request asks for: (prompt token ids, sampling, request id)."""


class TextDeltas:
    """The text of one generation, handed out in safe pieces as its tokens arrive.

    Args:
        tokenizer: decodes the tokens (None: no text at all).
        skip_special: drop special tokens from the text, as the whole answer does.
        stop: stop strings that end the generation and are cut from its text.
        markers: strings after whose start nothing more is sent as text (``<tool_call>``).
        held_ids: tokens that may end the generation, held back until a token follows them.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        skip_special: bool,
        stop: Sequence[str] = (),
        markers: Sequence[str] = (),
        held_ids: Collection[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.cuts = [*stop, *markers]
        self.hold = max((len(s) - 1 for s in self.cuts), default=0)
        self.ids: list[int] = []
        self.text = ""
        """The text of ``ids[:read]``."""
        self.prefix = 0
        self.read = 0
        """Tokens ``ids[prefix:read]`` are decoded again before new ones, as context (a token's
        text can depend on the one before it); only new tokens are decoded, never the whole list."""
        self.sent = ""
        self.frozen = False
        """A marker was seen: the rest comes from the final text."""
        self.held_ids = held_ids
        self.held: int | None = None
        """The last token, when it is one of ``held_ids``: not decoded until another follows."""

    def add(self, token: int) -> str:
        """The text that ``token`` adds and that can be sent now (possibly "")."""
        held, self.held = self.held, None
        delta = self._add(held) if held is not None else ""
        if token in self.held_ids:
            self.held = token
            return delta
        return delta + self._add(token)

    def _add(self, token: int) -> str:
        self.ids.append(token)
        if self.tokenizer is None or self.frozen:
            return ""
        decode = self.tokenizer.decode
        context = decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip_special)
        window = decode(self.ids[self.prefix :], skip_special_tokens=self.skip_special)
        if window.endswith("\ufffd") or not window.startswith(context):
            return ""  # inside a multi-byte character: wait for the rest of it
        self.text += window[len(context) :]
        self.prefix, self.read = self.read, len(self.ids)
        text = self.text
        end = len(text) - self.hold
        for cut in self.cuts:
            # Held back until complete, a stop string or marker starts after what was sent.
            at = text.find(cut, len(self.sent))
            if at >= 0:
                end, self.frozen = min(end, at), True
        if end <= len(self.sent):
            return ""
        delta = text[len(self.sent) : end]
        self.sent += delta
        return delta

    def rest(self, final: str) -> str:
        """What remains to send of ``final`` (the whole answer's text) after what was sent."""
        return final[len(self.sent) :] if final.startswith(self.sent) else ""


async def merged(
    scheduler: Scheduler,
    jobs: list[Job],
    input_logprobs: bool = False,
    images: list[ImageInputs | None] | None = None,
) -> AsyncIterator[tuple[int, TokenOut | GenerationResult]]:
    """Run ``jobs`` (prompt, params, rid; ``images``: each one's) at once and yield ``(job index,
    event)`` as each token is produced, a job's `GenerationResult` last (with ``input_logprobs``,
    each job's first token carries its prompt's log-probabilities). An engine failure is raised;
    leaving early aborts what is still running."""
    queue: asyncio.Queue[tuple[int, TokenOut | GenerationResult | BaseException]] = asyncio.Queue()

    async def pump(i: int, prompt: list[int], params: SamplingParams, rid: str) -> None:
        try:
            stream = scheduler.stream(prompt, params, rid, input_logprobs, images[i] if images else None)
            async for event in stream:
                queue.put_nowait((i, event))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, *job)) for i, job in enumerate(jobs)]
    try:
        left = len(jobs)
        while left:
            i, event = await queue.get()
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, GenerationResult):
                left -= 1
            yield i, event
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def send_events(
    request: web.Request, events: AsyncIterator[dict[str, object]], done_line: bool = True
) -> web.StreamResponse:
    """Answer with server-sent events, each written as soon as it is made; ``data: [DONE]``
    closes them (unless ``done_line`` is False: the Responses API has none). An error after the
    answer started is sent as one last event holding OpenAI's error object."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        async for event in events:
            kind = event.get("type") if not done_line else None
            head = f"event: {kind}\n".encode() if isinstance(kind, str) else b""
            await resp.write(head + sse(event))
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 - the status line is gone: report in the stream
        error = error_body(f"generation failed: {type(e).__name__}: {e}", 500)
        await resp.write(sse(error if done_line else {**error["error"], "type": "error"}))  # type: ignore[dict-item]
    if done_line:
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


class Answer:
    """How a route writes the answer to one request's jobs: `whole` from the results, or streamed:
    `opening` events, those of each token as it comes (`token`), of each job's end (`ending`), and
    `closing` ones after every job ended."""

    def whole(self, results: list[GenerationResult]) -> dict[str, object]:
        raise NotImplementedError

    def opening(self) -> list[dict[str, object]]:
        return []

    def token(self, i: int, event: TokenOut) -> list[dict[str, object]]:
        raise NotImplementedError

    def ending(self, i: int, r: GenerationResult) -> list[dict[str, object]]:
        raise NotImplementedError

    def closing(self, results: list[GenerationResult]) -> list[dict[str, object]]:
        return []


async def respond(
    request: web.Request,
    scheduler: Scheduler,
    jobs: list[Job],
    answer: Answer,
    stream: bool,
    done_line: bool = True,
    images: ImageInputs | None = None,
) -> web.StreamResponse:
    """Run ``jobs`` (each with ``images``, those of their one prompt) and answer with ``answer``:
    one JSON object, or with ``stream`` server-sent events written as the tokens come
    (`send_events`; ``done_line`` as there)."""
    per_job = [images] * len(jobs) if images is not None else None
    if not stream:
        return web.json_response(answer.whole(await scheduler.generate_many(jobs, images=per_job)))

    async def events() -> AsyncIterator[dict[str, object]]:
        for e in answer.opening():
            yield e
        results: list[GenerationResult] = []
        async for i, event in merged(scheduler, jobs, images=per_job):
            if isinstance(event, TokenOut):
                for e in answer.token(i, event):
                    yield e
                continue
            results.append(event)
            for e in answer.ending(i, event):
                yield e
        for e in answer.closing(results):
            yield e

    return await send_events(request, events(), done_line)
