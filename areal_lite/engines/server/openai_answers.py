"""How the OpenAI routes of our server write their answers, whole or as the chunks of a stream
(`areal_lite.engines.server.streaming.respond` runs them): ``/v1/completions``' text completions
(`CompletionAnswer`) and ``/v1/chat/completions``' chat completions (`ChatAnswer`), in vLLM's
shapes, vLLM's extensions included (``stop_reason``, ``token_ids`` and ``prompt_token_ids``).

`AnswerTexts` writes what every OpenAI answer decodes: the output's text (without the token a
generation stopped on, vLLM's rule), the text deltas a stream sends, and each token's text and
bytes in log-probabilities.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from areal_lite import __version__
from areal_lite.engines.local.request import GenerationResult, SamplingParams, TokenOut
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.engines.server.common import CONTEXT_TOKENS, TokenBytes, output_text, token_text
from areal_lite.engines.server.openai_request import ChoiceRequest
from areal_lite.engines.server.streaming import TOOL_CALL_START, Answer, TextDeltas
from areal_lite.openai_format.chat import assistant_message, chat_finish_reason, token_usage
from areal_lite.openai_format.tool_calls import ToolCall, parse_tool_calls

SYSTEM_FINGERPRINT = f"areal-lite-{__version__}"
"""An answer's ``system_fingerprint`` (vLLM's names its version): the server software that
answered, for telling answers of different builds apart."""


def finish_type(r: GenerationResult) -> str:
    """OpenAI's (and vLLM's) name for why a generation ended: stop, length or abort."""
    return str(r.finish_reason["type"])


def stop_reason(r: GenerationResult, params: SamplingParams) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or ``stop_token_ids`` token a generation ended on;
    None for any other end, end of sequence included."""
    matched = r.finish_reason.get("matched")
    return matched if isinstance(matched, str) or matched in params.stop_token_ids else None


def without_stop_token(r: GenerationResult, keep: bool) -> GenerationResult:
    """``r`` without the token it stopped on (end of sequence or a ``stop_token_ids`` one), whose
    text vLLM leaves out of the answer's unless ``include_stop_str_in_output`` (``keep``); its
    log-probability and usage still count it."""
    if keep or not isinstance(r.finish_reason.get("matched"), int):
        return r
    return dataclasses.replace(r, output_ids=r.output_ids[:-1])


class AnswerTexts:
    """The text of answers over ``scheduler``'s tokenizer (none: no text, token ids in its place)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.tokenizer = scheduler.tokenizer
        self.token_bytes = TokenBytes(scheduler.tokenizer)

    def output(self, r: GenerationResult, skip_special: bool, keep_stop: bool) -> str:
        """The text of ``r``'s output (``keep_stop``: with the stop string or token it ended on)."""
        return output_text(self.tokenizer, without_stop_token(r, keep_stop), skip_special, keep_stop)

    def deltas(
        self, params: SamplingParams, skip_special: bool, keep_stop: bool, markers: Sequence[str] = ()
    ) -> TextDeltas:
        """The text deltas of a streamed generation of ``params``: the tokens it may stop on held
        back, and its stop strings cut, unless ``keep_stop``."""
        stop = () if keep_stop else params.stop
        held = frozenset() if keep_stop else self.scheduler.stop_ids(params)
        return TextDeltas(self.tokenizer, skip_special, stop, markers, held)

    def token_text(self, token: int, as_ids: bool = False, before: Sequence[int] = ()) -> str:
        """A token's text in log-probabilities (`token_text`: vLLM's, ``before`` the tokens before it)."""
        tok = self.tokenizer
        return f"token_id:{token}" if as_ids or tok is None else token_text(tok, token, before)

    def chat_logprobs(
        self, tokens: list[int], logprobs: list[float], tops: list | None, before: Sequence[int] = ()
    ) -> list[dict[str, object]]:
        """Chat's ``logprobs.content`` entries for these output tokens (``tops``: their top lists;
        ``before``: the output tokens before them, in a stream)."""

        def entry(token: int, logprob: float, context: list[int]) -> dict[str, object]:
            text = self.token_text(token, before=context)
            return {"token": text, "logprob": logprob, "bytes": self.token_bytes(token, text)}

        out = []
        for k, (token, lp) in enumerate(zip(tokens, logprobs)):
            context = [*before[-CONTEXT_TOKENS:], *tokens[:k]]
            top = [entry(tid, v, context) for tid, v in (tops[k] if tops else [])]
            out.append({**entry(token, lp, context), "top_logprobs": top})
        return out


