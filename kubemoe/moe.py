"""Token grouping and output combination around a layer's routed experts.

This is the part of an MoE layer that does not depend on where the experts run: split a batch's
tokens by expert, and add each expert's output back to its tokens with the routing weight. The
in-process experts, the expert-function server and the frontend's remote dispatcher all use it.
Shapes: T = tokens, H = hidden size, K = experts per token, N_e = tokens routed to expert e.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kubemoe.expert import ExpertWeights, expert_ffn


@dataclass(frozen=True)
class ExpertGroup:
    expert: int
    tokens: torch.Tensor  # [N_e] token positions in the batch
    slots: torch.Tensor  # [N_e] which of the token's K choices this is


def group_tokens(top_k_index: torch.Tensor) -> list[ExpertGroup]:  # [T, K] -> groups, by expert id
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)
    experts, counts = flat[order].unique_consecutive(return_counts=True)
    k = top_k_index.shape[1]
    groups, start = [], 0
    for expert, count in zip(experts.tolist(), counts.tolist()):
        picked = order[start:start + count]
        groups.append(ExpertGroup(expert, picked // k, picked % k))
        start += count
    return groups


def expert_inputs(
    hidden: torch.Tensor, top_k_weights: torch.Tensor, group: ExpertGroup, weight_on_input: bool
) -> torch.Tensor:  # [N_e, H]
    x = hidden[group.tokens]
    if weight_on_input:
        x = x * top_k_weights[group.tokens, group.slots, None].to(x.dtype)
    return x


def combine(
    out: torch.Tensor,  # [T, H], accumulated in place
    top_k_weights: torch.Tensor,  # [T, K]
    group: ExpertGroup,
    expert_out: torch.Tensor,  # [N_e, H]
    weight_on_input: bool,
) -> None:
    if not weight_on_input:
        expert_out = expert_out * top_k_weights[group.tokens, group.slots, None]
    out.index_add_(0, group.tokens, expert_out.to(out.dtype))


class LocalExperts(torch.nn.Module):
    """A layer's routed experts computed in this process, with the `transformers` experts signature."""

    def __init__(self, weights: dict[int, ExpertWeights], act: Callable, weight_on_input: bool):
        super().__init__()
        self.weights, self.act, self.weight_on_input = weights, act, weight_on_input

    def forward(self, hidden_states, top_k_index, top_k_weights):  # [T, H], [T, K], [T, K] -> [T, H]
        out = torch.zeros_like(hidden_states)
        for group in group_tokens(top_k_index):
            x = expert_inputs(hidden_states, top_k_weights, group, self.weight_on_input)
            combine(out, top_k_weights, group, expert_ffn(x, self.weights[group.expert], self.act), self.weight_on_input)
        return out
