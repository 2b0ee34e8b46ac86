"""The Expert Placer (MoEless Algorithm 2): every replica onto a GPU, within each GPU's memory.

Replicas go most-loaded first. A replica reuses a warm replica of the same expert (one kept from
an earlier placement, `warm_previous`) when that GPU still has the memory: a warm start costs no
weight loading. Otherwise it joins the shortest queue: the GPU with the least load in the
replica's layer (per unit of capacity), because layers run one after another and a GPU's queue
in a layer holds only that layer's replicas; the GPU's load over all layers breaks ties, so the
hot replicas of different layers spread too. Two replicas of one expert never share a GPU while
another GPU has room (they would only queue behind each other). A replica that fits nowhere is
returned in `unplaced`, never dropped; when memory is short, scale-out replicas (an expert's second
and later) give way to every expert's first: an expert without a replica would lose its tokens.
`warm_slack` bounds what a warm start may cost in balance: a warm GPU is taken unless its queue in
the layer exceeds the shortest queue by more than warm_slack x the replica's load (inf, the default,
always reuses, as MoEless does; 0 reuses only where the warm GPU is as good as any). The operator
and the simulator take `WARM_SLACK`: a warm replica stays put unless its GPU's queue in the layer
exceeds the shortest by more than half the replica's load; only then does a cold start elsewhere
shorten the longer of the two queues by more than that, so small changes in load never cost a
cold start (weights loaded again) and a clearly better GPU still wins.
A replica counts in its GPU's queue for at least `min_replica_load` when it has any load: the
expert curve's knee in the loads' unit (`latency.ExpertCurve.knee_tokens`), because below it the
FFN reads the whole expert's weights whatever its tokens. Counting tokens alone would stack many
lightly loaded replicas on one GPU, which then reads all their weights one after another: at
decode-sized loads the slowest GPU of the layer. Each unit of load also counts `wire_cost` more: its
hidden states' copies to the GPU and back (`latency.LatencyModel.wire_cost`), which below the knee
are what its tokens cost. Without it every replica under the knee weighs the same in the queues, so
two nearly-knee-sized replicas may share a GPU while another pairs two idle ones (on the trained
model's recorded decode loads at 8 GPUs, 2 replicas a GPU: 6% of the simulated MoE-layer time).

`warm_serving` (optional) names the warm replicas that serve now, as opposed to ones only kept warm
(the operator's retired services): among an expert's warm GPUs a serving one is taken unless another
warm GPU's queue is shorter by more than warm_slack x the replica's load. Without it a replica under
unchanged loads would hop between its serving and its retired copy whenever their queues differ at
all: the routing table would change every window and each hop would restart the other copy's
keepAlive, so retired replicas would never expire and keep holding memory.
What "warm" costs depends on who keeps it. The simulator's warm replicas are the previous placement,
released unless reused: reusing one takes its memory again (`warm_held` False). The operator's are
running services kept for keepAlive whether reused or not (`warm_held` True): they hold their memory
from the start, and reusing one takes nothing more. Shapes: L = MoE layers, E = experts, G = GPUs.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

ExpertKey = tuple[int, int]        # (layer index, expert): layer indexes the [L] rows
ReplicaKey = tuple[int, int, int]  # (layer index, expert, replica number)
WARM_SLACK = 0.5  # what kubemoe runs with (see above)


@dataclass(frozen=True)
class GPU:
    id: str
    node: str
    memory_bytes: int      # what expert replicas may use on it
    capacity: float = 1.0  # relative speed: a GPU of capacity 2 takes twice the load for the same queue


@dataclass(frozen=True)
class Placement:
    """Where each replica runs, and what that puts on each GPU."""

    gpu_of: Mapping[ReplicaKey, str]            # replica -> GPU id
    replica_load: Mapping[ReplicaKey, float]    # its share of the expert's load
    gpu_load: Mapping[str, float]               # GPU id -> queued load over every layer (see `cost` in place)
    gpu_memory: Mapping[str, int]               # GPU id -> bytes its replicas use (and held warm ones)
    unplaced: tuple[ReplicaKey, ...] = ()       # replicas no GPU had memory for
    warm_reused: int = 0

    def locations(self) -> dict[ExpertKey, tuple[str, ...]]:
        """(layer, expert) -> the GPUs holding a replica: the `warm_previous` of the next placement."""
        found: dict[ExpertKey, list[str]] = {}
        for (layer, expert, _), gpu in sorted(self.gpu_of.items()):
            found.setdefault((layer, expert), []).append(gpu)
        return {key: tuple(gpus) for key, gpus in found.items()}

    def gpus_used(self) -> int:
        return len(set(self.gpu_of.values()))


def place(replicas: Sequence[Sequence[int]], loads: Sequence[Sequence[float]], gpus: Sequence[GPU],
          expert_bytes: int, warm_previous: Mapping[ExpertKey, Sequence[str]] | None = None,
          warm_slack: float = math.inf, warm_held: bool = False, min_replica_load: float = 0.0,
          warm_serving: Mapping[ExpertKey, Sequence[str]] | None = None, wire_cost: float = 0.0) -> Placement:
    """replicas [L][E] and loads [L][E] -> a Placement over `gpus`.

    `warm_previous` names a GPU once per warm replica of the expert there (a GPU may hold several);
    `warm_serving` those of them that serve now (each also in `warm_previous`).
    """
    if len(replicas) != len(loads) or any(len(r) != len(x) for r, x in zip(replicas, loads)):
        raise ValueError("replicas and loads must have the same [L][E] shape")
    if expert_bytes <= 0:
        raise ValueError(f"expert_bytes must be positive, got {expert_bytes}")
    if not min_replica_load >= 0:
        raise ValueError(f"min_replica_load must be >= 0 (0: queues count tokens only), got {min_replica_load}")
    if not wire_cost >= 0:
        raise ValueError(f"wire_cost must be >= 0 (0: queues count the FFN only), got {wire_cost}")
    if not warm_slack >= 0:
        raise ValueError(f"warm_slack must be >= 0 (inf: always reuse warm replicas), got {warm_slack}")
    if len({g.id for g in gpus}) != len(gpus):
        raise ValueError("GPU ids must be unique")
    by_id = {g.id: g for g in gpus}
    warm = {key: [g for g in ids if g in by_id] for key, ids in (warm_previous or {}).items()}
    serving = {key: [g for g in ids if g in by_id] for key, ids in (warm_serving or {}).items()}
    free = {g.id: g.memory_bytes for g in gpus}
    if warm_held:
        for ids in warm.values():
            for g in ids:
                free[g] -= expert_bytes
    slots = _Slots(free, expert_bytes)
    # Experts still without a replica that will need memory of their own: scale-out replicas leave
    # room for them. A held warm replica needs none (it is always taken when nothing else has room).
    firsts_waiting = sum(1 for layer, counts in enumerate(replicas) for e, c in enumerate(counts)
                         if c > 0 and not (warm_held and warm.get((layer, e))))
    total = {g.id: 0.0 for g in gpus}
    capacity = {g.id: g.capacity for g in gpus}
    gpu_of: dict[ReplicaKey, str] = {}
    replica_load: dict[ReplicaKey, float] = {}
    unplaced: list[ReplicaKey] = []
    reused = 0
    queue = _Queues(gpus, capacity, total, free, expert_bytes)
    for layer, (counts, row) in enumerate(zip(replicas, loads)):
        # Most-loaded replica first; equal loads by expert, so the result is deterministic.
        order = sorted(((row[e] / counts[e], e, i) for e in range(len(row)) for i in range(counts[e])),
                       key=lambda x: (-x[0], x[1], x[2]))
        queue.next_layer()
        hosts: dict[int, set[str]] = {}
        for load, expert, index in order:
            key = (layer, expert, index)
            # What it adds to its GPU's queue: at least a weight read, plus its tokens' copies.
            cost = max(load, min_replica_load) + wire_cost * load if load > 0 else 0.0
            taken = hosts.setdefault(expert, set())
            needs_own = index == 0 and not (warm_held and warm.get((layer, expert)))
            # Warm GPUs not yet holding this expert first; one that does only when nothing else has room.
            candidates = [g for g in sorted(warm.get((layer, expert), ()), key=lambda g: (g in taken, queue.rank(g)))
                          if warm_held or free[g] >= expert_bytes]
            gpu = candidates[0] if candidates else None
            # A serving replica stays where it is unless the best warm GPU is clearly better (see above).
            keep = next((g for g in candidates if g in serving.get((layer, expert), ()) and (g in taken) == (gpu in taken)),
                        None)
            if keep is not None and gpu is not None and queue.queue(keep) - queue.queue(gpu) <= warm_slack * cost:
                gpu = keep
            cold = queue.shortest(taken)
            # New memory goes to a replica only if every expert still waiting keeps room for its first.
            room = needs_own or slots.count - 1 >= firsts_waiting
            warm_ok = gpu is not None and (warm_held or room)
            cold_ok = cold is not None and room
            firsts_waiting -= needs_own
            if gpu is not None and warm_ok and not (
                    cold is not None and cold_ok and (gpu in taken and cold not in taken or warm_slack < math.inf
                                                      and queue.queue(gpu) - queue.queue(cold) > warm_slack * cost)):
                warm[(layer, expert)].remove(gpu)  # one warm replica serves one new replica
                if gpu in serving.get((layer, expert), ()):
                    serving[(layer, expert)].remove(gpu)
                reused += 1
                if not warm_held:
                    free[gpu] -= expert_bytes
            elif cold is not None and cold_ok:
                gpu = cold
                free[gpu] -= expert_bytes
            else:
                unplaced.append(key)  # no room, or what is left is some waiting expert's only replica's
                continue
            slots.update(gpu)
            total[gpu] += cost
            queue.add(gpu, cost)
            taken.add(gpu)
            gpu_of[key], replica_load[key] = gpu, load
    used = {g.id: g.memory_bytes - free[g.id] for g in gpus}
    return Placement(gpu_of, replica_load, total, used, tuple(unplaced), reused)


class _Slots:
    """How many more replicas the GPUs have memory for, all together, kept current as memory is taken."""

    def __init__(self, free: Mapping[str, int], expert_bytes: int):
        self.free, self.expert_bytes = free, expert_bytes
        self.per_gpu = {g: max(f, 0) // expert_bytes for g, f in free.items()}
        self.count = sum(self.per_gpu.values())

    def update(self, gpu: str) -> None:
        now = max(self.free[gpu], 0) // self.expert_bytes
        self.count += now - self.per_gpu[gpu]
        self.per_gpu[gpu] = now


class _Queues:
    """GPUs ordered by (layer load / capacity, total load / capacity, most free memory, id), the
    shortest queue first. Free memory spreads replicas that carry no load at all.

    Every GPU a layer has not touched yet has layer load 0, so their order is that of the rest of the
    key: one lazy min-heap over all GPUs keeps it across layers, and a small heap per layer holds the
    GPUs the layer has touched. A layer costs O(its replicas x log G), not O(G): rebuilding a heap of
    every GPU per layer was the largest part of a DeepSeek-V3 plan (58 layers x 1000 nodes). A GPU's
    entries go stale when its loads or memory change; a fresh one is pushed then.
    """

    def __init__(self, gpus: Sequence[GPU], capacity: Mapping[str, float], total: Mapping[str, float],
                 free: Mapping[str, int], expert_bytes: int):
        self.capacity, self.total, self.free, self.expert_bytes = capacity, total, free, expert_bytes
        self.layer: dict[str, float] = {}
        self.untouched = [(total[g.id] / g.capacity, -free[g.id], g.id) for g in gpus if free[g.id] >= expert_bytes]
        heapq.heapify(self.untouched)
        self.touched: list[tuple[float, float, int, str]] = []

    def next_layer(self) -> None:
        self.layer, self.touched = {}, []

    def _base(self, gpu: str) -> tuple[float, int, str]:
        return self.total[gpu] / self.capacity[gpu], -self.free[gpu], gpu

    def rank(self, gpu: str) -> tuple[float, float, int, str]:
        return (self.layer.get(gpu, 0.0) / self.capacity[gpu], *self._base(gpu))

    def queue(self, gpu: str) -> float:
        return self.layer.get(gpu, 0.0) / self.capacity[gpu]

    def add(self, gpu: str, load: float) -> None:
        self.layer[gpu] = self.layer.get(gpu, 0.0) + load
        if self.free[gpu] >= self.expert_bytes:
            heapq.heappush(self.touched, self.rank(gpu))
            heapq.heappush(self.untouched, self._base(gpu))  # for the next layers; the old entries go stale

    def shortest(self, avoid: set[str]) -> str | None:
        """The least-loaded GPU with room, avoiding `avoid` (this expert's GPUs) unless nothing else has room."""
        avoided: list[tuple[float, float, int, str]] = []
        best = [self._first(self.untouched, self._base, avoid, avoided, skip=self.layer),
                self._first(self.touched, self.rank, avoid, avoided)]
        found = min((r for r in best if r is not None), default=None) or min(avoided, default=None)
        return found[-1] if found is not None else None  # all avoided: every GPU with room already holds it

    def _first(self, heap: list, key, avoid: set[str], avoided: list, skip: Mapping[str, float] = {}):
        """The first valid entry of `heap` not in `avoid` or `skip`, as a full rank; avoided ones are
        collected (as full ranks) and every skipped entry goes back."""
        skipped, found = [], None
        while heap:
            entry = heap[0]
            gpu = entry[-1]
            if entry != key(gpu) or self.free[gpu] < self.expert_bytes:
                heapq.heappop(heap)  # stale, or full for good (memory only shrinks while placing)
                continue
            skipped.append(heapq.heappop(heap))
            if gpu in skip:
                continue  # touched in this layer: its rank is in the layer's heap
            if gpu in avoid:
                avoided.append(self.rank(gpu))
                continue
            found = self.rank(gpu)
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found
