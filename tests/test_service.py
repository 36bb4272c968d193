"""The Tinker-compatible service (``python -m areal_lite.service``) driven by the real ``tinker``
SDK over HTTP on 127.0.0.1, on a tiny model: a supervised loop lowers the NLL, an RL loop
(sample, reward, ``importance_sampling``, ``optim_step``) raises the reward, save then load gives
identical log-probabilities and identical next steps, two LoRA clients training at once do not
touch each other's weights, every built-in loss has the value of its definition (sums, per-datum
weights, ``loss_fn_config``), sampler snapshots stay fixed, and bad requests fail clearly (a refused
training request in its turn: the client's later requests run). Raw HTTP
covers what the SDK hides: JSON and protobuf bodies (zstd or not), request order, ``try_again``,
heartbeats."""

from __future__ import annotations

import json
import math
import threading
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from areal_lite.service.launch import local_service
from areal_lite.utils.tiny import build_tiny_model

KEY = "tml-test-key"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42.",
    "Solve step by step: 7 * 6 = 42, then 42 - 2 = 40.",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tinker") / "tiny"), hidden_size=64, num_layers=2)


@pytest.fixture(scope="module")
def url(model: str, tmp_path_factory: pytest.TempPathFactory):
    workdir = str(tmp_path_factory.mktemp("tinker_workdir"))
    with local_service([model], workdir, "--api-key", KEY, "--poll-timeout", "2") as base_url:
        yield base_url


@pytest.fixture
def service(url: str):
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def sft_datum(tokenizer, text: str, weight: float = 1.0) -> types.Datum:
    ids = tokenizer.encode(text)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [weight] * (len(ids) - 1)},
    )


def logprobs_of(tc, data: list[types.Datum]) -> list[np.ndarray]:
    out = tc.forward(data, "cross_entropy").result()
    return [np.asarray(o["logprobs"].data, dtype=np.float32) for o in out.loss_fn_outputs]


def mean_nll(tc, data: list[types.Datum]) -> float:
    return -float(np.mean(np.concatenate(logprobs_of(tc, data))))


def test_supervised_loop_lowers_nll(service, model: str, tokenizer) -> None:
    tc = service.create_lora_training_client(base_model=model, rank=8, seed=0).result()
    assert tc.get_info().lora_rank == 8 and tc.get_tokenizer().encode("hi") == tokenizer.encode("hi")
    data = [sft_datum(tokenizer, s) for s in SENTENCES]
    before = mean_nll(tc, data)
    for _ in range(8):
        fwd = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        out = fwd.result()
        opt.result()
        # loss:sum is the sum of -w * logprob over every datum's tokens, the logprobs returned with it
        lps = np.concatenate([o["logprobs"].data for o in out.loss_fn_outputs])
        assert out.metrics["loss:sum"] == pytest.approx(-lps.sum(), rel=1e-5)
    after = mean_nll(tc, data)
    assert after < 0.6 * before, (before, after)


def test_rl_loop_raises_reward(service, model: str, tokenizer) -> None:
    """Reward: the share of digits in a completion; group-centred advantages; importance_sampling."""
    tc = service.create_lora_training_client(base_model=model, rank=8, seed=0).result()
    digits = {tokenizer.convert_tokens_to_ids(c) for c in "0123456789"}
    prompts = [tokenizer.encode(p) for p in ["What is", "Solve:", "The answer", "Count"]]
    rewards = []
    for step in range(12):
        sampler = tc.save_weights_and_get_sampling_client().result()
        # A seed per request: the draws do not depend on which request the service reaches first.
        futures = [
            sampler.sample(
                types.ModelInput.from_ints(p), 8, types.SamplingParams(max_tokens=8, stop=[], seed=step * 8 + i)
            )
            for i, p in enumerate(prompts)
        ]
        data, step_rewards = [], []
        for p, f in zip(prompts, futures):
            seqs = f.result().sequences
            assert len(seqs) == 8 and all(len(s.tokens) == 8 and s.stop_reason == "length" for s in seqs)
            r = np.array([np.mean([t in digits for t in s.tokens]) for s in seqs])
            step_rewards.append(r.mean())
            for s, a in zip(seqs, r - r.mean()):
                n = len(p) - 1
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(p + s.tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": [0] * n + s.tokens,
                            "logprobs": [0.0] * n + s.logprobs,
                            "advantages": [0.0] * n + [float(a)] * len(s.tokens),
                        },
                    )
                )
        rewards.append(float(np.mean(step_rewards)))
        fwd = tc.forward_backward(data, "importance_sampling")
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        fwd.result(), opt.result()
    assert rewards[0] < 0.15 and max(rewards[-3:]) > 0.5, rewards


