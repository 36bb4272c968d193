"""The train engine's side of vision-language models (Qwen-VL's architecture in transformers): the
decoder and the vision tower of the HF model, the multimodal rotary positions of a padded batch,
and the forward of a packed micro-batch with its images.

A packed micro-batch is one row of many sequences (`areal_lite.api.engine`). The vision tower
encodes the micro-batch's images (attention within each image), their features replace the image
tokens' embeddings in order, and the decoder runs the row with the engine's varlen attention, each
token at its multimodal rotary position (``mrope_position_ids``, computed per sequence on the
padded batch by the model's own ``get_rope_index``) and its text position restarting per sequence
(what eager and sdpa attention mask by).

Which image placeholder tokens the images fill follows `areal_lite.utils.vision.image_token_mask`:
the first ones of each sequence, as many as its images have tokens; a placeholder the model
generated after them is a text token, as the inference engine ran it.

A micro-batch without images still runs the vision tower, on one blank merge block whose features
count with weight 0: every rank then runs the same sharded modules in the same order (a rank that
skipped the tower while another ran it would wait forever in the gather of its parameters), and
the tower's gradient is zero rather than missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict
from torch import nn

from areal_lite.api.engine import IMAGE_KEYS, PackedBatch
from areal_lite.utils.data import pack_images
from areal_lite.utils.vision import image_token_mask

POSITIONS_KEY = "mrope_position_ids"
"""The per-token key (``[B, L, 3]`` padded, ``[T, 3]`` packed) of the multimodal rotary positions."""
TOKEN_TYPES_KEY = "mm_token_type_ids"
"""The per-token key (int32 ``[B, L]`` padded, ``[T]`` packed): 1 on the tokens images fill, else 0."""


def decoder_layers(hf: nn.Module) -> nn.ModuleList:
    """The decoder layers of a HF causal LM or vision-language model."""
    inner = hf.base_model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


@dataclass
class PackedImages:
    """A packed micro-batch's images (`areal_lite.api.engine`) and its tokens' rotary positions."""

    pixel_values: torch.Tensor
    """``[P_total, D]``: every image's patches, in sequence order."""
    image_grid_thw: torch.Tensor
    """``[N, 3]``: each image's patch grid, in the same order."""
    positions: torch.Tensor
    """``[T, 3]`` int64: each token's multimodal rotary position."""
    token_types: torch.Tensor
    """``[T]``: 1 on the tokens the images fill, in order; 0 elsewhere."""

    @staticmethod
    def of(mb: PackedBatch) -> PackedImages:
        """The images of ``mb``, a packed micro-batch with its image keys and positions."""
        keys = (*IMAGE_KEYS, POSITIONS_KEY, TOKEN_TYPES_KEY)
        missing = [k for k in keys if k not in mb]
        if missing:
            raise ValueError(f"a vision-language model's micro-batch needs {', '.join(missing)}")
        tensors = [mb[k] for k in keys]
        assert all(isinstance(t, torch.Tensor) for t in tensors)
        return PackedImages(*tensors)  # type: ignore[arg-type]


