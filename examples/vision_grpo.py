"""Vision GRPO on CPU: a tiny vision-language model learns to name the colour of a shape it sees.

The task: a picture (``task.image_size`` pixels square) of one filled shape (square, circle or
triangle, of random size and place) in one of ``COLOURS`` on white, with the question "What colour
is the shape?"; the answer is the colour's name, checked exactly. A tiny Qwen2.5-VL is built here
(`areal_lite.utils.tiny_vlm`: a vision tower, 14-pixel patches merged 2 x 2 into image tokens, a
decoder with multimodal rotary positions) and warmed up with SFT until its greedy accuracy on dev
pictures reaches ``task.sft_target_reward``: it has learnt the answer's form and part of the colours.
Then GRPO trains it against the checker alone: `VisionRLVRWorkflow` renders each chat with its
picture through the processor, the picture travels with every generation request
(`ModelRequest.images`) and into the trajectories (``pixel_values``, ``image_grid_thw``), and
`FSDPEngine` trains vision tower and decoder on the packed batches. Greedy accuracy on held-out
pictures is measured before and after RL.

Deliberate simplification, as in the quickstart: labels are cheap here, so more SFT would solve the
task too; the demo shows images going through the whole RL machinery and the gain RL makes, in
minutes on a CPU. Generation needs an inference engine that takes images (docs/vision.md).

    python -m areal_lite.launcher.local examples/vision_grpo.py --config configs/vision_grpo.yaml
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
from PIL import Image, ImageDraw
from tensordict import TensorDict

from areal_lite import kit
from areal_lite.actors.ppo import PPOActor
from areal_lite.api.config import TrainEngineConfig
from areal_lite.api.config_loader import load_config
from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.kit.ranks import is_rank0
from areal_lite.rewards.format import exact_answer_reward
from areal_lite.rewards.runner import RewardRunner
from areal_lite.utils.data import concat_padded
from areal_lite.utils.tiny_vlm import build_tiny_vlm
from areal_lite.utils.vision import encode_image, load_processor
from areal_lite.workflows.trajectory import with_images
from areal_lite.workflows.vision_rlvr import VisionRLVRWorkflow, encode_vision_chat

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (30, 70, 220),
    "yellow": (235, 200, 20),
    "purple": (130, 40, 170),
    "orange": (245, 130, 20),
    "black": (20, 20, 20),
    "gray": (140, 140, 140),
}
QUESTION = "What colour is the shape?"


@dataclass
class TaskConfig(kit.RewardWarmUpConfig):
    """The pictures, the tiny VLM (``hidden_size`` and ``num_layers`` are its decoder's) and the
    SFT warm-up, which stops on the dev pictures' greedy accuracy (``sft_target_reward``: the
    checker's reward is 1 for a right answer); ``seed`` seeds the model and the pictures."""

    image_size: int = 56
    """Side of each picture in pixels (a multiple of 28: ``(image_size / 28)^2`` image tokens)."""
    n_train_prompts: int = 4096
    """Pictures (questions only, no answers) in the RL training set."""
    vision_hidden_size: int = 32
    """Width of the vision tower."""
    vision_depth: int = 2
    """Blocks of the vision tower."""


@dataclass
class VisionGRPOConfig(RLExperimentConfig):
    task: TaskConfig = field(default_factory=TaskConfig)


# ---------------------------------------------------------------------------------- the task


def draw_shape(rng: random.Random, size: int) -> tuple[Image.Image, str]:
    """A white picture with one filled shape of a random colour, kind, size and place; its colour."""
    name = rng.choice(sorted(COLOURS))
    image = Image.new("RGB", (size, size), (255, 255, 255))
    side = rng.randint(size // 4, size // 2)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    box, draw = [x, y, x + side, y + side], ImageDraw.Draw(image)
    kind = rng.choice(("square", "circle", "triangle"))
    if kind == "square":
        draw.rectangle(box, fill=COLOURS[name])
    elif kind == "circle":
        draw.ellipse(box, fill=COLOURS[name])
    else:
        draw.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=COLOURS[name])
    return image, name


def pictures(n: int, size: int, seed: int) -> list[dict[str, object]]:
    """``n`` items: the question with one picture (PNG bytes) and its colour as ``answer``."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        image, name = draw_shape(rng, size)
        content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
        items.append(
            {"messages": [{"role": "user", "content": content}], "images": [encode_image(image)], "answer": name}
        )
    return items


def demonstrations(processor: object, items: list[dict[str, object]]) -> TensorDict:
    """An SFT batch: each item's prompt with its picture, then its answer and eos (trained on)."""
    tokenizer = processor.tokenizer  # type: ignore[attr-defined]
    rows = []
    for item in items:
        prompt = encode_vision_chat(processor, item["messages"], item["images"])  # type: ignore[arg-type]
        answer = tokenizer(str(item["answer"]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = prompt.input_ids + answer
        row = TensorDict(
            {
                "input_ids": torch.tensor([ids]),
                "attention_mask": torch.ones(1, len(ids), dtype=torch.bool),
                "loss_mask": torch.tensor([[0] * len(prompt.input_ids) + [1] * len(answer)], dtype=torch.int32),
            },
            batch_size=[1],
        )
        rows.append(with_images(row, prompt.pixel_values, prompt.image_grid_thw))
    return concat_padded(rows)


def greedy_workflow(cfg: VisionGRPOConfig, processor: object) -> VisionRLVRWorkflow:
    """One greedy answer per picture, checked exactly: the dev and held-out accuracy."""
    eos = processor.tokenizer.eos_token_id  # type: ignore[attr-defined]
    gconfig = replace(cfg.gconfig, n_samples=1, greedy=True, stop_token_ids=[eos])
    return VisionRLVRWorkflow(RewardRunner(exact_answer_reward, mode="inline"), gconfig, processor)


def warm_up(cfg: VisionGRPOConfig, base_dir: str, sft_dir: str) -> None:
    """Build the tiny VLM in ``base_dir`` and train it on fresh labelled pictures each step until
    greedy accuracy on dev pictures reaches ``task.sft_target_reward``; save it in ``sft_dir``."""
    task = cfg.task

    def build() -> None:
        build_tiny_vlm(
            base_dir, hidden_size=task.hidden_size, num_layers=task.num_layers,
            vision_hidden_size=task.vision_hidden_size, vision_depth=task.vision_depth,
            min_pixels=task.image_size**2, max_pixels=task.image_size**2, seed=task.seed,
            corpus=[QUESTION, *COLOURS], vocab_size=350,  # each colour's name one token
        )  # fmt: skip

    def batches(_tokenizer: object, rank: int, world: int) -> Iterator[TensorDict]:
        processor = load_processor(base_dir)
        for step in itertools.count():  # each rank trains on its share of the step's pictures
            items = pictures(task.sft_batch_size * world, task.image_size, task.seed + 1000 + step)
            yield demonstrations(processor, items[rank::world])

    def judge(_tokenizer: object) -> VisionRLVRWorkflow:
        return greedy_workflow(cfg, load_processor(base_dir))

    engine_cfg = TrainEngineConfig(path=base_dir, backend=cfg.actor.backend, seed=task.seed, mb_spec=cfg.actor.mb_spec)
    kit.warm_up_with_sft(
        cfg, engine_cfg, sft_dir, build=build, batches=batches, judge=judge,
        dev=pictures(task.n_dev, task.image_size, task.seed + 2), lr=task.sft_lr, max_steps=task.sft_steps,
        eval_every=task.sft_eval_every, target=task.sft_target_reward,
    )  # fmt: skip
    if is_rank0():  # the warm-up saved the tokenizer; the engines also need the image processor
        load_processor(base_dir).save_pretrained(sft_dir)


# ---------------------------------------------------------------------------------- RL


def main(argv: list[str]) -> None:
    cfg = load_config(argv, VisionGRPOConfig)
    t_start = kit.job_start_time(cfg.output_dir)
    torch.manual_seed(cfg.seed)
    task = cfg.task
    base_dir, sft_dir = os.path.join(cfg.output_dir, "base_model"), os.path.join(cfg.output_dir, "sft_model")
    if not os.path.exists(os.path.join(sft_dir, "processor_config.json")):
        warm_up(cfg, base_dir, sft_dir)
    processor = load_processor(sft_dir)
    eval_items = pictures(task.n_eval, task.image_size, task.seed + 1)
    train_items = pictures(task.n_train_prompts, task.image_size, task.seed + 3)

    eos = processor.tokenizer.eos_token_id
    gconfig = replace(cfg.gconfig, n_samples=cfg.actor.group_size, stop_token_ids=[eos])
    # The checker is a string comparison: call it on the rollout loop (no worker process or thread).
    workflow = VisionRLVRWorkflow(RewardRunner(exact_answer_reward, mode="inline"), gconfig, processor)
    eval_workflow = greedy_workflow(cfg, processor)

    rollout, weight_meta = kit.make_rollout_controller(cfg, sft_dir)
    actor_cfg = replace(cfg.actor, path=sft_dir)
    actor = PPOActor(actor_cfg, kit.make_train_engine(actor_cfg))
    dataloader = kit.rank_dataloader(train_items, cfg.train_dataset, actor.engine, seed=cfg.seed)
    # The processor is saved with each HF checkpoint, so a checkpoint loads as the model did.
    run = kit.RunKit(cfg, actor.engine, dataloader, tokenizer=processor, rollout=rollout, weight_meta=weight_meta)
    run.start()
    score = kit.HeldOutScore(rollout, eval_workflow, eval_items, "eval/accuracy")
    acc_before = run.once("acc_before", score)
    kit.print_rank0(f"[vision] held-out greedy accuracy after SFT: {acc_before:.3f}")

    t_rl = time.time()
    for global_step in range(run.start_step, run.total_steps):
        _, stats = run.rl_step(actor, workflow, global_step)  # the quickstart's step
        run.end_step(global_step, stats, evaluate=score.evaluate)

    kit.print_rank0(f"[vision] RL: {run.total_steps - run.start_step} steps in {time.time() - t_rl:.2f}s")
    acc_after = score()
    minutes = (time.time() - t_start) / 60
    kit.print_rank0(f"\n{'held-out greedy accuracy':<28}{'value':>8}")
    kit.print_rank0(f"{'after SFT (before RL)':<28}{acc_before:>8.3f}")
    kit.print_rank0(f"{'after RL':<28}{acc_after:>8.3f}")
    run.finish(f"acc_before={acc_before:.3f} acc_after={acc_after:.3f} minutes={minutes:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
