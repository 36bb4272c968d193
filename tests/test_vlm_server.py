"""Our server with a vision-language model: OpenAI chat ``image_url`` parts (data URLs) through the
real ``openai`` SDK, SGLang's ``/generate`` with ``image_data`` in each of its forms, vLLM's
``/inference/v1/generate`` with ``content_parts``, and both remote clients sending images (and a
disk weight update) to it; every answer's log-probabilities equal a HF forward with the same images
(fp32, 1e-4). Bad images are 400s that say why."""

from __future__ import annotations

import asyncio
import base64
import os
import sys
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.io import ModelRequest, WeightUpdateMeta
from areal_lite.engines.remote.sglang import RemoteSGLangEngine
from areal_lite.engines.remote.vllm import RemoteVLLMEngine
from areal_lite.utils.tiny_vlm import VISION_TOKENS, build_tiny_vlm
from areal_lite.utils.vision import data_url, encode_image, load_processor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from inference_servers import start_servers, stop_servers
from test_vlm_serving import BLUE, GREEN, RED, Prompt, hf_logprobs

CLIENTS = {"sglang": RemoteSGLangEngine, "vllm": RemoteVLLMEngine}
QUESTION = "What colour is it?"


@dataclass
class VLM:
    """The tiny VLM under test: its directory, its HF model and its processor."""

    path: str
    hf: torch.nn.Module
    processor: object


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> VLM:
    path = build_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "tiny"), seed=5)
    return VLM(path, AutoModelForImageTextToText.from_pretrained(path).eval(), load_processor(path))


@pytest.fixture(scope="module")
def address(vlm: VLM):
    procs, addresses = start_servers(vlm.path, 1)
    yield addresses[0]
    stop_servers(procs)


def no_vision(processor: object) -> dict[str, int]:
    """OpenAI's ``logit_bias`` that keeps vision tokens out of an answer (a HF forward counts
    every image token of a sequence as one of its images'; reported log-probabilities are the
    policy's, before the bias)."""
    return {str(t): -100 for t in processor.tokenizer.convert_tokens_to_ids(VISION_TOKENS)}


def assert_scored(model: torch.nn.Module, prompt: Prompt, output: list[int], logprobs: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(logprobs), hf_logprobs(model, prompt, output), atol=1e-4, rtol=0)


def test_openai_sdk_sends_an_image_and_gets_the_answer(address: str, vlm: VLM) -> None:
    """The chat template renders the image part, the server expands its placeholder as the
    processor does (the same prompt ids), and the answer's log-probabilities are the HF forward's."""
    hf, processor = vlm.hf, vlm.processor
    prompt = Prompt(processor, QUESTION, [RED])
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="none")
    content = [
        {"type": "image_url", "image_url": {"url": data_url(encode_image(RED))}},
        {"type": "text", "text": QUESTION},
    ]
    answer = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=12,
        logprobs=True,
        logit_bias=no_vision(processor),
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = answer.choices[0]
    assert answer.prompt_token_ids == prompt.ids
    assert answer.usage.prompt_tokens == len(prompt.ids) and answer.usage.completion_tokens == 12
    assert isinstance(choice.message.content, str) and choice.finish_reason == "length"
    assert_scored(hf, prompt, choice.token_ids, [c.logprob for c in choice.logprobs.content])

    streamed = client.chat.completions.create(
        model=answer.model, messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0,
        logit_bias=no_vision(processor), extra_body={"ignore_eos": True}, stream=True,
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    greedy = client.chat.completions.create(
        model=answer.model, messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0,
        logit_bias=no_vision(processor), extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert text == greedy.choices[0].message.content

    with pytest.raises(openai.BadRequestError, match="not fetched from URLs"):
        client.chat.completions.create(
            model=answer.model,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]}],
        )
    with pytest.raises(openai.BadRequestError, match="base64"):
        url = "data:image/png;base64,@@@"
        client.chat.completions.create(
            model=answer.model,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
        )


def test_generate_takes_image_data_in_sglangs_forms(address: str, vlm: VLM) -> None:
    """``image_data`` for one prompt (a list, or one image) and for a batch (one entry per prompt),
    with text prompts (one placeholder an image) and token ids (expanded), as base64 or data URLs."""
    hf, processor = vlm.hf, vlm.processor
    one, two = Prompt(processor, QUESTION, [GREEN]), Prompt(processor, "Which is bigger?", [GREEN, BLUE])
    plain = Prompt(processor, "No image.", [])
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    b64 = base64.b64encode(encode_image(GREEN)).decode()
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    url = f"http://{address}/generate"
    single = httpx.post(url, json={"text": text, "image_data": b64, "sampling_params": params, "return_logprob": True})
    assert single.status_code == 200, single.text
    out = single.json()
    assert out["meta_info"]["prompt_tokens"] == len(one.ids)
    as_ids = httpx.post(url, json={"input_ids": one.ids, "image_data": [data_url(encode_image(GREEN))],
                                   "sampling_params": params, "return_logprob": True}).json()  # fmt: skip
    assert as_ids["output_ids"] == out["output_ids"]
    batch = httpx.post(url, json={
        "input_ids": [one.ids, two.ids, plain.ids], "image_data": [b64, [data_url(i) for i in two.images], None],
        "sampling_params": params, "return_logprob": True,
    }, timeout=60).json()  # fmt: skip
    for prompt, answer in zip([one, two, plain], batch):
        output = answer["output_ids"]
        assert not set(output) & set(processor.tokenizer.convert_tokens_to_ids(VISION_TOKENS)), (
            "greedy said <|image_pad|>"
        )
        assert_scored(hf, prompt, output, [e[0] for e in answer["meta_info"]["output_token_logprobs"]])
    assert batch[0]["output_ids"] == out["output_ids"]

    bad = [
        ({"input_ids": one.ids, "image_data": "https://x/cat.png"}, "not fetched"),
        ({"input_ids": one.ids, "image_data": "cat.png"}, "base64"),
        ({"input_ids": one.ids, "image_data": [b64, b64]}, "for 1 image"),
        ({"input_ids": [one.ids, plain.ids], "image_data": [b64]}, "one entry per prompt"),
        ({"input_ids": one.ids, "image_data": base64.b64encode(b"no image").decode()}, "not an image file"),
    ]
    for body, message in bad:
        r = httpx.post(url, json={**body, "sampling_params": params})
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)


