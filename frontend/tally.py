"""Routed tokens per expert, counted on the device and read by the host once per flush.

The in-process path of a layer never waits for the GPU (dispatch.py); counting its tokens per
expert on the host would. Each layer's counts add up in a device tensor instead, and a flush (every
`flush_every` steps, and before every load report or metrics scrape) reads them all in one copy and
hands them to the load recorder and the metrics.

A decode pass replayed as a CUDA graph (graphs.py) runs over more rows than it has sequences (its
row bucket): its counting is captured with the pass and counts only the first `rows` rows, a device
scalar the program sets before each replay (`count_rows`). Counting after the replay instead, op by
op on the real rows, cost about 6 ms a step at 48 layers on the H200 (frontend_full_h200.json).
Shapes: L = layers counted, E = experts, T = rows, K = choices per row.
"""

from __future__ import annotations

import functools
import threading

import torch

from kubemoe import moe_kernels
from kubemoe.frontend.predictor_train import row_hits


def count_rows(index: torch.Tensor, rows: torch.Tensor | None, counts: torch.Tensor | None = None,
               against: torch.Tensor | None = None, hits: torch.Tensor | None = None) -> None:
    """Over the first `rows` rows of `index` [T, K] (all of them where `rows` is None; else an int32
    device scalar): counts[e] += the pairs that chose e ([E] int64), and hits += the pairs whose
    expert is also in the same row of `against` [T, K'] ([] int64). Experts within one row of either
    are distinct. Never waits for the device: on a GPU one kernel, elsewhere a few torch ops."""
    if moe_kernels.available(index.device):
        _count_rows_kernel(index, rows, counts, against, hits)
        return
    live = None if rows is None else torch.arange(index.shape[0], device=index.device) < rows  # [T]
    if counts is not None:
        flat = index.reshape(-1)
        ones = torch.ones_like(flat) if live is None else live.repeat_interleave(index.shape[1]).to(flat.dtype)
        # index_add_, not bincount: bincount sizes its output from the largest id, which a CUDA
        # tensor can only tell the host by waiting for the GPU
        counts.index_add_(0, flat, ones)
    if against is not None and hits is not None:
        per_row = row_hits(index, against)  # [T]
        hits += (per_row if live is None else per_row * live).sum()


def drain(tensor: torch.Tensor) -> list:
    """The values added since the last drain, as host lists, taken out of `tensor`. A snapshot is
    subtracted, not the tensor zeroed: an add queued meanwhile by a graph replay on the same stream
    stays for the next drain instead of being lost. The one read of the device."""
    with torch.inference_mode():  # the engine's passes may have made it an inference tensor
        snapshot = tensor.clone()
        tensor.sub_(snapshot)
    return snapshot.tolist()


class DeviceTally:
    def __init__(self, layers: tuple[int, ...] | list[int], num_experts: int, record, flush_every: int = 32):
        self.num_experts, self.flush_every = num_experts, flush_every
        self._record = record  # callable(layer, [(expert, tokens)]) run at each flush with that layer's counts
        self._row = {layer: i for i, layer in enumerate(layers)}
        # [L, E] int64 on the device of the first counts, made once: graph replays add into it by address
        self._counts: torch.Tensor | None = None
        self._lock = threading.Lock()  # adds run on the engine's threads, flushes also on the HTTP thread
        self._steps = 0

    def counts_of(self, layer: int, device: torch.device) -> torch.Tensor:  # -> [E], a view that stays put
        with self._lock:
            if self._counts is None:
                self._counts = torch.zeros(len(self._row), self.num_experts, dtype=torch.int64, device=device)
            return self._counts[self._row[layer]]

    def add(self, layer: int, counts: torch.Tensor) -> None:  # [E]
        self.counts_of(layer, counts.device).add_(counts)

    def add_rows(self, layer: int, index: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Count the first `rows` rows of `index` [T, K] (see count_rows) for `layer`."""
        count_rows(index, rows, self.counts_of(layer, index.device))

    def step(self) -> None:
        """One engine step ended: flush every `flush_every` steps."""
        self._steps += 1
        if self._steps % self.flush_every == 0:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if self._counts is None:
                return
            counts = drain(self._counts)  # [L, E]
        for layer, i in self._row.items():
            row = counts[i]
            if any(row):
                self._record(layer, [(e, n) for e, n in enumerate(row) if n])


def _count_rows_kernel(index, rows, counts, against, hits) -> None:
    import triton

    t, k = index.shape
    index = index.contiguous()
    against_ = index if against is None else against.contiguous()
    # A pointer the kernel never reads stands in for an absent argument (the COUNT/SCORE flags say which)
    block = 256  # one size for every row count: a kernel compiled once, not once per bucket
    _make_kernel()[(triton.cdiv(t, block),)](
        index, index if rows is None else rows, index if counts is None else counts, against_,
        index if hits is None else hits, t, K=k, A=against_.shape[1], LIMIT=rows is not None,
        COUNT=counts is not None, SCORE=against is not None and hits is not None, BLOCK_T=block)


@functools.cache
def _make_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["T"])
    def count_rows_kernel(index_ptr, rows_ptr, counts_ptr, against_ptr, hits_ptr, T,
                          K: tl.constexpr, A: tl.constexpr, LIMIT: tl.constexpr, COUNT: tl.constexpr,
                          SCORE: tl.constexpr, BLOCK_T: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        end = T
        if LIMIT:
            end = tl.minimum(tl.load(rows_ptr).to(tl.int32), T)
        live = t < end
        got = tl.zeros((BLOCK_T,), dtype=tl.int64)
        for k in tl.static_range(K):
            e = tl.load(index_ptr + t * K + k, mask=live, other=0)
            if COUNT:
                tl.atomic_add(counts_ptr + e, tl.full((BLOCK_T,), 1, tl.int64), mask=live)
            if SCORE:
                for a in tl.static_range(A):
                    other = tl.load(against_ptr + t * A + a, mask=live, other=-1)
                    got += (live & (e == other)).to(tl.int64)
        if SCORE:
            tl.atomic_add(hits_ptr, tl.sum(got, axis=0))

    return count_rows_kernel
