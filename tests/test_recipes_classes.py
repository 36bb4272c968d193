"""Each recipe class end to end on a tiny model: SFT lowers its loss, writes checkpoints and resumes
after a crash; GRPO runs with its reference and evaluation; PPO trains its value model
(explained variance rises); DPO raises held-out preference accuracy."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from areal_lite.api.config import RecoverConfig, SaverConfig, StatsLoggerConfig
from areal_lite.api.io import GenerationConfig
from areal_lite.recipes import (
    DPO,
    GRPO,
    PPO,
    SFT,
    FunctionGrader,
    ModelBuilder,
    ModelConfig,
    RecipeRunConfig,
    StringThread,
    TrainingModel,
    async_map,
    shutdown,
)
from areal_lite.recipes.ppo import explained_variance
from areal_lite.utils.tiny import build_tiny_model

QUIET = StatsLoggerConfig(wandb_mode="disabled", console=False, tensorboard=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(
        str(tmp_path_factory.mktemp("tiny")), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
        vocab_size=0, max_position_embeddings=64,
    )  # fmt: skip


def config(**changes: object) -> ModelConfig:
    return ModelConfig(use_chat_template=False, max_seq_len=48, gconfig=GenerationConfig(max_new_tokens=4), **changes)  # type: ignore[arg-type]


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefgh") for _ in range(4)) + ":" for _ in range(n)]


def test_sft_lowers_its_loss_saves_and_resumes(model_dir: str, tmp_path: Path) -> None:
    data = [StringThread([("user", p)]).assistant(p[::-1]) for p in prompts(16, 0)]
    run_config = RecipeRunConfig(
        output_dir=str(tmp_path), saver=SaverConfig(freq_steps=3), recover=RecoverConfig(mode="auto", freq_steps=3),
        stats_logger=QUIET,
    )  # fmt: skip

    async def go() -> None:
        model = await ModelBuilder(model_dir, config()).spawn_train("sft")
        sft = SFT(data, model, lr=1e-2, samples_per_batch=8, num_epochs=3, run_config=run_config)
        await sft.run()
        losses = [h["loss"] for h in sft.history]
        assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
        assert (tmp_path / "checkpoints" / "globalstep3" / "config.json").exists()
        assert (tmp_path / "checkpoints" / "globalstep6" / "config.json").exists()
        probe = await model.tokenize_thread(data[0])
        trained = await model.logprobs_per_token(probe)

        # A new run of 8 steps (4 epochs) in the same place resumes after step 6 with the trained weights.
        again = await ModelBuilder(model_dir, config()).spawn_train("sft_again")
        sft2 = SFT(data, again, lr=1e-2, samples_per_batch=8, num_epochs=4, run_config=run_config)
        original = await again.logprobs_per_token(probe)
        assert original != trained
        sft2.total_steps = 6  # resume, then stop at once: the restored weights are those of step 6
        await sft2.run()
        assert sft2.history == [] and await again.logprobs_per_token(probe) == pytest.approx(trained, abs=1e-6)
        assert again.version == 6 and sft2.dataset.consumed == 6 * 8, "weights, version and data position restored"
        await shutdown(model, again)

    asyncio.run(go())


def test_grpo_runs_end_to_end(model_dir: str, tmp_path: Path) -> None:
    threads = [StringThread([("user", p)]) for p in prompts(8, 1)]
    grader = FunctionGrader(lambda t: float("a" in t.completion()))

    async def go() -> None:
        model = await ModelBuilder(model_dir, config(shared_prefix=True)).spawn_train("grpo")
        evaluated = []

        async def evaluate() -> dict[str, float]:
            evaluated.append(1)
            return {"eval/score": 0.5}

        grpo = GRPO(
            threads, model, grader, completions_per_sample=4, lr=1e-3, kl_beta=0.01, samples_per_batch=8,
            samples_per_mini_batch=4, max_num_grpo_steps=2, run_config=RecipeRunConfig(output_dir=str(tmp_path), stats_logger=QUIET),
            evaluate=evaluate,
        )  # fmt: skip
        last = await grpo.run()
        assert len(grpo.history) == 2 and evaluated == [1], "evaluated after the last step"
        assert last["eval/score"] == 0.5 and last["n_samples"] == 4 and "kl_k1" in last and "reward_mean" in last
        assert model.version == 4, "two mini-batches per step"
        with pytest.raises(RuntimeError, match="closed"):
            await grpo.model_ref.logprobs_per_token(await model.tokenize_thread(threads[0].assistant("x")))  # type: ignore[union-attr]
        await shutdown(model)

    asyncio.run(go())


def test_ppo_trains_its_value_model(model_dir: str, tmp_path: Path) -> None:
    """The reward depends on the prompt only (its last letter): a value model can learn it. Its
    value at the first answer token explains 0.74-0.88 of the rewards' variance over the prompts
    after training (8 runs), about 0 before; the logged explained variance (over a batch's
    tokens, a noisy 32-sample estimate) rises from about 0 to 0.13-0.45."""
    items = [StringThread([("user", p[:-1])], {"reward": float(p[-2] in "abcd")}) for p in prompts(64, 2)]
    grader = FunctionGrader(lambda t: float(t.metadata["reward"]))  # type: ignore[arg-type]
    rewards = torch.tensor([float(t.metadata["reward"]) for t in items])

    async def go() -> None:
        policy = await ModelBuilder(model_dir, config()).spawn_train("ppo_policy")
        value = await ModelBuilder(model_dir, config()).spawn_value("ppo_value")

        async def explained() -> float:
            async def first_value(t: StringThread) -> float:
                return (await value.values_per_token(await value.tokenize_thread(t.assistant("x"))))[0]

            return explained_variance(torch.tensor(await async_map(first_value, items)), rewards)

        before = await explained()
        ppo = PPO(
            items, policy, value, grader, lr_policy=1e-4, lr_value=1e-2, kl_beta=0.0, samples_per_batch=32,
            max_num_ppo_steps=10, samples_per_mini_batch=8, mini_epochs_per_batch=2, lam=1.0, value_clip_range=None,
            run_config=RecipeRunConfig(output_dir=str(tmp_path), stats_logger=QUIET),
        )  # fmt: skip
        await ppo.run()
        after = await explained()
        assert before < 0.1 and after > 0.5, (before, after)
        ev = [h["value/explained_variance"] for h in ppo.history]
        late = sum(ev[-3:]) / 3
        assert late > 0.1 and late > ev[0] + 0.1, ev
        assert all(k in ppo.history[-1] for k in ("loss", "value/loss", "clip_frac", "value/grad_norm"))
        assert "kl_ref" not in ppo.history[-1], "no reference model: no KL to one"
        await shutdown(policy, value)

    asyncio.run(go())


async def preference_accuracy(model: TrainingModel, pairs: list[tuple[StringThread, StringThread]]) -> float:
    async def prefers(pair: tuple[StringThread, StringThread]) -> float:
        good, bad = await async_map(model.tokenize_thread, pair)
        lp_good, lp_bad = await async_map(model.logprobs_per_token, [good, bad])
        return float(sum(lp_good) > sum(lp_bad))

    return sum(await async_map(prefers, pairs)) / len(pairs)


def test_dpo_raises_preference_accuracy(model_dir: str, tmp_path: Path) -> None:
    """Preferred answers end in ``1``, dispreferred ones in ``0``: held-out pairs (other prompts)
    are ranked right more often after training."""

    def pairs(seed: int, n: int, good: str, bad: str) -> list[tuple[StringThread, StringThread]]:
        rng = random.Random(seed)
        out = []
        for p in prompts(n, seed):
            stem = "".join(rng.choice("xyz") for _ in range(2))
            thread = StringThread([("user", p)])
            out.append((thread.assistant(stem + good), thread.assistant(stem + bad)))
        return out

    async def go() -> None:
        model = await ModelBuilder(model_dir, config()).spawn_train("dpo")
        train, held_out = pairs(3, 32, "1", "0"), pairs(4, 32, "1", "0")
        before = await preference_accuracy(model, held_out)
        if before > 0.5:  # the untrained model leans to "1": teach it the other way round
            train, held_out = pairs(3, 32, "0", "1"), pairs(4, 32, "0", "1")
            before = await preference_accuracy(model, held_out)
        dpo = DPO(
            train, model, lr=3e-3, samples_per_batch=16, beta=0.5, num_epochs=4,
            run_config=RecipeRunConfig(output_dir=str(tmp_path), stats_logger=QUIET),
        )  # fmt: skip
        await dpo.run()
        after = await preference_accuracy(model, held_out)
        assert after >= 0.9 and after > before + 0.2, (before, after)
        accuracy = [h["reward_accuracy"] for h in dpo.history]
        assert accuracy[-1] > 0.9 > accuracy[0], accuracy  # the policy starts as its reference: margins ~0
        await shutdown(model)

    asyncio.run(go())
