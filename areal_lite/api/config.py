"""The configuration schema: typed dataclasses with one docstring per field.

The configs each part of a run takes: the train engines and their algorithms, the rollout side and
the embedded engine, the CPU speed measures, data, checkpoints, evaluation, recovery and logging.
The configs of a whole run (`BaseExperimentConfig`, `RLExperimentConfig`, the launcher's) gather
them in `areal_lite.api.experiment_config`; `areal_lite.api.config_loader` builds one from YAML and
dotted command-line overrides. Values that can be derived (total steps, output directories) are
properties, not fields.

Field metadata says what a field holds, for checks made before a run starts:
``metadata=one_of("a", "b")`` lists a string field's valid values and ``metadata=at_least(1)``
(`more_than`, `between`: `areal_lite.api.bounds`) its numeric bounds (`load_config` checks both, in
a script's own sections too, before it builds the config), and `READS_MODEL` / `READS_FILE` mark
paths the run reads (the launcher checks that they exist before it starts anything).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from areal_lite.api.bounds import at_least, between, more_than
from areal_lite.api.io import MicroBatchSpec

__all__ = [
    "MISSING",
    "READS_FILE",
    "READS_MODEL",
    "CPUConfig",
    "DPOConfig",
    "DatasetConfig",
    "EvaluatorConfig",
    "InferenceEngineConfig",
    "LoRAConfig",
    "LocalEngineConfig",
    "MicroBatchSpec",
    "OptimizerConfig",
    "PPOActorConfig",
    "PPOCriticConfig",
    "RecoverConfig",
    "SaverConfig",
    "StatsLoggerConfig",
    "TrainEngineConfig",
    "at_least",
    "between",
    "more_than",
    "one_of",
]


def one_of(*choices: str) -> dict[str, tuple[str, ...]]:
    """Field metadata of a string field that takes one of ``choices``: `load_config` rejects any
    other value, naming the field, the value and the choices."""
    return {"choices": choices}


READS_MODEL = {"reads": "model"}
"""Field metadata of a model the run reads: a local directory, or a Hugging Face hub id."""
READS_FILE = {"reads": "file"}
"""Field metadata of a local file or directory the run reads (empty = none)."""


@dataclass
class OptimizerConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = field(default=1e-5, metadata=at_least(0.0))
    """Peak learning rate."""
    weight_decay: float = field(default=0.0, metadata=at_least(0.0))
    """Decoupled weight decay (AdamW)."""
    beta1: float = field(default=0.9, metadata=between(0.0, 1.0))
    """Adam beta1."""
    beta2: float = field(default=0.999, metadata=between(0.0, 1.0))
    """Adam beta2."""
    eps: float = field(default=1e-8, metadata=at_least(0.0))
    """Adam epsilon."""
    lr_scheduler_type: str = field(default="constant", metadata=one_of("constant", "linear", "cosine"))
    """constant, linear or cosine (after warm-up)."""
    warmup_steps_proportion: float = field(default=0.0, metadata=between(0.0, 1.0))
    """Fraction of the total training steps spent warming up linearly from 0."""
    min_lr_ratio: float = field(default=0.0, metadata=between(0.0, 1.0))
    """Final LR as a fraction of ``lr`` for linear and cosine schedules."""
    gradient_clipping: float = field(default=1.0, metadata=at_least(0.0))
    """Clip the global gradient norm to this value (0 = no clipping)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685) on the trained model, built by
    peft: each targeted linear layer computes ``W x + (alpha / rank) * B A x`` with ``W`` frozen and
    only ``A`` [rank, in] and ``B`` [out, rank] trained (B starts at 0, so training starts from the
    base model). Weight updates then ship the adapter alone. FSDP only."""

    rank: int = field(default=0, metadata=at_least(0))
    """Rank r of every adapter; 0 = off (full-parameter training)."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank. Changing the rank with
    alpha fixed changes the effective learning rate."""
    dropout: float = field(default=0.0, metadata=between(0.0, 1.0))
    """Dropout on the adapter's input while training (peft's ``lora_dropout``)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Which linear layers get adapters, as peft matches them: module names such as ``q_proj`` or
    ``down_proj`` (a name matches every module whose name ends with it), or ``all-linear``: every
    linear layer but the output head (on a transformers 5 mixture-of-experts model peft adds the
    experts' 3-D weights and the routers' weights to it)."""
    target_parameters: list[str] = field(default_factory=list)
    """Parameters (not modules) that get adapters, as peft's ``target_parameters`` matches them: the
    stacked expert weights of a mixture-of-experts model, e.g. ``mlp.experts.gate_up_proj`` and
    ``mlp.experts.down_proj`` (each expert gets its own low-rank update) with ``target_modules``
    naming the attention projections, to leave the routers without adapters."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class CPUConfig:
    """The CPU speed measures a user may switch (`areal_lite.cpu`): the compiled kernels of the
    embedded engine and of the FSDP trainer, and the route of training's fp32 matrix products.
    Each field has an environment variable that, set to a non-empty value, overrides it for every
    engine of the process (a benchmark; ``make test-avx2`` builds the kernels for AVX2 this way)."""

    kernel_arch: str = "native"
    """The ``-march`` the compiled kernels (decode attention, fused ops) are built for: ``native``
    (this CPU's instruction set), or e.g. ``x86-64-v3``: the AVX2 code of the CPUs without
    AVX-512, which runs on either kind. Overridden by ``$AREAL_LITE_KERNEL_ARCH``."""
    kernel_cache: str = ""
    """Directory of the built kernels, keyed by their source, flags, compiler and CPU; empty =
    ``~/.cache/areal_lite/kernels``. Overridden by ``$AREAL_LITE_KERNEL_CACHE``."""
    fused_ops: bool = True
    """Run a decoder layer's small per-token operations as compiled passes
    (`areal_lite.cpu.fused_ops`): the embedded engine's residual add and RMS norm, rotary embedding
    and SiLU product (fp32 and bf16 on CPU), and an FSDP trainer's RMS norms and SiLU MLPs, forward
    and backward, where they run in fp32 on CPU. False keeps the torch ops.
    ``$AREAL_LITE_FUSED_OPS`` overrides it (``0``: off, anything else: on)."""
    decode_attention: bool = True
    """The embedded engine on CPU: decode attention as a compiled kernel that reads each row's
    cached keys and values once, only as far as the row's length (`areal_lite.cpu.decode_attention`;
    fp32 and bf16, head dimensions a multiple of 16). False: two batched matmuls.
    ``$AREAL_LITE_DECODE_KERNEL`` overrides it (``0``: off, anything else: on)."""
    fp32_linear: str = field(default="auto", metadata=one_of("auto", "onednn", "torch"))
    """Where a train engine's fp32 matrix products run on CPU (`areal_lite.cpu.linear`): ``torch``
    (MKL, through ``F.linear``), ``onednn``, or ``auto``: oneDNN on AMD CPUs from Zen 5 on, where
    MKL runs its AVX2 kernels at half the CPU's vector width, unless oneDNN is capped below
    AVX-512. An FSDP engine's layers follow its own value; the chunked LM head (FSDP's and
    Megatron's) follows the value of the train engine initialised last in the process.
    ``$AREAL_LITE_CPU_LINEAR`` overrides it."""


