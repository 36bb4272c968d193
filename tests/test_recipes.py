"""The recipe API's primitives on a tiny model: threads tokenize exactly, concurrent calls are
packed, generation uses the current weights, ``train_grpo`` then ``optim_step`` equals
`PPOActor.ppo_update` and ``train_tangents`` (tangents from autodiff of the GRPO loss) equals
``train_grpo`` (1e-6, SGD-like), two ranks equal one, and bad input gets a clear error."""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from test_actors import SGD_LIKE, deltas, params
from test_fsdp import torchrun

from areal_lite.actors import DPOActor, PPOActor
from areal_lite.algorithms import functional as F
from areal_lite.api.config import DPOConfig, LoRAConfig, PPOActorConfig
from areal_lite.api.io import GenerationConfig, MicroBatchSpec
from areal_lite.recipes import (
    CombinedGrader,
    CosineScheduler,
    DataSet,
    FunctionGrader,
    Grader,
    JudgeGrader,
    ModelBuilder,
    ModelConfig,
    Recipe,
    RewardFnGrader,
    StringThread,
    TokenizedThread,
    async_map,
    async_map_batch,
    get_minibatches,
    repeat_thread,
    shutdown,
)
from areal_lite.rewards.format import exact_answer_reward
from areal_lite.utils.tiny import build_tiny_model

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from recipes_worker import grpo_delta, random_samples, sample


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(
        str(tmp_path_factory.mktemp("tiny")), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=300
    )


def run(coro):
    return asyncio.run(coro)


def sgd_config(**changes: object) -> ModelConfig:
    return replace(
        ModelConfig(optimizer=SGD_LIKE, max_seq_len=64, gconfig=GenerationConfig(max_new_tokens=6)), **changes
    )  # type: ignore[arg-type]


def padded(samples: list[TokenizedThread], **per_token: list[list[float]]) -> TensorDict:
    """The samples as a padded trajectory batch, with per-trained-token values placed."""
    width = max(len(s) for s in samples)
    batch = {
        "input_ids": torch.zeros(len(samples), width, dtype=torch.int64),
        "attention_mask": torch.zeros(len(samples), width, dtype=torch.bool),
        "loss_mask": torch.zeros(len(samples), width, dtype=torch.int32),
    }
    batch.update({k: torch.zeros(len(samples), width) for k in per_token})
    for i, s in enumerate(samples):
        batch["input_ids"][i, : len(s)] = torch.tensor(s.tokens)
        batch["attention_mask"][i, : len(s)] = True
        trained = torch.tensor([j for j, w in enumerate(s.weights) if w > 0])
        batch["loss_mask"][i, trained] = 1
        for k, values in per_token.items():
            batch[k][i, trained] = torch.tensor(values[i])
    batch["rewards"] = torch.zeros(len(samples))
    return TensorDict(batch, batch_size=[len(samples)])


# ----------------------------------------------------------------------------- threads


def test_chat_template_weights_only_the_assistant_content_and_its_end(model_dir):
    async def go():
        model = await ModelBuilder(model_dir, ModelConfig(max_seq_len=128)).spawn_train("threads")
        thread = StringThread().system("be brief").user("2+2?").assistant("4").user("and 3+3?").assistant("6")
        t = await model.tokenize_thread(thread)
        tok = model.tokenizer
        trained = [tok_id for tok_id, w in zip(t.tokens, t.weights) if w > 0]
        assert tok.decode(trained) == "4<|im_end|>6<|im_end|>"
        full = tok.apply_chat_template([{"role": r, "content": c} for r, c in thread.turns], tokenize=False)
        assert tok.decode(t.tokens) == full, "the turns concatenate to the chat template's rendering"
        assert (await model.detokenize_thread(t)).turns == thread.turns
        prompt = await model.tokenize_thread(thread.prompt())
        assert tok.decode(model.threads.prompt_ids(prompt)).endswith("<|im_start|>assistant\n")
        await shutdown(model)

    run(go())


def test_raw_threads_and_string_thread_helpers(model_dir):
    async def go():
        model = await ModelBuilder(model_dir, ModelConfig(use_chat_template=False)).spawn_train("raw")
        t = await model.tokenize_thread(StringThread([("user", "57+68=")]).assistant("125"))
        assert model.tokenizer.decode(t.tokens) == "57+68=125<|im_end|>" and t.n_trained == len(t.turns[1].tokens)
        await shutdown(model)

    run(go())
    thread = StringThread([("user", "q")], {"answer": "a"}).assistant("x")
    assert thread.completion() == "x" and thread.last_content() == "x" and thread.prompt().turns == [("user", "q")]
    with pytest.raises(ValueError, match="role"):
        StringThread([("robot", "hi")])
    with pytest.raises(ValueError, match="no assistant turn"):
        StringThread([("user", "q")]).completion()


