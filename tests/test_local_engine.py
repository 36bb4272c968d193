"""The embedded engine: log-probabilities equal a HF forward, sampling parameters are honoured,
continuous batching lets short requests leave early, weight updates (in-process, disk, broadcast)
land between steps with every token tagged by the version that produced it."""

from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_lite.api.config import LocalEngineConfig
from areal_lite.api.io import GenerationConfig, ModelRequest, ParamSpec, WeightUpdateMeta
from areal_lite.cpu import fused_ops
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.local.request import GenerationError, SamplingParams
from areal_lite.utils import flash_varlen
from areal_lite.utils.distributed import find_free_port, init_custom_process_group
from areal_lite.utils.tiny import build_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen2"), hidden_size=64, num_layers=2)


@pytest.fixture(scope="module")
def hf(model_path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_path).eval()


def make_engine(path: str, **kw: object) -> LocalInferenceEngine:
    engine = LocalInferenceEngine(LocalEngineConfig(path=path, **kw))
    engine.initialize()
    return engine


@pytest.fixture(scope="module")
def engine(model_path: str):
    eng = make_engine(model_path)
    yield eng
    eng.destroy()


def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Log-probability of each output token under a plain HF forward of prompt + output."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0, :-1]
    return logp.gather(1, ids[0, 1:, None])[len(prompt) - 1 :, 0]


def perturbed_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def generate_all(engine: LocalInferenceEngine, jobs: list[tuple[list[int], SamplingParams]]):
    async def run():
        return await asyncio.gather(*[engine.scheduler.generate(p, sp) for p, sp in jobs])

    return asyncio.run(run())


def generate_together(engine: LocalInferenceEngine, jobs: list[tuple[list[int], SamplingParams]]):
    """`generate_all` with every request queued at once, so that which rows share a step (and so
    what each draws from the engine's random stream) does not depend on the threads' timing."""
    return asyncio.run(engine.scheduler.generate_many([(p, sp, None) for p, sp in jobs]))


