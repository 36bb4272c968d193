"""Mixture-of-experts models through the stack, and routing replay.

The embedded engine runs MoE blocks as HF modules with log-probabilities equal to a HF forward and
records the experts of every token as the HF router chooses them; the routes travel with the
trajectory (padding, packing, micro-batches), through our server's SGLang protocol and the remote
client (also across a pause and a weight update); the train engine's routers replay them. The
acceptance test: with bf16 training against fp32 generation, replay brings the train engine's
log-probabilities of an MoE model's trajectories to the engine's as closely as a dense model's
are, and without replay they are measurably further apart.

The tests that start torchrun (FSDP on 2 ranks, Megatron with expert parallelism) and the
quickstart's smoke run are marked slow: ``make test-moe`` runs them all (about 5 minutes)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from areal_lite.api.config import InferenceEngineConfig, LocalEngineConfig, TrainEngineConfig
from areal_lite.api.io import GenerationConfig, MicroBatchSpec, ModelRequest, ModelResponse, WeightUpdateMeta
from areal_lite.api.workflow import TrajectoryError, check_trajectory_layout
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.remote.sglang import RemoteSGLangEngine
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.data import concat_padded, pack_batch, split_microbatches
from areal_lite.utils.moe import NO_EXPERT, RoutingReplay, layer_routers
from areal_lite.utils.tiny import build_tiny_model, build_tokenizer
from areal_lite.workflows.trajectory import check_trajectory, from_response, from_responses

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from inference_servers import running_on, start_servers, stop_servers
from test_fsdp import torchrun

VOCAB = 300
ROOT = Path(__file__).resolve().parents[1]


def save_model(path: str, config: object, init_std: float | None = None, seed: int = 0) -> str:
    """A random model of ``config`` with a local tokenizer in ``path``; ``init_std`` redraws every
    matrix with that spread (sharper distributions and routers than the default 0.02)."""
    tokenizer = build_tokenizer(path, vocab_size=VOCAB)
    config.vocab_size = len(tokenizer)  # type: ignore[attr-defined]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if init_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim >= 2:
                    p.normal_(0, init_std)
    model.save_pretrained(path)
    return path


def moe_config(model_type: str) -> object:
    common = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    if model_type == "qwen3_moe":  # layer 1 is dense: its routes are -1
        return Qwen3MoeConfig(
            **common, num_hidden_layers=3, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
        )  # fmt: skip
    if model_type == "mixtral":
        return MixtralConfig(
            **common, num_hidden_layers=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2
        )
    return Qwen2MoeConfig(
        **common, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_model(str(tmp_path_factory.mktemp("moe") / "qwen3_moe"), moe_config("qwen3_moe"), init_std=0.1)


def hf_routes_and_logprobs(model: torch.nn.Module, ids: list[int], n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain HF forward of ``ids``: every position's routes ``[len - 1, layers, k]`` (the last
    position's dropped, as the engine never runs it) and the log-probabilities of the last
    ``n_out`` tokens."""
    routers = layer_routers(model.model.layers)
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        r.register_forward_hook(lambda _m, _i, out, i=i: captured.__setitem__(i, out[2]))
        for i, r in enumerate(routers)
        if r is not None
    ]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    k = model.config.num_experts_per_tok
    routes = torch.full((len(ids), len(routers), k), NO_EXPERT, dtype=torch.int32)
    for i, r in captured.items():
        routes[:, i] = r.to(torch.int32)
    logp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return routes[:-1], logp[len(ids) - 1 - n_out :]


