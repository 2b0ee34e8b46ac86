"""Routed tokens per expert, counted on the device and read by the host once per flush.

The in-process path of a layer never waits for the GPU (dispatch.py); counting its tokens per
expert on the host would. Each layer's counts add up in a device tensor instead, and a flush (every
`flush_every` steps, and before every load report or metrics scrape) reads them all in one copy and
hands them to the load recorder and the metrics. Shapes: L = layers counted, E = experts.
"""

from __future__ import annotations

import threading

import torch


class DeviceTally:
    def __init__(self, num_experts: int, record, flush_every: int = 32):
        self.num_experts, self.flush_every = num_experts, flush_every
        self._record = record  # callable(layer, [(expert, tokens)]) run at each flush with that layer's counts
        self._counts: dict[int, torch.Tensor] = {}  # layer -> [E] int64 on the device
        self._lock = threading.Lock()  # adds run on the engine's threads, flushes also on the HTTP thread
        self._steps = 0

    def add(self, layer: int, counts: torch.Tensor) -> None:  # [E]
        with self._lock:
            mine = self._counts.get(layer)
            if mine is None:
                self._counts[layer] = counts.clone()
            else:
                mine += counts

    def step(self) -> None:
        """One engine step ended: flush every `flush_every` steps."""
        self._steps += 1
        if self._steps % self.flush_every == 0:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if not self._counts:
                return
            layers = sorted(self._counts)
            counts = torch.stack([self._counts[layer] for layer in layers]).tolist()  # [L, E]: the one read
            self._counts.clear()
        for layer, row in zip(layers, counts):
            self._record(layer, [(e, n) for e, n in enumerate(row) if n])
