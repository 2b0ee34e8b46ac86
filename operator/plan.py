"""Planning: from the spec, the expert loads and the nodes to replicas per bundle and their nodes.

Pure functions, no I/O. The operator's unit of replication is a bundle (one function's experts of one
layer; with Mixtral-sized experts, one expert): the MoEless Expert Scaler (`kubemoe.planning.scaler`)
gives each bundle its replicas per layer from the loads (predicted where the frontends send them),
with the spec's cvThreshold, layerMemoryCap and maxReplicasPerExpert, and the Expert Placer
(`kubemoe.planning.placer`, the one placer) puts each replica on an eligible node: warm services
first, then join-the-shortest-queue by the layer's load. A replica no node has room for is listed
in `Plan.unplaced`, which the status and an event report.

*In place*: a scale-out replica the placer puts at a site where a running function (a service of
another bundle, active before and after this plan) has memory to spare is hosted by that
function instead of a new service: the routing table names the function for the bundle too, and the
function Loads it (expert functions follow the table, `kubemoe.expert_fn.follow`), the cheapest warm
start. A new service (a cold start) is made only where no running function there has room, and for
a bundle's first replica (a loaded replica must stay in the table beside one being loaded). Never
under MPS: the driver caps each function at its planned bytes, and a Load past them fails.

*Warm* means one thing here and in the placer: a (bundle, node) service that is running, either in
the plan or *retired* (out of the plan, kept until spec keepAlive has passed since it left, pods
warm). Warm services hold their GPUs until then whether reused or not, so the placer counts them
from the start (`warm_held`); a plan that brings one back reuses it, and one whose keepAlive is over
is dropped (the operator deletes it).

GPUs are shared as spec.experts.gpuSharing says. With `exclusive` a replica takes spec.experts.gpus
whole GPUs, so a node holds allocatable // gpus replicas. With `timeSlicing`, `mps` and `dra` every
replica, one function, takes its bundle's bytes plus spec functionOverhead of one GPU's memory, on
the physical GPUs (GPU feature discovery's nvidia.com/gpu.count and .memory labels); with the device
plugin's shares a GPU also holds at most its shares (allocatable of the shared resource per physical
GPU), and with MPS each share is 1/replicas of the memory, so a function must fit that. The device
plugin picks which GPU a share lands on, so for timeSlicing/mps the placer's bin is the node (holding
what its GPUs hold) and the service is per node; with dra the plan's GPU is exact: a service runs on
a *site* `node/gpuN`, one ResourceClaim per site, which every function placed there shares.

Capacity is what other pods leave (`NodeInfo.taken`, read by `capacity.with_taken`): frontends, other
MoEDeployments' functions, anything else that requests GPUs or shares on the node.

The mode (distributed or offload; what auto picks) and the offload GPU budget are decided first, by
`mode.choose_mode`; an offload plan has no expert services.

Notation: L = MoE layers, E = experts per layer, B = bundles, N = eligible nodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from kubernetes.utils import parse_quantity

from kubemoe.bundles import Bundle
from kubemoe.operator.fields import DTYPE_BYTES
from kubemoe.operator.mode import Refused, choose_mode
from kubemoe.operator.spec import MoESpec, Placement
from kubemoe.planning import latency, placer
from kubemoe.planning.placer import WARM_SLACK
from kubemoe.planning.scaler import layer_cv, scale

ServiceKey = tuple[str, str]  # (bundle name, node name): one expert service
GPU = "nvidia.com/gpu"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"  # MiB, as GPU feature discovery labels it
# The NVIDIA device plugin's label for how a node's GPUs are shared: none | time-slicing | mps.
SHARING_STRATEGY_LABEL = "nvidia.com/gpu.sharing-strategy"
STRATEGY_LABEL_VALUES = {"timeSlicing": "time-slicing", "mps": "mps"}
NVIDIA_DRA_DRIVER = "gpu.nvidia.com"  # the NVIDIA DRA driver: its ResourceSlices list a node's GPUs


def gpu_site(node: str, index: int) -> str:
    """Where a dra function runs: one physical GPU of a node (no node name holds a '/')."""
    return f"{node}/gpu{index}"


def node_of(site: str) -> str:
    return site.partition("/")[0]


def function_bytes(spec: MoESpec, bundle: Bundle) -> int:
    """GPU memory one function of `bundle` takes: its experts plus the spec's per-function overhead."""
    return len(bundle.experts) * spec.layout.expert_bytes + spec.experts.sharing.function_overhead


