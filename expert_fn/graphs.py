"""CUDA graphs of expert FFNs: an expert's call is one graph launch instead of five kernel launches.

On the H200 host each eager launch costs 10-30 us of Python, torch and driver on the request's
path, more on a core that has just waited. Measured with benchmarks/round_cost.py at Mixtral size
and 64 tokens, a round from pinned shared memory (copy in, FFN, copy back, synchronise) took 203
us eagerly and 150 us with the FFN replayed as a graph (215 and 194 on another day).

One graph per (expert, bucket), where the bucket is the call's token count rounded up: to a power
of two up to 64, to a multiple of 64 above (padding costs little while the expert is bound by
reading its weights). Calls over `max_tokens` run eagerly: their kernels outlast their launches.
All graphs read one static input and write one static output, [max_tokens, H], and share one
memory pool: rounds run one at a time on one stream, and what a graph wrote is copied out (in
stream order) before the next replay overwrites it. Rows past a call's tokens hold whatever an
earlier call left there; an FFN treats rows independently, so they never reach the call's rows.

A call whose rows lie in pinned shared memory runs as one launch, its copies included: each graph
also comes as a RoundGraph (round_graph.py) around it, re-pointed at the call's rows.

The expert function captures every bucket's graph of the experts it loads before it reports ready
(prepare: a millisecond or so per graph); one missing, say after a reload raced a call, is captured
when first called. A graph is replayed only with the weights it was captured with: it reads their
memory by address, so an Unload (or a reload) retires it, and so does a new stack of its layer
(store.py), which gives every expert of the layer new weights; a Load into a stack's empty slots
leaves the other experts' graphs as they are.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple

import torch

from kubemoe.bundles import ExpertKey
from kubemoe.devices import captured, empty_cache, graph_pool
from kubemoe.expert import ExpertWeights, expert_ffn
from kubemoe.expert_fn import round_graph
from kubemoe.expert_fn.round_graph import CudaError, RoundGraph

if TYPE_CHECKING:
    from kubemoe.expert_fn.batcher import ComputeClock

DEFAULT_MAX_TOKENS = 256
log = logging.getLogger(__name__)


def bucket(tokens: int) -> int:
    """The token count a call of `tokens` runs padded to."""
    return 1 << (tokens - 1).bit_length() if tokens <= 64 else -(-tokens // 64) * 64


class ExpertGraphs:
    def __init__(self, hidden_size: int, act: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
                 dtype: torch.dtype, max_tokens: int = DEFAULT_MAX_TOKENS):
        self.max_tokens, self._act = max_tokens, act
        self.input = torch.zeros(bucket(max_tokens), hidden_size, device=device, dtype=dtype)
        self.output = torch.zeros_like(self.input)
        self._pool: tuple | None = None  # graph_pool(): made at the first capture
        self._side = torch.cuda.Stream(device)  # captures run on a stream of their own, as CUDA requires
        self._warm: set[int] = set()  # sizes run once eagerly
        # Rounds run on the device's current stream; nothing in an expert function changes it.
        self._stream = torch.cuda.current_stream(device).cuda_stream
        # Where round graphs' copies point until their first call: they must start on pinned host memory.
        self._host = torch.empty(self.input.shape, dtype=dtype, pin_memory=True) if round_graph.runtime() else None
        self._graphs: dict[tuple[ExpertKey, int], _Graphs] = {}  # by (key, bucket)
        self._uncaptured: dict[tuple[ExpertKey, int], weakref.ref] = {}  # captures out of memory: of these weights

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: ExpertKey, weights: ExpertWeights, rows: list[torch.Tensor],
            clock: ComputeClock) -> torch.Tensor | None:
        """expert_ffn of `rows` stacked ([N, H]; each on the CPU, pinned, or on the device): a view of
        the static output, valid until the next run. None when N is 0 or over max_tokens (run it eagerly).

        Queues the copies in, the replay (between clock.start and clock.stop) and nothing else."""
        tokens = sum(r.shape[0] for r in rows)
        if not 0 < tokens <= self.max_tokens:
            return None
        entry = self._entry(key, weights, bucket(tokens))
        if entry is None:
            return None
        graph = entry.ffn
        start = 0
        for r in rows:
            self.input[start:start + r.shape[0]].copy_(r, non_blocking=True)
            start += r.shape[0]
        clock.start()
        graph.replay()
        clock.stop()
        return self.output[:tokens]

    def run_pinned(self, key: ExpertKey, weights: ExpertWeights, rows: torch.Tensor, out: torch.Tensor,
                   clock: ComputeClock) -> bool:
        """expert_ffn of `rows` into `out` (may be `rows` itself): both [N, H], contiguous, in the
        graphs' dtype, in host memory registered with CUDA (a pinned segment). Queues one launch,
        copies included, and nothing else; False (nothing queued) when N is 0 or over max_tokens, or
        round graphs are unavailable: run() it then."""
        tokens = rows.shape[0]
        if self._host is None or not 0 < tokens <= self.max_tokens or rows.dtype != self.input.dtype:
            return False
        entry = self._entry(key, weights, bucket(tokens))
        whole = entry.whole if entry is not None else None
        if whole is None:
            return False
        try:
            whole.launch(rows.data_ptr(), out.data_ptr(), rows.nbytes, self._stream)
        except CudaError as e:  # nothing was queued: this call, and the ones after it, take run()
            self._no_round_graphs(e)
            return False
        clock.include(whole)
        return True

    async def prepare(self, experts: Iterable[tuple[ExpertKey, ExpertWeights]]) -> None:
        """Capture every size's graph of these experts now, one graph per turn of the event loop (a
        millisecond or so each: rounds go on in between), so no call pays for a capture."""
        for key, weights in experts:
            for size in self.sizes:
                self._entry(key, weights, size)
                await asyncio.sleep(0)

    @property
    def sizes(self) -> list[int]:
        return sorted({bucket(n) for n in range(1, self.max_tokens + 1)})

    def _entry(self, key: ExpertKey, weights: ExpertWeights, size: int) -> _Graphs | None:
        """The graphs of `key` at `size`, captured now if they are not held; None (run it eagerly) when the
        capture ran out of device memory, and a graph is an optimisation no call should fail for. Not tried
        again for the same weights (a Load that restacks the layer gives new ones).
        A function at its cap (--working-memory-mib) cannot free its cache during a capture: after a Load
        the cache holds the stacks it replaced (900 MiB of a 2.3 GiB cap on the H100, moeless_live.py), so
        a capture that runs out of memory is tried once more with the cache given back (empty_cache waits
        for the work queued on the device: once after a Load, not per call)."""
        failed = self._uncaptured.get((key, size))
        if failed is not None and failed() is weights:
            return None
        try:
            try:
                return self._held_or_captured(key, weights, size)
            except torch.OutOfMemoryError:
                if torch.cuda.memory_reserved(self.input.device) == torch.cuda.memory_allocated(self.input.device):
                    raise  # nothing cached to give back
                empty_cache()
                return self._held_or_captured(key, weights, size)
        except torch.OutOfMemoryError as e:
            self._uncaptured[(key, size)] = weakref.ref(weights)
            log.warning("no device memory to capture the graph of %s at %d tokens; its calls run eagerly: %s",
                        key, size, str(e).splitlines()[0])
            return None

    def _held_or_captured(self, key: ExpertKey, weights: ExpertWeights, size: int) -> _Graphs:
        held = self._graphs.get((key, size))
        if held is not None and held.weights() is weights:
            return held
        self._graphs = {k: v for k, v in self._graphs.items() if v.weights() is not None}  # forget unloaded experts'
        self._uncaptured = {k: w for k, w in self._uncaptured.items() if w() is not None}
        self._pool = graph_pool(self._pool, held=bool(self._graphs))
        x, y = self.input[:size], self.output[:size]
        current = torch.cuda.current_stream()
        self._side.wait_stream(current)  # what the device is still doing with input and output comes first
        try:
            with torch.cuda.stream(self._side):
                if size not in self._warm:  # once per shape outside a capture: cuBLAS settles its kernels and workspace
                    expert_ffn(x, weights, self._act, out=y)
                    self._warm.add(size)
                # Not torch.cuda.graph(): it also synchronises, collects garbage and empties the allocator's
                # cache, each time: tens of milliseconds. thread_local: a Load copying weights on another
                # thread meanwhile is not part of the capture.
                graph = torch.cuda.CUDAGraph(keep_graph=True)  # its nodes go into the RoundGraph too
                with captured(graph, self._pool):
                    expert_ffn(x, weights, self._act, out=y)
        finally:  # a failed capture too: the warm-up's writes to the output come before the next round's
            current.wait_stream(self._side)
        graph.instantiate()
        entry = self._graphs[(key, size)] = _Graphs(weakref.ref(weights), graph, self._whole(graph, x, y))
        return entry

    def _whole(self, graph: torch.cuda.CUDAGraph, x: torch.Tensor, y: torch.Tensor) -> RoundGraph | None:
        if self._host is None:
            return None
        try:
            return RoundGraph(graph, x, y, self._host[:x.shape[0]])
        except CudaError as e:  # the FFN graphs still serve, with their copies queued one by one
            self._no_round_graphs(e)
            return None

    def _no_round_graphs(self, error: CudaError) -> None:
        log.warning("calls from pinned memory now copy their rows with calls of their own: %s", error)
        self._host = None


class _Graphs(NamedTuple):
    weights: weakref.ref  # the weights they read (by address)
    ffn: torch.cuda.CUDAGraph  # the expert's FFN on `size` rows of input into output
    whole: RoundGraph | None  # the same with its copies from and to pinned host memory
