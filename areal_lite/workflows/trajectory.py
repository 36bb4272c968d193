"""Building and checking trajectories in the layout of the data contract (`areal_lite.api.engine`).

Workflows assemble token lists (prompt, generated, environment) and turn them into a ``[1, L]``
TensorDict here, so the dtypes and the mask/version conventions are written once. Responses that
carry the experts a mixture-of-experts model routed each token to (``routed_experts``) add them
to the trajectory, -1 on the positions no route covers. A vision-language model's trajectories
carry their prompt's images (`with_images`).
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict

from areal_lite.api.io import ModelResponse
from areal_lite.api.workflow import check_trajectory_layout
from areal_lite.utils.moe import NO_EXPERT

CONTRACT_DTYPES: dict[str, torch.dtype] = {
    "input_ids": torch.int64,
    "attention_mask": torch.bool,
    "loss_mask": torch.int32,
    "logprobs": torch.float32,
    "versions": torch.int32,
    "rewards": torch.float32,
}


class TokenTrace:
    """A trajectory under construction: tokens appended segment by segment, each either produced
    by the policy (trained on) or not (prompt, environment, tool output)."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.input_ids: list[int] = list(prompt_ids)
        self.loss_mask: list[int] = [0] * len(prompt_ids)
        self.logprobs: list[float] = [0.0] * len(prompt_ids)
        self.versions: list[int] = [-1] * len(prompt_ids)
        self.routes: torch.Tensor | None = None
        """The latest response's routes (they cover every token before its last)."""

    def add_generated(self, resp: ModelResponse) -> None:
        """Append a model response's output tokens with their logprobs and versions (and take its
        routes, when it has them: the response's prompt must then be the trace so far)."""
        if not (len(resp.output_tokens) == len(resp.output_logprobs) == len(resp.output_versions)):
            raise ValueError(
                f"response {resp.rid!r} has {len(resp.output_tokens)} tokens, {len(resp.output_logprobs)} logprobs "
                f"and {len(resp.output_versions)} versions"
            )
        if resp.routed_experts is not None:
            if list(resp.input_tokens) != self.input_ids:
                raise ValueError(f"response {resp.rid!r} with routes continues another token sequence than this trace")
            self.routes = resp.routed_experts
        self.input_ids += resp.output_tokens
        self.loss_mask += [1] * resp.output_len
        self.logprobs += resp.output_logprobs
        self.versions += resp.output_versions

    def add_context(self, token_ids: list[int]) -> None:
        """Append tokens the policy did not produce (environment, tool, chat-template glue)."""
        self.input_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)

    def to_tensordict(self, reward: float, **per_sequence: float) -> TensorDict:
        """The ``[1, L]`` trajectory with sequence reward ``reward`` and extra float32 ``[1]`` keys."""
        n = len(self.input_ids)
        out = {
            "input_ids": torch.tensor([self.input_ids], dtype=torch.int64),
            "attention_mask": torch.ones((1, n), dtype=torch.bool),
            "loss_mask": torch.tensor([self.loss_mask], dtype=torch.int32),
            "logprobs": torch.tensor([self.logprobs], dtype=torch.float32),
            "versions": torch.tensor([self.versions], dtype=torch.int32),
            "rewards": torch.tensor([reward], dtype=torch.float32),
        }
        if self.routes is not None:
            out["routed_experts"] = _pad_routes(self.routes, n)[None]
        for key, value in per_sequence.items():
            out[key] = torch.tensor([value], dtype=torch.float32)
        return TensorDict(out, batch_size=[1])


def _pad_routes(routes: torch.Tensor, length: int) -> torch.Tensor:
    """``routes`` [n <= length, layers, top_k] as int32 [length, layers, top_k], -1 after row n."""
    out = torch.full((length, *routes.shape[1:]), NO_EXPERT, dtype=torch.int32)
    out[: routes.shape[0]] = routes
    return out


def from_response(resp: ModelResponse, reward: float, **per_sequence: float) -> TensorDict:
    """The ``[1, L]`` trajectory of a single-turn response: its prompt, then its output tokens."""
    trace = TokenTrace(resp.input_tokens)
    trace.add_generated(resp)
    return trace.to_tensordict(reward, **per_sequence)