def test_save_then_load_gives_identical_logprobs_and_steps(service, model: str, tokenizer) -> None:
    tc = service.create_lora_training_client(base_model=model, rank=4, seed=1).result()
    data = [sft_datum(tokenizer, s) for s in SENTENCES]
    adam = types.AdamParams(learning_rate=5e-3)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(adam).result()
    path = tc.save_state("ckpt").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/ckpt")
    restored = service.create_training_client_from_state_with_optimizer(path).result()
    weights_only = service.create_training_client_from_state(path).result()
    expected = logprobs_of(tc, data)
    for other in (restored, weights_only):
        for a, b in zip(expected, logprobs_of(other, data)):
            np.testing.assert_array_equal(a, b)
    # The optimizer state came back too: the next step is the same step.
    for client in (tc, restored, weights_only):
        client.forward_backward(data, "cross_entropy")
        client.optim_step(adam).result()
    for a, b in zip(logprobs_of(tc, data), logprobs_of(restored, data)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(logprobs_of(tc, data), logprobs_of(weights_only, data)))


def test_two_lora_clients_train_at_once_without_touching_each_other(service, model: str, tokenizer) -> None:
    """A and B train concurrently (their requests interleave on the shared base); each ends
    exactly where the same training alone gets (C for A, D for B, run after, one at a time)."""
    a, b, c, d = (
        service.create_lora_training_client(base_model=model, rank=rank, seed=seed).result()
        for rank, seed in ((8, 11), (4, 22), (8, 11), (4, 22))
    )
    data_a = [sft_datum(tokenizer, SENTENCES[0])]
    data_b = [sft_datum(tokenizer, SENTENCES[1]), sft_datum(tokenizer, SENTENCES[2])]

    def train(tc, data, lr: float) -> None:
        for _ in range(4):
            tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=lr)).result()

    threads = [threading.Thread(target=train, args=args) for args in ((a, data_a, 1e-2), (b, data_b, 3e-3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    train(c, data_a, 1e-2)
    train(d, data_b, 3e-3)
    probe = data_a + data_b
    for trained, alone in ((a, c), (b, d)):
        for x, y in zip(logprobs_of(trained, probe), logprobs_of(alone, probe)):
            np.testing.assert_array_equal(x, y)
    assert not np.array_equal(logprobs_of(a, probe)[1], logprobs_of(b, probe)[1])


def test_builtin_losses_are_sums_of_their_definitions(service, model: str, tokenizer) -> None:
    tc = service.create_lora_training_client(base_model=model, rank=4, seed=3).result()
    rng = np.random.default_rng(0)
    plain = [sft_datum(tokenizer, s) for s in SENTENCES]
    lp = logprobs_of(tc, plain)
    q = [x + rng.normal(0, 0.3, x.shape).astype(np.float32) for x in lp]  # a sampler that differed
    adv = [rng.normal(0, 1, x.shape).astype(np.float32) for x in lp]
    w = [rng.uniform(0, 2, x.shape).astype(np.float32) for x in lp]
    mask = [(rng.uniform(size=x.shape) > 0.3).astype(np.float32) for x in lp]

    def data(**extra) -> list[types.Datum]:
        return [
            types.Datum(
                model_input=d.model_input,
                loss_fn_inputs={
                    "target_tokens": d.loss_fn_inputs["target_tokens"],
                    **{k: v[i] for k, v in extra.items()},
                },
            )
            for i, d in enumerate(plain)
        ]

    def gspo(lo: float, hi: float) -> float:
        total = 0.0
        for x, y, a, m in zip(lp, q, adv, mask):
            s = math.exp(float(np.sum((x - y) * m) / m.sum()))
            total -= float(np.sum(np.minimum(s * a, np.clip(s, lo, hi) * a)))
        return total

    ratio = [np.exp(x - y) for x, y in zip(lp, q)]
    cases = [
        ("cross_entropy", data(weights=w), None, -sum(float(np.sum(x * v)) for x, v in zip(lp, w))),
        (
            "importance_sampling",
            data(logprobs=q, advantages=adv),
            None,
            -sum(float(np.sum(r * a)) for r, a in zip(ratio, adv)),
        ),
        (
            "ppo",
            data(logprobs=q, advantages=adv),
            {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
            -sum(float(np.sum(np.minimum(r * a, np.clip(r, 0.9, 1.1) * a))) for r, a in zip(ratio, adv)),
        ),
        (
            "cispo",
            data(logprobs=q, advantages=adv),
            None,
            -sum(float(np.sum(np.clip(r, 0.8, 1.2) * x * a)) for r, x, a in zip(ratio, lp, adv)),
        ),
        (
            "dro",
            data(logprobs=q, advantages=adv),
            {"beta": 0.5},
            -sum(float(np.sum(x * a - 0.25 * (x - y) ** 2)) for x, y, a in zip(lp, q, adv)),
        ),
        (
            "gspo",
            data(logprobs=q, advantages=adv, sequence_ratio_mask=mask),
            {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05},
            gspo(0.95, 1.05),
        ),
    ]
    for name, batch, config, expected in cases:
        fwd = tc.forward(batch, name, config).result()
        assert fwd.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4), name
        for o, x in zip(fwd.loss_fn_outputs, lp):
            np.testing.assert_allclose(o["logprobs"].data, x, rtol=0, atol=1e-5)
        both = tc.forward_backward(batch, name, config).result()  # the same value from the training pass
        assert both.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4), name
        tc.optim_step(types.AdamParams(learning_rate=0.0)).result()  # drop the gradient


def test_an_optional_input_some_datums_leave_out_takes_its_default(service, model: str, tokenizer) -> None:
    """``weights`` defaults to 1 per datum: a batch where only some datums carry it is the batch
    with ones filled in (and likewise a per-token clip threshold and its ``loss_fn_config``)."""
    tc = service.create_lora_training_client(base_model=model, rank=4, seed=13).result()
    weighted = sft_datum(tokenizer, SENTENCES[0], weight=2.0)
    ids = tokenizer.encode(SENTENCES[1])
    bare = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    out = tc.forward([weighted, bare], "cross_entropy").result()
    expected = tc.forward([weighted, sft_datum(tokenizer, SENTENCES[1])], "cross_entropy").result()
    assert out.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-6)
    rl = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "logprobs": [-3.0] * d.model_input.length,
                "advantages": [1.0] * d.model_input.length,
                **extra,
            },
        )
        for d, extra in ((weighted, {"clip_high_threshold": [1.1] * weighted.model_input.length}), (bare, {}))
    ]
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.5}
    both = [rl[0], types.Datum(model_input=bare.model_input, loss_fn_inputs={**rl[1].loss_fn_inputs,
            "clip_high_threshold": [1.5] * bare.model_input.length})]  # fmt: skip
    assert tc.forward(rl, "ppo", config).result().metrics["loss:sum"] == pytest.approx(
        tc.forward(both, "ppo", config).result().metrics["loss:sum"], rel=1e-6
    )


