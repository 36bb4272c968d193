"""Runs that must reproduce each other exactly, on a tiny model with the real `PPOActor` and
`FSDPEngine` (one process):

- eta = 0 through the asynchronous executor (`prepare_batch`) equals the synchronous loop
  (`rollout_batch` on each step's prompts), batch for batch and gradient for gradient. The rollouts
  come from `SeededSampler`, which samples from the weights it was last sent with a generator
  seeded by the request, so the two runs' tokens can differ only through the weights (that is, the
  policy version) that produced them; a loop that skips one weight update shows the comparison
  notices;
- a replayed run (`replay_batches`) reproduces the parameters of the asynchronous run (eta = 1, the
  embedded engine) that recorded it (`record_batches`), bit for bit, generating nothing.
"""

from __future__ import annotations

import zlib
from collections import Counter
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from areal_lite.actors.ppo import PPOActor
from areal_lite.api.config import (
    DatasetConfig,
    InferenceEngineConfig,
    OptimizerConfig,
    PPOActorConfig,
    StatsLoggerConfig,
)
from areal_lite.api.engine import InferenceEngine
from areal_lite.api.experiment_config import RLExperimentConfig
from areal_lite.api.io import FinetuneSpec, GenerationConfig, ModelRequest, ModelResponse, WeightUpdateMeta
from areal_lite.core import BatchRecorder, BatchReplay, RolloutController
from areal_lite.kit import (
    RunKit,
    make_rollout_controller,
    make_train_engine,
    mean_reward,
    rank_dataloader,
    sync_weights,
)
from areal_lite.rewards import RewardRunner
from areal_lite.utils.tiny import build_tiny_model
from areal_lite.workflows.rlvr import RLVRWorkflow

GROUP, PROMPTS, STEPS = 4, 4, 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(
        str(tmp_path_factory.mktemp("tiny")), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=0
    )


def parity_reward(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **item: object
) -> float:
    """A reward a random model earns half the time, so groups carry signal."""
    return float(sum(completion_ids) % 2)


PROBLEMS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3, 9) for b in range(4, 8)]


def workflow(tokenizer: object, max_new_tokens: int = 4) -> RLVRWorkflow:
    gconfig = GenerationConfig(n_samples=GROUP, max_new_tokens=max_new_tokens, temperature=1.0)
    return RLVRWorkflow(RewardRunner(parity_reward, mode="inline"), gconfig, tokenizer, use_chat_template=False)