# ----------------------------------------------------------------------------- the primitives


async def grpo_inputs(model, n: int, seed: int):
    """Samples, their current log-probs, and GRPO inputs around them: older log-probs (so that
    clipping engages), reference log-probs and one advantage per sample."""
    samples = random_samples(n, seed=seed)
    current = await async_map(model.logprobs_per_token, samples)
    g = torch.Generator().manual_seed(seed + 100)
    old = [[x + 0.3 * float(torch.randn(1, generator=g)) for x in lp] for lp in current]
    ref = [[x - 0.2 * float(torch.rand(1, generator=g)) for x in lp] for lp in current]
    return samples, current, old, ref, torch.randn(n, generator=g).tolist()


def largest_difference(before: dict[str, torch.Tensor], a, b) -> float:
    """The largest difference between the parameter changes of two models that started equal."""
    da, db = deltas(before, a.engine), deltas(before, b.engine)
    assert sum(float(v.abs().sum()) for v in da.values()) > 0, "the update did nothing"
    return max(float((da[k] - db[k]).abs().max()) for k in da)


# train_ppo, train_grpo and train_gspo against PPOActor.ppo_update with the settings they stand for.
POLICY_CASES = {
    "grpo": (
        lambda m, s, old, ref, adv: m.train_grpo(s, old, ref, adv, 0.1, 0.05),
        {"eps_clip": 0.1, "kl_ctl": 0.05, "kl_estimator": "k3"},
    ),
    "ppo": (lambda m, s, old, ref, adv: m.train_ppo(s, old, adv, 0.15), {"eps_clip": 0.15}),
    "gspo": (
        lambda m, s, old, ref, adv: m.train_gspo(s, old, ref, adv, 0.2, 0.3, 0.05),
        {"policy_loss": "gspo", "eps_clip": 0.2, "eps_clip_higher": 0.3, "kl_ctl": 0.05, "kl_estimator": "k3",
         "loss_agg": "seq-mean-token-mean"},
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(POLICY_CASES))
def test_train_policy_then_optim_step_equals_ppo_update(model_dir, kind):
    """The same batch, the same settings, SGD-like steps: ``train_grpo`` (clip, KL k3 in the loss,
    token mean), ``train_ppo`` (clip, no KL) and ``train_gspo`` (sequence ratio, sequence mean)
    then ``optim_step`` equal ``ppo_update``."""
    train, settings = POLICY_CASES[kind]

    async def go():
        a = await ModelBuilder(model_dir, sgd_config()).spawn_train(f"{kind}_a")
        b = await ModelBuilder(model_dir, sgd_config()).spawn_train(f"{kind}_b")
        samples, _, old, ref, adv = await grpo_inputs(a, 8, seed=1)
        before = params(a.engine)
        await async_map(lambda i: train(a, samples[i], old[i], ref[i], adv[i]), range(8))
        stats = await a.optim_step()
        assert stats["clip_frac"] > 0 and stats["n_samples"] == 8
        # the KL to the reference is reported where there is one (train_ppo takes none)
        assert ("kl_ref" in stats) == (kind != "ppo"), sorted(stats)

        per_token_adv = [[x] * s.n_trained for x, s in zip(adv, samples)]
        batch = padded(samples, logprobs=old, prox_logp=old, ref_logp=ref, advantages=per_token_adv)
        cfg = PPOActorConfig(
            path=model_dir, optimizer=SGD_LIKE, behav_imp_weight_cap=None, use_decoupled_loss=False, **settings
        )
        actor = PPOActor(cfg, b.engine, ref_engine=b.engine)
        await b.with_engine("ppo_update", lambda _: actor.ppo_update(batch))
        worst = largest_difference(before, a, b)
        assert worst < 1e-6, worst
        await shutdown(a, b)

    run(go())


def test_train_dpo_then_optim_step_equals_the_dpo_actor(model_dir):
    async def go():
        a = await ModelBuilder(model_dir, sgd_config()).spawn_train("dpo_a")
        b = await ModelBuilder(model_dir, sgd_config()).spawn_train("dpo_b")
        samples = random_samples(8, seed=9)  # pairs (0, 1), (2, 3)...
        ref = [[x - 0.1 * (i % 3) for x in lp] for i, lp in enumerate(await async_map(a.logprobs_per_token, samples))]
        before = params(a.engine)
        await async_map(
            lambda i: a.train_dpo(samples[2 * i], samples[2 * i + 1], ref[2 * i], sum(ref[2 * i + 1]), 0.5), range(4)
        )
        await a.optim_step()
        cfg = DPOConfig(path=model_dir, optimizer=SGD_LIKE, beta=0.5, mb_spec=MicroBatchSpec(granularity=2))
        actor = DPOActor(cfg, b.engine, b.engine)
        await b.with_engine("train_dpo", lambda _: actor.train_dpo(padded(samples, ref_logp=ref)))
        worst = largest_difference(before, a, b)
        assert worst < 1e-6, worst
        await shutdown(a, b)

    run(go())


def test_train_tangents_from_autodiff_of_the_grpo_loss_equals_train_grpo(model_dir):
    clip, beta = 0.2, 0.1

    async def go():
        a = await ModelBuilder(model_dir, sgd_config()).spawn_train("tan_a")
        b = await ModelBuilder(model_dir, sgd_config()).spawn_train("tan_b")
        samples, current, old, ref, adv = await grpo_inputs(a, 6, seed=3)

        # The GRPO loss of the whole batch as a function of the log-probabilities, differentiated.
        lens = [len(lp) for lp in current]
        logp = torch.tensor([x for lp in current for x in lp], requires_grad=True)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        mask = torch.ones(len(logp), dtype=torch.bool)
        prox = torch.tensor([x for lp in old for x in lp])
        per_token_adv = torch.tensor([a for a, n in zip(adv, lens) for _ in range(n)])
        per_token, _ = F.ppo_policy_loss(logp, prox, prox, per_token_adv, mask, cu, eps_clip=clip)
        per_token = per_token + beta * F.kl_k3(logp, torch.tensor([x for lp in ref for x in lp]))
        F.token_mean(per_token, mask, cu).backward()
        tangents = logp.grad.split(lens)

        before = params(a.engine)
        await async_map(lambda i: a.train_tangents(samples[i], tangents[i].tolist()), range(6))
        await a.optim_step()
        await async_map(lambda i: b.train_grpo(samples[i], old[i], ref[i], adv[i], clip, beta), range(6))
        await b.optim_step()
        worst = largest_difference(before, a, b)
        assert worst < 1e-6, worst
        await shutdown(a, b)

    run(go())


def test_train_calls_count_at_the_call_whether_awaited_or_not(model_dir):
    """The reference interface's walkthrough calls ``model.train_grpo(...)`` without ``await``: every
    ``train_*`` call queues its sample when it returns (a bare call counts, no coroutine is left
    unawaited), and awaiting it, or mapping it with `async_map`, works as before and trains alike."""

    async def go():
        a = await ModelBuilder(model_dir, sgd_config()).spawn_train("bare_a")
        b = await ModelBuilder(model_dir, sgd_config()).spawn_train("bare_b")
        samples, _, old, ref, adv = await grpo_inputs(a, 4, seed=12)
        before = params(a.engine)
        for i, s in enumerate(samples):
            queued = a.train_grpo(s, old[i], ref[i], [adv[i]] * s.n_trained, 0.2, 0.05)
            assert not inspect.iscoroutine(queued)
        await async_map(lambda i: b.train_grpo(samples[i], old[i], ref[i], adv[i], 0.2, 0.05), range(4))
        assert (await a.optim_step(1e-3))["n_samples"] == 4
        await b.optim_step(1e-3)
        assert largest_difference(before, a, b) < 1e-7

        a.train_sft(samples[0])
        a.train_ppo(samples[1], old[1], torch.tensor(adv[1]))  # a 0-d tensor is one advantage
        a.train_gspo(samples[2], old[2], ref[2], adv[2])
        a.train_dpo(samples[0], samples[3], ref[0], ref[3])
        a.train_tangents(samples[3], [0.1] * samples[3].n_trained)
        stats = await a.optim_step(1e-3)
        assert stats["n_samples"] == 5, stats
        assert await a.train_sft(samples[0]) is None, "awaiting a train_* call gives None"
        with pytest.raises(ValueError, match="no assistant turn"):
            a.train_grpo(await a.tokenize_thread(StringThread([("user", "q")])), [], [], 1.0)  # raises at the call
        await a.optim_step(1e-3)
        await shutdown(a, b)

    run(go())


def test_a_model_builds_one_actor_per_loss_setting_not_per_step(model_dir, monkeypatch):
    """The actor behind a ``train_*`` loss is built at the first step that trains with its settings
    and kept: later steps with the same settings reuse it, other settings get their own."""
    from areal_lite.recipes import losses

    built: list[str] = []

    def counting(cls):
        class Counted(cls):
            def __init__(self, *args, **kwargs):
                built.append(cls.__name__)
                super().__init__(*args, **kwargs)

        return Counted

    for cls in (losses.PPOActor, losses.DPOActor):
        monkeypatch.setattr(losses, cls.__name__, counting(cls))

    async def go():
        model = await ModelBuilder(model_dir, sgd_config()).spawn_train("actors_once")
        samples, _, old, ref, adv = await grpo_inputs(model, 4, seed=21)
        for step in range(3):
            model.train_grpo(samples[step], old[step], ref[step], adv[step], 0.2, 0.05)
            model.train_dpo(samples[0], samples[3], ref[0], ref[3])
            if step == 1:
                model.train_ppo(samples[3], old[3], adv[3])
            await model.optim_step(1e-3)
        assert sorted(built) == ["DPOActor", "PPOActor", "PPOActor"], built
        await shutdown(model)

    run(go())


def test_forward_backward_is_one_pass_and_equals_logprobs_then_tangents(model_dir):
    """``forward_backward(samples, loss)``: one forward pass (counted) returns the log-probabilities
    ``logprobs_per_token`` gives, and its step equals ``train_tangents`` with the loss's autodiff
    tangents then ``optim_step`` (the two-pass path), SGD-like, to float noise."""
    clip, beta = 0.2, 0.1

    async def go():
        a = await ModelBuilder(model_dir, sgd_config()).spawn_train("fb_a")
        b = await ModelBuilder(model_dir, sgd_config()).spawn_train("fb_b")
        samples, _, old, ref, adv = await grpo_inputs(a, 6, seed=5)

        def loss(logp: torch.Tensor, i: int) -> torch.Tensor:
            n = logp.numel()
            prox, r = torch.tensor(old[i], dtype=logp.dtype), torch.tensor(ref[i], dtype=logp.dtype)
            cu = torch.tensor([0, n], dtype=torch.int32)
            per_token, _ = F.ppo_policy_loss(
                logp, prox, prox, torch.full((n,), adv[i]), torch.ones(n, dtype=torch.bool), cu, eps_clip=clip
            )
            return (per_token + beta * F.kl_k3(logp, r)).sum()

        forwards = []
        hook = a.engine.model.register_forward_pre_hook(lambda *_: forwards.append(1))
        before = params(a.engine)
        one_pass = await a.forward_backward(samples, loss)
        hook.remove()
        assert len(forwards) == 1
        await a.optim_step()

        two_pass = await async_map(b.logprobs_per_token, samples)
        for x, y in zip(one_pass, two_pass):
            torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=0, atol=1e-6)
        for i, (s, lp) in enumerate(zip(samples, two_pass)):
            logp = torch.tensor(lp, requires_grad=True)
            loss(logp, i).backward()
            await b.train_tangents(s, logp.grad.tolist())
        await b.optim_step()
        # The two-pass gradient goes through the tangents as float32 numbers (autodiff of the loss
        # on the first pass's values), the one-pass gradient straight through the loss: float noise.
        worst = largest_difference(before, a, b)
        assert worst < 5e-6, worst
        with pytest.raises(RuntimeError, match="no gradient accumulated"):
            await a.optim_step()  # the one-pass gradient was applied once
        await shutdown(a, b)

    run(go())


