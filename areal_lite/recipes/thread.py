"""Conversations as the recipe API sees them: `StringThread` (turns of text) and `TokenizedThread`
(the same turns as token ids, with a weight per token), and `ThreadTokenizer`, which turns one
into the other exactly.

A thread is a list of ``(role, content)`` turns plus ``metadata`` (e.g. the gold answer a grader
reads). Assistant turns are what a model is trained on: after tokenization their content tokens
(and the end-of-turn token that ends them) weigh 1, every other token 0. The per-token lists that
the training methods take (log-probabilities, advantages, tangents) have one entry per token of
weight > 0, in order: `TokenizedThread.n_trained` of them.

Tokenization never happens twice for the same tokens: a completion produced by ``generate_tokens``
keeps the ids the model sampled, so what is trained is exactly what was generated.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class StringThread:
    """A conversation: ``turns`` of ``(role, content)`` and free-form ``metadata``."""

    turns: list[tuple[str, str]] = field(default_factory=list)
    metadata: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, turn in enumerate(self.turns):
            if len(turn) != 2 or not isinstance(turn[1], str):
                raise ValueError(f"turn {i} must be a (role, content) pair of strings, got {turn!r}")
            if turn[0] not in ROLES:
                raise ValueError(f"turn {i} has role {turn[0]!r}; roles are {', '.join(ROLES)}")

    def _with(self, role: str, content: str) -> StringThread:
        return replace(self, turns=[*self.turns, (role, content)])

    def system(self, content: str) -> StringThread:
        """A copy with a system turn appended."""
        return self._with("system", content)

    def user(self, content: str) -> StringThread:
        """A copy with a user turn appended."""
        return self._with("user", content)

    def assistant(self, content: str) -> StringThread:
        """A copy with an assistant turn appended."""
        return self._with("assistant", content)

    def last_content(self) -> str:
        """The content of the last turn."""
        if not self.turns:
            raise ValueError("the thread has no turns")
        return self.turns[-1][1]

    def completion(self) -> str:
        """The content of the last assistant turn."""
        for role, content in reversed(self.turns):
            if role == "assistant":
                return content
        raise ValueError("the thread has no assistant turn")

    def prompt(self) -> StringThread:
        """The thread up to (without) its last assistant turn: what a model was asked."""
        for i in range(len(self.turns) - 1, -1, -1):
            if self.turns[i][0] == "assistant":
                return replace(self, turns=self.turns[:i])
        return self


@dataclass(frozen=True)
class TokenizedTurn:
    """One turn as token ids. ``weights`` has one entry per token (1.0 on what is trained);
    ``content`` is the turn's text (what `detokenize` gives back)."""

    role: str
    tokens: list[int]
    weights: list[float]
    content: str

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.weights):
            raise ValueError(f"a {self.role} turn has {len(self.tokens)} tokens but {len(self.weights)} weights")


@dataclass(frozen=True)
class TokenizedThread:
    """A conversation as token ids. ``logprobs`` are the sampling log-probabilities of the last
    generated turn when `generate_tokens` made it (empty otherwise)."""

    turns: list[TokenizedTurn]
    metadata: dict[str, object] = field(default_factory=dict)
    logprobs: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [t for turn in self.turns for t in turn.tokens]

    @property
    def weights(self) -> list[float]:
        """Per-token weights; the first token of a thread is never trained (nothing predicts it)."""
        w = [x for turn in self.turns for x in turn.weights]
        return [0.0, *w[1:]] if w else w

    @property
    def n_trained(self) -> int:
        """Tokens of weight > 0: the length of every per-token list a training method takes."""
        return sum(1 for w in self.weights if w > 0)

    def __len__(self) -> int:
        return sum(len(turn.tokens) for turn in self.turns)

    def with_turn(self, turn: TokenizedTurn, logprobs: list[float] | None = None) -> TokenizedThread:
        return replace(self, turns=[*self.turns, turn], logprobs=list(logprobs or []))

    def has_assistant_turn(self) -> bool:
        return any(t.role == "assistant" for t in self.turns)


def repeat_thread(thread: StringThread | TokenizedThread) -> Iterator[StringThread | TokenizedThread]:
    """``thread`` forever: the items `async_map_batch` draws to sample a group of completions."""
    while True:
        yield thread


