"""A GRPO step of areal-lite against TRL's `GRPOTrainer`, on the same model, side by side.

Every configuration trains the same model (``--model 20m``: a Qwen2 of hidden 384, 10 layers, 6
heads, 2 KV heads, built here; ``--model smollm2``: SmolLM2-135M-Instruct, `smollm2_dir`) in the
same dtype (``--dtype``: float32, or bfloat16 mixed precision on both sides), all parameters or
LoRA adapters (``--lora RANK``: peft's adapters of that rank, alpha 16, on every linear layer but
the head, on both sides) on the same prompts with the same step: ``--prompts`` prompts x ``--group`` samples x ``--tokens``
completion tokens (eos suppressed until then on both sides, so every completion has exactly that
many tokens; the tokens per step are counted from each side's batches and printed), one optimizer
step per batch, lr 1e-6 constant, clip epsilon 0.2, gradient norm clipped at 1.0, no KL term, no
gradient checkpointing, no vLLM. The reward (the share of digits in the completion's text) is the
same cheap function on both sides.

- ``TRL``: `GRPOTrainer` (generation by ``model.generate`` in the trainer, ``use_cpu=True``).
- ``sync``: our loop at eta = 0 (`RolloutController.prepare_batch` on the embedded engine, then
  `PPOActor.ppo_update` on `FSDPEngine` and an in-process weight update), on-policy: the
  engine's log-probabilities are the old policy's, as TRL takes them.
- ``async``: the same loop at eta = 1 with the decoupled loss (proximal log-probabilities
  recomputed): the engine generates the next batch while the trainer trains on this one. The
  engine keeps the process's thread count (``local_engine.num_threads`` 0): it and the trainer
  each run on half of the threads while both compute, on all of them alone.
- ``async_server``: the async loop with the engine in a process of its own on the same device:
  our server (``python -m areal_lite.engines.server``, what ``launcher.backend=areal`` starts,
  with the configuration's thread count) behind `RemoteSGLangEngine`, the weights handed over by
  ``ipc`` updates (shared memory on CPU, CUDA IPC handles on a GPU; no file). The trainer's
  interpreter and the engine's never contend; they share the device.

Our trainer runs each group's shared prompt through the model once (``shared_prefix``, as the
quickstart does; ``--no-shared-prefix`` turns it off): the same tokens are trained, with fewer
FLOPs, which TRL has no equivalent for.

For our sides the table also gives the training seconds of a step (advantages, update, weight
sync; ``train s``), then TRL's step time over our synchronous training alone: the ratio a loop
whose generation cost nothing would reach; and (when 1 thread and more were run) the step every
thread busy all step would give, generation and training at their one-thread rates (the sync
side's 1-thread step over the most threads run): no overlap of the same work does better, so a
ratio to TRL above that bound's (``trl_over_all_threads_busy``) needs less work per step.

Each configuration runs in its own process (``OMP_NUM_THREADS`` and ``torch.set_num_threads`` at
1 or 2); configurations alternate over ``--repeats`` rounds. ``--async-engine-threads N`` adds a
side, ``async_split``: the async loop with its engine on N threads (``local_engine.num_threads``),
so that generation and training running at once do not each take every thread; it runs where N
is below the configuration's thread count; ``--engine-cores 1`` adds ``async_pinned``, the same
with the engine's scheduler thread pinned to core 1 (``local_engine.cores``), so that the two are
measured side by side. A configuration's figure is its median
step time after ``--warmup`` steps, the best round's. The last line is
``RESULT best_over_trl=<TRL's best step time / ours at its best> ...``.

    OMP_NUM_THREADS=1 python benchmarks/grpo_vs_trl.py [--steps 8] [--repeats 1] [--model 20m|smollm2]
        [--lora 16] [--dtype float32|bfloat16] [--async-engine-threads 1 [--engine-cores 1]]

On a GPU (``--device cuda``) both sides train and generate on it (TRL without ``use_cpu``, our
engine with ``local_engine.device=cuda``; the trainer takes the GPU where there is one); the
thread count is then the CPU threads of each side's Python and launch work, e.g.
``--threads-list 4``. ``--model DIR`` takes any HF directory; one holding only a config and a
tokenizer gets random weights (seeded): SmolLM2-135M's config and tokenizer (a few MB) stand in
for the model where its package cannot be installed.

On SmolLM2 keep runs short, e.g. ``--model smollm2 --prompts 2 --group 4 --tokens 32 --steps 3
--warmup 2`` (a step of it is tens of CPU-seconds on each side). Keep two warm-up steps there: our
trainer's first two steps grow its heap to the step's peak (about 0.4 million page faults each on
SmolLM2, 2-4 s of extra wall time), the later ones reuse it; with one warm-up step the timed median
includes the second.

Needs ``trl`` (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_lite.api.config import InferenceEngineConfig
    from areal_lite.core.controller import RolloutController

MODEL = {"hidden_size": 384, "num_layers": 10, "num_heads": 6, "num_kv_heads": 2, "vocab_size": 512}
LR, CLIP, MAX_GRAD_NORM = 1e-6, 0.2, 1.0
LORA_ALPHA = 16.0
SIDES = ("trl", "sync", "async", "async_server", "async_split", "async_pinned")
"""``async_split``: the async loop with its engine on ``--async-engine-threads`` threads (run only
where that is fewer than the configuration's threads); ``async_pinned``: the same with the engine's
scheduler thread pinned to ``--engine-cores`` (run only where those are given)."""
SPLIT = ("async_split", "async_pinned")


def digit_share(text: str) -> float:
    """The reward: the share of the completion's characters that are digits (varies between
    samples of a random model, so every group has a signal to train on)."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def prompts(n: int) -> list[str]:
    return [f"What is {i * 7 % 97} + {i * 13 % 89}? Answer:" for i in range(n)]


