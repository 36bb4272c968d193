"""Run a training script on a Ray cluster: the same servers, trainer and restarts as `launcher.local`.

    RAY_ADDRESS=HEAD:6379 python -m areal_lite.launcher.ray SCRIPT --config CONFIG [key=value ...]

The driver (this process) connects to the cluster at ``RAY_ADDRESS`` (none: a throwaway one-node
cluster) and places the run with one placement group, `SPREAD` over the nodes: ``trainer_nnodes``
trainer bundles (``trainer_nproc`` CPUs and ``gpus_per_node`` GPUs each: a whole node's GPUs, so
one node each) and then one bundle per rollout server (``server_tp_size`` GPUs, else 1 CPU).

- Each server is an actor (`ServerProcess`, named ``<experiment>/<trial>/server<i>`` in the
  ``areal_lite`` namespace) that starts the server process on its node, listening on all
  interfaces, and dies with it: killing the actor kills the server;
- each trainer attempt runs one torchrun per trainer bundle as a Ray task, all meeting at the first
  bundle's node.

Failures are the driver's to handle, as in `launcher.local`: Ray never retries a trainer task or
restarts a server actor itself. A trainer node that exits non-zero, or whose worker dies, fails the
attempt: the other nodes are cancelled and the trainer starts again, up to ``recover.retries``
times, with ``AREAL_LITE_ATTEMPT`` set (with ``recover.mode=auto`` the script resumes from its last
recover checkpoint). An error a restart would meet again (`areal_lite.api.errors.RecurringError`)
is not retried: each trainer task points the trainer's ``AREAL_LITE_STOP_FILE`` at a file of its
own node and returns its line with torchrun's exit code, and the driver ends with that line, as
`launcher.local` does. A server that dies is reported and the trainer carries on with the others; the
run fails once none is left. SIGINT and SIGTERM stop the trainer (its torchrun gets SIGTERM) and
everything else; the exit code is then 128 + the signal.

The nodes share the file system with the driver (recover checkpoints, the servers' model and, with
``weight_update=disk``, each new version's weights pass through it): every process runs in the
driver's working directory with the driver's Python and the driver's ``PYTHONPATH``,
``OMP_NUM_THREADS`` and ``AREAL_LITE_*``, ``HF_*``, ``WANDB_*`` variables. Each trainer node's
output goes to ``logs/trainer<rank>.log`` and to the driver's console, each server's to
``logs/server<i>.log``; ``logs/servers.json`` lists the servers. Ray is an optional dependency
(``pip install areal-lite[ray]``), imported only when a run starts. The config is checked first as
by `launcher.local`, except its paths, which are the nodes' to see.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from types import FrameType
from typing import TYPE_CHECKING

from areal_lite.api.errors import STOP_FILE_ENV, read_stop_file
from areal_lite.launcher.cli import argument_parser, launcher_main
from areal_lite.launcher.commands import server_command, torchrun_command
from areal_lite.launcher.local import LocalLauncher
from areal_lite.launcher.plan import LaunchPlan
from areal_lite.launcher.preflight import check_config
from areal_lite.launcher.processes import is_healthy, spawn, stop
from areal_lite.utils.distributed import find_free_port
from areal_lite.utils.recover import ATTEMPT_ENV

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

logger = logging.getLogger("areal_lite.launcher")

NAMESPACE = "areal_lite"
"""Ray namespace of the server actors (tests and users find them there by name)."""
FORWARDED_ENV = ("PYTHONPATH", "OMP_NUM_THREADS")
FORWARDED_ENV_PREFIXES = ("AREAL_LITE_", "HF_", "WANDB_")
PLACEMENT_TIMEOUT_S = 120.0
"""How long to wait for the cluster to have room for a placement group."""


def server_bundles(plan: LaunchPlan) -> list[dict[str, int]]:
    """Placement-group bundles of the servers: one each, ``server_tp_size`` GPUs (or 1 CPU)."""
    cfg = plan.launcher
    bundle = {"GPU": cfg.server_tp_size, "CPU": 1} if cfg.gpus_per_node > 0 else {"CPU": 1}
    return [dict(bundle) for _ in range(cfg.n_servers)]


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
            plan,
            addresses,
            master_addr=master_addr,
            master_port=master_port,
            nnodes=nnodes,
            node_rank=rank,
            prepare=prepare,
        )
        for rank in range(nnodes)
    ]


def forwarded_env(environ: dict[str, str]) -> dict[str, str]:
    """The driver's variables that the cluster's processes get too."""
    return {k: v for k, v in environ.items() if k in FORWARDED_ENV or k.startswith(FORWARDED_ENV_PREFIXES)}


def server_actor_name(plan: LaunchPlan, index: int) -> str:
    return f"{os.path.basename(os.path.dirname(plan.output_dir))}/{os.path.basename(plan.output_dir)}/server{index}"


class ServerProcess:
    """Body of a server actor: starts the server on the actor's node, in the driver's directory.

    The server dies with the actor (``PR_SET_PDEATHSIG``), so ``ray.kill`` of the actor, or the
    actor's node going away, takes the server down and the driver sees the actor gone."""

    def __init__(self, plan: LaunchPlan, index: int, cwd: str) -> None:
        import ray

        os.chdir(cwd)
        os.makedirs(plan.log_dir, exist_ok=True)
        self.ip = ray.util.get_node_ip_address()
        self.node = ray.get_runtime_context().get_node_id()
        self.port = find_free_port("0.0.0.0")
        # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPUs, so they start at 0.
        cmd = server_command(plan, self.port, host="0.0.0.0")
        self.proc = spawn(
            cmd,
            cores=plan.launcher.server_cores,
            env={**os.environ},
            log_path=os.path.join(plan.log_dir, f"server{index}.log"),
        )

    def info(self) -> dict[str, object]:
        return {"address": f"{self.ip}:{self.port}", "pid": self.proc.pid, "actor_pid": os.getpid(), "node": self.node}

    def exit_code(self) -> int | None:
        """None while the server runs."""
        return self.proc.poll()

    def stop(self) -> None:
        stop([self.proc])