def usage(results: list[GenerationResult], prompt_tokens: int) -> dict[str, int]:
    return token_usage(prompt_tokens, sum(len(r.output_ids) for r in results))


def top_of(event: TokenOut) -> list | None:
    """A streamed token's top log-probabilities, as the list of one position's."""
    return [event.top] if event.top is not None else None


class ChoicesAnswer(Answer):
    """What completions and chat answers share: ``head`` (id, created, model) on every object,
    one choice per job of ``req``, and, streamed with ``stream_options.include_usage``, a usage
    chunk last."""

    def __init__(self, texts: AnswerTexts, req: ChoiceRequest, head: dict[str, object], prompt_tokens: int) -> None:
        self.texts, self.head, self.prompt_tokens = texts, head, prompt_tokens
        self.o, self.params, self.jobs = req.o, req.params, req.jobs

    def chunk(self, choices: list[dict[str, object]]) -> dict[str, object]:
        return {**self.head, "choices": choices}

    def text_of(self, r: GenerationResult) -> str:
        return self.texts.output(r, self.o.skip_special, self.o.keep_stop)

    def closing(self, results: list[GenerationResult]) -> list[dict[str, object]]:
        return [{**self.chunk([]), "usage": usage(results, self.prompt_tokens)}] if self.o.include_usage else []