class PlanError(Exception):
    """No plan fits; `reason` is a condition reason, the message says what to change."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Taken:
    """What pods other than this MoEDeployment's expert functions hold on a node (`capacity` reads it)."""

    resources: Mapping[str, int] = field(default_factory=dict)  # extended resource -> units requested
    pods: int = 0
    functions: tuple[tuple[str | None, int], ...] = ()  # other kubemoe functions: (GPU index with dra, bytes)

    def plus(self, resources: Mapping[str, int], pods: int, functions: Sequence[tuple[str | None, int]]) -> "Taken":
        total = dict(self.resources)
        for k, v in resources.items():
            total[k] = total.get(k, 0) + v
        return Taken(total, self.pods + pods, (*self.functions, *functions))


@dataclass(frozen=True)
class NodeInfo:
    name: str
    gpus: int                      # allocatable nvidia.com/gpu
    gpu_memory_bytes: int | None   # per GPU, from the GFD label; None when unlabelled
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, Any], ...] = ()
    schedulable: bool = True       # Ready and not cordoned
    allocatable: Mapping[str, int] = field(default_factory=dict)  # extended resources (domain/name) -> count
    pods: int | None = None        # allocatable pods (the kubelet's maxPods, 110 by default); None = unknown
    dra_gpus: int = 0              # GPUs the NVIDIA DRA driver published for the node (ResourceSlices)
    dra_memory_bytes: int | None = None  # the smallest of their memory capacities
    memory_bytes: int | None = None  # allocatable host memory; None = unknown
    taken: Taken = Taken()         # held by other pods (capacity.with_taken); the planner fills the rest

    @property
    def physical_gpus(self) -> int:
        """GPUs in the node (GFD's count label): allocatable nvidia.com/gpu counts shares when time-sliced."""
        count = self.labels.get(GPU_COUNT_LABEL, "")
        return int(count) if count.isdigit() else self.gpus

    def gpu_count(self, sharing_mode: str) -> int:
        """GPUs the planner may pack: with dra those a DRA driver offers, else GFD's physical count."""
        return self.dra_gpus if sharing_mode == "dra" else self.physical_gpus

    def memory_per_gpu(self, sharing_mode: str) -> int | None:
        return (self.dra_memory_bytes or self.gpu_memory_bytes) if sharing_mode == "dra" else self.gpu_memory_bytes

    def shares_per_gpu(self, resource: str) -> int:
        return self.allocatable.get(resource, 0) // self.physical_gpus if self.physical_gpus else 0

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> "NodeInfo":
        meta, spec, status = node["metadata"], node.get("spec", {}), node.get("status", {})
        labels = meta.get("labels", {}) or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []) or [])
        memory = labels.get(GPU_MEMORY_LABEL, "")
        allocatable = status.get("allocatable") or {}
        extended = {k: int(v) for k, v in allocatable.items() if "/" in k and str(v).isdigit()}
        pods = str(allocatable.get("pods", ""))
        return cls(meta["name"], extended.get(GPU, 0),
                   int(memory) * 2**20 if memory.isdigit() else None, labels, tuple(spec.get("taints", []) or ()),
                   ready and not spec.get("unschedulable", False), extended, int(pods) if pods.isdigit() else None,
                   memory_bytes=_quantity(allocatable.get("memory")))


