"""Iteration-level (continuous) batching decisions. Pure: no model, no tensors, no threads.

Each engine step decodes every running sequence and admits waiting ones up to the batch limit
(their prefill runs in the same step, so they decode from the next one). Finished and aborted
sequences leave between steps. A bounded waiting queue refuses new work when full.

The KV cache is bounded (`kv_capacity`, in token positions of the padded batch: sequences x the
longest one, as `batch.BatchState` lays them out). A sequence is admitted only if the batch with
it still fits, in queue order (a long prompt is not overtaken for ever). When the running batch
would outgrow the cache at this step, the latest admitted sequences are preempted: they leave the
batch, keep what they generated and go back to the head of the queue, to be prefilled again
(prompt + generated: recompute) when there is room. A sequence is never preempted alone: a lone
sequence's generation is capped at admission to what the cache can hold.
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
    preempted: list = field(default_factory=list)  # left the batch for lack of cache, back in the queue
    rejected: list = field(default_factory=list)  # can never fit the cache: they end with an error

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill or self.preempted or self.rejected)


def cached_tokens(seqs) -> int:
    """Cache positions `seqs` take in one left-padded batch once this step has run: each needs
    its prompt and everything generated (`context_length`), and the batch pads to the longest."""
    return len(seqs) * max((s.context_length for s in seqs), default=0)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque = deque()
        self.running: list = []
        self.kv_capacity: int | None = None  # cache positions; None: unbounded
        # A bounded cache whose bytes per position are not known yet (measured on the first prefill):
        # one sequence at a time until then.
        self.measuring = False
        self.preemptions = 0

    def add(self, seq) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting; retry later")
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        running, preempted, rejected = list(self.running), [], []
        cap = self.kv_capacity
        if cap is not None:
            while len(running) > 1 and cached_tokens(running) > cap:
                preempted.append(running.pop())  # the latest admitted first
        room = min(self.config.max_batch - len(running), self.config.max_prefills_per_step)
        if self.measuring:
            room = min(room, 0 if running else 1)
        admitted = []
        while self.waiting and len(admitted) < room and not preempted:
            seq = self.waiting[0]
            if cap is not None and seq.context_length >= cap:  # not even alone, with one token to generate
                rejected.append(self.waiting.popleft())
                continue
            if cap is not None and cached_tokens(running + admitted + [seq]) > cap:
                break
            admitted.append(self.waiting.popleft())
        self.waiting.extendleft(reversed(preempted))
        self.running = running + admitted
        self.preemptions += len(preempted)
        return StepPlan(decode=running, prefill=admitted, preempted=preempted, rejected=rejected)

    def remove(self, seqs) -> None:
        """Finished, aborted or failed sequences leave the batch (or the queue)."""
        gone = {id(s) for s in seqs}
        self.running = [s for s in self.running if id(s) not in gone]
        self.waiting = deque(s for s in self.waiting if id(s) not in gone)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting
