"""Planning: from the spec, the expert loads and the nodes to replicas per bundle and their nodes.

Pure functions, no I/O. The operator's unit of replication is a bundle (one function's experts of one
layer; with Mixtral-sized experts, one expert): the MoEless Expert Scaler (`kubemoe.planning.scaler`)
gives each bundle its replicas per layer from the loads (predicted where the frontends send them),
with the spec's cvThreshold, layerMemoryCap and maxReplicasPerExpert, and the Expert Placer
(`kubemoe.planning.placer`, the one placer) puts each replica on an eligible node: warm services
first, then join-the-shortest-queue by the layer's load. A replica no node has room for is listed
in `Plan.unplaced`, which the status and an event report.

*Warm* means one thing here and in the placer: a (bundle, node) service that is running, either in
the plan or *retired* (out of the plan, kept until spec keepAlive has passed since it left, pods
warm). Warm services hold their GPUs until then whether reused or not, so the placer counts them
from the start (`warm_held`); a plan that brings one back reuses it, and one whose keepAlive is over
is dropped (the operator deletes it).

Notation: L = MoE layers, E = experts per layer, B = bundles, N = eligible nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from kubemoe.bundles import Bundle
from kubemoe.operator.spec import MoESpec
from kubemoe.planning import placer
from kubemoe.planning.scaler import layer_cv, scale

ServiceKey = tuple[str, str]  # (bundle name, node name): one expert service
WARM_SLACK = 0.5  # see _place
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
class LayerSummary:
    """One MoE layer of a plan: its replicas and how even their loads are, before and after scaling."""

    layer: int
    replicas: int      # placed replicas of the layer's bundles
    cv_before: float   # CV of the bundles' loads with one replica each
    cv_after: float    # CV of the per-replica loads as placed


@dataclass(frozen=True)
class Plan:
    """Replicas per bundle and the node of each replica, plus the retired services kept warm."""

    mode: str                                      # distributed | offload (auto resolved)
    bundles: tuple[Bundle, ...]                    # [B]
    nodes: Mapping[str, tuple[str, ...]]           # bundle -> node of each of its replicas
    retired: Mapping[ServiceKey, Retired] = field(default_factory=dict)
    version: int = 1                               # routing-table version
    cv: float = 0.0                                # the largest cv_after of a layer
    unplaced: Mapping[str, int] = field(default_factory=dict)  # bundle -> scaled-out replicas no node had room for
    layers: tuple[LayerSummary, ...] = ()          # [L]; empty for a plan read back from the cluster

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
    """The next plan. Raises PlanError when the eligible nodes cannot hold one replica of every bundle."""
    eligible = eligible_nodes(spec, nodes)
    mode = resolve_mode(spec, eligible)
    bundles = tuple(spec.bundles())
    previous = previous or Plan(mode, bundles, {}, {}, 0)
    keep_alive_s = spec.experts.scaling.keep_alive_s
    placed: dict[str, tuple[str, ...]] = {}
    unplaced: dict[str, int] = {}
    if mode != "offload":
        _check_fits(spec, bundles, eligible)
        warm = {**{k: r.replicas for k, r in _kept(previous, now, keep_alive_s).items()}, **previous.services()}
        placed, unplaced = _place(spec, bundles, _replicas(spec, bundles, loads), loads, eligible, warm)
    active = {key for key in Plan(mode, bundles, placed).services()}
    retired = {**{k: r for k, r in _kept(previous, now, keep_alive_s).items() if k not in active},
               **{k: Retired(n, now) for k, n in previous.services().items() if k not in active}}
    changed = _placement_of(previous) != {b: tuple(sorted(n)) for b, n in placed.items() if n}
    layers = _layer_summaries(bundles, placed, loads) if mode != "offload" else ()
    return Plan(mode, bundles, placed, retired, previous.version + 1 if changed else max(previous.version, 1),
                max((x.cv_after for x in layers), default=0.0), unplaced, layers)


def _replicas(spec: MoESpec, bundles: Sequence[Bundle], loads: Loads) -> dict[str, int]:
    """Replicas per bundle: the scaler over each layer's bundles, a bundle being the unit a replica
    loads (with one expert per bundle, as for Mixtral-sized experts, this is the scaler per expert).
    The layer memory cap counts each bundle at the size of the layer's largest (conservative)."""
    scaling = spec.experts.scaling
    counts: dict[str, int] = {}
    for layer_bundles in _by_layer(bundles).values():
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


def _by_layer(bundles: Sequence[Bundle]) -> dict[int, list[Bundle]]:
    """MoE layer -> its bundles, in layer order: the placer's [L][B] rows (a bundle holds one layer's experts)."""
    rows: dict[int, list[Bundle]] = {}
    for bundle in bundles:
        rows.setdefault(bundle.experts[0][0], []).append(bundle)
    return dict(sorted(rows.items()))


