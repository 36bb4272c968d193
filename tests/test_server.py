"""Our server, over real HTTP on 127.0.0.1: generation with log-probabilities equal to a HF forward,
the info and control endpoints, weight updates from disk and by gloo broadcast, pause / abort
semantics, the API key, and a 400 (then normal service) for each kind of bad input on the SGLang,
OpenAI and vLLM routes (tests/test_openai_api.py drives the OpenAI routes with the SDK)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_lite.utils.distributed import find_free_port, init_custom_process_group
from areal_lite.utils.tiny import build_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from inference_servers import start_servers, stop_servers, with_bos

KEY = "secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 512


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("srv") / "m"), hidden_size=64, num_layers=2)


@pytest.fixture(scope="module")
def server(model_path: str):
    procs, addresses = start_servers(model_path, 1, ["--api-key", KEY, "--context-length", str(CONTEXT)])
    yield f"http://{addresses[0]}"
    stop_servers(procs)


async def call(
    url: str,
    path: str,
    body: object = None,
    method: str = "POST",
    raw: bytes | None = None,
    headers: dict | None = None,
):
    """(status, decoded body) of one call."""
    async with aiohttp.ClientSession(headers=AUTH if headers is None else headers) as s:
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        async with s.request(method, url + path, data=data, headers={"Content-Type": "application/json"}) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except json.JSONDecodeError:
                return r.status, text


def run(coro):
    return asyncio.run(coro)


def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0, :-1]
    return logp.gather(1, ids[0, 1:, None])[len(prompt) - 1 :, 0]


def check_logprobs(url: str, model: torch.nn.Module, version: str) -> None:
    prompt = [11, 12, 13, 14]
    status, out = run(
        call(
            url,
            "/generate",
            {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}, "return_logprob": True},
        )
    )
    assert status == 200 and out["meta_info"]["weight_version"] == version
    lps = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    assert [x[1] for x in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    torch.testing.assert_close(lps, hf_logprobs(model, prompt, out["output_ids"]), atol=1e-4, rtol=0)


def test_generate_matches_hf_and_protocol_shapes(server: str, model_path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    check_logprobs(server, model, "0")
    body = {
        "input_ids": [[5, 6, 7], [8]],
        "rid": ["a", "b"],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    status, out = run(call(server, "/generate", body))
    assert status == 200 and [o["meta_info"]["id"] for o in out] == ["a", "b"]
    first = out[0]["meta_info"]
    assert (
        first["prompt_tokens"] == 3
        and first["completion_tokens"] == 3
        and first["finish_reason"] == {"type": "length", "length": 3}
    )
    assert first["input_token_logprobs"][0][0] is None and len(first["input_token_logprobs"]) == 3
    torch.testing.assert_close(
        torch.tensor([x[0] for x in first["input_token_logprobs"][1:]]),
        hf_logprobs(model, [5], [6, 7]),
        atol=1e-4,
        rtol=0,
    )
    status, out = run(call(server, "/generate", {"text": "What is", "sampling_params": {"max_new_tokens": 2, "n": 3}}))
    assert status == 200 and len(out) == 3 and all(isinstance(o["text"], str) for o in out)


def test_generate_seeds_and_top_logprobs(server: str, model_path: str) -> None:
    """SGLang's ``sampling_seed`` (the same seed, the same tokens; the samples of ``n`` differ) and
    ``top_logprobs_num`` (the most likely tokens per position, equal to a HF forward)."""
    sp = {"max_new_tokens": 12, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 7, "n": 2}
    body = {"input_ids": [11, 12, 13], "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 3}
    status, first = run(call(server, "/generate", body))
    _, again = run(call(server, "/generate", body))
    assert status == 200 and [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    assert first[0]["output_ids"] != first[1]["output_ids"]
    tops = first[0]["meta_info"]["output_top_logprobs"]
    ids = torch.tensor([[11, 12, 13, *first[0]["output_ids"]]])
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(model_path)(ids).logits.float()
    want = torch.log_softmax(logits, dim=-1)[0, 2:-1].topk(3, dim=-1)
    assert [[t for _, t, _ in top] for top in tops] == want.indices.tolist()
    torch.testing.assert_close(torch.tensor([[v for v, _, _ in top] for top in tops]), want.values, atol=1e-4, rtol=0)


def test_info_endpoints_and_api_key(server: str, model_path: str) -> None:
    assert run(call(server, "/health", method="GET", headers={}))[0] == 200
    assert run(call(server, "/generate", {"input_ids": [1]}, headers={}))[0] == 401
    status, info = run(call(server, "/model_info", method="GET"))
    assert status == 200 and info["model_path"] == model_path and info["is_generation"] is True
    status, info = run(call(server, "/get_server_info", method="GET"))
    assert status == 200 and info["context_length"] == CONTEXT and "api_key" not in info
    assert run(call(server, "/flush_cache"))[0] == 200
    model = AutoModelForCausalLM.from_pretrained(model_path)
    status, values = run(call(server, "/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 5}))
    assert status == 200
    torch.testing.assert_close(torch.tensor(values), model.lm_head.weight.flatten()[:5])


async def stream_events(url: str, body: object) -> tuple[int, str, list[object]]:
    """(status, content type, the JSON of each ``data:`` line) of a streamed call; ``[DONE]`` is
    kept as the string."""
    async with aiohttp.ClientSession(headers=AUTH) as s, s.post(url + "/generate", json=body) as r:
        events = []
        async for line in r.content:
            text = line.decode().strip()
            if text.startswith("data:"):
                data = text[len("data:") :].strip()
                events.append(data if data == "[DONE]" else json.loads(data))
        return r.status, r.headers.get("Content-Type", ""), events


def test_generate_sglang_request_forms(server: str, model_path: str) -> None:
    """What SGLang's docs (sampling params, native API) let a /generate request say: a list of
    ``sampling_params`` for a batch, per-prompt ``return_logprob``, ``return_text_in_logprobs``,
    the ``input_token_logprobs`` that ``return_logprob`` always brings, PUT as well as POST."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    body = {
        "input_ids": [[5, 6, 7], [8, 9]],
        "sampling_params": [
            {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
            {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        ],
        "return_logprob": [True, False],
    }
    status, out = run(call(server, "/generate", body))
    assert status == 200, out
    assert [len(o["output_ids"]) for o in out] == [2, 5]
    assert "output_token_logprobs" in out[0]["meta_info"] and "output_token_logprobs" not in out[1]["meta_info"]
    # The first prompt alone gives the same tokens: each prompt got its own sampling_params.
    single = {"input_ids": [8, 9], "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    assert run(call(server, "/generate", single))[1]["output_ids"] == out[1]["output_ids"]

    body = {
        "text": "What is",
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
        "return_logprob": True,
        "return_text_in_logprobs": True,
    }
    status, out = run(call(server, "/generate", body))
    meta = out["meta_info"]
    assert status == 200 and [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert [text for _, _, text in meta["output_token_logprobs"]] == [tok.decode([t]) for t in out["output_ids"]]
    # logprob_start_len -1 (the default): the prompt's last token only, as SGLang answers.
    prompt = tok.encode("What is", add_special_tokens=False)
    assert meta["input_token_logprobs"] == [[None, prompt[-1], tok.decode([prompt[-1]])]]

    async def put() -> tuple[int, object]:
        async with aiohttp.ClientSession(headers=AUTH) as s, s.put(server + "/generate", json=single) as r:
            return r.status, await r.json()

    status, out = run(put())
    assert status == 200 and len(out["output_ids"]) == 5
    status, out = run(call(server, "/get_weight_version", method="GET"))
    assert status == 200 and out == {
        "weight_version": run(call(server, "/model_info", method="GET"))[1]["weight_version"]
    }


def test_generate_stream(server: str) -> None:
    """``stream: true`` answers server-sent events as SGLang's docs show: ``data: {...}`` lines
    with the text and output ids so far (the last with ``finish_reason``), then ``data: [DONE]``;
    the tokens are those of the same request unstreamed. A batch tags each event with ``index``."""
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = run(call(server, "/generate", {"text": "What is", "sampling_params": sp, "return_logprob": True}))[1]
    status, ctype, events = run(
        stream_events(server, {"text": "What is", "sampling_params": sp, "return_logprob": True, "stream": True})
    )
    assert status == 200 and ctype.startswith("text/event-stream") and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2 and all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert last["meta_info"]["completion_tokens"] == 6
    assert [x[1] for x in last["meta_info"]["output_token_logprobs"]] == whole["output_ids"]
    for before, after in itertools.pairwise(chunks):  # cumulative, as the docs' client reads it
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]

    status, _, events = run(
        stream_events(server, {"input_ids": [[5, 6], [7]], "rid": ["s0", "s1"], "sampling_params": sp, "stream": True})
    )
    finals = {c["index"]: c for c in events[:-1] if c["meta_info"]["finish_reason"] is not None}
    assert status == 200 and events[-1] == "[DONE]" and sorted(finals) == [0, 1]
    assert [finals[i]["meta_info"]["id"] for i in (0, 1)] == ["s0", "s1"]


def test_prompt_logprobs_and_top_logprobs_as_sglang(server: str, model_path: str) -> None:
    """``logprob_start_len`` with ``top_logprobs_num``: ``input_token_logprobs`` and
    ``input_top_logprobs`` from that position on, the first entry null (SGLang reports none at the
    start position), the rest equal to a HF forward; the same in every streamed event from the
    first token on; a start past the prompt is SGLang's 400."""
    prompt = [11, 12, 13, 14, 15]
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": prompt, "sampling_params": sp, "return_logprob": True, "logprob_start_len": 2}
    body["top_logprobs_num"] = 3
    status, whole = run(call(server, "/generate", body))
    assert status == 200, whole
    meta = whole["meta_info"]
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(model_path)(torch.tensor([prompt])).logits.float()
    logp = torch.log_softmax(logits, dim=-1)[0]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == [13, 14, 15]
    assert meta["input_token_logprobs"][0][0] is None
    want = torch.stack([logp[2, 14], logp[3, 15]])
    torch.testing.assert_close(
        torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"][1:]]), want, atol=1e-4, rtol=0
    )
    tops = meta["input_top_logprobs"]
    assert len(tops) == 3 and tops[0] is None
    top = logp[2:4].topk(3, dim=-1)
    assert [[t for _, t, _ in row] for row in tops[1:]] == top.indices.tolist()
    torch.testing.assert_close(
        torch.tensor([[v for v, _, _ in row] for row in tops[1:]]), top.values, atol=1e-4, rtol=0
    )
    assert len(meta["output_top_logprobs"]) == 4

    status, _, events = run(stream_events(server, {**body, "stream": True}))
    chunks = events[:-1]
    assert status == 200 and events[-1] == "[DONE]" and chunks[-1]["output_ids"] == whole["output_ids"]
    for chunk in chunks:
        assert chunk["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]
        assert chunk["meta_info"]["input_top_logprobs"] == tops

    status, out = run(call(server, "/generate", {**body, "logprob_start_len": len(prompt) + 1}))
    assert status == 400 and "is higher than the number of input tokens" in out["error"]["message"]


def test_context_length_as_sglang(server: str, model_path: str) -> None:
    """A ``max_new_tokens`` that takes prompt + completion past the context is SGLang's 400 (its
    message; streamed, the one event of a 200, as SGLang answers); without one, generation just ends at the context. ``--allow-auto-truncate`` shrinks
    ``max_new_tokens`` (and cuts a prompt that fills the context) instead, as SGLang's flag does."""
    prompt = [7] * (CONTEXT - 12)
    too_long = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}
    status, out = run(call(server, "/generate", too_long))
    assert status == 400
    message = out["error"]["message"]
    assert message.startswith(f"Requested token count exceeds the model's maximum context length of {CONTEXT}")
    assert f"a total of {CONTEXT + 8} tokens: {CONTEXT - 12} tokens from the input" in message
    status, out = run(call(server, "/generate", {"input_ids": prompt, "sampling_params": {"ignore_eos": True}}))
    assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    status, _, events = run(stream_events(server, {**too_long, "stream": True}))  # SGLang's way: in the stream
    assert status == 200 and events[-1] == "[DONE]" and len(events) == 2
    assert events[0]["error"]["message"].startswith("Requested token count exceeds")
    status, out = run(call(server, "/generate", {"input_ids": [7] * CONTEXT}))
    assert status == 400
    assert (
        out["error"]["message"]
        == f"The input ({CONTEXT} tokens) is longer than the model's context length ({CONTEXT} tokens)."
    )

    procs, addresses = start_servers(model_path, 1, ["--context-length", str(CONTEXT), "--allow-auto-truncate"])
    try:
        url = f"http://{addresses[0]}"
        status, out = run(call(url, "/generate", too_long))
        assert status == 200 and len(out["output_ids"]) == 12
        status, out = run(
            call(url, "/generate", {"input_ids": [7] * (CONTEXT + 5), "sampling_params": {"max_new_tokens": 3}})
        )
        assert status == 200 and out["meta_info"]["prompt_tokens"] == CONTEXT - 1
    finally:
        stop_servers(procs)


def test_server_info_and_rids_as_sglang(server: str, model_path: str) -> None:
    """``/get_server_info`` has what SGLang's clients read (``internal_states[0]["last_gen_throughput"]``,
    ``max_total_num_tokens``, ``served_model_name`` as a string, ``version``); a batch's string
    ``rid`` names its prompts ``rid_0``, ``rid_1``; a rid list of the wrong length and per-prompt
    log-probability options with ``n > 1`` are SGLang's 400s."""
    sp = {"max_new_tokens": 3, "ignore_eos": True}
    status, out = run(call(server, "/generate", {"input_ids": [[5, 6], [7]], "rid": "grp", "sampling_params": sp}))
    assert status == 200 and [o["meta_info"]["id"] for o in out] == ["grp_0", "grp_1"]
    status, info = run(call(server, "/get_server_info", method="GET"))
    assert status == 200 and info["internal_states"][0]["last_gen_throughput"] > 0
    assert info["served_model_name"] == model_path and info["tokenizer_path"] == model_path
    assert info["max_total_num_tokens"] >= CONTEXT and info["max_req_input_len"] < CONTEXT and info["version"]
    status, out = run(call(server, "/generate", {"input_ids": [[5], [7]], "rid": ["a", "b", "c"]}))
    assert status == 400 and "mismatch" in out["error"]["message"]
    bad_n = {"input_ids": [[5], [7]], "sampling_params": {"n": 2}, "return_logprob": [True, False]}
    status, out = run(call(server, "/generate", bad_n))
    assert status == 400 and "parallel_sample_num" in out["error"]["message"]


BAD_INPUTS = [
    ("/generate", b'{"input_ids": [1, 2', "malformed JSON"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokenz": 3}}, "unknown sampling_params keys"),
    ("/generate", {"input_ids": [1] * CONTEXT}, "context length"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"min_new_tokens": -3}}, "min_new_tokens"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "4"}}, "integer"),
    ("/generate", {"input_ids": ["a"]}, "input_ids"),
    ("/generate", {"input_ids": [10**7]}, "token ids"),
    ("/generate", {"text": "a", "input_ids": [1]}, "exactly one"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ("/generate", {"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("/generate", {"input_ids": [1], "sampling_params": {"ebnf": "root ::= ("}}, "does not parse"),
    ("/generate", {"input_ids": [1], "sampling_params": {"structural_tag": "{}"}}, "not supported"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_regex": "a+"}}, "not supported"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 5}}, "min_new_tokens"),
    ("/generate", {"text": "a", "image_data": "cat.png"}, "image_data"),
    ("/generate", {"input_embeds": [[0.5, 0.5]]}, "input_embeds"),
    ("/generate", {"input_ids": [1], "return_logprob": True, "token_ids_logprob": [3]}, "token_ids_logprob"),
    ("/generate", {"input_ids": [1], "custom_logit_processor": "{}"}, "custom_logit_processor"),
    ("/generate", {"input_ids": [1], "return_hidden_states": True}, "return_hidden_states"),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "the same n"),
    ("/generate", {"input_ids": [[1], [2]], "return_logprob": [True]}, "return_logprob"),
    ("/generate", {"text": []}, "text"),
    ("/generate", {"input_ids": [[]]}, "empty"),
    ("/generate", {"input_ids": [1], "stream": "yes"}, "boolean"),
    ("/generate", {"input_ids": [1], "sampling_params": "greedy"}, "sampling_params"),
    (
        "/update_weights_from_distributed",
        {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1, 2]]},
        "shape",
    ),
    (
        "/update_weights_from_distributed",
        {"names": ["lm_head.weight"], "dtypes": ["floaty"], "shapes": [[1, 2]]},
        "dtype",
    ),
    (
        "/update_weights_from_distributed",
        {"names": ["nope"], "dtypes": ["float32"], "shapes": [[1]]},
        "unknown parameter",
    ),
    (
        "/update_weights_from_distributed",
        {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1], [2]]},
        "length",
    ),
    ("/update_weights_from_disk", {"model_path": "/nonexistent/dir"}, "safetensors"),
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"},
        "nccl",
    ),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/update_weight_version", {"new_version": "v-two"}, "integers"),
    # The OpenAI-compatible routes.
    ("/v1/chat/completions", b'{"messages": [', "malformed JSON"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "4"}, "integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": "7"}, "seed"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "x"}]}, "tools"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [], "tool_choice": "required"},
        "tool_choice",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "boolean"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream_options": {}}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi" * CONTEXT}]}, "context length"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [10**7]}, "token ids"),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": [1, 2], "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": [1, 2], "stop_token_ids": ["x"]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, 2], "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": [1, 2], "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/responses", {"input": []}, "input"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, "not stored"),
    (
        "/v1/responses",
        {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]},
        "text parts",
    ),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, "function tools"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema"}}}, "schema"),
    ("/v1/responses", {"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ("/inference/v1/generate", {"sampling_params": {}}, "token_ids"),
    ("/inference/v1/generate", {"token_ids": [1, 2]}, "sampling_params"),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"min_p": 1.1}}, "min_p"),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"bad_words": ["x"]}}, "bad_words"),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"logprobs": 99}}, "logprobs"),
    ("/inference/v1/generate", {"token_ids": [10**7], "sampling_params": {}}, "token ids"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 10**6}}, "context length"),
    # vLLM's control routes and our worker extension's calls.
    ("/pause?mode=wait", {}, "mode"),
    ("/collective_rpc", {"method": "execute_model", "args": []}, "method"),
    ("/collective_rpc", {"method": "areal_load_weights_from_disk", "args": [{"model_path": "/x"}]}, "JSON object"),
    (
        "/collective_rpc",
        {"method": "areal_load_weights_from_disk", "args": ['{"model_path": "/nonexistent"}']},
        "safetensors",
    ),
    (
        "/collective_rpc",
        {
            "method": "areal_receive_weights",
            "args": ['{"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]]}'],
        },
        "shape",
    ),
    (
        "/collective_rpc",
        {
            "method": "areal_join_weight_update_group",
            "args": ['{"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 3, "world_size": 2}'],
        },
        "rank_offset",
    ),
]


