"""The interface every offload policy has (PreSched and the baselines), so one engine runs any of them.

Per MoE layer, after the gate: `policy.schedule(demand, costs) -> Schedule`. The demand says which
experts this layer's tokens chose (and how many tokens each), what is already on the GPU, and what the
predictor expects of the next layers; the schedule says where each expert runs, which are copied on
demand, and which later-layer experts to prefetch. Pure: executors (and pipeline.py) carry it out.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple, Protocol, Sequence

from kubemoe.frontend.offload.costs import ExpertCosts


@dataclass(frozen=True)
class LayerDemand:
    layer: int
    pending: Mapping[int, int]  # expert -> tokens routed to it in this layer (known: the gate has run)
    resident: frozenset[int]  # this layer's experts on the GPU: hot table + prefetched
    ahead: Sequence[Mapping[int, int]] = ()  # predicted expert -> tokens for layers layer+1, layer+2, ...
    resident_ahead: Sequence[frozenset[int]] = ()  # what is on the GPU for those layers already
    t_attn: float = 0.0  # seconds of the next layer's attention: the copy engine is free meanwhile
    prefetch_slots: int = 0  # experts one prefetch group holds
    # The host's seconds from this layer's return to the next layer's gate (launching its attention). The GPU
    # side overlaps them: its copies and kernels are queued. The CPU side does not: the host waits for the
    # CPU experts' outputs before it launches anything after the layer. 0: a model where the next attention
    # is device work after both sides (pipeline.py).
    host_gap: float = 0.0

    def __post_init__(self) -> None:
        if len(self.ahead) != len(self.resident_ahead):
            raise ValueError("ahead and resident_ahead must describe the same layers")
        if any(n <= 0 for n in self.pending.values()):
            raise ValueError(f"layer {self.layer}: pending token counts must be positive, got {dict(self.pending)}")

    # Sorted once per demand (it is frozen): a policy reads them several times a layer, and the
    # decisions are host time every MoE layer of every step.
    @functools.cached_property
    def _missing(self) -> tuple[tuple[int, int], ...]:
        return tuple(by_tokens((e, n) for e, n in self.pending.items() if e not in self.resident))

    @functools.cached_property
    def _resident_pending(self) -> tuple[tuple[int, int], ...]:
        return tuple(by_tokens((e, n) for e, n in self.pending.items() if e in self.resident))

    def missing(self) -> tuple[tuple[int, int], ...]:
        """This layer's (expert, tokens) not on the GPU, most tokens first (ties: lower expert id)."""
        return self._missing

    def resident_pending(self) -> tuple[tuple[int, int], ...]:
        return self._resident_pending


