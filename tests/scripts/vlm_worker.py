"""FSDPEngine checks on a vision-language model, run under torchrun (1 or 2 ranks on gloo).

Usage: ``torchrun --nproc-per-node N vlm_worker.py MODEL_DIR OUT_DIR``. Rank 0 writes
``OUT_DIR/vlm_w<world>.json`` and ``.pt`` parameter files that tests/test_vlm_fsdp.py compares.

The batch mixes sequences with one image, two images of other sizes and none; two share one image,
as a GRPO group's sequences do. Checks:
- packed log-probabilities and entropies (3 micro-batches; an uneven share per rank, where one
  rank's share has no image at all) against HF's padded forward with the same images; a sequence
  that ends with an image placeholder the model generated (a text token) against HF's forward
  given the embeddings (the images filling only the placeholders `image_token_mask` picks);
- one SGD step (lr 1, so parameters are gradients) with 1 and 4 micro-batches, and with the uneven
  share, against the step of HF's padded forward and backward on the whole batch;
- ``freeze_vision_tower``: the tower's parameters do not move, the decoder's do;
- a HF save that ``from_pretrained`` loads, and weight updates of all three kinds to a receiver.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from engine_checks import WeightReceiver, n_tokens, nll, write_results
from PIL import Image
from tensordict import TensorDict
from transformers import AutoModelForImageTextToText

from areal_lite.api.config import OptimizerConfig, TrainEngineConfig
from areal_lite.api.io import FinetuneSpec, MicroBatchSpec, SaveLoadMeta, WeightUpdateMeta
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.data import concat_padded, pack_images
from areal_lite.utils.distributed import destroy_default_group
from areal_lite.utils.vision import image_token_mask, load_processor
from areal_lite.workflows.trajectory import with_images

MODEL, OUT = sys.argv[1], sys.argv[2]
FT = FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=8)
IMAGE_SIZES = [[(56, 56)], [(112, 56), (28, 84)], [], [(84, 84)], [], [(28, 28)], [(56, 112)], []]
SAME_PICTURE = {6: 0}
"""Row 6 carries row 0's image instead (a prompt's completions share one, as a GRPO group's rows do)."""


def vlm_batch(seed: int) -> TensorDict:
    """Eight sequences: a chat prompt with IMAGE_SIZES[i]'s images of random pixels (row 6 with
    row 0's), then 2-7 random completion tokens trained on (loss_mask 1)."""
    processor = load_processor(MODEL)
    g = torch.Generator().manual_seed(seed)
    trajs, first_images = [], {}
    for i, sizes in enumerate(IMAGE_SIZES):
        images = [
            Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()) for w, h in sizes
        ]
        if i in SAME_PICTURE:
            images = first_images[SAME_PICTURE[i]]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": f"question {i}"}]
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        first_images[i] = images
        enc = processor(text=[text], images=images or None, return_tensors="pt")
        completion = torch.randint(3, 200, (1, int(torch.randint(2, 8, (1,), generator=g))), generator=g)
        ids = torch.cat([enc["input_ids"], completion], dim=1)
        n, m = ids.shape[1], completion.shape[1]
        traj = TensorDict(
            {
                "input_ids": ids,
                "attention_mask": torch.ones(1, n, dtype=torch.bool),
                "loss_mask": torch.tensor([[0] * (n - m) + [1] * m], dtype=torch.int32),
            },
            batch_size=[1],
        )
        pixels = enc["pixel_values"] if images else torch.zeros(0, 1176)
        grid = enc["image_grid_thw"] if images else torch.zeros(0, 3, dtype=torch.int64)
        trajs.append(with_images(traj, pixels, grid))
    return concat_padded(trajs)


def with_generated_placeholder(batch: TensorDict) -> TensorDict:
    """``batch`` whose row 0 ends with an image placeholder token the model "generated" (trained
    on): a text token, which no image fills."""
    out = batch.clone()
    n = int(out["attention_mask"][0].sum())
    if n == out["input_ids"].shape[1]:
        out = concat_padded([out], pad_to=n + 1)
    out["input_ids"][0, n] = load_processor(MODEL).tokenizer.convert_tokens_to_ids("<|image_pad|>")
    out["attention_mask"][0, n] = True
    out["loss_mask"][0, n] = 1
    return out


