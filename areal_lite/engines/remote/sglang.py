"""`RemoteSGLangEngine`: the client of SGLang-protocol servers (real SGLang on GPU nodes, or ours
on CPU), on the shared `RemoteEngine` base (`areal_lite.engines.remote.client`).

How SGLang spells each call (docs/protocol.md): ``/generate`` with ``input_ids`` (and a
vision-language model's images as ``image_data``: data URLs, as SGLang takes them), its answer's
``meta_info`` (log-probabilities, versions, routed experts), ``/pause_generation`` and
``/continue_generation``, disk and distributed weight updates (with the weight-update session of
SGLang >= 0.5.21), ``ipc`` updates for servers on this machine (``/update_weights_from_tensor``: each
bucket's handles, once per tensor-parallel rank of a server, as ``/get_server_info`` counts them),
``/update_weight_version``, and the LoRA adapter routes.

LoRA: the client's ``adapter_name`` goes in every generation call as ``lora_path``, and a weight
update from a LoRA train engine (``WeightUpdateMeta.lora_config``) reaches the servers through the
adapter routes: a PEFT adapter directory loaded with ``/load_lora_adapter`` (after
``/unload_lora_adapter`` of the previous one), or a broadcast of the adapter's tensors announced as
``<adapter name>:<tensor name>`` after ``/register_lora_adapter`` (once per adapter config).
"""

from __future__ import annotations

import base64

import torch

from areal_lite.api.config import InferenceEngineConfig
from areal_lite.api.io import GenerationConfig, WeightUpdateMeta
from areal_lite.engines.remote.client import RemoteEngine
from areal_lite.engines.remote.fleet import ServerError
from areal_lite.engines.remote.partial_rollout import Answer, parse_version
from areal_lite.utils.vision import data_url


def _sglang_answer(data: object) -> Answer:
    assert isinstance(data, dict), f"a /generate answer is an object, got {type(data).__name__}"
    meta = data["meta_info"]
    versions = meta.get("output_token_versions")
    if versions is None:  # SGLang: one version for the answer, when it is an integer
        v = parse_version(meta.get("weight_version"), -1)
        versions = None if v < 0 else [v] * len(data["output_ids"])
    routes = meta.get("routed_experts")
    return Answer(
        output_ids=list(data["output_ids"]),
        logprobs=[float(x[0]) for x in meta["output_token_logprobs"]],
        versions=None if versions is None else [int(v) for v in versions],
        finish=meta["finish_reason"]["type"] if meta.get("finish_reason") else "length",
        # SGLang's encoding: base64 of the int32 ids, row-major.
        routed_experts=None
        if routes is None
        else torch.frombuffer(bytearray(base64.b64decode(routes)), dtype=torch.int32),
    )


