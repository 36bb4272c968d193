"""LoRA against full-parameter training: weight updates, trainer memory, and how the inference side
applies an adapter.

One run, side by side, on one model (Qwen2, hidden 512, 8 layers: 34M parameters; LoRA rank 16 on
every linear layer):

- per weight update, the bytes sent and the CPU-seconds it takes (until the receiver has loaded
  them) into the embedded engine: in process, through disk (safetensors / a PEFT adapter
  directory) and by gloo broadcast (the engine joins as rank 1, in this process);
- trainer memory after one AdamW step: parameters plus optimizer state;
- merged vs on the fly, on the inference side, for this model and the quickstart's (hidden 128, 4
  layers): what merging costs per update (the embedded engine's whole adapter load) against what
  applying the adapter at every decode step costs (peft's LoRA layers unmerged vs merged, in a HF
  batched decode step of 64 rows). Merging wins once an update is followed by more than
  ``breakeven_steps`` decode steps.

Times are medians over ``--repeats`` in CPU-seconds of this process (the receiver's threads
included; disk waits are not counted), the decode steps alternating: stable when other jobs share
the cores. The last line is ``RESULT key=value ...``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lora.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from tensordict import TensorDict

from areal_lite.api.config import LocalEngineConfig, LoRAConfig, OptimizerConfig, TrainEngineConfig
from areal_lite.api.io import FinetuneSpec, WeightUpdateMeta
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.lora import config_dict, peft_config
from areal_lite.utils.tiny import build_tiny_model

LORA = LoRAConfig(rank=16, alpha=32.0)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median CPU-seconds of this process (all its threads: the receiver's too) over ``repeats``
    calls: stable when other jobs share the cores, unlike wall-clock time."""
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def batch(vocab: int) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (8, 64), generator=g)
    ones = torch.ones_like(ids)
    return TensorDict({"input_ids": ids, "attention_mask": ones.bool(), "loss_mask": ones.int()}, batch_size=[8])