def test_sums_scale_the_gradient_with_data_and_weights(service, model: str, tokenizer) -> None:
    tc = service.create_lora_training_client(base_model=model, rank=4, seed=4).result()
    once = [sft_datum(tokenizer, SENTENCES[1])]

    def grad_norm(data) -> float:
        tc.forward_backward(data, "cross_entropy")
        return tc.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics["grad_norm"]

    g = grad_norm(once)
    assert grad_norm(once * 2) == pytest.approx(2 * g, rel=1e-5)
    assert grad_norm([sft_datum(tokenizer, SENTENCES[1], weight=3.0)]) == pytest.approx(3 * g, rel=1e-5)


def test_forward_backward_custom_runs_on_the_client_with_the_gradient_of_its_loss(
    service, model: str, tokenizer
) -> None:
    """The SDK runs a custom loss itself (``forward``, then a ``cross_entropy`` pass weighted by
    ``-dC/dlogp``): with C the weighted NLL, the gradient is cross_entropy's."""
    import torch

    tc = service.create_lora_training_client(base_model=model, rank=4, seed=10).result()
    data = [sft_datum(tokenizer, s, weight=w) for s, w in zip(SENTENCES, (1.0, 0.5, 2.0))]

    def nll(batch: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(batch, logprobs))
        return loss, {"custom_nll": float(loss.detach())}

    custom = tc.forward_backward_custom(data, nll).result()
    g_custom = tc.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics["grad_norm"]
    builtin = tc.forward_backward(data, "cross_entropy").result()
    g_builtin = tc.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics["grad_norm"]
    assert custom.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)
    assert custom.metrics["custom_nll"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)
    assert g_custom == pytest.approx(g_builtin, rel=1e-5)


