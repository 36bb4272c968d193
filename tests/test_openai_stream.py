"""`TextDeltas`, the streamed text of our server's OpenAI routes: the pieces it hands out add up to
the whole answer's text, a multi-byte character is never split, a stop string never leaks into the
stream (even in part), and nothing from a ``<tool_call>`` on is streamed as text; and `TokenBytes`,
the bytes of each token in ``logprobs``, which add up to the text where a token splits a character."""

from __future__ import annotations

import pytest

from areal_lite.engines.server.common import TokenBytes, token_text
from areal_lite.engines.server.streaming import TOOL_CALL_START, TextDeltas
from areal_lite.utils.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def stream(tok, text: str, **kw: object) -> tuple[list[str], TextDeltas]:
    deltas = TextDeltas(tok, skip_special=True, **kw)  # type: ignore[arg-type]
    return [deltas.add(t) for t in tok.encode(text, add_special_tokens=False)], deltas


@pytest.mark.parametrize("text", ["Hello, world! The answer is 42.", "naïve café — 東京 🙂 ok", "  spaced   out  "])
def test_pieces_add_up_to_the_text_and_never_split_a_character(tok, text: str) -> None:
    pieces, deltas = stream(tok, text)
    assert "".join(pieces) + deltas.rest(text) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text  # no hold without stop strings or markers: all of it streamed


def test_a_stop_string_never_leaks_into_the_stream(tok) -> None:
    text = "one two STOP three"
    pieces, deltas = stream(tok, text, stop=["STOP"])
    streamed = "".join(pieces)
    # Whatever was sent before the stop string completed is a prefix of the text before it.
    final = text[: text.index("STOP")]
    assert "S" not in streamed[len("one two ") :] and final.startswith(streamed)
    assert streamed + deltas.rest(final) == final


def test_nothing_from_a_tool_call_on_is_streamed_as_text(tok) -> None:
    text = 'Let me check. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    pieces, deltas = stream(tok, text, markers=[TOOL_CALL_START])
    streamed = "".join(pieces)
    assert deltas.frozen and "<" not in streamed and "Let me check. ".startswith(streamed)
    # The whole answer's content strips the space before the call: the stream keeps it.
    assert streamed == "Let me check. " and deltas.rest("Let me check.") == ""


def test_token_bytes_add_up_to_the_text_where_tokens_split_characters(tok) -> None:
    text = "naïve café — 東京 🙂 ok <|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    token_bytes = TokenBytes(tok)
    pieces = [bytes(token_bytes(t, tok.decode([t]))) for t in ids]
    assert b"".join(pieces) == text.encode()
    assert any(p.decode(errors="replace") != p.decode(errors="ignore") for p in pieces)  # some split a character
    assert TokenBytes(None)(7, "token_id:7") == list(b"token_id:7")


def test_a_token_that_may_end_the_generation_waits_for_the_next(tok) -> None:
    """A token of ``held_ids`` (a stop token id) adds nothing until another follows it: the token
    a generation stops on is not part of its streamed text, one it did not stop on is."""
    [semicolon] = tok.encode(";", add_special_tokens=False)
    ab, cd = tok.encode("ab", add_special_tokens=False), tok.encode("cd", add_special_tokens=False)
    deltas = TextDeltas(tok, skip_special=True, held_ids={semicolon})
    pieces = [deltas.add(t) for t in [*ab, semicolon, *cd, semicolon]]
    assert "".join(pieces) == "ab;cd" and pieces[len(ab)] == "" and pieces[-1] == ""
    assert deltas.rest("ab;cd") == ""  # it stopped on the last one
    assert deltas.rest("ab;cd;") == ";"  # it ran out of tokens there: the final text has it


@pytest.mark.parametrize("text", ["naïve café — 東京 🙂 ok", "plain ascii", "🙂🙂"])
def test_token_texts_join_into_the_text_as_vllm_gives_them(tok, text: str) -> None:
    """`token_text`: a token that ends inside a character is "" (vLLM's), the one that completes
    it carries the whole character, so the texts of the tokens, each read after the ones before
    it, join into the text."""
    ids = tok.encode(text, add_special_tokens=False)
    texts = [token_text(tok, t, ids[:k]) for k, t in enumerate(ids)]
    alone = [tok.decode([t]) for t in ids]
    assert "".join(texts) == text and not any("\ufffd" in t for t in texts)
    assert any("\ufffd" in a for a in alone) == (text != "plain ascii")  # decoded alone: replacement characters
    assert "" in texts or text == "plain ascii"
    assert all(t == a for t, a in zip(texts, alone) if "\ufffd" not in a)