def nll(out: torch.Tensor, ent: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = mb["loss_mask"].float()
    return -(out * m).sum() / m.sum(), {}


def trainer_bytes(engine: FSDPEngine) -> tuple[int, int]:
    """(parameter bytes, optimizer-state bytes) of the trainer."""
    params = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    state = sum(
        t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return params, state


def measure_updates(model_dir: str, lora: LoRAConfig, workdir: str, repeats: int) -> dict[str, float]:
    """One trainer (full or LoRA) and one embedded engine: memory, then each kind of update."""
    cfg = TrainEngineConfig(path=model_dir, optimizer=OptimizerConfig(lr=1e-4), lora=lora)
    engine = FSDPEngine(cfg)
    engine.initialize(FinetuneSpec(1, 8, 8))
    data = batch(engine.model.hf.config.vocab_size)
    engine.train_batch(data, nll, lambda mb: float(mb["loss_mask"].sum()))
    params, state = trainer_bytes(engine)
    receiver = LocalInferenceEngine(LocalEngineConfig(path=model_dir))
    receiver.initialize()
    dist_meta = WeightUpdateMeta(type="distributed")
    engine.connect_engine(receiver, dist_meta)
    out = {"param_bytes": params, "optim_bytes": state, "trainer_bytes": params + state}
    sent = engine._adapter_tensors() if lora.enabled else dict(engine._hf_tensors())
    out["update_bytes"] = sum(t.nbytes for t in sent.values())
    metas = {
        "in_process": WeightUpdateMeta(type="in_process"),
        "disk": WeightUpdateMeta(type="disk", path=os.path.join(workdir, "full" if not lora.enabled else "lora")),
        "distributed": dist_meta,
    }
    for kind, meta in metas.items():
        out[f"{kind}_s"] = median_seconds(lambda meta=meta: engine.update_weights(meta), repeats)
    receiver.destroy()
    engine.destroy()
    return out


def adapter_on_inference_side(model_dir: str, repeats: int) -> dict[str, float]:
    """CPU-seconds of merging an adapter in the embedded engine (its whole load: merge, copy into
    the weights), and of one batched decode step (64 rows, 32 cached positions) with the adapter
    applied on the fly (peft's layers, unmerged) and merged into the weights."""
    from peft import get_peft_model
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), peft_config(LORA)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    engine = LocalInferenceEngine(LocalEngineConfig(path=model_dir))
    engine.initialize()
    config = config_dict(model.peft_config["default"])
    merge = median_seconds(lambda: engine.scheduler.weights.load_adapter("policy", config, tensors).result(), repeats)
    engine.destroy()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (64, 32), generator=g)
    step = torch.randint(3, model.config.vocab_size, (64, 1), generator=g)

    def decode_step(m: torch.nn.Module) -> Callable[[], object]:
        with torch.no_grad():
            cache = m(prompt, use_cache=True).past_key_values

        def run() -> None:
            with torch.no_grad():
                m(step, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # the next call decodes the same position again

        return run

    on_the_fly_step = decode_step(model)
    merged_step = decode_step(copy.deepcopy(model).merge_and_unload())
    on_the_fly, merged = [], []
    for _ in range(repeats * 4):  # alternating, so that both see the same load
        on_the_fly.append(median_seconds(on_the_fly_step, 1))
        merged.append(median_seconds(merged_step, 1))
    out = {
        "merge_s": merge,
        "decode_merged_s": statistics.median(merged),
        "decode_on_the_fly_s": statistics.median(on_the_fly),
    }
    overhead = out["decode_on_the_fly_s"] - out["decode_merged_s"]
    out["breakeven_steps"] = merge / overhead if overhead > 0 else float("inf")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(
            os.path.join(tmp, "model"), hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, vocab_size=4096
        )
        full = measure_updates(model_dir, replace(LORA, rank=0), tmp, args.repeats)
        lora = measure_updates(model_dir, LORA, tmp, args.repeats)
        sides = {"34M": adapter_on_inference_side(model_dir, args.repeats)}
        small = build_tiny_model(
            os.path.join(tmp, "small"), hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4, vocab_size=0
        )
        sides["quickstart"] = adapter_on_inference_side(small, args.repeats)

    mb = 1024 * 1024
    print(f"{'':<34}{'full':>12}{'LoRA r16':>12}{'full/LoRA':>11}")
    rows = [
        ("bytes per update (MiB)", "update_bytes", mb),
        ("in-process update (s)", "in_process_s", 1),
        ("disk update (s)", "disk_s", 1),
        ("broadcast update (s)", "distributed_s", 1),
        ("trainer parameters (MiB)", "param_bytes", mb),
        ("trainer optimizer state (MiB)", "optim_bytes", mb),
        ("trainer params + optimizer (MiB)", "trainer_bytes", mb),
    ]
    for label, key, unit in rows:
        print(f"{label:<34}{full[key] / unit:>12.4f}{lora[key] / unit:>12.4f}{full[key] / lora[key]:>10.1f}x")
    print(
        f"\n{'adapter on the inference side (ms)':<36}{'merge':>8}{'decode merged':>15}{'on the fly':>12}{'breakeven steps':>17}"
    )
    for size, side in sides.items():
        print(f"{size + ' model':<36}{side['merge_s'] * 1e3:>8.1f}{side['decode_merged_s'] * 1e3:>15.2f}"
              f"{side['decode_on_the_fly_s'] * 1e3:>12.2f}{side['breakeven_steps']:>17.1f}")  # fmt: skip
    result = {
        "update_bytes_full": full["update_bytes"],
        "update_bytes_lora": lora["update_bytes"],
        "bytes_ratio": full["update_bytes"] / lora["update_bytes"],
        **{f"{k}_full": round(full[f"{k}_s"], 4) for k in ("in_process", "disk", "distributed")},
        **{f"{k}_lora": round(lora[f"{k}_s"], 4) for k in ("in_process", "disk", "distributed")},
        "trainer_mib_full": round(full["trainer_bytes"] / mb, 1),
        "trainer_mib_lora": round(lora["trainer_bytes"] / mb, 1),
        "optim_mib_full": round(full["optim_bytes"] / mb, 2),
        "optim_mib_lora": round(lora["optim_bytes"] / mb, 2),
        **{
            f"{key}_ms_{size}": round(side[f"{key}_s"] * 1e3, 2)
            for size, side in (("34m", sides["34M"]), ("qs", sides["quickstart"]))
            for key in ("merge", "decode_merged", "decode_on_the_fly")
        },
        "breakeven_steps_34m": round(sides["34M"]["breakeven_steps"], 1),
        "breakeven_steps_qs": round(sides["quickstart"]["breakeven_steps"], 1),
    }
    print("RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
