"""Training LLaPor on routing records, judging it, and fine-tuning it online.

Offline, per source layer: the layer groups are found from the records (`layer_groups.py`), the PCA is
fitted on the layer's hidden states, and the head is trained with the hybrid loss and AdamW under a
warm-up + cosine schedule whose settings are its group's (`GroupConfig`); the state with the best
candidate hit on the held-out records is kept.

Hybrid loss (multi-label: one sigmoid per expert of the next layer, the true top-k set as targets):
  - binary cross-entropy with the positive term of each expert weighted by its inverse frequency in
    the training records (1 for an expert of average frequency, capped): rare experts are not ignored;
  - focal loss (gamma = 2): the many easy negatives stop dominating the gradient.

Metrics: top-k set accuracy (`predictor_train.topk_accuracy`) and the *candidate hit*: the share of the
true next-layer experts within the predictor's top-(K + 2) candidates. It generalises LayerScope's
"top-4 hit within the true top-6" (Mixtral, K = 2, two spare slots): routing records keep only the
true top-K, not the router's whole ranking, and what a prefetcher needs is that the experts actually
used are among those it loaded, so the spare slots are put on the prediction's side.

Online, `OnlineTuner` keeps a sliding window of recent rows per layer with their true next experts,
and when the window's error (1 - candidate hit) exceeds 10% it fine-tunes that layer's head for a
bounded number of steps on the window, then measures afresh.
Shapes: N = rows, H = hidden size, K = experts per token, E = experts.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

import torch

from kubemoe.frontend.offload.layer_groups import LayerGroups, find_layer_groups
from kubemoe.frontend.offload.llapor import LayerArch, LLaPor
from kubemoe.frontend.predictor_train import candidate_hit, row_hits, topk_accuracy
from kubemoe.frontend.records import RoutingRecords
from kubemoe.train import warmup_cosine

log = logging.getLogger(__name__)

SPARE_CANDIDATES = 2  # top-(K + 2): see the module docstring


@dataclass(frozen=True)
class GroupConfig:
    """A layer group's net and optimiser."""

    components: float  # PCA components as a share of the hidden size (less: stronger compression)
    width: int
    blocks: int  # gated residual blocks; 0: the shallow net
    dropout: float = 0.1
    lr: float = 3e-3
    weight_decay: float = 1e-2
    epochs: int = 12
    warmup: float = 0.05  # share of the steps
    floor: float = 0.05  # the cosine's end, as a share of lr

    def arch(self, group: str, hidden_size: int) -> LayerArch:
        return LayerArch(group, max(1, min(hidden_size, round(self.components * hidden_size))), self.width,
                         self.blocks, self.dropout)


OUTER = GroupConfig(components=0.125, width=128, blocks=0)  # input and output groups: shallow, strongly compressed
MIDDLE = GroupConfig(components=0.5, width=192, blocks=2, lr=2e-3, epochs=16)  # deeper, milder compression


@dataclass(frozen=True)
class LossConfig:
    focal_gamma: float = 2.0
    focal_weight: float = 1.0  # of the focal term beside the weighted BCE
    max_expert_weight: float = 10.0  # cap of the inverse-frequency weight (an expert seen once is not worth 1000)


@dataclass(frozen=True)
class LLaPorConfig:
    input: GroupConfig = OUTER
    middle: GroupConfig = MIDDLE
    output: GroupConfig = OUTER
    loss: LossConfig = LossConfig()
    batch: int = 512
    seed: int = 0
    device: str = "cpu"

    def group(self, name: str) -> GroupConfig:
        return getattr(self, name)


@dataclass(frozen=True)
class LayerRows:
    """One source layer's training rows."""

    hidden: torch.Tensor  # [N, H] float32
    experts: torch.Tensor  # [N, K]
    weights: torch.Tensor  # [N, K]
    true_next: torch.Tensor  # [N, K], the next MoE layer's experts

    def __len__(self) -> int:
        return len(self.true_next)

    def take(self, rows: torch.Tensor | slice) -> "LayerRows":
        return LayerRows(self.hidden[rows], self.experts[rows], self.weights[rows], self.true_next[rows])

    def then(self, newer: "LayerRows", keep: int) -> "LayerRows":
        """These rows followed by `newer`, only the last `keep` of them."""
        return LayerRows(*(torch.cat([a, b])[-keep:] for a, b in zip(self._fields(), newer._fields())))

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return self.hidden, self.experts, self.weights, self.true_next


def layer_rows(records: RoutingRecords, source: int, device: str | torch.device = "cpu") -> LayerRows:
    i = records.layer_index(source)
    return LayerRows(records.hidden[:, i].to(device, torch.float32), records.experts[:, i].to(device),
                     records.weights[:, i].to(device), records.experts[:, i + 1].to(device))


