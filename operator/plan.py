"""Planning: from the spec, the observed expert loads and the nodes to replicas per bundle and their nodes.

Pure functions, no I/O. Replica counts come from the MoEless Expert Scaler (`kubemoe.planning.scaler`)
run per layer over the bundles' loads, with the spec's cvThreshold, layerMemoryCap and
maxReplicasPerExpert; placement is Join-the-Shortest-Queue over eligible GPU nodes by
aggregated load, heaviest bundle first, preferring a node where the bundle is already warm. A
(bundle, node) service that leaves the plan is *retired*: kept (pods warm) until spec keepAlive has
passed since it left, reused if the plan brings it back, then dropped (the operator deletes it).

Notation: L = MoE layers, E = experts per layer, B = bundles, N = eligible nodes.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from kubemoe.bundles import Bundle
from kubemoe.operator.spec import MoESpec
from kubemoe.planning.scaler import scale

ServiceKey = tuple[str, str]  # (bundle name, node name): one expert service
GPU = "nvidia.com/gpu"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"  # MiB, as GPU feature discovery labels it


class PlanError(Exception):
    """No plan fits; `reason` is a condition reason, the message says what to change."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class NodeInfo:
    name: str
    gpus: int                      # allocatable nvidia.com/gpu
    gpu_memory_bytes: int | None   # per GPU, from the GFD label; None when unlabelled
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, Any], ...] = ()
    schedulable: bool = True       # Ready and not cordoned

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> "NodeInfo":
        meta, spec, status = node["metadata"], node.get("spec", {}), node.get("status", {})
        labels = meta.get("labels", {}) or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []) or [])
        memory = labels.get(GPU_MEMORY_LABEL, "")
        return cls(meta["name"], int((status.get("allocatable") or {}).get(GPU, 0)),
                   int(memory) * 2**20 if memory.isdigit() else None, labels, tuple(spec.get("taints", []) or ()),
                   ready and not spec.get("unschedulable", False))


@dataclass(frozen=True)
class Loads:
    """Observed tokens per second per (layer, expert), summed over the frontends that answered."""

    per_expert: Mapping[tuple[int, int], float] = field(default_factory=dict)  # {(l, e): tokens/s}
    tokens_per_second: float = 0.0
    frontends: int = 0

    def of(self, bundle: Bundle) -> float:
        return sum(self.per_expert.get(key, 0.0) for key in bundle.experts)


NO_LOADS = Loads()


@dataclass(frozen=True)
class Retired:
    replicas: int
    since: float  # unix seconds when it left the plan


@dataclass(frozen=True)
class Plan:
    """Replicas per bundle and the node of each replica, plus the retired services kept warm."""

    mode: str                                      # distributed | offload (auto resolved)
    bundles: tuple[Bundle, ...]                    # [B]
    nodes: Mapping[str, tuple[str, ...]]           # bundle -> node of each of its replicas
    retired: Mapping[ServiceKey, Retired] = field(default_factory=dict)
    version: int = 1                               # routing-table version
    cv: float = 0.0

    def services(self) -> dict[ServiceKey, int]:
        """Active (bundle, node) services and their replicas, in a stable order."""
        counts: dict[ServiceKey, int] = {}
        for bundle in self.bundles:
            for node in self.nodes.get(bundle.name, ()):
                counts[(bundle.name, node)] = counts.get((bundle.name, node), 0) + 1
        return counts

    @property
    def replicas(self) -> int:
        return sum(len(nodes) for nodes in self.nodes.values())

    @property
    def node_names(self) -> set[str]:
        return {node for nodes in self.nodes.values() for node in nodes}


