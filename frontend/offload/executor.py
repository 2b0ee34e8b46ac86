"""The offload executor: one MoE layer's routed experts, placed by a policy, run from the expert store.

Per layer, once the gate has run: the lookahead predicts the next layer's experts; the policy (PreSched
or a baseline, `policy.Policy`) gets what this layer's tokens chose, what is on the device and what is
expected next, and says which experts run from device slots (the hot table's resident ones and those
prefetched earlier), which are copied on demand, which run on the CPU and what to prefetch. Then:
1. the CPU experts' rows go to the host as one block (pinned, without waiting for the device) and the CPU pool
   starts on them once they land;
2. resident and prefetched experts compute on the device after their own copies' events: as one grouped FFN
   over the slot stack when GROUPED_MIN_EXPERTS or more are there, else one FFN each;
3. on-demand copies alternate between two halves of the slots free at this layer (the two on-demand slots and
   the prefetch slots nothing is held in), each computed as soon as it lands while the next copies run: where
   a half holds GROUPED_MIN_EXPERTS or more, the loads go in batches, each copied together and computed as
   one grouped FFN (at Qwen3-30B-A3B size a layer loads tens of small experts, and issuing a copy and an FFN
   for each one took the host longer than the link took to move them), else one by one; the prefetches queue
   behind them on the copy streams into the prefetch groups;
4. the CPU outputs, one block written in place by the pool, come back and are added into the same output as the
   device experts' (index_add).
Device slots: [0, R) the hot table's R experts, then the two on-demand slots, then 2 x P prefetch slots
(two groups of P: this layer's and the next one's, managed as one pool as pipeline.py models them).
Layers in decisions are MoE-layer positions (0, 1, ...), so "the next layer" is the next MoE layer.
Shapes: T = tokens, H = hidden size, K = experts per token.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Callable, Sequence

import torch

from kubemoe.expert import expert_ffn
from kubemoe.frontend.offload.baselines import OnDemand
from kubemoe.frontend.offload.costs import GROUPED_MIN_EXPERTS, OffloadProfile, ProfileRefresher
from kubemoe.frontend.offload.cpu_experts import CpuExperts
from kubemoe.frontend.offload.hot_table import ON_DEMAND_BUFFERS, PREFETCH_GROUPS, TokenCounter
from kubemoe.frontend.offload.lookahead import Lookahead, NoLookahead
from kubemoe.frontend.offload.pipeline import WINDOW
from kubemoe.frontend.offload.policy import LayerDemand, Policy, Schedule
from kubemoe.frontend.offload.stats import OffloadSeconds, OffloadStats
from kubemoe.frontend.offload.store import ExpertStore, Key
from kubemoe.moe import (
    ExpertGroup, StackedExperts, can_group, combine, expert_inputs, group_tokens, merge_groups, sorted_ffn, upload_ends,
)

log = logging.getLogger(__name__)


class OffloadExecutor:
    def __init__(self, store: ExpertStore, cpu: CpuExperts, policy: Policy, lookahead: Lookahead,
                 profile: OffloadProfile, resident: Sequence[Key], prefetch_slots: int, act: Callable,
                 weight_on_input: bool, on_layer: Callable[[OffloadStats, OffloadSeconds], None] | None = None,
                 counter: TokenCounter | None = None, rerank: Callable[[TokenCounter], Sequence[Key]] | None = None,
                 rerank_every: int = 0, rerank_swaps: int | None = None):
        self.store, self.cpu, self.policy, self.lookahead = store, cpu, policy, lookahead
        self.act, self.weight_on_input, self.on_layer = act, weight_on_input, on_layer
        self.layers = store.layers  # MoE layers; a decision's layer is a position in this tuple
        self.position = {layer: p for p, layer in enumerate(self.layers)}
        self.refresher = ProfileRefresher(profile)
        self.prefetch_slots = prefetch_slots
        needed = len(resident) + ON_DEMAND_BUFFERS + PREFETCH_GROUPS * prefetch_slots
        if needed > store.num_slots:
            raise ValueError(f"{len(resident)} resident experts and the working set need {needed} slots; the store has "
                             f"{store.num_slots}")
        # Device slots: resident, then on-demand, then the prefetch pool.
        self.resident_slot: dict[Key, int] = {}  # (position, expert) -> slot
        for slot, (layer, expert) in enumerate(resident):
            self.resident_slot[(self.position[layer], expert)] = slot
        store.copy_many([(key, slot) for slot, key in enumerate(resident)])
        self._index_resident()
        # LayerScope's Counter, fed by serving: every `rerank_every` forward passes the hot table is ranked
        # again and the experts that became hotter replace those that cooled, slot for slot.
        self.counter = counter if counter is not None else TokenCounter()
        self.rerank, self.rerank_every, self._passes = rerank, rerank_every, 0
        # Default: one prefetch group's worth of copies per refresh (what a layer may prefetch anyway).
        self.rerank_swaps = max(1, prefetch_slots) if rerank_swaps is None else rerank_swaps
        first = len(resident)
        self.on_demand = [first + i for i in range(ON_DEMAND_BUFFERS)]
        self.free_prefetch = list(range(first + ON_DEMAND_BUFFERS, first + ON_DEMAND_BUFFERS + PREFETCH_GROUPS * prefetch_slots))
        self.landed: dict[Key, int] = {}  # (position, expert) prefetched -> its slot, until its layer is done
        self.stats = OffloadStats()
        self.seconds = OffloadSeconds()
        # One grouped FFN over the slots for a layer's experts on the device, where the kernels run here.
        hidden_size, intermediate = store.host.down_shape  # [H, I]
        self.stack = store.stacked() if can_group(store.dtype, store.device, hidden_size, intermediate) else None
        # CPU experts' rows and outputs cross in pinned memory where the experts' weights could be pinned (else
        # pageable, as the weights: slower, synchronous copies).
        self._pinned = store.cuda and store.pinned
        self._left_at: float | None = None  # when the previous layer's experts returned (t_attn is the gap)

    def _index_resident(self) -> None:
        self.resident_by_position = [frozenset(e for p, e in self.resident_slot if p == q) for q in range(len(self.layers))]

    @property
    def profile(self) -> OffloadProfile:
        return self.refresher.profile

    def on_device(self, position: int) -> frozenset[int]:
        return self.resident_by_position[position] | {e for p, e in self.landed if p == position}

    # -- one layer --------------------------------------------------------------------------------

    def run_layer(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  groups: list[ExpertGroup] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Add the routed experts' outputs for `groups` (default: every token's) into `out` [T, H] and return it."""
        entered = time.perf_counter()
        position = self.position[layer]
        if position == 0:
            self._forget_prefetches()  # a new forward pass: nothing is in flight for it
            self._passes += 1
            if self.rerank and self.rerank_every and self._passes % self.rerank_every == 0:
                self.refresh_hot_table()
        elif self._left_at is not None:
            self.refresher.observe_attn(hidden.shape[0], entered - self._left_at)
        groups = group_tokens(top_k_index) if groups is None else groups
        out = torch.zeros_like(hidden) if out is None else out
        decided = time.perf_counter()
        demand, schedule = self._decide(position, hidden, top_k_index, top_k_weights, groups)
        seconds = OffloadSeconds(decide=time.perf_counter() - decided)
        self.counter.add(layer, demand.pending)
        stats = self._stats(demand, schedule)
        seconds.cpu_wait = self._execute(position, hidden, top_k_weights, groups, schedule, out)
        self._left_at = time.perf_counter()
        seconds.layers = self._left_at - entered
        self.stats.add(stats)
        self.seconds.add(seconds)
        if self.on_layer:
            self.on_layer(stats, seconds)
        return out

    def _decide(self, position, hidden, top_k_index, top_k_weights, groups) -> tuple[LayerDemand, Schedule]:
        """The policy's schedule. A lookahead that fails is switched off; a policy that fails leaves the layer
        to on-demand loading. Both are logged, neither fails a request."""
        window = list(range(position + 1, min(position + 1 + WINDOW, len(self.layers))))
        ahead = []
        if window:
            try:
                ahead = self.lookahead.ahead(self.layers[position], hidden, top_k_index, top_k_weights)[:len(window)]
            except Exception:  # noqa: BLE001 - a prediction is a hint: serving goes on without it
                log.exception("the %s lookahead failed at layer %d and is switched off: from now on only the hot "
                              "table and on-demand loading serve", self.lookahead.name, self.layers[position])
                self.lookahead = NoLookahead(f"switched off after the {self.lookahead.name} lookahead failed: "
                                             "the hot-expert table alone")
        demand = self._demand(position, groups, ahead, window, hidden.shape[0])
        try:
            schedule = self.policy.schedule(demand, self.profile.costs(self.store.expert_bytes))
            schedule.check(demand)
        except Exception:  # noqa: BLE001 - the layer still runs, as accelerate would run it
            log.exception("the %s policy failed at layer %d: its missing experts are loaded on demand",
                          self.policy.name, self.layers[position])
            schedule = OnDemand().schedule(demand, self.profile.costs(self.store.expert_bytes))
        return demand, schedule

    def _demand(self, position, groups, ahead, window, tokens) -> LayerDemand:
        held = len(self.landed)
        t_attn = self.profile.t_attn(tokens)  # timed as the host's gap between layers (`observe_attn`)
        return LayerDemand(
            layer=position,
            pending={g.expert: g.count for g in groups},
            resident=self.on_device(position),
            ahead=ahead,
            resident_ahead=[self.on_device(p) for p in window[:len(ahead)]],
            t_attn=t_attn if ahead else 0.0,
            host_gap=t_attn,  # what the CPU side holds back, the last layer's too
            prefetch_slots=max(0, min(self.prefetch_slots, len(self.free_prefetch), PREFETCH_GROUPS * self.prefetch_slots - held)),
        )

    def _stats(self, demand: LayerDemand, schedule: Schedule) -> OffloadStats:
        landed = {e for p, e in self.landed if p == demand.layer}
        copies = len(schedule.load) + len(schedule.prefetch)
        return OffloadStats(
            activated=len(demand.pending), hits=len(demand.pending.keys() & demand.resident),
            prefetched=len(schedule.prefetch), prefetch_used=len(demand.pending.keys() & landed),
            loaded=len(schedule.load), bytes_copied=copies * self.store.expert_bytes,
            gpu_tokens=sum(demand.pending[e] for e in schedule.gpu),
            cpu_tokens=sum(demand.pending[e] for e in schedule.cpu), cpu_experts=len(schedule.cpu))

    def _execute(self, position: int, hidden: torch.Tensor, top_k_weights: torch.Tensor, groups: list[ExpertGroup],
                 schedule: Schedule, out: torch.Tensor) -> float:  # -> seconds blocked on the CPU experts
        layer, store = self.layers[position], self.store
        by_expert = {g.expert: g for g in groups}

        # 1. The CPU side starts first: it is the slower one per expert. Its experts' rows go to the host as one
        # block, and their outputs come back as one, written in place by the worker.
        cpu_groups = [by_expert[e] for e in schedule.cpu]
        cpu_done = None
        if cpu_groups:
            cpu_rows = merge_groups(cpu_groups)
            inputs, landed = self._to_host(expert_inputs(hidden, top_k_weights, cpu_rows, self.weight_on_input))
            cpu_out = torch.empty(inputs.shape, dtype=self.cpu.dtype, pin_memory=self._pinned)  # [N, H]
            sizes = [g.count for g in cpu_groups]
            cpu_done = self.cpu.submit([((layer, g.expert), x, y) for g, x, y in
                                        zip(cpu_groups, inputs.split(sizes), cpu_out.split(sizes))], landed)

        # 2. Experts already on the device (resident or prefetched), grouped where there are enough of them.
        loads = set(schedule.load)
        ready = [(self._slot(position, e), by_expert[e]) for e in schedule.gpu if e not in loads]
        if self.stack is not None and len(ready) >= GROUPED_MIN_EXPERTS:
            self._compute_grouped(self.stack, ready, hidden, top_k_weights, out)
        else:
            for slot, group in ready:
                self._compute(slot, hidden, top_k_weights, group, out)

        # 3. On-demand copies through the free slots (this layer's prefetched experts are queued above: theirs are
        # free again), then the prefetches behind them.
        self._release_landed(position)
        self._load(layer, [by_expert[e] for e in schedule.load], hidden, top_k_weights, out)
        prefetches = [((self.layers[p], e), self.free_prefetch.pop()) for p, e in schedule.prefetch]
        store.copy_many(prefetches)
        for ((_, expert), slot), (target_position, _) in zip(prefetches, schedule.prefetch):
            self.landed[(target_position, expert)] = slot

        # 4. The CPU outputs join the same output; their times keep t_c true to what serving sees.
        cpu_wait = 0.0
        if cpu_done is not None:
            waited = time.perf_counter()
            cpu_done.result()
            cpu_wait = time.perf_counter() - waited
            combine(out, top_k_weights, cpu_rows, cpu_out.to(out.device, non_blocking=True), self.weight_on_input)
        timings = self.cpu.drain_timings()
        if timings:
            self.refresher.observe_cpu(store.expert_bytes, [(tokens, end - start) for _, tokens, start, end in timings])
        return cpu_wait

    def _load(self, layer: int, groups: list[ExpertGroup], hidden, top_k_weights, out: torch.Tensor) -> None:
        """Copy `groups`' experts on demand and compute them, alternating between two halves of the free slots
        (the on-demand slots first, then the prefetch slots the prefetches take last), so a copy never waits for
        the kernels of the batch before it. A batch of GROUPED_MIN_EXPERTS or more runs as one grouped FFN, as the
        cost model prices it (`GroupSeconds`)."""
        if not groups:
            return
        free = self.on_demand + self.free_prefetch
        half = len(free) // 2
        if self.stack is None or half < GROUPED_MIN_EXPERTS:
            for j, group in enumerate(groups):
                slot = free[j % len(free)]
                self.store.copy((layer, group.expert), slot)
                self._compute(slot, hidden, top_k_weights, group, out)
            return
        count = -(-len(groups) // half)  # the fewest batches the halves take
        size = -(-len(groups) // count)  # as even as can be, the last one the rest
        if size < GROUPED_MIN_EXPERTS:  # even batches would not group (6 loads, halves of 5: 3 + 3): fill a half first
            size = half
        for i, start in enumerate(range(0, len(groups), size)):
            batch = groups[start:start + size]
            slots = free[(i % 2) * half:][:len(batch)]
            if len(batch) < GROUPED_MIN_EXPERTS:
                for slot, group in zip(slots, batch):
                    self.store.copy((layer, group.expert), slot)
                    self._compute(slot, hidden, top_k_weights, group, out)
            else:
                self.store.copy_many([((layer, g.expert), slot) for slot, g in zip(slots, batch)])
                self._compute_grouped(self.stack, list(zip(slots, batch)), hidden, top_k_weights, out)

    def _to_host(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """x on the host, and the event the CPU worker waits for before reading it (None: there already). Into
        pinned memory without waiting: a blocking copy here (or back, from pageable memory) synchronised the
        device, and the host, which queues a Qwen3-30B-A3B-size layer's many small kernels ahead of the GPU,
        lost its lead at every layer with a CPU expert."""
        if x.device.type != "cuda":
            return x, None
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=self._pinned).copy_(x, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        return host, landed

    def refresh_hot_table(self) -> int:
        """Rank the hot table again from the counts so far; copy newly hot experts over cooled ones. -> swaps.

        At most `rerank_swaps` experts change per refresh, the hottest newcomers for the coldest leavers: the
        copies queue ahead of this pass's on-demand loads, so a refresh that re-ranked the whole table at once
        would stall one pass for (table size x t_io); the rest follows at the next refreshes."""
        if self.rerank is None:
            raise ValueError("this executor was built without a rerank function: pass rerank= to refresh its hot table")
        wanted = [(self.position[layer], expert) for layer, expert in self.rerank(self.counter)]
        count = {key: self.counter.counts[(self.layers[key[0]], key[1])] for key in set(wanted) | set(self.resident_slot)}
        entering = [k for k in wanted if k not in self.resident_slot]  # hottest first
        keep = set(wanted)
        leaving = sorted((k for k in self.resident_slot if k not in keep), key=lambda k: (count[k], k))  # coldest first
        pairs = [(old, new) for old, new in zip(leaving, entering) if count[new] > count[old]][:self.rerank_swaps]
        entering = [new for _, new in pairs]
        for old, new in pairs:  # the budget is the same: as many leave as enter
            slot = self.resident_slot.pop(old)
            self.store.copy((self.layers[new[0]], new[1]), slot)  # waits for kernels still reading the slot
            self.resident_slot[new] = slot
        self._index_resident()
        if entering:
            log.info("hot table refreshed: %d of %d resident experts replaced", len(entering), len(self.resident_slot))
        return len(entering)

    def _slot(self, position: int, expert: int) -> int:  # the device slot of an expert resident or prefetched
        slot = self.resident_slot.get((position, expert))
        return self.landed[(position, expert)] if slot is None else slot

    def _compute_grouped(self, stack: StackedExperts, ready: list[tuple[int, ExpertGroup]], hidden, top_k_weights,
                         out: torch.Tensor) -> None:
        """The experts in `ready`'s slots as one sorted_ffn over the slot stack: two grouped GEMMs and a few
        gathers where one FFN per expert takes ~7 kernels each (a Qwen3-30B-A3B-size layer has tens of experts
        on the device, and their launches, not the GPU, set the step's time)."""
        ready = sorted(ready, key=lambda pair: pair[0])  # rows in the stack's (slot) order
        counts = [0] * self.store.num_slots
        for slot, group in ready:
            counts[slot] = group.count
        self.store.wait_ready(*(slot for slot, _ in ready))
        rows = merge_groups([g for _, g in ready])
        x = expert_inputs(hidden, top_k_weights, rows, self.weight_on_input)
        ends = upload_ends(list(itertools.accumulate(counts)), self.store.device)
        combine(out, top_k_weights, rows, sorted_ffn(x, ends, stack, self.act), self.weight_on_input)
        self.store.release(*(slot for slot, _ in ready))

    def _compute(self, slot: int, hidden, top_k_weights, group: ExpertGroup, out: torch.Tensor) -> None:
        self.store.wait_ready(slot)
        x = expert_inputs(hidden, top_k_weights, group, self.weight_on_input)
        combine(out, top_k_weights, group, expert_ffn(x, self.store.slot_weights(slot), self.act), self.weight_on_input)
        self.store.release(slot)

    def _release_landed(self, position: int) -> None:
        """This layer's prefetch slots are free again (their kernels are queued: the next copy waits for them)."""
        for key in [k for k in self.landed if k[0] <= position]:
            self.free_prefetch.append(self.landed.pop(key))

    def _forget_prefetches(self) -> None:
        for key in list(self.landed):
            self.free_prefetch.append(self.landed.pop(key))
        self._left_at = None

    def close(self) -> None:
        self.cpu.close()
        self.store.close()