def test_concurrent_calls_are_packed(model_dir):
    """16 concurrent log-prob requests make one forward pass; 16 train calls, awaited together or
    one by one, one forward-backward pass at the step."""

    async def go():
        model = await ModelBuilder(model_dir, sgd_config()).spawn_train("packing")
        calls = {"forward": 0, "forward_backward": 0}
        for name in calls:
            method = getattr(model.engine, name)

            def counted(*args, _m=method, _n=name, **kwargs):
                calls[_n] += 1
                return _m(*args, **kwargs)

            setattr(model.engine, name, counted)
        samples = random_samples(16, seed=5)
        logprobs = await async_map(model.logprobs_per_token, samples)
        assert calls["forward"] == 1 and [len(lp) for lp in logprobs] == [s.n_trained for s in samples]
        for s, lp in zip(samples, logprobs):  # one by one
            await model.train_grpo(s, lp, lp, 1.0)
        stats = await model.optim_step()
        assert calls["forward_backward"] == 1 and stats["n_samples"] == 16
        await async_map(lambda i: model.train_sft(samples[i]), range(16))
        await async_map(lambda i: model.train_grpo(samples[i], logprobs[i], logprobs[i], -1.0), range(4))
        stats = await model.optim_step()
        assert calls["forward_backward"] == 3, "one pass per kind of loss"
        assert "sft/loss" in stats and "policy/loss" in stats and stats["n_samples"] == 20
        await shutdown(model)

    run(go())


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_cancelled_calls_leave_the_engine_thread_serving(model_dir):
    """Calls cancelled while they wait for the engine thread (a timeout, a failed task in a task
    group) are dropped when they finish there: the thread goes on serving the next calls instead of
    dying on setting a result nobody awaits (which hung every later call)."""

    async def go():
        model = await ModelBuilder(model_dir, sgd_config()).spawn_train("cancelled")
        samples = random_samples(8, seed=6)
        expected = await async_map(model.logprobs_per_token, samples)
        slow, release = model.engine.forward, threading.Event()

        def held(*args, **kwargs):
            release.wait(30)
            return slow(*args, **kwargs)

        model.engine.forward = held
        tasks = [asyncio.ensure_future(model.logprobs_per_token(s)) for s in samples]
        await asyncio.sleep(0.5)  # the calls are in the engine thread, inside forward
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        release.set()
        model.engine.forward = slow
        again = await asyncio.wait_for(async_map(model.logprobs_per_token, samples), 60)
        assert [a == pytest.approx(e, abs=1e-5) for a, e in zip(again, expected)] == [True] * len(samples)
        await shutdown(model)

    run(go())


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_generation_uses_the_current_weights_and_clones_stay_frozen(model_dir, lora_rank):
    async def go():
        cfg = ModelConfig(
            max_seq_len=64, gconfig=GenerationConfig(max_new_tokens=6, ignore_eos=True), lora=LoRAConfig(rank=lora_rank)
        )
        model = await ModelBuilder(model_dir, cfg).spawn_train("gen")
        trainable = {n for n, p in model.engine.model.named_parameters() if p.requires_grad}
        assert trainable and all(("lora_" in n) == bool(lora_rank) for n in trainable)
        syncs = []
        update, connect = model.engine.update_weights, model.engine.connect_engine
        model.engine.update_weights = lambda meta: (syncs.append(1), update(meta))[1]
        # With LoRA, connecting sends the adapter at once (requests name it); that is not a sync.
        model.engine.connect_engine = lambda engine, meta: (connect(engine, meta), syncs.pop() if lora_rank else None)[
            0
        ]
        prompt = await model.tokenize_thread(StringThread([("user", "hello")]))
        ref = await model.clone_inf()
        first = await model.generate_tokens(prompt)
        torch.testing.assert_close(first.logprobs, await model.logprobs_per_token(first), atol=1e-4, rtol=0)
        ref_before = await ref.logprobs_per_token(first)
        for _ in range(3):  # several steps between generations: one sync
            await model.train_sft(first)
            await model.optim_step(1e-2)
        assert syncs == []
        second = await async_map(model.generate_tokens, [prompt] * 4)
        assert len(syncs) == 1, "concurrent generations after steps share one weight sync"
        for s in second:  # sampled by the stepped weights: their log-probs are the train engine's now
            torch.testing.assert_close(s.logprobs, await model.logprobs_per_token(s), atol=1e-4, rtol=0)
        assert await ref.logprobs_per_token(first) == ref_before, "a clone keeps the weights it was cloned with"
        moved = await model.logprobs_per_token(first)
        assert max(abs(x - y) for x, y in zip(moved, ref_before)) > 1e-3
        text = await model.generate(StringThread([("user", "hello")]))
        assert text.turns[-1][0] == "assistant" and await ref.generate(StringThread([("user", "hi")]))
        await shutdown(ref, model)

    run(go())