@pytest.mark.parametrize("fused", [True, False], ids=["fused-ops", "torch-ops"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_logprobs_equal_hf_forward(arch: str, fused: bool, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the compiled norm, rotary and SiLU ops (`fused_ops`) and with the torch ops they stand in for."""
    if not fused:
        monkeypatch.setenv(fused_ops.ENV, "0")
    path = build_tiny_model(str(tmp_path / arch), arch=arch, hidden_size=64, num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    eng = make_engine(path, max_running_requests=4)  # fewer slots than requests: rows get reused
    try:
        assert (eng.scheduler._runner.ops is not None) == fused
        jobs = [
            ([3 + i, 40 + 2 * i, 7] * (1 + i % 4), SamplingParams(max_new_tokens=4 + 5 * i, ignore_eos=True))
            for i in range(7)
        ]
        results = generate_all(eng, jobs)
        for (prompt, sp), r in zip(jobs, results):
            assert len(r.output_ids) == sp.max_new_tokens and r.finish_reason == {
                "type": "length",
                "length": sp.max_new_tokens,
            }
            torch.testing.assert_close(
                torch.tensor(r.output_logprobs), hf_logprobs(model, prompt, r.output_ids), atol=1e-4, rtol=0
            )
            assert r.output_versions == [0] * len(r.output_ids)
    finally:
        eng.destroy()


def test_a_position_past_the_rotary_tables_is_an_error_not_a_stray_read(engine: LocalInferenceEngine) -> None:
    """The compiled rotary reads its tables without bounds checks; the runner checks the pass's
    positions first, as torch's indexing would."""
    runner = engine.scheduler._runner
    assert runner.ops is not None
    past = runner.rotary.positions
    with pytest.raises(IndexError, match=f"position {past} is past the rotary tables"):
        runner._layers_forward(torch.tensor([5]), torch.tensor([past]), lambda *a: pytest.fail("attended"))


@pytest.mark.parametrize("kind", ["qwen3", "llama-biases"])
def test_logprobs_equal_hf_forward_other_layouts(kind: str, tmp_path) -> None:
    """Qwen3 (q/k norms) and Llama with biases on attention and MLP, from configs (no tokenizer)."""
    from transformers import LlamaConfig, Qwen3Config

    common = {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    if kind == "qwen3":
        config = Qwen3Config(**common, num_key_value_heads=2, head_dim=16)
    else:
        config = LlamaConfig(**common, num_key_value_heads=4, attention_bias=True, mlp_bias=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random biases, so that dropping one would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(str(tmp_path / kind))
    eng = make_engine(str(tmp_path / kind))
    try:
        jobs = [([3 + i, 40, 7] * (1 + i), SamplingParams(max_new_tokens=6 + i, ignore_eos=True)) for i in range(3)]
        for (prompt, _), r in zip(jobs, generate_all(eng, jobs)):
            expected = hf_logprobs(model, prompt, r.output_ids)
            torch.testing.assert_close(torch.tensor(r.output_logprobs), expected, atol=1e-4, rtol=0)
    finally:
        eng.destroy()


def test_split_prefill_gives_the_same_logprobs(model_path: str, hf: torch.nn.Module, monkeypatch) -> None:
    monkeypatch.setattr("areal_lite.engines.local.model_runner.PREFILL_TOKENS", 10)  # split any batch
    eng = make_engine(model_path)
    real_pass, calls = eng.scheduler._runner._pass, []
    monkeypatch.setattr(
        eng.scheduler._runner, "_pass", lambda d, seqs: (seqs and calls.append(len(seqs))) or real_pass(d, seqs)
    )
    jobs = [(list(range(5, 5 + 3 * (i + 1))), SamplingParams(max_new_tokens=5, ignore_eos=True)) for i in range(5)]

    async def run():
        eng.scheduler.pause_generation("in_place")  # queue all five, then admit them in one prefill
        tasks = [asyncio.ensure_future(eng.scheduler.generate(p, sp)) for p, sp in jobs]
        await asyncio.sleep(0)
        eng.scheduler.continue_generation()
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(run())
        assert sum(calls) == 5 and len(calls) > 2  # the batch of five was split down
        for (prompt, _), r in zip(jobs, results):
            torch.testing.assert_close(
                torch.tensor(r.output_logprobs), hf_logprobs(hf, prompt, r.output_ids), atol=1e-4, rtol=0
            )
    finally:
        eng.destroy()


def test_identical_prompts_share_one_prefill_row(model_path: str, hf: torch.nn.Module, monkeypatch) -> None:
    """A GRPO group (one prompt, several samples) is prefilled as one row whose cache every sample
    gets; each sample is still drawn on its own and scored right, prompt log-probs included."""
    eng = make_engine(model_path)
    real_forward, widths = eng.scheduler._runner._layers_forward, []
    monkeypatch.setattr(
        eng.scheduler._runner, "_layers_forward", lambda ids, *a: widths.append(ids.shape[0]) or real_forward(ids, *a)
    )
    group, other = [5, 6, 7, 8, 9], [40, 41]
    jobs = [(group, SamplingParams(max_new_tokens=8, ignore_eos=True))] * 4 + [
        (other, SamplingParams(max_new_tokens=8, ignore_eos=True))
    ] * 2

    async def run():
        eng.scheduler.pause_generation("in_place")  # queue them all, then admit them in one prefill
        tasks = [
            asyncio.ensure_future(eng.scheduler.generate(p, sp, return_input_logprobs=i == 1))
            for i, (p, sp) in enumerate(jobs)
        ]
        await asyncio.sleep(0)
        eng.scheduler.continue_generation()
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(run())
        assert widths[0] == 7  # the prefill: two distinct prompts (5 + 2 tokens) packed in one pass
        assert all(w == 6 for w in widths[1:])  # then decode steps of all six rows
        for (prompt, _), r in zip(jobs, results):
            torch.testing.assert_close(
                torch.tensor(r.output_logprobs), hf_logprobs(hf, prompt, r.output_ids), atol=1e-4, rtol=0
            )
        assert len({tuple(r.output_ids) for r in results[:4]}) > 1  # samples, not copies
        expected = hf_logprobs(hf, group[:1], group[1:])
        torch.testing.assert_close(torch.tensor(results[1].input_logprobs[1:]), expected, atol=1e-4, rtol=0)
    finally:
        eng.destroy()


def test_greedy_equals_hf_generate(engine: LocalInferenceEngine, hf: torch.nn.Module) -> None:
    prompts = [[5, 9, 11, 20], [100, 3], list(range(30, 60))]
    results = generate_all(
        engine, [(p, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)) for p in prompts]
    )
    for p, r in zip(prompts, results):
        expected = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, len(p) :]
        assert r.output_ids == expected.tolist()


def test_prompt_logprobs_equal_hf_forward(engine: LocalInferenceEngine, hf: torch.nn.Module) -> None:
    """The prompt's log-probabilities and, with ``top_logprobs``, its most likely tokens per
    position equal a HF forward; a stream hands both over with its first token."""
    prompt = [7, 8, 9, 10, 200, 31]

    async def run():
        return await engine.scheduler.generate(
            prompt, SamplingParams(max_new_tokens=0, top_logprobs=3), return_input_logprobs=True
        )

    r = asyncio.run(run())
    assert r.output_ids == [] and r.input_logprobs[0] is None
    expected = hf_logprobs(hf, prompt[:1], prompt[1:])
    torch.testing.assert_close(torch.tensor(r.input_logprobs[1:]), expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        top = torch.log_softmax(hf(torch.tensor([prompt])).logits.float(), dim=-1)[0, :-1].topk(3, dim=-1)
    assert r.input_top_logprobs[0] is None
    assert [[t for t, _ in row] for row in r.input_top_logprobs[1:]] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([[v for _, v in row] for row in r.input_top_logprobs[1:]]), top.values)

    async def first_token():
        params = SamplingParams(max_new_tokens=2, temperature=0.0, top_logprobs=3)
        async for event in engine.scheduler.stream(prompt, params, return_input_logprobs=True):
            return event

    event = asyncio.run(first_token())
    assert event.input_logprobs == r.input_logprobs and event.input_top == r.input_top_logprobs


def test_sampling_parameters(engine: LocalInferenceEngine, model_path: str) -> None:
    prompt = [5, 9, 11, 20]
    greedy = generate_all(engine, [(prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))])[
        0
    ].output_ids
    stop_at = 3
    stop_tok = greedy[stop_at]
    first = greedy.index(stop_tok)
    tok = AutoTokenizer.from_pretrained(model_path)
    text = tok.decode(greedy)
    stop_str = text[len(tok.decode(greedy[:5])) :][:2]
    assert stop_str
    jobs = [
        (prompt, SamplingParams(max_new_tokens=12, temperature=1.0, top_k=1, ignore_eos=True)),
        (prompt, SamplingParams(max_new_tokens=12, temperature=0.7, top_p=1e-6, ignore_eos=True)),
        (prompt, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[stop_tok], ignore_eos=True)),
        (
            prompt,
            SamplingParams(
                max_new_tokens=12, temperature=0.0, stop_token_ids=[stop_tok], min_new_tokens=first + 2, ignore_eos=True
            ),
        ),
        (prompt, SamplingParams(max_new_tokens=12, temperature=0.0, stop=[stop_str], ignore_eos=True)),
        (prompt, SamplingParams(max_new_tokens=5, temperature=1.3, top_k=20, top_p=0.9, ignore_eos=True)),
    ]
    top_k1, top_p0, stop_id, min_new, stop_s, mixed = generate_all(engine, jobs)
    assert top_k1.output_ids == greedy and top_p0.output_ids == greedy
    assert stop_id.output_ids == greedy[: first + 1] and stop_id.finish_reason == {"type": "stop", "matched": stop_tok}
    # min_new_tokens suppresses the stop token, so the output leaves the greedy path at the stop point
    assert stop_tok not in min_new.output_ids[: first + 2] and len(min_new.output_ids) >= first + 2
    assert stop_s.finish_reason == {"type": "stop", "matched": stop_str}
    assert stop_str in tok.decode(stop_s.output_ids) and stop_str not in tok.decode(stop_s.output_ids[:-1])
    assert len(mixed.output_ids) == 5


def test_top_k_keeps_only_k_tokens(engine: LocalInferenceEngine, hf: torch.nn.Module) -> None:
    prompt = [5, 9, 11, 20]
    with torch.no_grad():
        top3 = set(hf(torch.tensor([prompt])).logits[0, -1].topk(3).indices.tolist())
    results = generate_all(
        engine, [(prompt, SamplingParams(max_new_tokens=1, temperature=5.0, top_k=3)) for _ in range(40)]
    )
    firsts = {r.output_ids[0] for r in results}
    assert firsts <= top3 and len(firsts) > 1


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (-1, 0.8)])
def test_sampling_follows_the_tempered_truncated_distribution(
    model_path: str, hf: torch.nn.Module, top_k: int, top_p: float
) -> None:
    prompt, n, temperature = [5, 9, 11, 20], 3000, 0.02
    with torch.no_grad():
        probs = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p  # the nucleus: mass before the token < top_p
    if top_k > 0:
        keep[top_k:] = False
    expected = torch.zeros_like(probs)
    expected[order[keep]] = sorted_probs[keep] / sorted_probs[keep].sum()
    assert 1 < int(keep.sum()) <= 4  # a distribution worth testing
    eng = make_engine(model_path, max_running_requests=512, seed=1)
    try:
        params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
        results = generate_all(eng, [(prompt, params)] * n)
    finally:
        eng.destroy()
    freq = torch.bincount(torch.tensor([r.output_ids[0] for r in results]), minlength=len(probs)) / n
    # 4 standard deviations of a frequency estimated from 3000 draws is at most 0.037
    torch.testing.assert_close(freq, expected, atol=0.037, rtol=0)