def _place(spec: MoESpec, bundles: Sequence[Bundle], replicas: Mapping[str, int], loads: Loads,
           eligible: Sequence[NodeInfo], warm: Mapping[ServiceKey, int]
           ) -> tuple[dict[str, tuple[str, ...]], dict[str, int]]:
    """The placer over nodes: each node is one of its "GPUs", its memory counted in replica slots.

    Until expert functions share GPUs, a replica takes spec.experts.gpus whole GPUs, so a node has
    room for gpus // experts.gpus replicas; its queue in a layer is the load of the layer's replicas
    on it (capacity 1: replicas on one node share its network and host). A warm
    service is kept unless its node's queue in the layer exceeds the shortest by more than half the
    replica's load (warm slack 0.5): only then does a cold start elsewhere shorten the longer of the
    two queues by more than that, so small changes in load never cost a cold start (weights loaded
    again) and a clearly better node still wins.
    """
    per_replica = spec.experts.gpus
    unbounded = sum(replicas.values()) + sum(warm.values())  # CPU-only experts: nodes never fill up
    slots = {n.name: n.gpus // per_replica if per_replica else unbounded for n in eligible}
    gpus = [placer.GPU(name, name, count) for name, count in slots.items()]
    rows = list(_by_layer(bundles).values())
    where = {b.name: (i, j) for i, row in enumerate(rows) for j, b in enumerate(row)}
    warm_previous: dict[placer.ExpertKey, list[str]] = {}
    for (bundle, node), count in warm.items():
        if bundle in where:
            warm_previous.setdefault(where[bundle], []).extend([node] * count)
    placement = placer.place([[replicas[b.name] for b in row] for row in rows],
                             [[loads.of(b) for b in row] for row in rows], gpus, 1, warm_previous,
                             warm_slack=WARM_SLACK, warm_held=True)
    placed: dict[str, list[str]] = {}
    for (i, j, _), node in placement.gpu_of.items():
        placed.setdefault(rows[i][j].name, []).append(node)
    unplaced: dict[str, int] = {}
    for i, j, _ in placement.unplaced:
        unplaced[rows[i][j].name] = unplaced.get(rows[i][j].name, 0) + 1
    homeless = [b.name for b in bundles if b.name not in placed]
    if homeless:
        raise PlanError("InsufficientCapacity",
                        f"{len(homeless)} of {len(bundles)} expert bundles (e.g. {homeless[0]}) fit on no node: "
                        f"{len(bundles)} replicas of {per_replica} {GPU} do not fit the "
                        f"{sum(n.gpus for n in eligible)} GPUs of {len(eligible)} eligible nodes (warm "
                        "replicas included): add GPU nodes, raise spec.experts.bundleBytes, or shorten "
                        "spec.experts.scaling.keepAlive")
    return {name: tuple(sorted(nodes)) for name, nodes in placed.items()}, unplaced


def _kept(previous: Plan, now: float, keep_alive_s: float) -> dict[ServiceKey, Retired]:
    """Retired services still warm: keepAlive has not passed since they left the plan."""
    return {key: r for key, r in previous.retired.items() if now - r.since < keep_alive_s}


@dataclass(frozen=True)
class Decisions:
    """What a new plan changes in the warm pool, for events: each list names services or bundles."""

    scaled_out: Mapping[str, tuple[int, int]]   # bundle -> (replicas before, after), more now
    scaled_in: Mapping[str, tuple[int, int]]    # bundle -> (before, after), fewer now
    retired: tuple[ServiceKey, ...]             # left the plan now, kept warm for keepAlive
    reused: tuple[ServiceKey, ...]              # were retired, back in the plan: a warm start
    expired: tuple[ServiceKey, ...]             # retired and keepAlive over: to be deleted
    unplaced: Mapping[str, int]                 # bundle -> scaled-out replicas no node had room for


def decisions(previous: Plan, new: Plan) -> Decisions:
    """previous (as observed in the cluster) -> new: the scaling and warm-pool decisions taken."""
    before = {b: len(n) for b, n in previous.nodes.items() if n}
    after = {b: len(n) for b, n in new.nodes.items() if n}
    active = new.services()
    return Decisions(
        scaled_out={b: (before.get(b, 0), n) for b, n in sorted(after.items()) if n > max(before.get(b, 0), 1)},
        scaled_in={b: (n, after.get(b, 0)) for b, n in sorted(before.items()) if after.get(b, 0) < n},
        retired=tuple(sorted(k for k in new.retired if k not in previous.retired)),
        reused=tuple(sorted(k for k in previous.retired if k in active)),
        expired=tuple(sorted(k for k in previous.retired if k not in active and k not in new.retired)),
        unplaced=dict(new.unplaced))


def _placement_of(p: Plan) -> dict[str, tuple[str, ...]]:
    return {b: tuple(sorted(n)) for b, n in p.nodes.items() if n}


def _layer_summaries(bundles: Sequence[Bundle], placed: Mapping[str, tuple[str, ...]],
                     loads: Loads) -> tuple[LayerSummary, ...]:
    summaries = []
    for layer, row in _by_layer(bundles).items():
        rates = [loads.of(b) for b in row]
        counts = [len(placed.get(b.name, ())) for b in row]
        summaries.append(LayerSummary(layer, sum(counts), round(layer_cv(rates, [1] * len(row)), 4),
                                      round(layer_cv(rates, counts), 4)))
    return tuple(summaries)
