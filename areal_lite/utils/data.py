"""Batches: padding trajectories together, packing them into 1-D, and cutting micro-batches.

The layouts are those of the data contract in `areal_lite.api.engine`. A key is per-token when its
first two dimensions are ``[B, L]``; every other key is per-sequence and stays ``[B, ...]``. The
image keys of a vision-language model's batch (`IMAGE_KEYS`) are per-sequence whatever their
second dimension: padding pads them to the largest image count, packing concatenates each
sequence's real patches and image grids in sequence order.
Micro-batches are cut by a token budget with a balanced first-fit-decreasing allocation; the
returned permutation puts results computed micro-batch by micro-batch back in the batch's order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from areal_lite.api.engine import IMAGE_KEYS, PackedBatch
from areal_lite.api.io import MicroBatchSpec


def is_per_token(value: torch.Tensor, batch_size: int, seqlen: int, key: str = "") -> bool:
    """Whether ``value`` (the batch's key ``key``) is per-token: ``[B, L, ...]`` and not an image key."""
    return key not in IMAGE_KEYS and value.ndim >= 2 and value.shape[0] == batch_size and value.shape[1] == seqlen


PAD_VALUES: dict[str, int] = {"routed_experts": -1}
"""Per-token keys padded with something else than 0 (``routed_experts``: -1, no expert)."""


def concat_padded(trajs: list[TensorDict], pad_to: int | None = None) -> TensorDict:
    """Right-pad per-token keys of every trajectory batch to a common length and concatenate.

    Padding is 0 (False for bool), or the key's `PAD_VALUES` entry; the image keys are padded to
    the largest image count instead. Every trajectory must carry the same keys.
    """
    if not trajs:
        raise ValueError("concat_padded needs at least one trajectory batch")
    keys = set(trajs[0].keys())
    for t in trajs[1:]:
        if set(t.keys()) != keys:
            raise ValueError(f"trajectories carry different keys: {sorted(keys)} vs {sorted(t.keys())}")
    max_len = max(t["attention_mask"].shape[1] for t in trajs)
    if pad_to is not None:
        max_len = max(max_len, pad_to)
    out: dict[str, torch.Tensor] = {}
    for key in trajs[0].keys():  # noqa: SIM118 - iterating a TensorDict yields rows, not keys
        width = max(t[key].shape[1] for t in trajs) if key in IMAGE_KEYS else max_len
        parts = []
        for t in trajs:
            v = t[key]
            b, length = t["attention_mask"].shape
            if (key in IMAGE_KEYS or is_per_token(v, b, length)) and v.shape[1] < width:
                pad = torch.full((b, width - v.shape[1], *v.shape[2:]), PAD_VALUES.get(key, 0), dtype=v.dtype)
                v = torch.cat([v, pad], dim=1)
            parts.append(v)
        out[key] = torch.cat(parts, dim=0)
    return TensorDict(out, batch_size=[sum(t.batch_size[0] for t in trajs)])


def seqlens_of(batch: TensorDict) -> torch.Tensor:
    """Real-token count of each sequence, int64 [B]."""
    return batch["attention_mask"].sum(dim=1).to(torch.int64)


def pack_batch(batch: TensorDict) -> PackedBatch:
    """Pack a right-padded batch into 1-D tensors over its real tokens.

    Returns per-token keys as ``[T, ...]``, per-sequence keys unchanged, the image keys as the
    model takes them (`pack_images`), and ``cu_seqlens`` (int32 ``[B+1]``), ``position_ids`` (int64
    ``[T]``, restarting at 0 per sequence) and ``max_seqlen``.
    """
    mask = batch["attention_mask"].bool()
    b, length = mask.shape
    lens = mask.sum(dim=1)
    if not torch.equal(mask, torch.arange(length).unsqueeze(0) < lens.unsqueeze(1)):
        raise ValueError("attention_mask must be right-padded (real tokens form a prefix of each row)")
    packed: PackedBatch = {}
    for key, value in batch.items():
        if is_per_token(value, b, length, key):
            packed[key] = value[mask]
        elif key not in IMAGE_KEYS:
            packed[key] = value
    if any(key in batch for key in IMAGE_KEYS):
        packed.update(pack_images(batch))
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, dim=0)
    packed["cu_seqlens"] = cu
    packed["position_ids"] = torch.cat([torch.arange(int(n)) for n in lens]) if b else torch.zeros(0, dtype=torch.int64)
    packed["max_seqlen"] = int(lens.max()) if b else 0
    return packed


