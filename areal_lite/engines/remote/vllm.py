"""The client of vLLM servers: `RemoteVLLMEngine`, the `RemoteEngine` of vLLM's protocol.

What each call is on a vLLM server started with our worker extension (docs/protocol.md, "The vLLM
protocol"; the launcher starts them so with ``launcher.backend=vllm``)::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL \\
        --worker-extension-cls areal_lite.engines.remote.vllm_worker.WeightUpdateExtension

- generation: ``POST /v1/completions`` with the prompt as token ids, ``return_token_ids`` and
  ``logprobs: 0`` (the sampled token's log-probability; vLLM's default ``--logprobs-mode
  raw_logprobs`` gives the policy's own, before temperature and top-p/top-k); a batch is one call
  with a list of prompts; a generation a pause ended comes back with ``finish_reason: "abort"``.
  A prompt with images goes to vLLM's token-in route, ``POST /inference/v1/generate``
  (``token_ids``, the images as ``content_parts`` of ``image_url`` data URLs, ``sampling_params``
  as vLLM's ``SamplingParams``), which vLLM >= 0.32 serves when started with
  ``--enable-scale-out`` (the launcher passes it), since its completions route takes no images;
- pause and resume: ``POST /pause?mode=abort`` and ``POST /resume`` (vLLM's RL routes);
- weights: ``POST /collective_rpc`` calling the methods of `WeightUpdateExtension` (join or leave
  the weight-update group, receive a broadcast chunk, load a directory; no ipc updates), then
  ``/reset_prefix_cache``. The servers apply an update whole, at its last chunk, or refuse it and
  keep their weights; a refusal (HTTP 500 with the worker's error) is raised naming the server, and
  a broadcast chunk's call fails as soon as one server fails it.

Versions stay in the client: vLLM does not tag tokens with the weights that produced them, so
each answer's tokens get the version that was current when its call was sent. That is exact for
the trainer's client with ``pause_mode=abort`` (the only mode taken here): every call runs on the
weights current when it was sent, since a weight update aborts it first and this client sends
nothing while it keeps the servers paused. A follower client of another trainer rank may send a
call just after rank 0 paused the servers; it then runs after the update, and its tokens are tagged
one version older than they are (their log-probabilities are right).
"""

from __future__ import annotations

import asyncio
import json

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.io import GenerationConfig, WeightUpdateMeta
from areal_lite.engines.remote.client import RemoteEngine
from areal_lite.engines.remote.partial_rollout import Answer
from areal_lite.engines.remote.vllm_worker import JOIN_GROUP, LEAVE_GROUP, LOAD_FROM_DISK, RECEIVE
from areal_lite.utils.vision import data_url

FINISH = {"length": "length", "abort": "abort"}
"""vLLM's finish reasons that are not a stop (``stop``, or a model-specific one such as ``repetition``)."""


def rpc(method: str, args: dict[str, object]) -> dict[str, object]:
    """The body of a ``/collective_rpc`` call of our worker extension: one JSON string argument."""
    return {"method": method, "args": [json.dumps(args)]}


def _answer(choice: dict[str, object]) -> Answer:
    """One choice of a ``/v1/completions`` answer (``logprobs.token_logprobs``) or of an
    ``/inference/v1/generate`` one (``logprobs.content[].logprob``)."""
    ids = choice.get("token_ids")
    logprobs = choice.get("logprobs")
    if not isinstance(ids, list) or not isinstance(logprobs, dict):
        raise RuntimeError("a generation answer lacks token_ids or logprobs")  # noqa: TRY004 - the server's fault
    content = logprobs.get("content")
    values = [c["logprob"] for c in content] if isinstance(content, list) else logprobs["token_logprobs"]
    return Answer(
        output_ids=[int(t) for t in ids],
        logprobs=[float(x) for x in values],
        versions=None,
        finish=FINISH.get(str(choice.get("finish_reason")), "stop"),
    )