class ThreadTokenizer:
    """Renders threads to token ids and back with a HF tokenizer.

    With ``use_chat_template`` each turn is what the tokenizer's chat template adds for it; an
    assistant turn is the template's generation header (weight 0), its content and end-of-turn
    token (weight 1), and whatever the template writes after that token (weight 0). Without it, a
    thread is the plain concatenation of its contents, each assistant turn followed by eos: the
    format of raw-text tasks such as ``57+68=`` -> ``125``.
    """

    def __init__(self, tokenizer: object, use_chat_template: bool, max_seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template
        self.max_seq_len = max_seq_len
        self.eos_id = int(tokenizer.eos_token_id)  # type: ignore[attr-defined]
        if use_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("use_chat_template=True but the tokenizer has no chat template")
        self.header_text = self._header_text() if use_chat_template else ""
        self.header = self._ids(self.header_text) if use_chat_template else []
        """The tokens that open an assistant turn (the generation prompt)."""

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    def _render(self, turns: list[tuple[str, str]], generation_prompt: bool = False) -> str:
        messages = [{"role": r, "content": c} for r, c in turns]
        return self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _header_text(self) -> str:
        probe = [("user", "x")]
        with_header, without = self._render(probe, True), self._render(probe)
        if not with_header.startswith(without):
            raise ValueError("the chat template's generation prompt does not extend the rendered conversation")
        return with_header[len(without) :]

    def tokenize(self, thread: StringThread) -> TokenizedThread:
        turns = []
        rendered = ""
        for k, (role, content) in enumerate(thread.turns):
            if not self.use_chat_template:
                ids = self._ids(content)
                if role == "assistant":
                    turns.append(TokenizedTurn(role, ids + [self.eos_id], [1.0] * (len(ids) + 1), content))
                else:
                    turns.append(TokenizedTurn(role, ids, [0.0] * len(ids), content))
                continue
            full = self._render(thread.turns[: k + 1])
            if not full.startswith(rendered):
                raise ValueError(f"the chat template renders turn {k} by rewriting the turns before it")
            if role != "assistant":
                ids = self._ids(full[len(rendered) :])
                turns.append(TokenizedTurn(role, ids, [0.0] * len(ids), content))
            else:
                turns.append(self._assistant_turn(full[len(rendered) :], content))
            rendered = full
        out = TokenizedThread(turns, dict(thread.metadata))
        self.check(out)
        return out

    def _assistant_turn(self, text: str, content: str) -> TokenizedTurn:
        """The template's text of one assistant turn: header (0), content up to eos (1), rest (0)."""
        if not text.startswith(self.header_text):
            raise ValueError("the chat template renders an assistant turn without its generation prompt")
        head, body = self.header, self._ids(text[len(self.header_text) :])
        end = max((i for i, t in enumerate(body) if t == self.eos_id), default=len(body) - 1)
        weights = [0.0] * len(head) + [1.0] * (end + 1) + [0.0] * (len(body) - end - 1)
        return TokenizedTurn("assistant", head + body, weights, content)

    def prompt_ids(self, thread: TokenizedThread) -> list[int]:
        """What a model is given to continue ``thread`` with a new assistant turn."""
        return thread.tokens + self.header

    def completion_turn(self, output_ids: list[int]) -> TokenizedTurn:
        """A generated assistant turn: the header (weight 0) then every sampled token (weight 1)."""
        content = self.tokenizer.decode(output_ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        return TokenizedTurn(
            "assistant", self.header + output_ids, [0.0] * len(self.header) + [1.0] * len(output_ids), content
        )

    def detokenize(self, thread: TokenizedThread) -> StringThread:
        return StringThread([(t.role, t.content) for t in thread.turns], dict(thread.metadata))

    def check(self, thread: TokenizedThread) -> None:
        """A clear error for a thread the model cannot take: too long, or a token id the
        tokenizer does not have."""
        if len(thread) > self.max_seq_len:
            raise ValueError(f"a thread of {len(thread)} tokens is longer than max_seq_len={self.max_seq_len}")
        vocab = len(self.tokenizer)  # type: ignore[arg-type]
        bad = [t for t in thread.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the tokenizer's vocabulary of {vocab}")
