"""`TrainingModel` (a policy being trained) and `ValueModel` (a value head being trained): the
``train_*`` methods that queue gradient contributions, ``optim_step`` that trains on them
(`areal_lite.recipes.losses`), ``clone_inf``, ``save``, and the weight sync that keeps generation
on the current weights. `areal_lite.recipes.model` says how models are spawned and run."""

from __future__ import annotations

import asyncio
import numbers
import os
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import TypeVar

import torch

from areal_lite.api.engine import TrainEngine
from areal_lite.api.io import GenerationConfig, SaveLoadMeta, WeightUpdateMeta
from areal_lite.recipes.inference import InferenceModel
from areal_lite.recipes.losses import (
    SAMPLE,
    Accumulate,
    DPOLoss,
    Loss,
    PolicyLoss,
    SampleLoss,
    SFTLoss,
    TangentLoss,
    TrainRow,
    ValueLoss,
    batch_order,
    per_sample_loss,
    placeholder_row,
    rows_to_batch,
)
from areal_lite.recipes.process import gather, work_dir
from areal_lite.recipes.thread import StringThread, TokenizedThread

T = TypeVar("T")


def is_scalar(value: object) -> bool:
    """A single number: a Python or numpy float, or a 0-d array or tensor (``advantages[i]``)."""
    return isinstance(value, numbers.Real) or getattr(value, "ndim", None) == 0


def per_token(name: str, values: float | Sequence[float], thread: TokenizedThread) -> list[float]:
    """``values`` as one float per trained token of ``thread`` (a single number is repeated)."""
    if is_scalar(values):
        return [float(values)] * thread.n_trained
    out = [float(v) for v in values]
    if len(out) != thread.n_trained:
        raise ValueError(
            f"{name} has {len(out)} values but the thread has {thread.n_trained} trained tokens "
            "(one value per token of weight > 0)"
        )
    return out


def train_row(thread: TokenizedThread, **values: list[float]) -> TrainRow:
    """The row of a thread: its tokens, its trained tokens, and per-trained-token ``values``
    placed at those tokens (0 elsewhere)."""
    trained = [i for i, w in enumerate(thread.weights) if w > 0]
    row = TrainRow(thread.tokens, [0] * len(thread), {})
    for i in trained:
        row.loss_mask[i] = 1
    for key, vals in values.items():
        full = [0.0] * len(thread)
        for i, v in zip(trained, vals):
            full[i] = v
        row.values[key] = full
    return row