def run_trl(path: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Step times and tokens per step of `GRPOTrainer`."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear")
    n = args.prompts * (args.steps + args.warmup)
    dataset = Dataset.from_list([{"prompt": p} for p in prompts(n)])

    def reward(completions: list[str], **kwargs: object) -> list[float]:
        return [digit_share(c) for c in completions]

    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.tokens,
        generation_kwargs={"min_new_tokens": args.tokens},
        learning_rate=LR,
        lr_scheduler_type="constant",
        epsilon=CLIP,
        max_grad_norm=MAX_GRAD_NORM,
        beta=0.0,
        num_iterations=1,
        steps_per_generation=1,
        max_steps=args.steps + args.warmup,
        gradient_checkpointing=False,
        use_vllm=False,
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bfloat16",
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        shuffle_dataset=False,
        disable_dropout=True,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    times: list[float] = []
    tokens: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: object, **k: object) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: object, **k: object) -> None:
            times.append(time.perf_counter() - self.t0)

        def on_log(
            self, _args: object, _state: object, _control: object, logs: dict | None = None, **k: object
        ) -> None:
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"] * args.prompts * args.group)

    trainer.add_callback(Timer())
    trainer.train()
    return times, tokens


def cores(text: str) -> list[int]:
    """``"0,1"`` -> ``[0, 1]``; ``""`` -> ``[]``."""
    return [int(c) for c in text.split(",") if c.strip()]


@contextlib.contextmanager
def served_rollout(path: str, args: argparse.Namespace, config: InferenceEngineConfig) -> Iterator[RolloutController]:
    """The ``async_server`` side's rollout: our server on ``path`` in a process of its own (on
    ``args.device``, with this process's thread count), its controller, stopped on exit."""
    from areal_lite.core.controller import RolloutController
    from areal_lite.engines.remote.sglang import RemoteSGLangEngine
    from areal_lite.launcher.processes import is_healthy, spawn, stop
    from areal_lite.utils.distributed import find_free_port

    port = find_free_port()
    cmd = [sys.executable, "-m", "areal_lite.engines.server", "--model-path", path, "--port", str(port)]
    cmd += [
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--max-running-requests",
        str(2 * args.prompts * args.group),
    ]
    server = spawn(cmd, cores=[], env=dict(os.environ))
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while not is_healthy(address):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"our server on {address} did not start (exit code {server.poll()})")
            time.sleep(0.5)
        rollout = RolloutController(RemoteSGLangEngine(replace(config, addresses=[address])), config)
        rollout.initialize()
        try:
            yield rollout
        finally:
            rollout.destroy()
    finally:
        stop([server])


def run_ours(path: str, args: argparse.Namespace, eta: int) -> tuple[list[float], list[float], list[float]]:
    """Step times, tokens per step and training seconds per step (advantages, update and weight
    sync; the rest of a step is waiting for the batch) of our loop at staleness bound ``eta``."""
    from transformers import AutoTokenizer

    from areal_lite.actors.ppo import PPOActor
    from areal_lite.api.config import (
        DatasetConfig,
        InferenceEngineConfig,
        LocalEngineConfig,
        LoRAConfig,
        OptimizerConfig,
        PPOActorConfig,
    )
    from areal_lite.api.io import FinetuneSpec, GenerationConfig, WeightUpdateMeta
    from areal_lite.core.controller import RolloutController
    from areal_lite.engines.local.engine import LocalInferenceEngine
    from areal_lite.kit import make_train_engine, rank_dataloader, sync_weights
    from areal_lite.rewards.runner import RewardRunner
    from areal_lite.workflows.rlvr import RLVRWorkflow

    tokenizer = AutoTokenizer.from_pretrained(path)
    on_policy = eta == 0
    cfg = PPOActorConfig(
        path=path,
        group_size=args.group,
        eps_clip=CLIP,
        optimizer=OptimizerConfig(
            lr=LR, lr_scheduler_type="constant", warmup_steps_proportion=0.0, gradient_clipping=MAX_GRAD_NORM
        ),
        use_decoupled_loss=not on_policy,
        recompute_logprob=not on_policy,
        shared_prefix=args.shared_prefix,
        dtype=args.dtype,
        lora=LoRAConfig(rank=args.lora, alpha=LORA_ALPHA),
    )
    engine = make_train_engine(cfg)
    rollout_config = InferenceEngineConfig(
        consumer_batch_size=args.prompts, max_head_offpolicyness=eta, max_concurrent_rollouts=2 * args.prompts
    )
    with contextlib.ExitStack() as stack:
        stack.callback(engine.destroy)
        if args.side == "async_server":
            rollout = stack.enter_context(served_rollout(path, args, rollout_config))
            meta = WeightUpdateMeta(type="ipc")
        else:
            local = LocalEngineConfig(
                path=path,
                dtype=args.dtype,
                device=args.device,
                max_running_requests=2 * args.prompts * args.group,
                # Generation beside training (async) on its own share of the threads, if asked.
                num_threads=args.async_engine_threads if args.side in SPLIT else 0,
                cores=cores(args.engine_cores) if args.side == "async_pinned" else [],
            )
            rollout = RolloutController(LocalInferenceEngine(local), rollout_config)
            rollout.initialize()
            stack.callback(rollout.destroy)
            meta = WeightUpdateMeta(type="in_process")
        total = args.steps + args.warmup
        items = [{"prompt": p, "answer": ""} for p in prompts(args.prompts * total)]
        dataloader = rank_dataloader(items, DatasetConfig(batch_size=args.prompts, shuffle=False), engine, seed=0)
        engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=len(items), train_batch_size=args.prompts))
        engine.connect_engine(rollout.engine, meta)
        actor = PPOActor(cfg, engine)
        gconfig = GenerationConfig(n_samples=args.group, max_new_tokens=args.tokens, min_new_tokens=args.tokens)

        def reward(
            prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **kw: object
        ) -> float:
            return digit_share(completion)

        workflow = RLVRWorkflow(RewardRunner(reward, mode="inline"), gconfig, tokenizer, use_chat_template=False)
        times, tokens, train = [], [], []
        for step in range(total):
            t0 = time.perf_counter()
            batch = rollout.prepare_batch(dataloader, workflow=workflow)
            t1 = time.perf_counter()
            actor.compute_advantages(batch)
            actor.ppo_update(batch)
            sync_weights(rollout, engine, meta, version=step + 1)
            times.append(time.perf_counter() - t0)
            train.append(time.perf_counter() - t1)
            tokens.append(float(batch["loss_mask"].sum()))
    return times, tokens, train


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    train: list[float] = []
    if args.side == "trl":
        times, tokens = run_trl(args.model_dir, args)
    else:
        times, tokens, train = run_ours(args.model_dir, args, eta=0 if args.side == "sync" else 1)
    print("WORKER " + json.dumps({"times": times, "tokens": tokens, "train": train}))


