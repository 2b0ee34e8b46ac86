"""One routed expert: its weights in kubemoe's canonical layout and its feed-forward function.

Every seed architecture's routed expert is a gated MLP, down(act(gate(x)) * up(x)), without biases.
kubemoe holds one expert as the per-expert slice of `transformers`' fused layout, so one function
runs all of them. Shapes: T = tokens, H = hidden size, I = expert intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ExpertWeights:
    gate_up: torch.Tensor  # [2I, H]: gate rows first, then up rows
    down: torch.Tensor  # [H, I]

    @property
    def hidden_size(self) -> int:
        return self.gate_up.shape[1]

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def copy_(self, source: "ExpertWeights") -> "ExpertWeights":
        """Copy `source`'s weights into these tensors (say, a stack's slot), in place; returns self."""
        self.gate_up.copy_(source.gate_up)
        self.down.copy_(source.down)
        return self


def expert_ffn(
    x: torch.Tensor,  # [T, H]
    weights: ExpertWeights,
    act: Callable[[torch.Tensor], torch.Tensor],
    out: torch.Tensor | None = None,  # [T, H] to write the result into (may be x itself: read first)
) -> torch.Tensor:  # [T, H]
    gate, up = F.linear(x, weights.gate_up).chunk(2, dim=-1)  # [T, I] each
    if out is None:
        return F.linear(act(gate) * up, weights.down)
    return torch.mm(act(gate) * up, weights.down.t(), out=out)  # what F.linear runs for 2-D inputs