class Queued:
    """What a ``train_*`` call returns: the sample is queued (or the call has raised) by the time
    the call returns, so a bare ``model.train_grpo(...)`` counts, as the reference interface's
    walkthrough writes it; ``await`` on it gives None, so awaiting the call or mapping it with
    `async_map` works too."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        return
        yield  # makes this a generator that finishes at once: there is nothing left to wait for


QUEUED = Queued()


def _free_name(path: str) -> str:
    """``path``, or ``path-<n>`` with the smallest n that does not exist yet."""
    candidate, n = path, 0
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


class _Trainable(InferenceModel):
    """The training half shared by `TrainingModel` and `ValueModel`: the calls queued since the
    last step, ``optim_step``, ``save`` and the training state for recovery."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._queued: list[tuple[Loss, list[TrainRow]]] = []
        self._accumulators: dict[Loss, Accumulate] = {}
        """Each distinct loss's accumulator on the engine (`Loss.accumulator`), made at its first step."""
        self._accumulated = False
        """Whether `forward_backward` added to the gradients since the last step."""
        self.version = 0
        """Optimizer steps taken: the policy version its generations are tagged with."""

    def _trainable(self, sample: TokenizedThread, what: str) -> TokenizedThread:
        if not isinstance(sample, TokenizedThread):
            raise TypeError(f"{what} takes a TokenizedThread (tokenize_thread gives one), got {type(sample).__name__}")
        if sample.n_trained == 0:
            raise ValueError(f"{what}: the thread has no assistant turn (no token of weight > 0): nothing to train on")
        self.threads.check(sample)
        return sample

    def _queue(self, loss: Loss, *rows: TrainRow) -> Queued:
        if self._closed:
            raise RuntimeError(f"model {self.name!r} is closed")
        self._queued.append((loss, list(rows)))
        return QUEUED

    async def optim_step(
        self, lr: float | None = None, wd: float | None = None, max_grad_norm: float | None = None
    ) -> dict[str, float]:
        """Train on every ``train_*`` call made since the last step, then clip, step AdamW and
        zero the gradients. None takes the configured value (`ModelConfig.optimizer`). Returns
        the losses' statistics (prefixed by the loss's name when several kinds were trained),
        ``grad_norm``, ``lr``, ``update_successful``, ``n_samples`` and ``n_tokens`` (all ranks).
        Collective."""
        queued, self._queued = self._queued, []
        accumulated, self._accumulated = self._accumulated, False
        stats = await self._call("optim_step", lambda: self._step(queued, lr, wd, max_grad_norm, accumulated))
        self.version += 1
        self._weights_changed()
        return stats

    def _step(
        self,
        queued: list[tuple[Loss, list[TrainRow]]],
        lr: float | None,
        wd: float | None,
        clip: float | None,
        accumulated: bool = False,
    ) -> dict[str, float]:
        losses = sorted({loss for loss, _ in queued}, key=repr)
        everyone = sorted({loss for mine in gather(losses) for loss in mine}, key=repr)
        if not everyone and not accumulated:
            raise RuntimeError(f"optim_step on {self.name!r} with no gradient accumulated: call a train_* method first")
        stats: dict[str, float] = {}
        n_samples = n_tokens = 0
        names = [loss.name for loss in everyone]
        for i, loss in enumerate(everyone):
            calls = sorted(
                (rs for q, rs in queued if q == loss), key=lambda rs: batch_order(rs[0].input_ids, rs[0].loss_mask)
            )
            rows = [row for rs in calls for row in rs]
            n_samples += len(rows) // loss.rows_per_call
            n_tokens += sum(sum(r.loss_mask) for r in rows)
            batch = rows_to_batch(rows or [placeholder_row(loss.keys)] * loss.rows_per_call)
            if loss not in self._accumulators:
                self._accumulators[loss] = loss.accumulator(self.engine)
            part = self._accumulators[loss](batch)
            prefix = "" if len(everyone) == 1 else f"{loss.name}{i if names.count(loss.name) > 1 else ''}/"
            stats.update({prefix + k: v for k, v in part.items()})
        stats.update(self.engine.optim_step(lr, wd, clip))
        totals = gather((n_samples, n_tokens))
        stats["n_samples"] = float(sum(s for s, _ in totals))
        stats["n_tokens"] = float(sum(t for _, t in totals))
        self.engine.set_version(self.version + 1)
        return stats

    def _weights_changed(self) -> None:
        """Hook: the weights changed (a step or a load)."""

    async def save(self, path: str) -> str:
        """Write the current weights as a HF model directory (with the tokenizer). Collective."""
        meta = SaveLoadMeta(path=path, weight_format="hf", tokenizer=self.tokenizer)
        await self._call("save", lambda: self.engine.save(meta))
        return path

    async def save_model_safely(self, path: str) -> str:
        """`save`, but never over an existing directory: when ``path`` exists, the weights go to
        ``path-1`` (or ``-2``, ...), the first name free on every rank. Returns where they went.
        Collective."""
        chosen = gather(_free_name(path))[0]  # rank 0's choice, so that every rank writes one directory
        return await self.save(chosen)

    async def with_engine(self, what: str, fn: Callable[[TrainEngine], T], changes_weights: bool = False) -> T:
        """``fn(engine)`` on the engine thread, in step with the other ranks (every rank calls it
        with the same ``what``): checkpoints and other collective work on the train engine. Say
        ``changes_weights`` when ``fn`` loads weights (the next generation then syncs)."""
        out = await self._call(what, lambda: fn(self.engine))
        if changes_weights:
            self.version = self.engine.get_version()
            self._weights_changed()
        return out