@pytest.mark.slow
@pytest.mark.parametrize("weight_update", ["disk", "distributed", "ipc"])
def test_generation_on_a_server_follows_the_steps(model_dir, tmp_path, weight_update):
    """With ``servers`` the policy generates on our SGLang-protocol server, and a step's weights
    reach it (through files, a gloo broadcast, or shared memory) before the next generation. Slow:
    about 17 s each, most of it the server's start."""
    from inference_servers import start_servers, stop_servers

    procs, addresses = start_servers(model_dir, 1)
    try:

        async def go():
            cfg = ModelConfig(
                max_seq_len=64, gconfig=GenerationConfig(max_new_tokens=6, ignore_eos=True), servers=addresses,
                weight_update=weight_update, work_dir=str(tmp_path),
            )  # fmt: skip
            model = await ModelBuilder(model_dir, cfg).spawn_train(f"served_{weight_update}")
            prompt = await model.tokenize_thread(StringThread([("user", "hello")]))
            first = await model.generate_tokens(prompt)
            torch.testing.assert_close(first.logprobs, await model.logprobs_per_token(first), atol=1e-4, rtol=0)
            await model.train_sft(first)
            await model.optim_step(1e-2)
            second = await model.generate_tokens(prompt)
            torch.testing.assert_close(second.logprobs, await model.logprobs_per_token(second), atol=1e-4, rtol=0)
            assert await model.logprobs_per_token(first) != first.logprobs, "the step changed the weights"
            await shutdown(model)

        run(go())
    finally:
        stop_servers(procs)


