"""RLVR rollouts for vision-language models: GRPO groups for prompts with images.

A dataset item carries ``messages`` whose content may hold image parts (``{"type": "image"}``)
and ``images``, one per image part in order: PIL images or image files' bytes. The model's
processor renders the chat with its template and expands each image's placeholder to the image's
tokens (`encode_vision_chat`, off the event loop: image processing is slow work). Every request of
the group carries the images as PNG bytes (`ModelRequest.images`), each completion is scored by the
reward function as in `areal_lite.workflows.rlvr`, and the group comes back as one ``[n, L]``
trajectory that carries the prompt's ``pixel_values`` and ``image_grid_thw`` (the data contract of
`areal_lite.api.engine`), so the train engine sees the pixels the inference engine saw.

What the inference engine is asked to do (docs/vision.md): generate from ``input_ids``, in which
each image is already expanded to its tokens, with ``images`` processed by the model's own
processor; nothing else differs from a text request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from areal_lite.api.engine import InferenceEngine
from areal_lite.api.io import GenerationConfig, ModelRequest
from areal_lite.api.workflow import RolloutWorkflow
from areal_lite.rewards.combined import RewardFn
from areal_lite.rewards.runner import RewardRunner
from areal_lite.utils.vision import decode_image, encode_image
from areal_lite.workflows.rlvr import as_runner, score
from areal_lite.workflows.trajectory import from_responses, with_images

ImageLike = object
"""A PIL image or an image file's bytes."""


@dataclass
class VisionPrompt:
    """A chat with images, encoded for the model."""

    input_ids: list[int]
    """The rendered chat's tokens, each image expanded to its tokens."""
    images: list[bytes]
    """The images as PNG bytes, in order: what a request carries."""
    pixel_values: torch.Tensor
    """The processor's ``[patches, D]`` patches of all the images (``[0, D]`` without images)."""
    image_grid_thw: torch.Tensor
    """The processor's ``[images, 3]`` grids."""


def _image_parts(messages: list[dict[str, object]]) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]  # type: ignore[union-attr]
        if isinstance(part, dict) and part.get("type") in ("image", "image_url")
    )


def encode_vision_chat(
    processor: object, messages: list[dict[str, object]], images: list[ImageLike], *, add_generation_prompt: bool = True
) -> VisionPrompt:
    """``messages`` rendered by the processor's chat template (with the assistant's turn opened
    when ``add_generation_prompt``), its ``images`` processed and their placeholders expanded.
    ValueError when the messages' image parts and ``images`` differ in number."""
    if _image_parts(messages) != len(images):
        raise ValueError(f"the messages have {_image_parts(messages)} image parts and the item {len(images)} images")
    pil = [decode_image(im) if isinstance(im, bytes) else im.convert("RGB") for im in images]  # type: ignore[attr-defined]
    text = processor.apply_chat_template(  # type: ignore[attr-defined]
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    enc = processor(text=[text], images=pil or None, return_tensors="pt")  # type: ignore[operator]
    if pil:
        pixels, grid = enc["pixel_values"], enc["image_grid_thw"]
    else:
        ip = processor.image_processor  # type: ignore[attr-defined]
        pixels = torch.zeros(0, 3 * ip.temporal_patch_size * ip.patch_size**2)
        grid = torch.zeros(0, 3, dtype=torch.int64)
    return VisionPrompt(
        input_ids=enc["input_ids"][0].tolist(),
        images=[im if isinstance(im, bytes) else encode_image(p) for im, p in zip(images, pil)],
        pixel_values=pixels.float(),
        image_grid_thw=grid.to(torch.int64),
    )


class VisionRLVRWorkflow(RolloutWorkflow):
    """GRPO groups of a prompt with images: ``gconfig.n_samples`` completions with their rewards.

    Args:
        reward_fn: ``reward_fn(prompt, completion, prompt_ids, completion_ids, **item) -> float``
            (the item's fields but ``messages`` and ``images``), or a `RewardRunner`.
        gconfig: sampling; ``n_samples`` is the group size.
        processor: the model's processor (`areal_lite.utils.vision.load_processor`).
        reward_timeout: seconds per sample when ``reward_fn`` is wrapped here.
    """

    def __init__(
        self,
        reward_fn: RewardFn | RewardRunner,
        gconfig: GenerationConfig,
        processor: object,
        reward_timeout: float = 15.0,
    ) -> None:
        self.reward = as_runner(reward_fn, reward_timeout)
        self.gconfig = gconfig
        self.processor = processor
        self.tokenizer = processor.tokenizer  # type: ignore[attr-defined]

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, object]) -> TensorDict:
        messages, images = list(data["messages"]), list(data.get("images") or [])  # type: ignore[call-overload]
        prompt = await asyncio.to_thread(encode_vision_chat, self.processor, messages, images)
        one = self.gconfig.new(n_samples=1)
        resps = await engine.agenerate_batch(
            [
                ModelRequest(input_ids=prompt.input_ids, gconfig=one, images=prompt.images)
                for _ in range(self.gconfig.n_samples)
            ]
        )
        text = self.tokenizer.decode(prompt.input_ids)
        fields = {k: v for k, v in data.items() if k not in ("messages", "images")}
        rewards = await asyncio.gather(*(score(self.reward, self.tokenizer, text, r, fields) for r in resps))
        return with_images(from_responses(resps, list(rewards)), prompt.pixel_values, prompt.image_grid_thw)


__all__ = ["VisionPrompt", "VisionRLVRWorkflow", "encode_vision_chat"]