def test_sampling_snapshots_stay_fixed_and_match_the_trainer(service, model: str, tokenizer) -> None:
    tc = service.create_lora_training_client(base_model=model, rank=8, seed=5).result()
    data = [sft_datum(tokenizer, s) for s in SENTENCES]
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    ids = tokenizer.encode(SENTENCES[1])
    first = tc.save_weights_and_get_sampling_client().result()
    named = tc.save_weights_for_sampler("snap").result().path
    before = first.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    assert before[0] is None
    # the sampler's log-probabilities are the trainer's (float32 on both: a ratio of 1)
    np.testing.assert_allclose(before[1:], logprobs_of(tc, [sft_datum(tokenizer, SENTENCES[1])])[0], atol=1e-4)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert first.compute_logprobs(types.ModelInput.from_ints(ids)).result() == before
    from_path = service.create_sampling_client(model_path=named).result()
    np.testing.assert_allclose(
        from_path.compute_logprobs(types.ModelInput.from_ints(ids)).result()[1:], before[1:], atol=1e-5
    )
    newer = tc.save_weights_and_get_sampling_client().result()
    assert newer.compute_logprobs(types.ModelInput.from_ints(ids)).result() != before

    # num_samples, stop tokens, a fixed seed, prompt log-probs
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[ids[2]])
    out = newer.sample(types.ModelInput.from_ints(ids[:2]), 5, params, include_prompt_logprobs=True).result()
    assert len(out.sequences) == 5 and len({s.sequence_id for s in out.sequences}) == 5
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 2
    for s in out.sequences:
        assert len(s.tokens) == len(s.logprobs) <= 6
        assert (s.stop_reason == "stop") == (s.tokens[-1] == ids[2]) and ids[2] not in s.tokens[:-1]
        assert s.stop_reason == "stop" or len(s.tokens) == 6
    again = newer.sample(types.ModelInput.from_ints(ids[:2]), 5, params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in out.sequences]
    greedy = newer.sample(
        types.ModelInput.from_ints(ids[:2]), 2, types.SamplingParams(max_tokens=4, temperature=0.0)
    ).result()
    assert greedy.sequences[0].tokens == greedy.sequences[1].tokens


def test_sampled_logprobs_are_the_trainers(service, model: str, tokenizer) -> None:
    tc = service.create_lora_training_client(base_model=model, rank=8, seed=6).result()
    tc.forward_backward([sft_datum(tokenizer, SENTENCES[0])], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tokenizer.encode("What is")
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=10, stop=[])).result()
    for s in seqs.sequences:
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(prompt + s.tokens[:-1]),
            loss_fn_inputs={"target_tokens": prompt[1:] + s.tokens},
        )
        trainer = logprobs_of(tc, [datum])[0][len(prompt) - 1 :]
        np.testing.assert_allclose(s.logprobs, trainer, atol=1e-4)