def hf_embeds_logprobs(model: torch.nn.Module, batch: TensorDict) -> torch.Tensor:
    """HF's padded forward given the input embeddings: the image features fill the tokens
    `image_token_mask` picks, positions from HF's get_rope_index on them."""
    am, ids = batch["attention_mask"], batch["input_ids"]
    images = pack_images(batch)
    counts = (batch["image_grid_thw"].prod(-1) // 4).sum(-1)
    fill = image_token_mask(ids, model.config.image_token_id, counts)
    features = torch.cat(model.model.get_image_features(images["pixel_values"], images["image_grid_thw"]).pooler_output)
    embeds = model.get_input_embeddings()(ids).masked_scatter(fill.unsqueeze(-1), features)
    pos, _ = model.model.get_rope_index(
        ids, fill.int(), image_grid_thw=images["image_grid_thw"], attention_mask=am.long()
    )
    logits = model(inputs_embeds=embeds, attention_mask=am.long(), position_ids=pos).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(am.shape[0], 1), lp], 1) * am


def uneven_shard(batch: TensorDict) -> TensorDict:
    """With 2 ranks, rows 0-1 and 3 (images) for rank 0 and rows 2, 4 and 7 (no image) for
    rank 1, which then runs the vision tower only on its blank stand-in; rows 5-6 go to rank 0."""
    if dist.get_world_size() == 1:
        return batch
    rows = [0, 1, 3, 5, 6] if dist.get_rank() == 0 else [2, 4, 7]
    return batch[torch.tensor(rows)]


def shard(batch: TensorDict) -> TensorDict:
    return batch[dist.get_rank() :: dist.get_world_size()]


def engine(n_mbs: int = 1, ft: FinetuneSpec | None = FT, **kw: object) -> FSDPEngine:
    cfg = TrainEngineConfig(
        path=MODEL,
        optimizer=OptimizerConfig(lr=1e-3, gradient_clipping=0.0),
        mb_spec=MicroBatchSpec(n_mbs=n_mbs),
        logits_chunk_size=7,
        **kw,
    )
    e = FSDPEngine(cfg)
    e.initialize(ft)
    return e


def with_sgd(e: FSDPEngine) -> FSDPEngine:
    """Plain SGD (lr 1): parameter equality to 1e-6 is gradient equality."""
    e.optimizer = torch.optim.SGD([p for p in e.model.parameters() if p.requires_grad], lr=1.0)
    return e


def hf_logprobs(model: torch.nn.Module, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned log-probabilities and entropies of HF's own padded forward with the images."""
    am = batch["attention_mask"]
    images = pack_images(batch)
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=am.long(),
        pixel_values=images["pixel_values"],
        image_grid_thw=images["image_grid_thw"],
        mm_token_type_ids=(batch["input_ids"] == model.config.image_token_id).int(),
    ).logits.float()
    logp = torch.log_softmax(logits, -1)
    lp = logp[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)[:, :-1]
    zero = torch.zeros(am.shape[0], 1)
    return torch.cat([zero, lp], 1) * am, torch.cat([zero, ent], 1) * am


def full_params(e: FSDPEngine) -> dict[str, torch.Tensor]:
    return e._full_state_dict()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str] | None = None) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in (keys or a))


def check_logprobs(res: dict[str, object], batch: TensorDict) -> None:
    hf = AutoModelForImageTextToText.from_pretrained(MODEL)
    with torch.no_grad():
        ref_lp, ref_ent = hf_logprobs(hf, batch)
    for attn in ("sdpa", "eager"):
        e = engine(n_mbs=3, ft=None, attn_impl=attn)
        lp, ent = e.forward(batch, with_entropy=True)
        res[f"logprob_err_{attn}"] = float((lp - ref_lp).abs().max())
        res[f"entropy_err_{attn}"] = float((ent - ref_ent).abs().max())
        e.destroy()
    e = engine(n_mbs=2, ft=None)
    generated = with_generated_placeholder(batch)
    with torch.no_grad():
        res["embeds_ref_err"] = float((hf_embeds_logprobs(hf, batch) - ref_lp).abs().max())
        res["logprob_err_generated_placeholder"] = float(
            (e.forward(generated) - hf_embeds_logprobs(hf, generated)).abs().max()
        )
    err = float((e.forward(uneven_shard(batch)) - uneven_shard(ref_lp)).abs().max())
    t = torch.tensor([err])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    res["logprob_err_uneven"] = float(t)
    e.destroy()


