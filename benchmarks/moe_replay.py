"""The train-inference mismatch of a mixture-of-experts model, with and without routing replay,
against its dense twin's.

Two tiny models of the quickstart's shape (4 layers, hidden 128, byte-level tokens): a dense Qwen3
and a Qwen3-MoE with the same attention whose MLPs are 8 experts, 2 per token, each half the dense
MLP's width (the same active width). Both are warmed up with SFT on the quickstart's addition task
until their training loss reaches ``--sft-loss`` (equally sharp distributions, as a trained policy
has: the mismatch grows with sharpness), then the embedded engine (fp32) samples 8 completions of
each of ``--prompts`` prompts and the FSDP train engine scores them. Two sources of mismatch:

- ``bf16 train``: the train engine in bf16 (mixed precision, as ``actor.dtype=auto`` picks on a
  CPU with AVX-512 BF16) against fp32 generation, same weights.
- ``kept cache``: one AdamW step (lr 1e-4, the quickstart's RL rate) lands while the requests are
  ``INTO`` tokens into their output, with ``local_engine.keep_cache_on_update``: the tokens sampled
  after it attend to keys and values of the old weights. Both engines in fp32; scored by the train
  engine holding the new weights, on the tokens sampled after the update. ``KL stale`` is the
  same statistic between the old and the new weights (train engine, fp32) on those tokens: the
  size of the update, which the kept cache's mismatch is a part of.

For each: ``KL`` the mean of ``exp(d) - 1 - d`` (k3; ``d`` = train - inference log-probability of
each scored token, the log of its importance weight), ``max |d|``, the importance weights' spread
(``w std``: standard deviation of ``exp(d)``; ``w max``), and for the MoE model the routing
agreement (the share of the recorded experts the training router picks itself) and the share of
tokens routed alike in every layer. ``dense`` is the level replay should bring the MoE model to.

    OMP_NUM_THREADS=1 python benchmarks/moe_replay.py [--sft-loss 0.5] [--prompts 64]

Last line: ``RESULT bf16_kl_dense=... bf16_kl_moe=... bf16_kl_moe_replay=... keep_kl_dense=...
keep_kl_moe=... keep_kl_moe_replay=... bf16_replay_over_dense=... keep_replay_over_dense=...
keep_per_update_dense=... keep_per_update_moe=... keep_per_update_moe_replay=...`` (the kept-cache
KL over the update's own, ``KL stale``: the update moves the two models by different amounts).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass

import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from areal_lite.actors.sft import SFTActor
from areal_lite.api.config import LocalEngineConfig, OptimizerConfig, TrainEngineConfig
from areal_lite.api.engine import PackedBatch
from areal_lite.api.io import FinetuneSpec, GenerationConfig, ModelRequest, ModelResponse, SaveLoadMeta
from areal_lite.cpu.precision import cpu_kind
from areal_lite.engines.local.engine import LocalInferenceEngine
from areal_lite.engines.train.fsdp import FSDPEngine
from areal_lite.utils.datasets import addition_problems, sft_batch
from areal_lite.utils.tiny import build_tiny_model
from areal_lite.workflows.trajectory import from_responses

INTO, AFTER = 6, 18
"""Kept-cache source: tokens generated when the update lands, and after it."""


@dataclass
class Scored:
    train: torch.Tensor
    """The train engine's log-probabilities of the scored tokens."""
    inference: torch.Tensor
    """The inference engine's (behaviour) log-probabilities of the same tokens."""
    routing: dict[str, float]
    """The train engine's ``moe/*`` statistics."""


def build(path: str, arch: str) -> str:
    return build_tiny_model(
        path, arch=arch, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4, vocab_size=0,
        max_position_embeddings=64, num_experts=8, num_experts_per_tok=2, seed=0,
    )  # fmt: skip


