"""What other pods hold on each node, read the way kube-scheduler reads it, so plans never over-commit.

Pure: pods (as the API returns them) in, `Taken` per node out; `plan` subtracts it from what the placer
may fill. Counted for a node:
- every pod bound to it (spec.nodeName) and not finished: its extended-resource requests (nvidia.com/gpu,
  a device plugin's shares), as the scheduler sums them (containers added, an init container's larger
  request wins, a limit stands for a missing request), and one pod of the kubelet's maxPods;
- a kubemoe expert function of another MoEDeployment also while Pending: its own plan put it on that
  node (required node affinity), so the scheduler will, and a second plan must not count on that room;
  with its GPU memory (render's `FUNCTION_MEMORY_ANNOTATION`, with shared GPUs) and, with dra, its GPU;
- this MoEDeployment's frontend pods not yet bound (or not yet made): reserved where the scheduler is
  likely to put them (`reserve_frontends`): the frontends are applied right after the experts, and an
  expert plan that filled every GPU would leave them Pending.
Not counted: this MoEDeployment's own expert functions (the plan re-makes them: its warm services are
the placer's `warm_previous`), and memory that a time-sliced pod other than a kubemoe function uses
(a share does not say how much; MPS shares do: 1/replicas of a GPU each).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

from kubernetes.utils import parse_quantity

from kubemoe.operator.plan import GPU, NodeInfo, Taken, placeable
from kubemoe.operator.render import (COMPONENT, EXPERT, FRONTEND, FUNCTION_MEMORY_ANNOTATION, GPU_ANNOTATION,
                                     INSTANCE, NODE_ANNOTATION)
from kubemoe.operator.spec import MoESpec

FINISHED = ("Succeeded", "Failed")


def pod_requests(pod: Mapping[str, Any]) -> dict[str, int]:
    """Extended resources (domain/name) a pod requests, as kube-scheduler computes a pod's request."""
    spec = pod.get("spec") or {}

    def of(container: Mapping[str, Any]) -> dict[str, int]:
        resources = container.get("resources") or {}
        # Extended resources cannot be overcommitted: a limit alone is the request.
        merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        return {k: int(parse_quantity(v)) for k, v in merged.items() if "/" in k}

    total: dict[str, int] = {}
    for container in spec.get("containers") or ():
        for k, v in of(container).items():
            total[k] = total.get(k, 0) + v
    for container in spec.get("initContainers") or ():
        for k, v in of(container).items():
            total[k] = max(total.get(k, 0), v)
    for k, v in ((spec.get("overhead") or {}).items()):
        if "/" in k:
            total[k] = total.get(k, 0) + int(parse_quantity(v))
    return total


@dataclasses.dataclass(frozen=True)
class Occupancy:
    taken: Mapping[str, Taken]   # node -> what pods other than this MoEDeployment's experts hold there
    frontends_bound: int         # this MoEDeployment's frontend pods already on a node (counted in `taken`)


def occupancy(pods: Iterable[Mapping[str, Any]], namespace: str, name: str) -> Occupancy:
    """Pods of the whole cluster -> what they hold per node, except MoEDeployment `namespace/name`'s experts."""
    found: dict[str, Taken] = {}
    frontends = 0
    for pod in pods:
        meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
        if status.get("phase") in FINISHED or meta.get("deletionTimestamp"):
            continue
        labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        ours = meta.get("namespace") == namespace and labels.get(INSTANCE) == name
        if ours and labels.get(COMPONENT) == EXPERT:
            continue  # re-planned now: its warm services are the placer's to reuse
        function = labels.get(COMPONENT) == EXPERT and NODE_ANNOTATION in annotations  # a kubemoe function
        node = spec.get("nodeName") or (annotations.get(NODE_ANNOTATION) if function else None)
        if not node:
            continue  # Pending and nobody planned it onto a node: the scheduler does not count it either
        frontends += ours and labels.get(COMPONENT) == FRONTEND
        nbytes = annotations.get(FUNCTION_MEMORY_ANNOTATION, "")  # shared GPUs only; whole ones count as requests
        memory = ((annotations.get(GPU_ANNOTATION), int(nbytes)),) if function and nbytes.isdigit() else ()
        found[node] = found.get(node, Taken()).plus(pod_requests(pod), 1, memory)
    return Occupancy(found, frontends)


def reserve_frontends(spec: MoESpec, nodes: Sequence[NodeInfo], frontends_bound: int) -> list[NodeInfo]:
    """The frontend's GPUs of its pods not yet on a node, taken where kube-scheduler's default scoring
    (least allocated) would put them: the fitting node with the most free nvidia.com/gpu, one pod at a time.
    Nodes the frontend may not use are left alone."""
    want, gpus = spec.frontend.replicas - frontends_bound, spec.frontend.gpus
    if want <= 0 or gpus <= 0:
        return list(nodes)
    out = {n.name: n for n in nodes}
    fitting = [n.name for n in nodes if placeable(n, spec.frontend.placement)]
    for _ in range(want):
        free = {name: out[name].gpus - out[name].taken.resources.get(GPU, 0) for name in fitting}
        best = max((name for name in fitting if free[name] >= gpus), key=lambda name: (free[name], name), default=None)
        if best is None:
            break  # it stays Pending whatever the experts do: nothing to reserve
        out[best] = dataclasses.replace(out[best], taken=out[best].taken.plus({GPU: gpus}, 1, ()))
    return [out[n.name] for n in nodes]


def with_taken(spec: MoESpec, nodes: Sequence[NodeInfo], pods: Iterable[Mapping[str, Any]], namespace: str,
               name: str) -> list[NodeInfo]:
    """Nodes with what other pods hold on them and this MoEDeployment's frontends still to come."""
    seen = occupancy(pods, namespace, name)
    held = [dataclasses.replace(n, taken=seen.taken.get(n.name, Taken())) for n in nodes]
    return reserve_frontends(spec, held, seen.frontends_bound)
