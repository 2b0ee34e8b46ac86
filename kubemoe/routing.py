"""Routing functions of the seed architectures as pure functions of router logits.

One function covers softmax top-k (Mixtral, Qwen3-MoE, DeepSeek-V2), sigmoid top-k with
group-limited selection and a score-correction bias (DeepSeek-V3 / Moonlight), sigmoid top-k
without normalisation (Llama-4) and PhiMoE's sparse mixer. The frontend's load predictor and the
offload path route with it without the `transformers` router modules; tests hold it equal to them.

Shapes: T = tokens, E = experts, K = experts per token, G = expert groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kubemoe import moe_kernels

Scoring = Literal["softmax", "sigmoid", "sparsemixer"]
GroupScore = Literal["max", "top2_sum"]


@dataclass(frozen=True)
class RoutingSpec:
    """How one architecture turns router logits into (weights, experts) per token."""

    top_k: int
    scoring: Scoring
    normalize: bool = False  # divide the K selected weights by their sum
    scaling: float = 1.0  # routed_scaling_factor, applied last
    n_group: int = 1  # group-limited selection: experts are split into G groups ...
    topk_group: int = 1  # ... and only the best topk_group groups may be chosen
    group_score: GroupScore = "max"
    has_bias: bool = False  # DeepSeek-V3: bias added for *selection* only, never to the weights
    weight_on_input: bool = False  # Llama-4 scales the expert input, not its output
    jitter_eps: float = 0.0  # PhiMoE sparse mixer threshold

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"need 1 <= topk_group <= n_group, got {self.topk_group} of {self.n_group}")


def route(
    logits: torch.Tensor,  # [T, E]
    spec: RoutingSpec,
    bias: torch.Tensor | None = None,  # [E]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (weights [T, K] float32, experts [T, K] int64), experts sorted ascending per token."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if spec.has_bias != (bias is not None):
        raise ValueError("bias must be given exactly when the routing spec has a score-correction bias")
    if spec.scoring == "sparsemixer":
        weights, experts = _sparsemixer(logits, spec)
    else:
        weights, experts = _topk(logits.float(), spec, bias)
    if spec.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * spec.scaling
    order = experts.argsort(dim=-1)
    return weights.gather(1, order), experts.gather(1, order)


def select_experts(
    logits: torch.Tensor,  # [T, E]
    spec: RoutingSpec,
    bias: torch.Tensor | None = None,  # [E]
) -> torch.Tensor:  # [T, K] int64, in no particular order within a token
    """The experts `route` picks, without their weights: for plain top-k, the top-k of the logits
    themselves (softmax and sigmoid keep their order), one kernel where `route` takes several (on a
    GPU kubemoe's, where torch's topk takes two). Load predictors need only this, on every layer of
    every step."""
    if spec.scoring == "sparsemixer" or spec.n_group > 1 or bias is not None:
        return route(logits, spec, bias)[1]
    if moe_kernels.runs_here(logits.device):
        return moe_kernels.top_k(logits, spec.top_k, softmax=False, normalize=False)[1]
    return logits.topk(spec.top_k, dim=-1).indices


def _topk(logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None):
    scores = logits.softmax(dim=-1) if spec.scoring == "softmax" else logits.sigmoid()  # [T, E]
    choice = scores if bias is None else scores + bias.float()
    if spec.n_group > 1:
        choice = _mask_groups(choice, spec)
    experts = choice.topk(spec.top_k, dim=-1).indices  # [T, K]
    return scores.gather(1, experts), experts


def _mask_groups(choice: torch.Tensor, spec: RoutingSpec) -> torch.Tensor:
    tokens, num_experts = choice.shape
    grouped = choice.view(tokens, spec.n_group, num_experts // spec.n_group)  # [T, G, E/G]
    if spec.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(spec.topk_group, dim=-1).indices, True)
    # DeepSeek-V2 zeroes the softmax scores of dropped groups, V3 sets them to -inf: for top-k
    # selection both only need "below every kept score".
    fill = 0.0 if spec.scoring == "softmax" else float("-inf")
    return grouped.masked_fill(~keep.unsqueeze(-1), fill).view(tokens, num_experts)


def _sparsemixer(logits: torch.Tensor, spec: RoutingSpec):
    # PhiMoE's sparse mixer (eval mode) is transformers' own function, not a copy of it.
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    if spec.top_k != 2:
        raise ValueError("PhiMoE's sparse mixer routes exactly 2 experts per token")
    weights, experts = sparsemixer(logits, jitter_eps=spec.jitter_eps, training=False, top_k=2)
    return weights.float(), experts