@pytest.mark.slow
def test_the_megatron_backend_scores_like_fsdp_and_generates_with_its_weights(model_dir):
    """``backend=megatron``: the same log-probabilities as FSDP, and after a step the embedded
    engine has Megatron's weights (converted to HF names). Slow: Megatron's start."""

    async def go():
        cfg = sgd_config(gconfig=GenerationConfig(max_new_tokens=5, ignore_eos=True))
        fsdp = await ModelBuilder(model_dir, cfg).spawn_train("as_fsdp")
        mcore = await ModelBuilder(model_dir, replace(cfg, backend="megatron")).spawn_train("as_megatron")
        samples = random_samples(6, seed=3)
        expected = await async_map(fsdp.logprobs_per_token, samples)
        got = await async_map(mcore.logprobs_per_token, samples)
        assert max(abs(x - y) for a, b in zip(got, expected) for x, y in zip(a, b)) < 1e-5
        await async_map(mcore.train_sft, samples)
        await mcore.optim_step()
        prompt = TokenizedThread(samples[0].turns[:1])
        sampled = await mcore.generate_tokens(prompt)
        torch.testing.assert_close(sampled.logprobs, await mcore.logprobs_per_token(sampled), atol=1e-4, rtol=0)
        await shutdown(fsdp, mcore)

    run(go())