class TrainingModel(_Trainable):
    """A policy being trained. Build one with `ModelBuilder.spawn_train`.

    The ``train_*`` methods add one sample's share of a gradient; ``optim_step`` applies it. They
    check their arguments and queue the sample when called (a bare call counts; awaiting one works
    too, see `Queued`). Their per-token arguments (``logprobs``, ``advantages``, ``tangents``...)
    have one value per trained token of the sample (``sample.n_trained``: its tokens of weight > 0);
    ``advantages`` may also be one number for the whole sample.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._register("sync", self._sync_handler)
        self._weights = 0
        """Counts the changes of the train engine's weights (steps, loads)."""
        self._generator_weights: int | None = None
        """Which of them the inference engine holds (None: it has not started)."""
        self._sync: tuple[int, asyncio.Future] | None = None
        self._connected = False
        self._clones = 0

    # ---------------------------------------------------------------- generation sees the current weights

    def _weights_changed(self) -> None:
        self._weights += 1

    async def _before_generation(self) -> None:
        if self._generator_weights == self._weights:
            return
        if self._sync is None or self._sync[0] != self._weights:
            self._sync = (self._weights, asyncio.ensure_future(self._packed("sync", None)))
        weights, pending = self._sync
        await pending
        self._generator_weights = weights

    def _generator_started(self) -> None:
        self._generator_weights = 0  # the directory's weights (servers are started on them too)

    def _sync_handler(self, items: list[object]) -> list[object]:
        """Push the train engine's weights to the inference engine. Every rank takes part, and a
        rank whose inference engine has not started starts it here (another rank's generation
        needs the sync, and trainer rank 0 is the one that sends)."""
        generator = self._ensure_generator()
        meta = self._weight_meta()
        if not self._connected:
            self.engine.connect_engine(generator, meta)
            self._connected = True
        self.engine.update_weights(meta)
        self._generator_weights = self._weights
        return [None] * len(items)

    def _weight_meta(self) -> WeightUpdateMeta:
        if not self.config.servers:
            return WeightUpdateMeta(type="in_process")
        if self.config.weight_update == "distributed":
            return WeightUpdateMeta(type="distributed", world_size=1 + len(self.config.servers))
        if self.config.weight_update == "ipc":
            return WeightUpdateMeta(type="ipc")
        path = os.path.join(work_dir(self.config), f"{self.name}-weights")
        return WeightUpdateMeta(type="disk", path=path)

    # ---------------------------------------------------------------- gradient contributions

    def train_sft(self, sample: TokenizedThread | StringThread) -> Awaitable[None]:
        """Supervised fine-tuning: the token-mean negative log-likelihood of the trained tokens.
        A `StringThread` is tokenized off the event loop first: that call counts once awaited."""
        if isinstance(sample, StringThread):
            return self._train_sft_text(sample)
        return self._queue(SFTLoss(), train_row(self._trainable(sample, "train_sft")))

    async def _train_sft_text(self, thread: StringThread) -> None:
        self.train_sft(await self.tokenize_thread(thread))

    def train_ppo(
        self,
        sample: TokenizedThread,
        logprobs: Sequence[float],
        advantages: float | Sequence[float],
        clip_range: float = 0.2,
    ) -> Queued:
        """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) with the ratio against
        ``logprobs`` (the policy that sampled the tokens) and per-token ``advantages`` (e.g. GAE)."""
        sample = self._trainable(sample, "train_ppo")
        lp = per_token("logprobs", logprobs, sample)
        adv = per_token("advantages", advantages, sample)
        zeros = [0.0] * len(lp)  # no reference: the loss drops these
        row = train_row(sample, advantages=adv, prox_logp=lp, behav_logp=lp, ref_logp=zeros)
        return self._queue(PolicyLoss(eps_clip=clip_range, reference=False), row)

    def train_grpo(
        self,
        sample: TokenizedThread,
        logprobs: Sequence[float],
        ref_logprobs: Sequence[float],
        advantages: float | Sequence[float],
        clip_range: float = 0.2,
        kl_beta: float = 0.0,
        *,
        kl_estimator: str = "k3",
        loss_agg: str = "token-mean",
    ) -> Queued:
        """GRPO (Shao et al. 2024, eq. 3): the clipped surrogate against ``logprobs`` plus
        ``kl_beta`` times a KL estimate to the reference (``kl_estimator`` k1, k2 or k3; eq. 4 is
        k3), token-averaged over every sample of the step (``loss_agg``)."""
        sample = self._trainable(sample, "train_grpo")
        lp = per_token("logprobs", logprobs, sample)
        ref = per_token("ref_logprobs", ref_logprobs, sample)
        adv = per_token("advantages", advantages, sample)
        row = train_row(sample, advantages=adv, prox_logp=lp, behav_logp=lp, ref_logp=ref)
        loss = PolicyLoss(eps_clip=clip_range, kl_beta=kl_beta, kl_estimator=kl_estimator, loss_agg=loss_agg)
        return self._queue(loss, row)

    def train_gspo(
        self,
        sample: TokenizedThread,
        logprobs: Sequence[float],
        ref_logprobs: Sequence[float],
        advantage: float | Sequence[float],
        left_clip: float = 3e-4,
        right_clip: float = 4e-4,
        kl_beta: float = 0.0,
    ) -> Queued:
        """GSPO (Zheng et al. 2025, eq. 5-7): a sequence-level ratio clipped to
        ``[1 - left_clip, 1 + right_clip]``, the sequence's ``advantage``, sequence-averaged."""
        sample = self._trainable(sample, "train_gspo")
        lp = per_token("logprobs", logprobs, sample)
        ref = per_token("ref_logprobs", ref_logprobs, sample)
        adv = per_token("advantage", advantage, sample)
        row = train_row(sample, advantages=adv, prox_logp=lp, behav_logp=lp, ref_logp=ref)
        loss = PolicyLoss(
            policy_loss="gspo", eps_clip=left_clip, eps_clip_higher=right_clip, kl_beta=kl_beta,
            loss_agg="seq-mean-token-mean",
        )  # fmt: skip
        return self._queue(loss, row)

    def train_dpo(
        self,
        sample_pos: TokenizedThread,
        sample_neg: TokenizedThread,
        ref_logprobs_pos: float | Sequence[float],
        ref_logprobs_neg: float | Sequence[float],
        beta: float = 0.1,
    ) -> Queued:
        """DPO (Rafailov et al. 2023, eq. 7) on one preference pair. The reference
        log-probabilities are per trained token (`logprobs_per_token` of the reference) or their
        sum over the sample."""
        pos = self._trainable(sample_pos, "train_dpo")
        neg = self._trainable(sample_neg, "train_dpo")
        rows = [
            train_row(s, ref_logp=_sequence_or_tokens(name, ref, s))
            for s, ref, name in (
                (pos, ref_logprobs_pos, "ref_logprobs_pos"),
                (neg, ref_logprobs_neg, "ref_logprobs_neg"),
            )
        ]
        return self._queue(DPOLoss(beta=beta), *rows)

    def train_tangents(
        self,
        sample: TokenizedThread | Sequence[int],
        tangents: Sequence[float] | Sequence[object],
        *serialized: Sequence[float] | Sequence[int],
    ) -> Queued:
        """Bring your own loss: add ``sum_t tangents[t] * dlog p_t/dtheta`` over the trained tokens,
        ``tangents`` being ``dL/dlog p`` of any loss ``L`` of the log-probabilities (closed form or
        autodiff of the values ``logprobs_per_token`` gave). With one rank the gradients of
        several calls add up exactly; see `areal_lite.actors.train_on_tangents` for several.

        Also in the serialized form of `serialize_tokenized_thread`: ``train_tangents(input_tokens,
        image_patches, tangents, target_tokens)`` with ``input_tokens = tokens[:-1]``,
        ``target_tokens = tokens[1:]`` and one tangent per target (0 where nothing is trained)."""
        if serialized:
            return self._queue(TangentLoss(), self._serialized_row(sample, tangents, *serialized))  # type: ignore[arg-type]
        sample = self._trainable(sample, "train_tangents")  # type: ignore[arg-type]
        if is_scalar(tangents):
            raise TypeError("tangents must hold one value per trained token, not a single number")
        return self._queue(TangentLoss(), train_row(sample, tangents=per_token("tangents", tangents, sample)))  # type: ignore[arg-type]

    def _serialized_row(
        self, inputs: Sequence[int], image_patches: Sequence[object], tangents: Sequence[float], targets: Sequence[int]
    ) -> TrainRow:
        if image_patches:
            raise ValueError("these models read text only: image_patches must be empty")
        inputs, targets = [int(t) for t in inputs], [int(t) for t in targets]
        if not inputs or len(targets) != len(inputs) or inputs[1:] != targets[:-1]:
            raise ValueError(
                "train_tangents(input_tokens, image_patches, tangents, target_tokens) takes tokens[:-1] and tokens[1:]"
            )
        if len(tangents) != len(targets):
            raise ValueError(f"{len(tangents)} tangents for {len(targets)} target tokens (one per target)")
        tokens = [*inputs, targets[-1]]
        if len(tokens) > self.config.max_seq_len:
            raise ValueError(f"a thread of {len(tokens)} tokens is longer than max_seq_len={self.config.max_seq_len}")
        full = [0.0, *(float(t) for t in tangents)]  # log-probs score each token given the ones before it
        return TrainRow(tokens, [0] + [1 if t != 0 else 0 for t in full[1:]], {"tangents": full})

    async def forward_backward(self, samples: Sequence[TokenizedThread], loss: SampleLoss) -> list[list[float]]:
        """Bring your own loss, in one pass: add now the gradient of ``sum_i loss(logp_i, i)``
        over ``samples`` and return each sample's per-trained-token log-probabilities from the
        same forward pass. ``loss(logp, i)`` gets sample ``i``'s log-probabilities (a tensor with
        gradient, one per token of weight > 0) and returns its loss, any function torch can
        differentiate. One forward and one backward pass, where ``logprobs_per_token`` then
        ``train_tangents`` cost two forwards; ``optim_step`` then applies it (with whatever
        ``train_*`` calls queued). Collective: every rank calls it, each with its own samples (the
        update then is the token-weighted mean of the ranks' sums, as for ``train_tangents``)."""
        checked = [self._trainable(s, "forward_backward") for s in samples]

        def run() -> list[list[float]]:
            rows = [train_row(s) for s in checked] or [placeholder_row(())]
            batch = rows_to_batch(rows)
            batch[SAMPLE] = torch.tensor(list(range(len(checked))) or [-1], dtype=torch.int64)
            loss_fn, weight_fn = per_sample_loss(loss, batch)
            _, logprobs = self.engine.forward_backward_logprobs(batch, loss_fn, weight_fn)
            mask = batch["loss_mask"].bool()
            return [logprobs[i][mask[i]].tolist() for i in range(len(checked))]

        out = await self._call("forward_backward", run)
        self._accumulated = True
        return out

    # ---------------------------------------------------------------- copies

    async def clone_inf(self, name: str | None = None) -> InferenceModel:
        """A frozen copy of the current weights (a reference policy). Collective."""
        self._clones += 1
        clone = name or f"{self.name}-ref{self._clones}"

        def save_copy() -> str:
            path = os.path.join(work_dir(self.config), clone)
            self.engine.save(SaveLoadMeta(path=path, weight_format="hf", tokenizer=self.tokenizer))
            return path

        path = await self._call(f"clone:{clone}", save_copy)
        return await InferenceModel._spawn(clone, path, self.config, trainable=False)