# -- loss --------------------------------------------------------------------------------------


def multi_hot(experts: torch.Tensor, num_experts: int) -> torch.Tensor:  # [N, K] -> [N, E]
    return torch.zeros(len(experts), num_experts, device=experts.device).scatter_(1, experts.long(), 1.0)


def inverse_frequency(experts: torch.Tensor, num_experts: int, cap: float) -> torch.Tensor:  # [N, K] -> [E]
    """An expert chosen as often as the average weighs 1; one never chosen weighs as if chosen once."""
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts).float()
    return (counts.mean() / counts.clamp_min(1.0)).clamp(max=cap)


def hybrid_loss(logits: torch.Tensor, target: torch.Tensor, expert_weight: torch.Tensor,
                config: LossConfig) -> torch.Tensor:  # [N, E], [N, E], [E] -> scalar
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, pos_weight=expert_weight)
    plain = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
    p = torch.sigmoid(logits)
    p_true = p * target + (1 - p) * (1 - target)  # the probability given to the right answer
    focal = ((1 - p_true) ** config.focal_gamma * plain).mean()
    return bce + config.focal_weight * focal


# -- metrics -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LLaPorScore:
    source: int
    target: int
    group: str
    accuracy: float  # top-k set accuracy
    candidate_hit: float  # share of the true experts within the top-(K + 2) candidates


@torch.no_grad()
def score_rows(predictor: LLaPor, source: int, rows: LayerRows) -> tuple[float, float]:
    """(top-k accuracy, candidate hit) of one layer's head on `rows`."""
    k = predictor.shape.top_k
    candidates = torch.cat([predictor.predict(source, *_inputs(rows.take(slice(i, i + 8192))),
                                              count=min(k + SPARE_CANDIDATES, predictor.shape.num_experts))[1]
                            for i in range(0, len(rows), 8192)])
    return topk_accuracy(candidates[:, :k], rows.true_next), candidate_hit(candidates, rows.true_next)


def evaluate_llapor(predictor: LLaPor, records: RoutingRecords, device: str = "cpu") -> list[LLaPorScore]:
    scores = []
    for source, target in predictor.pairs.items():
        accuracy, hit = score_rows(predictor, source, layer_rows(records, source, device))
        scores.append(LLaPorScore(source, target, predictor.group(source), accuracy, hit))
    return scores