def launch(side: str, threads: int, model: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """(median step seconds after warm-up, median tokens per step, median training seconds per
    step after warm-up, nan for TRL) of one configuration."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--threads", str(threads)]
    cmd += ["--model-dir", model, "--dtype", args.dtype, "--lora", str(args.lora)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--prompts", str(args.prompts)]
    cmd += ["--group", str(args.group), "--tokens", str(args.tokens)]
    cmd += [] if args.shared_prefix else ["--no-shared-prefix"]
    cmd += ["--async-engine-threads", str(args.async_engine_threads), "--device", args.device]
    cmd += ["--engine-cores", args.engine_cores]
    from areal_lite.launcher.commands import checkout_pythonpath

    path = checkout_pythonpath()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("WORKER ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{side} at {threads} thread(s) failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    data = json.loads(lines[-1].removeprefix("WORKER "))
    train = statistics.median(data["train"][args.warmup :]) if data["train"] else float("nan")
    return statistics.median(data["times"][args.warmup :]), statistics.median(data["tokens"]), train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all configurations")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads-list", default="1,2")
    parser.add_argument(
        "--model", default="20m", help="20m, smollm2, or a HF directory (random weights if it holds none)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both sides run")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on both sides (0: all parameters)")
    parser.add_argument(
        "--no-shared-prefix", dest="shared_prefix", action="store_false", help="our trainer without shared prefixes"
    )
    parser.add_argument(
        "--async-engine-threads",
        type=int,
        default=0,
        help="run the async_split side: the async loop with its engine on this many threads (0: not run)",
    )
    parser.add_argument(
        "--engine-cores",
        default="",
        help="run the async_pinned side: async_split with its engine pinned to these cores, e.g. 1 "
        "(local_engine.cores; empty: not run)",
    )
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.side = args.worker
        worker(args)
        return

    from areal_lite.cpu.precision import cpu_kind
    from areal_lite.utils.tiny import build_tiny_model, with_random_weights

    threads = [int(t) for t in args.threads_list.split(",")]
    best: dict[tuple[str, int], float] = {}
    tokens: dict[tuple[str, int], float] = {}
    train: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "smollm2":
            from areal_lite.utils.pretrained import smollm2_dir

            model = smollm2_dir()
        elif args.model == "20m":
            model = build_tiny_model(f"{tmp}/model", **MODEL)
        else:
            model = with_random_weights(args.model, f"{tmp}/model")

        def runs(side: str, t: int) -> bool:
            if side in SPLIT and not 0 < args.async_engine_threads < t:
                return False
            return side != "async_pinned" or bool(cores(args.engine_cores))

        configs = [(side, t) for t in threads for side in SIDES if runs(side, t)]
        for r in range(args.repeats):
            for side, t in configs if r % 2 == 0 else reversed(configs):
                seconds, n, train_s = launch(side, t, model, args)
                print(f"{side} at {t} thread(s): {seconds:.2f} s/step, {n:.0f} tokens/step", flush=True)
                if seconds < best.get((side, t), float("inf")):
                    best[side, t], train[side, t] = seconds, train_s
                tokens[side, t] = n
    name = {"20m": "20M Qwen2", "smollm2": "SmolLM2-135M-Instruct"}.get(args.model, args.model)
    mode = f"LoRA rank {args.lora}" if args.lora else "all parameters"
    if args.device == "cuda":
        import torch

        print(f"GPU: {torch.cuda.get_device_name()}; ", end="")
    print(f"CPU: {cpu_kind()}; load {os.getloadavg()[0]:.1f}")
    print(
        f"{args.prompts} prompts x {args.group} samples x {args.tokens} tokens per step, {name}, {args.dtype}, {mode}"
    )
    print(f"{'side':<13}{'threads':>8}{'s/step':>9}{'train s':>9}{'tokens/step':>13}{'tokens/s':>10}{'TRL / this':>12}")
    for side, t in configs:
        s = best[side, t]
        train_col = f"{train[side, t]:>9.2f}" if side != "trl" else f"{'':>9}"
        print(
            f"{side:<13}{t:>8}{s:>9.2f}{train_col}{tokens[side, t]:>13.0f}{tokens[side, t] / s:>10.0f}"
            f"{best['trl', t] / s:>12.2f}"
        )
    # The most any schedule could give: the synchronous step's training alone, as if generation
    # cost nothing (on this machine the two cores share one core's matmul throughput, FINDINGS).
    ceiling = {t: best["trl", t] / train["sync", t] for t in threads}
    print("TRL / our training alone (generation free): " + ", ".join(f"{c:.2f} at {t}" for t, c in ceiling.items()))
    trl_best = min(best["trl", t] for t in threads)
    # The most any schedule of this work could give on the most threads run: generation and
    # training each at its one-thread rate (the sync side's: generation is its step less its
    # training), every thread busy all step. Threads add less than their number to either (the
    # 2-thread update takes more than half the 1-thread one), so no schedule of the same kernels
    # gets below it: a ratio above this needs less work per step, not a better overlap.
    wide = max(threads)
    bound = best["sync", 1] / wide if 1 in threads and wide > 1 else None
    if bound is not None:
        print(
            f"every one of {wide} threads busy all step at one-thread rates (sync's {best['sync', 1]:.2f} s of "
            f"generation and training, / {wide}): {bound:.2f} s, TRL's best / that = {trl_best / bound:.2f}"
        )
    ours = [(side, t) for side, t in configs if side != "trl"]
    ours_best = min(best[c] for c in ours)
    result = [
        f"model={args.model}",
        f"device={args.device}",
        f"dtype={args.dtype}",
        f"lora={args.lora}",
        f"best_over_trl={trl_best / ours_best:.2f}",
    ]
    result += [f"{side}_over_trl_t{t}={best['trl', t] / best[side, t]:.2f}" for side, t in ours]
    result += [f"{side}_over_sync_t{t}={best['sync', t] / best[side, t]:.2f}" for side, t in ours if side != "sync"]
    result += [f"trl_over_train_only_t{t}={c:.2f}" for t, c in ceiling.items()]
    if bound is not None:
        result.append(f"trl_over_all_threads_busy={trl_best / bound:.2f}")
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
