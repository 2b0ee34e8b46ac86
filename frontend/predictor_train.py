"""Training and judging expert-load predictors on routing records.

Accuracy is what MoEless's layer-aware fine-tuning acts on: the share of a token's true top-k
experts that the prediction names (top-k set accuracy). The scaler plans from counts, so the error
of the predicted load distribution is reported beside it: the total variation distance between
predicted and true tokens per expert over a window of tokens (0 = the same loads, 1 = disjoint).

Layer-aware fine-tuning starts from the routers themselves and trains only the layers whose
accuracy is below the threshold, each until it passes the threshold or stops improving. The MLP
baseline is trained on the same data, from scratch, until it stops improving. Both minimise the
cross-entropy between the head's softmax and the true top-k set (uniform over its K experts).
Shapes: N = rows, T = tokens, H = hidden size, E = experts, K = experts per token.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch

from kubemoe.frontend.predictor import LoadPredictor
from kubemoe.frontend.records import RoutingRecords

log = logging.getLogger(__name__)


def topk_accuracy(predicted: torch.Tensor, true: torch.Tensor) -> float:  # [T, K], [T, K] -> share in [0, 1]
    """Mean over tokens of |predicted ∩ true| / K."""
    if predicted.shape != true.shape:
        raise ValueError(f"predicted {tuple(predicted.shape)} and true {tuple(true.shape)} experts differ in shape")
    if predicted.numel() == 0:
        return float("nan")
    return float(hits(predicted, true)) / true.numel()


def candidate_hit(candidates: torch.Tensor, true: torch.Tensor) -> float:  # [T, C], [T, K] -> share in [0, 1]
    """Share of the true experts that are among a prediction's C candidates per token (C >= K: what a
    prefetcher that loads the C most likely experts finds ready; C = K is top-k accuracy)."""
    if candidates.shape[0] != true.shape[0]:
        raise ValueError(f"candidates {tuple(candidates.shape)} and true {tuple(true.shape)} experts differ in tokens")
    if true.numel() == 0:
        return float("nan")
    return float(hits(candidates, true)) / true.numel()


def hits(predicted: torch.Tensor, true: torch.Tensor) -> torch.Tensor:  # [T, C], [T, K] -> scalar tensor
    """|predicted ∩ true| summed over tokens (experts within one token's row are distinct)."""
    return row_hits(predicted, true).sum()


def row_hits(predicted: torch.Tensor, true: torch.Tensor) -> torch.Tensor:  # [T, C], [T, K] -> [T]
    """|predicted ∩ true| per token."""
    return (predicted.unsqueeze(-1) == true.unsqueeze(-2)).any(-1).sum(-1)


def load_error(predicted: torch.Tensor, true: torch.Tensor, num_experts: int, window: int = 64) -> float:
    """Mean over windows of `window` tokens of the total variation distance between the loads."""
    errors = []
    for start in range(0, len(true) - window + 1, window):
        p = torch.bincount(predicted[start:start + window].reshape(-1), minlength=num_experts).float()
        t = torch.bincount(true[start:start + window].reshape(-1), minlength=num_experts).float()
        errors.append(0.5 * float((p / p.sum() - t / t.sum()).abs().sum()))
    return sum(errors) / len(errors) if errors else float("nan")


@dataclass(frozen=True)
class TrainConfig:
    threshold: float = 0.8  # MoEless's h: layers below it are fine-tuned
    max_epochs: int = 40
    patience: int = 3  # epochs without improvement before a layer stops
    lr: float = 1e-3
    batch: int = 512
    seed: int = 0
    device: str = "cpu"


@dataclass(frozen=True)
class LayerScore:
    target: int
    source: int
    accuracy: float
    load_error: float


def evaluate(predictor: LoadPredictor, records: RoutingRecords, window: int = 64, device: str = "cpu") -> list[LayerScore]:
    scores = []
    for source, target in predictor.pairs.items():
        x, true = _pair(records, source, target, device)
        with torch.no_grad():
            predicted = torch.cat([predictor.predict(source, x[i:i + 4096])[1] for i in range(0, len(x), 4096)])
        scores.append(LayerScore(target, source, topk_accuracy(predicted, true),
                                 load_error(predicted.cpu(), true.cpu(), predictor.shape.num_experts, window)))
    return scores


def _pair(records: RoutingRecords, source: int, target: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden entering `source` [N, H] float32, experts chosen at `target` [N, K])."""
    return (records.hidden[:, records.layer_index(source)].to(device, torch.float32),
            records.experts[:, records.layer_index(target)].to(device))


def _soft_targets(true: torch.Tensor, num_experts: int) -> torch.Tensor:  # [N, K] -> [N, E]
    target = torch.zeros(true.shape[0], num_experts, device=true.device)
    return target.scatter_(1, true, 1.0 / true.shape[1])


def _fit(predictor: LoadPredictor, target: int, train: tuple, held: tuple, config: TrainConfig,
         stop_at: float | None) -> tuple[float, int]:
    """Train one head; keep its best state by held-out accuracy. Returns (best accuracy, epochs run)."""
    head = predictor.heads[target]
    x, true = train
    soft = _soft_targets(true, predictor.shape.num_experts)
    gen = torch.Generator().manual_seed(config.seed + target)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)

    def held_accuracy() -> float:
        with torch.no_grad():
            return topk_accuracy(predictor.experts_from_logits(target, head(held[0])), held[1])

    best, best_state, stale, epoch = held_accuracy(), copy.deepcopy(head.state_dict()), 0, 0
    for epoch in range(1, config.max_epochs + 1):
        if stop_at is not None and best >= stop_at:
            break
        order = torch.randperm(len(x), generator=gen).to(x.device)
        for i in range(0, len(x), config.batch):
            rows = order[i:i + config.batch]
            loss = -(soft[rows] * torch.log_softmax(head(x[rows]), -1)).sum(-1).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        accuracy = held_accuracy()
        if accuracy > best + 1e-4:
            best, best_state, stale = accuracy, copy.deepcopy(head.state_dict()), 0
        else:
            stale += 1
            if stale >= config.patience:
                break
    head.load_state_dict(best_state)
    return best, epoch


def finetune(predictor: LoadPredictor, train: RoutingRecords, held: RoutingRecords,
             config: TrainConfig = TrainConfig()) -> LoadPredictor:
    """MoEless's layer-aware fine-tuning of router copies (a new predictor; `predictor` is unchanged)."""
    tuned = copy.deepcopy(predictor).to(config.device)
    tuned.kind = "finetuned"
    layers = {}
    for source, target in tuned.pairs.items():
        train_pair, held_pair = _pair(train, source, target, config.device), _pair(held, source, target, config.device)
        with torch.no_grad():
            before = topk_accuracy(tuned.predict(source, held_pair[0])[1], held_pair[1])
        if before >= config.threshold:
            layers[target] = {"source": source, "before": round(before, 4), "after": round(before, 4), "epochs": 0}
            continue
        after, epochs = _fit(tuned, target, train_pair, held_pair, config, stop_at=config.threshold)
        layers[target] = {"source": source, "before": round(before, 4), "after": round(after, 4), "epochs": epochs}
        log.info("layer %d (from %d): accuracy %.3f -> %.3f in %d epochs", target, source, before, after, epochs)
    tuned.info = {"threshold": config.threshold, "layers": layers, "train_rows": len(train)}
    return tuned.to("cpu")


def train_mlp(adapter, distance: int, train: RoutingRecords, held: RoutingRecords, width: int = 256,
              config: TrainConfig = TrainConfig()) -> LoadPredictor:
    """The ProMoE-style baseline: an MLP per layer, from scratch, until it stops improving."""
    mlp = LoadPredictor.mlp(adapter, distance, width, config.seed).to(config.device)
    layers = {}
    for source, target in mlp.pairs.items():
        after, epochs = _fit(mlp, target, _pair(train, source, target, config.device),
                             _pair(held, source, target, config.device), config, stop_at=None)
        layers[target] = {"source": source, "after": round(after, 4), "epochs": epochs}
    mlp.info = {"width": width, "layers": layers, "train_rows": len(train)}
    return mlp.to("cpu")
