"""LLaPor (LayerScope): at MoE layer l, predict the experts MoE layer l+1 will route to.

The offload path prefetches the next layer's experts while this layer computes, so a prediction made at
layer l, once this layer's router has run, can use three things: the hidden state entering layer l
(PCA-compressed), the experts this layer chose (multi-hot) and their routing weights. One small net per
source layer maps them to one score per expert of the next layer; the highest scores are the predicted
experts, and the next few the prefetch candidates. Nets differ by layer group (`layer_groups.py`): a
shallow net (linear + GELU + dropout) on a strongly compressed hidden state for the input and output
groups, a deeper one with gated residual blocks on a milder compression for the middle group. Training
and online fine-tuning are in `llapor_train.py`.

The file is one safetensors file: every layer's PCA, net and loss weights, with metadata naming the
format, the model's shape (`records.ModelShape`; a predictor of another checkpoint is refused) and each
layer's group and architecture. Shapes: T = tokens, H = hidden size, P = PCA components, E = experts,
K = experts per token, F = P + 2E features.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kubemoe.errors import KubemoeError
from kubemoe.frontend.predictor import prediction_pairs
from kubemoe.frontend.model_shape import ModelShape, layer_state, read_predictor, save_predictor

LLAPOR_FORMAT = "kubemoe.llapor/1"
_TRAIN_HINT = "train one on this checkpoint's routing records (`kubemoe predictor train --kind llapor`)"


@dataclass(frozen=True)
class LayerArch:
    """What rebuilds one layer's net from its weights (saved in the file's metadata)."""

    group: str
    components: int  # P
    width: int
    blocks: int  # gated residual blocks; 0 is the shallow net
    dropout: float


class PCA(torch.nn.Module):
    """Centre, project on the top principal axes, whiten (unit variance per component, so the net sees
    features of one scale whatever the layer's activation size)."""

    def __init__(self, hidden_size: int, components: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(hidden_size))  # [H]
        self.register_buffer("basis", torch.zeros(components, hidden_size))  # [P, H], rows scaled by 1/std

    @torch.no_grad()
    def fit(self, hidden: torch.Tensor) -> "PCA":  # [N, H]
        hidden = hidden.float()
        mean = hidden.mean(0)
        centred = hidden - mean
        cov = centred.T @ centred / max(1, len(hidden) - 1)  # [H, H]: eigh of it is cheaper than an SVD of [N, H]
        values, vectors = torch.linalg.eigh(cov.double())  # ascending
        top = values.flip(0)[: len(self.basis)].clamp_min(1e-8)
        axes = vectors.flip(1)[:, : len(self.basis)].T  # [P, H]
        self.mean.copy_(mean)
        self.basis.copy_((axes / top.sqrt()[:, None]).float())
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, P]
        return (hidden.float() - self.mean) @ self.basis.T


class GatedResidual(torch.nn.Module):
    """x + sigmoid(gate(x)) * mlp(norm(x)): the block can learn to pass x through untouched."""

    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Dropout(dropout),
                                       torch.nn.Linear(width, width))
        self.gate = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + torch.sigmoid(self.gate(y)) * self.mlp(y)


class LayerHead(torch.nn.Module):
    """One source layer's predictor: (hidden, experts, weights) -> next-layer logits [T, E].
    In eval mode except while training or fine-tuning (dropout)."""

    def __init__(self, hidden_size: int, num_experts: int, arch: LayerArch):
        super().__init__()
        self.num_experts = num_experts
        self.pca = PCA(hidden_size, arch.components)
        features = arch.components + 2 * num_experts
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, arch.width), torch.nn.GELU(), torch.nn.Dropout(arch.dropout),
            *[GatedResidual(arch.width, arch.dropout) for _ in range(arch.blocks)],
            torch.nn.Linear(arch.width, num_experts))
        # per-expert weight of the positive term of the loss (inverse frequency of the next layer's
        # experts in the training records): kept with the head so online fine-tuning uses the same loss
        self.register_buffer("expert_weight", torch.ones(num_experts))  # [E]

    def features(self, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[T, H], [T, K], [T, K] -> [T, F]: PCA of the hidden state, multi-hot experts, weights per expert."""
        chosen = torch.zeros(len(experts), self.num_experts, device=experts.device)
        multi_hot = chosen.scatter(1, experts.long(), 1.0)
        per_expert = chosen.scatter(1, experts.long(), weights.float())
        return torch.cat([self.pca(hidden), multi_hot, per_expert], 1)

    def forward(self, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.net(self.features(hidden, experts, weights))


@dataclass
class LLaPor:
    shape: ModelShape
    heads: dict[int, LayerHead]  # source MoE layer -> its head (every MoE layer but the last)
    archs: dict[int, LayerArch]  # source MoE layer -> what its head is
    info: dict  # training report, saved with the predictor

    def __post_init__(self) -> None:
        self.pairs = prediction_pairs(self.shape.moe_layers, 1)  # source -> target
        if set(self.heads) != set(self.pairs) or set(self.archs) != set(self.pairs):
            raise KubemoeError(f"LLaPor needs a head for each of layers {sorted(self.pairs)}, it has "
                               f"{sorted(self.heads)}; {_TRAIN_HINT}")

    @classmethod
    def build(cls, shape: ModelShape, archs: dict[int, LayerArch], info: dict | None = None) -> "LLaPor":
        heads = {s: LayerHead(shape.hidden_size, shape.num_experts, a).eval() for s, a in archs.items()}
        return cls(shape, heads, dict(archs), info or {})

    def group(self, source: int) -> str:
        return self.archs[source].group

    # -- prediction ------------------------------------------------------------------------------

    def logits(self, source: int, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Scores [T, E] of the next layer's experts from layer `source`'s hidden [T, H], experts and weights [T, K]."""
        return self.heads[source](hidden, experts, weights)

    @torch.no_grad()
    def predict(self, source: int, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                count: int | None = None) -> tuple[int, torch.Tensor]:
        """(target layer, its `count` (default K) most likely experts per token [T, count], best first)."""
        scores = self.heads[source](hidden, experts, weights)
        return self.pairs[source], scores.topk(count or self.shape.top_k, -1).indices

    def parameters_count(self) -> int:
        return sum(p.numel() for h in self.heads.values() for p in h.parameters())

    def to(self, device: str | torch.device) -> "LLaPor":
        for head in self.heads.values():
            head.to(device)
        return self

    # -- file ------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        meta = {"format": LLAPOR_FORMAT, "archs": json.dumps({str(s): asdict(a) for s, a in self.archs.items()}),
                "info": json.dumps(self.info)}
        return save_predictor(path, self.heads, "layers", meta, self.shape)

    @classmethod
    def load(cls, path: str | Path, expect: ModelShape) -> "LLaPor":
        """Read an LLaPor file for a model of shape `expect`; raises KubemoeError saying what to do."""
        meta, tensors = read_predictor(path, LLAPOR_FORMAT, "LLaPor", expect, _TRAIN_HINT)
        archs = {int(s): LayerArch(**a) for s, a in json.loads(meta["archs"]).items()}
        predictor = cls.build(expect, archs, json.loads(meta.get("info") or "{}"))
        for source, head in predictor.heads.items():
            head.load_state_dict(layer_state(tensors, "layers", source))
        return predictor