class VisionLanguageModel:
    """What the train engine needs of a HF vision-language model ``hf`` (a Qwen-VL
    ``*ForConditionalGeneration``): its positions, its vision tower, its packed forward."""

    def __init__(self, hf: nn.Module) -> None:
        self.hf = hf
        self.inner = hf.base_model
        """The HF model under the head: ``visual``, ``language_model``, ``get_rope_index``."""
        vision = hf.config.vision_config
        self.image_token_id = int(hf.config.image_token_id)
        self.merge = int(vision.spatial_merge_size)
        self.patch_dim = int(vision.in_channels * vision.temporal_patch_size * vision.patch_size**2)

    @property
    def tower(self) -> nn.Module:
        """The vision tower: patch embedding, vision blocks and the merger into the decoder's width."""
        return self.inner.visual

    def with_positions(self, batch: TensorDict) -> TensorDict:
        """``batch`` (padded, right-aligned) with the per-token keys the packed forward needs:
        ``mm_token_type_ids`` (1 on the tokens its images fill, `image_token_mask`; 0 elsewhere,
        an image placeholder the model generated included) and ``mrope_position_ids``
        ``[B, L, 3]`` (0 on padding), computed per sequence from them and its image grids. A batch
        without image keys is a text-only batch: every position's three parts equal its text
        position."""
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        if all(key in batch for key in IMAGE_KEYS):
            grids = batch["image_grid_thw"]
            image_tokens = image_token_mask(ids, self.image_token_id, (grids.prod(dim=-1) // self.merge**2).sum(-1))
            grid = pack_images(batch)["image_grid_thw"]
        elif any(key in batch for key in IMAGE_KEYS):
            raise ValueError(f"a batch with images carries both {' and '.join(IMAGE_KEYS)}")
        else:
            image_tokens, grid = torch.zeros_like(mask), ids.new_zeros((0, 3))
        if grid.shape[0] == 0:
            pos = (mask.cumsum(dim=1) - 1).clamp(min=0).unsqueeze(-1).expand(-1, -1, 3)
        else:
            pos = self._rope_positions(image_tokens, mask, batch["image_grid_thw"])
        out = batch.clone(recurse=False)
        out[TOKEN_TYPES_KEY] = image_tokens.to(torch.int32)
        out[POSITIONS_KEY] = (pos * mask.unsqueeze(-1)).to(torch.int64).contiguous()
        return out

    def _rope_positions(self, image_tokens: torch.Tensor, mask: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """``[B, L, 3]`` positions by ``get_rope_index``, called once per distinct image layout.

        The model's rule loops in Python over rows and tokens, the larger part of a GRPO step on a
        tiny model; yet a row's positions depend only on its token types and image grids, and after
        its last image token they go on one by one as text. So rows that share a head (their
        tokens through the first text token after the images, and their grids: a group's rows, one
        prompt with several completions) share one call, and each row continues from there."""
        device = mask.device
        image_tokens, mask, grids = image_tokens.cpu(), mask.cpu(), grids.cpu()
        rows, width = mask.shape
        # Each row's real tokens first (a row may be padded on the left): column j is token j.
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
        types = image_tokens.gather(1, order).to(torch.int64) * mask.gather(1, order)
        lengths = mask.sum(dim=1)
        col = torch.arange(width)
        last_image = torch.where(types.bool(), col, -1).amax(dim=1)  # -1: a row without images
        head = torch.minimum(last_image + 2, lengths).clamp(min=1)
        in_head = col[: int(head.max())] < head[:, None]
        keys = torch.cat([torch.where(in_head, types[:, : in_head.shape[1]], -1), grids.flatten(1)], dim=1)
        distinct, which = torch.unique(keys, dim=0, return_inverse=True)
        one = torch.zeros(distinct.shape[0], dtype=torch.int64).scatter_(0, which, torch.arange(rows))
        one_grids = grids[one].flatten(0, 1)
        head_pos, _ = self.inner.get_rope_index(
            torch.zeros_like(keys[one, : in_head.shape[1]]),
            (types[one, : in_head.shape[1]] * in_head[one]).to(torch.int32),
            image_grid_thw=one_grids[one_grids.prod(dim=-1) > 0],
            attention_mask=in_head[one].to(torch.int64),
        )
        per_row = head_pos.permute(1, 2, 0)[which]  # [rows, head width, 3]
        within = per_row.gather(1, col.clamp(max=in_head.shape[1] - 1)[None, :, None].expand(rows, -1, 3))
        last = per_row.gather(1, (head - 1)[:, None, None].expand(-1, 1, 3))
        compact = torch.where((col < head[:, None])[..., None], within, last + (col - head[:, None] + 1)[..., None])
        return torch.zeros_like(compact).scatter_(1, order[..., None].expand(-1, -1, 3), compact).to(device)

    def _features(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """The features ``[image tokens, hidden]`` of every image of ``grid``, in order, each
        distinct image through the vision tower once.

        A GRPO group's sequences carry one picture, and the tower's cost grows with the images it
        encodes (per-image steps in Python among them); an image's features depend on its pixels
        alone (attention stays within each image), so a copy takes its original's features, and
        the gradient sums over the copies as it would were each encoded."""
        blocks = pixels.split(grid.prod(dim=-1).tolist())
        by_grid: dict[tuple[int, ...], list[int]] = {}
        for i, g in enumerate(grid.tolist()):
            by_grid.setdefault(tuple(g), []).append(i)
        encoded: list[int] = []  # the images the tower runs on
        source = [0] * len(blocks)  # each image's place among them
        for members in by_grid.values():
            _, same = torch.unique(torch.stack([blocks[i].flatten() for i in members]), dim=0, return_inverse=True)
            first: dict[int, int] = {}
            for i, u in zip(members, same.tolist()):
                source[i] = first.setdefault(u, len(encoded))
                if source[i] == len(encoded):
                    encoded.append(i)
        out = self.inner.get_image_features(torch.cat([blocks[i] for i in encoded]), grid[encoded], return_dict=True)
        return torch.cat([out.pooler_output[j] for j in source])

    def hidden(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, images: PackedImages, **varlen: object
    ) -> torch.Tensor:
        """The decoder's last hidden states ``[T, hidden]`` of one packed row: ``input_ids`` and
        ``position_ids`` ``[T]`` (text positions restarting per sequence), ``varlen`` the
        sequence boundaries for the engine's attention."""
        has_images = images.image_grid_thw.shape[0] > 0
        pixels, grid = images.pixel_values, images.image_grid_thw
        if not has_images:
            pixels = pixels.new_zeros((self.merge**2, self.patch_dim))
            grid = grid.new_tensor([[1, self.merge, self.merge]])
        # The tower runs apart from the decoder: the decoder's boundaries (varlen) are not its own.
        features = self._features(pixels, grid)
        embeds = self.inner.get_input_embeddings()(input_ids)
        if has_images:
            # The tokens the images fill, by `image_token_mask`'s rule (not every placeholder id).
            fill = (images.token_types == 1).unsqueeze(-1)
            embeds = embeds.masked_scatter(fill, features.to(embeds.dtype))
        positions = torch.cat([position_ids.unsqueeze(0), images.positions.t()]).unsqueeze(1)
        hidden = self.inner(
            inputs_embeds=embeds.unsqueeze(0), position_ids=positions, use_cache=False, **varlen
        ).last_hidden_state[0]
        if not has_images:
            hidden = hidden + 0.0 * features.sum()
        return hidden


__all__ = ["POSITIONS_KEY", "TOKEN_TYPES_KEY", "PackedImages", "VisionLanguageModel", "decoder_layers"]
