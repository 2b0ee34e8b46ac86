"""Iteration-level (continuous) batching decisions. Pure: no model, no tensors, no threads.

Each engine step decodes every running sequence and admits waiting ones up to the batch limit
(their prefill runs in the same step, so they decode from the next one). Finished and aborted
sequences leave between steps. A bounded waiting queue refuses new work when full.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class QueueFull(Exception):
    """The waiting queue is full: retry later (HTTP 429, gRPC RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 32  # sequences decoded together in one step
    max_waiting: int = 256  # requests queued beyond the running batch
    max_prefills_per_step: int = 4  # bounds how long one step can stall the running batch

    def __post_init__(self) -> None:
        if min(self.max_batch, self.max_waiting, self.max_prefills_per_step) < 1:
            raise ValueError("scheduler limits must be >= 1")


@dataclass(frozen=True)
class StepPlan:
    decode: list = field(default_factory=list)  # running sequences, in batch order
    prefill: list = field(default_factory=list)  # admitted this step

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque = deque()
        self.running: list = []

    def add(self, seq) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting; retry later")
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        room = min(self.config.max_batch - len(self.running), self.config.max_prefills_per_step)
        admitted = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        plan = StepPlan(decode=list(self.running), prefill=admitted)
        self.running.extend(admitted)
        return plan

    def remove(self, seqs) -> None:
        """Finished, aborted or failed sequences leave the batch (or the queue)."""
        gone = {id(s) for s in seqs}
        self.running = [s for s in self.running if id(s) not in gone]
        self.waiting = deque(s for s in self.waiting if id(s) not in gone)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting
