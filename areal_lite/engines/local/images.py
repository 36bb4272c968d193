"""Images in the embedded engine (vision-language models of Qwen-VL's architecture): what a
request's images become before it is queued, and their features at prefill.

A request's images arrive as image files' bytes (`areal_lite.api.io.ModelRequest.images`) with a
prompt whose image tokens are already expanded (each image one run of image tokens, as many as the
processor makes of it). `ImagePrompts` (off the scheduler thread: decoding and resizing take time)
turns them into `ImageInputs`: the processor's pixel patches and patch grids, where the image
tokens sit, and the prompt's multimodal rotary positions by the model's own rule
(``get_rope_index``), with the offset its later text positions keep (`ImageInputs.delta`). The
image tokens' count is checked against the grids, image by image, so that a prompt and its images
that disagree are refused rather than run misaligned. Which placeholder tokens the images fill is
the rule the train engine reads a sequence by (`areal_lite.utils.vision.image_token_mask`): the
first ones, as many as the images have tokens; a later placeholder (one the model generated, in a
prompt resumed after an interruption) is a text token. Our server's prompts (a chat template's
output, SGLang's ``/generate``) may instead hold one placeholder token per image, which is then
expanded to the image's count, as the processor expands its text (``expand``).

At prefill the vision tower encodes the pass's images (`VisionTower`) and their features take the
place of the image tokens' embeddings; the decoder then runs as for text. A request re-prefilled
(after a weight update or a retract) encodes its images again, under the weights of that pass.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from itertools import groupby
from typing import TYPE_CHECKING

import torch

from areal_lite.utils.vision import decode_image, image_token_mask, load_processor

if TYPE_CHECKING:
    from PIL import Image
    from transformers import ProcessorMixin


@dataclass(eq=False)
class ImageInputs:
    """A prompt's images as the model takes them, and the multimodal positions they give it."""

    pixel_values: torch.Tensor
    """``[P, D]``: every image's patches, in the order of their image tokens (the processor's)."""
    grid_thw: torch.Tensor
    """``[I, 3]`` int64: each image's patch grid (time, height, width)."""
    token_index: torch.Tensor
    """int64: the prompt positions of the image tokens, whose embeddings the features replace in order."""
    positions: torch.Tensor
    """``[L, 3]`` int64: the prompt's multimodal rotary positions (time, height, width)."""
    delta: int
    """A text position ``i`` after the prompt is at ``i + delta`` in all three parts (Qwen2-VL's
    ``rope_deltas``: the prompt's largest position + 1 - its length)."""
    key: bytes
    """A digest of the pixels: requests with the same tokens and key share one prefill."""

    def positions_of(self, n: int) -> torch.Tensor:
        """The multimodal positions ``[n, 3]`` of the first ``n`` tokens of prompt + output."""
        length = self.positions.shape[0]
        if n <= length:
            return self.positions[:n]
        after = (torch.arange(length, n) + self.delta)[:, None].expand(-1, 3)
        return torch.cat([self.positions, after])