def test_stable_reinforce_uses_the_recorded_sampler_logprobs(service, model: str, tokenizer) -> None:
    tc = service.create_lora_training_client(base_model=model, rank=4, seed=8).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = tokenizer.encode("Solve:")
    seqs = (
        sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, stop=[]))
        .result()
        .sequences
    )
    data, expected = [], 0.0
    for s, a in zip(seqs, (1.0, -0.5)):
        n = len(prompt) - 1
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(prompt + s.tokens[:-1]),
            # the client's logprobs are wrong on purpose: the recorded ones are used
            loss_fn_inputs={"target_tokens": [0] * n + s.tokens, "logprobs": [0.0] * (n + len(s.tokens)),
                            "advantages": [0.0] * n + [a] * len(s.tokens)},
        ).with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id=s.sequence_id, length=len(prompt)),
                         types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(s.tokens) - 1)],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=s.sequence_id, offset=1, length=n),
                            types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(s.tokens))],
        )  # fmt: skip
        data.append(datum)
        lp = np.asarray(s.logprobs)
        expected -= float(np.sum(np.minimum(np.exp(lp - np.asarray(s.logprobs)), 2.0) * a * lp))
    out = tc.forward(data, "stable_reinforce").result()
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    no_provenance = types.Datum(model_input=data[0].model_input, loss_fn_inputs=data[0].loss_fn_inputs)
    with pytest.raises(tinker.RequestFailedError, match="provenance"):
        tc.forward([no_provenance], "stable_reinforce").result()


def test_full_fine_tuning_run(service, model: str, tokenizer) -> None:
    """A run created without a LoRA config trains every weight (its own engine)."""
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
    from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info

    holder = service.holder
    seq = holder.get_training_client_id()

    async def create() -> TrainingClient:
        with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            request = types.CreateModelRequest(session_id=holder.get_session_id(), model_seq_id=seq, base_model=model)
            future = await client.models.create(request=request)
        from tinker.lib.api_future_impl import _APIFuture

        created = await _APIFuture(types.CreateModelResponse, holder, future, time.time(), "CreateModel").result_async()
        return TrainingClient(holder, seq, created.model_id, info=await fetch_training_info(holder, created.model_id))

    tc = holder.run_coroutine_threadsafe(create()).result()
    assert tc.get_info().is_lora is False
    data = [sft_datum(tokenizer, s) for s in SENTENCES]
    before = mean_nll(tc, data)
    for _ in range(5):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    assert mean_nll(tc, data) < 0.8 * before
    path = tc.save_state("full").result().path
    restored = service.create_training_client_from_state_with_optimizer(path).result()
    for a, b in zip(logprobs_of(tc, data), logprobs_of(restored, data)):
        np.testing.assert_array_equal(a, b)
    sampler = tc.save_weights_and_get_sampling_client().result()
    ids = tokenizer.encode(SENTENCES[2])
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    np.testing.assert_allclose(lps[1:], logprobs_of(tc, [sft_datum(tokenizer, SENTENCES[2])])[0], atol=1e-4)


def test_bad_requests_fail_clearly_and_the_client_goes_on(service, model: str, tokenizer) -> None:
    with pytest.raises(Exception, match="not served here"):
        service.create_lora_training_client(base_model="no/such-model", rank=4).result()
    tc = service.create_lora_training_client(base_model=model, rank=4, seed=9).result()
    good = [sft_datum(tokenizer, SENTENCES[0])]
    image = types.Datum(
        model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)]),
        loss_fn_inputs={"target_tokens": [1, 2, 3, 4], "weights": [1.0] * 4},
    )
    missing = types.Datum(
        model_input=good[0].model_input, loss_fn_inputs={"target_tokens": good[0].loss_fn_inputs["target_tokens"]}
    )
    for data, loss, config, message in (
        ([image], "cross_entropy", None, "text models"),
        (good, "no_such_loss", None, "unknown loss_fn"),
        ([missing], "ppo", None, "needs loss_fn_inputs\\['logprobs'\\]"),
        (good, "cross_entropy", {"beta": 1.0}, "not cross_entropy's"),
    ):
        with pytest.raises(tinker.RequestFailedError, match=message) as err:
            tc.forward_backward(data, loss, config).result()
        assert err.value.category == types.RequestErrorCategory.User
    # the failed requests kept their places in the client's order: training goes on
    assert tc.forward_backward(good, "cross_entropy").result().metrics["loss:sum"] > 0
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


