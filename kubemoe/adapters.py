"""Model adapters: what kubemoe needs to know about each seed MoE architecture.

The model itself is always `transformers`' own class. An adapter adds what serving needs on top:
which decoder layers are MoE, experts and top-k per layer, the routing function, shared experts,
where each (layer, expert)'s tensors live in a checkpoint and how many bytes they take. Everything
structural is read off a meta-device `transformers` model (no weights are allocated), and checkpoint
tensor names come from `transformers`' own conversion tables (`revert_weight_conversion`), the same
ones `save_pretrained` uses; nothing here is a hand-written name map.

Shapes: T = tokens, H = hidden size, E = experts, I = expert intermediate size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kubemoe.checkpoint import Checkpoint
from kubemoe.errors import UnsupportedModelError
from kubemoe.expert import ExpertWeights
from kubemoe.routing import RoutingSpec, route


@dataclass(frozen=True)
class ArchSpec:
    """The few facts about an architecture that its `transformers` classes do not expose uniformly."""

    name: str  # kubemoe's name for it (CLI, presets)
    model_type: str  # transformers' config.model_type
    block_attr: str  # decoder-layer attribute holding the MLP / MoE block
    router_attr: str  # MoE-block attribute holding the router
    shared_attr: str | None  # MoE-block attribute holding the shared expert(s)
    routing: Callable[[Any], RoutingSpec]  # from the transformers config of the model
    fused_transposed: bool = False  # fused expert tensors stored [E, H, 2I] / [E, I, H] (Llama-4)
    router_fp32: bool = False  # router logits computed in float32 whatever the model dtype


ARCHS: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in [
        ArchSpec(
            "mixtral", "mixtral", "mlp", "gate", None,
            lambda c: RoutingSpec(c.num_experts_per_tok, "softmax", normalize=True),
        ),
        ArchSpec(
            "phimoe", "phimoe", "mlp", "router", None,
            lambda c: RoutingSpec(c.num_experts_per_tok, "sparsemixer", jitter_eps=c.router_jitter_noise),
        ),
        ArchSpec(
            "llama4", "llama4_text", "feed_forward", "router", "shared_expert",
            lambda c: RoutingSpec(c.num_experts_per_tok, "sigmoid", weight_on_input=True),
            fused_transposed=True,
        ),
        ArchSpec(
            "deepseek_v2", "deepseek_v2", "mlp", "gate", "shared_experts",
            lambda c: RoutingSpec(
                c.num_experts_per_tok, "softmax", scaling=c.routed_scaling_factor,
                **({"n_group": c.n_group, "topk_group": c.topk_group, "group_score": "max"}
                   if c.topk_method == "group_limited_greedy" else {}),
            ),
            router_fp32=True,
        ),
        ArchSpec(
            "qwen3_moe", "qwen3_moe", "mlp", "gate", None,
            lambda c: RoutingSpec(c.num_experts_per_tok, "softmax", normalize=c.norm_topk_prob),
        ),
        ArchSpec(
            "deepseek_v3", "deepseek_v3", "mlp", "gate", "shared_experts",
            lambda c: RoutingSpec(
                c.num_experts_per_tok, "sigmoid", normalize=c.norm_topk_prob, scaling=c.routed_scaling_factor,
                n_group=c.n_group, topk_group=c.topk_group, group_score="top2_sum", has_bias=True,
            ),
            router_fp32=True,
        ),
    ]
}
_BY_MODEL_TYPE = {spec.model_type: spec for spec in ARCHS.values()}


@dataclass(frozen=True)
class ExpertTensors:
    """Where one (layer, expert)'s weights live in the checkpoint."""

    gate: str
    up: str
    down: str
    index: int | None = None  # set when the tensors are fused 3-D [E, ...]: this expert's slice


@dataclass(frozen=True)
class RouterTensors:
    weight: str
    bias: str | None = None  # DeepSeek-V3's e_score_correction_bias


