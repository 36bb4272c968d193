"""Pieces shared by fsdp_worker.py and megatron_worker.py: a fixed batch, a token-mean NLL loss with
its weight (and a loss scaled by a share), and a receiver of weight updates."""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from tensordict import TensorDict
from transformers import AutoConfig

from areal_lite.api.engine import InferenceEngine, LossFn, PackedBatch
from areal_lite.api.io import WeightUpdateMeta
from areal_lite.utils.distributed import CustomGroup, init_custom_process_group
from areal_lite.utils.hf_layout import CheckpointLayout
from areal_lite.utils.vision import auto_model_class


def write_results(res: dict[str, object], path: str) -> None:
    """Rank 0 writes a worker's measurements as JSON for the test that launched it."""
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(res, f)


def make_batch(seed: int, n: int = 8, max_len: int = 24) -> TensorDict:
    """A fixed batch with long-tailed lengths; the first third of each sequence is the prompt."""
    g = torch.Generator().manual_seed(seed)
    lens = (torch.rand(n, generator=g) ** 3 * (max_len - 3)).long() + 3
    ar = torch.arange(max_len).unsqueeze(0)
    am = ar < lens.unsqueeze(1)
    ids = torch.randint(1, 250, (n, max_len), generator=g) * am
    loss_mask = (ar >= (lens // 3).unsqueeze(1)) & am
    return TensorDict({"input_ids": ids, "attention_mask": am, "loss_mask": loss_mask.int()}, batch_size=[n])


def group_batch(seed: int) -> TensorDict:
    """GRPO-like rows: two groups of 4 sharing a 5- and a 3-token prompt (completions of 1 to 9
    tokens, some starting alike), then a row that shares nothing and a group of 2."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for prompt_len, n in ((5, 4), (3, 4), (6, 1), (4, 2)):
        prompt = torch.randint(1, 250, (prompt_len,), generator=g).tolist()
        for _ in range(n):
            completion = torch.randint(1, 250, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist()
            rows.append((prompt, completion))
    rows[1] = (rows[1][0], rows[0][1][:1] + rows[1][1])  # a completion starting like the previous one
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.int32)
    am = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        loss_mask[i, len(p) : len(p) + len(c)] = 1
        am[i, : len(p) + len(c)] = True
    return TensorDict({"input_ids": ids, "attention_mask": am, "loss_mask": loss_mask}, batch_size=[len(rows)])


def nll(out: torch.Tensor, ent: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = mb["loss_mask"].float()  # type: ignore[union-attr]
    return -(out * m).sum() / m.sum(), {"entropy": (ent * m).sum() / m.sum()}


def n_tokens(mb: PackedBatch) -> float:
    return float(mb["loss_mask"].sum())  # type: ignore[union-attr]


def scaled(loss_fn: LossFn, share: float) -> LossFn:
    """``loss_fn`` times ``share``: a forward_backward call's part of an update accumulated over
    several calls (`TrainEngine.forward_backward`)."""

    def fn(out: torch.Tensor, ent: torch.Tensor, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, stats = loss_fn(out, ent, mb)
        return loss * share, stats

    return fn


class WeightReceiver(InferenceEngine):
    """The receiving side of weight updates, reduced to what the sender exercises: it applies
    received tensors to the HF model in ``model_dir`` and records the names of the last in-process
    update, the last version and the number of distributed chunks. Generation is not part of it."""

    def __init__(self, model_dir: str) -> None:
        config = AutoConfig.from_pretrained(model_dir)
        self.auto = auto_model_class(config)
        self.layout = CheckpointLayout(config)
        self.model = self.auto.from_pretrained(model_dir)
        self.pool = ThreadPoolExecutor(1)
        self.group: CustomGroup | None = None
        self.names: set[str] = set()
        self.version = -1
        self.chunks = 0

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> Future[None]:
        meta.world_size = 2  # trainer rank 0 + this receiver, as a server announces its ranks
        addr, port, name = meta.master_address, meta.master_port, meta.group_name

        def join() -> None:
            self.group = init_custom_process_group("gloo", addr, port, rank=1, world_size=2, group_name=name)

        return self.pool.submit(join)

    def update_weights(self, meta: WeightUpdateMeta) -> Future[None]:
        return self.pool.submit(self._receive, meta)

    def _receive(self, meta: WeightUpdateMeta) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            if meta.type == "in_process":
                assert meta.named_tensors is not None and meta.named_tensors.keys() == params.keys()
                self.names = set(meta.named_tensors)
                for k, v in meta.named_tensors.items():
                    params[k].copy_(v)
            elif meta.type == "disk":
                self.model.load_state_dict(self.auto.from_pretrained(meta.path).state_dict())
            else:
                assert self.group is not None
                for spec in meta.param_specs:
                    t = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
                    self.group.broadcast(t)
                    name, where, _ = self.layout.locate(spec.name)  # broadcasts carry checkpoint names
                    if where is None:
                        params[name].copy_(t)
                    else:
                        params[name].view(-1)[where] = t.flatten()
                self.chunks += 1
        self.version = meta.version if meta.version is not None else -1

    def set_version(self, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version

    def initialize(self) -> None:
        raise NotImplementedError("WeightReceiver only receives weights")

    def destroy(self) -> None:
        self.pool.shutdown()

    async def agenerate(self, req):  # type: ignore[no-untyped-def]
        raise NotImplementedError("WeightReceiver only receives weights")

    def pause(self) -> None:
        raise NotImplementedError("WeightReceiver only receives weights")

    def resume(self) -> None:
        raise NotImplementedError("WeightReceiver only receives weights")

    def submit(self, data, workflow, should_accept=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError("WeightReceiver only receives weights")

    def wait(self, count, timeout=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError("WeightReceiver only receives weights")

    def rollout_batch(self, data, workflow, should_accept=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError("WeightReceiver only receives weights")

    def prepare_batch(self, dataloader, workflow, should_accept=None):  # type: ignore[no-untyped-def]
        raise NotImplementedError("WeightReceiver only receives weights")
