"""The load predictor while serving: predict layer l+d at layer l, score it when l+d routes, refresh it.

At each MoE layer the dispatcher shows its observers the router's input and choice (`on_layer`).
For a source layer, the predictor names the experts layer l+d will get; when layer l+d routes in
the same forward pass, the prediction is scored against what it chose. Nothing of this waits for
the GPU: per-expert counts and hits add up in device tensors, and every `flush_every` forward
passes (and whenever `/loads` is read) one flush brings them to the host, into the load report and
the metrics. Measured on an H200 (frontend_decode.py), reading them back at every layer cost 10-30%
of decode throughput. A decode pass replayed as a CUDA graph captures this device work with the
pass (`observe_rows`: counted over the program's real rows only); what needs the host runs after
the replay, given the number of real rows.

A bounded online refresh keeps a fine-tunable predictor current: each layer keeps its last
`buffer_rows` (hidden, true experts) pairs in a ring on the predictor's device, and when a layer's
accuracy over the last window falls below the threshold, a background thread fine-tunes a copy of
its head on them for a few steps and swaps it in only if it scores better on the newest rows. Rows,
steps and refreshes are capped. Shapes: T = tokens, H = hidden size, E = experts, K = experts per token.
"""

from __future__ import annotations

import copy
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from kubemoe.frontend.predictor import LoadPredictor
from kubemoe.frontend.predictor_train import topk_accuracy
from kubemoe.frontend.tally import count_rows, drain

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefreshConfig:
    threshold: float = 0.8  # a layer below this accuracy over `window_tokens` is refreshed
    window_tokens: int = 2048
    buffer_rows: int = 1024  # per layer, newest kept, on the predictor's device in the hidden state's dtype
    keep_every: int = 8  # passes: rows are kept from one pass in this many (each keep is ~4 copies per layer)
    steps: int = 50  # gradient steps per refresh
    lr: float = 5e-4
    max_refreshes: int = 100  # per layer over the frontend's life
    max_backoff_windows: int = 64  # after refreshes that did not help, windows to wait at most before the next