def pack_images(batch: TensorDict) -> dict[str, torch.Tensor]:
    """The image keys of a padded batch as the model takes them: ``pixel_values`` ``[P_total, D]``,
    every sequence's real patches one after another in sequence order, and ``image_grid_thw``
    ``[N, 3]``, the real images' grids in the same order. ValueError when a sequence's grids need
    more patches than its row holds, or its zero (padding) grid rows come before a real one."""
    if not all(key in batch for key in IMAGE_KEYS):
        raise ValueError(f"a batch with images carries both {' and '.join(IMAGE_KEYS)}; this one has only one")
    pixels, grids = batch["pixel_values"], batch["image_grid_thw"]
    counts = grids.prod(dim=-1)
    real = counts > 0
    if (real[:, 1:] & ~real[:, :-1]).any():
        raise ValueError("image_grid_thw: a sequence's padding rows (zeros) must come after its images' rows")
    patches = counts.sum(dim=1)
    if (patches > pixels.shape[1]).any():
        b = int((patches > pixels.shape[1]).nonzero()[0])
        raise ValueError(
            f"sequence {b}'s image grids need {int(patches[b])} patches; its pixel_values row holds {pixels.shape[1]}"
        )
    keep = torch.arange(pixels.shape[1]).unsqueeze(0) < patches.unsqueeze(1)
    return {"pixel_values": pixels[keep], "image_grid_thw": grids[real]}


