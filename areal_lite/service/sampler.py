"""Sampling for the service: one HF model per base model, with any number of LoRA adapters
(sampler snapshots of the training runs) over the same base weights.

An adapter is a frozen copy of a training run's adapter taken by ``save_weights_for_sampler``: it
stays as it was while the run trains on. peft keeps every adapter unmerged beside the base
weights and routes each forward pass through the one a request names (its ``adapter_names``
mixed-batch mode), so no adapter is ever merged into the base and snapshots of several runs sample
from one copy of the base. A full fine-tuning snapshot has weights of its own: it gets a
`Generator` of its own.

`Generator.sample` runs one request: the prompt through the model once, its KV cache repeated for
the ``n`` samples, then one decode step for all samples at a time until each has stopped (a stop
token or string) or reached ``max_tokens``. Reported log-probabilities are the policy's own
(temperature 1, before top-k/top-p), as the train engine computes them, so that an importance
ratio against the trainer's log-probabilities is 1 where the weights are the same.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from areal_lite.service.wire import BadRequest, Samples, Sequence, Unsupported
from areal_lite.utils.lora import lora_config_of, peft_name

BASE = "__base__"
"""peft's name, in a mixed batch, for rows that use no adapter."""
EMPTY_TOPK = -99999.0
"""The SDK's log-prob for a top-k cell with no entry (the first prompt position)."""


@dataclass
class SamplingParams:
    """One sampling request's parameters, as the Tinker API names them."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    """None: the model's eos token(s); empty: never stop before ``max_tokens``."""
    stop_strings: tuple[str, ...] = ()
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None
    topk_prompt: int = 0
    topk_sample: int = 0

    @staticmethod
    def from_request(params: Mapping[str, object], body: Mapping[str, object]) -> SamplingParams:
        """The parameters of a ``SampleRequest`` (``sampling_params`` and the request's flags).
        ``stop``: None keeps the eos stop; a string or list of strings stops on those strings; a
        list of ints on those token ids (and nothing else: ``[]`` never stops early)."""
        if body.get("target_prompt_logprobs") is not None or int(body.get("prompt_alt_tokens_k") or 0):  # type: ignore[call-overload]
            raise Unsupported("target_prompt_logprobs and prompt_alt_tokens_k are not supported by this service")
        stop = params.get("stop")
        stop_ids: tuple[int, ...] | None = None
        stop_strs: tuple[str, ...] = ()
        if isinstance(stop, str):
            stop_strs = (stop,)
        elif isinstance(stop, list):
            if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
                stop_ids = tuple(stop)  # type: ignore[arg-type]
            elif all(isinstance(s, str) for s in stop):
                stop_strs = tuple(stop)  # type: ignore[arg-type]
            else:
                raise BadRequest("sampling_params.stop must be a string, a list of strings or a list of token ids")
        elif stop is not None:
            raise BadRequest("sampling_params.stop must be a string, a list of strings or a list of token ids")
        max_tokens = params.get("max_tokens")
        out = SamplingParams(
            max_tokens=128 if max_tokens is None else int(max_tokens),  # type: ignore[call-overload]
            temperature=float(params.get("temperature", 1.0)),  # type: ignore[arg-type]
            top_k=int(params.get("top_k", -1)),  # type: ignore[call-overload]
            top_p=float(params.get("top_p", 1.0)),  # type: ignore[arg-type]
            seed=None if params.get("seed") is None else int(params["seed"]),  # type: ignore[call-overload]
            stop_token_ids=stop_ids,
            stop_strings=stop_strs,
            prompt_logprobs=bool(body.get("prompt_logprobs")),
            prompt_logprobs_last_n=None
            if body.get("prompt_logprobs_last_n") is None
            else int(body["prompt_logprobs_last_n"]),  # type: ignore[call-overload]
            topk_prompt=int(body.get("topk_prompt_logprobs") or 0),  # type: ignore[call-overload]
            topk_sample=int(body.get("topk_sample_logprobs") or 0),  # type: ignore[call-overload]
        )
        if out.max_tokens < 1:
            raise BadRequest(f"sampling_params.max_tokens must be >= 1, got {out.max_tokens}")
        if out.temperature < 0 or not 0 < out.top_p <= 1:
            raise BadRequest("sampling_params: temperature must be >= 0 and top_p in (0, 1]")
        return out