def from_responses(resps: list[ModelResponse], rewards: list[float]) -> TensorDict:
    """The ``[n, L]`` batch of single-turn responses, right-padded with 0: what
    ``concat_padded([from_response(r, w) for r, w in zip(resps, rewards)])`` gives, built at once
    (a GRPO group without a TensorDict per sample, on the rollout client's thread)."""
    traces = []
    for resp in resps:
        trace = TokenTrace(resp.input_tokens)
        trace.add_generated(resp)
        traces.append(trace)
    width = max(len(t.input_ids) for t in traces)

    def padded(rows: list[list[int]] | list[list[float]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=dtype)

    lens = torch.tensor([len(t.input_ids) for t in traces])
    out = {
        "input_ids": padded([t.input_ids for t in traces], torch.int64),
        "attention_mask": torch.arange(width).unsqueeze(0) < lens.unsqueeze(1),
        "loss_mask": padded([t.loss_mask for t in traces], torch.int32),
        "logprobs": padded([t.logprobs for t in traces], torch.float32),
        "versions": padded([t.versions for t in traces], torch.int32),
        "rewards": torch.tensor(rewards, dtype=torch.float32),
    }
    routes = [t.routes for t in traces]
    if any(r is not None for r in routes):
        if any(r is None for r in routes):
            raise ValueError("some responses of the group carry routed_experts and some do not")
        out["routed_experts"] = torch.stack([_pad_routes(r, width) for r in routes])  # type: ignore[arg-type]
    return TensorDict(out, batch_size=[len(traces)])


def with_images(traj: TensorDict, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> TensorDict:
    """``traj`` (``[n, L]``, every row with the same prompt) carrying that prompt's images: the
    processor's ``pixel_values`` ``[P, D]`` and ``image_grid_thw`` ``[I, 3]`` (no images: ``P`` and
    ``I`` 0) as the per-sequence keys ``[n, P, D]`` float32 and ``[n, I, 3]`` int64 of the data
    contract (`areal_lite.api.engine`). ValueError when the grids do not account for the patches."""
    if pixel_values.dim() != 2 or image_grid_thw.dim() != 2 or image_grid_thw.shape[1] != 3:
        raise ValueError(
            f"pixel_values must be [patches, D] and image_grid_thw [images, 3], got {list(pixel_values.shape)} "
            f"and {list(image_grid_thw.shape)}"
        )
    if int(image_grid_thw.prod(dim=-1).sum()) != pixel_values.shape[0]:
        raise ValueError(
            f"image_grid_thw accounts for {int(image_grid_thw.prod(dim=-1).sum())} patches, pixel_values has "
            f"{pixel_values.shape[0]}"
        )
    n = traj.batch_size[0]
    out = traj.clone(recurse=False)
    out["pixel_values"] = pixel_values.to(torch.float32).unsqueeze(0).expand(n, -1, -1).clone()
    out["image_grid_thw"] = image_grid_thw.to(torch.int64).unsqueeze(0).expand(n, -1, -1).clone()
    return out


def encode_chat(tokenizer: object, messages: list[dict[str, str]], **template_kwargs: object) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template with the generation prompt
    (``template_kwargs`` such as ``enable_thinking`` go to the template)."""
    text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        messages, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


def prompt_messages(data: dict[str, object]) -> list[dict[str, str]]:
    """The chat messages of a dataset item: its ``messages``, or its ``prompt`` as one user turn."""
    if "messages" in data:
        return list(data["messages"])  # type: ignore[call-overload]
    if "prompt" in data:
        return [{"role": "user", "content": str(data["prompt"])}]
    raise KeyError(f"a dataset item needs 'messages' or 'prompt'; this one has {sorted(data)}")


def check_trajectory(batch: TensorDict) -> None:
    """Raise ValueError naming the first way ``batch`` breaks the data contract: its layout
    (`check_trajectory_layout`), exact dtypes, right padding, masks, logprobs and versions off the
    trained tokens, finite rewards. Slower than the layout check: for tests and debugging."""
    check_trajectory_layout(batch)
    for key, dtype in CONTRACT_DTYPES.items():
        if batch[key].dtype != dtype:
            raise ValueError(f"{key} has dtype {batch[key].dtype}, the contract says {dtype}")
    length = batch["input_ids"].shape[1]
    attn = batch["attention_mask"]
    lens = attn.sum(dim=1)
    if not torch.equal(attn, torch.arange(length).unsqueeze(0) < lens.unsqueeze(1)):
        raise ValueError("attention_mask is not right-padded")
    trained = batch["loss_mask"].bool()
    if (trained & ~attn).any():
        raise ValueError("loss_mask is 1 on padding")
    if (batch["logprobs"][~trained] != 0).any():
        raise ValueError("logprobs must be 0 where loss_mask is 0")
    if (batch["logprobs"][trained] > 0).any():
        raise ValueError("a log-probability is positive")
    if (batch["versions"][attn & ~trained] != -1).any():
        raise ValueError("versions must be -1 on prompt and environment tokens")
    if (batch["versions"][trained] < 0).any():
        raise ValueError("a trained token has no policy version")
    if not trained[:, 0].logical_not().all():
        raise ValueError("the first token of a sequence cannot be trained on (nothing predicts it)")
    if not all(math.isfinite(r) for r in batch["rewards"].tolist()):
        raise ValueError("a reward is not finite")