@pytest.mark.parametrize("path,body,message", BAD_INPUTS, ids=[f"{p}:{m}" for p, _, m in BAD_INPUTS])
def test_bad_input_is_400_and_server_keeps_serving(server: str, path: str, body: object, message: str) -> None:
    raw = body if isinstance(body, bytes) else None
    status, out = run(call(server, path, None if raw else body, raw=raw))
    assert status == 400
    text = out["error"]["message"] if "error" in out else out["message"]
    assert message.lower() in text.lower()
    status, ok = run(call(server, "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}))
    assert status == 200 and len(ok["output_ids"]) <= 2
    status, ok = run(call(server, "/v1/completions", {"prompt": [3, 4], "max_tokens": 2}))
    assert status == 200 and len(ok["choices"]) == 1


async def wait_running(url: str, task: asyncio.Future) -> None:
    """Until the server has a request in flight (flush_cache answers 400 then)."""
    while (await call(url, "/flush_cache"))[0] == 200:
        assert not task.done(), "the request ended before it was seen running"
        await asyncio.sleep(0.005)


def test_abort_request_and_pause_hold(server: str) -> None:
    async def scenario():
        long_body = {
            "input_ids": [1, 2],
            "rid": "long-7",
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
        }
        task = asyncio.ensure_future(call(server, "/generate", long_body))
        await wait_running(server, task)
        # Frozen in place first, so that the abort cannot lose a race with the request's end.
        await call(server, "/pause_generation", {"mode": "in_place"})
        assert (await call(server, "/abort_request", {"rid": "long-"}))[0] == 200
        aborted = await task
        held = asyncio.ensure_future(
            call(server, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}})
        )
        await wait_running(server, held)  # queued while paused
        assert not held.done()
        await call(server, "/continue_generation", {})
        return aborted, await held

    (s1, aborted), (s2, held) = run(scenario())
    assert s1 == 200 and aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert aborted["meta_info"]["id"] == "long-7" and len(aborted["output_ids"]) < 400
    assert s2 == 200 and len(held["output_ids"]) <= 3