def test_save_writes_the_current_weights(model_dir, tmp_path):
    async def go():
        model = await ModelBuilder(model_dir, sgd_config()).spawn_train("saved")
        s = random_samples(2, seed=6)
        await model.train_sft(s[0])
        await model.optim_step(1e-3)
        await model.save(str(tmp_path / "out"))
        loaded = await ModelBuilder(str(tmp_path / "out"), sgd_config()).spawn_inference("loaded")
        torch.testing.assert_close(await loaded.logprobs_per_token(s[1]), await model.logprobs_per_token(s[1]))
        await loaded.close()
        again = await ModelBuilder(str(tmp_path / "out"), sgd_config()).spawn_inference(
            "loaded"
        )  # the name is free again
        await shutdown(again, model)

    run(go())


def test_bad_input_gets_a_clear_error(model_dir):
    async def go():
        model = await ModelBuilder(model_dir, sgd_config()).spawn_train("errors")
        no_answer = await model.tokenize_thread(StringThread([("user", "what?")]))
        with pytest.raises(ValueError, match="no assistant turn"):
            await model.train_sft(no_answer)
        with pytest.raises(ValueError, match="no assistant turn"):
            await model.train_grpo(no_answer, [], [], 1.0)
        with pytest.raises(ValueError, match="no trained token"):
            await model.logprobs_per_token(no_answer)
        s = random_samples(1, seed=7)[0]
        with pytest.raises(
            ValueError, match=rf"tangents has {s.n_trained + 1} values but the thread has {s.n_trained} trained tokens"
        ):
            await model.train_tangents(s, [0.0] * (s.n_trained + 1))
        with pytest.raises(ValueError, match="logprobs has 1 values"):
            await model.train_grpo(s, [0.0], [0.0] * s.n_trained, 1.0)
        with pytest.raises(RuntimeError, match="no gradient accumulated: call a train_\\* method first"):
            await model.optim_step()
        with pytest.raises(TypeError, match="TokenizedThread"):
            await model.train_ppo(StringThread([("user", "q")]).assistant("a"), [0.0], 1.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="longer than max_seq_len"):
            await model.tokenize_thread(StringThread([("user", "x " * 200)]))
        with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
            await model.logprobs_per_token(sample([1, 2], [10**6]))
        with pytest.raises(TypeError, match="tokenize_thread takes a StringThread, got dict"):
            await model.tokenize_thread({"turns": []})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="detokenize_thread takes a TokenizedThread, got StringThread"):
            await model.detokenize_thread(StringThread([("user", "q")]))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="generate takes a StringThread"):
            await model.generate([("user", "q")])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="exists already"):
            await ModelBuilder(model_dir).spawn_train("errors")
        await shutdown(model)
        with pytest.raises(RuntimeError, match="closed"):
            await model.logprobs_per_token(s)

    run(go())


