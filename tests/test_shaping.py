"""Penalties, logit biases and min-p in the embedded engine (`areal_lite.engines.local.shaping`): the
repetition penalty and min-p equal transformers' own logits processors, frequency and presence
penalties follow OpenAI's formula, greedy generation with a repetition penalty equals HF
``generate``'s, a bias steers the tokens while the reported log-probabilities stay the policy's,
min-p sampling draws from the distribution it leaves, and the server's three protocols take the
options (and refuse bad values) as vLLM and SGLang do. The same options are compared with a real
vLLM in test_vllm_openai_parity."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from areal_lite.api.config import InferenceEngineConfig, LocalEngineConfig
from areal_lite.api.io import GenerationConfig, ModelRequest
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.local.request import SamplingParams, Sequence
from areal_lite.engines.local.shaping import min_p_masked, shaped
from areal_lite.engines.remote.sglang import RemoteSGLangEngine
from areal_lite.engines.remote.vllm import RemoteVLLMEngine
from areal_lite.utils.tiny import build_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from inference_servers import start_servers, stop_servers

VOCAB = 50


def sequence(prompt: list[int], out: list[int], **params: object) -> Sequence:
    s = Sequence("r", prompt, SamplingParams(**params), lambda _: None, frozenset({0}), False)
    s.out = list(out)
    return s


def test_repetition_penalty_equals_transformers() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    prompt, out = [3, 7, 7, 9], [9, 11, 3]
    ours = shaped(logits, [sequence(prompt, out, repetition_penalty=1.7), sequence(prompt, out)])
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + out]), logits[:1].clone())
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
    assert torch.equal(ours[1], logits[1])  # a row without options is left as it is


def test_frequency_and_presence_penalties_follow_openai_and_bias_is_added_and_clamped() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    out = [4, 4, 4, 8, 20]
    s = sequence([1, 2, 4], out, frequency_penalty=0.5, presence_penalty=-1.25, logit_bias={8: 3.0, 30: -500.0})
    expected = logits[0].clone()
    for token in set(out):  # OpenAI: mu[j] - c[j] * frequency - (c[j] > 0) * presence, output tokens only
        expected[token] -= out.count(token) * 0.5 + 1 * -1.25
    expected[8] += 3.0
    expected[30] -= 100.0  # clamped to [-100, 100], as vLLM does
    torch.testing.assert_close(shaped(logits, [s])[0], expected)
    assert s.params.logit_bias == {8: 3.0, 30: -100.0}
    # Nothing out yet: no frequency or presence penalty; the prompt does not count for them.
    first = sequence([4, 4], [], frequency_penalty=2.0, presence_penalty=2.0)
    assert torch.equal(shaped(logits, [first]), logits)


def test_min_tokens_suppression_comes_before_the_bias() -> None:
    """vLLM's order: a stop token held back by min_tokens stays out even with a +100 bias."""
    logits = torch.zeros(1, VOCAB)
    s = sequence([5], [6], min_new_tokens=3, logit_bias={0: 100.0})
    assert shaped(logits, [s])[0, 0] == float("-inf")
    s.out = [6, 6, 6]
    assert shaped(logits, [s])[0, 0] == 100.0


def test_min_p_equals_transformers() -> None:
    scores = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    params = [SamplingParams(min_p=0.2), SamplingParams(), SamplingParams(min_p=0.9)]
    ours = min_p_masked(scores, params)
    for row, p in zip(range(3), params):
        theirs = MinPLogitsWarper(p.min_p)(None, scores[row : row + 1].clone()) if p.min_p else scores[row : row + 1]
        assert torch.equal(ours[row], theirs[0])
    assert min_p_masked(scores, [SamplingParams()] * 3) is scores


@pytest.mark.parametrize(
    "bad",
    [
        {"frequency_penalty": 2.5},
        {"presence_penalty": -3.0},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("nan")},
        {"min_p": 1.5},
        {"logit_bias": {3: float("inf")}},
    ],
)
def test_bad_values_raise(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("shaping") / "m"), hidden_size=64, num_layers=2)


