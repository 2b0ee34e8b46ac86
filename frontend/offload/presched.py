"""PreSched: LayerScope's prefetch-aware cross-layer scheduler (Algorithm 1), as pure decision code.

At layer l, once the gate has run, it decides for every expert this layer's tokens chose whether it
runs on the GPU (already resident, or copied on demand) or on the CPU, and which experts of the
predicted next layer to prefetch while the copy engine would otherwise idle. The steps:

1. Cross-layer sorting: this layer's missing experts (pending tokens) and the predicted next layer's
   missing experts (predicted tokens) in one list, most tokens first.
2. GPU queue: everything missing starts on the CPU; walking the sorted list, an expert moves to the GPU
   while T_G_all < T_C_all, the GPU side's total time over the window (t_g of resident experts, t_io + t_g
   of moved ones) against the CPU side's (t_c of those left). For the next layer, "moved" means prefetched.
   kubemoe adds the host gap (`LayerDemand.host_gap`) to the CPU side while it holds any expert: the host
   launches nothing after the layer until the CPU experts' outputs are back, while the GPU side's copies and
   kernels run during that launching. Where the host's launching bounds the step (decode at Qwen3-30B-A3B
   size on the H100 host, whose copies take 0.25 ms an expert against ~2.2 ms of host time a layer), the
   paper's sums sent two or three experts a layer to the CPU that the GPU side would have hidden, and each
   such layer waited for them.
   t_g is priced as the executor runs the experts (`GroupSeconds`): a layer's loads as one group, a later
   layer's prefetches inside its resident experts' group, each a share of a grouped FFN where they group.
3. On-demand monotonicity: if an expert with n tokens is loaded on demand, every expert of this layer
   with more tokens is on the GPU too (the loads are a prefix of this layer's sorted missing experts).
4. Re-check of this layer's part: this layer's tokens are known, the next layer's only predicted, so the
   number of on-demand loads moves by one at a time while that brings the next layer's gate sooner
   (`SideTimes.finish`: the makespan with the host gap after the CPU side, as in step 2).
5. Prefetch count: the copy engine idles for T_gap = makespan - on-demand copy time in this layer, and
   during the next layer's attention, so f = (T_gap + t_attn) / t_io experts fit. The trade-off xi in [0, 1]
   rounds f: up when its fraction exceeds 1 - xi (a prefetch that may overrun its gap, in exchange for a
   hit), down otherwise (xi = 0.5 rounds to nearest; xi -> 1 favours hits, xi -> 0 never delays the
   next layer's on-demand copies).
6. Window extension: when the window asks no prefetch of the next layer (all that is worth the GPU is
   resident), the window grows to the layer after it, and so on while predictions reach.
7. Filling the idle copies (kubemoe's addition; `fill_idle_copies`): when f exceeds the GPU queue's
   prefetches, the rest of the f copies take the window's other predicted missing experts, in step 1's
   order. Step 2 charges a moved expert t_io on the GPU side, but a copy inside the idle window delays
   no GPU work: a right prediction turns a CPU expert (t_c) into a hit (t_g), a wrong one costs copy
   time the engine would have idled (by step 5's estimate). On the generated routing of
   benchmarks/offload_sim.py this is most of what separated PreSched from HybriMoE's fixed two
   prefetches at Qwen3-30B-A3B sizes and small batches, where the queue fills with this layer's
   one-token experts before any of the next layer's.

The sums in step 2 and the spans in steps 4-5 are the paper's estimate (transfers and compute added, not
overlapped), with the host gap after the CPU side; pipeline.py times the overlap.
"""

from __future__ import annotations

import math

from kubemoe.frontend.offload.costs import ExpertCosts, GroupSeconds
from kubemoe.frontend.offload.policy import LayerDemand, PrefixSpans, Schedule


# Step 1's entries: (-tokens, offset, expert), tokens pending (this layer) or predicted (later layers), offset 0 for
# this layer, 1 for the next one, ... Plain tuples sort natively in step 1's order (most tokens first; ties: nearer
# layer, lower id). A layer makes a hundred of them on the host that launches the GPU's work: as a NamedTuple
# with a sort key, making and sorting 60 of them took 3.5x as long (78 against 22 us on a 2-core CI machine).
Candidate = tuple[int, int, int]


def prefetch_count(window_s: float, t_io: float, xi: float) -> float:
    """Step 5: how many expert copies fit in `window_s` seconds of idle copy engine, rounded by xi
    (an int; infinite when copies are free)."""
    if t_io <= 0:
        return math.inf
    f = window_s / t_io
    whole = math.floor(f + 1e-9)
    fraction = max(f - whole, 0.0)
    return whole + int(fraction > 1e-9 and fraction > 1 - xi + 1e-9)


