"""The systems kubemoe's offload path is compared with, as policies with PreSched's interface.

Each reproduces the decision rule of a published system, not its code; pipeline.py (and later the
engine) runs them on the same hot table, buffers and cost figures, so only the decisions differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubemoe.frontend.offload.costs import ExpertCosts
from kubemoe.frontend.offload.policy import LayerDemand, Schedule, best_prefix, by_tokens


def _top_missing_ahead(demand: LayerDemand, count: int) -> list[tuple[int, int]]:
    """The next layer's `count` predicted experts with the most tokens that are not on the GPU."""
    if not demand.ahead or count <= 0:
        return []
    predicted, resident = demand.ahead[0], demand.resident_ahead[0]
    missing = by_tokens((e, n) for e, n in predicted.items() if e not in resident and n > 0)
    return [(demand.layer + 1, e) for e, _ in missing[:count]]


class OnDemand:
    """accelerate-style offload: every missing expert is copied when its layer needs it."""

    name = "on-demand"
    clairvoyant = False

    def schedule(self, demand: LayerDemand, costs: ExpertCosts) -> Schedule:
        return Schedule.from_split(demand, [e for e, _ in demand.missing()])


class GatePrefetch:
    """Fate / Klotski-like: GPU only; the next layer's predicted experts are prefetched into every slot."""

    name = "gpu-prefetch"
    clairvoyant = False

    def schedule(self, demand: LayerDemand, costs: ExpertCosts) -> Schedule:
        return Schedule.from_split(demand, [e for e, _ in demand.missing()],
                                   _top_missing_ahead(demand, demand.prefetch_slots))


class FiddlerLike:
    """Fiddler: a missing expert runs on the CPU when that beats copying it, t_c < t_io + t_g; no prefetch."""

    name = "fiddler-like"
    clairvoyant = False

    def schedule(self, demand: LayerDemand, costs: ExpertCosts) -> Schedule:
        load = [e for e, n in demand.missing() if costs.t_c(n) >= costs.t_io + costs.t_g(n)]
        return Schedule.from_split(demand, load)


class HybriMoELike:
    """HybriMoE-like: a greedy split of this layer alone, and a fixed prefetch of two experts.

    Walking the missing experts by tokens (most first), each goes to the side that would finish it
    first given what that side already holds (the GPU side pays t_io + t_g, the CPU side t_c).
    """

    name = "hybrimoe-like"
    clairvoyant = False
    PREFETCH = 2

    def schedule(self, demand: LayerDemand, costs: ExpertCosts) -> Schedule:
        gpu_end = costs.t_g_all([n for _, n in demand.resident_pending()])
        cpu_end, load = 0.0, []
        for expert, tokens in demand.missing():
            on_gpu, on_cpu = gpu_end + costs.t_io + costs.t_g(tokens), cpu_end + costs.t_c(tokens)
            if on_gpu <= on_cpu:
                gpu_end = on_gpu
                load.append(expert)
            else:
                cpu_end = on_cpu
        return Schedule.from_split(demand, load,
                                   _top_missing_ahead(demand, min(self.PREFETCH, demand.prefetch_slots)))


@dataclass(frozen=True)
class StaticSplit:
    """kTransformers / llama.cpp `--n-cpu-moe` style: whole layers' experts live on the GPU, the rest
    always run on the CPU; nothing is copied. `resident` (from `layers_that_fit`) replaces the hot table."""

    resident: frozenset[tuple[int, int]]
    name: str = "static-split"
    clairvoyant: bool = False

    @classmethod
    def layers_that_fit(cls, layers: list[int], experts_per_layer: int, expert_bytes: int,
                        budget_bytes: int) -> "StaticSplit":
        """The first layers whose experts fit in `budget_bytes` entirely (as `--n-cpu-moe` keeps the rest)."""
        whole = min(len(layers), budget_bytes // (experts_per_layer * expert_bytes))
        return cls(frozenset((l, e) for l in layers[:whole] for e in range(experts_per_layer)))

    def schedule(self, demand: LayerDemand, costs: ExpertCosts) -> Schedule:
        return Schedule.from_split(demand, [])


class Oracle:
    """The clairvoyant policy: the best split of every layer with perfect knowledge of the next one.

    `ahead` holds the actual routing. This layer takes the split that lets the next layer start soonest; every
    expert the next layer's own best split will load is prefetched (it would be copied anyway), as many
    as the slots hold. Layer by layer it is best by LayerScope's cost sums (with the host gap after the CPU
    side, as PreSched prices it), but not a bound on the step:
    pipeline.py overlaps copies with compute, and a policy that prefetches more (into CPU-bound experts)
    can beat it. pipeline.step_lower_bound is the bound that holds for every policy.
    """

    name = "oracle"
    clairvoyant = True

    def schedule(self, demand: LayerDemand, costs: ExpertCosts) -> Schedule:
        k = best_prefix(demand, costs)
        prefetch = []
        if demand.ahead:
            following = LayerDemand(demand.layer + 1, {e: n for e, n in demand.ahead[0].items() if n > 0},
                                    demand.resident_ahead[0], host_gap=demand.host_gap)
            loads_next = following.missing()[:best_prefix(following, costs)]
            prefetch = [(demand.layer + 1, e) for e, _ in loads_next[:demand.prefetch_slots]]
        return Schedule.from_split(demand, [e for e, _ in demand.missing()[:k]], prefetch)

