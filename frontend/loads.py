"""Observed expert loads: tokens per (layer, expert) per window, for the operator's planner.

The dispatcher records every routed token; windows roll over every `window_seconds`. `/loads`
serves the last complete window (or the current one before the first completes) as a
`kubemoe.v1.LoadReport`, whose rates the operator turns into replica counts.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from kubemoe.proto import kubemoe_pb2 as pb


class LoadRecorder:
    def __init__(self, model: str, frontend: str, window_seconds: float = 30.0, clock=time.time):
        if window_seconds <= 0:
            raise ValueError("window_seconds must be positive")
        self.model, self.frontend, self.window_seconds, self._clock = model, frontend, window_seconds, clock
        self._lock = threading.Lock()
        self._start = clock()
        self._current: Counter = Counter()
        self._tokens = 0
        self._last: pb.LoadReport | None = None

    def record(self, layer: int, expert_counts: list[tuple[int, int]]) -> None:
        with self._lock:
            self._roll()
            for expert, count in expert_counts:
                self._current[(layer, expert)] += count

    def record_tokens(self, count: int) -> None:
        """Tokens that went through the model (each counted once, not once per layer)."""
        with self._lock:
            self._roll()
            self._tokens += count

    def report(self) -> pb.LoadReport:
        with self._lock:
            self._roll()
            if self._last is not None:
                return self._last
            return self._build(self._clock() - self._start)

    def _roll(self) -> None:
        now = self._clock()
        if now - self._start >= self.window_seconds:
            self._last = self._build(self.window_seconds)
            self._start, self._current, self._tokens = now, Counter(), 0

    def _build(self, seconds: float) -> pb.LoadReport:
        seconds = max(seconds, 1e-9)
        return pb.LoadReport(
            model=self.model, frontend=self.frontend, window_start=self._start, window_seconds=seconds,
            tokens=self._tokens,
            loads=[pb.ExpertLoad(layer=l, expert=e, tokens=n, tokens_per_second=n / seconds)
                   for (l, e), n in sorted(self._current.items())],
        )
