"""Serving a vision-language model: the embedded engine with images (log-probabilities equal a HF
forward with the same images, rows with and without images in one batch, weight updates, the
decode step the GPU replays as a graph), and the requests it refuses."""

from __future__ import annotations

import asyncio

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from areal_lite.api.config import LocalEngineConfig
from areal_lite.api.io import GenerationConfig, ModelRequest, WeightUpdateMeta
from areal_lite.cpu import fused_ops
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.local.request import SamplingParams
from areal_lite.utils.tiny import build_tiny_model
from areal_lite.utils.tiny_vlm import VISION_TOKENS, build_tiny_vlm
from areal_lite.utils.vision import encode_image, image_token_mask, load_processor

RED = Image.new("RGB", (84, 140), (200, 10, 10))
GREEN = Image.new("RGB", (112, 112), (10, 200, 10))
BLUE = Image.new("RGB", (56, 56), (1, 2, 250))


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "tiny"), seed=3)


@pytest.fixture(scope="module")
def hf(vlm_dir: str) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()


def make_engine(path: str, **kw: object) -> LocalInferenceEngine:
    engine = LocalInferenceEngine(LocalEngineConfig(path=path, **kw))
    engine.initialize()
    return engine


class Prompt:
    """A chat prompt with images, as a workflow makes it: the processor's token ids (image tokens
    expanded) and pixels, and the images' PNG bytes for the engine."""

    def __init__(self, processor: object, text: str, images: list[Image.Image]) -> None:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        rendered = processor.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        self.enc = processor(text=[rendered], images=images or None, return_tensors="pt")
        self.ids: list[int] = self.enc["input_ids"][0].tolist()
        self.images = [encode_image(i) for i in images]
        self.processor_tokens = processor.tokenizer.convert_tokens_to_ids(VISION_TOKENS)

    def request(self, n: int, **gconfig: object) -> ModelRequest:
        return ModelRequest(
            input_ids=self.ids, gconfig=GenerationConfig(max_new_tokens=n, **gconfig), images=self.images
        )

    def params(self, n: int) -> SamplingParams:
        """``n`` tokens, never a vision token: a HF forward counts every image token of a sequence
        as one of its images' (reported log-probabilities are the policy's, before the bias)."""
        vision = self.processor_tokens
        return SamplingParams(max_new_tokens=n, ignore_eos=True, logit_bias=dict.fromkeys(vision, -100.0))


def hf_logprobs(model: torch.nn.Module, prompt: Prompt, output: list[int]) -> torch.Tensor:
    """Each output token's log-probability under a HF forward of prompt + output with the prompt's images."""
    ids = torch.tensor([prompt.ids + output])
    kw = {}
    if "pixel_values" in prompt.enc:
        kw = {
            "pixel_values": prompt.enc["pixel_values"],
            "image_grid_thw": prompt.enc["image_grid_thw"],
            "mm_token_type_ids": (ids == model.config.image_token_id).int(),
        }
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, **kw).logits.float(), dim=-1)[0, :-1]
    return logp.gather(1, ids[0, 1:, None])[len(prompt.ids) - 1 :, 0]


async def wait_tokens(engine: LocalInferenceEngine, rid: str, n: int) -> None:
    while (engine.scheduler.generated_tokens(rid) or 0) < n:
        await asyncio.sleep(0.005)


async def generate(engine: LocalInferenceEngine, prompt: Prompt, n: int, rid: str | None = None):
    _, images = await engine.scheduler.prepare_images(prompt.ids, prompt.images)
    return await engine.scheduler.generate(prompt.ids, prompt.params(n), rid=rid, images=images)


def generate_all(engine: LocalInferenceEngine, prompts: list[Prompt], lengths: list[int]):
    async def run():
        return await asyncio.gather(*[generate(engine, p, n) for p, n in zip(prompts, lengths)])

    return asyncio.run(run())


