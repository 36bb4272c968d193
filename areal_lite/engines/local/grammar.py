"""Structured output in the embedded engine: a request's grammar (a JSON schema, any JSON object,
a regular expression, one of a list of strings, an EBNF grammar) held to by masking, at each step,
the tokens it does not allow, with llguidance (the Rust matcher vLLM and SGLang also offer as a
backend). The mask goes on the logits before anything else (as in vLLM); the reported
log-probabilities stay the model's own, unmasked.

A request carries its grammar as llguidance's grammar string (`SamplingParams.grammar`), built by
the routes from what the request says (`json_schema`, `json_object`, `regex`, `choice`, `ebnf`);
the scheduler gives the request a matcher (`Grammars.matcher`), the model runner masks with it
(`mask`) and feeds it each sampled token (`advance`). Once the grammar is complete only the end of
sequence is allowed, so the generation ends there, as in vLLM.
"""

from __future__ import annotations

import json
import re
import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer
    from transformers import PreTrainedTokenizerBase

    from areal_lite.engines.local.request import Sequence


def json_schema_grammar(schema: object) -> str:
    """The grammar of JSON that validates against ``schema`` (a dict or its JSON text)."""
    from llguidance import LLMatcher

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object")  # noqa: TRY004 (bad input: a 400)
    return LLMatcher.grammar_from_json_schema(schema)


def json_object_grammar() -> str:
    """The grammar of any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    """The grammar of text that ``pattern`` matches in full."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: list[str]) -> str:
    """The grammar of exactly one of ``choices`` (vLLM's ``structured_outputs.choice``)."""
    if not choices:
        raise ValueError("choice must be a non-empty list of strings")
    return regex_grammar("|".join(f"(?:{re.escape(c)})" for c in choices))


def ebnf_grammar(ebnf: str) -> str:
    """The grammar written in GBNF-style EBNF (SGLang's and vLLM's ``root ::= ...``) or Lark."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    try:
        return LLMatcher.grammar_from_lark(any_to_lark(ebnf))
    except GbnfToLarkError as e:
        raise ValueError(f"the grammar does not parse: {e}") from None


CHECKED = 256
"""How many grammars `Grammars.check` remembers as compiling."""


class Grammars:
    """Matchers for one model's tokenizer: the tokenizer's llguidance form, the costly part, is
    built once, on first use (in the thread of the first structured request); a matcher for a
    small schema is cheap after that."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._ll: LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiled: dict[str, None] = {}
        """Grammars known to compile, oldest first (at most `CHECKED` of them)."""

    def check(self, grammar: str) -> None:
        """ValueError when ``grammar`` does not compile; a grammar seen to compile is not compiled
        again (a request is checked by its route, then by the scheduler as it is queued)."""
        if grammar not in self._compiled:
            self.matcher(grammar)
            with self._lock:  # route handlers check from their event loops' threads
                self._compiled[grammar] = None
                if len(self._compiled) > CHECKED:
                    del self._compiled[next(iter(self._compiled))]

    def matcher(self, grammar: str) -> LLMatcher:
        """A fresh matcher of ``grammar``; ValueError when it does not compile (the message says why)."""
        import llguidance
        import llguidance.hf

        if self.tokenizer is None:
            raise ValueError("structured output needs a tokenizer, and this model directory has none")
        if self._ll is None:
            eos = self.eos_ids or None
            self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)  # type: ignore[arg-type]
        m = llguidance.LLMatcher(self._ll, grammar)
        if m.is_error():
            raise ValueError(f"the structured output grammar is invalid: {m.get_error()}")
        return m


BITS = 1 << torch.arange(32, dtype=torch.int64)
"""The value of each bit of a word of llguidance's token bitmask."""


