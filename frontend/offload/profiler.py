"""LayerScope's Timer at start: t_io, t_g and t_c of one expert measured through the store and the CPU pool.

It times what the executor will run: a copy into a device slot (three chunks, pinned or not), the
expert on the device at a few token counts, and the same expert on the CPU in the dtype the pool chose;
t_g and t_c are least-squares lines over the token counts (`costs.fit_line`). t_attn starts at zero and
the executor refreshes it online from the time between one layer's experts and the next's.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from kubemoe.expert import expert_ffn
from kubemoe.frontend.offload.costs import CostLine, ExpertCosts, OffloadProfile, fit_line
from kubemoe.frontend.offload.cpu_experts import CpuExperts
from kubemoe.frontend.offload.store import ExpertStore

TOKENS = (1, 16, 64)


def _seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `run` (after one warm-up), the device's queue drained around each."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@torch.inference_mode()
def measure_profile(store: ExpertStore, cpu: CpuExperts, act: Callable, slot: int, repeats: int = 3,
                    tokens: tuple[int, ...] = TOKENS) -> OffloadProfile:
    """Figures for the store's expert size, using device slot `slot` (free at the time of the call)."""
    device = store.device
    key = (store.layers[0], 0)

    def copy():
        store.copy(key, slot)
        store.wait_ready(slot)

    t_io = _seconds(copy, device, repeats)
    weights = store.slot_weights(slot)
    gpu, cpu_samples = [], []
    for n in tokens:
        x = torch.randn(n, weights.hidden_size, device=device, dtype=store.dtype)
        gpu.append((n, _seconds(lambda: expert_ffn(x, weights, act), device, repeats)))
        x_host = x.cpu()
        cpu_samples.append((n, _seconds(lambda: cpu.submit(key, x_host).result(), torch.device("cpu"), repeats)))
    store.release(slot)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    pinned = "pinned" if store.pinned else "pageable"
    return OffloadProfile(f"{name}, {pinned} host memory, CPU experts in {str(cpu.dtype).removeprefix('torch.')} "
                          f"on {cpu.threads} threads",
                          (ExpertCosts(store.expert_bytes, t_io, fit_line(gpu), fit_line(cpu_samples)),),
                          CostLine(0.0, 0.0))
