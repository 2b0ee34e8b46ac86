"""AsyncIO (LayerScope): every expert's weights in host memory, fixed device slots, chunked copies.

`HostExperts`: one flat tensor per MoE layer, [E, S], each expert laid out gate | up | down (gate_up is the first
2IH elements as [2I, H], down the rest as [H, I]: `kubemoe.expert.ExpertWeights`), page-locked with
cudaHostRegister when CUDA is available. Memory that cannot be pinned is logged and stays pageable:
copies are slower, nothing fails. Several stores may share it (the benchmark runs every policy on one).
`ExpertStore`: one device tensor [N, S] allocated once and cut into slots of the
largest expert; what each slot holds is the executor's business (hot table, two on-demand slots,
prefetch groups). Nothing is allocated per transfer.

A copy is three chunks (gate, up, down), each on its own CUDA stream. Per slot the store keeps the
events of its last copy (compute waits for those, and only those: `wait_ready`) and the event recorded
after the last kernel that read it (`release`; the next copy into the slot waits for it), so a copy
never overwrites weights a kernel still reads. Experts computed together (one grouped FFN) are copied
together (`copy_many`): each stream takes its chunk of every one of them and records one event, so the
host's work per copy is one call, not five (at Qwen3-30B-A3B size it issues tens of copies a layer). Without CUDA the "device" is the CPU and a copy is a
plain synchronous copy: the same code runs, without streams or events (what CI exercises).
Shapes: E = experts per layer, I = expert intermediate size, H = hidden size, S = 3 I H, N = slots.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kubemoe.expert import ExpertWeights
from kubemoe.moe import StackedExperts

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (layer, expert)
CHUNKS = ("gate", "up", "down")


def pin_host(tensor: torch.Tensor) -> None:
    """Page-lock `tensor`'s memory in place (exact size; torch's pinned allocator rounds up to a power of two)."""
    from torch.cuda._pin_memory_utils import pin_memory

    pin_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def unpin_host(tensor: torch.Tensor) -> None:
    from torch.cuda._pin_memory_utils import unpin_memory

    unpin_memory(tensor.data_ptr())


def pin_all(tensors: list[torch.Tensor], pin: Callable[[torch.Tensor], None] = pin_host,
            unpin: Callable[[torch.Tensor], None] = unpin_host) -> list[torch.Tensor]:
    """Pin every tensor, or none: the pinned ones, or [] after a logged failure (pageable memory still works)."""
    pinned = []
    try:
        for tensor in tensors:
            pin(tensor)
            pinned.append(tensor)
        return pinned
    except Exception as e:  # noqa: BLE001 - any failure to pin leaves pageable memory, which still works
        size = sum(t.numel() * t.element_size() for t in tensors)
        log.warning("could not pin %.2f GiB of expert weights in host memory (%s): copies use pageable memory and "
                    "run slower; free host memory or raise the locked-memory limit (ulimit -l)", size / 2**30, e)
        for tensor in pinned:
            unpin(tensor)
        return []


@dataclass
class _SlotSync:
    ready: list = field(default_factory=list)  # events of the last copy into the slot, one per chunk stream
    free: object = None  # event after the last kernel that read the slot
    waited: set = field(default_factory=set)  # streams (handles) already ordered after `ready`


@dataclass
class _CopyTiming:
    nbytes: int
    start: torch.cuda.Event
    ends: list[torch.cuda.Event]


def covered(spans: Sequence[tuple[float, float]]) -> float:
    """Length of the union of the intervals (start, end): time in which at least one of them was running."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class HostExperts:
    """Every expert's weights in host memory, [E, S] per MoE layer, pinned when CUDA is available."""

    def __init__(self, layers: Sequence[int], num_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype, load: Callable[[int, int], ExpertWeights], pin_memory: bool | None = None,
                 pin: Callable[[torch.Tensor], None] = pin_host):
        self.layers, self.num_experts, self.dtype = tuple(layers), num_experts, dtype
        i, h = intermediate_size, hidden_size
        self.gate_up_shape, self.down_shape = (2 * i, h), (h, i)
        self.chunks = ((0, i * h), (i * h, 2 * i * h), (2 * i * h, 3 * i * h))  # gate | up | down, elements
        self.slot_elems = 3 * i * h
        self.expert_bytes = self.slot_elems * dtype.itemsize
        self.rows: dict[int, torch.Tensor] = {}  # layer -> [E, S]
        self._chunk_views: dict[Key, tuple[torch.Tensor, ...]] = {}
        for layer in self.layers:
            self.rows[layer] = torch.empty((num_experts, self.slot_elems), dtype=dtype)
            for expert in range(num_experts):
                self.weights((layer, expert)).copy_(load(layer, expert))
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self._pinned = pin_all(list(self.rows.values()), pin) if pin_memory else []
        self.pinned = bool(self._pinned)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.rows.values())

    def views(self, row: torch.Tensor) -> ExpertWeights:  # [S] -> weights viewing it
        split = self.chunks[1][1]
        return ExpertWeights(row[:split].view(self.gate_up_shape), row[split:].view(self.down_shape))

    def row(self, key: Key) -> torch.Tensor:  # [S]
        layer, expert = key
        return self.rows[layer][expert]

    def cut(self, row: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [S] -> views of its `chunks` (gate, up, down)
        return tuple(row[a:b] for a, b in self.chunks)

    def chunk_views(self, key: Key) -> tuple[torch.Tensor, ...]:
        """`key`'s row `cut`, made once: a copy reads them every time the expert is copied, and cutting them again
        cost six tensor views an expert on the host that issues the copies."""
        views = self._chunk_views.get(key)
        if views is None:
            views = self._chunk_views[key] = self.cut(self.row(key))
        return views

    def weights(self, key: Key) -> ExpertWeights:
        return self.views(self.row(key))

    def close(self) -> None:
        for tensor in self._pinned:
            try:
                unpin_host(tensor)
            except Exception:  # noqa: BLE001 - closing must not fail
                log.exception("unpinning expert memory failed")
        self._pinned.clear()


class ExpertStore:
    """Device slots for the experts of `host`, and the copies into them."""

    def __init__(self, host: HostExperts, device: torch.device, slots: int, async_io: bool = True,
                 timing: bool = False):
        self.host, self.layers, self.dtype = host, host.layers, host.dtype
        self.expert_bytes = host.expert_bytes
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slots = torch.empty((slots, host.slot_elems), dtype=host.dtype, device=self.device)  # [N, S]
        self._sync = [_SlotSync() for _ in range(slots)]
        # Each slot's weights as the FFN reads them, made once: five tensor views a computed expert otherwise
        self._slot_weights = [host.views(slot) for slot in self.slots]
        if self.cuda:
            self._slot_chunks = [host.cut(slot) for slot in self.slots]  # made once, as chunk_views
            # AsyncIO: a stream per chunk; without it (the ablation) the copies queue on the compute stream.
            self.streams = ([torch.cuda.Stream(self.device) for _ in CHUNKS] if async_io
                            else [torch.cuda.default_stream(self.device)] * len(CHUNKS))
        self.async_io = async_io
        self.timing = timing and self.cuda
        self._timings: list[_CopyTiming] = []

    @property
    def pinned(self) -> bool:
        return self.host.pinned

    @property
    def num_slots(self) -> int:
        return len(self._sync)

    def host_weights(self, key: Key) -> ExpertWeights:
        return self.host.weights(key)

    def slot_weights(self, slot: int) -> ExpertWeights:
        return self._slot_weights[slot]

    # -- copies and their events ----------------------------------------------------------------

    def copy(self, key: Key, slot: int) -> None:
        """Start copying `key`'s weights into `slot`, once every kernel that read the slot is done."""
        self.copy_many([(key, slot)])

    def copy_many(self, pairs: Sequence[tuple[Key, int]]) -> None:
        """Start copying each (key, slot) of `pairs` (distinct slots) once every kernel that read those slots is
        done; the slots are ready together (`wait_ready` of any of them waits for all)."""
        if not pairs:
            return
        if not self.cuda:
            for key, slot in pairs:
                self.slots[slot].copy_(self.host.row(key))
            return
        frees = list({id(e): e for e in (self._sync[slot].free for _, slot in pairs) if e is not None}.values())
        chunks = [(self.host.chunk_views(key), self._slot_chunks[slot]) for key, slot in pairs]
        start = torch.cuda.Event(enable_timing=True) if self.timing else None
        ready = []
        # The copies queue on the chunk streams made current by set_stream: `with torch.cuda.stream(...)` asked
        # for the current stream and device again on entry and exit, three times a call.
        compute = torch.cuda.current_stream(self.device)
        try:
            for n, stream in enumerate(self.streams):
                for free in frees:
                    stream.wait_event(free)
                if start is not None:
                    if n == 0:
                        start.record(stream)
                    else:
                        stream.wait_event(start)
                torch.cuda.set_stream(stream)
                for src, dst in chunks:
                    dst[n].copy_(src[n], non_blocking=True)
                event = torch.cuda.Event(enable_timing=self.timing)
                event.record(stream)
                ready.append(event)
        finally:
            torch.cuda.set_stream(compute)
        for _, slot in pairs:
            sync = self._sync[slot]
            sync.ready, sync.waited = ready, set()
        if start is not None:
            self._timings.append(_CopyTiming(len(pairs) * self.expert_bytes, start, ready))

    def wait_ready(self, *slots: int) -> None:
        """The compute stream waits for the last copies into `slots` (and for nothing else), once per copy: a
        resident expert's slot is read every forward pass, and waiting again for its copy's three events, long
        done, cost tens of host microseconds a layer where tens of experts are resident. Slots copied together
        share their events: each is waited for once."""
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            handle, waited = stream.cuda_stream, set()
            for slot in slots:
                sync = self._sync[slot]
                if handle not in sync.waited:
                    for event in sync.ready:
                        if id(event) not in waited:
                            stream.wait_event(event)
                            waited.add(id(event))
                    sync.waited.add(handle)

    def release(self, *slots: int) -> None:
        """Every kernel that reads `slots` is queued: the next copy into one of them waits for them."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            for slot in slots:
                self._sync[slot].free = event

    def stacked(self) -> StackedExperts:
        """Every slot as one expert stack, slot i at index i: views of the slots' memory, for one grouped FFN
        over the experts some slots hold (`moe.sorted_ffn`; a slot without rows is not read)."""
        split, n = self.host.chunks[1][1], self.num_slots
        return StackedExperts(self.slots[:, :split].view(n, *self.host.gate_up_shape),
                              self.slots[:, split:].view(n, *self.host.down_shape))

    def copy_seconds(self) -> tuple[int, float]:
        """(bytes, seconds) of the copies timed since the last call; seconds the link had a copy in flight, each
        copy (or `copy_many`) from its first chunk's start to its last chunk's end, overlapping copies counted once
        (waits for the GPU; with timing on only). Summed instead, two copies sharing the link would each count the time they
        shared, and the link would look half as fast as it ran."""
        timings, self._timings = self._timings, []
        if not timings:
            return 0, 0.0
        timings[-1].ends[-1].synchronize()
        torch.cuda.synchronize(self.device)
        origin = timings[0].start
        spans = [(origin.elapsed_time(t.start), max(origin.elapsed_time(e) for e in t.ends)) for t in timings]
        return sum(t.nbytes for t in timings), covered(spans) / 1e3

    def close(self) -> None:
        """Wait for the copies in flight (the host memory stays: it may serve another store)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
