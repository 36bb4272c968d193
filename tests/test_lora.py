"""LoRA's pieces outside a train engine: the peft config of `LoRAConfig`, adapters merged into the
base weights (`MergedLoRA`) equal to peft's own forward, and the embedded engine serving an
adapter sent in process, from a PEFT directory or by broadcast (announced by name, in chunks),
with log-probabilities equal to peft's forward to 1e-5 and the base weights back, bit for bit,
after an unload. The train engine's side is in tests/test_fsdp.py (``lora`` in the 2-rank run),
our server's routes in tests/test_server.py, a trainer against our servers in tests/test_remote.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from areal_lite.api.config import LocalEngineConfig, LoRAConfig
from areal_lite.api.io import ParamSpec, WeightUpdateMeta
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.local.request import SamplingParams
from areal_lite.utils.distributed import find_free_port, init_custom_process_group
from areal_lite.utils.lora import MergedLoRA, config_dict, lora_config_of, peft_config
from areal_lite.utils.tiny import build_tiny_model

PROMPTS = [[11, 12, 13, 14], [40, 41], [7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("lora") / "m"), hidden_size=64, num_layers=2)


def trained_adapter(model_path: str, seed: int, rank: int = 4, targets: tuple[str, ...] = ("all-linear",)) -> PeftModel:
    """A peft model over the base whose adapter holds random (non-zero) A and B, as after training."""
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_path),
        peft_config(LoRAConfig(rank=rank, alpha=2.0 * rank, target_modules=list(targets))),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def adapter_tensors(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's tensors under their PEFT file names (what a LoRA train engine sends)."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def forward_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0, :-1]
    return logp.gather(1, ids[0, 1:, None])[len(prompt) - 1 :, 0]


def generate(engine: LocalInferenceEngine) -> list:
    async def run():
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        return await asyncio.gather(*[engine.scheduler.generate(p, params) for p in PROMPTS])

    return asyncio.run(run())


def assert_serves(engine: LocalInferenceEngine, model: torch.nn.Module, version: int) -> None:
    """Every token the engine generates has ``model``'s log-probability (to 1e-5) and ``version``."""
    for prompt, r in zip(PROMPTS, generate(engine)):
        assert r.output_versions == [version] * 8
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs), forward_logprobs(model, prompt, r.output_ids), atol=1e-5, rtol=0
        )


def test_peft_config_from_lora_config() -> None:
    cfg = peft_config(LoRAConfig(rank=8, alpha=32.0, dropout=0.1, target_modules=["q_proj", "v_proj"]))
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules) == (8, 32.0, 0.1, {"q_proj", "v_proj"})
    assert peft_config(LoRAConfig(rank=4)).target_modules == "all-linear"
    with pytest.raises(ValueError, match="already takes every linear layer"):
        peft_config(LoRAConfig(rank=4, target_modules=["all-linear", "q_proj"]))
    assert not LoRAConfig().enabled and LoRAConfig(rank=1).enabled  # off by default


def test_merged_weights_give_peft_forward_logits(model_path: str) -> None:
    model = trained_adapter(model_path, seed=0)
    config = config_dict(model.peft_config["default"])
    base = AutoModelForCausalLM.from_pretrained(model_path).eval()
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    merge = MergedLoRA(base.config, config, base_state)
    # Every linear layer but the head, under its HF weight name; the adapter's tensors by PEFT name.
    linear = {f"{n}.weight" for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert set(merge.layers) == linear
    tensors = adapter_tensors(model)
    assert set(merge.shapes) == set(tensors) and all(k.startswith("base_model.model.model.layers.") for k in tensors)

    merged = merge.merged(tensors)
    base.load_state_dict({**base_state, **merged})
    ids = torch.randint(0, 200, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(base(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    assert all(torch.equal(merge.base[k], base_state[k]) for k in merged)  # the copy of the base is intact

    with pytest.raises(ValueError, match="missing"):
        merge.merged(dict(list(tensors.items())[:-1]))
    with pytest.raises(ValueError, match="has shape"):
        merge.merged({**tensors, next(iter(tensors)): torch.zeros(1, 1)})
    with pytest.raises(ValueError, match="DoRA"):
        lora_config_of({**config, "use_dora": True})


def test_embedded_engine_serves_adapters(model_path: str, tmp_path) -> None:
    engine = LocalInferenceEngine(LocalEngineConfig(path=model_path))
    engine.initialize()
    try:
        base_weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
        base = AutoModelForCausalLM.from_pretrained(model_path).eval()

        # In process: the adapter's tensors and its config.
        first = trained_adapter(model_path, seed=1)
        config = config_dict(first.peft_config["default"])
        meta = WeightUpdateMeta(type="in_process", named_tensors=adapter_tensors(first), lora_config=config, version=1)
        engine.update_weights(meta).result()
        assert_serves(engine, first, version=1)

        # From a PEFT adapter directory, written by peft itself; an adapter on fewer layers.
        second = trained_adapter(model_path, seed=2, rank=2, targets=("q_proj", "down_proj"))
        second.save_pretrained(str(tmp_path / "adapter"))
        lora_config = config_dict(second.peft_config["default"])
        engine.update_weights(
            WeightUpdateMeta(type="disk", path=str(tmp_path / "adapter"), lora_config=lora_config, version=2)
        ).result()
        assert_serves(engine, second, version=2)

        # By broadcast: registered (zeros: the base model), then filled in two chunks.
        third = trained_adapter(model_path, seed=3)
        tensors = adapter_tensors(third)
        group_meta = WeightUpdateMeta(type="distributed", master_port=find_free_port(), version=3)
        joined = engine.init_weights_update_group(group_meta)
        group = init_custom_process_group(
            "gloo", "127.0.0.1", group_meta.master_port, 0, 2, group_meta.group_name, timeout=60
        )
        joined.result(timeout=60)
        names = sorted(tensors)
        for chunk in (names[::2], names[1::2]):
            specs = [ParamSpec(n, tuple(tensors[n].shape), "float32") for n in chunk]
            fut = engine.update_weights(
                WeightUpdateMeta(**{**group_meta.to_json(), "param_specs": specs, "lora_config": config})
            )
            for n in chunk:
                group.broadcast(tensors[n])
            fut.result(timeout=60)
        assert_serves(engine, third, version=3)

        # One adapter at a time; base weights cannot be loaded over a merged adapter.
        sched = engine.scheduler
        with pytest.raises(ValueError, match="one adapter at a time"):
            sched.weights.load_adapter("other", config, tensors).result()
        with pytest.raises(ValueError, match="unload it"):
            engine.update_weights(WeightUpdateMeta(type="in_process", named_tensors=base_weights)).result()
        with pytest.raises(ValueError, match="not loaded"):
            sched.weights.unload_adapter("other").result()

        sched.weights.unload_adapter("policy").result()
        assert all(torch.equal(v, base_weights[k]) for k, v in engine.model.state_dict().items())
        assert_serves(engine, base, version=3)
    finally:
        engine.destroy()