@pytest.fixture(scope="module")
def engine(model_path: str):
    eng = LocalInferenceEngine(LocalEngineConfig(path=model_path, max_running_requests=512, seed=3))
    eng.initialize()
    yield eng
    eng.destroy()


def generate_all(engine: LocalInferenceEngine, jobs: list[tuple[list[int], SamplingParams]]):
    async def run():
        return await asyncio.gather(*[engine.scheduler.generate(p, sp) for p, sp in jobs])

    return asyncio.run(run())


def test_greedy_with_a_repetition_penalty_equals_hf_generate(engine: LocalInferenceEngine, model_path: str) -> None:
    """Penalized rows beside plain ones in one batch: each as HF ``generate`` decodes it alone."""
    hf = AutoModelForCausalLM.from_pretrained(model_path).eval()
    prompts = [[5, 9, 11, 20], [100, 3, 3, 3], list(range(30, 50))]
    jobs = [(p, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, repetition_penalty=rp))
            for p in prompts for rp in (1.0, 1.8)]  # fmt: skip
    results = generate_all(engine, jobs)
    for (p, params), r in zip(jobs, results):
        expected = hf.generate(
            torch.tensor([p]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
            repetition_penalty=params.repetition_penalty,
        )[0, len(p):].tolist()  # fmt: skip
        assert r.output_ids == expected
    changed = sum(plain.output_ids != penalized.output_ids for plain, penalized in zip(results[::2], results[1::2]))
    assert changed >= 2  # the penalty changed what was generated


def test_a_bias_steers_tokens_and_the_reported_logprobs_stay_the_policys(
    engine: LocalInferenceEngine, model_path: str
) -> None:
    hf = AutoModelForCausalLM.from_pretrained(model_path).eval()
    prompt = [5, 9, 11, 20]
    [r] = generate_all(engine, [(prompt, SamplingParams(max_new_tokens=6, temperature=0.8, logit_bias={42: 100.0}))])
    assert r.output_ids == [42] * 6
    ids = torch.tensor([prompt + r.output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits.float(), dim=-1)[0, len(prompt) - 1 : -1]
    policy = logp.gather(1, ids[0, len(prompt) :, None])[:, 0]
    torch.testing.assert_close(torch.tensor(r.output_logprobs), policy, atol=1e-4, rtol=0)
    assert max(r.output_logprobs) < -1.0  # far from what a biased distribution would report (~0)


def test_presence_penalty_keeps_a_greedy_output_from_repeating(engine: LocalInferenceEngine) -> None:
    """A strong enough presence penalty makes every token new: its logit falls by the penalty
    once used, and a tiny random model's logits lie within a few tenths of each other."""
    prompt = [5, 9, 11, 20]
    plain, penalized = generate_all(
        engine,
        [(prompt, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, **kw))
         for kw in ({}, {"presence_penalty": 2.0})],
    )  # fmt: skip
    assert len(set(plain.output_ids)) < 16  # the plain greedy output repeats itself
    assert len(set(penalized.output_ids)) == 16


def test_min_p_sampling_follows_the_distribution_it_leaves(engine: LocalInferenceEngine, model_path: str) -> None:
    hf = AutoModelForCausalLM.from_pretrained(model_path).eval()
    prompt, n, temperature, min_p = [5, 9, 11, 20], 2000, 0.05, 0.3
    with torch.no_grad():
        probs = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, dim=-1)
    keep = probs >= min_p * probs.max()
    expected = torch.where(keep, probs, 0.0) / probs[keep].sum()
    assert 1 < int(keep.sum()) < int((probs > 1e-3).sum())  # min-p cuts tokens that would be drawn
    results = generate_all(
        engine, [(prompt, SamplingParams(max_new_tokens=1, temperature=temperature, min_p=min_p))] * n
    )
    freq = torch.bincount(torch.tensor([r.output_ids[0] for r in results]), minlength=len(probs)) / n
    # 4 standard deviations of a frequency estimated from 2000 draws is at most 0.045
    torch.testing.assert_close(freq, expected, atol=0.045, rtol=0)