def same_experts(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two route tensors pick the same experts (top-k order aside)."""
    return torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values)


def local_engine(path: str, **kw: object) -> LocalInferenceEngine:
    engine = LocalInferenceEngine(LocalEngineConfig(path=path, max_running_requests=32, **kw))
    engine.initialize()
    return engine


def generate(engine: object, reqs: list[ModelRequest]) -> list[ModelResponse]:
    async def run() -> list[ModelResponse]:
        return await asyncio.gather(*[engine.agenerate(r) for r in reqs])  # type: ignore[attr-defined]

    return asyncio.run(run())


def requests(n: int, max_new_tokens: int = 12, **g: object) -> list[ModelRequest]:
    gconfig = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True, return_routed_experts=True, **g)
    return [
        ModelRequest(input_ids=[5 + i, 7, 9 + 2 * i, 11], gconfig=gconfig.new(max_new_tokens=max_new_tokens + i))
        for i in range(n)
    ]


# ----------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_engine_logprobs_and_routes_equal_a_hf_forward(model_type: str, tmp_path) -> None:
    path = save_model(str(tmp_path / model_type), moe_config(model_type))
    engine = local_engine(path)
    try:
        resps = generate(engine, requests(6))  # different lengths: rows leave and are refilled
    finally:
        engine.destroy()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for r in resps:
        routes, logp = hf_routes_and_logprobs(model, r.input_tokens + r.output_tokens, r.output_len)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), logp, atol=1e-4, rtol=0)
        assert r.routed_experts is not None and r.routed_experts.dtype == torch.int32
        assert r.routed_experts.shape == (r.input_len + r.output_len - 1, model.config.num_hidden_layers, 2)
        assert same_experts(r.routed_experts, routes)
    if model_type == "qwen3_moe":
        assert (resps[0].routed_experts[:, 1] == NO_EXPERT).all()  # the dense layer
        assert (resps[0].routed_experts[:, [0, 2]] >= 0).all()


def test_engine_routes_follow_a_weight_update(moe_path: str, tmp_path) -> None:
    """A weight update recomputes the running request's cache and its routes (every position's
    are then the new weights'); with ``keep_cache_on_update`` the positions cached before it keep
    the old weights' routes. The update arrives as a ``save_pretrained`` directory: the experts
    one tensor each, as the checkpoint layout has them."""
    old = AutoModelForCausalLM.from_pretrained(moe_path).eval()
    new = AutoModelForCausalLM.from_pretrained(moe_path).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    new.save_pretrained(str(tmp_path / "v1"))
    for keep in (False, True):
        engine = local_engine(moe_path, keep_cache_on_update=keep)
        req = ModelRequest(
            input_ids=[3, 4, 5],
            gconfig=GenerationConfig(max_new_tokens=80, ignore_eos=True, return_routed_experts=True),
        )

        async def run(engine: LocalInferenceEngine = engine, req: ModelRequest = req) -> ModelResponse:
            task = asyncio.ensure_future(engine.agenerate(req))
            while (engine.scheduler.generated_tokens(req.rid) or 0) < 5:
                await asyncio.sleep(0.005)
            meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "v1"), version=1)
            await asyncio.wrap_future(engine.update_weights(meta))
            return await task

        try:
            r = asyncio.run(run())
        finally:
            engine.destroy()
        switch = r.output_versions.index(1)
        assert 5 <= switch < 80
        ids = r.input_tokens + r.output_tokens
        old_routes, _ = hf_routes_and_logprobs(old, ids, r.output_len)
        new_routes, new_logp = hf_routes_and_logprobs(new, ids, r.output_len)
        if keep:  # positions run before the update: the decode step feeding token switch - 1 ran after it
            cached = r.input_len + switch - 1
            assert same_experts(r.routed_experts[:cached], old_routes[:cached])
            assert not same_experts(r.routed_experts, new_routes)
        else:
            assert same_experts(r.routed_experts, new_routes)
            lp = torch.tensor(r.output_logprobs)
            torch.testing.assert_close(lp[switch:], new_logp[switch:], atol=1e-4, rtol=0)


def test_return_routed_experts_refused_for_a_dense_model(tmp_path) -> None:
    engine = local_engine(build_tiny_model(str(tmp_path / "dense"), hidden_size=32, num_layers=1))
    try:
        with pytest.raises(ValueError, match="no mixture-of-experts"):
            generate(engine, requests(1))
    finally:
        engine.destroy()


# ----------------------------------------------------------------------------- the trajectory


def test_routes_travel_through_padding_packing_and_micro_batches(moe_path: str) -> None:
    engine = local_engine(moe_path)
    try:
        resps = generate(engine, requests(4))
    finally:
        engine.destroy()
    group = from_responses(resps[:2], [1.0, 0.0])
    check_trajectory(group)
    single = [from_response(r, 0.5) for r in resps[2:]]
    batch = concat_padded([group, *single])
    layers, k = resps[0].routed_experts.shape[1:]
    assert batch["routed_experts"].shape == (*batch["input_ids"].shape, layers, k)
    lens = batch["attention_mask"].sum(dim=1)
    for i, r in enumerate(resps):
        n = r.input_len + r.output_len
        assert torch.equal(batch["routed_experts"][i, : n - 1], r.routed_experts)
        assert (batch["routed_experts"][i, n - 1 :] == NO_EXPERT).all()  # the last token and the padding
        assert int(lens[i]) == n
    packed = pack_batch(batch)
    assert packed["routed_experts"].shape == (int(lens.sum()), layers, k)
    split = split_microbatches(batch, MicroBatchSpec(n_mbs=2))
    for mb, idx in zip(split.mbs, split.indices):
        mb_packed = pack_batch(mb)
        expected = torch.cat([batch["routed_experts"][i, : int(lens[i])] for i in idx])
        assert torch.equal(mb_packed["routed_experts"], expected)
    bad = group.clone()
    bad["routed_experts"] = bad["routed_experts"].float()
    with pytest.raises(TrajectoryError, match="routed_experts"):
        check_trajectory_layout(bad)


# ----------------------------------------------------------------------------- replay


def test_router_replay_is_the_hf_router_and_keeps_the_router_trained(moe_path: str) -> None:
    """Driven by `RoutingReplay`, the routers compute what HF's compute (bit for bit) when nothing
    is replayed or when the replayed experts are their own; forced to other experts, the layers run
    those with gate weights softmax(logits)[chosen] (renormalised when the model renormalises its
    top-k; this one does not), and the router gets gradients."""
    ref = AutoModelForCausalLM.from_pretrained(moe_path).eval()
    model = AutoModelForCausalLM.from_pretrained(moe_path).eval()
    replay = RoutingReplay(model)
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids, use_cache=False).logits
        replay.begin(None, replay=False)
        assert torch.equal(model(ids, use_cache=False).logits, expected)
        own = torch.stack(
            [
                replay._pass.layers[i].own if i in replay._pass.layers else torch.full((20, 2), NO_EXPERT)
                for i in range(3)
            ],
            dim=1,
        ).to(torch.int32)
        replay.begin(own, replay=True)
        assert torch.equal(model(ids, use_cache=False).logits, expected)
        assert replay.stats()["moe/routing_agreement"] == 1.0

    forced = own.clone()
    forced[:, [0, 2]] = torch.tensor([0, 1], dtype=torch.int32)  # every token to experts 0 and 1
    forced[-1] = NO_EXPERT  # a position without a route takes the router's own choice
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = model.model.layers[0].mlp.experts.register_forward_hook(lambda _m, inp, _o: seen.append((inp[1], inp[2])))
    replay.begin(forced, replay=True)
    model(ids, use_cache=False).logits.sum().backward()
    hook.remove()
    index, weights = seen[0]
    assert torch.equal(index[:-1], forced[:-1, 0].long()) and torch.equal(index[-1], own[-1, 0].long())
    probs = replay._pass.layers[0].probs
    gate = probs.gather(1, index)
    torch.testing.assert_close(weights, gate / gate.sum(dim=-1, keepdim=True) if model.config.norm_topk_prob else gate)
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    stats = replay.stats()
    assert stats["moe/routing_agreement"] < 1.0 and stats["moe/token_route_match"] < 1.0


def mismatch(path: str, dtype: str, replay: bool, moe: bool) -> dict[str, float]:
    """Generate 32 trajectories with the fp32 engine, score them with the FSDP engine in ``dtype``:
    the largest |train - inference| log-probability gap and the mean KL (k3) over the generated
    tokens."""
    engine = local_engine(path)
    try:
        resps = generate(engine, [ModelRequest(input_ids=[5 + i, 7, 9, 11 + i, 20 + i], gconfig=GenerationConfig(
            max_new_tokens=24, ignore_eos=True, return_routed_experts=moe)) for i in range(32)])  # fmt: skip
    finally:
        engine.destroy()
    batch = from_responses(resps, [0.0] * len(resps))
    train = FSDPEngine(TrainEngineConfig(path=path, dtype=dtype, routing_replay=replay))
    train.initialize()
    try:
        logp = train.forward(batch)
    finally:
        train.destroy()
    mask = batch["loss_mask"].bool()
    diff = (logp - batch["logprobs"])[mask]
    return {"max": float(diff.abs().max()), "kl": float((diff.exp() - 1 - diff).mean())}


def test_replay_brings_bf16_training_to_the_engine_as_close_as_a_dense_model(tmp_path) -> None:
    """bf16 training against fp32 generation, on an MoE model (4 layers of 8 experts, 2 per token)
    and its dense twin (the same attention, one MLP of the MoE's active width). The dense model's
    log-probabilities differ by bf16 rounding; the MoE model's, without replay, also where the two
    engines route a token to different experts, by far more. With replay the MoE model is at the
    dense model's level, and with both engines in fp32 the two agree to float tolerance."""
    from transformers import Qwen3Config

    moe_cfg = AutoConfig.from_pretrained(
        build_tiny_model(str(tmp_path / "moe_cfg"), arch="qwen3_moe", hidden_size=64, num_layers=4, num_experts=8)
    )
    moe = save_model(str(tmp_path / "moe"), moe_cfg, init_std=0.1)
    dense_cfg = Qwen3Config(**{k: getattr(moe_cfg, k) for k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
        "intermediate_size", "max_position_embeddings", "rms_norm_eps")})  # fmt: skip
    dense = save_model(str(tmp_path / "dense"), dense_cfg, init_std=0.1)
    dense_gap = mismatch(dense, "bfloat16", replay=False, moe=False)
    replayed = mismatch(moe, "bfloat16", replay=True, moe=True)
    free = mismatch(moe, "bfloat16", replay=False, moe=True)
    print(f"bf16 vs fp32: dense {dense_gap}, MoE with replay {replayed}, MoE without {free}")
    assert replayed["max"] <= 2 * dense_gap["max"] and replayed["kl"] <= 2 * dense_gap["kl"]
    assert free["max"] > 4 * dense_gap["max"] and free["kl"] > 4 * dense_gap["kl"]  # what replay removes
    exact = mismatch(moe, "float32", replay=True, moe=True)
    assert exact["max"] < 1e-4


def test_replay_removes_the_routing_part_of_a_kept_cache_mismatch(tmp_path) -> None:
    """A weight update lands mid-generation with ``keep_cache_on_update``: the tokens after it
    attend to the old weights' keys and values, which replay cannot undo, but their prefix was
    routed by the old weights too, which replay does. Scored by the train engine holding the new
    weights (fp32 both), replay removes most of the MoE model's mismatch on those tokens."""
    path = save_model(
        str(tmp_path / "moe"),
        AutoConfig.from_pretrained(
            build_tiny_model(str(tmp_path / "cfg"), arch="qwen3_moe", hidden_size=64, num_layers=4, num_experts=8)
        ),
        init_std=0.1,
    )
    new = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.003 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    new.save_pretrained(str(tmp_path / "new"))
    engine = local_engine(path, keep_cache_on_update=True)
    reqs = [ModelRequest(input_ids=[5 + i, 7, 9, 11 + i], gconfig=GenerationConfig(
        max_new_tokens=20, ignore_eos=True, return_routed_experts=True)) for i in range(32)]  # fmt: skip

    async def run() -> list[ModelResponse]:
        tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in reqs]
        while (engine.scheduler.generated_tokens(reqs[-1].rid) or 0) < 6:
            await asyncio.sleep(0.002)
        await asyncio.wrap_future(engine.scheduler.weights.load_tensors(new.state_dict(), version=1))
        return list(await asyncio.gather(*tasks))

    try:
        batch = from_responses(asyncio.run(run()), [0.0] * len(reqs))
    finally:
        engine.destroy()
    after = batch["versions"] == 1
    kl = {}
    for replay in (False, True):
        train = FSDPEngine(TrainEngineConfig(path=str(tmp_path / "new"), routing_replay=replay))
        train.initialize()
        try:
            d = (train.forward(batch) - batch["logprobs"])[after]
        finally:
            train.destroy()
        kl[replay] = float((d.exp() - 1 - d).mean())
    print(f"kept cache, KL on the {int(after.sum())} tokens after the update: {kl}")
    assert kl[True] < kl[False] / 3  # measured: 0.0035 against 0.033