class SeededSampler(InferenceEngine):
    """Samples from a HF model holding the weights last sent to it, one token at a time, with a
    generator seeded by the request's prompt and how often that prompt was asked for before: the
    same requests in the same order get the same tokens from the same weights, however they are
    scheduled."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.version = 0
        self.seen: Counter[tuple[int, ...]] = Counter()

    def initialize(self) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()

    def destroy(self) -> None:
        pass

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        key = tuple(req.input_ids)
        g = torch.Generator().manual_seed(zlib.crc32(repr((key, self.seen[key])).encode()))
        self.seen[key] += 1
        ids, out, logps = list(req.input_ids), [], []
        with torch.no_grad():
            for _ in range(req.gconfig.max_new_tokens):
                logits = self.model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
                logp = torch.log_softmax(logits, dim=-1)
                token = int(torch.multinomial(logp.exp(), 1, generator=g))
                ids.append(token)
                out.append(token)
                logps.append(float(logp[token]))
        return ModelResponse(list(req.input_ids), out, logps, [self.version] * len(out), stop_reason="length")

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[None]:
        raise NotImplementedError

    def update_weights(self, meta: WeightUpdateMeta) -> Future[None]:
        assert meta.named_tensors is not None
        self.model.load_state_dict(dict(meta.named_tensors), strict=True)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def set_version(self, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass


def actor_config(model_dir: str) -> PPOActorConfig:
    # lr and eps of one size: Adam's first steps follow the gradient's size (FINDINGS: invariances)
    return PPOActorConfig(
        path=model_dir, group_size=GROUP, optimizer=OptimizerConfig(lr=1e-2, eps=1e-2), behav_imp_weight_cap=None
    )


def rollout_config(eta: int) -> InferenceEngineConfig:
    return InferenceEngineConfig(
        consumer_batch_size=PROMPTS, max_head_offpolicyness=eta, max_concurrent_rollouts=2 * PROMPTS
    )


def full(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run_loop(
    model_dir: str, synchronous: bool, skip_sync_at: int | None = None
) -> tuple[list[TensorDict], list[dict[str, torch.Tensor]]]:
    """STEPS PPO steps at eta = 0: each step's batch from `rollout_batch` on the step's prompts
    (``synchronous``) or from `prepare_batch`; returns the batches and each step's gradients (taken
    before the optimizer step)."""
    from transformers import AutoTokenizer

    cfg = actor_config(model_dir)
    engine = make_train_engine(cfg)
    rollout = RolloutController(SeededSampler(model_dir), rollout_config(eta=0))
    rollout.initialize()
    try:
        dataloader = rank_dataloader(PROBLEMS, DatasetConfig(batch_size=PROMPTS), engine, seed=3)
        engine.initialize(FinetuneSpec(total_train_epochs=1, dataset_size=STEPS, train_batch_size=1))
        meta = WeightUpdateMeta(type="in_process")
        engine.connect_engine(rollout.engine, meta)
        actor = PPOActor(cfg, engine)
        grads: list[dict[str, torch.Tensor]] = []
        step_optimizer = engine.optim_step

        def spy(*args: object, **kwargs: object) -> dict[str, float]:
            grads.append({n: full(p.grad) for n, p in engine.model.named_parameters()})
            return step_optimizer(*args, **kwargs)  # type: ignore[arg-type]

        engine.optim_step = spy  # type: ignore[method-assign]
        wf = workflow(AutoTokenizer.from_pretrained(model_dir))
        prompts = iter(dataloader)
        batches = []
        for step in range(STEPS):
            if synchronous:
                batch = rollout.rollout_batch(next(prompts), wf)
            else:
                batch = rollout.prepare_batch(dataloader, workflow=wf)
            batches.append(batch.clone())
            actor.compute_advantages(batch)
            actor.ppo_update(batch)
            if step != skip_sync_at:
                sync_weights(rollout, engine, meta, version=step + 1)
            else:  # the trainer moves on, the sampler keeps the old weights
                engine.set_version(step + 1)
                rollout.set_version(step + 1)
        return batches, grads
    finally:
        rollout.destroy()
        engine.destroy()


def assert_same_batch(a: TensorDict, b: TensorDict, step: int) -> None:
    assert sorted(a.keys()) == sorted(b.keys())
    for key in sorted(a.keys()):
        assert torch.equal(a[key], b[key]), f"step {step}: {key} differs"


def test_eta_zero_through_the_executor_equals_the_synchronous_loop(model_dir):
    sync_batches, sync_grads = run_loop(model_dir, synchronous=True)
    async_batches, async_grads = run_loop(model_dir, synchronous=False)
    assert len(sync_grads) == len(async_grads) == STEPS
    for step in range(STEPS):
        assert_same_batch(sync_batches[step], async_batches[step], step)
        assert int(async_batches[step]["versions"].max()) == step  # every token from the current policy
        for name, g in sync_grads[step].items():
            assert torch.equal(g, async_grads[step][name]), f"step {step}: gradient of {name} differs"
    assert any(bool(g.abs().sum() > 0) for g in sync_grads[-1].values()), "the updates did nothing"
    assert float(sync_batches[0]["rewards"].std()) > 0

    # The comparison sees which weights sampled: a loop that skips the first weight update samples
    # its next batch from the old weights, and that batch differs.
    stale_batches, _ = run_loop(model_dir, synchronous=True, skip_sync_at=0)
    assert_same_batch(sync_batches[0], stale_batches[0], 0)
    assert not torch.equal(sync_batches[1]["logprobs"], stale_batches[1]["logprobs"])


# ----------------------------------------------------------------------------- record and replay


def rl_config(model_dir: str, out: Path, **overrides: object) -> RLExperimentConfig:
    cfg = RLExperimentConfig(
        experiment_name="replay",
        seed=3,
        total_train_steps=STEPS,
        actor=actor_config(model_dir),
        train_dataset=DatasetConfig(batch_size=PROMPTS),
        stats_logger=StatsLoggerConfig(console=False, wandb_mode="disabled", plot_keys=[]),
        gconfig=GenerationConfig(n_samples=GROUP, max_new_tokens=4),
    )
    cfg.cluster.fileroot = str(out)
    cfg.local_engine.path = model_dir
    cfg.rollout = rollout_config(eta=1)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def train_and_record_or_replay(cfg: RLExperimentConfig, generate: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The quickstart's loop, shortened; returns the final parameters and the evaluation scores."""
    from transformers import AutoTokenizer

    rollout, meta = make_rollout_controller(cfg)
    if not generate:

        async def no_generation(req: ModelRequest) -> ModelResponse:
            raise AssertionError("a replayed run generated")

        rollout.engine.agenerate = no_generation  # type: ignore[method-assign]
    engine = make_train_engine(cfg.actor)
    try:
        dataloader = rank_dataloader(PROBLEMS, cfg.train_dataset, engine, seed=cfg.seed)
        run = RunKit(cfg, engine, dataloader, rollout=rollout, weight_meta=meta)
        engine.initialize(run.finetune_spec)
        engine.connect_engine(rollout.engine, meta)
        actor = PPOActor(cfg.actor, engine)
        wf = workflow(AutoTokenizer.from_pretrained(cfg.actor.path))
        scores = [mean_reward(rollout, wf, PROBLEMS[:4])]
        for step in range(run.start_step, run.total_steps):
            batch = rollout.prepare_batch(dataloader, workflow=wf)
            actor.compute_advantages(batch)
            stats = actor.ppo_update(batch)
            sync_weights(rollout, engine, meta, version=step + 1)
            run.end_step(step, stats)
        scores.append(mean_reward(rollout, wf, PROBLEMS[:4]))
        run.close()
        return {n: full(p) for n, p in engine.model.named_parameters()}, scores
    finally:
        rollout.destroy()
        engine.destroy()


