"""Expert loads per window, observed and predicted, for the operator's planner.

The dispatcher records every routed token; the load predictor (`prediction.py`) records the tokens
per expert it predicted each layer would get and, once that layer has routed, how many of the
tokens' true experts it named. Windows roll over every `window_seconds`. `/loads` serves the last
complete window (or the current one before the first completes) as a `kubemoe.v1.LoadReport`,
whose rates the operator turns into replicas.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from kubemoe.frontend.offload.stats import COUNTS, OffloadStats
from kubemoe.proto import kubemoe_pb2 as pb


class LoadRecorder:
    def __init__(self, model: str, frontend: str, window_seconds: float = 30.0, clock=time.time):
        if window_seconds <= 0:
            raise ValueError("window_seconds must be positive")
        self.model, self.frontend, self.window_seconds, self._clock = model, frontend, window_seconds, clock
        self._lock = threading.Lock()
        self._start = clock()
        self._current: Counter = Counter()
        self._predicted: Counter = Counter()
        self._scores: dict[int, list[int]] = {}  # layer -> [source layer, tokens, hits, true choices]
        self._tokens = self._passes = 0
        self._last: pb.LoadReport | None = None
        self.predictor, self.prediction_distance = "", 0  # what predicts, set by the frontend
        self.offload_policy = ""  # set by a frontend in offload mode: the report then carries its counts
        self._offload = OffloadStats()
        # Run before each report (and metrics scrape): device-side tallies (dispatcher, predictor) flush into it.
        self.before_report: list = []

    def record(self, layer: int, expert_counts: list[tuple[int, int]]) -> None:
        with self._lock:
            self._roll()
            for expert, count in expert_counts:
                self._current[(layer, expert)] += count

    def record_predicted(self, layer: int, source: int, counts: list[int], tokens: int) -> None:
        """`counts[e]` of `tokens` tokens predicted for expert e of `layer`, from the hidden state at `source`."""
        with self._lock:
            self._roll()
            for expert, count in enumerate(counts):
                if count:
                    self._predicted[(layer, expert)] += count
            self._score(layer, source)[1] += tokens

    def record_accuracy(self, layer: int, source: int, hits: int, choices: int) -> None:
        """Of the `choices` (token, expert) pairs `layer` routed, `hits` had been predicted."""
        with self._lock:
            self._roll()
            score = self._score(layer, source)
            score[2] += hits
            score[3] += choices

    def record_offload(self, stats) -> None:
        """One MoE layer's `offload.executor.OffloadStats`."""
        with self._lock:
            self._roll()
            self._offload.add(stats)

    def _score(self, layer: int, source: int) -> list[int]:
        return self._scores.setdefault(layer, [source, 0, 0, 0])

    def record_tokens(self, count: int) -> None:
        """One forward pass (a decode step, a prefill chunk) of `count` tokens (each counted once, not once
        per layer)."""
        with self._lock:
            self._roll()
            self._tokens += count
            self._passes += 1

    def refresh(self) -> None:
        """Bring in the counts still held on the device (a report or a metrics scrape is about to be read)."""
        for flush in self.before_report:
            flush()

    def report(self) -> pb.LoadReport:
        self.refresh()
        with self._lock:
            self._roll()
            if self._last is not None:
                return self._last
            return self._build(self._clock() - self._start)

    def _roll(self) -> None:
        now = self._clock()
        if now - self._start >= self.window_seconds:
            self._last = self._build(self.window_seconds)
            self._start, self._current, self._predicted, self._scores = now, Counter(), Counter(), {}
            self._tokens = self._passes = 0
            self._offload = OffloadStats()

    def _build(self, seconds: float) -> pb.LoadReport:
        seconds = max(seconds, 1e-9)
        return pb.LoadReport(
            model=self.model, frontend=self.frontend, window_start=self._start, window_seconds=seconds,
            tokens=self._tokens, passes=self._passes,
            loads=[pb.ExpertLoad(layer=l, expert=e, tokens=self._current[(l, e)],
                                 tokens_per_second=self._current[(l, e)] / seconds,
                                 predicted_tokens=self._predicted[(l, e)],
                                 predicted_tokens_per_second=self._predicted[(l, e)] / seconds)
                   for l, e in sorted(self._current.keys() | self._predicted.keys())],
            predictions=[pb.LayerPrediction(layer=l, source_layer=s, tokens=t, accuracy=h / c if c else 0.0)
                         for l, (s, t, h, c) in sorted(self._scores.items())],
            predictor=self.predictor, prediction_distance=self.prediction_distance,
            offload=self._offload_report() if self.offload_policy else None,
        )

    def _offload_report(self) -> pb.OffloadStats:
        s = self._offload
        return pb.OffloadStats(**{name: getattr(s, name) for name in COUNTS},
                               policy=self.offload_policy, hit_rate=s.hit_rate, prefetch_accuracy=s.prefetch_accuracy,
                               cpu_share=s.cpu_share)
