"""The HF view of `MegatronEngine`'s weights, which megatron-core spreads over ranks: reading a HF
directory into this rank's parameters and gathering full HF-named tensors out of them.

`HFWeights` knows which HF tensors each rank's parameters are: a pipeline stage numbers its layers
from 0 and an expert-parallel rank its experts, so local names become global ones; tensor-parallel
shards are cut and joined by `areal_lite.engines.train.mcore_convert`. `SafetensorsDir` reads a HF
directory's tensors one at a time, `new_value_head` draws a critic's new value head as FSDPEngine
does, and `write_hf_dir` writes what `from_pretrained` loads.
"""

from __future__ import annotations

import copy
import glob
import os
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from areal_lite.engines.train.mcore_convert import ArchSpec, hf_to_mcore, mcore_split_dim, mcore_to_hf

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")

StageSpecs = list[list[tuple[str, list[tuple[str, tuple[int, ...]]]]]]
"""For every pipeline stage: its local parameter names and the HF tensors (names, shapes) each one
converts to."""


class SafetensorsDir(Mapping[str, torch.Tensor]):
    """HF tensors of a model directory, read one at a time from its safetensors files, plus
    ``extra`` tensors that the directory lacks."""

    def __init__(self, path: str, extra: dict[str, torch.Tensor] | None = None) -> None:
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}: MegatronEngine loads safetensors checkpoints")
        self._where: dict[str, str] = {}
        for f in files:
            with safe_open(f, framework="pt") as h:
                for k in h.keys():  # noqa: SIM118 (the handle is not iterable)
                    self._where[k] = f
        self._extra = extra or {}

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name in self._extra:
            return self._extra[name]
        if name not in self._where:
            raise KeyError(f"{name} is not in the checkpoint")
        with safe_open(self._where[name], framework="pt") as h:
            return h.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter({**self._where, **self._extra})

    def __len__(self) -> int:
        return len(set(self._where) | set(self._extra))


def new_value_head(path: str, seed: int) -> dict[str, torch.Tensor]:
    """The ``score`` layer HF initialises for a critic loaded from a causal-LM directory, drawn
    exactly as FSDPEngine draws it (same seed, same loading call), so both engines start equal."""
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(seed)
    hf = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    return {f"score.{k}": v.detach().clone() for k, v in hf.score.state_dict().items()}


