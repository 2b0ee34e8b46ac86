"""What the offload executor counts per MoE layer; added up for /metrics, /loads and the benchmark."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class OffloadStats:
    """Counts of one layer, or added up since start: what /metrics and /loads report."""

    activated: int = 0  # (layer, expert) pairs the routing chose
    hits: int = 0  # of those, already on the device (hot table or prefetched)
    prefetched: int = 0  # experts prefetched
    prefetch_used: int = 0  # prefetched experts their layer then used
    loaded: int = 0  # experts copied on demand
    bytes_copied: int = 0  # on demand and prefetched
    gpu_tokens: int = 0  # expert-token work on the device
    cpu_tokens: int = 0  # ... and on the CPU
    cpu_experts: int = 0

    def add(self, other: "OffloadStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def hit_rate(self) -> float:
        return self.hits / self.activated if self.activated else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        return self.prefetch_used / self.prefetched if self.prefetched else 0.0

    @property
    def cpu_share(self) -> float:
        total = self.gpu_tokens + self.cpu_tokens
        return self.cpu_tokens / total if total else 0.0


COUNTS = tuple(f.name for f in fields(OffloadStats))


@dataclass
class OffloadSeconds:
    """Where the thread that runs the model spends an offload layer's wall time, added up (host clock, no
    device synchronisation added): what tells a CPU side that holds up the GPU from a slow decision."""

    layers: float = 0.0  # from the gate's output to the layer's experts queued and joined
    decide: float = 0.0  # the lookahead and the policy
    cpu_wait: float = 0.0  # blocked on the CPU experts' results after the device work was queued

    def add(self, other: "OffloadSeconds") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