def run_trainer_node(cmd: list[str], attempt: int, cwd: str, log_path: str, cores: list[int]) -> tuple[int, str | None]:
    """Body of a trainer task: torchrun on this node; its output to ``log_path`` and to the driver.
    Returns torchrun's exit code and the line of the error a restart would meet again, if one
    stopped the trainer: the ranks write it to a file of this node, which the driver may not see."""
    os.chdir(cwd)
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    with tempfile.TemporaryDirectory(prefix="areal_lite_trainer_") as tmp:
        stop_file = os.path.join(tmp, "recurring_error")
        env = {**os.environ, ATTEMPT_ENV: str(attempt), STOP_FILE_ENV: stop_file}
        proc = spawn(cmd, cores=cores, env=env, log_path=log_path)
        try:
            rc = _follow(proc, log_path, start)
        finally:
            # Cancelled (KeyboardInterrupt) or done: torchrun stops its workers on SIGTERM.
            stop([proc])
        return rc, read_stop_file(stop_file)


def _follow(proc: subprocess.Popen, log_path: str, start: int) -> int:
    """Copy ``log_path`` from ``start`` to stdout (Ray forwards it to the driver) until ``proc`` exits."""
    with open(log_path, "rb") as log:
        log.seek(start)
        while True:
            rc = proc.poll()
            sys.stdout.write(log.read().decode(errors="replace"))
            sys.stdout.flush()
            if rc is not None:
                return rc
            time.sleep(0.5)


def _node_ip_and_port() -> tuple[str, int, str]:
    import ray

    return ray.util.get_node_ip_address(), find_free_port("0.0.0.0"), ray.get_runtime_context().get_node_id()