def test_eos_stops_unless_ignored(tmp_path) -> None:
    path = build_tiny_model(str(tmp_path / "m"), hidden_size=64, num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(path)
    greedy = model.generate(torch.tensor([[5, 6]]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[
        0, 2:
    ].tolist()
    eos = greedy[2]  # declare a token the model produces early to be its eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(path)
    eng = make_engine(path)
    try:
        stopped, ignored = generate_all(
            eng,
            [
                ([5, 6], SamplingParams(max_new_tokens=12, temperature=0.0)),
                ([5, 6], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)),
            ],
        )
        assert stopped.output_ids == greedy[: greedy.index(eos) + 1]
        assert stopped.finish_reason == {"type": "stop", "matched": eos}
        assert ignored.output_ids == greedy
    finally:
        eng.destroy()


def test_short_requests_leave_before_the_long_one(engine: LocalInferenceEngine) -> None:
    async def run() -> tuple[bool, int]:
        long = asyncio.ensure_future(
            engine.scheduler.generate([1, 2, 3], SamplingParams(max_new_tokens=300, ignore_eos=True))
        )
        shorts = await asyncio.gather(
            *[engine.scheduler.generate([4 + i], SamplingParams(max_new_tokens=4, ignore_eos=True)) for i in range(6)]
        )
        long_running = not long.done()
        r = await long
        return long_running and all(len(s.output_ids) == 4 for s in shorts), len(r.output_ids)

    ok, n = asyncio.run(run())
    assert ok and n == 300


def test_agenerate_from_many_event_loops(engine: LocalInferenceEngine) -> None:
    def in_thread(i: int) -> int:
        req = ModelRequest(input_ids=[3, 4, 5 + i], gconfig=GenerationConfig(max_new_tokens=6, ignore_eos=True))
        resp = asyncio.run(engine.agenerate(req))
        assert resp.stop_reason == "length" and len(resp.output_logprobs) == 6 and resp.rid == req.rid
        return resp.output_len

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(in_thread, range(8))) == [6] * 8


async def _wait_tokens(engine: LocalInferenceEngine, rid: str, n: int) -> None:
    while (engine.scheduler.generated_tokens(rid) or 0) < n:
        await asyncio.sleep(0.005)


def update_mid_generation(eng: LocalInferenceEngine, new_state: dict[str, torch.Tensor], n: int):
    """Generate ``n`` tokens from [1, 2, 3], loading ``new_state`` as version 1 after the 5th."""

    async def run():
        task = asyncio.ensure_future(
            eng.scheduler.generate([1, 2, 3], SamplingParams(max_new_tokens=n, ignore_eos=True), rid="long")
        )
        await _wait_tokens(eng, "long", 5)
        meta = WeightUpdateMeta(type="in_process", named_tensors=new_state, version=1)
        await asyncio.wrap_future(eng.update_weights(meta))
        return await task

    return asyncio.run(run())


def test_in_process_update_mid_generation_tags_both_versions(model_path: str, hf: torch.nn.Module) -> None:
    eng = make_engine(model_path)
    new_state = perturbed_state(hf, seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    new_model.load_state_dict(new_state)
    try:
        r = update_mid_generation(eng, new_state, 120)
        switch = r.output_versions.index(1)
        assert 5 <= switch < 120 and r.output_versions == [0] * switch + [1] * (120 - switch)
        old = hf_logprobs(hf, [1, 2, 3], r.output_ids)
        new = hf_logprobs(new_model, [1, 2, 3], r.output_ids)
        lp = torch.tensor(r.output_logprobs)
        torch.testing.assert_close(lp[:switch], old[:switch], atol=1e-4, rtol=0)
        torch.testing.assert_close(lp[switch:], new[switch:], atol=1e-4, rtol=0)
        assert eng.get_version() == 1
    finally:
        eng.destroy()


@pytest.mark.parametrize("sampling", ["seeded", "engine_stream", "greedy"])
def test_fixed_shape_decode_step_equals_the_eager_one(model_path: str, hf: torch.nn.Module, sampling: str) -> None:
    """The decode step the engine replays as a CUDA graph on a GPU (`DecodeGraphs`: rows padded to
    a bucket, attention over the whole cache, a mask from the cached lengths), run eagerly here in
    place of the engine's own decode: the same tokens for the same seeds, log-probabilities equal
    to the eager engine's and to a HF forward, as rows finish and are refilled (every bucket from
    1 to 8 rows) and as the cache grows past its first 256 positions (the graphs dropped and
    recorded again). Requests with seeds of their own take the logits from the step and sample
    after it; requests sampled from the engine's stream, or all greedy, have their tokens chosen
    inside the step (modes ``sample`` and ``greedy``)."""

    def params(i: int, n: int) -> SamplingParams:
        if sampling == "seeded":
            return SamplingParams(max_new_tokens=n, seed=i, ignore_eos=True)
        return SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.0 if sampling == "greedy" else 1.0)

    jobs = [(list(range(3, 5 + 2 * i)), params(i, 3 + 7 * i)) for i in range(11)] + [([1, 2, 3], params(99, 300))]
    eager, static = make_engine(model_path, max_running_requests=8), make_engine(model_path, max_running_requests=8)
    runner = static.scheduler._runner
    graphs = runner.graphs = runner.decode_graphs(eager=True)
    assert graphs.buckets == [1, 2, 4, 8]
    widths, modes, real_run = [], set(), graphs.run

    def run(rows: int, mode: str = "logits") -> torch.Tensor:
        widths.append(rows)
        modes.add(mode)
        return real_run(rows, mode)

    graphs.run = run  # type: ignore[method-assign]
    try:
        expected, got = generate_together(eager, jobs), generate_together(static, jobs)
    finally:
        eager.destroy()
        static.destroy()
    assert set(widths) >= {1, 3, 8} and runner.cap > 256
    assert modes == {{"seeded": "logits", "engine_stream": "sample", "greedy": "greedy"}[sampling]}
    for (prompt, _), e, g in zip(jobs, expected, got):
        assert g.output_ids == e.output_ids
        torch.testing.assert_close(torch.tensor(g.output_logprobs), torch.tensor(e.output_logprobs), atol=1e-5, rtol=0)
        torch.testing.assert_close(
            torch.tensor(g.output_logprobs), hf_logprobs(hf, prompt, g.output_ids), atol=1e-4, rtol=0
        )


def test_no_decode_graphs_on_cpu(engine: LocalInferenceEngine) -> None:
    """``cuda_graphs`` (on by default) is for CUDA: on CPU the engine decodes as before."""
    assert engine.config.cuda_graphs and engine.scheduler._runner.graphs is None


def test_keep_cache_on_update_continues_on_the_old_keys(model_path: str, hf: torch.nn.Module, monkeypatch) -> None:
    """With ``keep_cache_on_update`` a weight update recomputes nothing: the running request goes on
    from its cached keys and values of the old weights, so after the switch its log-probabilities
    are not the new model's (they are with the default recompute, in the test above)."""
    eng = make_engine(model_path, keep_cache_on_update=True)
    runner = eng.scheduler._runner
    prefills = []
    original = runner._pass
    monkeypatch.setattr(runner, "_pass", lambda d, seqs: (seqs and prefills.append(len(seqs))) or original(d, seqs))
    new_state = perturbed_state(hf, seed=1)
    new_model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    new_model.load_state_dict(new_state)
    try:
        r = update_mid_generation(eng, new_state, 60)
        assert prefills == [1]  # the request's own prefill; none at the update
        switch = r.output_versions.index(1)
        assert 5 <= switch < 60
        lp = torch.tensor(r.output_logprobs)
        torch.testing.assert_close(lp[:switch], hf_logprobs(hf, [1, 2, 3], r.output_ids)[:switch], atol=1e-4, rtol=0)
        stale = (lp[switch:] - hf_logprobs(new_model, [1, 2, 3], r.output_ids)[switch:]).abs()
        assert stale.max() > 1e-2
    finally:
        eng.destroy()


def test_disk_and_broadcast_updates(model_path: str, hf: torch.nn.Module, tmp_path) -> None:
    eng = make_engine(model_path)
    prompt = [9, 8, 7, 6]
    try:
        disk_model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        disk_model.load_state_dict(perturbed_state(hf, seed=2))
        disk_model.save_pretrained(str(tmp_path / "v1"))
        eng.update_weights(WeightUpdateMeta(type="disk", path=str(tmp_path / "v1"), version=1)).result()
        r = generate_all(eng, [(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True))])[0]
        assert r.output_versions == [1] * 10
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs), hf_logprobs(disk_model, prompt, r.output_ids), atol=1e-4, rtol=0
        )

        bcast_state = perturbed_state(hf, seed=3)
        meta = WeightUpdateMeta(type="distributed", master_port=find_free_port(), version=2)
        joined = eng.init_weights_update_group(meta)
        assert meta.world_size == 2
        group = init_custom_process_group(
            "gloo", meta.master_address, meta.master_port, 0, meta.world_size, meta.group_name, timeout=60
        )
        joined.result(timeout=60)
        names = list(bcast_state)
        for chunk in (names[: len(names) // 2], names[len(names) // 2 :]):
            specs = [ParamSpec(n, tuple(bcast_state[n].shape), "float32") for n in chunk]
            fut = eng.update_weights(WeightUpdateMeta(**{**meta.to_json(), "param_specs": specs}))
            for n in chunk:
                group.broadcast(bcast_state[n].clone())
            fut.result(timeout=60)
        bcast_model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        bcast_model.load_state_dict(bcast_state)
        r = generate_all(eng, [(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True))])[0]
        assert r.output_versions == [2] * 10
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs), hf_logprobs(bcast_model, prompt, r.output_ids), atol=1e-4, rtol=0
        )
    finally:
        eng.destroy()


