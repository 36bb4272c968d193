"""Property tests for padding, packing and micro-batching (areal_lite.utils.data)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from areal_lite.api.io import MicroBatchSpec
from areal_lite.utils.data import (
    allocate_balanced,
    allocate_sequential,
    concat_padded,
    pack_batch,
    split_microbatches,
    unpack_batch,
)

PER_TOKEN = {"input_ids", "attention_mask", "loss_mask", "logprobs", "versions"}


def make_traj(lengths: list[int], width: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    ids = torch.randint(1, 1000, (n, width), generator=g) * mask
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "loss_mask": (torch.rand(n, width, generator=g) > 0.5).int() * mask,
            "logprobs": torch.randn(n, width, generator=g) * mask,
            "versions": torch.randint(-1, 5, (n, width), generator=g, dtype=torch.int32) * mask,
            "rewards": torch.randn(n, generator=g),
        },
        batch_size=[n],
    )


lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=24)


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(lengths_st, min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_concat_pack_unpack_round_trip(groups: list[list[int]], seed: int) -> None:
    trajs = [make_traj(g, max(g) + k, seed + k) for k, g in enumerate(groups)]
    batch = concat_padded(trajs)
    all_lens = [n for g in groups for n in g]
    assert batch.batch_size[0] == len(all_lens)
    assert batch["attention_mask"].sum(1).tolist() == all_lens

    packed = pack_batch(batch)
    cu = packed["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu.tolist()[-1] == sum(all_lens)
    assert packed["max_seqlen"] == max(all_lens)
    pos = packed["position_ids"]
    assert pos.tolist() == [i for n in all_lens for i in range(n)]
    assert packed["input_ids"].shape == (sum(all_lens),)
    assert torch.equal(packed["rewards"], batch["rewards"])

    restored = unpack_batch(packed, batch["attention_mask"].shape[1], PER_TOKEN)
    for key in batch.keys():  # noqa: SIM118 - iterating a TensorDict yields rows, not keys
        assert torch.equal(restored[key], batch[key]), key


@settings(max_examples=200, deadline=None)
@given(
    lengths=lengths_st,
    budget=st.integers(40, 200),
    granularity=st.sampled_from([1, 2, 4]),
    min_bins=st.integers(1, 4),
)
def test_balanced_allocation_respects_budget_groups_and_covers_all(
    lengths: list[int], budget: int, granularity: int, min_bins: int
) -> None:
    lengths = lengths + [1] * (-len(lengths) % granularity)
    groups_fit = all(sum(lengths[i : i + granularity]) <= budget for i in range(0, len(lengths), granularity))
    if not groups_fit:
        with pytest.raises(ValueError, match="max_tokens_per_mb"):
            allocate_balanced(lengths, budget, min_bins, granularity)
        return
    bins = allocate_balanced(lengths, budget, min_bins, granularity)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))  # every sequence exactly once
    for b in bins:
        assert b, "no empty micro-batch"
        assert sum(lengths[i] for i in b) <= budget
        for i in b:  # groups never split
            start = i - i % granularity
            assert all(j in b for j in range(start, start + granularity))
    n_groups = len(lengths) // granularity
    assert len(bins) >= min(min_bins, n_groups)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, seed=st.integers(0, 1000), n_mbs=st.integers(1, 5))
def test_split_restores_original_order(lengths: list[int], seed: int, n_mbs: int) -> None:
    batch = make_traj(lengths, max(lengths), seed)
    split = split_microbatches(batch, MicroBatchSpec(n_mbs=n_mbs, max_tokens_per_mb=max(lengths) * 3))
    # per-sequence results
    rewards = torch.cat([mb["rewards"] for mb in split.mbs])[split.restore_order]
    assert torch.equal(rewards, batch["rewards"])
    # per-token results, padded back to the batch's width
    width = batch["attention_mask"].shape[1]
    padded = [torch.nn.functional.pad(mb["logprobs"], (0, width - mb["logprobs"].shape[1])) for mb in split.mbs]
    assert torch.equal(torch.cat(padded)[split.restore_order], batch["logprobs"])
    for mb, idx in zip(split.mbs, split.indices):
        assert mb["attention_mask"].shape[1] == max(lengths[i] for i in idx)


def test_sequence_longer_than_budget_is_a_clear_error() -> None:
    batch = make_traj([5, 30, 7], 30, 0)
    with pytest.raises(ValueError, match="sequence 1 has 30 tokens, more than the micro-batch budget"):
        split_microbatches(batch, MicroBatchSpec(max_tokens_per_mb=20))


def test_balanced_beats_sequential_on_long_tail() -> None:
    lengths = [200, 20, 20, 20, 190, 15, 15, 180, 10, 10, 10, 10]
    balanced = allocate_balanced(lengths, 256)
    naive = allocate_sequential(lengths, 256)
    assert len(balanced) <= len(naive)


def test_pack_rejects_left_padding() -> None:
    batch = make_traj([3, 2], 3, 0)
    batch["attention_mask"] = torch.tensor([[True, True, True], [False, True, True]])
    with pytest.raises(ValueError, match="right-padded"):
        pack_batch(batch)


PATCH_DIM = 6


def with_random_images(traj: TensorDict, seed: int, max_images: int = 3) -> TensorDict:
    """``traj`` carrying 0..max_images images per sequence (grids [1, h, w]), each sequence's patches
    filled with values that name it (sequence seed, image, patch), as one trajectory of a workflow."""
    g = torch.Generator().manual_seed(seed)
    n = traj.batch_size[0]
    grids = [
        [
            [1, int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))]
            for _ in range(int(torch.randint(0, max_images + 1, (1,), generator=g)))
        ]
        for _ in range(n)
    ]
    width_i = max(1, max(len(gr) for gr in grids))
    width_p = max(1, max(sum(t * h * w for t, h, w in gr) for gr in grids))
    pixels = torch.zeros(n, width_p, PATCH_DIM)
    grid = torch.zeros(n, width_i, 3, dtype=torch.int64)
    for b, gr in enumerate(grids):
        count = sum(t * h * w for t, h, w in gr)
        pixels[b, :count] = seed * 1000 + b + torch.randn(count, PATCH_DIM, generator=g)
        if gr:
            grid[b, : len(gr)] = torch.tensor(gr)
    out = traj.clone(recurse=False)
    out["pixel_values"], out["image_grid_thw"] = pixels, grid
    return out


def images_of(batch: TensorDict, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s real patches and grid rows."""
    grid = batch["image_grid_thw"][b]
    grid = grid[grid.prod(-1) > 0]
    return batch["pixel_values"][b, : int(grid.prod(-1).sum())], grid


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(lengths_st, min_size=1, max_size=4), seed=st.integers(0, 2**10), n_mbs=st.integers(1, 5))
def test_each_sequence_keeps_its_images_through_padding_splits_and_packing(
    groups: list[list[int]], seed: int, n_mbs: int
) -> None:
    trajs = [with_random_images(make_traj(g, max(g) + k, seed + k), seed + k) for k, g in enumerate(groups)]
    batch = concat_padded(trajs)
    originals = [images_of(t, b) for t in trajs for b in range(t.batch_size[0])]
    assert batch["pixel_values"].shape[1] == max(t["pixel_values"].shape[1] for t in trajs)
    for b, (pixels, grid) in enumerate(originals):
        got_pixels, got_grid = images_of(batch, b)
        assert torch.equal(got_pixels, pixels) and torch.equal(got_grid, grid)
    lengths = batch["attention_mask"].sum(1).tolist()
    split = split_microbatches(batch, MicroBatchSpec(n_mbs=n_mbs, max_tokens_per_mb=max(lengths) * 2))
    for mb, idx in zip(split.mbs, split.indices):
        packed = pack_batch(mb)
        assert torch.equal(packed["pixel_values"], torch.cat([originals[i][0] for i in idx]).reshape(-1, PATCH_DIM))
        assert torch.equal(packed["image_grid_thw"], torch.cat([originals[i][1] for i in idx]).reshape(-1, 3))
        assert packed["input_ids"].shape == (sum(lengths[i] for i in idx),)
        with pytest.raises(ValueError, match="cannot be unpacked"):
            unpack_batch(packed, mb["attention_mask"].shape[1], PER_TOKEN)


