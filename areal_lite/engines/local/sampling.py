"""How the embedded engine picks each row's next token, and what it records with it.

`choose_tokens` takes a greedy row's argmax of its shaped logits (min-token suppression, logit
bias, penalties: `areal_lite.engines.local.shaping`); any other row draws at its temperature,
after min-p, top-k and top-p, by `inverse_cdf` from a uniform of the engine's random stream or of
the request's own (``seed``). `record_tokens` appends each token to its request with its
log-probability, which is the policy's own (temperature 1, before top-p/top-k/min-p, min-token
suppression, logit biases and penalties), as the train engine recomputes them, and the most
likely tokens when the request asks for them.
"""

from __future__ import annotations

import math

import torch

from areal_lite.engines.local import grammar
from areal_lite.engines.local.request import Sequence
from areal_lite.engines.local.shaping import min_p_masked, shaped, suppressing, top_k_top_p_masked

NOT_FINITE = "the model's next-token probabilities are not finite (NaN): its weights or inputs have diverged"
"""Why a decode step fails when the model outputs NaN, instead of an index error from sampling."""


def choose_tokens(
    raw: torch.Tensor, policy: torch.Tensor, seqs: list[Sequence], generator: torch.Generator
) -> torch.Tensor:
    """The next token [n] of each of ``seqs`` from its row of ``raw`` logits [n, V] (fp32), whose
    softmax is ``policy`` (drawn from when a row is sampled as the policy stands); uniforms come
    from ``generator`` unless a request has a seed of its own. FloatingPointError on NaN."""
    params = [s.params for s in seqs]
    logits = shaped(raw, seqs)  # min-token suppression, logit bias, penalties
    greedy = [p.greedy for p in params]
    if all(greedy):
        tokens = logits.argmax(dim=-1)
    else:
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        filtered = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
        if logits is raw and not filtered and all(t == 1.0 and p.min_p == 0 for t, p in zip(temps, params)):
            scores = None
        else:
            scores = min_p_masked(logits / torch.tensor(temps, device=logits.device)[:, None], params)
        if filtered:
            scores = top_k_top_p_masked(scores, params)
        probs = policy if scores is None else torch.softmax(scores, dim=-1)
        u = torch.rand((len(seqs), 1), generator=generator, dtype=torch.float64, device=probs.device)
        for j, s in enumerate(seqs):
            if s.params.seed is not None and not s.params.greedy:
                # A seeded request draws from its own stream, whatever else shares the batch.
                if s.rng is None:
                    s.rng = torch.Generator(device=probs.device).manual_seed(s.params.seed)
                u[j] = torch.rand(1, generator=s.rng, dtype=torch.float64, device=probs.device)
        sampled = inverse_cdf(probs, u)
        tokens = (
            torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(dim=-1), sampled)
            if any(greedy)
            else sampled
        )
    if bool((tokens >= logits.shape[-1]).any()):  # sampling past the vocabulary: NaN probabilities
        raise FloatingPointError(NOT_FINITE)
    return tokens


def record_tokens(seqs: list[Sequence], tokens: torch.Tensor, raw: torch.Tensor, policy: torch.Tensor) -> None:
    """Append each of ``tokens`` to its request of ``seqs`` with its log-probability under
    ``policy`` (the softmax of the ``raw`` logits), advance the request's grammar, and add the most
    likely tokens of a request that asks for them. FloatingPointError on NaN."""
    chosen = policy.gather(1, tokens[:, None])[:, 0]
    if bool(chosen.isnan().any()):  # a greedy row's argmax over NaN logits
        raise FloatingPointError(NOT_FINITE)
    tiny = chosen < 1e-30
    chosen = chosen.log()
    if bool(tiny.any()):
        # Far below one in 1e30 the float32 probability loses precision (and underflows to
        # 0 past ~1e-45): those rows' log-probabilities come from the logits directly.
        # (Possible only for a token sampled at a temperature above 1, or after suppression,
        # a bias or a penalty.)
        at = tiny.nonzero()[:, 0]
        chosen[at] = raw[at].gather(1, tokens[at, None])[:, 0] - torch.logsumexp(raw[at], dim=-1)
    for s, t, lp in zip(seqs, tokens.tolist(), chosen.tolist()):
        s.out.append(t)
        s.logprobs.append(lp)
        grammar.advance(s, t)
    k = max(s.params.top_logprobs for s in seqs)
    if k:
        logp = torch.log_softmax(raw, dim=-1)
        values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
        for s, row_ids, row_values in zip(seqs, ids.tolist(), values.tolist()):
            n = s.params.top_logprobs
            if n:
                s.top.append(list(zip(row_ids[:n], row_values[:n])))


def graph_mode(seqs: list[Sequence]) -> str:
    """How a decode step of ``seqs`` can choose its tokens inside the step's CUDA graph: ``greedy``
    (every row greedy) or ``sample`` (every row sampled as the policy stands: temperature 1, no
    top-k, top-p or min-p, no seed of its own), with nothing shaping the logits (no grammar,
    suppression, bias or penalty) and no top log-probabilities asked; else ``logits`` (the graph
    gives the logits and `choose_tokens` runs after it)."""
    mode = "logits"
    for s in seqs:
        p = s.params
        if p.top_logprobs or s.matcher is not None or p.reshapes_logits or suppressing(s):
            return "logits"
        if p.greedy:
            row = "greedy"
        elif p.temperature == 1.0 and p.top_k <= 0 and p.top_p >= 1.0 and p.min_p == 0 and p.seed is None:
            row = "sample"
        else:
            return "logits"
        if mode not in ("logits", row):
            return "logits"
        mode = row
    return mode