def test_pause_abort_returns_partial_output(server: str) -> None:
    async def scenario():
        task = asyncio.ensure_future(
            call(
                server,
                "/generate",
                {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}},
            )
        )
        await wait_running(server, task)
        await call(server, "/pause_generation", {"mode": "in_place"})
        await call(server, "/pause_generation", {"mode": "abort"})
        out = await task
        await call(server, "/continue_generation", {})
        return out

    status, out = run(scenario())
    assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "abort", "message": "paused"}
    assert len(out["output_ids"]) < 400
    assert len(out["meta_info"]["output_token_versions"]) == len(out["output_ids"])


def test_weight_updates_disk_and_broadcast(server: str, model_path: str, tmp_path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(tmp_path / "v1"))
    status, out = run(
        call(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "v1"), "weight_version": "1"})
    )
    assert status == 200 and out["success"] is True
    check_logprobs(server, model, "1")

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    port = find_free_port()

    async def broadcast() -> None:
        joined = asyncio.ensure_future(
            call(
                server,
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": str(port),  # as AReaL's client sends it; SGLang takes both
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": "g",
                    "backend": "gloo",
                },
            )
        )
        group = await asyncio.to_thread(init_custom_process_group, "gloo", "127.0.0.1", port, 0, 2, "g", 60)
        assert (await joined)[0] == 200
        state = model.state_dict()
        names = list(state)
        for i, chunk in enumerate((names[:5], names[5:])):
            if i == 0:  # SGLang >= 0.5.21 wraps updates in a session; older versions do not
                assert (await call(server, "/begin_weight_update", {"selector": "all"}))[0] == 200
            body = {
                "names": chunk,
                "dtypes": ["float32"] * len(chunk),
                "shapes": [list(state[n].shape) for n in chunk],
                "group_name": "g",
                "weight_version": "2",
            }
            fut = asyncio.ensure_future(call(server, "/update_weights_from_distributed", body))
            for n in chunk:
                await asyncio.to_thread(group.broadcast, state[n].clone())
            status, out = await fut
            assert status == 200 and out["success"] is True
            if i == 0:
                assert (await call(server, "/end_weight_update", {}))[0] == 200
        assert (await call(server, "/destroy_weights_update_group", {"group_name": "g"}))[0] == 200

    run(broadcast())
    check_logprobs(server, model, "2")
    status, out = run(call(server, "/update_weight_version", {"new_version": "5"}))
    assert status == 200 and run(call(server, "/model_info", method="GET"))[1]["weight_version"] == "5"
    check_logprobs(server, model, "5")


