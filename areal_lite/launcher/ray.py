"""Run a training script on a Ray cluster: the same servers and trainer as `launcher.local`.

    python -m areal_lite.launcher.ray SCRIPT --config CONFIG [key=value ...]

Each rollout server is a Ray actor holding ``server_tp_size`` GPUs (Ray sets its
``CUDA_VISIBLE_DEVICES``) that starts the server process on its node and reports ``ip:port``;
the driver waits until every server answers ``GET /health``. The trainer takes a placement group
of ``trainer_nnodes`` bundles (one per node, spread over distinct nodes) and runs one torchrun per
bundle as a Ray task, restarted up to ``recover.retries`` times like the local launcher. Ray is an
optional dependency (``pip install areal-lite[ray]``); it is imported only when a run starts. The
config is checked first as by `launcher.local` (not its paths, which are the nodes' to see).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from areal_lite.launcher.local import (
    ATTEMPT_ENV,
    LaunchPlan,
    check_config,
    is_healthy,
    read_plan,
    run_reporting_config_errors,
    server_command,
    torchrun_command,
)
from areal_lite.utils.distributed import find_free_port


def server_resources(plan: LaunchPlan) -> dict[str, int]:
    """Ray resources of one server actor."""
    gpus = plan.launcher.server_tp_size if plan.launcher.gpus_per_node > 0 else 0
    return {"num_gpus": gpus, "num_cpus": 1}


def trainer_bundles(plan: LaunchPlan) -> list[dict[str, int]]:
    """Placement-group bundles of the trainer: one per node, ``trainer_nproc`` CPUs and the node's GPUs."""
    bundle = {"CPU": plan.launcher.trainer_nproc}
    if plan.launcher.gpus_per_node > 0:
        bundle = {"GPU": plan.launcher.gpus_per_node, **bundle}
    return [dict(bundle) for _ in range(plan.launcher.trainer_nnodes)]


def trainer_node_commands(
    plan: LaunchPlan, addresses: list[str], *, master_addr: str, master_port: int, prepare: bool = False
) -> list[list[str]]:
    """One torchrun command per trainer node, all meeting at ``master_addr:master_port``."""
    nnodes = plan.launcher.trainer_nnodes
    return [
        torchrun_command(
            plan, addresses, master_addr=master_addr, master_port=master_port, nnodes=nnodes, node_rank=rank, prepare=prepare
        )
        for rank in range(nnodes)
    ]


class ServerProcess:
    """Body of the server actor: starts the server on the actor's node and watches it."""

    def __init__(self, plan: LaunchPlan) -> None:
        import ray

        self.ip = ray.util.get_node_ip_address()
        self.port = find_free_port("0.0.0.0")
        # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPUs, so they start at 0.
        self.proc = subprocess.Popen(server_command(plan, self.port, host="0.0.0.0"), start_new_session=True)

    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _node_ip_and_port() -> tuple[str, int]:
    import ray

    return ray.util.get_node_ip_address(), find_free_port("0.0.0.0")


def _run(cmd: list[str], attempt: int) -> int:
    return subprocess.run(cmd, env={**os.environ, ATTEMPT_ENV: str(attempt)}, check=False).returncode


def run(plan: LaunchPlan) -> int:
    """Run ``plan`` on the Ray cluster at ``RAY_ADDRESS`` (or a local one); returns the exit code."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(address=os.environ.get("RAY_ADDRESS"))
    cfg = plan.launcher
    servers = []
    bundles = trainer_bundles(plan)
    pg = placement_group(bundles, strategy="STRICT_SPREAD" if len(bundles) > 1 else "PACK")
    try:
        ray.get(pg.ready())
        on_bundle = [PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i) for i in range(len(bundles))]
        master_addr, master_port = ray.get(ray.remote(num_cpus=0)(_node_ip_and_port).options(scheduling_strategy=on_bundle[0]).remote())

        def run_trainer(addresses: list[str], attempt: int, prepare: bool = False) -> int:
            cmds = trainer_node_commands(plan, addresses, master_addr=master_addr, master_port=master_port, prepare=prepare)
            task = ray.remote(_run)
            pending = [
                task.options(num_cpus=b["CPU"], num_gpus=b.get("GPU", 0), scheduling_strategy=s).remote(cmd, attempt)
                for cmd, b, s in zip(cmds, bundles, on_bundle)
            ]
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                rc = ray.get(done[0])
                if rc != 0:
                    # One node failed: the others would wait forever in the next collective.
                    for ref in pending:
                        ray.cancel(ref, force=True)
                    return rc
            return 0

        if cfg.prepare_overrides:
            rc = run_trainer([], 0, prepare=True)
            if rc != 0:
                return rc
        addresses: list[str] = []
        if cfg.backend != "local":
            actor = ray.remote(**server_resources(plan))(ServerProcess)
            servers = [actor.remote(plan) for _ in range(cfg.n_servers)]
            addresses = ray.get([s.address.remote() for s in servers])
            deadline = time.monotonic() + cfg.server_startup_timeout
            while not all(is_healthy(a) for a in addresses):
                if time.monotonic() > deadline or not all(ray.get([s.alive.remote() for s in servers])):
                    raise RuntimeError(f"rollout servers {addresses} did not become healthy")
                time.sleep(1.0)
        rc = 1
        for attempt in range(plan.recover.retries + 1):
            rc = run_trainer(addresses, attempt)
            if rc == 0:
                break
        return rc
    finally:
        for s in servers:
            ray.get(s.stop.remote())
        remove_placement_group(pg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a training script on a Ray cluster.")
    parser.add_argument("script")
    parser.add_argument("--config", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)

    def launch() -> int:
        plan = read_plan(args.script, args.config, args.overrides)
        check_config(plan, paths=False)  # paths are those of the cluster's nodes, not of this one
        return run(plan)

    return run_reporting_config_errors(launch)


if __name__ == "__main__":
    sys.exit(main())