def by_tokens(items: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(expert, tokens) pairs, most tokens first (ties: lower expert id)."""
    ranked = sorted(items)  # by expert id
    ranked.sort(key=operator.itemgetter(1), reverse=True)  # stable, also reversed: ties keep the id order
    return ranked


@dataclass(frozen=True)
class Schedule:
    gpu: tuple[int, ...]  # this layer's experts computed on the GPU (resident ones first, then `load`)
    load: tuple[int, ...]  # of those, copied on demand, in copy order
    cpu: tuple[int, ...]  # computed on the CPU
    prefetch: tuple[tuple[int, int], ...] = field(default=())  # (layer, expert) copied after `load`, in order

    def check(self, demand: LayerDemand) -> None:
        """Raise ValueError unless this is a valid schedule for `demand` (the engine relies on it)."""
        placed = list(self.gpu) + list(self.cpu)
        if sorted(placed) != sorted(demand.pending):
            raise ValueError(f"layer {demand.layer}: every pending expert must run exactly once on the GPU or "
                             f"the CPU; pending {sorted(demand.pending)}, gpu {self.gpu}, cpu {self.cpu}")
        needs_copy = {e for e in self.gpu if e not in demand.resident}
        if set(self.load) != needs_copy or len(self.load) != len(needs_copy):
            raise ValueError(f"layer {demand.layer}: load {self.load} must be exactly the GPU experts not "
                             f"resident ({sorted(needs_copy)})")
        ahead = {demand.layer + 1 + i: r for i, r in enumerate(demand.resident_ahead)}
        for layer, expert in self.prefetch:
            if layer not in ahead or expert in ahead[layer]:
                raise ValueError(f"layer {demand.layer}: prefetch of ({layer}, {expert}) is outside the window "
                                 "or already resident")
        if len(set(self.prefetch)) != len(self.prefetch) or len(self.prefetch) > demand.prefetch_slots:
            raise ValueError(f"layer {demand.layer}: {len(self.prefetch)} prefetches (with repeats?) exceed "
                             f"the {demand.prefetch_slots} prefetch slots")

    @classmethod
    def from_split(cls, demand: LayerDemand, load: Sequence[int], prefetch=()) -> "Schedule":
        """Resident experts on the GPU, `load` copied and computed on the GPU, every other one on the CPU."""
        loaded = set(load)
        cpu = tuple(e for e, _ in demand.missing() if e not in loaded)
        gpu = tuple(e for e, _ in demand.resident_pending()) + tuple(load)
        return cls(gpu, tuple(load), cpu, tuple(prefetch))


class Policy(Protocol):
    # read-only: a class attribute or a frozen dataclass's field
    @property
    def name(self) -> str: ...

    @property
    def clairvoyant(self) -> bool: ...  # True: `ahead` must hold the actual routing (the oracle), not the prediction

    def schedule(self, demand: LayerDemand, costs: ExpertCosts) -> Schedule: ...


class SideTimes(NamedTuple):
    """LayerScope's estimate of one layer's two sides: sums of per-expert costs (transfers included)."""

    gpu: float  # resident experts' t_g (`t_g_all`) + the loads' t_io each and their t_g as a group (`GroupSeconds`)
    cpu: float  # CPU experts' t_c, one after another (each uses every core)
    copies: float  # the loads' share of `gpu`: the copy engine's busy time
    held: float = 0.0  # the host gap the CPU side holds back (`LayerDemand.host_gap`; 0 without CPU experts)

    @property
    def makespan(self) -> float:
        """The paper's: when both sides are done (the copy engine's window in PreSched's step 5)."""
        return max(self.gpu, self.cpu)

    @property
    def finish(self) -> float:
        """When the next layer can pass its gate: the GPU side overlaps the host gap, the CPU side precedes it."""
        return max(self.gpu, self.cpu + self.held)


class PrefixSpans:
    """k -> the layer's `SideTimes` when its k missing experts with the most tokens are loaded, the rest on the CPU,
    for k = 0 .. len(missing). Each k in O(1) from the missing experts' token prefix sums: the cost lines are
    linear, so the loads' t_g (one FFN each, or one grouped FFN from GROUPED_MIN_EXPERTS loads on, as the executor
    runs them: `GroupSeconds`) and the CPU experts' t_c are a line of their tokens and their count. A decision
    reads a few k (PreSched's re-check walks from its k) or every k (`best_prefix`); the host pays per k read."""

    __slots__ = ("costs", "tokens", "base", "gap")

    def __init__(self, demand: LayerDemand, costs: ExpertCosts):
        self.costs, self.gap = costs, demand.host_gap
        self.tokens = list(itertools.accumulate((n for _, n in demand.missing()), initial=0))  # [k]: the k largest's
        self.base = costs.t_g_all([n for _, n in demand.resident_pending()])  # resident experts' t_g

    def __len__(self) -> int:
        return len(self.tokens)

    def times(self, k: int) -> SideTimes:
        costs, missing = self.costs, len(self.tokens) - 1
        loaded, left = self.tokens[k], self.tokens[-1] - self.tokens[k]
        loads = costs.shared if costs.groups(k) else costs.gpu
        return SideTimes(gpu=self.base + loads.slope * loaded + loads.intercept * k + k * costs.t_io,
                         cpu=costs.cpu.slope * left + costs.cpu.intercept * (missing - k), copies=k * costs.t_io,
                         held=self.gap if k < missing else 0.0)

    def finish(self, k: int) -> float:
        return self.times(k).finish


def best_prefix(demand: LayerDemand, costs: ExpertCosts) -> int:
    """The k minimising when this layer lets the next one pass its gate (`SideTimes.finish`); fewest loads on
    ties (they leave PCIe to prefetching).

    Loading the experts with the most tokens is optimal among splits of k loads while the GPU's cost
    per token is below the CPU's (beta): swapping a loaded expert for a CPU one with more tokens
    shortens the CPU side by more than it lengthens the GPU side.
    """
    spans = PrefixSpans(demand, costs)
    return min(range(len(spans)), key=lambda k: (spans.finish(k), k))