class Generator:
    """A frozen HF causal LM for sampling, with named LoRA adapters (at most ``max_adapters``
    loaded; the least recently used is dropped first). Used from the service's engine thread only."""

    def __init__(self, path: str, dtype: torch.dtype, max_adapters: int = 64, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.peft: torch.nn.Module | None = None
        """peft's wrapper, once an adapter was added."""
        self.adapters: OrderedDict[str, None] = OrderedDict()
        self.max_adapters = max_adapters
        self.rng = torch.Generator().manual_seed(seed)
        """Draws for requests without a seed of their own."""
        # transformers 5.24 renamed past_key_values to cache (the old name warns, then goes).
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(type(self.model).forward).parameters else "past_key_values"
        )
        eos = self.model.generation_config.eos_token_id
        self.eos: tuple[int, ...] = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_len = int(self.model.config.max_position_embeddings)

    # ---------------------------------------------------------------- adapters

    def has_adapter(self, name: str) -> bool:
        if name in self.adapters:
            self.adapters.move_to_end(name)
            return True
        return False

    def add_adapter(self, name: str, config: Mapping[str, object], tensors: Mapping[str, torch.Tensor]) -> None:
        """Load adapter ``name`` (its PEFT config and tensors), replacing one of that name."""
        from peft import get_peft_model, set_peft_model_state_dict

        if name in self.adapters:
            self.drop_adapter(name)
        while len(self.adapters) >= self.max_adapters:
            self.drop_adapter(next(iter(self.adapters)))
        cfg = lora_config_of(config)
        if self.peft is None:
            self.peft = get_peft_model(self.model, cfg, adapter_name=name)
        else:
            self.peft.add_adapter(name, cfg)
        dtype = next(self.model.parameters()).dtype
        state = {peft_name(k): v.to(dtype) for k, v in tensors.items()}
        result = set_peft_model_state_dict(self.peft, state, adapter_name=name)
        missing = [k for k in result.missing_keys if f".{name}." in k]
        if missing:
            self.drop_adapter(name)
            raise ValueError(f"adapter {name!r} lacks tensors for {len(missing)} of its weights, e.g. {missing[0]}")
        self.peft.eval()
        self.adapters[name] = None

    def drop_adapter(self, name: str) -> None:
        if name not in self.adapters:
            return
        assert self.peft is not None
        del self.adapters[name]
        if self.adapters:
            self.peft.delete_adapter(name)
        else:  # peft keeps at least one adapter: take the LoRA layers out altogether
            self.model = self.peft.unload()
            self.peft = None

    # ---------------------------------------------------------------- sampling

    def _forward(self, ids: torch.Tensor, adapter: str | None, cache: object | None) -> tuple[torch.Tensor, object]:
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"adapter {adapter!r} is not loaded")
        extra: dict[str, object] = {} if self.peft is None else {"adapter_names": [adapter or BASE] * ids.shape[0]}
        if cache is not None:
            extra[self._cache_arg] = cache
        model = self.peft if self.peft is not None else self.model
        out = model(input_ids=ids, use_cache=True, **extra)
        return out.logits.float(), getattr(out, self._cache_arg)

    @torch.no_grad()
    def sample(self, prompt: list[int], n: int, params: SamplingParams, adapter: str | None = None) -> Samples:
        """``n`` completions of ``prompt`` under ``adapter`` (None: the base weights)."""
        if not prompt:
            raise BadRequest("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise BadRequest(f"the prompt holds token ids outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) + params.max_tokens > self.max_len:
            raise BadRequest(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceed the context of {self.max_len}"
            )
        if n < 1:
            raise BadRequest(f"num_samples must be >= 1, got {n}")
        logits, cache = self._forward(torch.tensor([prompt]), adapter, None)
        result = Samples([], *self._prompt_stats(prompt, logits[0], params))
        cache.batch_repeat_interleave(n)  # type: ignore[attr-defined]
        rng = torch.Generator().manual_seed(params.seed) if params.seed is not None else self.rng
        stop_ids = set(self.eos if params.stop_token_ids is None else params.stop_token_ids)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        topks: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        step_logits = logits[0, -1:].expand(n, -1)
        for step in range(params.max_tokens):
            logp = torch.log_softmax(step_logits, dim=-1)
            chosen = self._choose(step_logits, params, rng)
            chosen_lp = logp.gather(1, chosen[:, None])[:, 0].tolist()
            if params.topk_sample:
                top = logp.topk(params.topk_sample, dim=-1)
            for row, token in enumerate(chosen.tolist()):
                if reasons[row] is not None:
                    continue
                tokens[row].append(token)
                logps[row].append(chosen_lp[row])
                if params.topk_sample:
                    topks[row].append((top.indices[row].numpy(), top.values[row].numpy()))
                if token in stop_ids or self._hit_stop_string(tokens[row], params.stop_strings):
                    reasons[row] = "stop"
            if all(r is not None for r in reasons) or step == params.max_tokens - 1:
                break
            step_logits, cache = self._forward(chosen[:, None], adapter, cache)
            step_logits = step_logits[:, -1]
        for row in range(n):
            topk = (np.stack([t[0] for t in topks[row]]), np.stack([t[1] for t in topks[row]])) if topks[row] else None
            result.sequences.append(Sequence(tokens[row], logps[row], reasons[row] or "length", topk))  # type: ignore[arg-type]
        return result

    def _choose(self, logits: torch.Tensor, params: SamplingParams, rng: torch.Generator) -> torch.Tensor:
        """One token per row: greedy at temperature 0, else a draw at the temperature from the
        top-k / top-p nucleus (transformers' own warpers)."""
        if params.temperature == 0:
            return logits.argmax(dim=-1)
        from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

        scores = logits / params.temperature
        if params.top_k > 0:
            scores = TopKLogitsWarper(params.top_k)(None, scores)
        if params.top_p < 1.0:
            scores = TopPLogitsWarper(params.top_p)(None, scores)
        return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=rng)[:, 0]

    def _hit_stop_string(self, tokens: list[int], stops: tuple[str, ...]) -> bool:
        if not stops:
            return False
        text = self.tokenizer.decode(tokens)
        return any(s in text for s in stops)

    def _prompt_stats(
        self, prompt: list[int], logits: torch.Tensor, params: SamplingParams
    ) -> tuple[np.ndarray | None, tuple[np.ndarray, np.ndarray] | None]:
        """The prompt's log-probabilities ([P], NaN where not scored) and top-k ([P, k]), as asked."""
        if not (params.prompt_logprobs or params.topk_prompt):
            return None, None
        logp = torch.log_softmax(logits[:-1], dim=-1)  # row i predicts prompt token i + 1
        first = 1
        if params.prompt_logprobs_last_n is not None:
            if not 1 <= params.prompt_logprobs_last_n <= len(prompt) - 1:
                raise BadRequest(f"prompt_logprobs_last_n must be in [1, {len(prompt) - 1}]")
            first = len(prompt) - params.prompt_logprobs_last_n
        values = None
        if params.prompt_logprobs:
            scored = logp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].numpy()
            values = np.concatenate([[np.nan], scored]).astype(np.float32)
            values[:first] = np.nan
        topk = None
        if params.topk_prompt:
            k = params.topk_prompt
            top = logp.topk(k, dim=-1)
            ids = np.zeros((len(prompt), k), dtype=np.int32)
            lps = np.full((len(prompt), k), EMPTY_TOPK, dtype=np.float32)
            ids[first:] = top.indices.numpy()[first - 1 :]
            lps[first:] = top.values.numpy()[first - 1 :]
            topk = (ids, lps)
        return values, topk