@pytest.mark.parametrize("fused", [True, False], ids=["fused-ops", "torch-ops"])
def test_logprobs_with_images_equal_hf_forward(vlm_dir: str, hf: torch.nn.Module, fused: bool, monkeypatch) -> None:
    """One image, two images, no image, and the same tokens with other pixels (which must not share
    a prefill), in one batch with fewer rows than requests: each request's log-probabilities equal
    a HF forward of its prompt, output and images."""
    if not fused:
        monkeypatch.setenv(fused_ops.ENV, "0")
    processor = load_processor(vlm_dir)
    prompts = [
        Prompt(processor, "What colour?", [RED]),
        Prompt(processor, "Which is larger?", [GREEN, BLUE]),
        Prompt(processor, "No picture here, just text.", []),
        Prompt(processor, "What colour?", [Image.new("RGB", (84, 140), (10, 10, 200))]),
        Prompt(processor, "Describe.", [BLUE]),
    ]
    assert prompts[0].ids == prompts[3].ids
    engine = make_engine(vlm_dir, max_running_requests=3)
    try:
        assert (engine.scheduler._runner.ops is not None) == fused
        results = generate_all(engine, prompts, [6 + 3 * i for i in range(len(prompts))])
    finally:
        engine.destroy()
    for i, (p, r) in enumerate(zip(prompts, results)):
        assert len(r.output_ids) == 6 + 3 * i and r.output_versions == [0] * len(r.output_ids)
        expected = hf_logprobs(hf, p, r.output_ids)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), expected, atol=1e-4, rtol=0)
    # Other pixels, other features: the first token's distribution differs between prompts 0 and 3.
    first = [hf_logprobs(hf, prompts[i], results[0].output_ids[:1]) for i in (0, 3)]
    assert not torch.allclose(first[0], first[1], atol=1e-4)


def test_image_requests_join_a_running_batch(vlm_dir: str, hf: torch.nn.Module) -> None:
    """Continuous batching: image requests admitted while a text request decodes, their prefill in
    the same passes as its decode steps, and a text request after them."""
    processor = load_processor(vlm_dir)
    text, red, both = (
        Prompt(processor, "Count slowly.", []),
        Prompt(processor, "What colour?", [RED]),
        Prompt(processor, "Two?", [GREEN, BLUE]),
    )
    engine = make_engine(vlm_dir)

    async def run():
        long = asyncio.ensure_future(generate(engine, text, 60, rid="long"))
        await wait_tokens(engine, "long", 10)
        mid = await asyncio.gather(generate(engine, red, 8), generate(engine, both, 12))
        assert not long.done()
        return [await long, *mid]

    try:
        results = asyncio.run(run())
    finally:
        engine.destroy()
    for p, r in zip([text, red, both], results):
        torch.testing.assert_close(torch.tensor(r.output_logprobs), hf_logprobs(hf, p, r.output_ids), atol=1e-4, rtol=0)
    assert [len(r.output_ids) for r in results] == [60, 8, 12]


def test_weight_update_recomputes_an_image_requests_cache(vlm_dir: str, hf: torch.nn.Module) -> None:
    """A weight update mid-generation (the vision tower's weights too): the request's cache is
    recomputed with its images under the new weights, and each token's log-probability is the
    HF forward's under the weights of its version."""
    processor = load_processor(vlm_dir)
    prompt = Prompt(processor, "What colour?", [GREEN])
    g = torch.Generator().manual_seed(7)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hf.state_dict().items()}
    assert any(k.startswith("model.visual.") for k in new_state)
    new_model = AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    new_model.load_state_dict(new_state)
    engine = make_engine(vlm_dir)

    update = WeightUpdateMeta(type="in_process", named_tensors=new_state, version=1)

    async def run():
        task = asyncio.ensure_future(generate(engine, prompt, 80, rid="long"))
        await wait_tokens(engine, "long", 5)
        await asyncio.wrap_future(engine.update_weights(update))  # while the request decodes
        return await task

    try:
        r = asyncio.run(run())
    finally:
        engine.destroy()
    versions = r.output_versions
    switch = versions.index(1)
    assert versions == [0] * switch + [1] * (80 - switch) and switch >= 5
    lp = torch.tensor(r.output_logprobs)
    old, new = hf_logprobs(hf, prompt, r.output_ids), hf_logprobs(new_model, prompt, r.output_ids)
    torch.testing.assert_close(lp[:switch], old[:switch], atol=1e-4, rtol=0)
    torch.testing.assert_close(lp[switch:], new[switch:], atol=1e-4, rtol=0)


