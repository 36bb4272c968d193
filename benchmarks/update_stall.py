"""What a weight update costs running requests: recomputing their KV caches or keeping them.

The embedded engine applies a weight update between two decode steps. By default it then
recomputes every running request's cache under the new weights (one prefill of all their
tokens), so the tokens sampled afterwards are exactly the new policy's; with
``local_engine.keep_cache_on_update=true`` it keeps the caches, so the update is only a copy of
the weights, but the tokens sampled afterwards attend to keys and values the old weights made.
This measures both sides of that trade on the 20M Qwen2 of ``benchmarks/roofline.py``:

- ``update s``: how long generation stalls for the update (the engine's future, from the call
  to the weights being live), with ``B`` requests running, each 16-128 prompt tokens and 40
  tokens into its output (32 more follow); ``in decode steps``: that stall over the median decode step time.
- ``|dlogp| after``: the mean absolute difference between the log-probabilities the engine
  reported for tokens sampled after the update and a plain HF forward of the new weights over
  the same tokens (``before``: against the old weights for the tokens before it, float noise);
  ``KL after``: the mean of ``exp(d) - 1 - d`` over those tokens, ``d`` the difference (a
  non-negative estimate of the KL between what sampled them and the new policy); ``KL stale``:
  the same between the old and the new weights on those tokens, what a request finished
  entirely on the old weights would carry (the staleness asynchronous RL already corrects).

The update is one AdamW step (``--lr``, default the quickstart's 1e-4) of the model on its own
greedy text, a realistic step size. Modes alternate over ``--repeats`` rounds; a row is its
median.

    OMP_NUM_THREADS=1 python benchmarks/update_stall.py [--batch 64] [--repeats 3]

Last line: ``RESULT recompute_s=... keep_s=... stall_ratio=... keep_kl=... recompute_kl=... stale_kl=...``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
from roofline import MODELS, mixed_prompts  # the model and prompts of the roofline
from transformers import AutoModelForCausalLM

from areal_lite.api.config import LocalEngineConfig
from areal_lite.engines.local.request import GenerationResult, SamplingParams
from areal_lite.engines.local.scheduler import Scheduler
from areal_lite.utils.tiny import build_tiny_model


@dataclass
class Sample:
    update_s: float
    step_s: float
    dlogp_before: float
    dlogp_after: float
    kl_after: float
    kl_stale: float


def one_adamw_step(model: torch.nn.Module, lr: float, seed: int) -> dict[str, torch.Tensor]:
    """The weights after one AdamW step on next-token loss over random sequences."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (8, 64), generator=g)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model(ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def token_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0, :-1]
    return logp.gather(1, ids[0, 1:, None])[len(prompt) - 1 :, 0]


INTO, AFTER = 40, 32
"""Tokens each request has generated when the update lands, and generates after it."""


def sample(path: str, keep: bool, new_state: dict[str, torch.Tensor], batch: int, seed: int) -> Sample:
    scheduler = Scheduler(LocalEngineConfig(path=path, max_running_requests=batch, keep_cache_on_update=keep))
    scheduler.start()
    assert scheduler.model is not None
    prompts = mixed_prompts(batch, seed, scheduler.model.config.vocab_size)
    step_times: list[float] = []
    try:

        async def run() -> tuple[float, list[GenerationResult]]:
            tasks = [
                asyncio.ensure_future(
                    scheduler.generate(p, SamplingParams(max_new_tokens=INTO + AFTER, ignore_eos=True), rid=str(i))
                )
                for i, p in enumerate(prompts)
            ]
            # The requests run in lockstep: time the decode steps until they are INTO tokens in.
            last, t_last = 0, time.perf_counter()
            while last < INTO:
                await asyncio.sleep(0.002)
                n, now = scheduler.generated_tokens("0") or 0, time.perf_counter()
                if n > last:
                    step_times.append((now - t_last) / (n - last))
                    last, t_last = n, now
            t0 = time.perf_counter()
            await asyncio.wrap_future(scheduler.weights.load_tensors(new_state, version=1))
            return time.perf_counter() - t0, await asyncio.gather(*tasks)

        update_s, results = asyncio.run(run())
    finally:
        scheduler.stop()
    old = AutoModelForCausalLM.from_pretrained(path).eval()
    new = AutoModelForCausalLM.from_pretrained(path).eval()
    new.load_state_dict(new_state)
    before, after, stale = [], [], []
    for p, r in zip(prompts, results):
        lp = torch.tensor(r.output_logprobs)
        switch = r.output_versions.index(1)
        old_lp, new_lp = token_logprobs(old, p, r.output_ids), token_logprobs(new, p, r.output_ids)
        before.append(lp[:switch] - old_lp[:switch])
        after.append(lp[switch:] - new_lp[switch:])
        stale.append(old_lp[switch:] - new_lp[switch:])
    b, a, st = torch.cat(before), torch.cat(after), torch.cat(stale)
    return Sample(update_s, statistics.median(step_times[1:]), float(b.abs().mean()), float(a.abs().mean()),
                  kl(a), kl(st))  # fmt: skip


def kl(d: torch.Tensor) -> float:
    """Mean of ``exp(d) - 1 - d`` (k3): a non-negative estimate of the KL between the policies
    whose log-probability difference on sampled tokens is ``d``."""
    return float((d.exp() - 1 - d).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="running requests when the update lands")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW lr of the update (the quickstart's)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(f"{tmp}/20M", vocab_size=512, **MODELS["20M"])
        new_state = one_adamw_step(AutoModelForCausalLM.from_pretrained(path), args.lr, seed=0)
        rows: dict[str, list[Sample]] = {"recompute": [], "keep": []}
        for r in range(args.repeats):
            for mode in ("recompute", "keep") if r % 2 == 0 else ("keep", "recompute"):
                rows[mode].append(sample(path, mode == "keep", new_state, args.batch, seed=r))
    med = {
        m: {f: statistics.median(getattr(s, f) for s in v) for f in Sample.__dataclass_fields__}
        for m, v in rows.items()
    }
    print(f"20M Qwen2, {args.batch} running requests, one AdamW step at lr {args.lr:g}, {args.threads} thread(s)")
    print(
        f"{'mode':<11}{'update s':>10}{'in decode steps':>17}{'|dlogp| before':>16}{'|dlogp| after':>15}"
        f"{'KL after':>11}{'KL stale':>11}"
    )
    for mode, m in med.items():
        print(
            f"{mode:<11}{m['update_s']:>10.3f}{m['update_s'] / m['step_s']:>17.1f}{m['dlogp_before']:>16.2e}"
            f"{m['dlogp_after']:>15.2e}{m['kl_after']:>11.2e}{m['kl_stale']:>11.2e}"
        )
    rec, keep = med["recompute"], med["keep"]
    print(
        f"RESULT recompute_s={rec['update_s']:.3f} keep_s={keep['update_s']:.3f} "
        f"stall_ratio={rec['update_s'] / keep['update_s']:.1f} keep_kl={keep['kl_after']:.2e} "
        f"recompute_kl={rec['kl_after']:.2e} stale_kl={keep['kl_stale']:.2e}"
    )


if __name__ == "__main__":
    main()
