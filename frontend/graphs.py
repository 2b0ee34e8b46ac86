"""CUDA graphs for the decode pass: a step's kernels replayed in a few launches, not launched one by one.

On the H200 a 2-layer Mixtral decode pass took 3.4-4.6 ms at every batch size while its kernels
needed 0.5-1.5 ms (frontend_decode.py): the host launching hundreds of small kernels through
`transformers`' modules was the step. A captured graph launches them at once.

A pass over a given number of rows is captured into a *program*: segments of captured kernels,
with *cuts* between them where the host must act when it is replayed.
- A layer whose experts all run in this process is captured whole (the grouped GEMM). When every
  layer is, so is the counting beside it (tokens per expert, the load predictor's device work), over
  the real rows only: their number is a device scalar the program sets before each replay
  (`Recorder.real_rows`). Host work (routing records, the host's side of the counting) runs after
  the last segment, given the number of real rows (`Recorder.after`).
- A layer whose experts run elsewhere is a cut (`Recorder.cut`): the segment before it sorts the
  layer's (token, choice) pairs by expert and counts them, at replay the cut sends the real rows'
  pairs to their expert functions and the replies land in the buffer the next segment weighs and
  sums (dispatch.py). Where every such layer's functions are on this GPU and linked (`links`,
  expert_fn/device_link.py), there are no cuts: the program hands each layer to them and takes their
  outputs on the GPU, and its replay tells them the step started and waits for its end (bounded:
  a replay whose functions failed it raises VoidStep, and the step runs again eagerly, as calls).
A batch of 5 replays the program of 8 rows (ROW_BUCKETS); the 3 spare rows are one-token sequences
in spare cache rows (batch.py) that nothing but the graph sees. Programs hold for one cache
allocation and one set of in-process expert weights (`generation`): when either moves, they are
captured again.

The first step at a new size runs the program eagerly (the same code, each cut at once) on the
capture stream: that is the step itself and the warm-up a capture needs. The capture follows, and
the next step of that size replays it. A capture that fails switches graphs off for the frontend,
logged once, and decoding goes on eagerly.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol

import torch

from kubemoe.devices import graph_pool
from kubemoe.frontend.batch import BatchState

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)

Cut = Callable[[int], None]  # host work in a program, given the number of real rows


class ProgramLinks(Protocol):
    """A program's device links (expert_fn/device_link.py's StepLinks)."""

    def capture_end(self) -> None: ...  # queue the program's last work (captured)
    def start(self) -> None: ...  # before each replay
    def launched(self) -> None: ...  # after it was queued
    def finish(self) -> bool: ...  # for the oldest replay not finished: whether its outputs hold


class VoidStep(RuntimeError):
    """A replay whose outputs do not hold (a linked expert function failed it): run the step again."""

_current = threading.local()


def recording() -> "Recorder | None":
    """The recorder of the pass that this thread runs as a program, else None (an ordinary pass)."""
    return getattr(_current, "recorder", None)


class Recorder:
    """What a pass run as a program gives its layers. Eager (the first run): a cut runs at once, an
    `after` at the end of the pass. Capturing: a cut ends the segment being captured and starts the
    next; both are kept for the replays."""

    def __init__(self, rows: int, pool=None, capturing: bool = False, rows_on_device: torch.Tensor | None = None,
                 links=None):
        self.rows, self.pool, self.capturing = rows, pool, capturing
        self.links = links  # device links the captured layers may run through (dispatch.py), or None
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.cuts: list[Cut] = []
        self.afters: list[Cut] = []
        # A capture's is made before it begins, outside the graph's memory: a replay writes it from the host
        self.rows_on_device = rows_on_device
        self._graph: torch.cuda.CUDAGraph | None = None

    def real_rows(self, device: torch.device) -> torch.Tensor:
        """The number of real rows as an int32 device scalar, for work captured over all the rows that
        must count only those: a replay sets it first (Program.replay); an eager run holds `rows`."""
        if self.rows_on_device is None:
            self.rows_on_device = torch.full((), self.rows, dtype=torch.int32, device=device)
        return self.rows_on_device

    def cut(self, fn: Cut) -> None:
        if not self.capturing:
            _outside(fn, self.rows)
            return
        self._end()
        self.cuts.append(fn)
        self._begin()

    def after(self, fn: Cut) -> None:
        self.afters.append(fn)

    def _begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def _end(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.capture_end()
            self.segments.append(graph)

    def run_afters(self) -> None:
        for fn in self.afters:
            _outside(fn, self.rows)


def _outside(fn: Cut, rows: int) -> None:
    """Host work runs as an ordinary pass would run it, not recorded again."""
    recorder, _current.recorder = recording(), None
    try:
        fn(rows)
    finally:
        _current.recorder = recorder


@dataclass
class Program:
    segments: list[torch.cuda.CUDAGraph]
    cuts: list[Cut]  # cuts[i] runs between segments[i] and segments[i + 1]
    afters: list[Cut]
    logits: torch.Tensor  # [rows, V], written by the last segment
    rows_on_device: torch.Tensor  # what the captured work reads as the number of real rows
    links: ProgramLinks | None = None

    def replay(self, rows: int) -> torch.Tensor:  # -> logits of the real rows [rows, V]
        """Launch the program; with links, `settle` must follow before its outputs are read."""
        self.rows_on_device.fill_(rows)
        if self.links is not None:
            self.links.start()
        for i, graph in enumerate(self.segments):
            if i:
                self.cuts[i - 1](rows)
            graph.replay()
        if self.links is None:
            self._afters(rows)
        else:
            self.links.launched()
        return self.logits[:rows]

    def settle(self, rows: int) -> None:
        """The oldest unsettled replay's end, waited for (bounded), then its afters, which may wait for the
        GPU. VoidStep: its outputs do not hold."""
        assert self.links is not None
        if not self.links.finish():
            raise VoidStep("a device-linked expert function failed the step")
        self._afters(rows)

    def _afters(self, rows: int) -> None:
        for fn in self.afters:
            fn(rows)


def _pass(model: torch.nn.Module, state: BatchState, padded: int, recorder: Recorder) -> torch.Tensor:
    _current.recorder = recorder
    try:
        return model(**state.pass_inputs(padded), use_cache=True, logits_to_keep=1).logits[:, -1]
    finally:
        _current.recorder = None


def run_eagerly(model: torch.nn.Module, state: BatchState, padded: int, rows: int) -> torch.Tensor:
    """A program's pass over `padded` rows of `state` (prepared by state.advance) run as the layers record
    it, each cut at once and the afters at the end, launched op by op: the step itself the first time a
    size runs (and, on a CPU, what a replay would compute) -> logits of the `rows` real rows."""
    recorder = Recorder(rows)
    logits = _pass(model, state, padded, recorder)[:rows]
    recorder.run_afters()
    return logits


def padded_rows(rows: int, max_rows: int = ROW_BUCKETS[-1]) -> int | None:
    """The program size a pass of `rows` runs at; None beyond the largest (decoded eagerly)."""
    i = bisect.bisect_left(ROW_BUCKETS, rows)
    return ROW_BUCKETS[i] if i < len(ROW_BUCKETS) and ROW_BUCKETS[i] <= max_rows else None


class DecodeGraphs:
    """Decode passes as replayed programs, one per row bucket, for one BatchState allocation at a time."""

    def __init__(self, model: torch.nn.Module, generation: Callable[[], Hashable], max_rows: int = ROW_BUCKETS[-1],
                 links: Callable[[int], ProgramLinks | None] | None = None):
        self.model = model
        self.generation = generation  # the in-process expert weights' and links' (the dispatcher's): programs read them
        self.links = links  # the device links for a program of so many rows, or None (dispatch.py)
        self.max_rows = max_rows
        self.enabled = True
        self.captures = 0
        self._programs: dict[int, Program] = {}
        self._unsettled: collections.deque[tuple[Program, int]] = collections.deque()  # linked replays in flight
        self._key: Hashable = None
        self._pool: tuple | None = None  # graph_pool()
        self._stream = torch.cuda.Stream()

    def rows(self, rows: int) -> int | None:
        """The rows to prepare a pass of `rows` sequences for; None: decode it as an ordinary pass."""
        return padded_rows(rows, self.max_rows) if self.enabled else None

    def decode(self, state: BatchState, padded: int, rows: int, settle: bool = True) -> torch.Tensor:
        """One decode pass over `state`'s inputs, prepared for `padded` rows (state.advance) -> logits [rows, V].
        `settle=False`: a replay through device links is left unsettled, and `settle` must come before its
        logits are read; the next pass may be launched first (at most two in flight)."""
        self._check_key(state)
        program = self._programs.get(padded)
        if program is not None:
            logits = program.replay(rows)
            if program.links is not None:
                self._unsettled.append((program, rows))
                if settle:
                    try:
                        self.settle()
                    except VoidStep:
                        return self._eager(state, padded, rows)
            return logits
        logits = self._eager(state, padded, rows)
        try:
            self._programs[padded] = self._capture(state, padded, rows)
            self.captures += 1
        except Exception:  # noqa: BLE001 - graphs are a speed-up: without them the engine decodes as before
            log.exception("capturing the decode pass of %d rows failed: CUDA graphs are off for this frontend", padded)
            self.enabled = False
            self._programs.clear()
        return logits

    def launches_behind(self, state: BatchState, padded: int) -> bool:
        """Whether a pass of `padded` rows over `state` would only be queued (a replay without cuts), so
        it may be launched behind a linked replay not yet settled; anything else waits for the GPU, which
        that replay must not make it do unbounded: it settles first."""
        program = self._programs.get(padded)
        return program is not None and not program.cuts and self._key == (state.generation, self.generation())

    def settle(self, keep: int = 0) -> None:
        """Wait for the linked replays in flight, oldest first, until `keep` remain (each wait bounded).
        VoidStep: one of them does not hold (run it again: eagerly, as calls, since its links are gone)."""
        void = None
        while len(self._unsettled) > keep:
            program, rows = self._unsettled.popleft()
            try:
                program.settle(rows)
            except VoidStep as e:
                log.warning("%s: the decode step of %d rows runs again, as calls", e, len(program.logits))
                self._programs = {k: p for k, p in self._programs.items() if p is not program}
                void = e
        if void is not None:
            raise void

    def _check_key(self, state: BatchState) -> None:
        key = (state.generation, self.generation())
        if key != self._key:  # the cache, the weights or the links moved: every program reads old addresses
            self._programs.clear()
            self._key = key
        self._pool = graph_pool(self._pool, held=bool(self._programs))

    def _eager(self, state: BatchState, padded: int, rows: int) -> torch.Tensor:
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits = run_eagerly(self.model, state, padded, rows)
        torch.cuda.current_stream().wait_stream(stream)
        return logits

    def _capture(self, state: BatchState, padded: int, rows: int) -> Program:
        torch.cuda.synchronize()
        links = self.links(padded) if self.links is not None else None  # attaching may move the generation
        self._check_key(state)
        rows_on_device = torch.full((), rows, dtype=torch.int32, device="cuda")
        recorder = Recorder(rows, self._pool, capturing=True, rows_on_device=rows_on_device, links=links)
        with torch.cuda.stream(self._stream):
            recorder._begin()
            try:
                logits = _pass(self.model, state, padded, recorder)
                if links is not None:
                    links.capture_end()
            finally:
                recorder._end()  # a failed capture raises here too; the graph is dropped
        torch.cuda.synchronize()
        return Program(recorder.segments, recorder.cuts, recorder.afters, logits, rows_on_device, links)