@pytest.mark.filterwarnings("ignore:.*load_state:FutureWarning")
def test_a_refused_training_request_keeps_its_place_and_the_client_goes_on(service, model: str, tokenizer) -> None:
    """A training request the service refuses (a checkpoint that does not exist, a bad name) fails
    as its own future, in its turn: the requests after it run instead of waiting for it forever."""
    tc = service.create_lora_training_client(base_model=model, rank=4, seed=12).result()
    good = [sft_datum(tokenizer, SENTENCES[0])]
    for refused, message in (
        (lambda: tc.load_state("tinker://no-such-run/weights/x"), "no checkpoint"),
        (lambda: tc.load_state_with_optimizer("tinker://no-such-run/sampler_weights/x"), "no checkpoint"),
        (lambda: tc.save_state("a/b"), "cannot be empty or contain '/'"),
        (lambda: tc.save_weights_for_sampler("a/b"), "cannot be empty or contain '/'"),
    ):
        with pytest.raises(tinker.RequestFailedError, match=message) as err:
            refused().result(timeout=60)
        assert err.value.category == types.RequestErrorCategory.User
        assert tc.forward_backward(good, "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
    sampler_path = tc.save_weights_for_sampler("s").result(timeout=60).path
    with pytest.raises(tinker.RequestFailedError, match="training checkpoint"):
        tc.load_state(sampler_path).result(timeout=60)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)


def test_rest_client_lists_runs_checkpoints_and_sessions(service, url: str, model: str) -> None:
    tc = service.create_lora_training_client(base_model=model, rank=4, seed=14).result()
    state = tc.save_state("listed").result().path
    sampler = tc.save_weights_for_sampler("listed").result().path
    rest = tinker.RestClient(base_url=url, api_key=KEY)
    runs = rest.list_training_runs(limit=1000).result()
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    assert runs.cursor.total_count == len(runs.training_runs) and runs.training_runs[0].training_run_id == tc.model_id
    assert len(rest.list_training_runs(limit=1).result().training_runs) == 1
    listed = rest.list_user_checkpoints().result()
    assert [c.tinker_path for c in listed.checkpoints[:2]] == [sampler, state]  # newest first
    assert listed.cursor.total_count >= 2
    session_id = service.holder.get_session_id()
    assert session_id in rest.list_sessions().result().sessions
    assert tc.model_id in rest.get_session(session_id).result().training_run_ids


# ---------------------------------------------------------------------------------- raw HTTP


def _proto_body(model_id: str, seq_id: int, ids: list[int]) -> bytes:
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.types.forward_backward_input import ForwardBackwardInput
    from tinker.types.forward_backward_request import ForwardBackwardRequest

    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    req = ForwardBackwardRequest(ForwardBackwardInput([datum], "cross_entropy"), model_id, seq_id)
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = True
    return msg.SerializeToString()