class HFWeights:
    """The HF tensors of a megatron `GPTModel` whose parameters this rank's model-parallel group
    holds; ``layer_ids`` are the global indices of this pipeline stage's layers."""

    def __init__(self, arch: ArchSpec, layer_ids: list[int], expert_parallel_size: int) -> None:
        self.arch = arch
        self.layer_ids = layer_ids
        self.expert_parallel_size = expert_parallel_size
        self._stage_specs: StageSpecs | None = None

    def global_name(self, local: str, ep_rank: int | None = None) -> str:
        """A parameter's name with this stage's local layer index replaced by the global one, and
        a local expert's index by the global index it has on expert-parallel rank ``ep_rank``
        (default: this rank's)."""
        from megatron.core import parallel_state as ps

        name = _LAYER_PREFIX.sub(lambda m: f"decoder.layers.{self.layer_ids[int(m.group(1))]}.", local)
        if not self.arch.num_experts:
            return name
        rank = ps.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
        per_rank = self.arch.num_experts // self.expert_parallel_size
        return _LOCAL_EXPERT.sub(lambda m: f".local_experts.{rank * per_rank + int(m.group(1))}.", name)

    def global_names(self, local: str) -> list[str]:
        """The global names of parameter ``local`` on every expert-parallel rank (one name but for
        experts, of which each rank holds its own)."""
        if not self.arch.num_experts or not _LOCAL_EXPERT.search(local):
            return [self.global_name(local)]
        return [self.global_name(local, r) for r in range(self.expert_parallel_size)]

    def is_tied_copy(self, name: str) -> bool:
        """The last stage's copy of a tied embedding (PP > 1): not a weight of its own."""
        return name == "output_layer.weight" and self.arch.tie_word_embeddings

    @torch.no_grad()
    def copy_into(self, gpt: torch.nn.Module, hf: Mapping[str, torch.Tensor]) -> None:
        """Overwrite this rank's parameters of ``gpt`` (or of the model inside its DDP wrapper)
        with their shards of the HF tensors ``hf``."""
        from megatron.core import parallel_state as ps

        params = dict(getattr(gpt, "module", gpt).named_parameters())
        sources = {
            name: "embedding.word_embeddings.weight" if self.is_tied_copy(name) else self.global_name(name)
            for name in params
        }
        tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        converted = hf_to_mcore(hf, self.arch, tp_rank, tp, names=set(sources.values()))
        for name, p in params.items():
            p.copy_(converted[sources[name]].to(p.dtype))

    def _stage_param_specs(self, gpt: torch.nn.Module) -> StageSpecs:
        """`StageSpecs` of the model whose stage this rank holds as ``gpt``. Known on every rank,
        so that all take part in the same collectives."""
        from megatron.core import parallel_state as ps

        if self._stage_specs is None:
            tp = ps.get_tensor_model_parallel_world_size()
            mine = []
            for name, p in gpt.named_parameters():
                if self.is_tied_copy(name):
                    continue
                specs = []
                for gname in self.global_names(name):
                    n_shards = 1 if mcore_split_dim(gname) is None else tp
                    meta = [torch.empty(p.shape, device="meta") for _ in range(n_shards)]
                    specs += [(hf, tuple(t.shape)) for hf, t in mcore_to_hf(gname, meta, self.arch)]
                mine.append((name, specs))
            stages: list[object] = [None] * ps.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(stages, mine, group=ps.get_pipeline_model_parallel_group())
            self._stage_specs = stages  # type: ignore[assignment]
        return self._stage_specs  # type: ignore[return-value]

    @torch.no_grad()
    def hf_tensors(
        self, gpt: torch.nn.Module, device: torch.device, dtype: torch.dtype
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors in ``dtype`` on ``device``, one at a time, on every rank, from this
        rank's stage ``gpt``. Collective over the model-parallel group: every rank iterates to the
        end. Each stage gathers its parameters over tensor-parallel ranks, then broadcasts them to
        the others; data-parallel replicas hold identical weights, so nothing runs across them."""
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        pp_group = ps.get_pipeline_model_parallel_group()
        pp_ranks = dist.get_process_group_ranks(pp_group)
        my_stage = ps.get_pipeline_model_parallel_rank()
        local = dict(gpt.named_parameters())
        for stage, specs in enumerate(self._stage_param_specs(gpt)):
            for name, hf_specs in specs:
                tensors: list[torch.Tensor]
                if stage == my_stage:
                    gnames = self.global_names(name)
                    part = local[name].detach().to(device)
                    if len(gnames) > 1:  # an expert: each expert-parallel rank holds its own
                        parts = [torch.empty_like(part) for _ in gnames]
                        dist.all_gather(parts, part.contiguous(), group=ps.get_expert_model_parallel_group())
                        held = [(g, [p]) for g, p in zip(gnames, parts)]
                    elif tp > 1 and mcore_split_dim(gnames[0]) is not None:
                        shards = [torch.empty_like(part) for _ in range(tp)]
                        dist.all_gather(shards, part.contiguous(), group=ps.get_tensor_model_parallel_group())
                        held = [(gnames[0], shards)]
                    else:
                        held = [(gnames[0], [part])]
                    # copies: replicated parameters are views into megatron's live buffers
                    tensors = [
                        t.to(dtype=dtype, copy=True) for g, shards in held for _, t in mcore_to_hf(g, shards, self.arch)
                    ]
                else:
                    tensors = [torch.empty(shape, dtype=dtype, device=device) for _, shape in hf_specs]
                for (hf_name, _), t in zip(hf_specs, tensors):
                    if len(pp_ranks) > 1:
                        dist.broadcast(t, src=pp_ranks[stage], group=pp_group)
                    yield hf_name, t


def write_hf_dir(
    path: str,
    tensors: dict[str, torch.Tensor],
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    is_critic: bool,
    source_path: str,
    tokenizer: object | None,
) -> None:
    """A HF model directory that ``from_pretrained`` loads: ``tensors`` as sharded safetensors
    (replacing any there), ``hf_config`` saying ``dtype`` (and for a critic the
    token-classification architecture), the generation config of ``source_path`` where it has one,
    and ``tokenizer``."""
    from huggingface_hub import save_torch_state_dict
    from transformers import GenerationConfig

    os.makedirs(path, exist_ok=True)
    for stale in glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(
        os.path.join(path, "*.safetensors.index.json")
    ):
        os.remove(stale)
    hf_config = copy.deepcopy(hf_config)
    hf_config.dtype = str(dtype).removeprefix("torch.")
    if is_critic:
        hf_config.architectures = [
            a.replace("ForCausalLM", "ForTokenClassification") for a in hf_config.architectures or []
        ]
    hf_config.save_pretrained(path)
    try:
        GenerationConfig.from_pretrained(source_path).save_pretrained(path)
    except OSError:
        pass  # the source directory had no generation config
    save_torch_state_dict(tensors, path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)  # type: ignore[attr-defined]


__all__ = ["HFWeights", "SafetensorsDir", "new_value_head", "write_hf_dir"]