def test_fixed_shape_decode_step_keeps_the_multimodal_offsets(vlm_dir: str, hf: torch.nn.Module) -> None:
    """The decode step a GPU replays as a CUDA graph (run eagerly here): rows with images decode at
    their cache length plus their offset, rows of every width as requests finish and are refilled."""
    processor = load_processor(vlm_dir)
    prompts = [Prompt(processor, f"Picture {i}?", [RED, GREEN, BLUE][: i % 3]) for i in range(6)]
    engine = make_engine(vlm_dir, max_running_requests=4)
    runner = engine.scheduler._runner
    runner.graphs = runner.decode_graphs(eager=True)
    widths, real_run = [], runner.graphs.run

    def run(rows: int, mode: str = "logits") -> torch.Tensor:
        widths.append(rows)
        return real_run(rows, mode)

    runner.graphs.run = run  # type: ignore[method-assign]
    try:
        results = generate_all(engine, prompts, [4 + 5 * i for i in range(len(prompts))])
    finally:
        engine.destroy()
    assert widths and max(widths) == 4
    assert not any(runner.delta.tolist())  # free rows hold no offset
    for p, r in zip(prompts, results):
        torch.testing.assert_close(torch.tensor(r.output_logprobs), hf_logprobs(hf, p, r.output_ids), atol=1e-4, rtol=0)


def test_prompt_logprobs_with_images_and_agenerate(vlm_dir: str, hf: torch.nn.Module) -> None:
    """The prompt's log-probabilities with its images equal a HF forward's, and `agenerate` takes a
    `ModelRequest`'s images (its first token scored as the HF forward scores it)."""
    processor = load_processor(vlm_dir)
    prompt = Prompt(processor, "What colour is it?", [RED])
    engine = make_engine(vlm_dir)

    async def run():
        _, images = await engine.scheduler.prepare_images(prompt.ids, prompt.images)
        params = SamplingParams(max_new_tokens=1)
        scored = await engine.scheduler.generate(prompt.ids, params, return_input_logprobs=True, images=images)
        return scored, await engine.agenerate(prompt.request(1))

    try:
        scored, answer = asyncio.run(run())
    finally:
        engine.destroy()
    ids = torch.tensor([prompt.ids])
    kw = {k: prompt.enc[k] for k in ("pixel_values", "image_grid_thw")}
    with torch.no_grad():
        logits = hf(input_ids=ids, mm_token_type_ids=(ids == hf.config.image_token_id).int(), **kw).logits
    logp = torch.log_softmax(logits[0].float(), -1)
    assert scored.input_logprobs[0] is None
    expected = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(scored.input_logprobs[1:]), expected, atol=1e-4, rtol=0)
    [token] = answer.output_tokens
    assert answer.input_tokens == prompt.ids and answer.output_logprobs[0] == pytest.approx(
        float(logp[-1, token]), abs=1e-4
    )


