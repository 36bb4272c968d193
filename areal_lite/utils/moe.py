"""Mixture-of-experts models: their routers, routing replay, and routing statistics.

A mixture-of-experts (MoE) layer sends each token to the ``top_k`` of its experts that its router
scores highest. Two engines that compute the router's scores with slightly different numerics
(bf16 training against fp32 generation, kernels, a KV cache kept across a weight update) can pick
different experts for the same token, and then the token's log-probability differs by far more
than the numerics alone would make it: the importance weights of RL blow up. Routing replay
(Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
Routers", arXiv:2510.11370: R3) records the experts the inference engine chose for every token
and forces them in the training forward.

The convention here: where a token has recorded experts, the training forward uses those experts
with gate weights recomputed from the *current* router's probabilities,
``softmax(logits)[chosen]``, renormalised over the chosen experts when the model renormalises its
top-k (Qwen3-MoE's ``norm_topk_prob``, Mixtral). That is the model's own gating formula evaluated at
the recorded experts, so (1) when the recorded experts are the ones the router would pick, replay
changes nothing, bit for bit, and (2) the gate weights keep their gradient, so the router is still
trained: only the discrete choice, which has no gradient anyway, is taken from generation. (Keeping
the recorded gate *values* as well would cut the router off from the loss.) With renormalisation
this equals R3's softmax over the chosen experts' logits alone. Positions without a recorded route
(``-1``: the last token of a sequence, environment tokens appended after the last generation)
take the router's own choice.

Routes are laid out as SGLang returns them (``return_routed_experts``): one row per token, one
entry per decoder layer (``-1`` on the layers without experts), ``top_k`` expert ids each.

Supported: the routers of Qwen3-MoE, Qwen2-MoE and Mixtral in transformers 5 (softmax over the
experts, top-k, optional renormalisation), which return ``(logits, gate weights, expert ids)``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
"""Model types whose routers `RoutingReplay` drives (the softmax-top-k routers of transformers 5)."""
NO_EXPERT = -1
"""The expert id of a route slot where no expert was chosen (a layer without experts, a position
the engine never ran)."""


def routing_shape(config: object) -> tuple[int, int] | None:
    """``(decoder layers, experts per token)`` of a HF model config with MoE layers; None for a
    dense model."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        return None
    return int(config.num_hidden_layers), int(top_k)  # type: ignore[attr-defined]