class RemoteVLLMEngine(RemoteEngine):
    """`InferenceEngine` over vLLM servers (or ours, which serves the same routes)."""

    def __init__(
        self, config: InferenceEngineConfig, control_servers: bool = True, adapter_name: str | None = None
    ) -> None:
        if adapter_name is not None:
            raise ValueError(
                "LoRA adapters are served through SGLang's protocol only: use launcher.backend sglang or areal "
                "(or local), or train full weights (actor.lora.rank=0)"
            )
        if config.pause_mode != "abort":
            raise ValueError(
                "RemoteVLLMEngine needs rollout.pause_mode=abort: vLLM does not tell which tokens a "
                "generation frozen across a weight update produced after it"
            )
        super().__init__(config, control_servers)

    def _generate_call(
        self, prompts: list[list[int]], rids: list[str], g: GenerationConfig, produced: int, budget: int,
        images: list[list[bytes]],
    ) -> tuple[str, dict[str, object]]:  # fmt: skip
        if g.return_routed_experts:
            raise ValueError("routed experts come from SGLang-protocol servers: use launcher.backend sglang or areal")
        sampling: dict[str, object] = {
            "max_tokens": budget,
            "min_tokens": min(budget, max(0, g.min_new_tokens - produced)),
            "temperature": 0.0 if g.greedy else g.temperature,
            "top_p": g.top_p,
            "top_k": g.top_k,
            "ignore_eos": g.ignore_eos,
            "logprobs": 0,
            **g.shaping(),
        }
        if g.stop_token_ids:
            sampling["stop_token_ids"] = list(g.stop_token_ids)
        if g.stop:
            sampling["stop"] = list(g.stop)
        if any(images):
            [prompt], [files] = prompts, images  # a prompt with images is sent alone
            parts = [{"type": "image_url", "url": data_url(f)} for f in files]
            body = {"token_ids": prompt, "content_parts": parts, "sampling_params": sampling, "request_id": rids[0]}
            return "/inference/v1/generate", body
        # vLLM numbers a batch's prompts under one id.
        prompt_or_batch = prompts if len(prompts) > 1 else prompts[0]
        return "/v1/completions", {
            "prompt": prompt_or_batch,
            **sampling,
            "return_token_ids": True,
            "request_id": rids[0],
        }

    async def _context_len_call(self) -> int | None:
        """vLLM's ``/v1/models`` gives the served model's ``max_model_len``."""
        models = await self._context_info("/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        limit = data[0].get("max_model_len") if isinstance(data, list) and data and isinstance(data[0], dict) else None
        return limit if isinstance(limit, int) else None

    def _answers(self, data: object, count: int) -> list[Answer]:
        assert isinstance(data, dict), f"a /v1/completions answer is an object, got {type(data).__name__}"
        choices = sorted(data["choices"], key=lambda c: c["index"])
        assert len(choices) == count, f"{count} prompts got {len(choices)} choices"
        return [_answer(c) for c in choices]

    async def _pause_call(self) -> None:
        await self.fleet.fanout("/pause?mode=abort", {})

    async def _resume_call(self) -> None:
        await self.fleet.fanout("/resume", {})

    async def _join_group_call(self, payloads: list[dict[str, object]]) -> None:
        await self.fleet.fanout("/collective_rpc", [rpc(JOIN_GROUP, p) if p else {} for p in payloads])

    async def _leave_group_call(self, group_name: str) -> None:
        await self.fleet.fanout("/collective_rpc", rpc(LEAVE_GROUP, {"group_name": group_name}))

    async def _load_from_disk_call(self, meta: WeightUpdateMeta) -> None:
        await self.fleet.fanout("/collective_rpc", rpc(LOAD_FROM_DISK, {"model_path": meta.path}))
        await self.fleet.fanout("/reset_prefix_cache", {})

    async def _receive_broadcast_call(self, meta: WeightUpdateMeta) -> None:
        specs = {
            "names": [s.name for s in meta.param_specs],
            "dtypes": [s.dtype for s in meta.param_specs],
            "shapes": [list(s.shape) for s in meta.param_specs],
            "last": meta.last_chunk,
        }
        await self._rpc_failing_fast(rpc(RECEIVE, specs))
        if meta.last_chunk:
            await self.fleet.fanout("/reset_prefix_cache", {})

    async def _rpc_failing_fast(self, body: dict[str, object]) -> None:
        """One RPC to every live server, raising the first server's error as soon as it comes: a
        broadcast's other receivers may wait for a sender that waits for the failed server, so
        waiting for every answer (as `ServerFleet.fanout` does) could wait for the group's
        timeout."""
        calls = [
            asyncio.ensure_future(self.fleet.request(i, "/collective_rpc", body, self.config.request_timeout))
            for i in self.fleet.live()
        ]
        try:
            for call in asyncio.as_completed(calls):
                await call
        finally:
            for call in calls:
                call.cancel()

    def _check_ipc(self, meta: WeightUpdateMeta) -> None:
        raise ValueError(
            "vLLM servers take weight_update=disk or distributed (our worker extension's calls), not ipc; "
            "launcher.backend=areal or sglang serves ipc updates"
        )

    async def _version_call(self, version: int) -> None:
        """Nothing to tell: vLLM tags no tokens with versions; this client does."""
