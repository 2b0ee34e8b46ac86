"""The offload path's settings, built once (from the CLI, which reads what the operator renders)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("kubemoe", "on-demand", "gpu-prefetch", "fiddler-like", "hybrimoe-like", "static-split")
PREDICTOR_CHOICES = ("llapor", "router", "frequency")  # or a file of `kubemoe predictor train --kind llapor`


@dataclass(frozen=True)
class OffloadConfig:
    gpu_budget_bytes: int  # device memory for expert weights: hot table + on-demand slots + prefetch groups
    predictor: str = "llapor"  # llapor | router | frequency | FILE (see lookahead.py)
    policy: str = "kubemoe"  # PreSched, or a baseline of baselines.py run by the same engine
    prefetch_slots: int | None = None  # experts per prefetch group; default: the model's experts per token
    cpu_threads: int | None = None  # CPU expert pool; default: every core but one (cpu_experts.default_threads)
    xi: float = 0.5  # PreSched's hit/miss trade-off
    async_io: bool = True  # False: copies on the compute stream (the ablation)
    hot_table: bool = True  # False: the resident experts are the first by (layer, expert), not the hottest
    rerank_every: int = 256  # forward passes between refreshes of the hot table from served counts; 0: never
    rerank_swaps: int | None = None  # most experts one refresh replaces (copies); default: the prefetch slots

    def __post_init__(self) -> None:
        if self.gpu_budget_bytes <= 0:
            raise ValueError(f"the GPU budget must be positive, got {self.gpu_budget_bytes} bytes")
        if self.policy not in POLICIES:
            raise ValueError(f"offload policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.rerank_every < 0:
            raise ValueError(f"rerank_every must be >= 0 forward passes, got {self.rerank_every}")
        if self.rerank_swaps is not None and self.rerank_swaps < 1:
            raise ValueError(f"rerank_swaps must be >= 1 expert per refresh, got {self.rerank_swaps}")
        if self.prefetch_slots is not None and self.prefetch_slots < 0:
            raise ValueError(f"prefetch slots must be >= 0, got {self.prefetch_slots}")
