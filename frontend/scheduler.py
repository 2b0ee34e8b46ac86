"""Iteration-level (continuous) batching decisions. Pure: no model, no tensors, no threads.

Each engine step computes at most `max_step_tokens` tokens: one decode token for every running
sequence, and prompt chunks in what is left (chunked prefill). A prompt longer than what is left
is split: its first chunk runs now, the rest in the next steps, so a long prompt never stalls the
running batch for more than one step's budget. Sequences part-way through their prefill continue
first (in admission order), then waiting ones are admitted up to the batch limit. A sequence whose
last chunk runs in a step samples its first token there and decodes from the next step. Finished
and aborted sequences leave between steps. A bounded waiting queue refuses new work when full.

Only a step's last chunk can stop short of its context's end, so at most one sequence is part-way
through its prefill at any time. How chunks run is the engine's choice; `chunk_groups` says which
share rows of one shape in a forward pass (in practice prompts of one length that each fit the step whole).

The KV cache is bounded (`kv_capacity`, in token positions of the padded batch: sequences x the
longest one, as `batch.BatchState` lays them out; a sequence being prefilled reserves its whole
context from admission). A sequence is admitted only if the batch with it still fits, in queue
order (a long prompt is not overtaken for ever). When the batch would outgrow the cache at this
step, the latest admitted sequences are preempted (those still being prefilled first): they leave
the batch, keep what they generated and go back to the head of the queue, to be prefilled again
(prompt + generated: recompute) when there is room. A sequence is never preempted alone: a lone
sequence's generation is capped at admission to what the cache can hold.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Iterable, Protocol, TypeVar

# Step budgets where none is given: 2048 on a GPU (vLLM's chunked-prefill default; a forward of that
# many tokens is still short next to a request's decode); on a CPU every token costs, so a smaller one
# keeps the running batch's pace.
DEFAULT_STEP_TOKENS = {"cuda": 2048, "cpu": 256}


class Schedulable(Protocol):
    """What the scheduler reads of a sequence; the engine's `Sequence`, a test's factory."""

    @property
    def context_length(self) -> int:  # tokens its cache holds once this step has run: prompt + generated
        ...


S = TypeVar("S", bound=Schedulable)


class QueueFull(Exception):
    """The waiting queue is full: retry later (HTTP 429, gRPC RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 32  # sequences decoded together in one step
    max_waiting: int = 256  # requests queued beyond the running batch
    max_step_tokens: int = 2048  # tokens one step computes: decode tokens first, prompt chunks in the rest

    def __post_init__(self) -> None:
        if min(self.max_batch, self.max_waiting, self.max_step_tokens) < 1:
            raise ValueError("scheduler limits must be >= 1")


@dataclass(frozen=True)
class Chunk(Generic[S]):
    """Tokens [start, stop) of a sequence's context (prompt + generated) prefilled in this step."""

    seq: S
    start: int
    stop: int

    @property
    def tokens(self) -> int:
        return self.stop - self.start

    @property
    def last(self) -> bool:
        """The prefill ends with this chunk: the sequence samples its first token from it."""
        return self.stop == self.seq.context_length


@dataclass(frozen=True)
class StepPlan(Generic[S]):
    decode: list[S] = field(default_factory=list)  # running sequences, in batch order
    chunks: list[Chunk[S]] = field(default_factory=list)  # prompt chunks of this step, continued ones first
    preempted: list[S] = field(default_factory=list)  # left the batch for lack of cache, back in the queue
    rejected: list[S] = field(default_factory=list)  # can never fit the cache: they end with an error

    @property
    def prefill(self) -> list[S]:
        """Sequences with a prompt chunk in this step."""
        return [c.seq for c in self.chunks]

    @property
    def empty(self) -> bool:
        return not (self.decode or self.chunks or self.preempted or self.rejected)


def cached_tokens(seqs: list[S]) -> int:
    """Cache positions `seqs` take in the running batch's rows once this step has run: each needs
    its prompt and everything generated (`context_length`), and every row spans as many columns as
    the longest (batch.py)."""
    return len(seqs) * max((s.context_length for s in seqs), default=0)


def chunk_groups(chunks: list[Chunk[S]]) -> list[list[Chunk[S]]]:
    """Chunks whose rows stack into one [rows, length] block of a forward pass: the same start and
    length, so no row needs padding (a padded row would run through attention and the experts for
    nothing). In plan order."""
    groups: dict[tuple[int, int], list[Chunk[S]]] = {}
    for chunk in chunks:
        groups.setdefault((chunk.start, chunk.stop), []).append(chunk)
    return list(groups.values())


class Scheduler(Generic[S]):
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[S] = deque()
        self.running: list[S] = []  # decoding, in batch order
        self.prefilling: list[S] = []  # admitted, prompt not all prefilled yet, in admission order
        self._prefilled: dict[int, int] = {}  # id(seq) -> context tokens prefilled so far
        self.kv_capacity: int | None = None  # cache positions; None: unbounded
        # A bounded cache whose bytes per position are not known yet (measured on the first prefill):
        # one sequence at a time until then.
        self.measuring = False
        self.preemptions = 0

    def add(self, seq: S) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting; retry later")
        self.waiting.append(seq)

    def prefilled(self, seq: S) -> int:
        """Context tokens of a sequence being prefilled that are in its cache."""
        return self._prefilled.get(id(seq), 0)

    def has_prefill(self) -> bool:
        """Whether the next step would prefill: a prompt part-way, or one waiting with a batch slot free
        (the cache's bound may still hold it back)."""
        return bool(self.prefilling) or (bool(self.waiting) and len(self.running) < self.config.max_batch)

    def schedule(self, prefill: bool = True) -> StepPlan[S]:
        """The next step's plan; `prefill=False`: decode only (no chunks, nothing admitted), e.g. while
        the running batch's pass is already launched and its chunks would ride in the next one."""
        running, prefilling = list(self.running), list(self.prefilling)
        preempted: list[S] = []
        rejected: list[S] = []
        cap = self.kv_capacity
        if cap is not None:
            while len(running) + len(prefilling) > 1 and cached_tokens(running + prefilling) > cap:
                preempted.append(prefilling.pop() if prefilling else running.pop())  # the latest admitted first
        budget = self.config.max_step_tokens - len(running) if prefill else 0
        chunks: list[Chunk[S]] = []
        for seq in prefilling:
            if budget < 1:
                break
            chunks.append(self._chunk(seq, budget))
            budget -= chunks[-1].tokens
        room = self.config.max_batch - len(running) - len(prefilling)
        if self.measuring:
            room = min(room, 0 if running or prefilling else 1)
        admitted: list[S] = []
        while self.waiting and len(admitted) < room and budget >= 1 and not preempted:
            seq = self.waiting[0]
            if cap is not None and seq.context_length >= cap:  # not even alone, with one token to generate
                rejected.append(self.waiting.popleft())
                continue
            if cap is not None and cached_tokens(running + prefilling + admitted + [seq]) > cap:
                break
            admitted.append(self.waiting.popleft())
            chunks.append(self._chunk(seq, budget))
            budget -= chunks[-1].tokens
        for seq in preempted:
            self._prefilled.pop(id(seq), None)
        self.waiting.extendleft(reversed(preempted))
        done = {id(c.seq) for c in chunks if c.last}
        self.running = running + [c.seq for c in chunks if c.last]
        self.prefilling = [s for s in prefilling + admitted if id(s) not in done]
        self.preemptions += len(preempted)
        return StepPlan(decode=running, chunks=chunks, preempted=preempted, rejected=rejected)

    def _chunk(self, seq: S, budget: int) -> Chunk[S]:
        start = self._prefilled.pop(id(seq), 0)
        chunk = Chunk(seq, start, min(seq.context_length, start + budget))
        if not chunk.last:
            self._prefilled[id(seq)] = chunk.stop
        return chunk

    def remove(self, seqs: Iterable[S]) -> None:
        """Finished, aborted or failed sequences leave the batch (or the queue)."""
        gone = {id(s) for s in seqs}
        self.running = [s for s in self.running if id(s) not in gone]
        self.prefilling = [s for s in self.prefilling if id(s) not in gone]
        self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        for key in gone:
            self._prefilled.pop(key, None)

    @property
    def idle(self) -> bool:
        return not self.running and not self.prefilling and not self.waiting