def choose_plain(raw: torch.Tensor, policy: torch.Tensor, mode: str, uniforms: torch.Tensor | None) -> torch.Tensor:
    """`chosen_logprobs` of the rows' tokens as `graph_mode` allows choosing them on the device:
    the argmax of ``raw`` (``greedy``), or `inverse_cdf` of ``policy`` at ``uniforms`` (``sample``)."""
    tokens = raw.argmax(dim=-1) if mode == "greedy" else inverse_cdf(policy, uniforms)
    return chosen_logprobs(tokens, raw, policy)


def chosen_logprobs(tokens: torch.Tensor, raw: torch.Tensor, policy: torch.Tensor) -> torch.Tensor:
    """``[n, 2]`` float64: each row's token and its log-probability under ``policy`` (the softmax of
    ``raw``), as `record_tokens` reports it, computed without reading anything back: NaN where the
    probabilities were not finite (or the token is past the vocabulary)."""
    vocab = raw.shape[-1]
    at = tokens.clamp(max=vocab - 1)[:, None]
    chosen = policy.gather(1, at)[:, 0]
    exact = raw.gather(1, at)[:, 0] - torch.logsumexp(raw, dim=-1)
    logp = torch.where(chosen < 1e-30, exact, chosen.log())
    logp = torch.where(tokens >= vocab, torch.full_like(logp, float("nan")), logp)
    return torch.stack([tokens.double(), logp.double()], dim=1)


def record_chosen(seqs: list[Sequence], chosen: list[list[float]], vocab: int) -> None:
    """Append the tokens and log-probabilities of `chosen_logprobs` (read back) to ``seqs``.
    FloatingPointError on NaN. No grammar or top log-probabilities: `graph_mode` left those out."""
    for s, (t, lp) in zip(seqs, chosen):
        if math.isnan(lp) or t >= vocab:
            raise FloatingPointError(NOT_FINITE)
        s.out.append(int(t))
        s.logprobs.append(lp)


CDF_BLOCK = 256
"""Vocabulary entries per block of `inverse_cdf`'s first level."""
SMALL_VOCAB = 2048
"""Up to this many entries `inverse_cdf` takes one running sum, faster there than two levels
(`benchmarks/sampling.py`)."""


def running_sum_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`inverse_cdf` by one float64 running sum over each whole row (a [n, V] float64 copy): what
    it does up to `SMALL_VOCAB` entries, and what the engine did at every size before."""
    running = probs.double().cumsum_(dim=-1)
    total = running[:, -1:]
    # Below the total even where u x total rounds up to it: the token found has a positive share.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(running, target, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A token per row of ``probs`` [n, V] (non-negative, fp32): the first whose running sum of
    the row exceeds ``u`` [n, 1] (float64 uniforms in [0, 1)) times the row's total, so drawn
    with its probability, never one of probability 0 (its running sum equals the one before it).

    The running sums are in float64, so a token's share is its probability to ~1e-16 even at the
    end of a large vocabulary (in float32 the rare tokens' would blur). Past `SMALL_VOCAB` entries
    they come in two levels: the sums of blocks of `CDF_BLOCK` entries pick the block, then the
    running sum of that block's entries picks the token; the same token as one running sum over
    the row, without its [n, V] float64 copy (78 MB at 64 rows of a 151936-token vocabulary, which
    glibc maps afresh at every step in the engine's thread). `benchmarks/sampling.py` measures it
    against one running sum and ``torch.multinomial`` (docs/performance.md, "Sampling without a
    float64 copy of the vocabulary")."""
    n, v = probs.shape
    if v <= SMALL_VOCAB:
        return running_sum_sample(probs, u)
    full = v // CDF_BLOCK
    # Each block summed in float32 (torch's cascade sum, exact to ~1e-7 of the block's mass: a
    # sum with dtype=float64 would first copy the whole row to float64), the blocks in float64.
    sums = probs[:, : full * CDF_BLOCK].reshape(n, full, CDF_BLOCK).sum(dim=-1)
    if full * CDF_BLOCK < v:
        sums = torch.cat([sums, probs[:, full * CDF_BLOCK :].sum(dim=-1, keepdim=True)], dim=1)
    running = sums.double().cumsum_(dim=-1)
    total = running[:, -1:]
    # Below the total even where u x total rounds up to it: the block found has a positive sum.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    found = torch.searchsorted(running, target, right=True).clamp_(max=running.shape[1] - 1)
    before = torch.where(found > 0, running.gather(1, (found - 1).clamp(min=0)), 0.0)
    at = found * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)
    within = probs.gather(1, at.clamp(max=v - 1)).double().masked_fill_(at >= v, 0.0).cumsum_(dim=-1)
    # The block's own sum, added in another order, may round a little below its share of the
    # row's: the remainder stays below it, so the token found has a positive probability.
    last = within[:, -1:]
    rest = torch.minimum((target - before).clamp_(min=0.0), torch.nextafter(last, torch.zeros_like(last)))
    return (found * CDF_BLOCK + torch.searchsorted(within, rest, right=True))[:, 0]