def unpack_sequences(values: torch.Tensor, cu_seqlens: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Inverse of packing for one per-token tensor: ``[T, ...]`` -> right-padded ``[B, seqlen, ...]``."""
    b = cu_seqlens.numel() - 1
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    out = torch.zeros((b, seqlen, *values.shape[1:]), dtype=values.dtype, device=values.device)
    mask = torch.arange(seqlen, device=values.device).unsqueeze(0) < lens.to(values.device).unsqueeze(1)
    out[mask] = values
    return out


def unpack_batch(packed: PackedBatch, seqlen: int, per_token_keys: set[str]) -> TensorDict:
    """Inverse of `pack_batch`: the ``per_token_keys`` back to ``[B, seqlen]``, other tensors kept,
    the packing keys dropped. (Which keys are per-token cannot be told from shapes alone when every
    sequence has one token, so the caller names them.)"""
    cu = packed["cu_seqlens"]
    assert isinstance(cu, torch.Tensor)
    if any(key in packed for key in IMAGE_KEYS):
        raise ValueError("a packed batch's images cannot be unpacked: which sequence holds which image is gone")
    out: dict[str, torch.Tensor] = {}
    for key, value in packed.items():
        if key in ("cu_seqlens", "position_ids", "max_seqlen"):
            continue
        assert isinstance(value, torch.Tensor)
        out[key] = unpack_sequences(value, cu, seqlen) if key in per_token_keys else value
    return TensorDict(out, batch_size=[cu.numel() - 1])


def allocate_balanced(
    lengths: list[int], budget: int | None, min_bins: int = 1, granularity: int = 1
) -> list[list[int]]:
    """Assign sequences to micro-batches: balanced first-fit-decreasing over groups.

    Consecutive runs of ``granularity`` sequences form a group that is never split. Groups are
    placed largest first, each into the least-loaded micro-batch that still has room under
    ``budget`` tokens (None = unlimited); a new micro-batch opens only when none has room. Starts
    with ``max(min_bins, ceil(total / budget))`` micro-batches. Returns the sequence indices of
    each micro-batch, ascending within it; no micro-batch is empty.
    """
    n = len(lengths)
    if n == 0:
        return []
    if n % granularity != 0:
        raise ValueError(f"{n} sequences cannot be cut into groups of granularity {granularity}")
    groups = [list(range(i, i + granularity)) for i in range(0, n, granularity)]
    sizes = [sum(lengths[j] for j in g) for g in groups]
    if budget is not None:
        too_long = [(gi, s) for gi, s in enumerate(sizes) if s > budget]
        if too_long:
            gi, s = too_long[0]
            what = f"sequence {gi}" if granularity == 1 else f"group {gi} (sequences {groups[gi][0]}..{groups[gi][-1]})"
            raise ValueError(
                f"{what} has {s} tokens, more than the micro-batch budget max_tokens_per_mb={budget}; "
                "raise the budget or shorten the sequences (nothing is truncated silently)"
            )
    total = sum(sizes)
    n_bins = max(min_bins, math.ceil(total / budget) if budget else 1)
    n_bins = min(n_bins, len(groups))
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    loads = [0] * n_bins
    for gi in sorted(range(len(groups)), key=lambda i: (-sizes[i], i)):
        order = sorted(range(len(bins)), key=lambda k: (loads[k], k))
        target = next((k for k in order if budget is None or loads[k] + sizes[gi] <= budget), None)
        if target is None:
            bins.append([])
            loads.append(0)
            target = len(bins) - 1
        bins[target].extend(groups[gi])
        loads[target] += sizes[gi]
    return [sorted(b) for b in bins if b]


def allocate_sequential(lengths: list[int], budget: int, granularity: int = 1) -> list[list[int]]:
    """The naive split: fill micro-batches in order, opening a new one when the next group does not fit."""
    bins: list[list[int]] = [[]]
    load = 0
    for i in range(0, len(lengths), granularity):
        g = list(range(i, min(i + granularity, len(lengths))))
        size = sum(lengths[j] for j in g)
        if size > budget:
            raise ValueError(f"group starting at sequence {i} has {size} tokens, more than the budget {budget}")
        if load + size > budget and bins[-1]:
            bins.append([])
            load = 0
        bins[-1].extend(g)
        load += size
    return [b for b in bins if b]


@dataclass
class MicroBatchSplit:
    """Micro-batches of a padded batch, and how to put per-sequence results back in order."""

    mbs: list[TensorDict]
    """Each micro-batch, padded to its own longest sequence."""
    indices: list[list[int]]
    """Original batch indices of the sequences in each micro-batch."""

    @property
    def restore_order(self) -> torch.Tensor:
        """Permutation ``p`` such that ``torch.cat(per_mb_results)[p]`` is in the batch's order."""
        flat = torch.tensor([i for idx in self.indices for i in idx], dtype=torch.int64)
        p = torch.empty_like(flat)
        p[flat] = torch.arange(flat.numel())
        return p


def split_microbatches(batch: TensorDict, spec: MicroBatchSpec) -> MicroBatchSplit:
    """Cut a padded batch into micro-batches by ``spec`` (see `allocate_balanced`)."""
    b, length = batch["attention_mask"].shape
    lens = seqlens_of(batch).tolist()
    indices = allocate_balanced(lens, spec.max_tokens_per_mb, spec.n_mbs, spec.granularity)
    mbs = []
    for idx in indices:
        sel = torch.tensor(idx, dtype=torch.int64)
        sub_len = max(1, max(lens[i] for i in idx))
        sub = {}
        for key, value in batch.items():
            v = value[sel]
            if is_per_token(value, b, length, key):
                v = v[:, :sub_len]
            sub[key] = v
        mbs.append(TensorDict(sub, batch_size=[len(idx)]))
    return MicroBatchSplit(mbs=mbs, indices=indices)