@dataclass
class TrainEngineConfig:
    """A train engine (FSDP or Megatron) and the model it owns."""

    path: str = field(default=MISSING, metadata=READS_MODEL)
    """HF model directory to load (config, safetensors, tokenizer), or a hub id."""
    backend: str = field(default="fsdp", metadata=one_of("fsdp", "megatron"))
    """fsdp or megatron: the one line that swaps the train backend."""
    dtype: str = field(default="float32", metadata=one_of("float32", "bfloat16", "float16", "auto"))
    """Compute dtype: float32; bfloat16 (mixed precision: fp32 master weights and optimizer state,
    fp32 gradient reduction; float16 too on FSDP); or auto: bfloat16 where the device computes it
    natively (CUDA with bf16, a CPU with AVX-512 BF16 or AMX), else float32. Weights sent to the
    inference engines are in this dtype."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    is_critic: bool = False
    """Build a value-head model (per-token scalar) instead of a language model head."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer; ignored for frozen models (reference policies)."""
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    """How `train_batch` and `forward` cut batches into micro-batches."""
    logits_chunk_size: int = field(default=1024, metadata=at_least(1))
    """Tokens whose full-vocabulary logits are materialised at once in log-prob computation."""
    attn_impl: str = "sdpa"
    """Attention implementation passed to transformers (sdpa, eager, flash_attention_2). ``sdpa``
    runs packed sequences without crossing them: torch's varlen flash kernel on CUDA in bf16/fp16,
    SDPA per sequence elsewhere (`areal_lite.engines.train.varlen_attention`)."""
    liger_kernels: bool = False
    """FSDP on CUDA: the HF model's RMS norms, rotary embeddings and SwiGLU MLPs replaced by Liger's
    Triton kernels (the ``liger`` extra, ``pip install -e ".[liger]"``), fewer passes over the
    activations than torch's separate ops; the LM head stays the engine's own. An error on CPU or
    without the package."""
    compile_layers: bool = False
    """FSDP: every decoder layer compiled with ``torch.compile`` (in place, before sharding, so
    parameter names and checkpoints stay; FSDP's gathers stay outside the compiled graphs). The
    norms, rotary embedding and MLP of a layer become fused kernels; attention keeps the engine's
    varlen path. The first micro-batches pay the compilation (tens of seconds), and packed lengths
    compile as dynamic shapes. Off by default: measure it (``benchmarks/train_mfu.py --variant
    compile_layers=true``) before turning it on."""
    share_cores_with_engine: bool = True
    """FSDP on CPU, connected to an embedded engine in this process that has its own thread share
    (`LocalEngineConfig.num_threads`): train on the process's threads less that share while the
    engine is generating, and on all of them while it is not (`areal_lite.cpu.threads.CoreSharing`).
    False keeps the process's count throughout."""
    cpu: CPUConfig = field(default_factory=CPUConfig)
    """Speed measures on CPU: the fused kernels and the route of the fp32 products (`CPUConfig`)."""
    shared_prefix: bool = False
    """FSDP with attn_impl=sdpa: run the prefix that consecutive sequences of a micro-batch share
    (a GRPO group's prompt) through the model once, as a tree with one branch per sequence
    (`areal_lite.engines.train.shared_prefix`; where groups' prompts start alike, e.g. with a system turn,
    the trees are chosen to save the most tokens); the results are those of the ordinary forward. With
    several micro-batches, set ``mb_spec.granularity`` to the group size so none is cut apart
    (benchmarks/shared_prefix.py)."""
    tensor_parallel_size: int = field(default=1, metadata=at_least(1))
    """Megatron only: tensor-parallel degree (data-parallel degree is world size / this)."""
    pipeline_parallel_size: int = field(default=1, metadata=at_least(1))
    """Megatron only: pipeline-parallel degree."""
    expert_parallel_size: int = 1
    """Megatron only, mixture-of-experts models: expert-parallel degree (each rank of an
    expert-parallel group holds num_experts / this experts; tokens travel to them all-to-all)."""
    seed: int = 1
    """Seed for initialisation of new heads, adapters and dropout."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters instead of full-parameter training (off by default)."""
    freeze_vision_tower: bool = False
    """Vision-language models, FSDP: keep the vision tower (patch embedding, vision blocks and the
    merger into the decoder) as loaded, training only the decoder and its embeddings and head.
    False trains the whole model."""
    routing_replay: bool = False
    """Mixture-of-experts models, FSDP: route each token to the experts the inference engine chose
    for it (the batch's ``routed_experts``; generate with ``gconfig.return_routed_experts``), with
    gate weights recomputed from the current router so that it still trains
    (`areal_lite.utils.moe`). Without it the router routes by itself and the ``moe/*`` statistics
    say how often it disagrees with generation."""


