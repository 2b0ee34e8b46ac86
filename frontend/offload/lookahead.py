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
    source: str  # where its predictions come from, for the log and /readyz

    def ahead(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> list[dict[int, int]]: ...


def expert_counts(experts: torch.Tensor, num_experts: int) -> dict[int, int]:  # [T, K] -> expert -> tokens
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    counts.index_add_(0, experts.reshape(-1), torch.ones_like(experts.reshape(-1)))
    return {e: n for e, n in enumerate(counts.tolist()) if n}


class NoLookahead:
    name = "frequency"

    def __init__(self, source: str = "no prediction: the hot-expert table alone"):
        self.source = source

    def ahead(self, layer, hidden, top_k_index, top_k_weights) -> list[dict[int, int]]:
        return []


class RouterReuse:
    name = "router"

    def __init__(self, predictor: LoadPredictor, source: str = "the next MoE layer's router"):
        self.predictor, self.source = predictor, source

    def ahead(self, layer, hidden, top_k_index, top_k_weights) -> list[dict[int, int]]:
        if layer not in self.predictor.pairs:
            return []
        _, experts = self.predictor.predict(layer, hidden.float())
        return [expert_counts(experts, self.predictor.shape.num_experts)]


class LLaPorLookahead:
    name = "llapor"

    def __init__(self, predictor: LLaPor, source: str = "an LLaPor predictor"):
        self.predictor, self.source = predictor, source

    def ahead(self, layer, hidden, top_k_index, top_k_weights) -> list[dict[int, int]]:
        if layer not in self.predictor.pairs:
            return []
        _, experts = self.predictor.predict(layer, hidden, top_k_index, top_k_weights)
        return [expert_counts(experts, self.predictor.shape.num_experts)]


def load_lookahead(choice: str, adapter, checkpoint, device: torch.device) -> Lookahead:
    """`--offload-predictor`: llapor (the file in the checkpoint folder, else gate reuse), router, frequency,
    or an LLaPor file's path; a file made for another checkpoint, or a named file that is missing, is
    refused (KubemoeError). Which one serves, and from where, is logged."""
    lookahead = _lookahead(choice, adapter, checkpoint, device)
    log.info("offload predictor: %s, %s", lookahead.name, lookahead.source)
    return lookahead


def _lookahead(choice: str, adapter, checkpoint, device: torch.device) -> Lookahead:
    from pathlib import Path

    from kubemoe.frontend.model_shape import ModelShape
    from kubemoe.frontend.offload.config import PREDICTOR_CHOICES
    from kubemoe.offload_env import LLAPOR_FILE

    if choice == "frequency":
        return NoLookahead()
    if len(adapter.moe_layers) < 2:
        return NoLookahead("one MoE layer: nothing to predict ahead of it, the hot-expert table alone")
    router = "the next MoE layer's router applied to this layer's hidden state"
    if choice == "router":
        return RouterReuse(LoadPredictor.from_routers(adapter, checkpoint, 1, device=device), router)
    path = Path(choice) if choice not in PREDICTOR_CHOICES else Path(checkpoint.path) / LLAPOR_FILE
    if choice == "llapor" and not path.is_file():
        log.warning("no LLaPor predictor at %s (train one: `kubemoe predictor train --kind llapor --out %s`, or name "
                    "a file with spec.offload.predictorFile / --offload-predictor FILE)", path, path)
        return RouterReuse(LoadPredictor.from_routers(adapter, checkpoint, 1, device=device),
                           f"{router} (no LLaPor file at {path})")
    shape = ModelShape.of(adapter)
    predictor = LLaPor.load(path, shape).to(device)  # refuses another checkpoint's file, saying what to do
    return LLaPorLookahead(predictor, f"the file {path.resolve()}, trained for {shape.describe()}")


class Replayed:
    """Predictions set from outside before each forward pass: a benchmark replaying recorded routing and the
    predictor's recorded outputs (or, for the clairvoyant oracle, the next layer's actual routing)."""

    name = "replayed"
    source = "predictions set from outside before each forward pass"

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.next: dict[int, torch.Tensor] = {}  # MoE layer -> experts [T, K] expected at the following MoE layer

    def ahead(self, layer, hidden, top_k_index, top_k_weights) -> list[dict[int, int]]:
        experts = self.next.get(layer)
        return [] if experts is None else [expert_counts(experts, self.num_experts)]
