"""The expert-load predictor (MoEless): at MoE layer l, predict which experts layer l+d will route to.

MoEless's speculative predictor applies layer l+d's router to the hidden state entering layer l: the
residual stream changes little over a few layers, so the next routers already guess well, and a
copy of a router fine-tuned on routing records guesses better (`predictor_train.py`). Its
per-expert token counts are the predicted loads that the scaler plans replicas for. Three kinds of
predictor share this interface and file format:

  router     layer l+d's router unchanged (the Mixtral-offloading approach; no training)
  finetuned  copies of the routers, fine-tuned only for the layers that predicted badly (MoEless)
  mlp        a small MLP per layer trained from scratch (the ProMoE approach; a baseline)

Heads map hidden [T, H] to logits [T, E] in float32, and the architecture's own routing function
(`kubemoe.routing.select_experts`) turns those into experts, so a prediction picks experts the way
the router does. Shapes: T = tokens, H = hidden size, E = experts, K = experts per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kubemoe.errors import KubemoeError
from kubemoe.frontend.model_shape import ModelShape, layer_state, read_predictor, save_predictor
from kubemoe.routing import RoutingSpec, select_experts

PREDICTOR_FORMAT = "kubemoe.load-predictor/1"
KINDS = ("router", "finetuned", "mlp")
_TRAIN_HINT = "train one on this checkpoint's routing records (`kubemoe predictor train`)"


class GateHead(torch.nn.Module):
    """A router copy: logits = hidden @ weight.T."""

    def __init__(self, weight: torch.Tensor):  # [E, H]
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().float().clone())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E]
        return torch.nn.functional.linear(hidden.float(), self.weight)


class MLPHead(torch.nn.Module):
    """ProMoE-style predictor: hidden -> width -> experts."""

    def __init__(self, hidden_size: int, num_experts: int, width: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(hidden_size, width), torch.nn.GELU(),
                                       torch.nn.Linear(width, num_experts))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E]
        return self.net(hidden.float())


def prediction_pairs(moe_layers: tuple[int, ...], distance: int) -> dict[int, int]:
    """{source layer: target layer}: MoE layer i predicts MoE layer i + distance (in MoE-layer order)."""
    if distance < 1:
        raise KubemoeError(f"the prediction distance must be at least 1, got {distance}")
    if distance >= len(moe_layers):
        raise KubemoeError(f"prediction distance {distance} reaches beyond the last MoE layer: the model has "
                           f"{len(moe_layers)} MoE layers, so use a distance of at most {len(moe_layers) - 1}")
    return {moe_layers[i]: moe_layers[i + distance] for i in range(len(moe_layers) - distance)}


@dataclass
class LoadPredictor:
    shape: ModelShape
    distance: int
    kind: str
    routing: RoutingSpec
    heads: dict[int, torch.nn.Module]  # target layer -> head
    biases: dict[int, torch.Tensor]  # target layer -> the router's selection bias (DeepSeek-V3), if any
    info: dict  # training report, saved with the predictor

    def __post_init__(self) -> None:
        self.pairs = prediction_pairs(self.shape.moe_layers, self.distance)
        self.targets = {t: s for s, t in self.pairs.items()}
        if set(self.heads) != set(self.targets):
            raise KubemoeError(f"the predictor has heads for layers {sorted(self.heads)}, but distance {self.distance} "
                               f"needs layers {sorted(self.targets)}")

    @classmethod
    def from_routers(cls, adapter, checkpoint, distance: int, device: str | torch.device = "cpu") -> "LoadPredictor":
        """The next routers unchanged: MoEless's starting point and the reuse baseline."""
        shape = ModelShape.of(adapter)
        heads, biases = {}, {}
        for target in prediction_pairs(shape.moe_layers, distance).values():
            names = adapter.router_tensors(target)
            heads[target] = GateHead(checkpoint.read(names.weight, dtype=torch.float32)).to(device)
            if names.bias:
                biases[target] = checkpoint.read(names.bias, dtype=torch.float32, device=device)
        return cls(shape, distance, "router", adapter.routing, heads, biases, {})

    @classmethod
    def mlp(cls, adapter, distance: int, width: int = 256, seed: int = 0) -> "LoadPredictor":
        shape = ModelShape.of(adapter)
        torch.manual_seed(seed)
        heads = {t: MLPHead(shape.hidden_size, shape.num_experts, width)
                 for t in prediction_pairs(shape.moe_layers, distance).values()}
        return cls(shape, distance, "mlp", adapter.routing, heads, {}, {"width": width})

    # -- prediction ------------------------------------------------------------------------------

    def logits(self, target: int, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E]
        return self.heads[target](hidden)

    def experts_from_logits(self, target: int, logits: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, K]
        return select_experts(logits, self.routing, self.biases.get(target))

    @torch.no_grad()
    def predict(self, source: int, hidden: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(target layer, predicted experts [T, K]) from the hidden state entering MoE layer `source`."""
        target = self.pairs[source]
        return target, self.experts_from_logits(target, self.logits(target, hidden))

    def parameters_count(self) -> int:
        return sum(p.numel() for h in self.heads.values() for p in h.parameters())

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for h in self.heads.values() for p in h.parameters()) + \
            sum(b.nbytes for b in self.biases.values())

    def to(self, device: str | torch.device) -> "LoadPredictor":
        for head in self.heads.values():
            head.to(device)
        self.biases = {t: b.to(device) for t, b in self.biases.items()}
        return self

    # -- file ------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        meta = {"format": PREDICTOR_FORMAT, "kind": self.kind, "distance": str(self.distance), "info": json.dumps(self.info)}
        return save_predictor(path, self.heads, "heads", meta, self.shape,
                              {f"biases.{t}": b for t, b in self.biases.items()})

    @classmethod
    def load(cls, path: str | Path, adapter, distance: int | None = None) -> "LoadPredictor":
        """Read a predictor file for the model of `adapter`; raises KubemoeError saying what to do."""
        shape = ModelShape.of(adapter)
        meta, tensors = read_predictor(path, PREDICTOR_FORMAT, "predictor", shape, _TRAIN_HINT)
        if meta.get("kind") not in KINDS:
            raise KubemoeError(f"{path} holds a load predictor of unknown kind {meta.get('kind')!r}; {_TRAIN_HINT}")
        saved = int(meta["distance"])
        if distance is not None and distance != saved:
            raise KubemoeError(f"the predictor {path} predicts {saved} MoE layers ahead, not {distance}: train one "
                               f"with --distance {distance} or serve with --prediction-distance {saved}")
        info = json.loads(meta.get("info") or "{}")
        heads: dict[int, torch.nn.Module] = {}
        for target in prediction_pairs(shape.moe_layers, saved).values():
            state = layer_state(tensors, "heads", target)
            head = GateHead(state["weight"]) if "weight" in state else \
                MLPHead(shape.hidden_size, shape.num_experts, int(info.get("width", 256)))
            head.load_state_dict(state)
            heads[target] = head
        biases = {int(k.split(".")[1]): v for k, v in tensors.items() if k.startswith("biases.")}
        return cls(shape, saved, meta["kind"], adapter.routing, heads, biases, info)