def test_a_recipe_ported_from_the_reference_interface_runs(model_dir, tmp_path):
    """The frictions of porting a GRPO recipe written against the reference interface alone: a
    StringThread passed to generate_tokens through async_map_batch(repeat_thread(...)) is
    tokenized; serialize_tokenized_thread feeds train_tangents' serialized form, which equals the
    thread form; save_model_safely never overwrites; a subclass of the exported Recipe gets
    training_completion_percentage."""

    class PortedGRPO(Recipe):
        name = "ported-grpo"

        def __init__(self, items: list[StringThread], model, group: int, steps: int) -> None:
            super().__init__({"model": model}, DataSet(items, allow_looping=True, seed=1), steps, None, None)
            self.model, self.group, self.progress = model, group, []

        async def gen_data(self, prompt: StringThread) -> list[TokenizedThread]:
            return await async_map_batch(self.model.generate_tokens, repeat_thread(prompt), batch_size=self.group)

        async def train_step(self, run) -> dict[str, float]:
            self.progress.append(self.training_completion_percentage)
            samples = (await async_map_batch(self.gen_data, self.dataset, 2))[0]
            texts = await async_map(self.model.detokenize_thread, samples)
            assert all(t.completion() is not None for t in texts)
            for s in samples:
                lp = await self.model.logprobs_per_token(s)
                tokens, patches, weights = await self.model.serialize_tokenized_thread(s)
                full = [0.0] * (len(tokens) - 1)
                trained = [i - 1 for i, w in enumerate(weights) if w > 0]
                for i, x in zip(trained, lp):
                    full[i] = -0.01 * x
                await self.model.train_tangents(tokens[:-1], patches, full, tokens[1:])
            return await self.model.optim_step(1e-3)

    async def go():
        model = await ModelBuilder(model_dir, sgd_config()).spawn_train("ported")
        recipe = PortedGRPO([StringThread([("user", "12+30=")]), StringThread([("user", "7+8=")])], model, 3, 2)
        await recipe.run()
        assert recipe.progress == [0.0, 0.5] and recipe.training_completion_percentage == 0.5
        with pytest.raises(TypeError, match="takes a TokenizedThread .or a StringThread, tokenized., got dict"):
            await model.generate_tokens({"turns": []})  # type: ignore[arg-type]

        first = await model.save_model_safely(str(tmp_path / "saved"))
        second = await model.save_model_safely(str(tmp_path / "saved"))
        assert (first, second) == (str(tmp_path / "saved"), str(tmp_path / "saved-1"))

        # The serialized form of train_tangents trains exactly like the thread form.
        a = await ModelBuilder(model_dir, sgd_config()).spawn_train("serialized")
        b = await ModelBuilder(model_dir, sgd_config()).spawn_train("threaded")
        s = random_samples(1, seed=11)[0]
        tangents = [0.1 * (i + 1) for i in range(s.n_trained)]
        tokens, patches, weights = await a.serialize_tokenized_thread(s)
        assert patches == [] and weights == s.weights and tokens == s.tokens
        full = [0.0] * (len(tokens) - 1)
        for i, t in zip([i - 1 for i, w in enumerate(weights) if w > 0], tangents):
            full[i] = t
        before = params(a.engine)
        await a.train_tangents(tokens[:-1], patches, full, tokens[1:])
        await a.optim_step(1e-3)
        await b.train_tangents(s, tangents)
        await b.optim_step(1e-3)
        assert largest_difference(before, a, b) < 1e-7
        with pytest.raises(ValueError, match=r"tokens\[:-1\] and tokens\[1:\]"):
            await a.train_tangents(tokens[:-1], patches, full, tokens[:-1])
        await shutdown(model, a, b)

    run(go())


def test_tp_that_the_backend_cannot_honour_raises(model_dir):
    with pytest.raises(ValueError, match="fsdp backend has no tensor parallelism"):
        ModelBuilder(model_dir).tp(2)
    assert ModelBuilder(model_dir).tp(1).config.tensor_parallel_size == 1
    megatron = ModelBuilder(model_dir, ModelConfig(backend="megatron")).tp(2)
    with pytest.raises(ValueError, match="fsdp backend has no tensor parallelism"):
        run(megatron.with_config(backend="fsdp").spawn_train("tp_fsdp"))


# ----------------------------------------------------------------------------- two ranks


def test_two_ranks_train_like_one_on_the_union(model_dir, tmp_path):
    """train_grpo on 3 + 5 samples over two ranks then optim_step equals one rank on all 8; ranks
    that ask for different numbers of log-probs, and a generation on one rank only (whose weight
    sync the other joins), stay in step."""
    one, *_ = run(grpo_delta(model_dir))
    code, output = torchrun(2, SCRIPTS / "recipes_worker.py", model_dir, str(tmp_path))
    assert code == 0, output[-4000:]
    two = torch.load(tmp_path / "grpo_delta_w2.pt")
    assert two["rounds"] > 0, "the ranks exchanged what they had pending"
    assert sum(float(v.abs().sum()) for v in one.values()) > 0, "the update did nothing"
    worst = max(float((one[k] - two["delta"][k]).abs().max()) for k in one)
    assert worst < 1e-6, worst