def check_gradients(res: dict[str, object], batch: TensorDict) -> None:
    """One SGD step of the engine against one SGD step of HF's padded forward and backward."""
    hf = AutoModelForImageTextToText.from_pretrained(MODEL)
    lp, _ = hf_logprobs(hf, batch)
    mask = batch["loss_mask"].float()
    (-(lp * mask).sum() / mask.sum()).backward()
    with torch.no_grad():
        reference = {n: (p - p.grad).detach().clone() for n, p in hf.named_parameters()}
    res["hf_vision_grad_norm"] = float(hf.model.visual.patch_embed.proj.weight.grad.norm())
    rank0 = dist.get_rank() == 0
    for n_mbs, share, tag in ((1, shard, "mb1"), (4, shard, "mb4"), (2, uneven_shard, "uneven")):
        e = with_sgd(engine(n_mbs=n_mbs))
        before = full_params(e)
        res[f"stats_{tag}"] = e.train_batch(share(batch), nll, n_tokens)
        after = full_params(e)
        if rank0:
            res[f"grad_err_{tag}"] = max_diff(reference, after)
            res[f"changed_{tag}"] = max_diff(before, after)
            torch.save(after, os.path.join(OUT, f"params_{tag}_w{dist.get_world_size()}.pt"))
        e.destroy()

    e = with_sgd(engine(n_mbs=2, freeze_vision_tower=True))
    before = full_params(e)
    res["frozen_trainable"] = sorted(
        {".".join(n.split(".")[:2]) for n, p in e.model.hf.named_parameters() if p.requires_grad}
    )
    e.train_batch(shard(batch), nll, n_tokens)
    after = full_params(e)
    if rank0:
        vision = [k for k in before if k.startswith("model.visual.")]
        decoder = [k for k in before if k.startswith("model.language_model.")]
        res["frozen_vision_change"] = max_diff(before, after, vision)
        res["frozen_decoder_change"] = max_diff(before, after, decoder)
        res["frozen_decoder_err"] = max_diff(reference, after, decoder)
    e.destroy()


def check_saves_and_updates(res: dict[str, object], batch: TensorDict) -> None:
    e = engine(n_mbs=2)
    e.train_batch(shard(batch), nll, n_tokens)
    rank0 = dist.get_rank() == 0
    hf_dir = os.path.join(OUT, "hf")
    e.save(SaveLoadMeta(path=hf_dir, weight_format="hf", tokenizer=load_processor(MODEL)))
    full = full_params(e)
    if rank0:
        loaded = AutoModelForImageTextToText.from_pretrained(hf_dir)
        res["saved_err"] = max_diff(full, {k: v.detach() for k, v in loaded.state_dict().items()})
        res["saved_processor"] = type(load_processor(hf_dir)).__name__
    receiver = WeightReceiver(MODEL) if rank0 else None
    dist_meta = WeightUpdateMeta(type="distributed", chunk_bytes=50_000)
    e.connect_engine(receiver, dist_meta)  # type: ignore[arg-type]
    for i, meta in enumerate(
        [WeightUpdateMeta(type="in_process"), WeightUpdateMeta(type="disk", path=os.path.join(OUT, "push")), dist_meta]
    ):
        e.train_batch(shard(batch), nll, n_tokens)
        e.set_version(i + 1)
        e.update_weights(meta)
        full = full_params(e)
        if rank0:
            res[f"update_{meta.type}_diff"] = max_diff(receiver.params(), full)
            res[f"update_{meta.type}_version"] = receiver.version
    if rank0:
        receiver.destroy()
    e.destroy()


def main() -> None:
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    batch = vlm_batch(0)
    res: dict[str, object] = {"images_per_row": [int((g.prod(-1) > 0).sum()) for g in batch["image_grid_thw"]]}
    check_logprobs(res, batch)
    check_gradients(res, batch)
    check_saves_and_updates(res, batch)
    write_results(res, os.path.join(OUT, f"vlm_w{dist.get_world_size()}.json"))
    destroy_default_group()


if __name__ == "__main__":
    main()