class CompletionAnswer(ChoicesAnswer):
    """``/v1/completions``' answer: ``text_completion`` objects, one choice per job, with
    ``echo`` after its prompt (its text, and with ``scored`` its log-probabilities), and
    log-probabilities (``logprobs``) in the legacy shape: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` and ``text_offset``, each token's text its id with ``as_ids``."""

    def __init__(
        self,
        texts: AnswerTexts,
        req: ChoiceRequest,
        prompts: list[list[int]],
        prompt_texts: list[str] | None,
        logprobs: bool,
        as_ids: bool,
        echo: bool,
        scored: list[GenerationResult] | None = None,
    ) -> None:
        o = req.o
        head = {"id": f"cmpl-{o.request_id}", "object": "text_completion", "created": int(time.time()),
                "model": req.model, "system_fingerprint": SYSTEM_FINGERPRINT}  # fmt: skip
        super().__init__(texts, req, head, sum(len(p) for p in prompts))
        self.logprobs, self.as_ids, self.echo = logprobs, as_ids, echo
        # Echoed, a choice's text and log-probabilities start with its prompt's (top ones included,
        # as vLLM and OpenAI answer).
        if echo and prompt_texts is None:  # token ids: decoded
            tok = texts.tokenizer
            prompt_texts = [tok.decode(p) if tok is not None else "" for p in prompts]
        self.echoed = [prompt_texts[i // o.n] if echo else "" for i in range(len(self.jobs))]  # type: ignore[index]
        self.echo_blocks: list[dict[str, list] | None] = [None] * len(self.jobs)
        if scored is not None:
            self.echo_blocks = [
                self.logprob_block(p, scored[i // o.n].input_logprobs or [], scored[i // o.n].input_top_logprobs, 0)
                for i, (p, _, _) in enumerate(self.jobs)
            ]
        # A choice's output offsets go on from its echoed tokens' texts (a BOS's included, as vLLM counts).
        self.starts = [
            len(e) if b is None else sum(map(len, b["tokens"])) for e, b in zip(self.echoed, self.echo_blocks)
        ]

    def logprob_block(
        self,
        tokens: list[int],
        lps: list[float] | list[float | None],
        tops: list | None,
        offset: int,
        before: Sequence[int] = (),
    ) -> dict[str, list]:
        """The legacy ``logprobs`` of ``tokens``, their texts' offsets from ``offset`` on."""
        # vLLM reads each token's text after the tokens before it that have log-probabilities
        # (not an echoed prompt's first token); ``before``: a stream's earlier output tokens.
        contexts = [[*before[-CONTEXT_TOKENS:], *(t for t, lp in zip(tokens[:k], lps) if lp is not None)]
                    for k in range(len(tokens))]  # fmt: skip
        strings = [self.texts.token_text(t, self.as_ids, c) for t, c in zip(tokens, contexts)]
        offsets = []
        for s in strings:
            offsets.append(offset)
            offset += len(s)
        top: list[dict[str, float] | None] = []
        for k, (s, lp) in enumerate(zip(strings, lps)):
            if lp is None:  # an echoed prompt's first token
                top.append(None)
                continue
            entry = {s: lp}  # vLLM: the sampled token, then the most likely ones
            for tid, v in tops[k] if tops else []:
                entry.setdefault(self.texts.token_text(tid, self.as_ids, contexts[k]), v)
            top.append(entry)
        return {"tokens": strings, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}

    def whole(self, results: list[GenerationResult]) -> dict[str, object]:
        choices = []
        for i, r in enumerate(results):
            choice: dict[str, object] = {
                "index": i,
                "text": self.echoed[i] + self.text_of(r),
                "logprobs": self._with_echo(i, r) if self.logprobs else None,
                "finish_reason": finish_type(r),
                "stop_reason": stop_reason(r, self.params),
            }
            if self.o.with_ids:
                choice.update(prompt_token_ids=r.input_ids, token_ids=r.output_ids)
            choices.append(choice)
        return {**self.chunk(choices), "usage": usage(results, self.prompt_tokens)}

    def _with_echo(self, i: int, r: GenerationResult) -> dict[str, list]:
        block = self.logprob_block(r.output_ids, r.output_logprobs, r.output_top_logprobs, self.starts[i])
        pre = self.echo_blocks[i]
        return {k: pre[k] + v for k, v in block.items()} if pre is not None else block

    def opening(self) -> list[dict[str, object]]:
        o = self.o
        self.deltas = [self.texts.deltas(self.params, o.skip_special, o.keep_stop) for _ in self.jobs]
        self.first = [True] * len(self.jobs)
        self.offsets = list(self.starts)
        self.sent: list[list[int]] = [[] for _ in self.jobs]
        if not self.echo:
            return []
        chunks = []
        for i, (prompt, _, _) in enumerate(self.jobs):
            choice: dict[str, object] = {"index": i, "text": self.echoed[i], "logprobs": self.echo_blocks[i],
                                         "finish_reason": None}  # fmt: skip
            if o.with_ids:
                choice["prompt_token_ids"] = prompt
            self.first[i] = False
            chunks.append(self.chunk([choice]))
        return chunks

    def token(self, i: int, event: TokenOut) -> list[dict[str, object]]:
        choice: dict[str, object] = {"index": i, "text": self.deltas[i].add(event.token), "finish_reason": None}
        block = self.logprob_block([event.token], [event.logprob], top_of(event), self.offsets[i], self.sent[i])
        choice["logprobs"] = block if self.logprobs else None
        self.offsets[i] += len(block["tokens"][0])
        self.sent[i].append(event.token)
        if self.o.with_ids:
            choice["token_ids"] = [event.token]
            if self.first[i]:
                choice["prompt_token_ids"] = self.jobs[i][0]
        self.first[i] = False
        return [self.chunk([choice])]

    def ending(self, i: int, r: GenerationResult) -> list[dict[str, object]]:
        rest = self.deltas[i].rest(self.text_of(r))
        chunks = [self.chunk([{"index": i, "text": rest, "logprobs": None, "finish_reason": None}])] if rest else []
        end = {"index": i, "text": "", "logprobs": None, "finish_reason": finish_type(r),
               "stop_reason": stop_reason(r, self.params)}  # fmt: skip
        return [*chunks, self.chunk([end])]


class ChatAnswer(ChoicesAnswer):
    """``/v1/chat/completions``' answer: ``chat.completion`` objects (``chat.completion.chunk``
    streamed), one choice per job, its text read for Hermes tool calls when ``tools`` were offered.
    A call forced by ``tool_choice`` (``forced``) has content "" beside it, as vLLM answers;
    ``named``: the function it names, whose call ends with ``stop`` (OpenAI's and vLLM's)."""

    def __init__(
        self,
        texts: AnswerTexts,
        req: ChoiceRequest,
        prompt: list[int],
        logprobs: bool,
        tools: bool,
        forced: bool,
        named: str | None,
    ) -> None:
        head = {"id": f"chatcmpl-{req.o.request_id}", "created": int(time.time()), "model": req.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}  # fmt: skip
        super().__init__(texts, req, head, len(prompt))
        self.prompt, self.logprobs, self.tools, self.forced, self.named = prompt, logprobs, tools, forced, named

    def chunk(self, choices: list[dict[str, object]]) -> dict[str, object]:
        return {**self.head, "object": "chat.completion.chunk", "choices": choices}

    def answer(self, r: GenerationResult) -> tuple[str, list[ToolCall]]:
        text = self.text_of(r)
        return parse_tool_calls(text) if self.tools else (text, [])

    def message(self, content: str, calls: list[ToolCall]) -> dict[str, object]:
        # vLLM's answer to a forced call: content "" beside the calls (OpenAI's: null).
        message = assistant_message(content, calls)
        return {**message, "content": content} if self.forced else message

    def finish(self, r: GenerationResult, calls: list[ToolCall]) -> str:
        # OpenAI's and vLLM's: a named tool's call ends with "stop", auto and required ones with "tool_calls".
        return finish_type(r) if self.named is not None else chat_finish_reason(finish_type(r), calls)

    def whole(self, results: list[GenerationResult]) -> dict[str, object]:
        choices = []
        for i, r in enumerate(results):
            content, calls = self.answer(r)
            entries = self.texts.chat_logprobs(r.output_ids, r.output_logprobs, r.output_top_logprobs)
            choice: dict[str, object] = {
                "index": i,
                "message": self.message(content, calls),
                "logprobs": {"content": entries} if self.logprobs else None,
                "finish_reason": self.finish(r, calls),
                "stop_reason": stop_reason(r, self.params),
            }
            if self.o.with_ids:
                choice["token_ids"] = r.output_ids
            choices.append(choice)
        out = {**self.head, "object": "chat.completion", "choices": choices,
               "usage": usage(results, self.prompt_tokens)}  # fmt: skip
        if self.o.with_ids:
            out["prompt_token_ids"] = self.prompt
        return out

    def opening(self) -> list[dict[str, object]]:
        markers = (TOOL_CALL_START,) if self.tools else ()
        self.deltas = [
            self.texts.deltas(self.params, self.o.skip_special, self.o.keep_stop, markers) for _ in self.jobs
        ]
        self.sent: list[list[int]] = [[] for _ in self.jobs]
        chunks = []
        for i in range(len(self.jobs)):
            first: dict[str, object] = {"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}  # fmt: skip
            if self.o.with_ids:
                first["prompt_token_ids"] = self.prompt
            chunks.append(self.chunk([first]))
        return chunks

    def token(self, i: int, event: TokenOut) -> list[dict[str, object]]:
        c: dict[str, object] = {
            "index": i,
            "delta": {"content": self.deltas[i].add(event.token)},
            "logprobs": {
                "content": self.texts.chat_logprobs([event.token], [event.logprob], top_of(event), self.sent[i])
            }
            if self.logprobs
            else None,
            "finish_reason": None,
        }
        if self.o.with_ids:
            c["token_ids"] = [event.token]
        self.sent[i].append(event.token)
        return [self.chunk([c])]

    def ending(self, i: int, r: GenerationResult) -> list[dict[str, object]]:
        content, calls = self.answer(r)
        rest = self.deltas[i].rest(content)
        chunks = []
        if rest:
            chunks.append(
                self.chunk([{"index": i, "delta": {"content": rest}, "logprobs": None, "finish_reason": None}])
            )
        if calls:
            tool_calls = [{"index": j, **c.to_openai()} for j, c in enumerate(calls)]
            chunks.append(self.chunk([{"index": i, "delta": {"tool_calls": tool_calls}, "logprobs": None,
                                       "finish_reason": None}]))  # fmt: skip
        end = {"index": i, "delta": {}, "logprobs": None, "finish_reason": self.finish(r, calls),
               "stop_reason": stop_reason(r, self.params)}  # fmt: skip
        return [*chunks, self.chunk([end])]