class ImagePrompts:
    """A vision-language model's prompts with images, made ready for the scheduler.

    Args:
        model: the HF model (a Qwen-VL ``*ForConditionalGeneration``): its config names the image
            token and the merge size, and its ``get_rope_index`` gives the positions.
        path: the model directory, whose processor (`areal_lite.utils.vision.load_processor`)
            resizes and patches the images (and whose chat template our server renders).
    """

    def __init__(self, model: torch.nn.Module, path: str) -> None:
        self.processor: ProcessorMixin = load_processor(path)
        self.image_token_id = int(model.config.image_token_id)
        self.merge = int(model.config.vision_config.spatial_merge_size)
        self._rope_index = model.model.get_rope_index
        self._recent: OrderedDict[tuple, tuple[list[int], ImageInputs]] = OrderedDict()
        self._lock = threading.Lock()

    RECENT = 512
    """How many prompts' `ImageInputs` are kept: a GRPO group's requests (one prompt, its
    images, several samples) arrive together and share one."""

    def prepare(self, input_ids: list[int], images: list[bytes], expand: bool = False) -> tuple[list[int], ImageInputs]:
        """The prompt ``input_ids`` with its images' `ImageInputs`: the first runs of image tokens,
        one per image in order, each as many as the processor makes of its image or (with
        ``expand``) a single placeholder, which is expanded (the prompt returned is then longer).
        Later image tokens are text. ValueError where the prompt and the images disagree. A
        prompt met among the last `RECENT` gets the same (read-only) `ImageInputs` again."""
        key = (tuple(input_ids), tuple(images), expand)
        with self._lock:
            found = self._recent.get(key)
            if found is not None:
                self._recent.move_to_end(key)
                return list(found[0]), found[1]
        ids, inputs = self._prepare(input_ids, images, expand)
        with self._lock:
            self._recent[key] = (ids, inputs)
            if len(self._recent) > self.RECENT:
                self._recent.popitem(last=False)
        return list(ids), inputs

    def _prepare(self, input_ids: list[int], images: list[bytes], expand: bool) -> tuple[list[int], ImageInputs]:
        pixels, grid = self._process(images)
        made = (grid.prod(dim=-1) // self.merge**2).tolist()
        runs = [(t, len(list(run))) for t, run in groupby(input_ids)]
        spans = [n for t, n in runs if t == self.image_token_id][: len(made)]
        if len(spans) != len(made):
            raise ValueError(f"the prompt has image tokens for {len(spans)} image(s) but {len(made)} image(s) came")
        for i, (held, needed) in enumerate(zip(spans, made)):
            if held != needed and not (expand and held == 1):
                raise ValueError(f"image {i} makes {needed} image tokens but the prompt holds {held} for it")
        if expand:
            counts = iter(made)
            expanded: list[int] = []
            for t, n in runs:  # image runs past the images' (text) keep their length
                expanded += [t] * (next(counts, n) if t == self.image_token_id else n)
            input_ids = expanded
        return input_ids, self._inputs(torch.tensor(input_ids), pixels, grid, sum(made))

    def _process(self, images: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        pictures = [self._decode(i, data) for i, data in enumerate(images)]
        out = self.processor.image_processor(images=pictures, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    @staticmethod
    def _decode(i: int, data: bytes) -> Image.Image:
        try:
            return decode_image(data)
        except Exception as e:
            raise ValueError(f"image {i} is not an image file that PIL reads: {e}") from e

    def _inputs(self, ids: torch.Tensor, pixels: torch.Tensor, grid: torch.Tensor, tokens: int) -> ImageInputs:
        is_image = image_token_mask(ids[None], self.image_token_id, torch.tensor([tokens]))[0]
        positions, delta = self._rope_index(ids[None], is_image[None].int(), image_grid_thw=grid)
        key = hashlib.blake2b(pixels.numpy().tobytes(), digest_size=16)
        key.update(grid.numpy().tobytes())
        return ImageInputs(
            pixel_values=pixels,
            grid_thw=grid,
            token_index=is_image.nonzero()[:, 0],
            positions=positions[:, 0].t().contiguous(),
            delta=int(delta),
            key=key.digest(),
        )


class VisionTower:
    """The vision tower of a HF vision-language model, run at prefill."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner = model.model
        """The HF model under the LM head: ``visual``, ``get_image_features``."""

    def embed(self, embeds: torch.Tensor, images: list[tuple[int, ImageInputs]]) -> torch.Tensor:
        """``embeds`` [N, hidden] of a pass with the image tokens' rows replaced by their images'
        features: ``images`` are ``(offset, inputs)`` of each prefilled sequence with images,
        ``offset`` where its tokens start in the pass."""
        device = embeds.device
        pixels = torch.cat([inp.pixel_values for _, inp in images]).to(device)
        grid = torch.cat([inp.grid_thw for _, inp in images]).to(device)
        features = torch.cat(self.inner.get_image_features(pixels, grid, return_dict=True).pooler_output)
        rows = torch.cat([offset + inp.token_index for offset, inp in images]).to(device)
        return embeds.index_copy(0, rows, features.to(embeds.dtype))


__all__ = ["ImageInputs", "ImagePrompts", "VisionTower"]