def mask(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """Set to -inf, in place, the logits of the tokens each row's grammar does not allow next.

    The bitmask is unpacked here with eager ops rather than by ``llguidance.torch``'s
    TorchScript kernel, which on torch's AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``, as on the
    AVX2-only CPUs) let through 262 tokens of a 512-token vocabulary where the grammar allowed 10."""
    import llguidance.torch

    vocab = logits.shape[-1]
    bitmask = llguidance.torch.allocate_token_bitmask(len(rows), vocab)
    for k, j in enumerate(rows):
        llguidance.torch.fill_next_token_bitmask(seqs[j].matcher, bitmask, k)
    allowed = (bitmask.to(torch.int64).unsqueeze(-1) & BITS).ne(0).flatten(1)[:, :vocab]
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))


def advance(s: Sequence, token: int) -> None:
    """Feed the token ``s`` just sampled to its matcher (none once the grammar is complete)."""
    if s.matcher is not None and not s.matcher.is_stopped():
        s.matcher.consume_token(token)


def requested(response_format: object, structured_outputs: object) -> str | None:
    """The grammar a request asks for: OpenAI's ``response_format`` (``json_object``, or
    ``json_schema`` with its ``schema``) or vLLM's ``structured_outputs`` (one of ``json``,
    ``json_object``, ``regex``, ``choice``, ``grammar``); None for free text. ValueError naming
    what is wrong."""
    if response_format is not None and response_format != {"type": "text"}:
        if not isinstance(response_format, dict):
            raise ValueError("response_format must be an object")
        kind = response_format.get("type")
        if kind == "json_object":
            return json_object_grammar()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format.json_schema must be an object with a schema")
            return json_schema_grammar(spec["schema"])
        raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
    if structured_outputs is None:
        return None
    if not isinstance(structured_outputs, dict):
        raise ValueError("structured_outputs must be an object")  # noqa: TRY004 (bad input: a 400)
    makers = {"json": json_schema_grammar, "regex": regex_grammar, "choice": choice_grammar, "grammar": ebnf_grammar}
    given = {k: v for k, v in structured_outputs.items() if v not in (None, False)}
    unknown = sorted(set(given) - set(makers) - {"json_object"})
    if unknown:
        raise ValueError(
            f"structured_outputs: {', '.join(unknown)} not supported (json, json_object, regex, choice, grammar are)"
        )
    if len(given) != 1:
        raise ValueError(
            "You must use one kind of structured outputs constraint: json, json_object, regex, choice or grammar"
        )
    [(key, value)] = given.items()
    if key == "json_object":
        return json_object_grammar()
    if key == "choice" and not (isinstance(value, list) and all(isinstance(c, str) for c in value)):
        raise ValueError("structured_outputs.choice must be a list of strings")
    if key in ("regex", "grammar") and not isinstance(value, str):
        raise ValueError(f"structured_outputs.{key} must be a string")
    return makers[key](value)


def forced_tool_call(tool_choice: object, tools: list[dict[str, object]], parallel: object) -> tuple[str, str | None]:
    """The grammar of a forced tool call in the Hermes format the chat templates teach
    (``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, what vLLM's hermes parser
    forces too): a named tool (``{"type": "function", "function": {"name": ...}}``) once, or for
    ``"required"`` one or more calls of ``tools`` (one when ``parallel`` is false), the
    arguments held to each tool's ``parameters`` schema. Returns (grammar, the named tool or
    None). ValueError for a tool that is not among ``tools``."""
    from llguidance import LLMatcher

    params = {t["function"]["name"]: t["function"].get("parameters") for t in tools}  # type: ignore[index,union-attr]

    def call(name: str) -> str:
        schema = params[name] if isinstance(params[name], dict) else {"type": "object", "properties": {}}
        head = json.dumps(f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ')
        return f"{head} %json {json.dumps(schema)} " + json.dumps("}\n</tool_call>")

    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
            )
        if name not in params:
            raise ValueError(f"Tool '{name}' has not been passed in `tools`.")
        return LLMatcher.grammar_from_lark(f"start: {call(name)}\n"), name
    rules = "call: " + " | ".join(call(name) for name in params)
    start = "start: call" if parallel is False else 'start: call ("\\n" call)*'
    return LLMatcher.grammar_from_lark(f"{start}\n{rules}\n"), None
