"""The load predictor while serving: predict layer l+d at layer l, score it when l+d routes, refresh it.

At each MoE layer the dispatcher shows its observers the router's input and choice (`on_layer`).
For a source layer, the predictor names the experts layer l+d will get and records their counts
as predicted loads; when layer l+d routes in the same forward pass, the prediction is scored
against what it chose. The prediction costs one [T, H] x [H, E] product per layer, computed
before the layer's expert calls go out (on a GPU it is queued behind the router, nothing waits).

A bounded online refresh keeps a fine-tunable predictor current: each layer keeps its last
`buffer_rows` (hidden, true experts) pairs, and when a layer's accuracy over the last window falls
below the threshold, a background thread fine-tunes a copy of its head on them for a few steps and
swaps it in only if it scores better on the newest rows. Rows, steps and refreshes are capped.
Shapes: T = tokens, H = hidden size, E = experts, K = experts per token.
"""

from __future__ import annotations

import copy
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kubemoe.frontend.predictor import LoadPredictor
from kubemoe.frontend.predictor_train import hits, topk_accuracy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefreshConfig:
    threshold: float = 0.8  # a layer below this accuracy over `window_tokens` is refreshed
    window_tokens: int = 2048
    buffer_rows: int = 4096  # per layer, newest kept
    steps: int = 50  # gradient steps per refresh
    lr: float = 5e-4
    max_refreshes: int = 100  # per layer over the frontend's life


class _Layer:
    """One predicted layer's serving state: its window's score and a ring of recent (hidden, experts) rows."""

    def __init__(self, config: RefreshConfig, hidden_size: int, top_k: int):
        self.hidden = torch.empty(config.buffer_rows, hidden_size)
        self.experts = torch.zeros(config.buffer_rows, top_k, dtype=torch.int64)
        self.filled = self.next = 0
        self.window_hits = self.window_choices = 0
        self.refreshes = 0
        self.busy = False

    def keep(self, hidden: torch.Tensor, experts: torch.Tensor, max_rows: int = 64) -> None:
        """Keep at most `max_rows` rows of a pass (a prefill would otherwise flush the ring at once)."""
        rows = min(max_rows, len(hidden), len(self.hidden))
        at = (self.next + torch.arange(rows)) % len(self.hidden)
        self.hidden[at] = hidden[-rows:].detach().float().cpu()
        self.experts[at] = experts[-rows:].detach().cpu()
        self.next = int(at[-1] + 1) % len(self.hidden)
        self.filled = min(len(self.hidden), self.filled + rows)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept rows, oldest first."""
        if self.filled < len(self.hidden):
            return self.hidden[:self.filled].clone(), self.experts[:self.filled].clone()
        order = (self.next + torch.arange(len(self.hidden))) % len(self.hidden)
        return self.hidden[order], self.experts[order]


class OnlinePredictor:
    """Runs a LoadPredictor beside the dispatcher; records predicted loads and accuracy in `loads`."""

    def __init__(self, predictor: LoadPredictor, loads, metrics=None, refresh: RefreshConfig | None = RefreshConfig(),
                 device: str | torch.device = "cpu"):
        self.predictor = predictor.to(device)
        self.loads, self.metrics, self.refresh = loads, metrics, refresh
        loads.predictor, loads.prediction_distance = predictor.kind, predictor.distance
        self._pending = threading.local()  # {target: (source, predicted [T, K], hidden [T, H])} per forward pass
        self._layers = {t: _Layer(refresh or RefreshConfig(), predictor.shape.hidden_size, predictor.shape.top_k)
                        for t in predictor.targets}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kubemoe-predictor") if refresh else None

    def on_layer(self, layer: int, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> None:
        pending = getattr(self._pending, "by_target", None)
        if pending is None or layer == self.predictor.shape.moe_layers[0]:
            pending = self._pending.by_target = {}
            self._pending.counts = {}
        if layer in pending:
            self._score(layer, *pending.pop(layer), experts)
        if layer in self.predictor.pairs:
            with self._lock:  # a refresh may be swapping this layer's head
                target, predicted = self.predictor.predict(layer, hidden)
            counts = torch.bincount(predicted.reshape(-1), minlength=self.predictor.shape.num_experts)
            counts = counts.tolist()
            self._pending.counts[target] = counts
            self.loads.record_predicted(target, layer, counts, predicted.shape[0])
            if self.metrics:
                self.metrics.record_expert_tokens(target, list(enumerate(counts)), predicted=True)
            pending[target] = (layer, predicted, hidden)

    def predicted_counts(self, layer: int) -> list[int] | None:
        """This forward pass's predicted tokens per expert of `layer`, made d layers earlier on this
        thread (the dispatcher splits hot experts by it); None where nothing predicts the layer."""
        return getattr(self._pending, "counts", {}).get(layer)

    def _score(self, target: int, source: int, predicted: torch.Tensor, hidden: torch.Tensor, true: torch.Tensor) -> None:
        got = int(hits(predicted, true))
        self.loads.record_accuracy(target, source, got, true.numel())
        state = self._layers[target]
        state.window_hits += got
        state.window_choices += true.numel()
        if self.refresh:
            state.keep(hidden, true)
        if state.window_choices < (self.refresh or RefreshConfig()).window_tokens * true.shape[1]:
            return
        accuracy = state.window_hits / state.window_choices
        state.window_hits = state.window_choices = 0
        if self.metrics:
            self.metrics.record_predictor_accuracy(target, accuracy)
        if self._pool and accuracy < self.refresh.threshold and not state.busy \
                and state.refreshes < self.refresh.max_refreshes and state.filled >= self.refresh.buffer_rows // 2:
            state.busy = True
            state.refreshes += 1
            self._pool.submit(self._refresh, target, *state.rows(), accuracy)

    def _refresh(self, target: int, hidden: torch.Tensor, true: torch.Tensor, accuracy: float) -> None:
        state = self._layers[target]
        try:
            with self._lock:
                serving = self.predictor.heads[target]
                head = copy.deepcopy(serving)
            device = next(head.parameters()).device
            hidden, true = hidden.to(device).clone(), true.to(device).clone()  # not inference tensors: trained on
            cut = int(len(hidden) * 0.8)  # train on the older rows, judge on the newest
            soft = torch.zeros(cut, self.predictor.shape.num_experts, device=device)
            soft.scatter_(1, true[:cut], 1.0 / true.shape[1])
            optimizer = torch.optim.AdamW(head.parameters(), lr=self.refresh.lr)
            for _ in range(self.refresh.steps):
                loss = -(soft * torch.log_softmax(head(hidden[:cut]), -1)).sum(-1).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            with torch.no_grad():
                old = topk_accuracy(self.predictor.experts_from_logits(target, serving(hidden[cut:])), true[cut:])
                new = topk_accuracy(self.predictor.experts_from_logits(target, head(hidden[cut:])), true[cut:])
            if new > old:
                with self._lock:
                    self.predictor.heads[target] = head
                if self.metrics:
                    self.metrics.record_predictor_refresh(target)
            log.info("predictor layer %d refreshed online: accuracy %.3f over the window; %.3f -> %.3f on the "
                     "newest rows (%s)", target, accuracy, old, new, "kept" if new > old else "discarded")
        except Exception:  # noqa: BLE001 - a failed refresh leaves the serving predictor as it was
            log.exception("predictor refresh of layer %d failed; the previous head keeps serving", target)
        finally:
            state.busy = False

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown(wait=False, cancel_futures=True)