class RayLauncher(LocalLauncher):
    """`LocalLauncher`'s run (prepare run, servers, trainer attempts, teardown) with servers as Ray
    actors and trainer nodes as Ray tasks in placement groups."""

    def __init__(self, plan: LaunchPlan) -> None:
        super().__init__(plan)
        self.cwd = os.getcwd()
        self.actors: list[ActorHandle] = []
        self.trainer_refs: list[ObjectRef] = []
        self.group: PlacementGroup | None = None
        self.n_trainer_bundles = len(trainer_bundles(plan))
        self.recurring: str | None = None
        """The line a trainer node returned for the last attempt (see `run_trainer_node`)."""

    def run(self) -> int:
        import ray

        ray.init(
            address=os.environ.get("RAY_ADDRESS"),
            namespace=NAMESPACE,
            runtime_env={"env_vars": forwarded_env(dict(os.environ))},
        )
        try:
            self.group = self._placement_group([*trainer_bundles(self.plan), *server_bundles(self.plan)])
            return super().run()
        finally:
            ray.shutdown()

    def _placement_group(self, bundles: list[dict[str, int]]) -> PlacementGroup:
        import ray
        from ray.util.placement_group import placement_group

        group = placement_group(bundles, strategy="SPREAD", name=self.plan.output_dir)
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"the Ray cluster has no room for the run (SPREAD {bundles}) after "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; its resources: {ray.cluster_resources()}"
            )
        return group

    def _on_bundle(self, index: int) -> object:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=index)

    def recurring_error(self) -> str | None:
        return self.recurring

    def check_server_model(self) -> None:
        """The servers' model is for their nodes to find (the server reports a missing one)."""

    def start_servers(self) -> None:
        import ray

        bundles = server_bundles(self.plan)
        actor = ray.remote(ServerProcess)
        for i, bundle in enumerate(bundles):
            options = {
                "num_cpus": bundle["CPU"],
                "num_gpus": bundle.get("GPU", 0),
                "max_restarts": 0,
                "name": server_actor_name(self.plan, i),
                "scheduling_strategy": self._on_bundle(self.n_trainer_bundles + i),
            }
            self.actors.append(actor.options(**options).remote(self.plan, i, self.cwd))
        servers = ray.get([a.info.remote() for a in self.actors])
        self.addresses = [s["address"] for s in servers]
        self.wait_healthy()
        os.makedirs(self.plan.log_dir, exist_ok=True)
        names = [server_actor_name(self.plan, i) for i in range(len(servers))]
        with open(os.path.join(self.plan.log_dir, "servers.json"), "w") as f:
            json.dump([{**s, "actor": n, "namespace": NAMESPACE} for s, n in zip(servers, names)], f)
        logger.info("servers ready: %s", ", ".join(self.addresses))

    def wait_healthy(self) -> None:
        import ray

        deadline = time.monotonic() + self.plan.launcher.server_startup_timeout
        while not all(is_healthy(a) for a in self.addresses):
            if self.received_signal is not None:
                raise SystemExit(128 + self.received_signal)
            codes = ray.get([a.exit_code.remote() for a in self.actors])
            if any(rc is not None for rc in codes):
                raise RuntimeError(
                    f"a server exited before becoming healthy (exit codes {codes}); see {self.plan.log_dir}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"servers {self.addresses} not healthy after {self.plan.launcher.server_startup_timeout} s"
                )
            time.sleep(0.5)

    def _servers_left(self) -> bool:
        import ray

        for i, actor in enumerate(self.actors):
            if i in self._reported_dead:
                continue
            try:
                rc = ray.get(actor.exit_code.remote(), timeout=30)
                why = None if rc is None else f"exited with {rc}"
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                why = f"its actor is gone ({type(e).__name__})"
            if why is not None:
                self._reported_dead.add(i)
                logger.warning("server %d (%s) %s; continuing with the others", i, self.addresses[i], why)
        return len(self._reported_dead) < len(self.actors) or not self.actors

    def run_trainer(self, attempt: int, prepare: bool = False) -> int:
        import ray

        bundles = trainer_bundles(self.plan)
        locate = ray.remote(num_cpus=0)(_node_ip_and_port).options(scheduling_strategy=self._on_bundle(0))
        master_addr, master_port, node = ray.get(locate.remote())
        cmds = trainer_node_commands(
            self.plan, self.addresses, master_addr=master_addr, master_port=master_port, prepare=prepare
        )
        logger.info("%s on node %s: %s", "prepare" if prepare else f"attempt {attempt}", node, " ".join(cmds[0]))
        task = ray.remote(run_trainer_node)
        self.trainer_refs = [
            task.options(num_cpus=b["CPU"], num_gpus=b.get("GPU", 0), max_retries=0,
                         scheduling_strategy=self._on_bundle(rank)).remote(
                cmd, attempt, self.cwd, os.path.join(self.plan.log_dir, f"trainer{rank}.log"), self.plan.launcher.trainer_cores)
            for rank, (cmd, b) in enumerate(zip(cmds, bundles))
        ]  # fmt: skip
        rc = 0
        self.recurring = None
        pending = list(self.trainer_refs)
        while pending:
            if self.received_signal is not None:
                rc = 128 + self.received_signal
                break
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            results = [self._result(ref) for ref in done]
            self.recurring = self.recurring or next((line for _, line in results if line), None)
            failed = [code for code, _ in results if code != 0]
            if failed:
                rc = failed[0]  # one node failed: the others would wait forever in the next collective
                break
            if pending and not self._servers_left():
                logger.error("every rollout server has exited; stopping the trainer")
                rc = 1
                break
        self._cancel_trainer()
        self._servers_left()  # report a server that died since the last check, too
        return rc

    def _result(self, ref: ObjectRef) -> tuple[int, str | None]:
        """A finished trainer task's exit code and recurring error (see `run_trainer_node`)."""
        import ray

        try:
            rc, recurring = ray.get(ref)
            return int(rc), recurring
        except ray.exceptions.RayError as e:
            logger.warning("a trainer node failed: %s", " ".join(str(e).split())[:300])
            return 1, None

    def _cancel_trainer(self) -> None:
        import ray

        # Only tasks still running: cancelling a finished one trips an internal check of Ray 2.60.
        _, running = ray.wait(self.trainer_refs, num_returns=len(self.trainer_refs), timeout=0)
        for ref in running:
            ray.cancel(ref)  # KeyboardInterrupt in the task, which stops its torchrun
        if running:
            _, running = ray.wait(running, num_returns=len(running), timeout=30)
        for ref in running:
            ray.cancel(ref, force=True)
        self.trainer_refs = []

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self.received_signal = signum  # run_trainer's loop stops the trainer

    def teardown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.trainer_refs:
            self._cancel_trainer()
        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except ray.exceptions.RayError:
                pass  # gone already
            ray.kill(actor)
        if self.group is not None:
            remove_placement_group(self.group)
        self.actors, self.group = [], None


def main(argv: list[str] | None = None) -> int:
    def launch(plan: LaunchPlan, _: object) -> int:
        check_config(plan, paths=False)  # paths are those of the cluster's nodes, not of this one
        return RayLauncher(plan).run()

    return launcher_main(argument_parser(__doc__), launch, argv)


if __name__ == "__main__":
    sys.exit(main())