# ----------------------------------------------------------------------------- helpers


def test_async_map_batch_retries_and_replaces_failing_items():
    attempts: dict[int, int] = {}

    async def flaky(x: int) -> int:
        attempts[x] = attempts.get(x, 0) + 1
        await asyncio.sleep(0.001 * (x % 3))
        if x == 1 and attempts[x] == 1:
            raise RuntimeError("transient")
        if x == 2:
            raise RuntimeError("always")
        return x * 10

    out = run(async_map_batch(flaky, iter(range(100)), 4, retries=1))
    assert out == [0, 10, 30, 40] and attempts[1] == 2 and attempts[2] == 2
    with pytest.raises(RuntimeError, match="always"):
        run(async_map_batch(flaky, iter([2, 2, 2, 2]), 2, retries=0, max_failures=2))
    with pytest.raises(ValueError, match="ran out"):
        run(async_map_batch(flaky, iter([0, 2]), 2, retries=0))
    assert run(async_map(lambda x: asyncio.sleep(0, x + 1), [1, 2, 3])) == [2, 3, 4]


def test_dataset_minibatches_and_schedule():
    data = DataSet(list(range(10)), allow_looping=True, seed=3)
    first = [next(data) for _ in range(10)]
    assert sorted(first) == list(range(10))
    second = [next(data) for _ in range(10)]
    assert sorted(second) == list(range(10)) and second != first, "each epoch reshuffles"
    state = data.state_dict()
    more = [next(data) for _ in range(4)]
    data.load_state_dict(state)
    assert [next(data) for _ in range(4)] == more
    once = DataSet(["a", "b"], allow_looping=False)
    assert sorted(once) == ["a", "b"]
    mbs = get_minibatches(list(range(10)), 4, n_epochs=2, seed=0)
    assert [len(m) for m in mbs] == [4, 4, 2, 4, 4, 2] and sorted(x for m in mbs[:3] for x in m) == list(range(10))
    sched = CosineScheduler(1.0, min_lr_ratio=0.1, warmup_fraction=0.1)
    assert sched(0.05) == pytest.approx(0.5) and sched(0.1) == pytest.approx(1.0) and sched(1.0) == pytest.approx(0.1)


def test_graders(model_dir):
    class Counted(Grader):
        def __init__(self, value: float) -> None:
            self.value, self.set_up = value, 0

        async def setup(self) -> None:
            self.set_up += 1

        async def score_float_value(self, thread: StringThread) -> float:
            return self.value

    async def go():
        thread = StringThread([("user", "57+68=")], {"answer": "125"}).assistant("125")
        exact = RewardFnGrader(exact_answer_reward, mode="inline")
        short = FunctionGrader(lambda t: float(len(t.completion()) <= 3), name="short")
        counted = Counted(0.5)
        combined = CombinedGrader({"exact": exact, "short": short, "half": counted}, {"exact": 2.0, "half": 4.0})
        await combined.setup()
        assert counted.set_up == 1, "setup sets every child up"
        assert await combined.score_components(thread) == {"exact": 1.0, "short": 1.0, "half": 0.5, "total": 5.0}
        assert await exact.score_float_value(thread.prompt().assistant("124")) == 0.0
        with pytest.raises(ValueError, match="2 weights for 3"):
            CombinedGrader([exact, short, counted], [1.0, 2.0])

        judge = JudgeGrader(ModelBuilder(model_dir, ModelConfig(max_seq_len=256)), name="judge_model")
        with pytest.raises(TypeError, match="setup"):
            await judge.score_float_value(thread)
        await judge.setup()
        assert await judge.score_float_value(thread) in (0.0, 1.0) and isinstance(judge.last_verdict, str)
        await judge.close()
        await shutdown()

    run(go())


def test_a_custom_grader_only_needs_score_float_value():
    """A grader written inside a recipe may be any object with ``score_float_value``: CombinedGrader
    sets up and closes the children that have ``setup`` / ``close``, and refuses at once an object
    that cannot score."""

    class Mine:
        async def score_float_value(self, thread: StringThread) -> float:
            return 2.0

    async def go():
        combined = CombinedGrader({"mine": Mine(), "one": FunctionGrader(lambda t: 1.0)}, {"mine": 0.5})  # type: ignore[dict-item]
        await combined.setup()
        assert await combined.score_float_value(StringThread([("user", "q")]).assistant("a")) == 2.0
        await combined.close()

    run(go())
    with pytest.raises(TypeError, match="score_float_value"):
        CombinedGrader({"fn": lambda t: 1.0})  # type: ignore[dict-item]