def test_raw_protocol_order_try_again_bodies_and_heartbeats(url: str, model: str, tokenizer) -> None:
    import zstandard

    h = {"X-API-Key": KEY}
    with httpx.Client(base_url=url, headers=h, timeout=30) as http:
        assert (
            http.post(
                "/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "raw"}
            ).status_code
            == 200
        )
        assert http.post("/api/v1/create_session", headers={"X-API-Key": "tml-wrong"}, json={}).status_code == 401
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]

        def result(request_id: str, proto: bool = False) -> httpx.Response:
            extra = {"Accept": "application/x-protobuf"} if proto else {}
            return http.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=extra)

        created = http.post(
            "/api/v1/create_model",
            json={"session_id": session, "model_seq_id": 0, "base_model": model, "lora_config": {"rank": 4}},
        ).json()
        model_id = created["model_id"]
        while (r := result(created["request_id"]).json()).get("type") == "try_again":
            pass
        assert r == {"type": "create_model", "model_id": model_id}
        ids = tokenizer.encode(SENTENCES[1])
        json_body = {
            "model_id": model_id,
            "forward_backward_input": {
                "loss_fn": "cross_entropy",
                "data": [
                    {
                        "model_input": {"chunks": [{"type": "encoded_text", "tokens": ids[:-1]}]},
                        "loss_fn_inputs": {
                            "target_tokens": {"data": ids[1:], "dtype": "int64", "shape": [len(ids) - 1]}
                        },
                    }
                ],
            },
        }
        # seq 2 first: it waits for seq 1, so its future answers try_again meanwhile
        second = http.post("/api/v1/forward", json={**json_body, "seq_id": 2}).json()["request_id"]
        assert result(second).json() == {"type": "try_again", "request_id": second, "queue_state": "active"}
        first = http.post("/api/v1/forward", json={**json_body, "seq_id": 1}).json()["request_id"]
        again = http.post("/api/v1/forward", json={**json_body, "seq_id": 1}).json()["request_id"]
        assert again == first  # a retried request is the same request
        one, two = result(first).json(), result(second).json()
        assert one == two and one["loss_fn_output_type"] == "ArrayRecord"
        expected = one["loss_fn_outputs"][0]["logprobs"]["data"]
        proto = _proto_body(model_id, 3, ids)
        for seq, body, encoding in (
            (3, proto, None),
            (4, zstandard.ZstdCompressor().compress(_proto_body(model_id, 4, ids)), "zstd"),
        ):
            headers = {"Content-Type": "application/x-protobuf", **({"Content-Encoding": encoding} if encoding else {})}
            rid = http.post("/api/v1/forward_backward", content=body, headers=headers).json()["request_id"]
            reply = result(rid, proto=True)
            assert reply.headers["content-type"].startswith("application/x-protobuf")
            from tinker.proto.response_conv import deserialize_forward_backward_output

            out = deserialize_forward_backward_output(reply.content)
            np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].data, expected, rtol=0, atol=0)
        bad = http.post(
            "/api/v1/forward_backward", content=b"\x00garbage", headers={"Content-Type": "application/x-protobuf"}
        )
        assert bad.status_code == 400 and "protobuf" in bad.json()["error"]
        assert http.post("/api/v1/retrieve_future", json={"request_id": "req-none"}).status_code == 404
        assert http.post("/api/v1/session_heartbeat", json={"session_id": session}).json() == {
            "type": "session_heartbeat"
        }
        assert http.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "success"}}).status_code == 200
        assert http.post("/api/v1/session_heartbeat", json={"session_id": session}).status_code == 410
        assert http.post("/api/v1/session_heartbeat", json={"session_id": "nope"}).status_code == 404
        run = http.get(f"/api/v1/training_runs/{model_id}").json()
        assert run["is_lora"] and run["lora_rank"] == 4 and run["base_model"] == model
        assert (
            json.loads(http.get("/api/v1/get_server_capabilities").text)["supported_models"][0]["model_name"] == model
        )


def test_an_idle_session_ends_and_releases_its_runs(model: str, tmp_path) -> None:
    """No heartbeat for --session-timeout seconds: the session ends (heartbeats get 410) and its
    run is released (a request for it is refused); its checkpoint stays on disk."""
    with (
        local_service([model], str(tmp_path), "--session-timeout", "3") as base,
        httpx.Client(base_url=base, timeout=30) as http,
    ):
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        created = http.post(
            "/api/v1/create_model",
            json={"session_id": session, "model_seq_id": 0, "base_model": model, "lora_config": {"rank": 2}},
        ).json()
        while (
            http.post("/api/v1/retrieve_future", json={"request_id": created["request_id"]}).json().get("type")
            == "try_again"
        ):
            pass
        saved = http.post(
            "/api/v1/save_weights", json={"model_id": created["model_id"], "seq_id": 1, "path": "kept"}
        ).json()
        assert (
            http.post("/api/v1/retrieve_future", json={"request_id": saved["request_id"]})
            .json()["path"]
            .endswith("/weights/kept")
        )
        time.sleep(8)  # 3 s without a request, and the reaper's next round (every 0.75 s)
        assert http.post("/api/v1/session_heartbeat", json={"session_id": session}).status_code == 410
        refused = http.post(
            "/api/v1/optim_step", json={"model_id": created["model_id"], "seq_id": 2, "adam_params": {}}
        )
        assert refused.status_code == 400 and "no training run" in refused.json()["error"]
        checkpoints = http.get(f"/api/v1/training_runs/{created['model_id']}/checkpoints").json()["checkpoints"]
        assert [c["checkpoint_id"] for c in checkpoints] == ["weights/kept"]