class PreSched:
    name = "kubemoe"
    clairvoyant = False

    def __init__(self, xi: float = 0.5, extend_window: bool = True, fill_idle_copies: bool = True):
        if not 0 <= xi <= 1:
            raise ValueError(f"xi must be in [0, 1], got {xi}")
        self.xi, self.extend_window, self.fill_idle_copies = xi, extend_window, fill_idle_copies

    def schedule(self, demand: LayerDemand, costs: ExpertCosts) -> Schedule:
        depth = min(1, len(demand.ahead))
        while True:
            candidates = self.candidates(demand, depth)
            chosen = self.gpu_queue(demand, costs, depth, candidates)
            prefetchable = [c for c in chosen if c[1] > 0]  # offset > 0
            # Step 6: nothing to prefetch for the window's layers: look one layer further.
            if prefetchable or not self.extend_window or depth >= len(demand.ahead):
                break
            depth += 1
        spans = PrefixSpans(demand, costs)
        k = self.recheck(spans, self.monotone_loads(demand, chosen))
        times = spans.times(k)
        f = prefetch_count(times.makespan - times.copies + demand.t_attn, costs.t_io, self.xi)
        count = int(min(f, demand.prefetch_slots))  # f is infinite where copies are free
        if self.fill_idle_copies and count > len(prefetchable):
            # Step 7: the copies the queue leaves idle go to the window's other predicted experts.
            queued = set(prefetchable)
            prefetchable += [c for c in candidates if c[1] > 0 and c not in queued]
        prefetch = [(demand.layer + offset, expert) for _, offset, expert in prefetchable[:count]]
        return Schedule.from_split(demand, [e for e, _ in demand.missing()[:k]], prefetch)

    @staticmethod
    def candidates(demand: LayerDemand, depth: int) -> list[Candidate]:
        """Step 1: the window's missing experts, most tokens first (ties: nearer layer, lower id)."""
        items = [(-n, 0, e) for e, n in demand.missing()]
        for offset, (predicted, resident) in enumerate(zip(demand.ahead[:depth], demand.resident_ahead), 1):
            items += [(-n, offset, e) for e, n in predicted.items() if e not in resident and n > 0]
        items.sort()
        return items

    @staticmethod
    def gpu_queue(demand: LayerDemand, costs: ExpertCosts, depth: int, candidates: list[Candidate]) -> list[Candidate]:
        """Step 2: of step 1's `candidates` for `depth` layers ahead, those moved to the GPU, in their order,
        while T_G_all < T_C_all."""
        # The GPU side as the executor runs it: this layer's resident experts, then its loads as a group of their
        # own; a later layer's prefetches join its resident experts' group.
        groups = [GroupSeconds(costs)] + [GroupSeconds(costs, [n for e, n in predicted.items() if e in resident and n > 0])
                                          for predicted, resident in zip(demand.ahead[:depth], demand.resident_ahead)]
        t_g_all = costs.t_g_all([n for _, n in demand.resident_pending()]) + sum(g.seconds for g in groups)
        t_c_all = costs.cpu.total([-rank for rank, _, _ in candidates])
        # Each candidate priced as it comes, from the lines' terms: no list or call per candidate.
        cpu, gpu, shared = costs.cpu, costs.gpu, costs.shared
        chosen = []
        for c in candidates:
            if t_g_all >= t_c_all + demand.host_gap:  # while any expert is on the CPU, the host waits for it
                break
            rank, offset, _ = c
            tokens = -rank
            t_g_all += costs.t_io + groups[offset].join(gpu.slope * tokens + gpu.intercept,
                                                        shared.slope * tokens + shared.intercept)
            t_c_all -= cpu.slope * tokens + cpu.intercept
            chosen.append(c)
        return chosen

    @staticmethod
    def monotone_loads(demand: LayerDemand, chosen: list[Candidate]) -> int:
        """Step 3: the number k of this layer's missing experts loaded: every one down to the last chosen."""
        order = {e: i for i, (e, _) in enumerate(demand.missing())}
        return max((order[expert] + 1 for _, offset, expert in chosen if offset == 0), default=0)

    @staticmethod
    def recheck(spans: PrefixSpans, k: int) -> int:
        """Step 4: move k (this layer's loads) by one while this layer's own makespan `spans.finish(k)` shrinks."""
        here = spans.finish(k)
        while True:
            # The better neighbour (ties: fewer loads), if it beats k.
            best = min(((spans.finish(j), j) for j in (k - 1, k + 1) if 0 <= j < len(spans)), default=None)
            if best is None or best[0] >= here:
                return k
            here, k = best
