"""Rollout throughput of the WorkflowExecutor against our SGLang-protocol servers.

Part 1: trajectories/s of `prepare_batch` (RLVR groups, 4 samples per prompt, 32 new tokens each,
eos ignored so every trajectory has the same length) against 1 and 2 servers
(``python -m areal_lite.engines.server``, one process each, OMP_NUM_THREADS=1), with no training
in between (eta = 4, so admission never waits on the trainer).

Part 2: one server, a simulated training step between batches: the trainer sleeps for about the
time one batch takes to roll out (as a GPU trainer would leave the rollout machine's CPU alone),
then sets the next version. With eta = 0 rollout stops while the trainer "trains"; with eta = 2
the executor keeps generating the next batches, so wall-clock throughput should approach the
rollout-only rate. Reports trajectories/s and the mean staleness of consumed trajectories.

On a shared 2-core machine two servers compete for the same cores as the client; the 1 -> 2
server figure measures the client's fan-out overhead there more than scaling.

    .venv/bin/python benchmarks/rollout.py [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.io import GenerationConfig
from areal_lite.core import RolloutController
from areal_lite.engines.remote.sglang import RemoteSGLangEngine
from areal_lite.rewards import RewardRunner, boxed_format_reward
from areal_lite.utils.distributed import find_free_port
from areal_lite.utils.tiny import build_tiny_model
from areal_lite.workflows import RLVRWorkflow

PROMPTS_PER_BATCH = 4
SAMPLES = 4
NEW_TOKENS = 32


def start_servers(path: str, n: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addresses = [], []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for _ in range(n):
        port = find_free_port()
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "areal_lite.engines.server", "--model-path", path, "--port", str(port)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        addresses.append(f"127.0.0.1:{port}")
    return procs, addresses


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(
    addresses: list[str], tokenizer: object, eta: int, steps: int, train_seconds: float
) -> tuple[float, float, float]:
    """Returns (trajectories/s, seconds per step, mean staleness) over ``steps`` after a warm-up step."""
    cfg = InferenceEngineConfig(
        addresses=addresses,
        consumer_batch_size=PROMPTS_PER_BATCH,
        max_head_offpolicyness=eta,
        max_concurrent_rollouts=4 * PROMPTS_PER_BATCH,
        setup_timeout=300.0,
    )
    rollout = RolloutController(RemoteSGLangEngine(cfg), cfg)
    rollout.initialize()
    rollout.set_version(0)  # the servers outlive the engine between runs
    gconfig = GenerationConfig(n_samples=SAMPLES, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    workflow = RLVRWorkflow(RewardRunner(boxed_format_reward, mode="thread"), gconfig, tokenizer)
    data = [
        [{"prompt": f"What is {i} + {j}?", "answer": str(i + j)} for j in range(PROMPTS_PER_BATCH)] for i in range(50)
    ]
    try:
        n_traj, staleness = 0, []
        t0 = 0.0
        for step in range(steps + 1):
            if step == 1:  # step 0 warms up connections and the servers' first forward passes
                t0 = time.perf_counter()
            batch = rollout.prepare_batch(data, workflow)
            if step >= 1:
                n_traj += batch.batch_size[0]
                staleness += rollout.last_batch_staleness
            if train_seconds:
                time.sleep(train_seconds)
            rollout.pause()  # the weight update would happen here
            rollout.set_version(step + 1)
            rollout.resume()
        seconds = time.perf_counter() - t0
        return n_traj / seconds, seconds / steps, sum(staleness) / len(staleness)
    finally:
        rollout.destroy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(os.path.join(tmp, "tiny"), hidden_size=64, num_layers=2)
        tokenizer = AutoTokenizer.from_pretrained(path)
        procs, addresses = start_servers(path, 2)
        try:
            rows = []
            one, _, _ = run(addresses[:1], tokenizer, eta=4, steps=args.steps, train_seconds=0.0)
            rows.append(("1 server, no training", 4, one, 0.0))
            two, _, _ = run(addresses, tokenizer, eta=4, steps=args.steps, train_seconds=0.0)
            rows.append(("2 servers, no training", 4, two, 0.0))
            _, step_s, _ = run(addresses[:1], tokenizer, eta=0, steps=5, train_seconds=0.0)
            train_s = step_s
            sync, _, sync_stale = run(addresses[:1], tokenizer, eta=0, steps=args.steps, train_seconds=train_s)
            rows.append((f"1 server, train {train_s:.2f}s", 0, sync, sync_stale))
            asyn, _, asyn_stale = run(addresses[:1], tokenizer, eta=2, steps=args.steps, train_seconds=train_s)
            rows.append((f"1 server, train {train_s:.2f}s", 2, asyn, asyn_stale))
        finally:
            stop(procs)

    print(f"{'setting':<28} {'eta':>4} {'traj/s':>8} {'staleness':>10}")
    for name, eta, tps, stale in rows:
        print(f"{name:<28} {eta:>4} {tps:>8.1f} {stale:>10.2f}")
    print(
        f"RESULT traj_per_s_1server={one:.1f} traj_per_s_2servers={two:.1f} "
        f"traj_per_s_eta0_train={sync:.1f} traj_per_s_eta2_train={asyn:.1f} "
        f"eta2_speedup={asyn / sync:.2f} staleness_eta2={asyn_stale:.2f}"
    )


if __name__ == "__main__":
    main()
