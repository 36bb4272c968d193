"""The tinker-cookbook's own supervised and RL loops, unmodified, against this service, on a local
model and local data: ``python -m tinker_cookbook.recipes.sl_loop`` then ``recipes.rl_loop``.

What stands in for the hub (no change to the cookbook's code; docs/service.md explains each):

- the model: the cookbook picks a renderer by the model's hub name (``model_info``) and loads its
  tokenizer with ``AutoTokenizer.from_pretrained(name)``, which takes a local directory of that
  name first. A tiny model (ChatML tokenizer, byte-level BPE trained here) is written to
  ``<workdir>/Qwen/Qwen3-4B-Instruct-2507`` (a registry name whose renderer, ``qwen3_instruct``,
  is ChatML), the loops run from ``<workdir>``, and the service serves it under that name;
- the data: ``datasets.load_dataset("HuggingFaceH4/no_robots")`` and ``("openai/gsm8k", "main")``
  load local directories of those names (JSON lines; gsm8k's card names its ``main`` config);
- RL starts from the supervised result: rl_loop resumes from the last training state in its log
  directory's ``checkpoints.jsonl``; this script writes sl_loop's final state there (batch 0).

The task, in both loops' format: additions of digits 0-2 ("What is 1 + 2?") answered inside
``\\boxed{}`` after rl_loop's own few-shot turn (its reward parses the box and compares it with
gsm8k's ``#### 3``). sl_loop (20 steps) teaches the answer format and the answers' distribution;
a model this small does not yet tell the questions apart in that budget (about 1 right answer in 5
at temperature 1, the chance of answering by the distribution). rl_loop (its default loss,
``stable_reinforce``, on the sampler's recorded log-probabilities) then raises the reward by making
the format reliable and concentrating on the likelier answers (toward 1 in 3). Learning to add
takes a bigger model or many more steps; docs/service.md gives the measured run.

Usage: python examples/tinker/cookbook_loops.py --workdir DIR [--sl-steps 20] [--rl-steps 20]
Prints each loop's per-step metrics and ``RESULT sl_nll_first=... sl_nll_last=...
rl_reward_first3=... rl_reward_last5=...`` (means over the first 3 and the last 5 RL steps).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

from areal_lite.service.launch import local_service
from areal_lite.utils.tiny import build_tiny_model

MODEL_NAME = "Qwen/Qwen3-4B-Instruct-2507"
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
# rl_loop's own few-shot turn (its convo_prefix), which every RL prompt starts with.
PREFIX = [
    {"role": "user", "content": "How many r's are in strawberry?" + SUFFIX},
    {
        "role": "assistant",
        "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e 8) r "
        "9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
    },
]


def problems() -> list[tuple[str, int]]:
    return [(f"What is {a} + {b}?", a + b) for a in range(3) for b in range(3)]


def write_data(root: str, seed: int) -> None:
    """The two datasets, in the shapes the loops read, under the hub names they load."""
    rng = random.Random(seed)
    sl_dir = os.path.join(root, "HuggingFaceH4", "no_robots")
    os.makedirs(sl_dir, exist_ok=True)
    with open(os.path.join(sl_dir, "train.jsonl"), "w") as f:
        for _ in range(200):  # sl_loop needs max_steps * batch_size rows; repeats are fine
            for question, answer in rng.sample(problems(), len(problems())):
                messages = [*PREFIX, {"role": "user", "content": question + SUFFIX}]
                messages.append({"role": "assistant", "content": f"\\boxed{{{answer}}}"})
                f.write(json.dumps({"messages": messages}) + "\n")
    rl_dir = os.path.join(root, "openai", "gsm8k")
    os.makedirs(os.path.join(rl_dir, "main"), exist_ok=True)
    with open(os.path.join(rl_dir, "main", "train.jsonl"), "w") as f:
        for _ in range(200):
            for question, answer in rng.sample(problems(), len(problems())):
                f.write(json.dumps({"question": question, "answer": f"{question} #### {answer}"}) + "\n")
    with open(os.path.join(rl_dir, "README.md"), "w") as f:
        f.write(
            "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n"
        )


def write_model(root: str, seed: int) -> str:
    """A tiny Qwen2-style model whose tokenizer's merges were learned on the loops' text."""
    corpus = [m["content"] for m in PREFIX] + [q + SUFFIX + f" \\boxed{{{a}}}" for q, a in problems()]
    return build_tiny_model(
        os.path.join(root, *MODEL_NAME.split("/")),
        hidden_size=128,
        num_layers=2,
        vocab_size=800,
        max_position_embeddings=1024,
        corpus=corpus,
        seed=seed,
    )


def cookbook(module: str, root: str, url: str, **config: object) -> None:
    """``python -m tinker_cookbook.recipes.<module> key=value ...`` from ``root``, offline."""
    # A datasets cache of this run's own: offline, `datasets` answers a hub name from its cache
    # before looking at a local directory of that name (an earlier run's data would come back).
    env = {
        **os.environ,
        "TINKER_API_KEY": "tml-local",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": os.path.join(root, "datasets_cache"),
    }
    args = [f"{k}={v}" for k, v in {"base_url": url, "model_name": MODEL_NAME, **config}.items()]
    subprocess.run([sys.executable, "-m", f"tinker_cookbook.recipes.{module}", *args], cwd=root, env=env, check=True)


def metrics(log_path: str, key: str) -> list[float]:
    with open(os.path.join(log_path, "metrics.jsonl")) as f:
        return [row[key] for row in map(json.loads, f) if key in row]


def resume_from(sl_log: str, rl_log: str) -> None:
    """rl_loop's log directory, holding sl_loop's final training state as its last checkpoint."""
    with open(os.path.join(sl_log, "checkpoints.jsonl")) as f:
        final = [json.loads(line) for line in f][-1]
    os.makedirs(rl_log, exist_ok=True)
    with open(os.path.join(rl_log, "checkpoints.jsonl"), "w") as f:
        f.write(json.dumps({"name": "sft", "batch": 0, "state_path": final["state_path"]}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="model, data, service checkpoints and the loops' logs")
    parser.add_argument("--sl-steps", type=int, default=20)
    parser.add_argument("--rl-steps", type=int, default=20)
    parser.add_argument("--sl-lr", type=float, default=5e-3)
    parser.add_argument("--rl-lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = os.path.abspath(args.workdir)
    os.makedirs(root, exist_ok=True)
    model = write_model(root, args.seed)
    write_data(root, args.seed)
    sl_log, rl_log = os.path.join(root, "runs", "sl"), os.path.join(root, "runs", "rl")
    with local_service([f"{MODEL_NAME}={model}"], os.path.join(root, "service")) as url:
        cookbook(
            "sl_loop", root, url, log_path=sl_log, batch_size=32, learning_rate=args.sl_lr, lora_rank=16,
            max_steps=args.sl_steps, save_every=0, max_length=512, train_on_what="last_assistant_message",
        )  # fmt: skip
        resume_from(sl_log, rl_log)
        cookbook(
            "rl_loop", root, url, log_path=rl_log, batch_size=16, group_size=8, learning_rate=args.rl_lr, lora_rank=16,
            max_tokens=8, max_steps=args.rl_steps, save_every=0,
        )  # fmt: skip
    nll, reward = metrics(sl_log, "train_mean_nll"), metrics(rl_log, "reward/total")
    print(f"{'step':>4}  {'sl_loop train_mean_nll':>24}  {'rl_loop reward/total':>22}")
    for i in range(max(len(nll), len(reward))):
        a = f"{nll[i]:.3f}" if i < len(nll) else ""
        b = f"{reward[i]:.3f}" if i < len(reward) else ""
        print(f"{i:>4}  {a:>24}  {b:>22}")
    print(
        f"RESULT sl_nll_first={nll[0]:.3f} sl_nll_last={nll[-1]:.3f} "
        f"rl_reward_first3={sum(reward[:3]) / 3:.3f} rl_reward_last5={sum(reward[-5:]) / 5:.3f}"
    )


if __name__ == "__main__":
    main()