# ----------------------------------------------------------------------------- over HTTP


def test_server_returns_routes_through_a_pause_and_an_update(moe_path: str, tmp_path) -> None:
    """Our server answers ``return_routed_experts`` (SGLang's base64 int32); the client shapes
    them. Generations aborted by a weight update (pause mode abort) resume as prompt + generated:
    the stitched response's routes are those of its last part, the new weights' for every token."""
    procs, addresses = start_servers(moe_path, 1)
    engine = RemoteSGLangEngine(InferenceEngineConfig(addresses=addresses, setup_timeout=60, request_timeout=60))
    engine.initialize()
    old = AutoModelForCausalLM.from_pretrained(moe_path).eval()
    try:
        reqs = requests(3)
        for r in generate(engine, reqs):
            routes, logp = hf_routes_and_logprobs(old, r.input_tokens + r.output_tokens, r.output_len)
            assert same_experts(r.routed_experts, routes)
            torch.testing.assert_close(torch.tensor(r.output_logprobs), logp, atol=1e-4, rtol=0)

        new = AutoModelForCausalLM.from_pretrained(moe_path).eval()
        with torch.no_grad():
            for p in new.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
        new.save_pretrained(str(tmp_path / "v1"))
        long = requests(2, max_new_tokens=150)

        async def update_mid_generation() -> list[ModelResponse]:
            tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in long]
            while not await running_on(addresses[0]):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "v1"), version=1)
            await asyncio.wrap_future(engine.update_weights(meta))
            return await asyncio.gather(*tasks)

        for r in asyncio.run(update_mid_generation()):
            assert 0 in r.output_versions and 1 in r.output_versions
            routes, _ = hf_routes_and_logprobs(new, r.input_tokens + r.output_tokens, r.output_len)
            assert same_experts(r.routed_experts, routes)
    finally:
        engine.destroy()
        stop_servers(procs)