@dataclass(frozen=True)
class Loads:
    """Observed tokens per second per (layer, expert), summed over the frontends that answered."""

    per_expert: Mapping[tuple[int, int], float] = field(default_factory=dict)  # {(l, e): tokens/s}
    tokens_per_second: float = 0.0
    frontends: int = 0
    passes_per_second: float = 0.0  # forward passes, each one call per MoE layer (0: not reported)

    # A plan asks for each bundle's rate several times (scaler, placer, hosting, summaries): summed once.
    _of: dict[tuple[tuple[int, int], ...], float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def of(self, bundle: Bundle) -> float:
        rate = self._of.get(bundle.experts)
        if rate is None:
            rate = self._of[bundle.experts] = sum(self.per_expert.get(key, 0.0) for key in bundle.experts)
        return rate


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
    nodes: Mapping[str, tuple[str, ...]]           # bundle -> site of each replica: its node (node/gpuN with dra)
    retired: Mapping[ServiceKey, Retired] = field(default_factory=dict)
    version: int = 1                               # routing-table version
    cv: float = 0.0                                # the largest cv_after of a layer
    unplaced: Mapping[str, int] = field(default_factory=dict)  # bundle -> scaled-out replicas no node had room for
    layers: tuple[LayerSummary, ...] = ()          # [L]; empty for a plan read back from the cluster
    gpus_held: int = 0                             # GPUs the expert functions hold (placed and warm)
    hosted: Mapping[str, tuple[ServiceKey, ...]] = field(default_factory=dict)  # bundle -> functions hosting a replica in place
    mode_reason: str = ""                          # why this mode (mode.py); empty for a plan read back
    gpu_budget: int | None = None                  # offload: bytes of GPU memory the frontend gives experts

    def services(self) -> dict[ServiceKey, int]:
        """Active (bundle, node) services and their replicas, in a stable order."""
        counts: dict[ServiceKey, int] = {}
        for bundle in self.bundles:
            for node in self.nodes.get(bundle.name, ()):
                counts[(bundle.name, node)] = counts.get((bundle.name, node), 0) + 1
        return counts

    @property
    def replicas(self) -> int:
        """Replicas with a service of their own (each holds its GPUs); `hosted` ones come on top."""
        return sum(len(nodes) for nodes in self.nodes.values())

    def replicas_of(self, bundle: str) -> int:
        return len(self.nodes.get(bundle, ())) + len(self.hosted.get(bundle, ()))

    @property
    def node_names(self) -> set[str]:
        return {node_of(site) for sites in self.nodes.values() for site in sites}

    def sites(self) -> set[str]:
        """Sites of active and retired services: with dra, the GPUs that need a claim."""
        return {site for _, site in [*self.services(), *self.retired]}


def _quantity(value: Any) -> int | None:
    try:
        return int(parse_quantity(value)) if value is not None else None
    except ValueError:
        return None


def with_dra_devices(nodes: Sequence[NodeInfo], slices: Sequence[Mapping[str, Any]]) -> list[NodeInfo]:
    """Nodes with the GPUs the NVIDIA DRA driver published for them: whole-GPU devices (attribute type
    gpu, not MIG slices) of driver gpu.nvidia.com in ResourceSlices, with their memory capacity."""
    found: dict[str, list[int]] = {}
    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("driver") != NVIDIA_DRA_DRIVER or not spec.get("nodeName"):
            continue
        for device in spec.get("devices") or ():
            if ((device.get("attributes") or {}).get("type") or {}).get("string", "gpu") != "gpu":
                continue
            memory = (((device.get("capacity") or {}).get("memory")) or {}).get("value")
            found.setdefault(spec["nodeName"], []).append(int(parse_quantity(memory)) if memory else 0)
    return [dataclasses.replace(n, dra_gpus=len(found.get(n.name, ())),
                                dra_memory_bytes=min(found[n.name]) or None if n.name in found else None)
            for n in nodes]


def eligible_nodes(spec: MoESpec, nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    """Nodes an expert replica may run on: schedulable, selected, every hard taint tolerated, GPUs enough
    and shared the way spec.experts.gpuSharing asks."""
    return [n for n in nodes if placeable(n, spec.experts.placement) and _offers_gpus(spec, n)]


def offload_nodes(spec: MoESpec, nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    """Nodes an offload frontend may run on: one GPU (its node affinity, render.py), spec.frontend.placement."""
    return [n for n in nodes if placeable(n, spec.frontend.placement) and n.physical_gpus == 1]


def placeable(node: NodeInfo, placement: Placement) -> bool:
    """Schedulable, selected, and every hard taint tolerated."""
    return (node.schedulable and all(node.labels.get(k) == v for k, v in placement.node_selector.items())
            and all(tolerated(t, placement.tolerations) for t in node.taints
                    if t.get("effect") in ("NoSchedule", "NoExecute")))


def _offers_gpus(spec: MoESpec, node: NodeInfo) -> bool:
    sharing, gpus = spec.experts.sharing, spec.experts.gpus
    if not sharing.shared:
        return node.gpus >= gpus and (gpus == 0 or node.gpus > 0)
    if not node.gpu_count(sharing.mode) or not node.memory_per_gpu(sharing.mode):
        return False  # nothing to pack into: no DRA GPUs, or no GFD count and memory labels
    if sharing.mode == "dra":
        return True
    # A node whose device plugin shares another way (or not at all, when labelled) gives other guarantees.
    strategy = node.labels.get(SHARING_STRATEGY_LABEL)
    return node.shares_per_gpu(sharing.resource_name) > 0 and strategy in (None, STRATEGY_LABEL_VALUES[sharing.mode])


def tolerated(taint: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t.get("key") == taint.get("key")):
            return True
        if t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def plan(spec: MoESpec, loads: Loads, nodes: Sequence[NodeInfo], previous: Plan | None, now: float) -> Plan:
    """The next plan. Raises PlanError when the eligible nodes cannot hold one replica of every bundle."""
    eligible = eligible_nodes(spec, nodes)
    choice = choose_mode(spec, eligible, offload_nodes(spec, nodes))
    if isinstance(choice, Refused):
        raise PlanError(choice.reason, choice.message)
    mode = choice.mode
    bundles = tuple(spec.bundles())
    previous = previous or Plan(mode, bundles, {}, {}, 0)
    keep_alive_s = spec.experts.scaling.keep_alive_s
    placed: dict[str, tuple[str, ...]] = {}
    unplaced: dict[str, int] = {}
    hosted: dict[str, tuple[ServiceKey, ...]] = {}
    gpus_held = 0
    # Retired services still warm, of bundles the spec still has: one of a bundle it no longer has (bundleBytes
    # changed) renders nowhere, so it is deleted now, and neither kept nor counted in status.
    names = {b.name for b in bundles}
    kept = {k: r for k, r in _kept(previous, now, keep_alive_s).items() if k[0] in names}
    if mode != "offload":
        _check_fits(spec, bundles, eligible)
        warm = {**{k: r.replicas for k, r in kept.items()}, **previous.services()}
        placed, unplaced, gpus_held = _place(spec, bundles, _replicas(spec, bundles, loads), loads, eligible, warm,
                                             set(previous.services()))
        placed, hosted = _host_in_place(spec, bundles, placed, loads, eligible, previous.services(), warm,
                                        previous.hosted)
    active = {key for key in Plan(mode, bundles, placed).services()}
    retired = {**{k: r for k, r in kept.items() if k not in active},
               **{k: Retired(n, now) for k, n in previous.services().items() if k not in active and k[0] in names}}
    changed = _placement_of(previous) != {b: tuple(sorted(n)) for b, n in placed.items() if n}
    changed = changed or _hosting_of(previous) != {b: tuple(sorted(h)) for b, h in hosted.items() if h}
    if not spec.experts.sharing.shared:  # whole GPUs per replica, retired ones kept warm included
        gpus_held = spec.experts.gpus * (sum(len(n) for n in placed.values()) + sum(r.replicas for r in retired.values()))
    layers = _layer_summaries(bundles, placed, hosted, loads) if mode != "offload" else ()
    return Plan(mode, bundles, placed, retired, previous.version + 1 if changed else max(previous.version, 1),
                max((x.cv_after for x in layers), default=0.0), unplaced, layers, gpus_held, hosted,
                choice.reason, choice.gpu_budget)


def _host_in_place(spec: MoESpec, bundles: Sequence[Bundle], placed: Mapping[str, tuple[str, ...]], loads: Loads,
                   eligible: Sequence[NodeInfo], running: Mapping[ServiceKey, int], warm: Mapping[ServiceKey, int],
                   was_hosted: Mapping[str, tuple[ServiceKey, ...]]
                   ) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[ServiceKey, ...]]]:
    """Scale-out replicas placed where the bundle has no service yet go into a running function at that
    site with memory to spare (the one with the least load in the replica's layer: another layer's
    function runs at another moment), instead of a new service. See the module docstring.

    A replica hosted before (`was_hosted`) stays with its host while that runs on and the bundle keeps
    as many replicas: the placer, which sees services only, may have put it on another site, and moving it
    would make a plan of the same loads differ from the last one (new pods for nothing) once the services
    kept warm beside it expire."""
    if spec.experts.sharing.capped:  # a function holds its planned bytes and no more (the module docstring)
        return {b: tuple(n) for b, n in placed.items() if n}, {}
    nodes = {n.name: n for n in eligible}

    def room(site: str) -> int:  # bytes one function may hold there; 0 where unknown
        node = nodes.get(node_of(site))
        if node is None:
            return 0
        if spec.experts.sharing.shared:
            return _function_room(spec, node)
        return (node.gpu_memory_bytes or 0) * spec.experts.gpus

    size = {b.name: function_bytes(spec, b) for b in bundles}
    experts = {b.name: len(b.experts) * spec.layout.expert_bytes for b in bundles}  # what hosting one more adds
    layer_of = {b.name: b.experts[0][0] for b in bundles}
    active = {(b, site) for b, sites in placed.items() for site in sites}
    hosts = sorted(k for k in running if k in active)  # functions running before and after this plan
    used = {k: size.get(k[0], 0) for k in hosts}
    rate = {b.name: loads.of(b) for b in bundles}
    in_layer: dict[ServiceKey, float] = {}  # a host's load in its own bundle's layer
    at_site: dict[str, list[ServiceKey]] = {}
    for bundle, site in hosts:
        in_layer[(bundle, site)] = rate[bundle] / max(len(placed[bundle]), 1)
        at_site.setdefault(site, []).append((bundle, site))
    kept: dict[str, list[str]] = {b: list(sites) for b, sites in placed.items()}
    hosted: dict[str, list[ServiceKey]] = {}

    def host_at(bundle: str, site: str, host: ServiceKey, share: float) -> None:
        used[host] += experts[bundle]
        if layer_of[host[0]] == layer_of[bundle]:
            in_layer[host] += share
        kept[bundle].remove(site)
        hosted.setdefault(bundle, []).append(host)

    for bundle in sorted(kept, key=lambda b: (-rate[b] / max(len(kept[b]), 1), b)):
        if not any((bundle, site) in warm for site in kept[bundle]):
            continue  # no loaded replica yet: its first one is a service of its own
        share = rate[bundle] / max(len(kept[bundle]), 1)
        new = [site for site in kept[bundle] if (bundle, site) not in warm]  # not its own service there
        for host in was_hosted.get(bundle, ()):
            if new and host in used and used[host] + experts[bundle] <= room(host[1]):
                host_at(bundle, new.pop(0), host, share)
        for site in sorted(set(new)):
            fits = [k for k in at_site.get(site, ()) if k[0] != bundle and used[k] + experts[bundle] <= room(site)
                    and k not in hosted.get(bundle, ())]
            if not fits:
                continue  # a new service: a cold start
            host = min(fits, key=lambda k: (in_layer[k] if layer_of[k[0]] == layer_of[bundle] else 0.0, used[k], k))
            host_at(bundle, site, host, share)
    return ({b: tuple(n) for b, n in kept.items() if n}, {b: tuple(sorted(h)) for b, h in hosted.items()})


def _hosting_of(p: Plan) -> dict[str, tuple[ServiceKey, ...]]:
    return {b: tuple(sorted(h)) for b, h in p.hosted.items() if h}


def _replicas(spec: MoESpec, bundles: Sequence[Bundle], loads: Loads) -> dict[str, int]:
    """Replicas per bundle: the scaler over each layer's bundles, a bundle being the unit a replica
    loads (with one expert per bundle, as for Mixtral-sized experts, this is the scaler per expert).
    The layer memory cap counts each bundle at the size of the layer's largest (conservative), and so
    does the least load worth a replica (`min_replica_load`)."""
    scaling = spec.experts.scaling
    counts: dict[str, int] = {}
    for layer_bundles in _by_layer(bundles).values():
        experts = max(len(b.experts) for b in layer_bundles)
        [row] = scale([[loads.of(b) for b in layer_bundles]], experts * spec.layout.expert_bytes,
                      scaling.cv_threshold, scaling.layer_memory_cap, scaling.max_replicas_per_expert,
                      min_replica_load(spec, loads, experts))
        counts.update((b.name, r) for b, r in zip(layer_bundles, row))
    return counts


def min_replica_load(spec: MoESpec, loads: Loads, experts: int = 1) -> float:
    """The least load worth a replica of `experts` experts (`latency.min_replica_load`), by the frontends'
    passes a second: 0 while none reports them."""
    return latency.min_replica_load(spec.layout.expert_bytes, DTYPE_BYTES[spec.dtype], loads.passes_per_second, experts)


def _check_fits(spec: MoESpec, bundles: Sequence[Bundle], eligible: Sequence[NodeInfo]) -> None:
    sharing = spec.experts.sharing
    if not eligible:
        raise PlanError("InsufficientCapacity", "no node can run expert functions: need schedulable nodes "
                        f"{_offering(spec)} matching spec.experts.placement (nodeSelector "
                        f"{dict(spec.experts.placement.node_selector)}, tolerations for their taints)")
    largest = max(len(b.experts) for b in bundles) * spec.layout.expert_bytes
    memories = [n.gpu_memory_bytes for n in eligible if n.gpu_memory_bytes]
    if not sharing.shared:
        if memories and spec.experts.gpus and largest > max(memories) * spec.experts.gpus:
            raise PlanError("InsufficientCapacity",
                            f"a bundle of {largest / 2**30:.1f} GiB does not fit the GPU memory of any eligible node "
                            f"({max(memories) / 2**30:.1f} GiB per GPU): lower spec.experts.bundleBytes or raise "
                            "spec.experts.gpus")
        return
    need = largest + sharing.function_overhead
    room = max(_function_room(spec, n) for n in eligible)
    if need > room:
        split = " (MPS gives each share 1/replicas of a GPU's memory)" if sharing.mode == "mps" else ""
        raise PlanError("InsufficientCapacity",
                        f"a function of {need / 2**30:.2f} GiB (the largest bundle, {largest / 2**30:.2f} GiB, plus "
                        f"spec.experts.gpuSharing.functionOverhead) does not fit the {room / 2**30:.2f} GiB one "
                        f"function may use on any eligible node{split}: lower spec.experts.bundleBytes"
                        + (" or configure fewer MPS replicas per GPU" if sharing.mode == "mps" else ""))


def _offering(spec: MoESpec) -> str:
    sharing = spec.experts.sharing
    if sharing.mode == "exclusive":
        return f"with {spec.experts.gpus} {GPU}"
    if sharing.mode == "dra":
        return (f"with GPUs in ResourceSlices of the {NVIDIA_DRA_DRIVER} DRA driver (memory from their capacity or "
                f"GFD's {GPU_MEMORY_LABEL})")
    return (f"advertising {sharing.resource_name} ({STRATEGY_LABEL_VALUES[sharing.mode]} shares of the NVIDIA device "
            f"plugin, {SHARING_STRATEGY_LABEL} {STRATEGY_LABEL_VALUES[sharing.mode]} or unset) with GFD's "
            f"{GPU_COUNT_LABEL} and {GPU_MEMORY_LABEL} labels")


def _function_room(spec: MoESpec, node: NodeInfo) -> int:
    """Bytes one function may use on one of the node's GPUs."""
    memory = node.memory_per_gpu(spec.experts.sharing.mode) or 0
    if spec.experts.sharing.mode == "mps":
        return memory // max(node.shares_per_gpu(spec.experts.sharing.resource_name), 1)
    return memory


def _by_layer(bundles: Sequence[Bundle]) -> dict[int, list[Bundle]]:
    """MoE layer -> its bundles, in layer order: the placer's [L][B] rows (a bundle holds one layer's experts)."""
    rows: dict[int, list[Bundle]] = {}
    for bundle in bundles:
        rows.setdefault(bundle.experts[0][0], []).append(bundle)
    return dict(sorted(rows.items()))


def _place(spec: MoESpec, bundles: Sequence[Bundle], replicas: Mapping[str, int], loads: Loads,
           eligible: Sequence[NodeInfo], warm: Mapping[ServiceKey, int], serving: set[ServiceKey]
           ) -> tuple[dict[str, tuple[str, ...]], dict[str, int], int]:
    """The placer over the eligible GPUs -> (sites per bundle, unplaced per bundle, GPUs holding a replica).

    A replica's queue in a layer is the load of the layer's replicas in its bin, per GPU of the bin. A
    warm service is kept within the placer's WARM_SLACK, a `serving` one (active in the previous plan)
    before a retired one.
    """
    gpus, item = _placer_gpus(spec, bundles, replicas, warm, eligible)
    rows = list(_by_layer(bundles).values())
    where = {b.name: (i, j) for i, row in enumerate(rows) for j, b in enumerate(row)}
    warm_previous: dict[placer.ExpertKey, list[str]] = {}
    warm_serving: dict[placer.ExpertKey, list[str]] = {}
    bins = {g.id for g in gpus}
    for (bundle, site), count in warm.items():  # a bin's id is its site
        if site not in bins or bundle not in where:
            continue  # the node left or is no longer eligible, or the bundle is gone: nothing to reuse
        warm_previous.setdefault(where[bundle], []).extend([site] * count)
        if (bundle, site) in serving:
            warm_serving.setdefault(where[bundle], []).extend([site] * count)
    placement = placer.place([[replicas[b.name] for b in row] for row in rows],
                             [[loads.of(b) for b in row] for row in rows], gpus, item, warm_previous,
                             warm_slack=WARM_SLACK, warm_held=True, warm_serving=warm_serving,
                             min_replica_load=min_replica_load(spec, loads, max(len(b.experts) for b in bundles)))
    placed: dict[str, list[str]] = {}
    for (i, j, _), gpu in placement.gpu_of.items():
        placed.setdefault(rows[i][j].name, []).append(gpu)  # a bin's id is its site
    unplaced: dict[str, int] = {}
    for i, j, _ in placement.unplaced:
        unplaced[rows[i][j].name] = unplaced.get(rows[i][j].name, 0) + 1
    homeless = [b.name for b in bundles if b.name not in placed]
    if homeless:
        raise PlanError("InsufficientCapacity",
                        f"{len(homeless)} of {len(bundles)} expert bundles (e.g. {homeless[0]}) fit on no "
                        f"{'GPU' if spec.experts.sharing.shared else 'node'}: "
                        f"{_capacity_text(spec, bundles, eligible)} (warm replicas included): add GPU nodes, "
                        + ("share GPUs (spec.experts.gpuSharing), " if not spec.experts.sharing.shared else "")
                        + "raise spec.experts.bundleBytes, or shorten spec.experts.scaling.keepAlive")
    # Warm services hold their memory from the start (warm_held), so this counts retired ones too.
    nodes = {n.name: n for n in eligible}
    if not spec.experts.sharing.shared:
        return {name: tuple(sorted(sites)) for name, sites in placed.items()}, unplaced, 0  # plan() counts whole GPUs
    held = sum(1 if spec.experts.sharing.mode == "dra" else _gpus_holding(spec, nodes[g.node], used // item, item)
               for g in gpus if (used := placement.gpu_memory.get(g.id, 0)) > 0)
    return {name: tuple(sorted(sites)) for name, sites in placed.items()}, unplaced, held


def _placer_gpus(spec: MoESpec, bundles: Sequence[Bundle], replicas: Mapping[str, int],
                 warm: Mapping[ServiceKey, int], eligible: Sequence[NodeInfo]) -> tuple[list[placer.GPU], int]:
    """The placer's bins (its "GPUs", id = the site a service runs on) and the bytes of one replica in them.

    exclusive: one bin per node whose memory counts replica slots (whole GPUs no other pod holds //
    spec.experts.gpus; CPU-only experts never fill a node). Shared, a replica is one function: the largest
    bundle plus the function overhead (the last bundle of a layer may be smaller: conservative). dra: every
    GPU the DRA driver offers, exact (site node/gpuN), less what other functions hold on it. timeSlicing
    and mps: one bin per node, because the device plugin picks the GPU of each share, not the operator (a
    per-GPU guess would differ from window to window and move warm services for nothing); it holds what
    its GPUs hold: on each GPU the functions its memory and its free shares take beside what other pods
    hold there, summed, and its capacity is its GPU count, so the shortest queue is the shortest per GPU.
    Every bin holds at most its part of the node's pods that other pods leave (one function is one pod;
    the kubelet runs at most maxPods, 110 by default).
    """
    sharing = spec.experts.sharing
    if not sharing.shared:
        per_replica = spec.experts.gpus
        unbounded = sum(replicas.values()) + sum(warm.values())
        return [placer.GPU(n.name, n.name, _free_gpus(n) // per_replica if per_replica else unbounded)
                for n in eligible], 1
    item = max(function_bytes(spec, b) for b in bundles)
    bins = []
    for n in eligible:
        if item > _function_room(spec, n):
            continue  # an MPS share of this node is too small for a function
        count = n.gpu_count(sharing.mode)
        slots = _function_slots(spec, n, count, item)
        pods = None if n.pods is None else max(n.pods - n.taken.pods, 0)
        if sharing.mode == "dra":
            bins += [placer.GPU(gpu_site(n.name, i), n.name, (s if pods is None else min(s, pods // count)) * item)
                     for i, s in enumerate(slots)]
        else:
            total = sum(slots) if pods is None else min(sum(slots), pods)
            bins.append(placer.GPU(n.name, n.name, total * item, capacity=count))
    return bins, item


def _function_slots(spec: MoESpec, node: NodeInfo, count: int, item: int) -> list[int]:
    """[count] functions of `item` bytes each of the node's GPUs still has memory (and shares) for."""
    sharing = spec.experts.sharing
    memory = node.memory_per_gpu(sharing.mode) or 0
    held, shares = _taken_per_gpu(spec, node, count, memory)
    slots = [max(memory - held[i], 0) // item for i in range(count)]
    if sharing.mode != "dra":
        per_gpu = node.shares_per_gpu(sharing.resource_name)
        slots = [min(s, max(per_gpu - shares[i], 0)) for i, s in enumerate(slots)]
    return slots


def _gpus_holding(spec: MoESpec, node: NodeInfo, functions: int, item: int) -> int:
    """GPUs a node's bin of `functions` functions keeps busy: packed as tightly as its GPUs allow."""
    count = node.gpu_count(spec.experts.sharing.mode)
    per_gpu = max(max(_function_slots(spec, dataclasses.replace(node, taken=Taken()), count, item), default=0), 1)
    return min(count, -(-functions // per_gpu))


def _free_gpus(node: NodeInfo) -> int:
    """Whole nvidia.com/gpu no other pod holds (a frontend's, another MoEDeployment's)."""
    return max(node.gpus - node.taken.resources.get(GPU, 0), 0)


def _taken_per_gpu(spec: MoESpec, node: NodeInfo, count: int, memory: int) -> tuple[list[int], list[int]]:
    """[count] bytes and shares other pods hold on each of the node's GPUs. Other kubemoe functions hold
    their memory on their GPU (dra) or, where the device plugin picks it, on the GPU holding the fewest
    bytes so far (largest first: as tightly as it could be); shares spread the same way. With MPS a share that is not a kubemoe
    function holds its 1/replicas of a GPU; a time-sliced one holds memory nobody declares (not counted)."""
    held, shares = [0] * count, [0] * count
    if not count:
        return held, shares
    sharing = spec.experts.sharing
    pinned = [(int(g[3:]), b) for g, b in node.taken.functions if g and g[3:].isdigit() and int(g[3:]) < count]
    floating = sorted((b for g, b in node.taken.functions if not (g and g[3:].isdigit() and int(g[3:]) < count)),
                      reverse=True)
    for index, nbytes in pinned:
        held[index] += nbytes
    units = node.taken.resources.get(sharing.resource_name, 0) if sharing.mode != "dra" else 0
    if sharing.mode == "mps":  # shares of other pods, beyond those of kubemoe functions, hold their part
        per_share = memory // max(node.shares_per_gpu(sharing.resource_name), 1)
        floating += [per_share] * max(units - len(node.taken.functions), 0)
    for nbytes in floating:
        index = min(range(count), key=lambda i: (held[i], i))
        held[index] += nbytes
    for _ in range(units):
        shares[min(range(count), key=lambda i: (shares[i], i))] += 1
    return held, shares


def _capacity_text(spec: MoESpec, bundles: Sequence[Bundle], eligible: Sequence[NodeInfo]) -> str:
    sharing = spec.experts.sharing
    if not sharing.shared:
        others = sum(n.gpus - _free_gpus(n) for n in eligible)
        return (f"{len(bundles)} replicas of {spec.experts.gpus} {GPU} do not fit the "
                f"{sum(n.gpus for n in eligible)} GPUs of {len(eligible)} eligible nodes"
                + (f" (other pods hold {others} of them: frontends, other MoEDeployments)" if others else ""))
    item = max(function_bytes(spec, b) for b in bundles)
    gpus = sum(n.gpu_count(sharing.mode) for n in eligible)
    text = (f"{len(bundles)} functions of up to {item / 2**30:.2f} GiB (bundle plus functionOverhead) do not fit "
            f"the {gpus} GPUs of {len(eligible)} eligible nodes")
    held = sum(b for n in eligible for _, b in n.taken.functions)
    shares = sum(n.allocatable.get(sharing.resource_name, 0) for n in eligible)
    taken = sum(n.taken.resources.get(sharing.resource_name, 0) for n in eligible)
    if sharing.mode != "dra":
        text += f" ({shares} {sharing.resource_name} shares)"
    if held or (taken and sharing.mode != "dra"):
        text += (f"; other pods hold {held / 2**30:.2f} GiB of their memory"
                 + (f" and {taken} of {shares} {sharing.resource_name} shares" if sharing.mode != "dra" else "")
                 + " (other MoEDeployments' functions)")
    return text


def keep_alive_ends(plan: Plan, keep_alive_s: float) -> float | None:
    """When the first service `plan` keeps warm is past keepAlive (a plan made then deletes it); None if none is kept."""
    if not plan.retired:
        return None
    return min(r.since for r in plan.retired.values()) + keep_alive_s


def short_of_replicas(spec: MoESpec, current: Plan, loads: Loads) -> list[str]:
    """Bundles to which the scaler would give more replicas under `loads` than `current` has (placed, hosted
    in place, or wanted and unplaced): a hot expert the plan leaves overloaded, so a plan made now would
    scale out. A plan is never short under the loads it was made with. Fewer wanted (scaling in) is not
    short: that waits for the regular re-plan, as autoscalers damp scaling down."""
    if current.mode == "offload" or not loads.per_expert:
        return []
    wanted = _replicas(spec, current.bundles, loads)
    return [b.name for b in current.bundles
            if wanted[b.name] > current.replicas_of(b.name) + current.unplaced.get(b.name, 0)]


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
    hosted: Mapping[str, tuple[ServiceKey, ...]] = field(default_factory=dict)  # bundle -> functions newly hosting it in place


def decisions(previous: Plan, new: Plan) -> Decisions:
    """previous (as observed in the cluster) -> new: the scaling and warm-pool decisions taken."""
    before = {b: previous.replicas_of(b) for b in {*previous.nodes, *previous.hosted} if previous.replicas_of(b)}
    after = {b: new.replicas_of(b) for b in {*new.nodes, *new.hosted} if new.replicas_of(b)}
    active = new.services()
    return Decisions(
        scaled_out={b: (before.get(b, 0), n) for b, n in sorted(after.items()) if n > max(before.get(b, 0), 1)},
        scaled_in={b: (n, after.get(b, 0)) for b, n in sorted(before.items()) if after.get(b, 0) < n},
        retired=tuple(sorted(k for k in new.retired if k not in previous.retired)),
        reused=tuple(sorted(k for k in previous.retired if k in active)),
        expired=tuple(sorted(k for k in previous.retired if k not in active and k not in new.retired)),
        unplaced=dict(new.unplaced),
        hosted={b: tuple(k for k in h if k not in previous.hosted.get(b, ())) for b, h in sorted(new.hosted.items())
                if set(h) - set(previous.hosted.get(b, ()))})


def _placement_of(p: Plan) -> dict[str, tuple[str, ...]]:
    return {b: tuple(sorted(n)) for b, n in p.nodes.items() if n}


def _layer_summaries(bundles: Sequence[Bundle], placed: Mapping[str, tuple[str, ...]],
                     hosted: Mapping[str, tuple[ServiceKey, ...]], loads: Loads) -> tuple[LayerSummary, ...]:
    summaries = []
    for layer, row in _by_layer(bundles).items():
        rates = [loads.of(b) for b in row]
        counts = [len(placed.get(b.name, ())) + len(hosted.get(b.name, ())) for b in row]
        summaries.append(LayerSummary(layer, sum(counts), round(layer_cv(rates, [1] * len(row)), 4),
                                      round(layer_cv(rates, counts), 4)))
    return tuple(summaries)