def _inputs(rows: LayerRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rows.hidden, rows.experts, rows.weights


# -- offline training --------------------------------------------------------------------------


def _fit_head(predictor: LLaPor, source: int, train: LayerRows, held: LayerRows, group: GroupConfig,
              config: LLaPorConfig) -> dict:
    head = predictor.heads[source]
    target = multi_hot(train.true_next, predictor.shape.num_experts)
    gen = torch.Generator().manual_seed(config.seed + source)
    optimizer = torch.optim.AdamW(head.net.parameters(), lr=group.lr, weight_decay=group.weight_decay)
    steps_per_epoch = -(-len(train) // config.batch)
    total = group.epochs * steps_per_epoch
    warmup = max(1, round(group.warmup * total))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup, total, group.floor))
    best_accuracy, best_hit = score_rows(predictor, source, held)
    best_epoch, best_state = 0, copy.deepcopy(head.state_dict())
    for epoch in range(1, group.epochs + 1):
        head.train()
        order = torch.randperm(len(train), generator=gen).to(train.hidden.device)
        for i in range(0, len(train), config.batch):
            rows = order[i:i + config.batch]
            loss = hybrid_loss(head(*_inputs(train.take(rows))), target[rows], head.expert_weight, config.loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        head.eval()
        accuracy, hit = score_rows(predictor, source, held)
        if (hit, accuracy) > (best_hit, best_accuracy):  # the candidate hit is what prefetching lives on
            best_accuracy, best_hit, best_epoch, best_state = accuracy, hit, epoch, copy.deepcopy(head.state_dict())
    head.load_state_dict(best_state)
    return {"held_accuracy": round(best_accuracy, 4), "held_candidate_hit": round(best_hit, 4),
            "best_epoch": best_epoch, "epochs": group.epochs}


def train_llapor(train: RoutingRecords, held: RoutingRecords, config: LLaPorConfig = LLaPorConfig(),
                 groups: LayerGroups | None = None) -> LLaPor:
    """LLaPor for the model of `train`'s records; `held` judges each epoch. Groups: found from `train`."""
    shape = train.shape
    groups = groups or find_layer_groups(train.experts, shape.moe_layers, shape.num_experts)
    torch.manual_seed(config.seed)
    archs = {s: config.group(g).arch(g, shape.hidden_size) for s, g in zip(groups.sources, groups.groups)}
    predictor = LLaPor.build(shape, archs).to(config.device)
    layers, start = {}, time.perf_counter()
    for source in predictor.pairs:
        rows, held_rows = layer_rows(train, source, config.device), layer_rows(held, source, config.device)
        head = predictor.heads[source]
        head.pca.fit(rows.hidden)
        head.expert_weight.copy_(inverse_frequency(rows.true_next, shape.num_experts, config.loss.max_expert_weight))
        report = _fit_head(predictor, source, rows, held_rows, config.group(archs[source].group), config)
        layers[str(source)] = {"group": archs[source].group, **report}  # str: the report goes through JSON
        log.info("LLaPor layer %d (%s): held-out candidate hit %.3f", source, archs[source].group,
                 report["held_candidate_hit"])
    predictor.info = {"train_rows": len(train), "held_rows": len(held), "seconds": round(time.perf_counter() - start, 1),
                      "correlation": [round(c, 4) for c in groups.correlation], "layers": layers}
    return predictor.to("cpu")


# -- online fine-tuning ------------------------------------------------------------------------


@dataclass(frozen=True)
class OnlineConfig:
    window: int = 1024  # tokens per layer whose error is measured; also the least between two fine-tunings
    threshold: float = 0.10  # LayerScope: fine-tune when the windowed error exceeds 10%
    max_steps: int = 20  # per fine-tuning: bounded, so serving never stalls on it
    batch: int = 256
    lr: float = 1e-4
    loss: LossConfig = LossConfig()


@dataclass
class _Window:
    rows: LayerRows  # the last `window` rows: judged, and fine-tuned on
    hits: torch.Tensor  # [N]: per row, how many of its true experts were among the candidates

    def then(self, newer: "_Window", keep: int) -> "_Window":
        return _Window(self.rows.then(newer.rows, keep), torch.cat([self.hits, newer.hits])[-keep:])


class OnlineTuner:
    """Watches one LLaPor's predictions against the routing that followed; fine-tunes a layer when its
    error over the last `window` tokens exceeds `threshold`."""

    def __init__(self, predictor: LLaPor, config: OnlineConfig = OnlineConfig()):
        self.predictor, self.config = predictor, config
        self.tunes: dict[int, int] = {}  # source layer -> fine-tunings so far
        self._windows: dict[int, _Window] = {}
        self._optimizers: dict[int, torch.optim.Optimizer] = {}

    def error(self, source: int) -> float:
        """1 - candidate hit of layer `source` over its current window (0 before any rows)."""
        w = self._windows.get(source)
        return 1 - float(w.hits.sum()) / w.rows.true_next.numel() if w is not None and len(w.rows) else 0.0

    def observe(self, source: int, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                true_next: torch.Tensor) -> bool:
        """Add rows of layer `source` ([T, H], [T, K], [T, K]) with the experts the next layer chose ([T, K]);
        returns whether the layer was fine-tuned."""
        rows = LayerRows(hidden.float(), experts, weights, true_next)
        shape = self.predictor.shape
        candidates = self.predictor.predict(source, *_inputs(rows), count=min(shape.top_k + SPARE_CANDIDATES,
                                                                               shape.num_experts))[1]
        keep, earlier = self.config.window, self._windows.get(source)
        newer = _Window(rows.take(slice(-keep, None)), row_hits(candidates, true_next)[-keep:])
        window = self._windows[source] = earlier.then(newer, keep) if earlier else newer
        if len(window.rows) < self.config.window or self.error(source) <= self.config.threshold:
            return False
        self._finetune(source, window.rows)
        self.tunes[source] = self.tunes.get(source, 0) + 1
        del self._windows[source]  # judge the tuned head on rows it predicts from now on
        return True

    def _finetune(self, source: int, rows: LayerRows) -> None:
        head = self.predictor.heads[source]
        if source not in self._optimizers:  # kept across fine-tunings: Adam's moments carry on
            self._optimizers[source] = torch.optim.AdamW(head.net.parameters(), lr=self.config.lr)
        optimizer = self._optimizers[source]
        target = multi_hot(rows.true_next, self.predictor.shape.num_experts)
        gen = torch.Generator().manual_seed(self.tunes.get(source, 0))
        head.train()
        for _ in range(self.config.max_steps):
            pick = torch.randint(0, len(rows), (min(self.config.batch, len(rows)),), generator=gen).to(rows.hidden.device)
            loss = hybrid_loss(head(*_inputs(rows.take(pick))), target[pick], head.expert_weight, self.config.loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        head.eval()
        log.info("LLaPor layer %d fine-tuned online (%d steps)", source, self.config.max_steps)