@dataclass
class PPOActorConfig(TrainEngineConfig):
    """A PPO-family actor (PPO, GRPO, Dr. GRPO, GSPO, DAPO, REINFORCE, RLOO, ReMax, REINFORCE++):
    the train engine plus the algorithm's knobs. Each knob picks or parameterises one function of
    `areal_lite.algorithms.functional`."""

    group_size: int = field(default=1, metadata=at_least(1))
    """Samples per prompt (GRPO group): consecutive rows of a batch; groups stay in one minibatch."""
    ppo_n_minibatches: int = field(default=1, metadata=at_least(1))
    """Optimizer steps per training batch (the batch is cut into this many minibatches)."""
    eps_clip: float = field(default=0.2, metadata=at_least(0.0))
    """PPO ratio clip epsilon (lower side, and upper when ``eps_clip_higher`` is None). GSPO
    clips a sequence-level ratio and wants much smaller values (3e-4)."""
    eps_clip_higher: float | None = None
    """Upper clip epsilon (DAPO clip-higher, e.g. 0.28); None = symmetric."""
    c_clip: float | None = None
    """Dual-clip constant (> 1) bounding the loss for negative advantages; None = off."""
    behav_imp_weight_cap: float | None = 5.0
    """Upper end of the band for the behaviour importance weight exp(prox - behav): with the
    default ``token_mask`` mode, tokens above it are dropped from the loss (decoupled PPO); the
    truncating modes clamp to it. None = no upper end."""
    behav_imp_weight_floor: float | None = None
    """Lower end of that band (IcePop masks below 0.5); None = no lower end."""
    behav_imp_weight_mode: str = field(
        default="token_mask", metadata=one_of("token_mask", "token_truncate", "sequence_mask", "sequence_truncate")
    )
    """What the behaviour weight does outside its band, per token or per sequence (the sequence's
    ratio is the product of its tokens'): ``*_mask`` drops the token or sequence (IcePop,
    Seq-MIS), ``*_truncate`` clamps the weight into the band (TIS, Seq-TIS). The weight corrects
    stale tokens and the train-inference mismatch alike. ``token_mask`` without a floor is
    decoupled PPO's capped weight (for GSPO: its geometric-mean sequence weight)."""
    use_decoupled_loss: bool = True
    """Ratio against the proximal policy (``prox_logp``) with a behaviour importance weight;
    False = standard PPO, ratio against ``prox_logp`` without a behaviour weight."""
    recompute_logprob: bool = True
    """When the batch has no ``prox_logp``, recompute it with the train engine (True) or take the
    behaviour log-probabilities as the proximal policy (False: on-policy or plain PPO)."""
    policy_loss: str = field(default="ppo", metadata=one_of("ppo", "gspo", "reinforce", "cispo"))
    """ppo, gspo, reinforce or cispo (clips a stopped-gradient weight instead of the update: set
    ``eps_clip`` 1.0 to leave it open below, as MiniMax-M1, and ``eps_clip_higher`` above)."""
    loss_agg: str = field(
        default="token-mean", metadata=one_of("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    )
    """token-mean, seq-mean-token-mean or seq-mean-token-sum (Dr. GRPO)."""
    kl_ctl: float = field(default=0.0, metadata=at_least(0.0))
    """Coefficient of the KL penalty to the reference policy (0 = no reference model)."""
    kl_estimator: str = field(default="k1", metadata=one_of("k1", "k2", "k3"))
    """k1, k2 or k3 (Schulman 2020)."""
    kl_in_reward: bool = False
    """Put the KL penalty into the per-token reward instead of the loss."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient."""
    skip_zero_advantage: bool = True
    """Leave sequences whose advantages are all zero out of the update's forward and backward
    passes (GRPO groups whose samples all got the same reward). Their gradient is exactly zero, so
    the update is unchanged: the loss is still normalised over the whole batch. Applies only to the
    built-in policy losses without an entropy bonus or a KL term in the loss; the update's
    statistics (entropy, clip fraction, importance weights) are then over the trained sequences."""
    reward_bias: float = 0.0
    """Added to every reward before scaling."""
    reward_scaling: float = 1.0
    """Multiplies every reward."""
    reward_clip: float = field(default=20.0, metadata=more_than(0.0))
    """Rewards are clipped to [-reward_clip, reward_clip]."""
    mask_truncated: bool = False
    """Give zero reward to sequences cut off by the length limit: a per-sequence bool
    ``truncated`` key of the batch, or else completions of ``max_new_tokens`` tokens."""
    adv_estimator: str = field(
        default="grpo", metadata=one_of("grpo", "dr_grpo", "rloo", "remax", "reinforce_pp", "gae")
    )
    """grpo (group-normalised), dr_grpo (group mean only), rloo, remax (needs
    ``baseline_rewards`` [B] in the batch), reinforce_pp (whitened returns) or gae (needs
    ``values`` [B,L] from a `PPOCritic`)."""
    adv_norm_level: str = field(default="group", metadata=one_of("group", "batch", "none"))
    """grpo: mean and std over the group, over the batch, or none (advantage = reward)."""
    discount: float = field(default=1.0, metadata=between(0.0, 1.0))
    """Discount gamma of GAE and REINFORCE++ returns."""
    gae_lambda: float = field(default=1.0, metadata=between(0.0, 1.0))
    """GAE lambda."""
    overlong_penalty_len: int = field(default=0, metadata=at_least(0))
    """DAPO soft overlong penalty: length window before ``max_new_tokens`` (0 = off)."""
    overlong_penalty_factor: float = 1.0
    """DAPO soft overlong penalty: the penalty at the limit."""
    max_new_tokens: int = field(default=0, metadata=at_least(0))
    """Generation length limit, for the overlong penalty and ``mask_truncated`` (0 = unknown)."""


@dataclass
class PPOCriticConfig(TrainEngineConfig):
    """A value model trained with PPO's clipped value loss (``is_critic`` is forced on)."""

    group_size: int = field(default=1, metadata=at_least(1))
    """Samples per prompt; groups stay in one minibatch (as the actor's)."""
    ppo_n_minibatches: int = field(default=1, metadata=at_least(1))
    """Optimizer steps per training batch."""
    value_eps_clip: float | None = 0.2
    """Clip of the new value around the old one in the value loss; None = unclipped."""

    def __post_init__(self) -> None:
        self.is_critic = True


@dataclass
class DPOConfig(TrainEngineConfig):
    """A DPO policy: rows 2i and 2i+1 of a batch are the chosen and rejected answers of pair i."""

    beta: float = 0.1
    """DPO's beta (IPO's tau): strength of the implicit KL to the reference."""
    label_smoothing: float = 0.0
    """Probability that a preference label is flipped (conservative DPO); sigmoid loss only."""
    dpo_loss: str = field(default="sigmoid", metadata=one_of("sigmoid", "ipo"))
    """sigmoid (DPO) or ipo."""


@dataclass
class InferenceEngineConfig:
    """The rollout side: the executor's staleness control and, for remote engines, the servers."""

    max_concurrent_rollouts: int | None = field(default=None, metadata=at_least(1))
    """Cap on episodes running at once (None = the consumer batch size)."""
    consumer_batch_size: int = field(default=1, metadata=at_least(1))
    """Accepted episodes (e.g. GRPO groups) per training batch: the ``batch_size`` of the staleness bound."""
    max_head_offpolicyness: int = field(default=0, metadata=at_least(0))
    """Staleness bound eta: a batch consumed at step t holds only tokens of versions >= t - eta
    (0 = synchronous RL)."""
    queue_size: int | None = field(default=None, metadata=at_least(1))
    """Cap on finished-but-unconsumed plus running episodes (None = 16 x consumer batch size)."""
    on_workflow_error: str = field(default="raise", metadata=one_of("raise", "skip"))
    """raise (fail fast, naming the input) or skip (count it and go on)."""
    loop_stall_timeout: float = field(default=60.0, metadata=more_than(0.0))
    """Seconds the rollout event loop may be blocked by code that does not await (a grader run
    inline, blocking I/O in a workflow) before the run stops, naming the function it is blocked in."""
    max_reward_failures: float = field(default=0.5, metadata=between(0.0, 1.0))
    """An episode whose rewards are not all finite numbers (its grader raised, timed out or returned
    NaN or a non-number: `RewardRunner` scores such a sample NaN) is dropped and counted
    (``rollout/reward_failed``); the run stops, naming the count, when more than this fraction of
    the last ``consumer_batch_size`` episodes were dropped so (1 = never stop)."""
    addresses: list[str] = field(default_factory=list)
    """Remote engines: host:port of each server (the launcher fills this in)."""
    request_timeout: float = field(default=3600.0, metadata=more_than(0.0))
    """Seconds before one HTTP generation request is given up (and retried elsewhere)."""
    request_retries: int = field(default=3, metadata=at_least(1))
    """Attempts per request across servers before it fails."""
    control_timeout: float = field(default=30.0, metadata=more_than(0.0))
    """Seconds a server may leave ``GET /health`` unanswered (it is asked every few seconds)
    before it is set aside as unresponsive (a hung or stopped process): its running requests go to
    the other servers, and it gets no requests, pauses or weight updates until it answers again,
    when it rejoins with the current weights and version. A server that refuses connections is set
    aside at once."""
    setup_timeout: float = field(default=120.0, metadata=more_than(0.0))
    """Seconds to wait for servers to become healthy."""
    api_key: str | None = None
    """Bearer token for servers started with --api-key."""
    pause_mode: str = field(default="abort", metadata=one_of("abort", "in_place"))
    """How servers pause for weight updates: abort (resume as prompt + generated) or in_place."""
    client_cores: list[int] = field(default_factory=list)
    """CPU cores for the rollout client's threads in the trainer process (executor loop, HTTP
    client loop, reward threads); empty = no pinning. On a small CPU machine, the rollout
    server's core keeps them off the training thread's core (benchmarks/async_vs_sync.py)."""
    episode_process: bool = False
    """Run the workflows (their generation calls, rewards, trajectory building) in a child process
    instead of a thread of the trainer's: their Python work then no longer competes with training
    for the trainer's interpreter lock while rollouts run ahead (asynchronous RL on few cores).
    Remote servers only; workflows must pickle, and their own counters (e.g. `RewardRunner.stats`)
    count in the child. The child runs on ``client_cores``. It is started with multiprocessing's
    spawn method, which imports the training script again: keep its entry point under
    ``if __name__ == "__main__":``."""


@dataclass
class LocalEngineConfig:
    """The embedded engine (in-process, or behind our SGLang-protocol server)."""

    path: str = field(default=MISSING, metadata=READS_MODEL)
    """HF model directory, or a hub id."""
    dtype: str = field(default="float32", metadata=one_of("float32", "bfloat16", "float16"))
    """float32, bfloat16 or float16."""
    device: str = "cpu"
    """cpu or cuda."""
    max_running_requests: int = field(default=128, metadata=at_least(1))
    """Requests decoded together in one continuous batch (KV-cache rows; the cache grows with the
    longest running request). On a 2-core CPU, 256 requests of 10-30 tokens on a 4-layer,
    hidden-128 model ran 1.5x faster with 128 rows than with 64, and no faster with 256."""
    max_total_tokens: int = field(default=0, metadata=at_least(0))
    """Context limit per request (0 = the model's max_position_embeddings)."""
    seed: int = 0
    """Sampling seed."""
    keep_cache_on_update: bool = False
    """Keep the running requests' KV caches across a weight update instead of recomputing them
    under the new weights. Recomputing (the default) costs one prefill of every running token per
    update; keeping makes the update a copy of the weights, but the tokens sampled after it attend
    to keys and values of the old weights, so their log-probabilities are of neither policy
    exactly (the decoupled loss takes them as the behaviour policy's; the trainer's
    ``mismatch/*`` statistics show the gap). Measured in benchmarks/update_stall.py."""
    max_prefill_tokens: int = field(default=1024, metadata=at_least(0))
    """Distinct prompt tokens a step may prefill beside its decoding (0 = no limit): waiting
    requests are admitted while their prompts fit (at least one a step; samples of one prompt
    count once). 64 prompts arriving at once then get their first tokens a step at a time instead
    of all after one long prefill, and the running requests keep decoding meanwhile."""
    cuda_graphs: bool = True
    """On CUDA, replay each decode step (every running request, no prefill) from a CUDA graph
    captured per padded batch size: one launch a step instead of one per kernel
    (`areal_lite.engines.local.decode_graphs`). Off: every step runs eagerly. Ignored on CPU and for
    mixture-of-experts models."""
    num_threads: int = field(default=0, metadata=at_least(0))
    """Threads of the engine's torch ops (the scheduler thread's own count; 0 = the process's).
    Where generation and training run at once in one process (asynchronous RL with the engine
    in-process), giving each part of the cores keeps them from oversubscribing them. With 0 and an
    FSDP trainer connected in process on CPU (``actor.share_cores_with_engine``), the engine runs
    on half of the process's threads while the trainer computes and on all of them otherwise (the
    trainer likewise), so whichever computes alone has every thread."""
    cores: list[int] = field(default_factory=list)
    """CPU cores for the engine's scheduler thread and the OpenMP workers it starts (empty = no
    pinning; cores the machine lacks are refused at start): to keep the engine off cores that
    other work uses. Measured on a 2-core machine it gave no speed-up, neither in an asynchronous
    GRPO loop nor for generation alone (docs/performance.md, "The engine's thread on a core of its
    own")."""
    cpu: CPUConfig = field(default_factory=CPUConfig)
    """Speed measures on CPU: the engine's compiled kernels (`CPUConfig`; ``fp32_linear`` is the
    train engines')."""


@dataclass
class DatasetConfig:
    """A dataset (a local parquet/jsonl path or a built-in synthetic task)."""

    path: str = field(default="", metadata=READS_FILE)
    """Local file or directory; empty for synthetic tasks."""
    type: str = field(default="rl", metadata=one_of("rl", "sft"))
    """rl or sft."""
    batch_size: int = field(default=8, metadata=at_least(1))
    """Items (prompts) per training batch."""
    shuffle: bool = True
    """Shuffle each epoch."""
    max_length: int | None = field(default=None, metadata=at_least(1))
    """Drop items whose prompt is longer than this many tokens (counted in ``data/left_out/*``)."""
    on_bad_row: str = field(default="raise", metadata=one_of("raise", "skip"))
    """A row that lacks a field the run reads, holds one of the wrong type or an empty one, or is
    not valid JSON: raise (stop, naming its file and line) or skip (leave it out; counted in the
    statistics as ``data/left_out/bad`` and the first few logged)."""


@dataclass
class SaverConfig:
    """Periodic HF checkpoints."""

    freq_steps: int | None = field(default=None, metadata=at_least(1))
    """Save every this many steps (None = never)."""
    freq_epochs: int | None = field(default=None, metadata=at_least(1))
    """Save every this many epochs."""


@dataclass
class EvaluatorConfig:
    """Periodic evaluation."""

    freq_steps: int | None = field(default=None, metadata=at_least(1))
    """Evaluate every this many steps (None = only where the script asks)."""


@dataclass
class RecoverConfig:
    """Crash recovery from the full training state."""

    mode: str = field(default="disabled", metadata=one_of("disabled", "auto", "resume"))
    """disabled, auto (resume when a recover checkpoint exists) or resume (require one)."""
    freq_steps: int = field(default=1, metadata=at_least(1))
    """Write the recover checkpoint every this many steps."""
    retries: int = field(default=0, metadata=at_least(0))
    """Launcher restarts after a failure."""


@dataclass
class StatsLoggerConfig:
    """Where per-step statistics go."""

    wandb_mode: str = field(default="offline", metadata=one_of("disabled", "offline", "online"))
    """wandb mode: offline (runs under the output directory's ``wandb/``; ``wandb sync`` uploads
    them later), online (needs a login) or disabled."""
    wandb_project: str = "areal-lite"
    """wandb project name."""
    tensorboard: bool = False
    """Also write tensorboard event files."""
    console: bool = True
    """Print one short line per step (the ``console_keys``) and the full table every
    ``full_stats_every`` steps; on a terminal under a progress bar, elsewhere (a launcher's log,
    CI) as plain lines without control characters."""
    console_keys: list[str] = field(
        default_factory=lambda: [
            "reward=reward_mean",
            "acc=eval/accuracy",
            "loss",
            "kl_ref",
            "kl_behav=behav_kl",
            "stale=rollout/staleness_max",
            "time=timing/step",
        ]
    )
    """The statistics of the per-step console line, in order, each ``label=key`` or just ``key``;
    a key missing from a step's statistics is left out of that step's line. ``timing/`` keys are
    shown in seconds."""
    full_stats_every: int = field(default=50, metadata=at_least(0))
    """Print the table of every statistic every this many steps and at the last step (0 = never;
    wandb and tensorboard always get every statistic)."""
    reward_std_key: str = "reward_std"
    """The statistic watched for a collapsing reward spread (all samples of a group scoring alike)."""
    collapse_steps: int = field(default=5, metadata=at_least(0))
    """Warn once the reward std has been 0 for this many consecutive steps (0 = never)."""
    kl_key: str = "approx_kl"
    """The statistic watched for an exploding KL divergence (from one update to the next)."""
    kl_ref_key: str = "kl_ref"
    """Watched instead of ``kl_key`` on the steps that report it: the KL to the reference policy,
    when the run has one (the drift that a KL penalty is there to bound)."""
    kl_max: float = 1.0
    """Warn when the watched KL exceeds this (nats per token)."""
    plot_keys: list[str] = field(default_factory=lambda: ["reward_mean", "eval/accuracy"])
    """Statistics drawn, one panel each, in ``output_dir/curves.png`` when the logger closes."""
