"""LayerScope's Timer at start: t_io, t_g and t_c of one expert measured through the store and the CPU pool.

It times what the executor will run: a copy into a device slot (three chunks, pinned or not), the
expert on the device at a few token counts (alone, and inside one grouped FFN of many where the kernels
group), and the same expert on the CPU in the dtype the pool chose; t_g and t_c are least-squares lines
over the token counts (`costs.fit_line`). t_attn starts at zero and
the executor refreshes it online from the time between one layer's experts and the next's (and t_c from
the CPU experts it serves).

Three things keep the figures true to serving:
- t_g and t_io are timed over calls queued back to back, as the executor queues a layer's experts and copies,
  never waiting for one: a synchronised call measures the round trip to the device instead (0.67 ms for a
  Qwen3-30B-A3B-size expert's FFN on the lent H100's host, 0.10 on the H200's, for a few microseconds of weight
  reads; a lone copy of that expert took 0.29 ms on the H100 where copies streamed at 0.18 ms each), and
  PreSched, pricing every copied expert so, sent experts to the CPU that the GPU would have run sooner;
- every token count up to `WARM_TOKENS` (what decode sends one expert) runs once on both sides first:
  the first call of a shape compiles or loads its kernels (oneDNN's JIT on the CPU; CUDA's lazy module
  loading, which also synchronises the device, on the GPU), and serving must not pay that mid-request
  nor the profile count it;
- each CPU sample reads another expert's weights, round robin over the model: serving meets an expert's
  weights in DRAM, and timing one expert again and again measures them from the host's last-level cache
  (hundreds of MB on the hosts GPUs sit in).
The sampled token counts reach a prefill expert's share (`TOKENS`), so t_c's slope is measured where
PreSched uses it, not extrapolated from a few tokens.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable

import torch

from kubemoe.expert import expert_ffn
from kubemoe.frontend.offload.costs import GROUPED_MIN_EXPERTS, CostLine, ExpertCosts, OffloadProfile, fit_line
from kubemoe.frontend.offload.cpu_experts import CpuExperts
from kubemoe.frontend.offload.store import ExpertStore
from kubemoe.moe import can_group, sorted_ffn, upload_ends

TOKENS = (1, 16, 64, 256)
WARM_TOKENS = 64
QUEUED_CALLS = 8  # device work timed per sample, back to back: the launch of one overlaps the run of another


def median_seconds(run: Callable[[], object], device: torch.device, repeats: int, calls: int = 1) -> float:
    """Median seconds per call of `run` (after one warm-up): `calls` calls queued back to back per sample, the
    device's queue drained around each sample."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            run()
        sync()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


@torch.inference_mode()
def measure_profile(store: ExpertStore, cpu: CpuExperts, act: Callable, slot: int, repeats: int = 3,
                    tokens: tuple[int, ...] = TOKENS, warm_tokens: int = WARM_TOKENS) -> OffloadProfile:
    """Figures for the store's expert size, timed in its device slots (every one free at the time of the call;
    `slot` for the expert on its own)."""
    device = store.device
    keys = [(layer, e) for layer in store.layers for e in range(store.host.num_experts)]
    cold = itertools.cycle(keys)  # the CPU's next expert: another one each call
    key = keys[0]

    def copy():
        store.copy(key, slot)
        store.wait_ready(slot)

    t_io = median_seconds(copy, device, repeats, QUEUED_CALLS)
    weights = store.slot_weights(slot)
    hidden = weights.hidden_size
    for n in sorted(set(range(1, warm_tokens + 1)) | set(tokens)):
        x = torch.randn(n, hidden, device=device, dtype=store.dtype)
        expert_ffn(x, weights, act)
        cpu.submit([(next(cold), x.cpu(), None)]).result()
    gpu, cpu_samples = [], []
    for n in tokens:
        x = torch.randn(n, hidden, device=device, dtype=store.dtype)
        gpu.append((n, median_seconds(lambda: expert_ffn(x, weights, act), device, repeats,  # noqa: B023 - called here
                                       QUEUED_CALLS)))
        x_host = x.cpu()
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            cpu.submit([(next(cold), x_host, None)]).result()
            runs.append(time.perf_counter() - start)
        cpu_samples.append((n, statistics.median(runs)))
    cpu.drain_timings()  # the profile's runs are not serving's
    grouped = _grouped_line(store, act, keys, tokens, repeats)
    store.release(slot)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    pinned = "pinned" if store.pinned else "pageable"
    return OffloadProfile(f"{name}, {pinned} host memory, CPU experts in {str(cpu.dtype).removeprefix('torch.')} "
                          f"one at a time on {cpu.threads} threads, weights read cold",
                          (ExpertCosts(store.expert_bytes, t_io, fit_line(gpu), fit_line(cpu_samples), grouped),),
                          CostLine(0.0, 0.0))


def _grouped_line(store: ExpertStore, act: Callable, keys: list[tuple[int, int]], tokens: tuple[int, ...],
                  repeats: int) -> CostLine | None:
    """t_g per expert inside one grouped FFN over the slot stack, as the executor runs a layer's experts on the
    device: 2 x GROUPED_MIN_EXPERTS experts (or every slot) with n tokens each, the time shared among them
    (slots free at the call: they get the first of `keys`, real weights as serving reads; uninitialised
    memory may hold denormals, which the CPU multiplies many times slower). None where it cannot group."""
    hidden, intermediate = store.host.down_shape
    if not can_group(store.dtype, store.device, hidden, intermediate) or store.num_slots < GROUPED_MIN_EXPERTS:
        return None
    stack, experts = store.stacked(), min(store.num_slots, 2 * GROUPED_MIN_EXPERTS)
    for slot, key in zip(range(experts), itertools.cycle(keys)):
        store.copy(key, slot)
        store.wait_ready(slot)
    samples = []
    for n in tokens:
        x = torch.randn(experts * n, hidden, device=store.device, dtype=store.dtype)
        ends = upload_ends([n * min(e + 1, experts) for e in range(store.num_slots)], store.device)
        seconds = median_seconds(lambda: sorted_ffn(x, ends, stack, act), store.device, repeats,  # noqa: B023 - called here
                                 QUEUED_CALLS)
        samples.append((n, seconds / experts))
    store.release(*range(experts))
    return fit_line(samples)