def test_image_keys_are_per_sequence_even_when_as_wide_as_the_tokens() -> None:
    batch = make_traj([4, 2], 4, 0)
    batch["pixel_values"] = torch.arange(2 * 4 * PATCH_DIM, dtype=torch.float32).reshape(2, 4, PATCH_DIM)
    batch["image_grid_thw"] = torch.tensor([[[1, 2, 2]], [[1, 1, 2]]])
    packed = pack_batch(batch)
    assert torch.equal(packed["pixel_values"], torch.cat([batch["pixel_values"][0], batch["pixel_values"][1, :2]]))
    assert packed["image_grid_thw"].tolist() == [[1, 2, 2], [1, 1, 2]]
    sub = split_microbatches(batch, MicroBatchSpec(n_mbs=2)).mbs
    assert [mb["pixel_values"].shape[1] for mb in sub] == [4, 4]  # not cut to the micro-batch's token width


def test_bad_image_layouts_are_clear_errors() -> None:
    batch = make_traj([3, 2], 3, 0)
    batch["pixel_values"] = torch.zeros(2, 4, PATCH_DIM)
    batch["image_grid_thw"] = torch.tensor([[[1, 2, 2]], [[1, 2, 3]]])
    with pytest.raises(ValueError, match="sequence 1's image grids need 6 patches"):
        pack_batch(batch)
    batch["image_grid_thw"] = torch.tensor([[[0, 0, 0], [1, 2, 2]], [[0, 0, 0], [0, 0, 0]]])
    with pytest.raises(ValueError, match="padding rows"):
        pack_batch(batch)
    del batch["image_grid_thw"]
    with pytest.raises(ValueError, match="both"):
        pack_batch(batch)