def eligible_nodes(spec: MoESpec, nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    """Nodes an expert replica may run on: schedulable, selected, every hard taint tolerated, GPUs enough."""
    placement, gpus = spec.experts.placement, spec.experts.gpus
    return [n for n in nodes
            if n.schedulable and n.gpus >= gpus and (gpus == 0 or n.gpus > 0)
            and all(n.labels.get(k) == v for k, v in placement.node_selector.items())
            and all(tolerated(t, placement.tolerations) for t in n.taints if t.get("effect") in ("NoSchedule", "NoExecute"))]


def tolerated(taint: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t.get("key") == taint.get("key")):
            return True
        if t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def resolve_mode(spec: MoESpec, eligible: Sequence[NodeInfo]) -> str:
    if spec.mode != "auto":
        return spec.mode
    # Expert functions pay off where a node has GPUs to spare; a fleet of single-GPU nodes offloads.
    return "distributed" if any(n.gpus > 1 for n in eligible) else "offload"


def plan(spec: MoESpec, loads: Loads, nodes: Sequence[NodeInfo], previous: Plan | None, now: float) -> Plan:
    """The next plan. Raises PlanError when the eligible nodes cannot hold it."""
    eligible = eligible_nodes(spec, nodes)
    mode = resolve_mode(spec, eligible)
    bundles = tuple(spec.bundles())
    previous = previous or Plan(mode, bundles, {}, {}, 0)
    if mode == "offload":
        placed: dict[str, tuple[str, ...]] = {}
    else:
        _check_fits(spec, bundles, eligible)
        placed = _place(spec, bundles, _replicas(spec, bundles, loads), loads, eligible, previous)
    active = {key for key in Plan(mode, bundles, placed).services()}
    retired = _retire(previous, active, now, spec.experts.scaling.keep_alive_s)
    changed = _placement_of(previous) != {b: tuple(sorted(n)) for b, n in placed.items() if n}
    return Plan(mode, bundles, placed, retired, previous.version + 1 if changed else max(previous.version, 1),
                _max_layer_cv(bundles, placed, loads))


def _replicas(spec: MoESpec, bundles: Sequence[Bundle], loads: Loads) -> dict[str, int]:
    """Replicas per bundle: the scaler over each layer's bundles, a bundle being the unit a replica
    loads (with one expert per bundle, as for Mixtral-sized experts, this is the scaler per expert).
    The layer memory cap counts each bundle at the size of the layer's largest (conservative)."""
    by_layer: dict[int, list[Bundle]] = {}
    for bundle in bundles:
        by_layer.setdefault(bundle.experts[0][0], []).append(bundle)  # a bundle holds one layer's experts
    scaling = spec.experts.scaling
    counts: dict[str, int] = {}
    for layer_bundles in by_layer.values():
        largest = max(len(b.experts) for b in layer_bundles) * spec.layout.expert_bytes
        [row] = scale([[loads.of(b) for b in layer_bundles]], largest, scaling.cv_threshold,
                      scaling.layer_memory_cap, scaling.max_replicas_per_expert)
        counts.update((b.name, r) for b, r in zip(layer_bundles, row))
    return counts


def _check_fits(spec: MoESpec, bundles: Sequence[Bundle], eligible: Sequence[NodeInfo]) -> None:
    if not eligible:
        raise PlanError("InsufficientCapacity",
                        f"no node can run expert functions: need schedulable nodes with {spec.experts.gpus} "
                        f"{GPU} matching spec.experts.placement (nodeSelector {dict(spec.experts.placement.node_selector)}, "
                        "tolerations for their taints)")
    largest = max(len(b.experts) for b in bundles) * spec.layout.expert_bytes
    memories = [n.gpu_memory_bytes for n in eligible if n.gpu_memory_bytes]
    if memories and spec.experts.gpus and largest > max(memories) * spec.experts.gpus:
        raise PlanError("InsufficientCapacity",
                        f"a bundle of {largest / 2**30:.1f} GiB does not fit the GPU memory of any eligible node "
                        f"({max(memories) / 2**30:.1f} GiB per GPU): lower spec.experts.bundleBytes or raise "
                        "spec.experts.gpus")


def _place(spec: MoESpec, bundles: Sequence[Bundle], replicas: Mapping[str, int], loads: Loads,
           eligible: Sequence[NodeInfo], previous: Plan) -> dict[str, tuple[str, ...]]:
    """JSQ: each replica (heaviest bundle first) goes to the node with the least aggregated load,
    preferring a node where the bundle is warm, then the node with fewest replicas, then by name.
    A lazy heap over nodes keeps this O(R log N) for R replicas: 1000 nodes plan in milliseconds."""
    gpus = spec.experts.gpus
    # Warm services keep holding their GPUs whether reused or retired: count them before placing.
    warm: dict[ServiceKey, int] = {**{k: r.replicas for k, r in previous.retired.items()}, **previous.services()}
    free = {n.name: (n.gpus if gpus else math.inf) for n in eligible}
    warm_nodes: dict[str, list[str]] = {}
    for (bundle, node), count in warm.items():
        if node in free:
            free[node] -= count * gpus
            warm_nodes.setdefault(bundle, []).append(node)
    load = {name: 0.0 for name in free}
    count = {name: 0 for name in free}
    heap = [(0.0, 0, name) for name in sorted(free)]  # (load, replicas, node); stale entries skipped
    placed: dict[str, list[str]] = {}

    def coldest() -> tuple[float, bool, int, str] | None:
        while heap:
            entry_load, entry_count, node = heap[0]
            if (entry_load, entry_count) != (load[node], count[node]) or free[node] < gpus:
                heapq.heappop(heap)  # outdated, or full for good (free only shrinks while placing)
                continue
            return (entry_load, True, entry_count, node)
        return None

    for bundle in sorted(bundles, key=lambda b: (-loads.of(b), b.name)):
        per_replica = loads.of(bundle) / replicas[bundle.name]
        for _ in range(replicas[bundle.name]):
            candidates = [(load[n], False, count[n], n) for n in warm_nodes.get(bundle.name, ())
                          if warm[(bundle.name, n)] > 0]
            cold = coldest()
            if cold:
                candidates.append(cold)
            if not candidates:
                raise PlanError("InsufficientCapacity",
                                f"{sum(replicas.values())} expert replicas of {gpus} {GPU} do not fit the "
                                f"{sum(n.gpus for n in eligible)} GPUs of {len(eligible)} eligible nodes (warm "
                                "replicas included): add GPU nodes, raise spec.experts.bundleBytes, shorten "
                                "spec.experts.scaling.keepAlive, or scale out less (spec.experts.scaling."
                                "maxReplicasPerExpert, layerMemoryCap, a higher cvThreshold)")
            _, is_cold, _, node = min(candidates)
            if is_cold:
                free[node] -= gpus
            else:
                warm[(bundle.name, node)] -= 1  # a warm pod taken over: its GPU is already counted
            load[node] += per_replica
            count[node] += 1
            heapq.heappush(heap, (load[node], count[node], node))
            placed.setdefault(bundle.name, []).append(node)
    return {name: tuple(sorted(nodes)) for name, nodes in placed.items()}


def _retire(previous: Plan, active: set[ServiceKey], now: float, keep_alive_s: float) -> dict[ServiceKey, Retired]:
    retired = {key: r for key, r in previous.retired.items() if key not in active and now - r.since < keep_alive_s}
    for key, replicas in previous.services().items():
        if key not in active:
            retired[key] = Retired(replicas, now)
    return retired


def _placement_of(p: Plan) -> dict[str, tuple[str, ...]]:
    return {b: tuple(sorted(n)) for b, n in p.nodes.items() if n}


def _max_layer_cv(bundles: Sequence[Bundle], placed: Mapping[str, tuple[str, ...]], loads: Loads) -> float:
    """max over layers of CV(per-replica load): 0 when a layer has no load."""
    per_layer: dict[int, list[float]] = {}
    for b in bundles:
        replicas = len(placed.get(b.name, ()))
        for _ in range(replicas):
            per_layer.setdefault(b.experts[0][0], []).append(loads.of(b) / replicas)
    cvs = []
    for values in per_layer.values():
        mean = sum(values) / len(values)
        if mean > 0:
            cvs.append(math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / mean)
    return round(max(cvs, default=0.0), 4)