def test_lora_adapter_routes(server: str, model_path: str, tmp_path) -> None:
    """SGLang's LoRA routes: an adapter loaded from a PEFT directory, or registered and then filled
    by a broadcast announced as ``<adapter>:<tensor>``, serves requests that name it with
    log-probabilities equal to peft's forward (1e-5); unloading puts the base model back."""
    from peft import get_peft_model
    from peft.utils import get_peft_model_state_dict

    from areal_lite.api.config import LoRAConfig
    from areal_lite.utils.lora import config_dict, peft_config

    def adapter(seed: int, rank: int):
        peft_model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(model_path), peft_config(LoRAConfig(rank=rank))
        )
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        return peft_model.eval()

    def assert_serves(model: torch.nn.Module, lora_path: object) -> None:
        body = {"input_ids": [[11, 12, 13], [20, 21]], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
        status, out = run(call(server, "/generate", {**body, "return_logprob": True, "lora_path": lora_path}))
        assert status == 200, out
        for prompt, o in zip(body["input_ids"], out):
            lps = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]])
            torch.testing.assert_close(lps, hf_logprobs(model, prompt, o["output_ids"]), atol=1e-5, rtol=0)

    base = AutoModelForCausalLM.from_pretrained(model_path).eval()
    assert run(call(server, "/update_weights_from_disk", {"model_path": model_path, "weight_version": "0"}))[0] == 200
    status, out = run(call(server, "/generate", {"input_ids": [1, 2], "lora_path": "policy"}))
    assert status == 400 and "not loaded" in out["error"]["message"]

    first = adapter(seed=1, rank=4)
    first.save_pretrained(str(tmp_path / "a1"))
    status, out = run(
        call(server, "/load_lora_adapter", {"lora_name": "policy", "lora_path": str(tmp_path / "a1"), "pinned": False})
    )
    assert status == 200 and out == {
        "success": True,
        "error_message": "",
        "loaded_adapters": {"policy": str(tmp_path / "a1")},
    }
    assert_serves(first, "policy")
    assert_serves(first, ["policy", None])  # one entry per prompt; the server holds one adapter, merged

    for path, body, message in [
        ("/load_lora_adapter", {"lora_name": "other", "lora_path": str(tmp_path / "a1")}, "one adapter at a time"),
        ("/load_lora_adapter", {"lora_name": "policy", "lora_path": str(tmp_path)}, "not a PEFT adapter directory"),
        ("/update_weights_from_disk", {"model_path": model_path}, "unload it"),
        ("/unload_lora_adapter", {"lora_name": "other"}, "not loaded"),
        (
            "/register_lora_adapter",
            {"lora_name": "policy", "config_dict": {"peft_type": "NOPE"}},
            "PEFT adapter config",
        ),
    ]:
        status, out = run(call(server, path, body))
        assert status == 400 and out["success"] is False and message in (out.get("error_message") or out["message"]), (
            path,
            out,
        )
    assert_serves(first, "policy")  # nothing changed

    status, out = run(call(server, "/unload_lora_adapter", {"lora_name": "policy"}))
    assert status == 200 and out["loaded_adapters"] == {}
    assert_serves(base, None)

    second = adapter(seed=2, rank=2)
    config = config_dict(second.peft_config["default"])
    status, out = run(call(server, "/register_lora_adapter", {"lora_name": "policy", "config_dict": config}))
    assert status == 200 and out["loaded_adapters"] == {"policy": "registered"}
    assert_serves(base, "policy")  # registered with zero weights: the base model
    tensors = get_peft_model_state_dict(second)
    port = find_free_port()

    async def broadcast() -> None:
        join = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "lora",
            "backend": "gloo",
        }
        joined = asyncio.ensure_future(call(server, "/init_weights_update_group", join))
        group = await asyncio.to_thread(init_custom_process_group, "gloo", "127.0.0.1", port, 0, 2, "lora", 60)
        assert (await joined)[0] == 200
        names = sorted(tensors)
        bad = {
            "names": ["other:" + names[0]],
            "dtypes": ["float32"],
            "shapes": [list(tensors[names[0]].shape)],
            "group_name": "lora",
        }
        assert (await call(server, "/update_weights_from_distributed", bad))[0] == 400
        for chunk in (names[::2], names[1::2]):
            body = {
                "names": [f"policy:{n}" for n in chunk],
                "dtypes": ["float32"] * len(chunk),
                "shapes": [list(tensors[n].shape) for n in chunk],
                "group_name": "lora",
                "weight_version": "3",
            }
            fut = asyncio.ensure_future(call(server, "/update_weights_from_distributed", body))
            for n in chunk:
                await asyncio.to_thread(group.broadcast, tensors[n].detach().clone())
            status, out = await fut
            assert status == 200 and out["success"] is True
        assert (await call(server, "/destroy_weights_update_group", {"group_name": "lora"}))[0] == 200

    run(broadcast())
    assert_serves(second, "policy")
    assert run(call(server, "/unload_lora_adapter", {"lora_name": "policy"}))[0] == 200


