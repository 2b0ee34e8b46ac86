"""Which mode a MoEDeployment serves in, and the offload path's GPU budget: a pure decision from the spec's
model layout and the nodes' GPUs and memory, made by every plan (plan.py) and shown in status.mode,
status.modeReason and a ModeChosen event.

mode auto decides as the two published systems are meant to run:
- a node eligible for expert functions has more than one GPU: distributed (MoEless: experts spread over GPUs);
- every eligible node has one GPU: distributed when those GPUs hold one replica of every expert bundle
  (a GPU of its own per bundle with gpuSharing exclusive, packed by memory when shared), each GPU keeping
  free what a frontend's budget would leave it; otherwise offload (LayerScope: one frontend per single-GPU
  node holds every expert in host memory and streams them through a GPU budget).
mode offload, chosen or written, must fit: a node with one GPU the frontend may run on, host memory for
every expert (pinned), and a GPU budget (written, or derived: kubemoe/offload_budget.py) no larger than
that GPU and no smaller than one layer's working set. What does not fit is `Refused`, with what to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kubemoe.offload_budget import RESERVED_FRACTION, suggested_budget, working_set_bytes
from kubemoe.operator import conditions as c
from kubemoe.operator.schema import SpecError, parse_bytes
from kubemoe.operator.spec import MoESpec

if TYPE_CHECKING:
    from kubemoe.operator.plan import NodeInfo

DISTRIBUTED, OFFLOAD, AUTO = "distributed", "offload", "auto"
ONE_GPU = "nvidia.com/gpu.count 1"  # what the offload frontend's node affinity asks for (render.py)


@dataclass(frozen=True)
class ModeChoice:
    mode: str                      # distributed | offload
    reason: str                    # for people: why this mode (and budget)
    gpu_budget: int | None = None  # offload: bytes of GPU memory for experts, as the frontend gets it


@dataclass(frozen=True)
class Refused:
    reason: str   # a condition reason
    message: str  # what does not fit and what to change


def choose_mode(spec: MoESpec, expert_nodes: Sequence[NodeInfo], offload_nodes: Sequence[NodeInfo]
                ) -> ModeChoice | Refused:
    """`expert_nodes`: where expert functions may run (plan.eligible_nodes); `offload_nodes`: nodes with one
    GPU where the frontend may run (plan.offload_nodes)."""
    if spec.mode == DISTRIBUTED:
        return ModeChoice(DISTRIBUTED, "spec.mode is distributed")
    if spec.mode == OFFLOAD:
        return offload(spec, offload_nodes, "spec.mode is offload")
    widest = max(expert_nodes, key=lambda n: (n.physical_gpus, n.name), default=None)
    if widest is not None and widest.physical_gpus > 1:
        return ModeChoice(DISTRIBUTED, f"mode auto: node {widest.name} has {widest.physical_gpus} GPUs for expert "
                                       "functions")
    gpu = min((n.gpu_memory_bytes for n in expert_nodes if n.gpu_memory_bytes), default=None)
    if gpu is None:
        return offload(spec, offload_nodes, "mode auto: no eligible node has more than one GPU")
    fits, sizes = _spread(spec, expert_nodes, suggested_budget(gpu))
    if fits:
        return ModeChoice(DISTRIBUTED, f"mode auto: every eligible node has one GPU, and they hold the experts "
                                       f"({sizes})")
    return offload(spec, offload_nodes, f"mode auto: every eligible node has one GPU, too few or too small for the "
                                        f"experts ({sizes})")


def _spread(spec: MoESpec, nodes: Sequence[NodeInfo], room: int) -> tuple[bool, str]:
    """Whether one replica of every bundle fits the single-GPU `nodes` as expert functions, each GPU
    keeping what a frontend's budget would leave free (`room` of the smallest is for experts), and why."""
    bundles = spec.bundles()
    largest = max(len(b.experts) for b in bundles) * spec.layout.expert_bytes
    sharing, per_replica = spec.experts.sharing, spec.experts.gpus
    if not sharing.shared:  # whole GPUs per replica: a count, and the largest bundle within its GPUs
        slots = sum(n.gpus // per_replica for n in nodes) if per_replica else len(bundles)
        why = (f"{len(bundles)} bundles of up to {_gib(largest)}, {max(per_replica, 1)} whole GPU each, on "
               f"{slots} GPUs with {_gib(room)} for experts")
        return len(bundles) <= slots and largest <= room * max(per_replica, 1), why
    need = spec.layout.total_expert_bytes + len(bundles) * sharing.function_overhead
    share = -(-need // len(nodes))
    why = f"{_gib(share)} of functions on each of {len(nodes)} shared GPUs, {_gib(room)} of the smallest for experts"
    return share <= room and largest + sharing.function_overhead <= room, why


def offload(spec: MoESpec, nodes: Sequence[NodeInfo], why: str) -> ModeChoice | Refused:
    """Offload on `nodes` (one GPU each, the frontend's), or why it does not fit."""
    layout, total = spec.layout, spec.layout.total_expert_bytes
    placement = (f"spec.frontend.placement (nodeSelector {dict(spec.frontend.placement.node_selector)}, "
                 "tolerations for their taints)")
    if not nodes:
        return Refused(c.INSUFFICIENT_CAPACITY,
                       f"{why}, but no schedulable node with one GPU ({ONE_GPU}, where the offload frontend runs) "
                       f"matches {placement}: add such a node, relax spec.frontend.placement, or set mode: "
                       "distributed")
    limit = _memory_limit(spec)
    if limit is not None and limit < total:
        return Refused(c.INSUFFICIENT_CAPACITY,
                       f"{why}, but spec.frontend.resources.limits.memory ({_gib(limit)}) cannot hold every expert "
                       f"({_gib(total)} in pinned host memory): raise it above {_gib(total)} or set mode: distributed")
    roomy = [n for n in nodes if n.memory_bytes is None or n.memory_bytes >= total]
    if not roomy:
        largest = max(nodes, key=lambda n: n.memory_bytes or 0)
        return Refused(c.INSUFFICIENT_CAPACITY,
                       f"{why}, but no node with one GPU has the host memory for every expert ({_gib(total)} pinned; "
                       f"the largest, {largest.name}, has {_gib(largest.memory_bytes or 0)} allocatable): add "
                       "memory or nodes with more, or set mode: distributed to spread the experts over GPUs")
    # (GPU bytes, node) of the smallest labelled GPU: the frontend may land on any of these nodes.
    smallest = min(((n.gpu_memory_bytes, n.name) for n in roomy if n.gpu_memory_bytes), default=None)
    prefetch = min(layout.experts_per_token or 1, layout.experts_per_layer)
    working = working_set_bytes(layout.expert_bytes, prefetch)
    budget = spec.offload.gpu_memory_budget if spec.offload else None
    if budget is None:
        if smallest is None:
            return Refused(c.INSUFFICIENT_CAPACITY,
                           f"{why}, but the GPU memory of the nodes with one GPU is unknown: label them with GPU "
                           "feature discovery's nvidia.com/gpu.memory (MiB) or set spec.offload.gpuMemoryBudget")
        gpu, node = smallest
        budget = suggested_budget(gpu)
        source = (f"{_gib(budget)} derived: {1 - RESERVED_FRACTION:.0%} of the smallest GPU ({node}, {_gib(gpu)}), "
                  "the rest for attention weights and the KV cache")
        if budget < working:
            return Refused(c.INSUFFICIENT_CAPACITY,
                           f"{why}, but the GPU of {node} ({_gib(gpu)}) leaves {_gib(budget)} for experts, less than "
                           f"one layer's working set ({_gib(working)}: {working // layout.expert_bytes} experts of "
                           f"{_gib(layout.expert_bytes)}): use nodes with larger GPUs (spec.frontend.placement), set "
                           "spec.offload.gpuMemoryBudget by hand, or set mode: distributed")
    else:
        source = f"{_gib(budget)} from spec.offload.gpuMemoryBudget"
        if smallest is not None and budget > smallest[0]:
            gpu, node = smallest
            return Refused(c.GPU_BUDGET_TOO_LARGE,
                           f"spec.offload.gpuMemoryBudget ({_gib(budget)}) is more than the GPU of {node} "
                           f"({_gib(gpu)}), where the offload frontend may run: lower it to "
                           f"{_gib(suggested_budget(gpu))} (the rest holds attention weights and the KV cache), or "
                           "restrict spec.frontend.placement to nodes with larger GPUs")
    return ModeChoice(OFFLOAD, f"{why}: offload, GPU budget {source}", budget)


def _memory_limit(spec: MoESpec) -> int | None:
    value = (spec.frontend.resources.get("limits") or {}).get("memory")
    try:
        return parse_bytes(value, "spec.frontend.resources.limits.memory") if value is not None else None
    except SpecError:
        return None  # not a quantity: the API server refuses the Deployment, and PlanApplied says so


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
