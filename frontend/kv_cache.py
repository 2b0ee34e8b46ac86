"""How much memory the running batch's KV cache may take: a budget in bytes, set or found.

Given (`--kv-cache-bytes`), it is that on any device. Otherwise, on CUDA it is a fraction
(`--kv-cache-fraction`) of the device memory free when the first prompt has run (weights, in-process
experts and the first activations are in by then); on the CPU the cache is unbounded. The engine
turns it into token positions with the bytes per token it measures on the first prefill, and the
scheduler admits and preempts by it (scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheConfig:
    bytes: int | None = None  # the budget; None: found from the device
    fraction: float = 0.9  # of the free device memory, where `bytes` is None (CUDA only)

    def __post_init__(self) -> None:
        if self.bytes is not None and self.bytes <= 0:
            raise ValueError(f"the KV cache budget must be positive, got {self.bytes} bytes")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"the KV cache fraction must be in (0, 1], got {self.fraction}")

    def bounded(self, device: torch.device) -> bool:
        return self.bytes is not None or device.type == "cuda"

    def budget(self, device: torch.device) -> int | None:
        if self.bytes is not None:
            return self.bytes
        if device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * self.fraction)