class RemoteSGLangEngine(RemoteEngine):
    """The client of SGLang-protocol servers (docs/protocol.md): SGLang itself, or ours."""

    def __init__(
        self, config: InferenceEngineConfig, control_servers: bool = True, adapter_name: str | None = None
    ) -> None:
        super().__init__(config, control_servers, adapter_name)
        self._adapter_held: dict[str, object] | None = None
        """The config of the adapter the servers hold (loaded or registered by this client)."""
        self._tp_size: dict[int, int] = {}
        """Tensor-parallel ranks of each server (SGLang takes one handles entry per rank)."""

    def _generate_call(
        self, prompts: list[list[int]], rids: list[str], g: GenerationConfig, produced: int, budget: int,
        images: list[list[bytes]],
    ) -> tuple[str, dict[str, object]]:  # fmt: skip
        params = g.to_sglang()
        params["max_new_tokens"] = budget
        params["min_new_tokens"] = min(budget, max(0, g.min_new_tokens - produced))
        batch = len(prompts) > 1  # SGLang's list forms of input_ids, rid and lora_path
        payload: dict[str, object] = {
            "input_ids": prompts if batch else prompts[0],
            "sampling_params": params,
            "return_logprob": True,
            "rid": rids if batch else rids[0],
        }
        if any(images):  # SGLang's forms: a list of images for one prompt, one such list a prompt for a batch
            urls = [[data_url(image) for image in per_prompt] for per_prompt in images]
            payload["image_data"] = urls if batch else urls[0]
        if g.return_routed_experts:
            payload["return_routed_experts"] = True
        if self.adapter_name is not None:
            payload["lora_path"] = [self.adapter_name] * len(prompts) if batch else self.adapter_name
        return "/generate", payload

    async def _context_len_call(self) -> int | None:
        """SGLang's ``/get_server_info`` reports ``max_req_input_len`` (the context less one: a
        prompt must leave room for a token); None from a server that does not answer it."""
        info = await self._context_info("/get_server_info")
        limit = info.get("max_req_input_len") if isinstance(info, dict) else None
        return limit + 1 if isinstance(limit, int) else None

    def _answers(self, data: object, count: int) -> list[Answer]:
        answers = data if count > 1 else [data]
        assert isinstance(answers, list) and len(answers) == count, "a batch request answers one result per prompt"
        return [_sglang_answer(a) for a in answers]

    async def _pause_call(self) -> None:
        await self.fleet.fanout("/pause_generation", {"mode": self.config.pause_mode})

    async def _resume_call(self) -> None:
        await self.fleet.fanout("/continue_generation", {})

    async def _join_group_call(self, payloads: list[dict[str, object]]) -> None:
        await self.fleet.fanout_checked("/init_weights_update_group", payloads)

    async def _leave_group_call(self, group_name: str) -> None:
        await self.fleet.fanout_checked("/destroy_weights_update_group", {"group_name": group_name})

    async def _load_from_disk_call(self, meta: WeightUpdateMeta) -> None:
        if meta.lora_config is not None:
            await self._load_adapter_call(meta)
            return
        await self.fleet.fanout_checked(
            "/update_weights_from_disk",
            {
                "model_path": meta.path,
                "weight_version": None if meta.version is None else str(meta.version),
                "abort_all_requests": False,
                "flush_cache": True,
            },
        )

    async def _load_adapter_call(self, meta: WeightUpdateMeta) -> None:
        """The PEFT adapter directory ``meta.path`` in place of the held adapter (SGLang refuses to
        load a name it holds), then the version of later tokens (the load call carries none)."""
        name = self.adapter_name
        if self._adapter_held is not None:
            await self.fleet.fanout_checked("/unload_lora_adapter", {"lora_name": name})
            self._adapter_held = None
        await self.fleet.fanout_checked("/load_lora_adapter", {"lora_name": name, "lora_path": meta.path})
        self._adapter_held = meta.lora_config
        if meta.version is not None:
            await self._version_call(meta.version)

    async def _receive_broadcast_call(self, meta: WeightUpdateMeta) -> None:
        names = [s.name for s in meta.param_specs]
        if meta.lora_config is not None:
            if self._adapter_held != meta.lora_config:
                if self._adapter_held is not None:
                    await self.fleet.fanout_checked("/unload_lora_adapter", {"lora_name": self.adapter_name})
                    self._adapter_held = None
                register = {"lora_name": self.adapter_name, "config_dict": meta.lora_config}
                await self.fleet.fanout_checked("/register_lora_adapter", register)
                self._adapter_held = meta.lora_config
            names = [f"{self.adapter_name}:{n}" for n in names]
        session = await self.fleet.optional_fanout("/begin_weight_update", {"selector": "all"})
        await self.fleet.fanout_checked(
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": [s.dtype for s in meta.param_specs],
                "shapes": [list(s.shape) for s in meta.param_specs],
                "group_name": meta.group_name,
                "weight_version": None if meta.version is None else str(meta.version),
                "flush_cache": True,
                "abort_all_requests": False,
            },
        )
        if session:
            await self.fleet.fanout("/end_weight_update", {})

    async def _load_from_handles_call(self, meta: WeightUpdateMeta) -> None:
        for i in self.fleet.live():
            if i not in self._tp_size:
                try:
                    info = await self.fleet.request(
                        i, "/get_server_info", None, self.config.request_timeout, method="GET"
                    )
                except ServerError:  # a server that does not say: one rank
                    info = None
                size = info.get("tp_size") if isinstance(info, dict) else None
                self._tp_size[i] = size if isinstance(size, int) and size > 0 else 1
        body = {
            "load_format": None,  # SGLang's default: the entry is a list of (name, tensor)
            "weight_version": None if meta.version is None else str(meta.version),
            "flush_cache": True,
            "abort_all_requests": False,
        }
        payloads = [
            {**body, "serialized_named_tensors": [meta.serialized_tensors] * self._tp_size.get(i, 1)}
            for i in range(len(self.fleet))
        ]
        session = await self.fleet.optional_fanout("/begin_weight_update", {"selector": "all"})
        await self.fleet.fanout_checked("/update_weights_from_tensor", payloads)
        if session:
            await self.fleet.fanout("/end_weight_update", {})

    async def _version_call(self, version: int) -> None:
        await self.fleet.fanout("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