def test_token_in_route_takes_content_parts(address: str, vlm: VLM) -> None:
    """vLLM 0.32's ``/inference/v1/generate``: ``content_parts`` with image data URLs; the
    placeholder expanded (``prompt_token_ids``), log-probabilities scored by HF."""
    hf, processor = vlm.hf, vlm.processor
    prompt = Prompt(processor, QUESTION, [BLUE])
    collapsed = processor.tokenizer(
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
            tokenize=False,
            add_generation_prompt=True,
        )
    )["input_ids"]
    body = {
        "token_ids": collapsed,
        "content_parts": [{"type": "image_url", "url": data_url(prompt.images[0])}],
        "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 0, "ignore_eos": True},
        "return_token_ids": True,
    }
    r = httpx.post(f"http://{address}/inference/v1/generate", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["prompt_token_ids"] == prompt.ids and len(collapsed) < len(prompt.ids)
    [choice] = answer["choices"]
    assert_scored(hf, prompt, choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]])
    bad = httpx.post(f"http://{address}/inference/v1/generate", json={**body, "content_parts": [{"type": "audio_url"}]})
    assert bad.status_code == 400 and "images only" in bad.json()["error"]["message"]


@pytest.mark.parametrize("kind", sorted(CLIENTS))
def test_remote_clients_send_images_and_weight_updates(kind: str, address: str, vlm: VLM, tmp_path) -> None:
    """`RemoteSGLangEngine` (``image_data``) and `RemoteVLLMEngine` (``/inference/v1/generate``
    with ``content_parts``) against our server: answers scored by HF with the images, before and
    after a disk update of every weight (the vision tower's too)."""
    hf, processor, vlm_dir = vlm.hf, vlm.processor, vlm.path
    prompts = [
        Prompt(processor, QUESTION, [RED]),
        Prompt(processor, "Two?", [GREEN, BLUE]),
        Prompt(processor, "Hi", []),
    ]
    config = InferenceEngineConfig(addresses=[address], request_timeout=60, setup_timeout=60)
    engine = CLIENTS[kind](config)
    engine.initialize()
    greedy = {"greedy": True, "ignore_eos": True}
    g = torch.Generator().manual_seed(11)
    new = AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    new.save_pretrained(str(tmp_path / "v1"))
    vision_ids = set(processor.tokenizer.convert_tokens_to_ids(VISION_TOKENS))

    async def run(requests: list[ModelRequest]):
        return await asyncio.gather(*[engine.agenerate(r) for r in requests])

    try:
        engine.update_weights(WeightUpdateMeta(type="disk", path=vlm_dir, version=0)).result()
        for model, version in ((hf, 0), (new, 1)):
            if version:
                engine.update_weights(WeightUpdateMeta(type="disk", path=str(tmp_path / "v1"), version=1)).result()
                engine.set_version(1)
            answers = asyncio.run(run([p.request(10, **greedy) for p in prompts]))
            for prompt, answer in zip(prompts, answers):
                assert not set(answer.output_tokens) & vision_ids, "greedy said a vision token: change the prompt"
                assert answer.output_versions == [version] * 10
                assert_scored(model, prompt, answer.output_tokens, answer.output_logprobs)
    finally:
        engine.update_weights(WeightUpdateMeta(type="disk", path=vlm_dir, version=0)).result()
        engine.destroy()


def test_a_text_model_refuses_images(tmp_path) -> None:
    from areal_lite.utils.tiny import build_tiny_model

    path = build_tiny_model(str(tmp_path / "text"), hidden_size=64, num_layers=1)
    procs, [address] = start_servers(path, 1)
    try:
        image = base64.b64encode(encode_image(Image.new("RGB", (28, 28)))).decode()
        r = httpx.post(f"http://{address}/generate", json={"input_ids": [5, 6], "image_data": image})
        assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"]
        content = [{"type": "image_url", "image_url": {"url": data_url(encode_image(Image.new("RGB", (28, 28))))}}]
        r = httpx.post(
            f"http://{address}/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
        assert "takes no images" in r.json()["error"]["message"]
    finally:
        stop_servers(procs)
