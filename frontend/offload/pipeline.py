"""A step-time model of the offload path: one policy's decisions played on CPU, GPU and PCIe timelines.

Given a routing trace (per step, per MoE layer: the experts' actual token counts and the predicted ones),
a policy and the cost figures, it plays every layer as the engine will run it:
- the layer's attention runs on the GPU once the previous layer's experts are merged; then the gate,
  and the policy decides (the decision itself is taken as free);
- copies share one copy engine, one after another: first this layer's on-demand loads, then its
  prefetches; prefetches issued earlier still in flight delay them (the price of a wrong prefetch);
- on-demand loads go through two buffers used alternately: the third load waits until the first
  loaded expert has been computed (its buffer is free again; the engine also borrows the free prefetch
  slots and batches small experts, so this wait is the model's worst case, and one it rarely meets: a
  loaded expert computes in a fraction of its copy's time);
- prefetched experts go to two prefetch groups of `prefetch_slots`, modelled as one pool of twice that:
  a buffer is held from its copy until its layer is done;
- the GPU computes resident experts first, then the loaded ones in copy order, each after its copy and
  priced as the engine runs them (each a share of one grouped FFN where they group, `ExpertCosts.groups`);
- the CPU computes its experts one after another (each uses every core) in parallel with all of it;
- the layer ends when both sides are done.
The model's attention is device work after both sides, so its policies are told no host gap
(`LayerDemand.host_gap` 0): the engine's decode at Qwen3-30B-A3B size, where the host's launching
between layers bounds the step and the GPU side runs during it, is not what this models.
Shapes: L = MoE layers of a step (a trace's layers are consecutive MoE layers).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from kubemoe.frontend.offload.costs import OffloadProfile
from kubemoe.frontend.offload.policy import LayerDemand, Policy

# Pinned host-to-GPU bandwidth as measured on x16 links (bytes/s), to scale t_io with.
PCIE_BANDWIDTH = {"pcie3": 12e9, "pcie4": 25e9, "pcie5": 55e9}
WINDOW = 2  # predicted layers a policy sees ahead (PreSched's window extension reaches the second)
BOUND_LAMBDAS = (0.0,) + tuple(2 ** (i / 4) for i in range(-28, 29))  # see step_lower_bound


@dataclass(frozen=True)
class LayerRouting:
    layer: int
    actual: Mapping[int, int]  # expert -> tokens routed to it
    predicted: Mapping[int, int]  # expert -> tokens the predictor expected (made at an earlier layer)


@dataclass(frozen=True)
class StepTrace:
    tokens: int  # tokens in the batch this step (decode: the batch size; prefill: all prompt tokens)
    layers: tuple[LayerRouting, ...]  # [L]


@dataclass
class StepStats:
    seconds: float = 0.0
    tokens: int = 0
    copies: int = 0  # experts copied (on demand + prefetched)
    prefetched: int = 0
    prefetch_used: int = 0  # prefetched experts their layer then used
    activated: int = 0  # (layer, expert) pairs the routing chose
    hits: int = 0  # of those, on the GPU when their layer came (hot table or prefetched)
    cpu_tokens: int = 0  # expert-token work done on the CPU
    gpu_tokens: int = 0
    copy_seconds: float = 0.0  # copy engine busy
    copy_log: list = field(default_factory=list)  # ("load" | "prefetch", layer, expert, start, end) per copy

    def add(self, other: "StepStats") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True)
class RunResult:
    policy: str
    steps: int
    stats: StepStats
    expert_bytes: int

    @property
    def tokens_per_s(self) -> float:
        return self.stats.tokens / self.stats.seconds

    @property
    def step_s(self) -> float:
        return self.stats.seconds / self.steps

    @property
    def bytes_copied(self) -> int:
        return self.stats.copies * self.expert_bytes

    @property
    def hit_rate(self) -> float:
        return self.stats.hits / max(self.stats.activated, 1)

    @property
    def prefetch_accuracy(self) -> float:
        return self.stats.prefetch_used / max(self.stats.prefetched, 1)

    @property
    def cpu_share(self) -> float:
        return self.stats.cpu_tokens / max(self.stats.cpu_tokens + self.stats.gpu_tokens, 1)

    @property
    def pcie_busy(self) -> float:
        return self.stats.copy_seconds / self.stats.seconds

    def summary(self) -> dict:
        return {"policy": self.policy, "steps": self.steps, "tokens_per_s": self.tokens_per_s, "step_s": self.step_s,
                "bytes_copied": self.bytes_copied, "hit_rate": self.hit_rate,
                "prefetch_accuracy": self.prefetch_accuracy, "cpu_share": self.cpu_share, "pcie_busy": self.pcie_busy}


@dataclass
class _Timeline:
    now: float = 0.0  # the previous layer's end
    gpu: float = 0.0  # when each engine is next free
    pcie: float = 0.0
    cpu: float = 0.0
    landed: dict = field(default_factory=dict)  # (layer, expert) prefetched -> when its copy ends

    def copy(self, not_before: float, t_io: float) -> float:
        self.pcie = max(self.pcie, not_before) + t_io
        return self.pcie


def simulate_step(step: StepTrace, policy: Policy, profile: OffloadProfile, expert_bytes: int,
                  resident: frozenset[tuple[int, int]], prefetch_slots: int) -> StepStats:
    costs = profile.costs(expert_bytes)
    t_attn = profile.t_attn(step.tokens)
    stats, time = StepStats(tokens=step.tokens), _Timeline()
    layers = step.layers

    def on_gpu(layer: int) -> frozenset[int]:
        return frozenset(e for l, e in resident if l == layer) | {e for l, e in time.landed if l == layer}

    for i, routing in enumerate(layers):
        layer = routing.layer
        attn_end = max(time.gpu, time.now) + t_attn
        time.gpu = attn_end
        window = layers[i + 1:i + 1 + WINDOW]
        held = sum(1 for l, _ in time.landed if l >= layer)  # prefetch buffers not yet released
        demand = LayerDemand(
            layer=layer,
            pending={e: n for e, n in routing.actual.items() if n > 0},
            resident=on_gpu(layer),
            ahead=[dict(w.actual if policy.clairvoyant else w.predicted) for w in window],
            resident_ahead=[on_gpu(w.layer) for w in window],
            t_attn=t_attn if window else 0.0,
            prefetch_slots=max(0, min(prefetch_slots, 2 * prefetch_slots - held)),
        )
        schedule = policy.schedule(demand, costs)
        schedule.check(demand)

        stats.activated += len(demand.pending)
        stats.hits += len(demand.pending.keys() & demand.resident)
        stats.prefetch_used += len(demand.pending.keys() & {e for l, e in time.landed if l == layer})

        # GPU: resident experts (waiting for a prefetch still in flight), then loads through two buffers.
        loads = set(schedule.load)
        ready = [e for e in schedule.gpu if e not in loads]
        if costs.groups(len(ready)):  # one grouped FFN, once every prefetch it reads has landed
            landed = max((time.landed.get((layer, e), 0.0) for e in ready), default=0.0)
            time.gpu = max(time.gpu, landed) + costs.t_g_all([demand.pending[e] for e in ready])
        else:
            for expert in ready:
                time.gpu = max(time.gpu, time.landed.get((layer, expert), 0.0)) + costs.t_g(demand.pending[expert])
        computed: list[float] = []  # when each loaded expert's compute ends: its buffer is free again
        load_seconds = costs.t_g_each([demand.pending[e] for e in schedule.load])  # priced as they run together
        for j, expert in enumerate(schedule.load):
            buffer_free = computed[j - 2] if j >= 2 else 0.0
            copied = time.copy(max(attn_end, buffer_free), costs.t_io)
            stats.copy_log.append(("load", layer, expert, copied - costs.t_io, copied))
            time.gpu = max(time.gpu, copied) + load_seconds[j]
            computed.append(time.gpu)
        for target in schedule.prefetch:
            time.landed[target] = time.copy(attn_end, costs.t_io)
            stats.copy_log.append(("prefetch", *target, time.landed[target] - costs.t_io, time.landed[target]))

        # CPU: its experts after the attention, in parallel with the GPU side.
        time.cpu = max(time.cpu, attn_end) + sum(costs.t_c(demand.pending[e]) for e in schedule.cpu)
        time.now = max(time.gpu, time.cpu)

        copies = len(schedule.load) + len(schedule.prefetch)
        stats.copies += copies
        stats.copy_seconds += copies * costs.t_io
        stats.prefetched += len(schedule.prefetch)
        stats.cpu_tokens += sum(demand.pending[e] for e in schedule.cpu)
        stats.gpu_tokens += sum(demand.pending[e] for e in schedule.gpu)
        time.landed = {k: v for k, v in time.landed.items() if k[0] > layer}  # this layer's group is free
    stats.seconds = time.now
    return stats


def simulate(trace: Sequence[StepTrace], policy: Policy, profile: OffloadProfile, expert_bytes: int,
             resident: frozenset[tuple[int, int]], prefetch_slots: int) -> RunResult:
    """Every step of `trace`, one after another (the hot table stays; prefetches do not cross steps)."""
    total = StepStats()
    for step in trace:
        total.add(simulate_step(step, policy, profile, expert_bytes, resident, prefetch_slots))
    return RunResult(policy.name, len(trace), total, expert_bytes)


def step_lower_bound(step: StepTrace, profile: OffloadProfile, expert_bytes: int,
                     resident: frozenset[tuple[int, int]], lambdas: Sequence[float] = BOUND_LAMBDAS) -> float:
    """Seconds no policy can beat on `step` in this model, with the same hot table: a true lower bound.

    If a policy computes k_l missing experts of layer l on the GPU, its step takes at least
      A = sum over layers of (t_attn + max(GPU compute, CPU compute))  (layers follow each other), and
      B = t_attn + sum over layers of k_l * t_io  (every copy waits for the first gate, on one engine).
    With k_l fixed, the CPU side is shortest when the k_l experts with most tokens leave it, and the GPU
    side is at least the k_l smallest t_g, each expert priced at the cheaper of its FFN alone and its share of
    a grouped one (which one a policy's experts get depends on how many of them it lands). max(A, B) >= (A + lambda * B) / (1 + lambda) for any
    lambda >= 0, and that relaxation splits by layer, so each lambda gives a bound computed layer by
    layer; the best over `lambdas` is returned. Unlike the `Oracle` policy, this bound holds for every
    policy (the oracle decides greedily and pipeline overlap can beat it).
    """
    costs = profile.costs(expert_bytes)
    t_attn = profile.t_attn(step.tokens)
    grouped = costs.grouped

    def t_g(n: int) -> float:
        return costs.t_g(n) if grouped is None else min(costs.t_g(n), grouped(n))

    phases = []  # [layer][k] -> shortest expert phase with k missing experts on the GPU
    for routing in step.layers:
        tokens = [n for e, n in routing.actual.items() if n > 0 and (routing.layer, e) not in resident]
        gpu = sum(t_g(n) for e, n in routing.actual.items() if n > 0 and (routing.layer, e) in resident)
        by_cpu = sorted((costs.t_c(n) for n in tokens), reverse=True)
        by_gpu = sorted(t_g(n) for n in tokens)
        cpu_left, gpu_side, layer = sum(by_cpu), gpu, []
        for k in range(len(tokens) + 1):
            layer.append(max(gpu_side, cpu_left))
            if k < len(tokens):
                cpu_left, gpu_side = cpu_left - by_cpu[k], gpu_side + by_gpu[k]
        phases.append(layer)
    best = 0.0
    for lam in lambdas:
        relaxed = len(phases) * t_attn + lam * t_attn
        relaxed += sum(min(span + lam * k * costs.t_io for k, span in enumerate(layer)) for layer in phases)
        best = max(best, relaxed / (1 + lam))
    return best


def routing_counts(tokens_by_expert: Sequence[Sequence[int]]) -> dict[int, int]:
    """Per-token expert choices [T][K] -> expert -> tokens (the form the trace holds)."""
    return dict(Counter(e for choices in tokens_by_expert for e in choices))