def test_pause_holds_requests_and_abort_returns_partial_output(model_path: str, hf: torch.nn.Module) -> None:
    eng = make_engine(model_path)
    try:

        async def run():
            eng.scheduler.pause_generation("in_place")
            held = asyncio.ensure_future(
                eng.scheduler.generate([1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True), rid="held")
            )
            await asyncio.sleep(0)
            # A command runs while paused (the scheduler is alive), yet the request was not admitted.
            await asyncio.wrap_future(
                eng.update_weights(WeightUpdateMeta(type="in_process", named_tensors={}, version=None))
            )
            assert eng.scheduler.generated_tokens("held") is None and not held.done()
            eng.scheduler.continue_generation()
            r_held = await held
            long = asyncio.ensure_future(
                eng.scheduler.generate([1, 2], SamplingParams(max_new_tokens=400, ignore_eos=True), rid="long-1")
            )
            await _wait_tokens(eng, "long-1", 3)
            eng.scheduler.abort("long-")
            return r_held, await long

        held, aborted = asyncio.run(run())
        assert len(held.output_ids) == 3
        assert aborted.finish_reason["type"] == "abort" and 3 <= len(aborted.output_ids) < 400
        assert len(aborted.output_logprobs) == len(aborted.output_versions) == len(aborted.output_ids)
    finally:
        eng.destroy()


