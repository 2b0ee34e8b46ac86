"""What the offload scheduler expects of the next MoE layer, made at this one once its router has run.

Every source answers `ahead(layer, hidden, top_k_index, top_k_weights) -> [expert -> tokens]` for the
following MoE layers (index 0: the next one; empty: no prediction, so nothing is prefetched):
- `LLaPorLookahead`: LayerScope's learned predictor (a file of `kubemoe predictor train --kind llapor`);
- `RouterReuse`: the next layer's router applied to this layer's hidden state (gate reuse, as Fate and
  Klotski prefetch);
- `NoLookahead`: the hot table alone (the operator's `predictor: frequency`).
Shapes: T = tokens, H = hidden size, K = experts per token, E = experts.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from kubemoe.frontend.offload.llapor import LLaPor
from kubemoe.frontend.predictor import LoadPredictor

log = logging.getLogger(__name__)


class Lookahead(Protocol):
    name: str

    def ahead(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> list[dict[int, int]]: ...


def expert_counts(experts: torch.Tensor, num_experts: int) -> dict[int, int]:  # [T, K] -> expert -> tokens
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    counts.index_add_(0, experts.reshape(-1), torch.ones_like(experts.reshape(-1)))
    return {e: n for e, n in enumerate(counts.tolist()) if n}


class NoLookahead:
    name = "frequency"

    def ahead(self, layer, hidden, top_k_index, top_k_weights) -> list[dict[int, int]]:
        return []


class RouterReuse:
    name = "router"

    def __init__(self, predictor: LoadPredictor):
        self.predictor = predictor

    def ahead(self, layer, hidden, top_k_index, top_k_weights) -> list[dict[int, int]]:
        if layer not in self.predictor.pairs:
            return []
        _, experts = self.predictor.predict(layer, hidden.float())
        return [expert_counts(experts, self.predictor.shape.num_experts)]


class LLaPorLookahead:
    name = "llapor"

    def __init__(self, predictor: LLaPor):
        self.predictor = predictor

    def ahead(self, layer, hidden, top_k_index, top_k_weights) -> list[dict[int, int]]:
        if layer not in self.predictor.pairs:
            return []
        _, experts = self.predictor.predict(layer, hidden, top_k_index, top_k_weights)
        return [expert_counts(experts, self.predictor.shape.num_experts)]


def load_lookahead(choice: str, adapter, checkpoint, device: torch.device) -> Lookahead:
    """`--offload-predictor`: llapor (the file beside the checkpoint, else gate reuse, logged), router,
    frequency, or an LLaPor file; a file made for another checkpoint is refused (KubemoeError)."""
    from pathlib import Path

    from kubemoe.frontend.model_shape import ModelShape
    from kubemoe.frontend.offload.config import LLAPOR_FILE, PREDICTOR_CHOICES

    if choice == "frequency":
        return NoLookahead()
    if len(adapter.moe_layers) < 2:
        log.info("one MoE layer: nothing to predict ahead of it; the hot table alone decides")
        return NoLookahead()
    path = None
    if choice == "llapor":
        path = Path(checkpoint.path) / LLAPOR_FILE
        if not path.is_file():
            log.warning("no LLaPor predictor at %s (train one: `kubemoe predictor train --kind llapor --out %s`); "
                        "prefetching from the next layer's router instead", path, path)
            path = None
    elif choice not in PREDICTOR_CHOICES:
        path = Path(choice)
    if path is not None:
        return LLaPorLookahead(LLaPor.load(path, ModelShape.of(adapter)).to(device))
    return RouterReuse(LoadPredictor.from_routers(adapter, checkpoint, 1, device=device))


class Replayed:
    """Predictions set from outside before each forward pass: a benchmark replaying recorded routing and the
    predictor's recorded outputs (or, for the clairvoyant oracle, the next layer's actual routing)."""

    name = "replayed"

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.next: dict[int, torch.Tensor] = {}  # MoE layer -> experts [T, K] expected at the following MoE layer

    def ahead(self, layer, hidden, top_k_index, top_k_weights) -> list[dict[int, int]]:
        experts = self.next.get(layer)
        return [] if experts is None else [expert_counts(experts, self.num_experts)]