def _sequence_or_tokens(name: str, ref: float | Sequence[float], sample: TokenizedThread) -> list[float]:
    """Per-token reference log-probabilities, or a sequence total placed on the first trained
    token (DPO only uses their sum)."""
    if is_scalar(ref):
        return [float(ref)] + [0.0] * (sample.n_trained - 1)
    return per_token(name, ref, sample)


class ValueModel(_Trainable):
    """A value model (a scalar head per token) being trained, for PPO. Build one with
    `ModelBuilder.spawn_value`; it starts from a language model's weights with a new head."""

    is_critic = True

    async def values_per_token(self, thread: TokenizedThread) -> list[float]:
        """The value of the state before each trained token (one per token of weight > 0)."""
        return await self._score(thread)

    async def logprobs_per_token(self, thread: TokenizedThread) -> list[float]:
        raise TypeError("a ValueModel has values (values_per_token), not log-probabilities")

    def train_value(
        self,
        sample: TokenizedThread,
        values: Sequence[float],
        returns: Sequence[float],
        clip_range: float | None = 0.2,
    ) -> Queued:
        """PPO's clipped value loss toward ``returns``, the new values clipped to within
        ``clip_range`` of ``values`` (the ones the returns were computed with)."""
        sample = self._trainable(sample, "train_value")
        row = train_row(
            sample, values=per_token("values", values, sample), returns=per_token("returns", returns, sample)
        )
        return self._queue(ValueLoss(eps_clip=clip_range), row)

    async def generate_tokens(
        self, thread: TokenizedThread, gconfig: GenerationConfig | None = None
    ) -> TokenizedThread:
        raise TypeError("a ValueModel scores tokens; it does not generate")
