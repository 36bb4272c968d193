"""Asynchronous vs synchronous RL on the quickstart workload: training steps per minute.

The rollout server is pinned to its own core (launcher.server_cores); the trainer is not pinned,
because its process also runs the rollout client (HTTP, workflows, rewards) in threads: pinning the
whole process to one core made those threads steal the training thread's core (measured: train time
0.63 s -> 0.86 s per step with eta = 2), while unpinned they use the server's core in its idle gaps.
With eta = 0 (synchronous RL) each step waits for its own rollouts; with eta = 2 the server
generates the next batches while the trainer trains on this one. Both runs start from the same SFT
checkpoint (made once, first) and run the same number of RL steps; only the RL loop is timed (the
quickstart prints it).

    python benchmarks/async_vs_sync.py [--steps 30]

Two balanced stages can overlap at most 2x. The quickstart's stages are not balanced (rollout about
0.27 s, training about 0.63 s per step here), which caps its gain near (0.27 + 0.63) / 0.63 = 1.4.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_quickstart(fileroot: str, trial: str, overrides: list[str]) -> str:
    cmd = [
        sys.executable, "-m", "areal_lite.launcher.local", "examples/quickstart.py",
        "--config", "configs/quickstart.yaml",
        f"cluster.fileroot={fileroot}", f"trial_name={trial}", "recover.mode=disabled", "recover.retries=0",
        "stats_logger.tensorboard=false", *overrides,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"quickstart run {trial} failed with exit code {out.returncode}")
    return out.stdout


def rl_steps_per_minute(log: str) -> float:
    m = re.search(r"\[quickstart\] RL: (\d+) steps in ([\d.]+)s", log)
    if not m:
        raise SystemExit("the quickstart did not report its RL timing")
    return int(m.group(1)) / float(m.group(2)) * 60


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30, help="RL steps per run")
    parser.add_argument("--keep", action="store_true", help="keep the output directory")
    args = parser.parse_args()
    n_cores = os.cpu_count() or 1
    pin = ["launcher.server_cores=[1]"] if n_cores >= 2 else []
    fileroot = tempfile.mkdtemp(prefix="areal_async_")
    try:
        # One SFT warm-up shared by both runs (the quickstart skips SFT when sft_model exists).
        run_quickstart(fileroot, "sft", ["launcher.backend=local", "task.prepare_only=true"])
        rates = {}
        for eta in (0, 2):
            trial = f"eta{eta}"
            shutil.copytree(os.path.join(fileroot, "quickstart", "sft", "sft_model"), os.path.join(fileroot, "quickstart", trial, "sft_model"))
            log = run_quickstart(
                fileroot, trial, [f"total_train_steps={args.steps}", f"rollout.max_head_offpolicyness={eta}", "task.n_eval=8", *pin]
            )
            rates[eta] = rl_steps_per_minute(log)
    finally:
        if not args.keep:
            shutil.rmtree(fileroot, ignore_errors=True)
    print(f"quickstart RL loop, {args.steps} steps, rollout server pinned to its own core: {bool(pin)}")
    print(f"{'mode':<22}{'steps/min':>10}")
    print(f"{'synchronous (eta=0)':<22}{rates[0]:>10.1f}")
    print(f"{'asynchronous (eta=2)':<22}{rates[2]:>10.1f}")
    print(f"RESULT async_over_sync={rates[2] / rates[0]:.2f} sync_steps_per_min={rates[0]:.1f} async_steps_per_min={rates[2]:.1f}")


if __name__ == "__main__":
    main()