def is_router(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers top-k router (``(logits, weights, ids)`` from hidden states)."""
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k") and hasattr(module, "weight")


def layer_routers(layers: list[torch.nn.Module] | torch.nn.ModuleList) -> list[torch.nn.Module | None]:
    """The router of each decoder layer (``layer.mlp.gate``, unwrapped from peft's LoRA wrapper when
    its weight has an adapter), None for a layer without experts."""
    out: list[torch.nn.Module | None] = []
    for layer in layers:
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if hasattr(gate, "get_base_layer"):
            gate = gate.get_base_layer()
        out.append(gate if isinstance(gate, torch.nn.Module) and is_router(gate) else None)
    return out


def empty_routes(n: int, shape: tuple[int, int]) -> torch.Tensor:
    """``[n, layers, top_k]`` int32 routes of no expert."""
    return torch.full((n, *shape), NO_EXPERT, dtype=torch.int32)


@dataclass
class LayerRouting:
    """What one router did in one forward pass."""

    own: torch.Tensor
    """[T, k] the experts the router picked itself."""
    chosen: torch.Tensor
    """[T, k] the experts the layer ran (the recorded ones where replayed)."""
    probs: torch.Tensor
    """[T, E] fp32 router probabilities (detached)."""
    recorded: torch.Tensor | None
    """[T, k] the recorded experts of this layer (``-1`` rows: none), when the batch carries them."""


@dataclass
class _Pass:
    recorded: torch.Tensor | None = None
    """[T, layers, k] routes of the tokens of this pass, or None."""
    replay: bool = False
    layers: dict[int, LayerRouting] = field(default_factory=dict)


class RoutingReplay:
    """Drives the routers of one HF MoE model: each forward pass (`begin`) may carry the recorded
    routes of its tokens, which the routers replay (``replay=True``) or only compare with; either
    way each router's choice is kept for `stats`.

    The routers' ``forward`` is replaced on the instances (not the classes): the replacement
    computes what the HF router computes when nothing is replayed. A pass's routes stay set until
    the next `begin`, so that a backward pass that recomputes activations (gradient checkpointing)
    routes as the forward did."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        shape = routing_shape(config)
        if shape is None:
            raise ValueError(f"{config.model_type!r} has no mixture-of-experts layers")
        if config.model_type not in MOE_MODEL_TYPES:
            raise ValueError(f"routing replay supports model types {MOE_MODEL_TYPES}, got {config.model_type!r}")
        self.shape = shape
        self.num_experts = int(getattr(config, "num_experts", None) or config.num_local_experts)
        # Mixtral always renormalises its top-k and keeps the gate weights in fp32.
        renormalise = bool(getattr(config, "norm_topk_prob", True))
        cast = config.model_type != "mixtral"
        self.routers = layer_routers(model.base_model.layers)
        self._pass = _Pass()
        for i, router in enumerate(self.routers):
            if router is not None:
                router.forward = types.MethodType(_make_forward(self, i, renormalise, cast), router)

    def begin(self, routes: torch.Tensor | None, replay: bool) -> None:
        """Start a forward pass over packed tokens whose recorded routes are ``routes`` ``[T,
        layers, top_k]`` (None: not recorded); ``replay`` forces them."""
        if routes is not None and tuple(routes.shape[1:]) != self.shape:
            raise ValueError(
                f"routed_experts has shape {list(routes.shape)}; this model routes [tokens, {self.shape[0]}, {self.shape[1]}]"
            )
        if replay and routes is None:
            raise ValueError("routing replay is on but the batch has no 'routed_experts'")
        self._pass = _Pass(recorded=routes, replay=replay)

    def route(self, layer: int, probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(own, chosen) experts ``[T, k]`` of ``layer`` for router probabilities ``probs`` [T, E]."""
        own = torch.topk(probs, top_k, dim=-1).indices
        p = self._pass
        recorded = None
        if p.recorded is not None:
            if p.recorded.shape[0] != probs.shape[0]:
                raise ValueError(
                    f"routed_experts covers {p.recorded.shape[0]} tokens, the forward pass runs {probs.shape[0]}"
                )
            recorded = p.recorded[:, layer].to(device=own.device, dtype=own.dtype)
        chosen = own
        if p.replay and recorded is not None:
            chosen = torch.where(recorded[:, :1] >= 0, recorded, own)
        p.layers[layer] = LayerRouting(own=own, chosen=chosen, probs=probs.detach(), recorded=recorded)
        return own, chosen

    def stats(self) -> dict[str, float]:
        """Statistics of the last pass, over its MoE layers:

        - ``moe/routing_agreement``: of the recorded experts of each (token, layer), the share the
          router picks itself (tokens with recorded routes only; 1 = generation and training route
          alike, and 1 when no token has any).
        - ``moe/token_route_match``: the share of those tokens whose experts agree in every layer.
        - ``moe/expert_load_max``: the largest share of routed slots one expert took, times the
          number of experts (1 = balanced), averaged over layers.
        - ``moe/aux_loss``: the load-balancing loss ``E * sum_e f_e P_e`` of the Switch Transformer
          (Fedus et al. 2021, eq. 4, alpha = 1): ``f_e`` the share of routed slots expert e took,
          ``P_e`` its mean router probability; 1 when balanced. Averaged over layers.
        """
        layers = list(self._pass.layers.values())
        if not layers:
            return {}
        n_exp = self.num_experts
        loads, aux = [], []
        for lr in layers:
            counts = torch.bincount(lr.chosen.flatten(), minlength=n_exp).float()
            share = counts / counts.sum().clamp(min=1)
            loads.append(float(share.max()) * n_exp)
            aux.append(float(n_exp * (share * lr.probs.mean(dim=0)).sum()))
        out = {"moe/expert_load_max": sum(loads) / len(loads), "moe/aux_loss": sum(aux) / len(aux)}
        with_rec = [lr for lr in layers if lr.recorded is not None]
        if with_rec:  # the keys depend only on whether the batch has routes: ranks reduce them together
            has = with_rec[0].recorded[:, 0] >= 0  # type: ignore[index]
            overlap = torch.stack([_overlap(lr.own[has], lr.recorded[has]) for lr in with_rec])  # type: ignore[index]
            agree = overlap.mean() if overlap.numel() else torch.tensor(1.0)
            match = (overlap == 1).all(dim=0).float().mean() if overlap.numel() else torch.tensor(1.0)
            out["moe/routing_agreement"] = float(agree)
            out["moe/token_route_match"] = float(match)
        return out


def _overlap(own: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """[T] the share of each row of ``recorded`` [T, k] that ``own`` [T, k] contains."""
    return (own[:, :, None] == recorded[:, None, :]).any(dim=1).float().mean(dim=1)


RouterForward = Callable[[torch.nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _make_forward(replay: RoutingReplay, layer: int, renormalise: bool, cast: bool) -> RouterForward:
    """The ``forward`` of router ``layer``: the HF router's computation, with the experts `RoutingReplay.route` chooses."""

    def forward(
        router: torch.nn.Module, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = hidden_states.reshape(-1, router.weight.shape[1])
        logits = F.linear(hidden, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        _, chosen = replay.route(layer, probs, router.top_k)
        weights = probs.gather(1, chosen)
        if renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype) if cast else weights, chosen

    return forward


__all__ = [
    "MOE_MODEL_TYPES",
    "NO_EXPERT",
    "LayerRouting",
    "RoutingReplay",
    "empty_routes",
    "is_router",
    "layer_routers",
    "routing_shape",
]