class _Layer:
    """One predicted layer's serving state: its row of the device tallies, its window's score, and a
    ring of recent (hidden, experts) rows for refreshes."""

    def __init__(self, source: int, row: int):
        self.source, self.row = source, row  # row: of OnlinePredictor's device tallies
        self.tokens = self.choices = 0  # known on the host without reading the device
        self.window_hits = self.window_choices = 0
        # ring of rows ([R, H] hidden, [R, K] experts), made at the first row kept (its width and dtype come with it)
        self.ring: tuple[torch.Tensor, torch.Tensor] | None = None
        self.filled = self.next = 0
        self.refreshes = 0
        self.busy = False
        # Windows to let pass before the next refresh, doubled by each refresh that did not help (a layer
        # the head cannot learn would otherwise retrain every window, taking the GPU and the GIL from serving)
        self.wait = self.backoff = 0

    def keep(self, hidden: torch.Tensor, experts: torch.Tensor, capacity: int, max_rows: int = 64) -> None:
        """Keep at most `max_rows` rows of a pass (a prefill would otherwise flush the ring at once);
        device-to-device copies in at most two slices around the ring's end."""
        if self.ring is None:
            self.ring = (hidden.new_empty(capacity, hidden.shape[1]), experts.new_zeros(capacity, experts.shape[1]))
        ring_hidden, ring_experts = self.ring
        rows = min(max_rows, len(hidden), capacity)
        hidden, experts = hidden[-rows:], experts[-rows:]
        first = min(rows, capacity - self.next)
        ring_hidden[self.next:self.next + first] = hidden[:first]
        ring_experts[self.next:self.next + first] = experts[:first]
        if rows > first:
            ring_hidden[:rows - first] = hidden[first:]
            ring_experts[:rows - first] = experts[first:]
        self.next = (self.next + rows) % capacity
        self.filled = min(capacity, self.filled + rows)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept rows, oldest first (copies: the ring goes on filling)."""
        if self.ring is None:
            raise RuntimeError("no rows kept yet: a refresh needs rows (keep() first)")
        hidden, experts = self.ring
        if self.filled < len(hidden):
            return hidden[:self.filled].clone(), experts[:self.filled].clone()
        return (torch.cat([hidden[self.next:], hidden[:self.next]]),
                torch.cat([experts[self.next:], experts[:self.next]]))


class OnlinePredictor:
    """Runs a LoadPredictor beside the dispatcher; records predicted loads and accuracy in `loads`."""

    def __init__(self, predictor: LoadPredictor, loads, metrics=None, refresh: RefreshConfig | None = RefreshConfig(),
                 device: str | torch.device = "cpu", flush_every: int = 32):
        self.predictor = predictor.to(device)
        self.loads, self.metrics, self.refresh, self.flush_every = loads, metrics, refresh, flush_every
        loads.predictor, loads.prediction_distance = predictor.kind, predictor.distance
        loads.before_report.append(self.flush)  # /loads is always current
        self._pending = threading.local()  # per forward pass: {target: (predicted [T, K], hidden [T, H])}
        self._layers = {t: _Layer(s, row) for row, (t, s) in enumerate(sorted(predictor.targets.items()))}
        # [Lt, E + 1] int64: predicted tokens per expert of each target layer, then its hits. Made once, on
        # the predictor's device: a decode pass captured as a CUDA graph adds into it by address.
        self._tallies = torch.zeros(len(self._layers), predictor.shape.num_experts + 1, dtype=torch.int64,
                                    device=device)
        self._lock = threading.Lock()  # tallies (flushed from the thread that reads /loads) and head updates
        self._passes = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kubemoe-predictor") if refresh else None

    def on_layer(self, layer: int, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> None:
        self.observe_rows(layer, hidden, experts, None)(len(hidden))

    def observe_rows(self, layer: int, hidden: torch.Tensor, experts: torch.Tensor,
                     rows: torch.Tensor | None) -> Callable[[int], None]:
        """Layer `layer`'s device work over the first `rows` rows (an int32 device scalar; None: every
        row) without waiting for the device, so that a CUDA graph can capture it: predict the target
        layer and count the prediction, score the prediction made for this layer. Returns the host's
        part, to run with the number of real rows once the pass is done (after each replay)."""
        # {target: (predicted [T, K], hidden [T, H])} of this thread's forward pass
        pending: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = getattr(self._pending, "by_target", None)
        if pending is None or layer == self.predictor.shape.moe_layers[0]:
            pending = self._pending.by_target = {}
            self._pending.predicted = {}
        scored = predicted_for = None
        if layer in pending:
            predicted, source_hidden = pending.pop(layer)
            scored = self._layers[layer]
            count_rows(predicted, rows, against=experts, hits=self._tallies[scored.row, -1])
        if layer in self.predictor.pairs:
            with self._lock:  # a refresh may be updating this layer's head
                target, predicted = self.predictor.predict(layer, hidden)
                predicted_for = self._layers[target]
                count_rows(predicted, rows, self._tallies[predicted_for.row, :-1])
            self._pending.predicted[target] = predicted
            pending[target] = (predicted, hidden)
        last = layer == self.predictor.shape.moe_layers[-1]

        def host(real: int) -> None:
            with self._lock:
                if scored is not None:
                    scored.choices += real * experts.shape[1]
                    if self.refresh and self._passes % self.refresh.keep_every == 0:
                        scored.keep(source_hidden[:real], experts[:real], self.refresh.buffer_rows)
                if predicted_for is not None:
                    predicted_for.tokens += real
                if not last:
                    return
                self._passes += 1
                due = self._passes % self.flush_every == 0
            if due:
                self.flush()

        return host

    def predicted_counts(self, layer: int) -> list[int] | None:
        """This forward pass's predicted tokens per expert of `layer`, made d layers earlier on this
        thread (the dispatcher splits hot experts by it); None where nothing predicts the layer.
        Reading it waits for the GPU: the dispatcher asks only where a bundle has several replicas."""
        predicted = getattr(self._pending, "predicted", {}).get(layer)
        if predicted is None:
            return None
        return torch.bincount(predicted.reshape(-1), minlength=self.predictor.shape.num_experts).tolist()

    def flush(self) -> None:
        """Bring the tallies since the last flush to the host: load report, metrics, window scores, refreshes."""
        with self._lock:
            drained = drain(self._tallies)  # [Lt, E + 1]
            tallies = []
            for target, state in self._layers.items():
                if state.tokens or state.choices:
                    row = drained[state.row]
                    tallies.append((target, state, row[:-1], row[-1], state.tokens, state.choices))
                    state.tokens = state.choices = 0
        window = (self.refresh or RefreshConfig()).window_tokens * self.predictor.shape.top_k
        for target, state, counts, got, tokens, choices in tallies:
            self.loads.record_predicted(target, state.source, counts, tokens)
            if choices:
                self.loads.record_accuracy(target, state.source, got, choices)
            if self.metrics:
                self.metrics.record_expert_tokens(target, list(enumerate(counts)), predicted=True)
            state.window_hits += got
            state.window_choices += choices
            if state.window_choices >= window:
                self._judge_window(target, state)

    def _judge_window(self, target: int, state: _Layer) -> None:
        accuracy = state.window_hits / state.window_choices
        state.window_hits = state.window_choices = 0
        if self.metrics:
            self.metrics.record_predictor_accuracy(target, accuracy)
        refresh = self.refresh
        if refresh is None or self._pool is None:  # refreshes are off
            return
        if state.wait:  # the last refresh did not help: the next one waits longer
            state.wait -= 1
            return
        if accuracy < refresh.threshold and not state.busy \
                and state.refreshes < refresh.max_refreshes and state.filled >= refresh.buffer_rows // 2:
            state.busy = True
            state.refreshes += 1
            with self._lock:
                rows = state.rows()
            self._pool.submit(self._refresh, target, *rows, accuracy, refresh)

    def _refresh(self, target: int, hidden: torch.Tensor, true: torch.Tensor, accuracy: float,
                 refresh: RefreshConfig) -> None:
        state = self._layers[target]
        try:
            with self._lock:
                serving = self.predictor.heads[target]
                head = copy.deepcopy(serving)
            device = next(head.parameters()).device
            # copies outside inference mode (the ring's rows were taken inside it), in float32 to train on
            hidden, true = hidden.to(device, torch.float32).clone(), true.to(device).clone()
            cut = int(len(hidden) * 0.8)  # train on the older rows, judge on the newest
            soft = torch.zeros(cut, self.predictor.shape.num_experts, device=device)
            soft.scatter_(1, true[:cut], 1.0 / true.shape[1])
            optimizer = torch.optim.AdamW(head.parameters(), lr=refresh.lr)
            for _ in range(refresh.steps):
                loss = -(soft * torch.log_softmax(head(hidden[:cut]), -1)).sum(-1).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            with torch.no_grad():
                old = topk_accuracy(self.predictor.experts_from_logits(target, serving(hidden[cut:])), true[cut:])
                new = topk_accuracy(self.predictor.experts_from_logits(target, head(hidden[cut:])), true[cut:])
            if new > old:
                # copied into the serving head, not swapped for it: a decode pass captured as a CUDA
                # graph reads the serving head's weights by address
                with self._lock, torch.no_grad():
                    for mine, better in zip(serving.parameters(), head.parameters()):
                        mine.copy_(better)
                if self.metrics:
                    self.metrics.record_predictor_refresh(target)
            state.backoff = 0 if new > old else min(2 * state.backoff or 1, refresh.max_backoff_windows)
            state.wait = state.backoff
            log.info("predictor layer %d refreshed online: accuracy %.3f over the window; %.3f -> %.3f on the "
                     "newest rows (%s)", target, accuracy, old, new, "kept" if new > old else "discarded")
        except Exception:  # noqa: BLE001 - a failed refresh leaves the serving predictor as it was
            log.exception("predictor refresh of layer %d failed; the previous head keeps serving", target)
        finally:
            state.busy = False

    def close(self) -> None:
        self.flush()
        if self._pool:
            self._pool.shutdown(wait=False, cancel_futures=True)