def test_generation_config_carries_the_options(engine: LocalInferenceEngine) -> None:
    g = GenerationConfig(max_new_tokens=16, greedy=True, ignore_eos=True, presence_penalty=2.0)
    resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=[5, 9, 11, 20], gconfig=g)))
    assert len(set(resp.output_tokens)) == 16
    assert g.to_sglang()["presence_penalty"] == 2.0 and "repetition_penalty" not in g.to_sglang()


@pytest.fixture(scope="module")
def server(model_path: str):
    procs, addresses = start_servers(model_path, 1)
    yield f"http://{addresses[0]}"
    stop_servers(procs)


def test_the_server_takes_the_options_on_every_protocol(server: str) -> None:
    prompt, bias = [5, 9, 11, 20], {"42": 100}
    sglang = requests.post(f"{server}/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 3, "logit_bias": bias, "repetition_penalty": 1.2, "min_p": 0.1}}, timeout=60)  # fmt: skip
    assert sglang.status_code == 200 and sglang.json()["output_ids"] == [42] * 3
    openai = requests.post(f"{server}/v1/completions", json={"prompt": prompt, "max_tokens": 3, "logit_bias": bias,
        "frequency_penalty": 0.5, "presence_penalty": 0.5, "return_token_ids": True}, timeout=60)  # fmt: skip
    assert openai.status_code == 200 and openai.json()["choices"][0]["token_ids"] == [42] * 3
    tokens = requests.post(f"{server}/inference/v1/generate", json={"token_ids": prompt, "sampling_params": {
        "max_tokens": 3, "logit_bias": bias, "min_p": 0.2}}, timeout=60)  # fmt: skip
    assert tokens.status_code == 200 and tokens.json()["choices"][0]["token_ids"] == [42] * 3


@pytest.mark.parametrize("client", [RemoteSGLangEngine, RemoteVLLMEngine])
def test_remote_clients_send_the_options(server: str, engine: LocalInferenceEngine, client: type) -> None:
    """A `GenerationConfig`'s penalties and min-p reach the server on both protocols: the same
    greedy tokens as the embedded engine with them, not those without."""
    g = GenerationConfig(max_new_tokens=12, greedy=True, ignore_eos=True, repetition_penalty=1.8, presence_penalty=0.5)
    req = ModelRequest(input_ids=[5, 9, 11, 20], gconfig=g.new(min_p=0.2))
    local, plain = (asyncio.run(engine.agenerate(r)) for r in (req, ModelRequest([5, 9, 11, 20], g.new(
        repetition_penalty=1.0, presence_penalty=0.0))))  # fmt: skip
    remote = client(InferenceEngineConfig(addresses=[server.removeprefix("http://")], request_timeout=60))
    remote.initialize()
    try:
        assert asyncio.run(remote.agenerate(req)).output_tokens == local.output_tokens != plain.output_tokens
    finally:
        remote.destroy()


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/completions", {"prompt": [1, 2], "frequency_penalty": 2.5}, "frequency_penalty"),
        ("/v1/completions", {"prompt": [1, 2], "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": [1, 2], "min_p": -0.1}, "min_p"),
        ("/v1/completions", {"prompt": [1, 2], "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": [1, 2], "logit_bias": {"1": "up"}}, "logit_bias"),
        ("/v1/completions", {"prompt": [1, 2], "logit_bias": [1]}, "logit_bias"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 9},
            "presence_penalty",
        ),
        ("/generate", {"input_ids": [1], "sampling_params": {"repetition_penalty": -1}}, "repetition_penalty"),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"min_p": 2}}, "min_p"),
    ],
)
def test_bad_options_are_a_400_naming_them(server: str, route: str, body: dict, param: str) -> None:
    r = requests.post(f"{server}{route}", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("route", ["/v1/completions", "/generate"])
def test_a_bias_on_a_token_outside_the_vocabulary_is_a_400(server: str, route: str) -> None:
    body = {"prompt": [1, 2], "logit_bias": {"100000": 5}} if route == "/v1/completions" else {
        "input_ids": [1, 2], "sampling_params": {"logit_bias": {"100000": 5}}}  # fmt: skip
    r = requests.post(f"{server}{route}", json=body, timeout=60)
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], r.text
    assert requests.get(f"{server}/health", timeout=10).status_code == 200