def test_pause_modes_abort_and_retract(model_path: str, hf: torch.nn.Module) -> None:
    eng = make_engine(model_path)
    try:

        async def run():
            a = asyncio.ensure_future(
                eng.scheduler.generate([1, 2], SamplingParams(max_new_tokens=400, ignore_eos=True), rid="a")
            )
            await _wait_tokens(eng, "a", 2)
            await asyncio.get_running_loop().run_in_executor(None, eng.scheduler.pause_generation, "abort")
            ra = await a
            eng.scheduler.continue_generation()
            b = asyncio.ensure_future(
                eng.scheduler.generate([1, 2], SamplingParams(max_new_tokens=60, ignore_eos=True), rid="b")
            )
            await _wait_tokens(eng, "b", 2)
            await asyncio.get_running_loop().run_in_executor(None, eng.scheduler.pause_generation, "retract")
            assert eng.scheduler.generated_tokens("b") is None  # back in the queue, cache dropped
            eng.scheduler.continue_generation()
            return ra, await b

        ra, rb = asyncio.run(run())
        assert ra.finish_reason == {"type": "abort", "message": "paused"} and len(ra.output_ids) >= 2
        assert len(rb.output_ids) == 60
        # Re-prefilled after the retract: every token still scores as under the one policy.
        torch.testing.assert_close(
            torch.tensor(rb.output_logprobs), hf_logprobs(hf, [1, 2], rb.output_ids), atol=1e-4, rtol=0
        )
    finally:
        eng.destroy()


