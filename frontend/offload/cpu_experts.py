"""CPU experts: the experts a schedule puts on the CPU, computed one after another beside the GPU work.

They read the weights straight from the store's host memory (never copied). One worker thread runs
them in turn, each on every core through torch's intra-op threads: what the cost model assumes (a
layer's CPU side is the sum of its experts' t_c). A worker per core, each with its own OpenMP team of
every core, ran a layer's CPU experts side by side with cores x experts threads: oversubscribed, and
each worker took the GIL from the thread that launches the GPU work. Every expert's wall time is kept
(`drain_timings`) so the executor refreshes t_c from what serving sees, not only from the start-up
profile. The compute dtype is
chosen once at start by timing one expert both ways: the checkpoint's (bf16 / fp16) where the CPU has
fast kernels for it, else float32 with the weights widened per call (CPUs without bf16 units run a
bf16 matmul many times slower than widening and running fp32). Shapes: N = an expert's tokens, H = hidden size.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from kubemoe.expert import ExpertWeights, expert_ffn
from kubemoe.frontend.offload.store import HostExperts, Key

log = logging.getLogger(__name__)

CpuJob = tuple[Key, torch.Tensor, torch.Tensor | None]  # (expert, x [N, H] on the host, where its output goes or None)


def _widen(weights: ExpertWeights, dtype: torch.dtype) -> ExpertWeights:
    if weights.gate_up.dtype == dtype:
        return weights
    return ExpertWeights(weights.gate_up.to(dtype), weights.down.to(dtype))


def choose_cpu_dtype(weights: ExpertWeights, act: Callable, tokens: int = 16, repeats: int = 3) -> torch.dtype:
    """The faster of the weights' own dtype and float32 (widened per call) for one expert on `tokens` tokens."""
    native = weights.gate_up.dtype
    if native == torch.float32:
        return native
    x = torch.randn(tokens, weights.hidden_size)
    timings: dict[torch.dtype, float] = {}  # seconds
    for dtype in (native, torch.float32):
        xs = x.to(dtype)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            expert_ffn(xs, _widen(weights, dtype), act)
            best = min(best, time.perf_counter() - start)
        timings[dtype] = best
    chosen = min(timings, key=timings.__getitem__)
    log.info("CPU experts compute in %s (one expert, %d tokens: %s)", str(chosen).removeprefix("torch."), tokens,
             ", ".join(f"{str(d).removeprefix('torch.')} {s * 1e3:.2f} ms" for d, s in timings.items()))
    return chosen


def default_threads() -> int:
    """Every core but one: the thread that runs the model launches the GPU work between and during the CPU
    experts, and an OpenMP team on every core (its threads spin a while after each matmul) took that thread's
    core away from it."""
    return max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) - 1)


class CpuExperts:
    def __init__(self, host: HostExperts, act: Callable, threads: int | None = None,
                 dtype: torch.dtype | None = None):
        self.host, self.act = host, act
        self.threads = threads or default_threads()  # intra-op threads of the one worker
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kubemoe-cpu-expert",
                                       initializer=lambda: torch.set_num_threads(self.threads))
        self.dtype = dtype or choose_cpu_dtype(host.weights((host.layers[0], 0)), act)
        self._timings: list[tuple[Key, int, float, float]] = []  # (key, tokens, start, end) per expert run
        self._lock = threading.Lock()

    def submit(self, jobs: Sequence[CpuJob], ready: torch.cuda.Event | None = None) -> Future[list[torch.Tensor]]:
        """A layer's CPU experts, (key, x [N, H] on the host, out or None) each -> future of their outputs
        [N, H] in this pool's dtype, run one after another as one task: one hand-over to the worker a layer
        (a wake-up and a turn at the GIL each), not one an expert. `ready`: an event after the copy that
        fills the xs, waited for on the worker (the thread that submits never waits for the device). `out`:
        where an output goes (e.g. its rows of a pinned block the caller copies to the device at once)."""
        return self.pool.submit(self.run, list(jobs), ready)

    def run(self, jobs: Sequence[CpuJob], ready: torch.cuda.Event | None = None) -> list[torch.Tensor]:
        if ready is not None:
            ready.synchronize()
        outs, timings = [], []
        with torch.inference_mode():  # per thread
            for key, x, out in jobs:
                start = time.perf_counter()
                y = expert_ffn(x.to(self.dtype), _widen(self.host.weights(key), self.dtype), self.act)
                outs.append(y if out is None else out.copy_(y))
                timings.append((key, x.shape[0], start, time.perf_counter()))
        with self._lock:
            self._timings += timings
        return outs

    def drain_timings(self) -> list[tuple[Key, int, float, float]]:
        """(key, tokens, start, end) of every expert run since the last call, in the order they ran."""
        with self._lock:
            timings, self._timings = self._timings, []
        return timings

    def close(self) -> None:
        self.pool.shutdown(wait=True)
