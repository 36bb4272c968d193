"""Vision-language models: the tiny VLM, its processor, images as bytes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText

from areal_lite.utils.tiny_vlm import build_tiny_vlm
from areal_lite.utils.vision import decode_image, encode_image, is_vision_config, load_processor


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "tiny"), seed=1)


def image_message(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def test_tiny_vlm_loads_as_a_qwen2_5_vl_checkpoint_and_is_seeded(vlm_dir: str, tmp_path) -> None:
    config = AutoConfig.from_pretrained(vlm_dir)
    assert config.model_type == "qwen2_5_vl" and is_vision_config(config)
    text = config.text_config
    assert text.hidden_size // text.num_attention_heads == 32  # a head size vLLM's CPU attention has
    assert sum(text.rope_parameters["mrope_section"]) == 16
    with open(os.path.join(vlm_dir, "processor_config.json")) as f:
        assert json.load(f)["processor_class"] == "Qwen2_5_VLProcessor"
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    again = AutoModelForImageTextToText.from_pretrained(build_tiny_vlm(str(tmp_path / "again"), seed=1))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert not is_vision_config(AutoConfig.for_model("qwen2"))


@pytest.mark.parametrize(("size", "tokens"), [((112, 112), 16), ((56, 56), 4), ((84, 140), 15), ((20, 20), 4)])
def test_processor_expands_each_image_to_its_tokens(vlm_dir: str, size: tuple[int, int], tokens: int) -> None:
    processor = load_processor(vlm_dir)
    text = processor.apply_chat_template(image_message("What colour?"), tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour?<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    enc = processor(text=[text], images=[Image.new("RGB", size, (200, 30, 30))], return_tensors="pt")
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((enc["input_ids"] == image_id).sum()) == tokens
    assert int(enc["image_grid_thw"].prod()) == enc["pixel_values"].shape[0] == 4 * tokens
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], len(processor.tokenizer)) and logits.isfinite().all()


def test_text_only_messages_keep_the_text_models_template(vlm_dir: str) -> None:
    tokenizer = load_processor(vlm_dir).tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_images_round_trip_through_png_bytes() -> None:
    image = Image.new("RGB", (30, 20))
    image.putpixel((3, 4), (1, 2, 3))
    data = encode_image(image)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    back = decode_image(data)
    assert back.size == (30, 20) and back.getpixel((3, 4)) == (1, 2, 3)
    assert decode_image(encode_image(image.convert("L"))).mode == "RGB"


def test_bad_sizes_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        build_tiny_vlm(str(tmp_path / "a"), hidden_size=60, num_heads=4)
    with pytest.raises(ValueError, match="min_pixels"):
        build_tiny_vlm(str(tmp_path / "b"), min_pixels=100)


def test_trajectories_carry_their_prompts_images(vlm_dir: str) -> None:
    from tensordict import TensorDict

    from areal_lite.api.workflow import TrajectoryError, check_trajectory_layout
    from areal_lite.utils.data import concat_padded, pack_batch
    from areal_lite.workflows.trajectory import check_trajectory, with_images

    processor = load_processor(vlm_dir)
    text = processor.apply_chat_template(image_message("?"), tokenize=False, add_generation_prompt=True)
    enc = processor(text=[text], images=[Image.new("RGB", (56, 112), (0, 0, 255))], return_tensors="pt")
    n, length = 3, enc["input_ids"].shape[1] + 2
    base = TensorDict(
        {
            "input_ids": torch.cat([enc["input_ids"], torch.tensor([[5, 6]])], 1).expand(n, -1).clone(),
            "attention_mask": torch.ones(n, length, dtype=torch.bool),
            "loss_mask": torch.tensor([[0] * (length - 2) + [1, 1]] * n, dtype=torch.int32),
            "logprobs": torch.tensor([[0.0] * (length - 2) + [-1.0, -2.0]] * n),
            "versions": torch.tensor([[-1] * (length - 2) + [0, 0]] * n, dtype=torch.int32),
            "rewards": torch.zeros(n),
        },
        batch_size=[n],
    )
    traj = with_images(base, enc["pixel_values"], enc["image_grid_thw"])
    check_trajectory(traj)
    assert traj["pixel_values"].shape == (n, 32, 1176) and traj["image_grid_thw"].tolist() == [[[1, 8, 4]]] * n
    no_image = with_images(base[:1], torch.zeros(0, 1176), torch.zeros(0, 3, dtype=torch.int64))
    batch = concat_padded([traj, no_image])
    assert batch["pixel_values"].shape == (n + 1, 32, 1176) and not batch["image_grid_thw"][n].any()
    packed = pack_batch(batch)
    assert torch.equal(packed["pixel_values"], enc["pixel_values"].repeat(n, 1))
    with pytest.raises(ValueError, match="accounts for 32 patches"):
        with_images(base, enc["pixel_values"][:5], enc["image_grid_thw"])
    del traj["image_grid_thw"]
    with pytest.raises(TrajectoryError, match="without 'image_grid_thw'"):
        check_trajectory_layout(traj)
    traj["image_grid_thw"] = torch.zeros(n, 1, 2, dtype=torch.int64)
    with pytest.raises(TrajectoryError, match=r"integer \[n, images, 3\]"):
        check_trajectory_layout(traj)


class RecordingEngine:
    """An `InferenceEngine` stand-in for the workflow's tests: it records each request and answers
    ``answer`` (then eos) with log-probability -0.5 a token."""

    def __init__(self, tokenizer: object, answer: str) -> None:
        self.requests: list = []
        self.output = tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id]  # type: ignore[operator,attr-defined]

    async def agenerate_batch(self, reqs: list) -> list:
        from areal_lite.api.io import ModelResponse

        self.requests += reqs
        n = len(self.output)
        return [
            ModelResponse(list(r.input_ids), list(self.output), [-0.5] * n, [3] * n, "stop", rid=r.rid) for r in reqs
        ]


def test_vision_workflow_sends_the_images_and_returns_them_with_the_group(vlm_dir: str) -> None:
    import asyncio

    from areal_lite.api.io import GenerationConfig
    from areal_lite.rewards.runner import RewardRunner
    from areal_lite.workflows.trajectory import check_trajectory
    from areal_lite.workflows.vision_rlvr import VisionRLVRWorkflow, encode_vision_chat

    processor = load_processor(vlm_dir)
    red, blue = Image.new("RGB", (112, 56), (220, 30, 30)), Image.new("RGB", (56, 56), (30, 30, 220))
    content = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "text", "text": "?"}]
    item = {"messages": [{"role": "user", "content": content}], "images": [red, encode_image(blue)], "answer": "7"}
    seen: list[dict] = []

    def reward(prompt: str, completion: str, prompt_ids: list, completion_ids: list, **fields: object) -> float:
        seen.append(fields)
        return float(completion == fields["answer"])

    engine = RecordingEngine(processor.tokenizer, "7")
    workflow = VisionRLVRWorkflow(RewardRunner(reward, mode="inline"), GenerationConfig(n_samples=4), processor)
    traj = asyncio.run(workflow.arun_episode(engine, item))  # type: ignore[arg-type]

    check_trajectory(traj)
    assert traj["rewards"].tolist() == [1.0] * 4 and seen[0] == {"answer": "7"}
    expected = processor(
        text=[processor.apply_chat_template(item["messages"], tokenize=False, add_generation_prompt=True)],
        images=[red, blue],
        return_tensors="pt",
    )
    assert len(engine.requests) == 4 and len({r.rid for r in engine.requests}) == 4
    for req in engine.requests:
        assert req.input_ids == expected["input_ids"][0].tolist() and req.gconfig.n_samples == 1
        assert [decode_image(b).getpixel((5, 5)) for b in req.images] == [(220, 30, 30), (30, 30, 220)]
    assert torch.equal(traj["pixel_values"][2], expected["pixel_values"])
    assert traj["image_grid_thw"][0].tolist() == expected["image_grid_thw"].tolist() == [[1, 4, 8], [1, 4, 4]]
    assert traj["input_ids"][0, : len(engine.requests[0].input_ids)].tolist() == engine.requests[0].input_ids

    text_only = encode_vision_chat(processor, [{"role": "user", "content": "no picture"}], [])
    assert text_only.pixel_values.shape == (0, 1176) and text_only.image_grid_thw.shape == (0, 3)
    with pytest.raises(ValueError, match="2 image parts and the item 1 images"):
        encode_vision_chat(processor, item["messages"], [red])


def test_images_fill_the_first_placeholders_of_each_row() -> None:
    from areal_lite.utils.vision import image_token_mask

    ids = torch.tensor([[1, 9, 9, 2, 9, 3], [9, 9, 9, 9, 5, 0], [4, 5, 6, 9, 0, 0]])
    mask = image_token_mask(ids, 9, torch.tensor([2, 4, 0]))
    assert mask.tolist() == [
        [False, True, True, False, False, False],  # the third 9, after the images' two, is text
        [True, True, True, True, False, False],
        [False, False, False, False, False, False],
    ]
    with pytest.raises(ValueError, match="row 1 has 4 image placeholder tokens; its images need 5"):
        image_token_mask(ids, 9, torch.tensor([2, 5, 0]))


def test_train_positions_equal_hf_rope_index_row_by_row(vlm_dir: str) -> None:
    """The train engine computes the multimodal positions once per distinct image layout (a group's
    rows share their prompt's) and continues each row as text: the same as HF's rule run row by
    row, for a group of one prompt with completions of three lengths, a row with two images of
    other sizes, a row without images, a generated placeholder after the images (text), and a row
    padded on the left."""
    from areal_lite.engines.train.multimodal import POSITIONS_KEY, VisionLanguageModel
    from areal_lite.utils.data import concat_padded, pack_images
    from areal_lite.utils.vision import image_token_mask
    from areal_lite.workflows.trajectory import with_images

    processor = load_processor(vlm_dir)
    hf = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    pad_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def row(images: list[Image.Image], completion: list[int], left_pad: int = 0):
        from tensordict import TensorDict

        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "?"}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
        enc = processor(text=[text], images=images or None, return_tensors="pt")
        ids = [0] * left_pad + enc["input_ids"][0].tolist() + completion
        n = len(ids)
        traj = TensorDict(
            {
                "input_ids": torch.tensor([ids]),
                "attention_mask": torch.tensor([[False] * left_pad + [True] * (n - left_pad)]),
            },
            batch_size=[1],
        )
        if not images:
            return with_images(traj, torch.zeros(0, 1176), torch.zeros(0, 3, dtype=torch.int64))
        return with_images(traj, enc["pixel_values"], enc["image_grid_thw"])

    blue, red = Image.new("RGB", (56, 56), (0, 0, 255)), Image.new("RGB", (84, 140), (255, 0, 0))
    batch = concat_padded(
        [
            row([blue], [5, 6]),
            row([blue], [5]),
            row([blue], [5, 6, 7, 8]),
            row([red, blue], [7]),
            row([], [5, 6]),
            row([blue], [pad_id, 5]),
            row([blue], [6], left_pad=3),
        ]
    )
    got = VisionLanguageModel(hf).with_positions(batch)[POSITIONS_KEY]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    fill = image_token_mask(ids, hf.config.image_token_id, (batch["image_grid_thw"].prod(-1) // 4).sum(-1))
    want, _ = hf.model.get_rope_index(
        ids, fill.int(), image_grid_thw=pack_images(batch)["image_grid_thw"], attention_mask=mask.long()
    )
    assert torch.equal(got, want.permute(1, 2, 0) * mask.unsqueeze(-1))
    assert not torch.equal(got[3, :, 0], got[3, :, 1])  # the images' tokens have 3-D positions