def test_image_tokens_past_the_images_are_text(vlm_dir: str, hf: torch.nn.Module) -> None:
    """The rule the train engine reads a sequence by (`image_token_mask`): the images fill the
    first image tokens; a later one (sampled by the model, then resumed as prompt) is a text token,
    and so is one in a prompt without images. Scored against HF's forward given the embeddings
    and positions by that rule."""
    processor = load_processor(vlm_dir)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    resumed = Prompt(processor, "What colour?", [RED])
    resumed.ids = resumed.ids + [pad, 40, 41]
    plain = Prompt(processor, "No image", [])
    plain.ids = plain.ids + [pad, 42]
    engine = make_engine(vlm_dir)
    try:
        results = generate_all(engine, [resumed, plain], [6, 6])
    finally:
        engine.destroy()
    for prompt, r in zip([resumed, plain], results):
        ids = torch.tensor([prompt.ids + r.output_ids])
        tokens = torch.tensor([int(prompt.enc["image_grid_thw"].prod(-1).sum()) // 4 if prompt.images else 0])
        mask = image_token_mask(ids, pad, tokens)
        embeds = hf.get_input_embeddings()(ids)
        positions = None
        with torch.no_grad():
            if prompt.images:
                grid = prompt.enc["image_grid_thw"]
                features = hf.model.get_image_features(prompt.enc["pixel_values"], grid, return_dict=True)
                embeds[mask] = torch.cat(features.pooler_output)
                positions, _ = hf.model.get_rope_index(ids, mask.int(), image_grid_thw=grid)
            logp = torch.log_softmax(hf(inputs_embeds=embeds, position_ids=positions).logits[0, :-1].float(), -1)
        expected = logp.gather(1, ids[0, 1:, None])[len(prompt.ids) - 1 :, 0]
        torch.testing.assert_close(torch.tensor(r.output_logprobs), expected, atol=1e-4, rtol=0)


def test_requests_that_disagree_with_their_images_are_refused(vlm_dir: str, tmp_path) -> None:
    processor = load_processor(vlm_dir)
    one, two = Prompt(processor, "What colour?", [RED]), Prompt(processor, "Two?", [GREEN, BLUE])
    engine = make_engine(vlm_dir)
    try:
        cases = [
            (ModelRequest(input_ids=one.ids, images=two.images), "image tokens for 1 image"),
            (ModelRequest(input_ids=one.ids, images=[encode_image(BLUE)]), "image 0 makes 4 image tokens"),
            (ModelRequest(input_ids=one.ids, images=[b"not a picture"]), "image 0 is not an image file"),
            (ModelRequest(input_ids=[5, 6, 7], images=one.images), "image tokens for 0 image"),
        ]
        for request, message in cases:
            with pytest.raises(ValueError, match=message):
                asyncio.run(engine.agenerate(request))
        assert engine.scheduler.num_running == 0
    finally:
        engine.destroy()
    text_model = build_tiny_model(str(tmp_path / "text"), hidden_size=64, num_layers=1)
    engine = make_engine(text_model)
    try:
        with pytest.raises(ValueError, match="takes no images"):
            asyncio.run(engine.agenerate(ModelRequest(input_ids=[5, 6, 7], images=one.images)))
    finally:
        engine.destroy()


def test_a_groups_requests_share_one_preparation(vlm_dir: str, hf: torch.nn.Module) -> None:
    """A prompt with its images is prepared once for the requests of a group: the same
    `ImageInputs` again, the prompt's ids as a fresh list; another image, or another prompt, is
    prepared anew; a prompt refused is refused again."""
    from areal_lite.engines.local.images import ImagePrompts

    processor = load_processor(vlm_dir)
    red = Prompt(processor, "What colour?", [RED])
    blue = Prompt(processor, "What colour?", [Image.new("RGB", RED.size, (1, 2, 250))])
    prompts = ImagePrompts(hf, vlm_dir)
    ids, inputs = prompts.prepare(red.ids, red.images)
    again_ids, again = prompts.prepare(list(red.ids), list(red.images))
    assert again is inputs and again_ids == ids and again_ids is not ids
    other = prompts.prepare(blue.ids, blue.images)[1]
    assert other is not inputs and other.key != inputs.key
    assert torch.equal(other.positions, inputs.positions)  # the same layout, other pixels
    for _ in range(2):
        with pytest.raises(ValueError, match="image 0 makes 4 image tokens but the prompt holds 15"):
            prompts.prepare(red.ids, [encode_image(BLUE)])


def test_qwen2_vl_logprobs_equal_hf_forward(vlm_dir: str, tmp_path) -> None:
    """Qwen2-VL (the architecture before 2.5: its own vision tower, the same multimodal rotary):
    a tiny one from its config, with the tiny VLM's tokenizer and image processor."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    from areal_lite.utils.vision import image_only

    path = str(tmp_path / "qwen2_vl")
    base = load_processor(vlm_dir)
    tiny = AutoModelForImageTextToText.from_pretrained(vlm_dir).config
    config = Qwen2VLConfig(
        text_config=tiny.text_config.to_dict() | {"model_type": "qwen2_vl_text"},
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": tiny.text_config.hidden_size, "num_heads": 2},
        image_token_id=tiny.image_token_id,
        video_token_id=tiny.video_token_id,
        vision_start_token_id=tiny.vision_start_token_id,
        vision_end_token_id=tiny.vision_end_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = tiny.text_config.eos_token_id
    model.save_pretrained(path)
    processor = image_only(Qwen2VLProcessor)(base.image_processor, base.tokenizer, chat_template=base.chat_template)
    processor.save_pretrained(path)
    prompts = [Prompt(processor, "What colour?", [RED]), Prompt(processor, "Text.", [])]
    engine = make_engine(path)
    try:
        assert engine.scheduler._runner.rotary.axes is not None
        results = generate_all(engine, prompts, [10, 10])
    finally:
        engine.destroy()
    for p, r in zip(prompts, results):
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs), hf_logprobs(model, p, r.output_ids), atol=1e-4, rtol=0
        )