# ----------------------------------------------------------------------------- FSDP on 2 ranks


@pytest.fixture(scope="module")
def two_ranks(moe_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("moe_worker")
    code, output = torchrun(2, ROOT / "tests" / "scripts" / "moe_worker.py", moe_path, str(out), timeout=600)
    assert code == 0, output[-6000:]
    with open(out / "moe_w2.json") as f:
        return json.load(f)


@pytest.mark.slow
def test_fsdp_replay_on_two_ranks_equals_a_plain_model_replaying(two_ranks: dict) -> None:
    assert two_ranks["replay_logp_packed"] < 1e-5
    assert two_ranks["replay_logp_tree"] < 1e-5  # shared prefixes take the first sequence's routes
    assert two_ranks["replay_sgd_vs_reference"] < 1e-6
    assert two_ranks["replay_router_moved"] > 1e-4  # the gate weights kept their gradient
    stats = two_ranks["replay_stats"]
    assert 0 < stats["moe/routing_agreement"] < 1 and stats["moe/aux_loss"] > 0


@pytest.mark.slow
def test_fsdp_weight_updates_of_every_kind_reach_the_engine(two_ranks: dict) -> None:
    for kind, version in (("in_process", 1), ("disk", 2), ("distributed", 3)):
        assert two_ranks[f"update_{kind}"]["err"] < 1e-5, kind
        assert two_ranks[f"update_{kind}"]["versions"] == [version]
    received = {kind: names for kind, names, _ in two_ranks["update_received"]}
    assert "model.layers.0.mlp.experts.gate_up_proj" in received["in_process"]  # the runtime layout in process
    sent = [n for kind, names, _ in two_ranks["update_received"] if kind == "distributed" for n in names]
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in sent and not any("gate_up_proj" in n for n in sent)
    assert "model.layers.0.mlp.experts.0.down_proj.weight" in two_ranks["update_disk_keys"]


@pytest.mark.slow
def test_fsdp_lora_on_attention_experts_and_routers(two_ranks: dict) -> None:
    assert {"q_proj", "o_proj", "experts", "gate"} <= set(two_ranks["lora_trainable"])
    for kind in ("in_process", "disk", "distributed"):
        assert two_ranks[f"lora_{kind}"]["err"] < 1e-5, kind
    assert two_ranks["lora_merged_vs_peft_logits"] < 1e-5


# ----------------------------------------------------------------------------- Megatron


def test_megatron_conversion_round_trips_a_qwen3_moe_checkpoint(moe_path: str, tmp_path) -> None:
    from safetensors.torch import load_file

    from areal_lite.engines.train.mcore_convert import ArchSpec, hf_to_mcore, mcore_state_to_hf

    with pytest.raises(ValueError, match="every Qwen3-MoE layer"):  # moe_path has a dense layer
        ArchSpec.from_hf_config(AutoConfig.from_pretrained(moe_path))
    path = build_tiny_model(str(tmp_path / "m"), arch="qwen3_moe", hidden_size=32, num_layers=2, num_experts=4)
    arch = ArchSpec.from_hf_config(AutoConfig.from_pretrained(path))
    assert arch.qk_norm and arch.num_experts == 4 and arch.experts_per_token == 2
    hf = load_file(f"{path}/model.safetensors")  # the checkpoint layout: one tensor per expert
    mcore = hf_to_mcore(hf, arch)
    assert mcore["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (2 * 64, 32)
    back = mcore_state_to_hf({k: [v] for k, v in mcore.items()}, arch)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.slow
def test_megatron_expert_parallel_equals_fsdp_with_and_without_replay(tmp_path) -> None:
    """megatron-core's MoE layers on CPU with the experts over 2 gloo ranks (all-to-all dispatch;
    the ranks' micro-batch counts differ) give FSDP's log-probabilities and AdamW step, also with
    routing replay; their HF checkpoint loads and their weight updates reach the embedded engine."""
    model = build_tiny_model(str(tmp_path / "m"), arch="qwen3_moe", hidden_size=64, num_layers=2, num_experts=4)
    worker = ROOT / "tests" / "scripts" / "megatron_moe_worker.py"
    code, output = torchrun(2, worker, model, str(tmp_path), timeout=600)
    assert code == 0, output[-6000:]
    with open(tmp_path / "megatron_moe.json") as f:
        res = json.load(f)
    assert res["micro_batches_per_rank"][0] != res["micro_batches_per_rank"][1]
    for run in ("ep2_replay0", "ep1_replay0", "ep2_replay1", "ep1_replay1"):
        assert res[run]["logp"] < 1e-5 and res[run]["params"] < 1e-5, (run, res[run])
        assert res[run]["moved"] > 1e-2  # the step changed the weights
    assert res["ep2_replay1"]["moved"] != res["ep2_replay0"]["moved"]  # replay changed the step
    assert res["hf_save_loaded_all"] and res["hf_save_vs_tensors"] == 0.0
    for kind, version in (("in_process", 1), ("disk", 2), ("distributed", 3)):
        assert res[f"update_{kind}"]["err"] < 1e-5 and res[f"update_{kind}"]["versions"] == [version]


@pytest.mark.slow
def test_quickstart_moe_smoke(tmp_path) -> None:
    """The MoE quickstart's path end to end, tiny: SFT warm-up, our server returning routes, FSDP
    replaying them (with shared prefixes) under the launcher."""
    import subprocess

    cmd = [sys.executable, "-m", "areal_lite.launcher.local", "examples/quickstart.py"]
    cmd += ["--config", "configs/quickstart_moe.yaml", f"cluster.fileroot={tmp_path}"]
    cmd += ["task.sft_steps=10", "task.sft_eval_every=5", "task.sft_batch_size=16", "task.n_dev=8", "task.n_eval=8"]
    cmd += ["task.n_train_prompts=64", "task.hidden_size=32", "task.num_layers=1", "total_train_steps=2"]
    cmd += ["train_dataset.batch_size=4", "rollout.consumer_batch_size=4", "local_engine.max_running_requests=32"]
    cmd += ["stats_logger.console=false", "stats_logger.tensorboard=false", "stats_logger.wandb_mode=disabled"]
    cmd += ["recover.mode=disabled"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "RESULT acc_before=" in proc.stdout, out[-4000:]