def test_bad_requests_raise(engine: LocalInferenceEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.scheduler.validate_request([], SamplingParams())
    with pytest.raises(ValueError, match="context length"):
        engine.scheduler.validate_request([1] * engine.scheduler.context_len, SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.scheduler.validate_request([10**6], SamplingParams())
    for bad in ({"max_new_tokens": -1}, {"top_p": 0.0}, {"top_k": 0}, {"temperature": -1.0}, {"min_new_tokens": -2}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="unknown parameter"):
        engine.update_weights(WeightUpdateMeta(type="in_process", named_tensors={"nope": torch.zeros(1)})).result()
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(
            WeightUpdateMeta(type="in_process", named_tensors={"lm_head.weight": torch.zeros(1)})
        ).result()
    r = generate_all(engine, [([1, 2], SamplingParams(max_new_tokens=2, ignore_eos=True))])[0]  # still serving
    assert len(r.output_ids) == 2


def test_engine_failure_fails_the_running_requests_and_keeps_serving(model_path: str, monkeypatch) -> None:
    eng = make_engine(model_path)
    try:
        runner = eng.scheduler._runner
        real_step = runner.step
        calls = {"n": 0}

        def flaky_step(admitted: list) -> list:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected failure")
            return real_step(admitted)

        monkeypatch.setattr(runner, "step", flaky_step)
        with pytest.raises(GenerationError, match="injected failure"):
            generate_all(eng, [([1, 2], SamplingParams(max_new_tokens=50, ignore_eos=True))])
        r = generate_all(eng, [([1, 2], SamplingParams(max_new_tokens=5, ignore_eos=True))])[0]
        assert len(r.output_ids) == 5
    finally:
        eng.destroy()


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_a_model_that_outputs_nan_fails_its_requests_saying_so(model_path: str, greedy: bool) -> None:
    """NaN logits (diverged weights) fail the request with a message that says so, not with an
    index error from sampling nor, greedy, with NaN log-probabilities."""
    eng = make_engine(model_path)
    try:
        with torch.no_grad():
            eng.scheduler._runner.base.norm.weight.fill_(float("nan"))
        params = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0.0 if greedy else 1.0)
        with pytest.raises(GenerationError, match="probabilities are not finite"):
            generate_all(eng, [([1, 2, 3], params)])
    finally:
        eng.destroy()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_command_its_caller_gave_up_leaves_the_scheduler_serving(model_path: str) -> None:
    """A weight update or adapter call whose caller cancelled the future (an HTTP handler
    cancelled, an asyncio timeout) still runs; its result is dropped, and the scheduler thread goes
    on instead of dying on setting it."""
    eng = make_engine(model_path)
    try:
        hold = threading.Event()
        first = eng.scheduler._run_in_scheduler(lambda: hold.wait(30))  # keeps the thread busy
        given_up = eng.scheduler._run_in_scheduler(lambda: "nobody reads this")
        assert given_up.cancel()
        hold.set()
        assert first.result(timeout=30) is True
        generation = eng.scheduler.generate([1, 2], SamplingParams(max_new_tokens=5, ignore_eos=True))
        r = asyncio.run(asyncio.wait_for(generation, 60))  # a dead scheduler thread would hang it
        assert len(r.output_ids) == 5
    finally:
        eng.destroy()


def test_admission_keeps_each_step_within_the_prefill_budget(model_path: str) -> None:
    from areal_lite.engines.local.request import Sequence
    from areal_lite.engines.local.scheduler import Scheduler

    scheduler = Scheduler(LocalEngineConfig(path=model_path, max_prefill_tokens=40))

    def seq(prompt: list[int]) -> Sequence:
        return Sequence("r", prompt, SamplingParams(max_new_tokens=4), lambda r: None, frozenset(), False)

    group = [seq([5] * 30) for _ in range(4)]  # one prompt, 4 samples: prefilled once
    scheduler._waiting = [*group, seq([6] * 20), seq([7] * 5), seq([8] * 100)]
    assert scheduler._admit(free=16) == group  # 30 tokens; 30 + 20 would pass 40
    assert len(scheduler._admit(free=16)) == 2  # 20 + 5
    assert len(scheduler._admit(free=16)) == 1  # alone past the budget: admitted all the same
    scheduler._waiting = [seq([5] * 3) for _ in range(5)]
    assert len(scheduler._admit(free=2)) == 2  # and never more than the free rows


def test_engine_with_a_small_prefill_budget_matches_hf(model_path: str, hf: torch.nn.Module) -> None:
    engine = make_engine(model_path, max_prefill_tokens=8)
    try:
        jobs = [([3 + i, 40, 41 + i, 7, 9, 11], SamplingParams(max_new_tokens=6, ignore_eos=True)) for i in range(6)]
        for (prompt, _), res in zip(jobs, generate_all(engine, jobs)):
            assert len(res.output_ids) == 6
            torch.testing.assert_close(
                torch.tensor(res.output_logprobs), hf_logprobs(hf, prompt, res.output_ids), atol=1e-4, rtol=0
            )
    finally:
        engine.destroy()


def test_packed_prefill_equals_the_per_sequence_prefill(model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill a CUDA engine runs where torch has varlen attention (`flash_varlen`: one kernel
    call for every distinct prompt of a pass, keys and values scattered into every row that shares
    them), here with a reference kernel of torch's signature in place of its flash one: the same
    tokens and log-probabilities as the per-sequence prefill, for groups of rows sharing a prompt
    and prompts admitted beside running rows."""

    def reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert window_size == (-1, 0) and cu_q.dtype == torch.int32 and max_q == max(cu_q.diff().tolist())
        outs = []
        for a, e in itertools.pairwise(cu_q.tolist()):
            o = F.scaled_dot_product_attention(
                *(x[a:e].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, scale=scale, enable_gqa=enable_gqa
            )
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)

    jobs = [
        (list(range(5, 9 + 3 * (i // 3))), SamplingParams(max_new_tokens=4 + i, seed=i, ignore_eos=True))
        for i in range(12)
    ]
    plain = make_engine(model_path, max_running_requests=5)
    try:
        expected = generate_all(plain, jobs)
    finally:
        plain.destroy()
    monkeypatch.setattr(flash_varlen, "_kernel", lambda: (reference, frozenset({"window_size", "enable_gqa", "scale"})))
    monkeypatch.setattr(flash_varlen, "available", lambda device, dtype: True)
    engine = make_engine(model_path, max_running_requests=5)
    calls = []
    real = engine.scheduler._runner.cache.scatter
    engine.scheduler._runner.cache.scatter = lambda *a: calls.append(1) or real(*a)  # type: ignore[method-assign]
    try:
        got = generate_all(engine, jobs)
    finally:
        engine.destroy()
    assert calls, "the packed prefill did not run"
    for e, g in zip(expected, got):
        assert g.output_ids == e.output_ids
        torch.testing.assert_close(torch.tensor(g.output_logprobs), torch.tensor(e.output_logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("sampling", ["engine_stream", "greedy"])
def test_device_side_choice_in_eager_steps_equals_the_host_checked_one(model_path: str, sampling: str) -> None:
    """What a GPU engine does in its eager steps (prefills beside decode rows): plain rows' tokens
    chosen and their log-probabilities computed on the device, read back once, against the
    step-by-step `choose_tokens` / `record_tokens` the CPU engine runs: the same tokens from the
    same stream, the same log-probabilities."""
    temperature = 0.0 if sampling == "greedy" else 1.0
    jobs = [
        (list(range(5, 9 + i)), SamplingParams(max_new_tokens=6 + i, temperature=temperature, ignore_eos=True))
        for i in range(10)
    ]
    results = []
    for on_device in (False, True):
        engine = make_engine(model_path, max_running_requests=4)
        engine.scheduler._runner.sample_on_device = on_device
        try:
            results.append(generate_together(engine, jobs))
        finally:
            engine.destroy()
    for e, g in zip(*results):
        assert g.output_ids == e.output_ids
        torch.testing.assert_close(torch.tensor(g.output_logprobs), torch.tensor(e.output_logprobs), atol=1e-6, rtol=0)
