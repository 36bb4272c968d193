"""The configuration of a whole run: the fields every experiment has (`BaseExperimentConfig`), an
RL run's sections (`RLExperimentConfig`), and where and how it runs (`ClusterConfig`,
`LauncherConfig`, `SlurmConfig`). Training scripts subclass the experiment configs with sections of
their own and build them with `areal_lite.api.config_loader.load_config`; the parts they gather
are in `areal_lite.api.config`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from areal_lite.api.bounds import at_least, more_than
from areal_lite.api.config import (
    READS_FILE,
    READS_MODEL,
    DatasetConfig,
    EvaluatorConfig,
    InferenceEngineConfig,
    LocalEngineConfig,
    PPOActorConfig,
    RecoverConfig,
    SaverConfig,
    StatsLoggerConfig,
    one_of,
)
from areal_lite.api.io import GenerationConfig


@dataclass
class ClusterConfig:
    """Where runs write their outputs."""

    fileroot: str = "outputs"
    """Root directory of all experiments."""


@dataclass
class SlurmConfig:
    """The Slurm job that `areal_lite.launcher.slurm` writes and submits."""

    partition: str = ""
    """Partition (``--partition``); empty = the cluster's default."""
    account: str = ""
    """Account (``--account``); empty = none."""
    time: str = "24:00:00"
    """Wall-clock limit (``--time``)."""
    cpus_per_task: int = field(default=8, metadata=at_least(1))
    """CPUs for each server and each trainer node."""
    extra_sbatch: list[str] = field(default_factory=list)
    """More ``#SBATCH`` options, e.g. ``--qos=high``."""
    colocate_servers: bool = False
    """Run the rollout servers on the first trainer node instead of nodes of their own (a one-node
    job; small servers on CPU). With GPUs the servers take that node's first
    ``n_servers * server_tp_size`` GPUs and the trainer the next ``trainer_nproc``."""


@dataclass
class LauncherConfig:
    """How the launchers (`areal_lite.launcher.local`, `.ray`, `.slurm`) start servers and trainers."""

    backend: str = field(default="local", metadata=one_of("local", "areal", "sglang", "vllm"))
    """Rollout backend: local (embedded in the trainer), areal (our server), sglang or vllm
    (vLLM's OpenAI server with our weight-update worker extension; on CPU too)."""
    n_servers: int = field(default=1, metadata=at_least(1))
    """Rollout servers to start (areal, sglang, vllm)."""
    trainer_nproc: int = field(default=1, metadata=at_least(1))
    """Trainer processes per node (torchrun --nproc-per-node)."""
    server_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for each server. Our server (``areal``) also gets the config's
    ``local_engine`` settings (dtype, device, max_running_requests, max_total_tokens, seed) as
    flags; these arguments come after them and win."""
    server_cores: list[int] = field(default_factory=list)
    """CPU cores to pin the servers to (empty = no pinning)."""
    trainer_cores: list[int] = field(default_factory=list)
    """CPU cores to pin the trainer to (empty = no pinning)."""
    server_model_path: str = field(default="", metadata=READS_MODEL)
    """HF model directory the servers load; empty = the config's ``actor.path``."""
    server_host: str = "127.0.0.1"
    """Address the servers bind to and the trainer connects to."""
    server_tp_size: int = field(default=1, metadata=at_least(1))
    """GPUs per server (SGLang ``--tp-size``, vLLM ``--tensor-parallel-size``); servers take
    consecutive GPUs from 0."""
    server_startup_timeout: float = field(default=300.0, metadata=more_than(0.0))
    """Seconds to wait for every server to answer ``GET /health`` with 200."""
    vllm_python: str = ""
    """The Python that runs the vLLM servers (vLLM pins its own torch: it lives in a venv of its
    own). Empty: ``$AREAL_LITE_VLLM_PYTHON``, else the checkout's ``.venv-vllm`` that ``make
    install-vllm`` builds, when present, else the launcher's own Python."""
    vllm_cpu_kvcache_gib: int = field(default=1, metadata=at_least(1))
    """GiB of KV cache per vLLM server on a machine without GPUs (``VLLM_CPU_KVCACHE_SPACE``)."""
    trainer_nnodes: int = field(default=1, metadata=at_least(1))
    """Trainer nodes (ray, slurm); each runs ``trainer_nproc`` processes."""
    gpus_per_node: int = field(default=0, metadata=at_least(0))
    """GPUs per trainer node (ray, slurm; 0 on CPU)."""
    prepare_overrides: list[str] = field(default_factory=list)
    """When set, the script first runs once with these overrides appended (e.g. a flag that makes it
    build the model the servers load, then exit), before any server starts; empty = no such run."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """The Slurm job (launcher.slurm only)."""


@dataclass
class BaseExperimentConfig:
    """Fields every experiment has. Scripts subclass this with their own sections."""

    experiment_name: str = "areal-lite"
    """Name of the experiment (a directory under ``cluster.fileroot``)."""
    trial_name: str = "trial0"
    """Name of this trial (a directory under the experiment)."""
    seed: int = 1
    """Global seed."""
    total_train_epochs: int = field(default=1, metadata=at_least(1))
    """Passes over the training set."""
    total_train_steps: int | None = field(default=None, metadata=at_least(1))
    """Stop after this many steps (None = the epochs decide)."""
    profile: str = field(default="", metadata=one_of("", "cpu"))
    """A named set of overrides applied over the config file and under the command line
    (`areal_lite.api.config_loader.PROFILES`): ``cpu`` runs a GPU recipe on a machine without one.
    Keys a script's config lacks are skipped."""
    tokenizer_path: str = field(default="", metadata=READS_MODEL)
    """Tokenizer directory (defaults to the actor's model path)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    valid_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    saver: SaverConfig = field(default_factory=SaverConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    recover: RecoverConfig = field(default_factory=RecoverConfig)
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)

    @property
    def output_dir(self) -> str:
        """``fileroot/experiment_name/trial_name``: where this run writes everything."""
        return os.path.join(self.cluster.fileroot, self.experiment_name, self.trial_name)


@dataclass
class RLExperimentConfig(BaseExperimentConfig):
    """An RL run: the policy, its rollouts, and how weights reach them. RL scripts subclass this
    with their own sections (a task, a critic)."""

    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    local_engine: LocalEngineConfig = field(default_factory=LocalEngineConfig)
    """The embedded engine (``launcher.backend=local``; our server, ``areal``, takes its settings too)."""
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    weight_update: str = field(default="disk", metadata=one_of("disk", "distributed", "ipc"))
    """How weights reach rollout servers: disk (safetensors files every server loads; works
    everywhere, and a server that comes back after a failure reloads them), distributed (a
    broadcast from trainer rank 0: NCCL on GPU, gloo on CPU), or ipc (servers on the trainer's
    machine map its memory: shared memory on CPU, CUDA IPC handles on a GPU; no file, no process
    group). The embedded engine takes them in process whatever this says."""
    record_batches: str = ""
    """Directory where the run's rollout controller records every batch it hands out (training
    batches with their token versions and the policy version they were consumed at, and
    evaluation batches), one file per batch under ``rank<r>/``; empty = no recording."""
    replay_batches: str = field(default="", metadata=READS_FILE)
    """Directory of such a recording to train from instead of generating: the controller hands out
    the recorded batches in order and generates nothing, so the same config and seed reproduce
    the recorded run's parameters bit for bit. Use ``launcher.backend=local`` (no servers)."""