def sft(base: str, out_old: str, out_new: str, target_loss: float, max_steps: int) -> str:
    """SFT (AdamW 1e-3, 128 problems a step) until the mean loss of the last 10 steps is at most
    ``target_loss``, into ``out_old``; then one more step at the RL learning rate 1e-4 into
    ``out_new`` (the kept-cache source's weight update). Returns a line for the table."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    cfg = TrainEngineConfig(path=base, optimizer=OptimizerConfig(lr=1e-3))
    engine = FSDPEngine(cfg)
    engine.initialize(FinetuneSpec(1, (max_steps + 1) * 128, 128))
    actor = SFTActor(cfg, engine)

    def batch_of(step: int) -> TensorDict:
        problems = addition_problems(128, 2, seed=1000 + step)
        return sft_batch(tokenizer, [{"prompt": p["prompt"], "completion": p["answer"]} for p in problems])

    losses: list[float] = []
    for step in range(max_steps):
        losses.append(actor.train_lm(batch_of(step))["loss"])
        if len(losses) >= 10 and sum(losses[-10:]) / 10 <= target_loss:
            break
    engine.save(SaveLoadMeta(path=out_old, weight_format="hf", tokenizer=tokenizer))
    engine.forward_backward(batch_of(max_steps), actor.loss_fn, actor.loss_weight)
    engine.optim_step(lr=1e-4)
    engine.save(SaveLoadMeta(path=out_new, weight_format="hf", tokenizer=tokenizer))
    engine.destroy()
    return f"{len(losses)} SFT steps to a loss of {sum(losses[-10:]) / 10:.3f}"


def prompts_of(tokenizer: object, n: int) -> list[list[int]]:
    return [tokenizer(p["prompt"])["input_ids"] for p in addition_problems(n, 2, seed=7)]  # type: ignore[operator]


def generate(path: str, prompts: list[list[int]], moe: bool, update_to: str | None) -> list[ModelResponse]:
    """8 samples of each prompt by the fp32 engine; with ``update_to``, the requests run
    ``INTO + AFTER`` tokens and the weights of ``update_to`` land ``INTO`` tokens in, caches kept."""
    engine = LocalInferenceEngine(
        LocalEngineConfig(path=path, max_running_requests=len(prompts) * 8, keep_cache_on_update=True, seed=0)
    )
    engine.initialize()
    n_new = INTO + AFTER if update_to else 8
    g = GenerationConfig(max_new_tokens=n_new, ignore_eos=update_to is not None, return_routed_experts=moe)
    reqs = [ModelRequest(input_ids=p, gconfig=g) for p in prompts for _ in range(8)]

    async def run() -> list[ModelResponse]:
        tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in reqs]
        if update_to is not None:
            while (engine.scheduler.generated_tokens(reqs[-1].rid) or 0) < INTO:
                await asyncio.sleep(0.002)
            new = AutoModelForCausalLM.from_pretrained(update_to).state_dict()
            await asyncio.wrap_future(engine.scheduler.weights.load_tensors(new, version=1))
        return list(await asyncio.gather(*tasks))

    try:
        return asyncio.run(run())
    finally:
        engine.destroy()


def score(path: str, batch: TensorDict, dtype: str, replay: bool, only_version: int | None) -> Scored:
    """The train engine's (``path`` in ``dtype``) log-probabilities of the batch's generated tokens
    (those of ``only_version`` when given), packed, and its routing statistics (one micro-batch)."""
    kept: list[torch.Tensor] = []

    def loss_fn(logp: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict]:
        mask = mb["loss_mask"].bool()  # type: ignore[union-attr]
        if only_version is not None:
            mask &= mb["versions"] == only_version  # type: ignore[operator]
        kept.append(torch.stack([logp[mask], mb["logprobs"][mask]]).double())  # type: ignore[index]
        return logp.sum() * 0, {}

    engine = FSDPEngine(TrainEngineConfig(path=path, dtype=dtype, routing_replay=replay))
    engine.initialize()
    try:
        stats = engine.eval_batch(batch, loss_fn, lambda mb: 1.0)
    finally:
        engine.destroy()
    (both,) = kept
    return Scored(train=both[0], inference=both[1], routing=stats)


def mismatch(d: torch.Tensor) -> dict[str, float]:
    """Statistics of ``d`` = log importance weights (train - inference) of the scored tokens."""
    w = d.exp()
    return {"kl": float((w - 1 - d).mean()), "max_abs": float(d.abs().max()), "w_std": float(w.std()),
            "w_max": float(w.max()), "tokens": float(d.numel())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sft-loss", type=float, default=0.5, help="SFT both models to this training loss")
    parser.add_argument("--max-sft-steps", type=int, default=800)
    parser.add_argument("--prompts", type=int, default=64, help="prompts (x 8 samples) per source")
    args = parser.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    rows: list[tuple[str, str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoTokenizer

        paths, trained = {}, {}
        for name, arch in (("dense", "qwen3"), ("moe", "qwen3_moe")):
            base = build(f"{tmp}/{name}/base", arch)
            paths[name] = (f"{tmp}/{name}/old", f"{tmp}/{name}/new")
            trained[name] = sft(base, *paths[name], args.sft_loss, args.max_sft_steps)
        prompts = prompts_of(AutoTokenizer.from_pretrained(paths["dense"][0]), args.prompts)
        for name in ("dense", "moe"):
            old, new = paths[name]
            moe = name == "moe"
            resps = generate(old, prompts, moe, update_to=None)
            batch = from_responses(resps, [0.0] * len(resps))
            for replay in (False, True) if moe else (False,):
                label = "MoE, replay" if replay else ("MoE" if moe else "dense")
                s = score(old, batch, "bfloat16", replay, None)
                rows.append(("bf16 train", label, {**mismatch(s.train - s.inference), **s.routing}))
            floor = score(old, batch, "float32", moe, None)  # both engines in fp32, same weights
            rows.append(("fp32 both", label, {**mismatch(floor.train - floor.inference), **floor.routing}))

            resps = generate(old, prompts, moe, update_to=new)
            batch = from_responses(resps, [0.0] * len(resps))
            for replay in (False, True) if moe else (False,):
                label = "MoE, replay" if replay else ("MoE" if moe else "dense")
                s = score(new, batch, "float32", replay, only_version=1)
                before = score(old, batch, "float32", replay, only_version=1)
                stale = mismatch(s.train - before.train)["kl"]
                rows.append(("kept cache", label, {**mismatch(s.train - s.inference), **s.routing, "stale": stale}))

    print(f"\nCPU: {cpu_kind()}; {args.prompts} prompts x 8 samples per source; {(time.time() - t0) / 60:.1f} min")
    print(f"dense: {trained['dense']}; MoE: {trained['moe']}")
    print(
        f"{'source':<12}{'model':<13}{'tokens':>7}{'KL':>11}{'max |d|':>10}{'w std':>9}{'w max':>9}"
        f"{'agreement':>11}{'tokens alike':>14}{'KL stale':>11}"
    )
    for source, label, s in sorted(rows, key=lambda r: r[0]):
        agree, alike, stale = s.get("moe/routing_agreement"), s.get("moe/token_route_match"), s.get("stale")
        print(
            f"{source:<12}{label:<13}{s['tokens']:>7.0f}{s['kl']:>11.2e}{s['max_abs']:>10.3f}{s['w_std']:>9.4f}"
            f"{s['w_max']:>9.3f}{'' if agree is None else f'{agree:.4f}':>11}"
            f"{'' if alike is None else f'{alike:.4f}':>14}{'' if stale is None else f'{stale:.2e}':>11}"
        )
    kl = {(src, label): s["kl"] for src, label, s in rows}
    stale = {label: s["stale"] for src, label, s in rows if src == "kept cache"}
    # A kept cache's mismatch scales with the update it spans: per unit of the update's own KL
    per_update = {label: kl["kept cache", label] / stale[label] for label in stale}
    print(
        f"RESULT bf16_kl_dense={kl['bf16 train', 'dense']:.2e} bf16_kl_moe={kl['bf16 train', 'MoE']:.2e} "
        f"bf16_kl_moe_replay={kl['bf16 train', 'MoE, replay']:.2e} keep_kl_dense={kl['kept cache', 'dense']:.2e} "
        f"keep_kl_moe={kl['kept cache', 'MoE']:.2e} keep_kl_moe_replay={kl['kept cache', 'MoE, replay']:.2e} "
        f"bf16_replay_over_dense={kl['bf16 train', 'MoE, replay'] / kl['bf16 train', 'dense']:.2f} "
        f"keep_replay_over_dense={kl['kept cache', 'MoE, replay'] / kl['kept cache', 'dense']:.2f} "
        f"keep_per_update_dense={per_update['dense']:.2f} keep_per_update_moe={per_update['MoE']:.2f} "
        f"keep_per_update_moe_replay={per_update['MoE, replay']:.2f}"
    )


if __name__ == "__main__":
    main()