class MoEAdapter:
    """An architecture adapter bound to one model config."""

    def __init__(self, config):
        try:
            self.arch = _BY_MODEL_TYPE[config.model_type]
        except KeyError:
            known = ", ".join(sorted(_BY_MODEL_TYPE))
            raise UnsupportedModelError(
                f"model type {config.model_type!r} has no kubemoe adapter; supported: {known}"
            ) from None
        self.config = config
        self.routing: RoutingSpec = self.arch.routing(config)
        self.moe_layers: tuple[int, ...] = tuple(
            i for i, layer in enumerate(self._layers) if hasattr(self._block(layer), "experts")
        )
        if not self.moe_layers:
            raise UnsupportedModelError(f"the {self.arch.name} config has no MoE layer")
        experts = self.experts_module(self.meta_model, self.moe_layers[0])
        self.num_experts: int = experts.gate_up_proj.shape[0]
        self.expert_intermediate_size: int = experts.down_proj.shape[1 if self.arch.fused_transposed else 2]
        self.act = experts.act_fn

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "MoEAdapter":
        return cls(Checkpoint(path).config)

    # -- structure ------------------------------------------------------------------------------

    @cached_property
    def meta_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.config)

    @property
    def _layers(self):
        return self.meta_model.model.layers

    def _block(self, layer: torch.nn.Module) -> torch.nn.Module:
        return getattr(layer, self.arch.block_attr)

    def moe_block(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        return self._block(model.model.layers[layer])

    def experts_module(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        return self.moe_block(model, layer).experts

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    @property
    def has_shared_experts(self) -> bool:
        return self.arch.shared_attr is not None

    def expert_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one routed expert (gate, up and down projections) in `dtype`."""
        return 3 * self.hidden_size * self.expert_intermediate_size * dtype.itemsize

    def _check(self, layer: int, expert: int | None = None) -> None:
        if layer not in self.moe_layers:
            raise ValueError(f"layer {layer} is not an MoE layer of this {self.arch.name} model (MoE layers: {list(self.moe_layers)})")
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: layer {layer} has experts 0..{self.num_experts - 1}")

    # -- checkpoint names -----------------------------------------------------------------------

    def checkpoint_layout(self) -> dict[str, torch.Size]:
        """Every tensor a checkpoint of this config holds, by name, as `save_pretrained` writes it."""
        model = self.meta_model
        # A tied weight (an LM head sharing the embedding) is saved once, under its first name.
        tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
        state = {k: v for k, v in model.state_dict().items() if k not in tied}
        return {name: t.shape for name, t in self._to_checkpoint_names(state).items()}

    def checkpoint_name(self, internal_name: str) -> str:
        """The checkpoint's name for one of the model's parameters or persistent buffers."""
        tensor = self.meta_model.get_parameter_or_buffer(internal_name)
        (name,) = self._to_checkpoint_names({internal_name: tensor})
        return name

    def _to_checkpoint_names(self, internal: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.meta_model, internal)

    @cached_property
    def _expert_names(self) -> dict[int, list[ExpertTensors]]:
        names = {}
        for layer in self.moe_layers:
            prefix = f"model.layers.{layer}.{self.arch.block_attr}.experts"
            experts = self.experts_module(self.meta_model, layer)
            gate_up = list(self._to_checkpoint_names({f"{prefix}.gate_up_proj": experts.gate_up_proj}))
            down = list(self._to_checkpoint_names({f"{prefix}.down_proj": experts.down_proj}))
            if not re.search(r"\.experts\.0\.", down[0]):  # the checkpoint keeps the fused 3-D tensors
                names[layer] = [ExpertTensors(gate_up[0], gate_up[0], down[0], e) for e in range(self.num_experts)]
                continue
            # The reverse conversion splits gate_up into all gate tensors, then all up tensors.
            e_count = self.num_experts
            assert len(gate_up) == 2 * e_count and len(down) == e_count, (gate_up, down)
            names[layer] = [ExpertTensors(gate_up[e], gate_up[e_count + e], down[e]) for e in range(e_count)]
            assert all(f".{e}." in names[layer][e].down for e in range(e_count))
        return names

    def expert_tensors(self, layer: int, expert: int) -> ExpertTensors:
        self._check(layer, expert)
        return self._expert_names[layer][expert]

    def router_tensors(self, layer: int) -> RouterTensors:
        self._check(layer)
        router = getattr(self.moe_block(self.meta_model, layer), self.arch.router_attr)
        prefix = f"model.layers.{layer}.{self.arch.block_attr}.{self.arch.router_attr}"
        weight = next(iter(self._to_checkpoint_names({f"{prefix}.weight": router.weight})))
        bias = None
        if self.routing.has_bias:
            bias = next(iter(self._to_checkpoint_names({f"{prefix}.e_score_correction_bias": router.e_score_correction_bias})))
        return RouterTensors(weight, bias)

    # -- weights and compute --------------------------------------------------------------------

    def load_expert(
        self,
        checkpoint: Checkpoint,
        layer: int,
        expert: int,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        copy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> ExpertWeights:
        """Read one expert's weights, and nothing else, straight into `dtype` on `device` (`copy`: as
        Checkpoint.read's; whatever the weights are assembled from on the GPU goes on the current stream)."""
        names = self.expert_tensors(layer, expert)
        if names.index is not None:
            gate_up = checkpoint.read(names.gate, names.index, dtype, device, copy)  # [H, 2I] when transposed
            down = checkpoint.read(names.down, names.index, dtype, device, copy)
            if self.arch.fused_transposed:
                gate_up, down = gate_up.t().contiguous(), down.t().contiguous()
            return ExpertWeights(gate_up, down)
        gate = checkpoint.read(names.gate, None, dtype, device, copy)  # [I, H]
        gate_up = torch.empty((2 * gate.shape[0], gate.shape[1]), dtype=gate.dtype, device=gate.device)
        gate_up[: gate.shape[0]] = gate
        gate_up[gate.shape[0]:] = checkpoint.read(names.up, None, dtype, device, copy)
        return ExpertWeights(gate_up, checkpoint.read(names.down, None, dtype, device, copy))

    def read_expert_into(
        self,
        checkpoint: Checkpoint,
        layer: int,
        expert: int,
        target: ExpertWeights,
        copy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> ExpertWeights:
        """load_expert into `target`'s tensors (a stack's slot: its dtype and device): each tensor as stored
        goes straight into its place, gate and up included; only a transposed layout is assembled first."""
        names = self.expert_tensors(layer, expert)
        if self.arch.fused_transposed:
            return target.copy_(self.load_expert(checkpoint, layer, expert, target.gate_up.dtype,
                                                 target.gate_up.device, copy))
        if names.index is not None:
            checkpoint.read_into(target.gate_up, names.gate, names.index, copy)
        else:
            half = target.gate_up.shape[0] // 2
            checkpoint.read_into(target.gate_up[:half], names.gate, None, copy)
            checkpoint.read_into(target.gate_up[half:], names.up, None, copy)
        checkpoint.read_into(target.down, names.down, names.index, copy)
        return target

    def router_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E]
        if self.arch.router_fp32:
            return F.linear(hidden.float(), weight.float())
        return F.linear(hidden, weight)

    def route(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, K], experts [T, K]) for hidden states [T, H], as the architecture routes."""
        return route(self.router_logits(hidden, weight), self.routing, bias)


def arch_names() -> list[str]:
    return sorted(ARCHS)


def install_routed_experts(adapter: MoEAdapter, model: torch.nn.Module, layer: int, experts: torch.nn.Module) -> None:
    """Make `experts` compute layer `layer`'s routed experts inside a `transformers` model.

    `experts` takes what `transformers`' own experts modules take: (hidden [T, H], top_k_index [T, K],
    top_k_weights [T, K]) -> [T, H]. Most architectures call their experts module that way, so it
    is swapped in place. Llama-4 instead feeds every expert a dense, score-scaled copy of all tokens;
    its block gets a forward that keeps its own router and shared expert and calls `experts` sparsely.
    """
    block = adapter.moe_block(model, layer)
    if not adapter.routing.weight_on_input:
        block.experts = experts
        return
    top_k = adapter.top_k

    def forward(hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]
        scores, logits = block.router(hidden)  # [T, E]: sigmoid of the top-k logits, 0 elsewhere
        index = logits.topk(top_k, dim=-1).indices  # [T, K]
        return block.shared_expert(hidden) + experts(hidden, index, scores.gather(1, index)), logits

    block.experts = experts  # routed weights leave the block, so they are never loaded into it
    block.forward = forward