def test_a_replayed_run_reproduces_the_recorded_parameters_bit_for_bit(model_dir, tmp_path):
    recording = tmp_path / "recording"
    recorded, scores = train_and_record_or_replay(
        rl_config(model_dir, tmp_path / "a", record_batches=str(recording)), True
    )
    files = sorted((recording / "rank0").glob("*.pt"))
    assert len(files) == STEPS + 2  # the training batches and the two evaluations
    staleness = [s for f in files for s in torch.load(f, weights_only=True)["staleness"]]
    assert max(staleness) >= 1, "eta = 1 should have trained on a stale batch"

    replayed, replayed_scores = train_and_record_or_replay(
        rl_config(model_dir, tmp_path / "b", replay_batches=str(recording)), False
    )
    changed = [n for n in recorded if not torch.equal(recorded[n], replayed[n])]
    assert not changed, f"parameters differ after the replay: {changed}"
    assert replayed_scores == scores


def test_replay_says_where_the_loop_left_the_recording(tmp_path):
    recorder = BatchRecorder(str(tmp_path))
    batch = TensorDict({"input_ids": torch.arange(6).view(2, 3), "rewards": torch.tensor([0.0, 1.0])}, batch_size=[2])
    recorder.write("eval", batch, 0, [])
    recorder.write("train", batch, 0, [0, 0])
    replay = BatchReplay(str(tmp_path))
    assert torch.equal(replay.read("eval", 0)["input_ids"], batch["input_ids"])
    with pytest.raises(RuntimeError, match="diverged at batch 1: the loop asks for a train batch at policy version 1"):
        replay.read("train", 1)
    assert replay.read("train", 0)["rewards"].tolist() == [0.0, 1.0]
    with pytest.raises(RuntimeError, match="ends after 2 batches"):
        replay.read("train", 1)
    with pytest.raises(FileNotFoundError):
        BatchReplay(str(tmp_path / "none"))