def test_text_prompts_get_the_tokenizers_special_tokens_as_sglang_and_vllm_encode_them(tmp_path) -> None:
    """With a tokenizer that starts what it encodes with a BOS (Llama's kind): SGLang's text prompt
    and a completion's (vLLM's ``add_special_tokens``, true by default) count it, a chat's does not
    (false by default: the template writes its own start). test_vllm_openai_parity holds the
    OpenAI side to a real vLLM on such a tokenizer."""
    path = build_tiny_model(str(tmp_path / "m"), hidden_size=64, num_layers=2)
    with_bos(path)
    procs, addresses = start_servers(path, 1)
    url = f"http://{addresses[0]}"
    try:
        bare = len(AutoTokenizer.from_pretrained(path).encode("ab", add_special_tokens=False))
        _, out = run(call(url, "/generate", {"text": "ab", "sampling_params": {"max_new_tokens": 1}}))
        assert out["meta_info"]["prompt_tokens"] == bare + 1
        for special, expected in ((None, bare + 1), (True, bare + 1), (False, bare)):
            body = {"prompt": "ab", "max_tokens": 1, **({} if special is None else {"add_special_tokens": special})}
            _, out = run(call(url, "/v1/completions", body))
            assert out["usage"]["prompt_tokens"] == expected, (special, out)
        chat = {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 1}
        _, plain = run(call(url, "/v1/chat/completions", chat))
        _, with_special = run(call(url, "/v1/chat/completions", {**chat, "add_special_tokens": True}))
        assert with_special["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + 1
    finally:
        stop_servers(procs)
