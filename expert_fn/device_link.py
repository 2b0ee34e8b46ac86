"""The device link: a frontend and an expert function on the same GPU hand a decode step's layers to
each other on the GPU alone.

Through shared memory and the lane (shm.py, lane.py) a remote layer's rows still go device -> host ->
device and back, and the frontend waits for its GPU before each layer's calls and for the calls
before it launches anything more. On the H200 at 1bfb8e1 a 2-layer Mixtral decode step with its
experts in 2 expert functions on the frontend's GPU took 8.0 ms at batch 32 (MPS) against 2.2 ms in
process. Linking each layer through CUDA IPC events (1f2c481 to 486e2e6) took it to 4.4 ms: the host
still made a round trip to each function per layer, to learn that its done event was recorded.

Here the frontend lends each function device buffers through CUDA IPC (AttachDevice in the proto):
`rows` (a layer's rows sorted by expert), `ends` (where each expert's rows end) and `out` (the rows'
outputs: each function writes its own rows there, the rest to the last, scratch row), shared by every
link, and per link `flags` (gpu_flags.py: go[layer], done[layer], void). A captured decode program
(frontend/graphs.py) queues, per linked layer, the rows gathered into `rows` and the copy into `ends`,
go[layer] for each function of the layer, then per function a wait for done[layer]; its next kernel
reads the outputs from `out`. (Per-link `out`s, each function's rows taken from its own, cost a
kernel per function and layer; the buffers shared, a linked layer takes about as many kernels as an
in-process one, plus its flags.) Before each replay the frontend sends each linked function one step
packet (the rows and, per layer, the experts it expects there); the function replays its own program
for that packet, captured on first sight: per layer, wait for go, the FFN of its own rows (found on the
device from `ends`), done. Neither side's host waits for anything within a step; the frontend waits for
the step's end (bounded: a function that never signals voids the step, which runs again as calls).

A function that ends a link while a step may still wait on it (shutdown, a frontend gone) first sets
`void`, then every go flag: its program runs out on whatever is in `rows`, and the frontend, which
reads `void` after each step, throws that step away.

What both sides must agree on lives here: the packets, the buffers' sharing and layout, and which rows
are whose (`owned_rows`, `row_groups`). Same GPU means same node: the socket lies in the shared
`--shm-dir`, and torch's IPC bookkeeping in the host's /dev/shm.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hmac
import logging
import math
import os
import secrets
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from kubemoe import moe_kernels, wire
from kubemoe.devices import captured, graph_pool
from kubemoe.expert_fn import gpu_flags
from kubemoe.expert_fn.lane import listen_socket, peer_uid, socket_address
from kubemoe.moe import StackedExperts, sorted_ffn
from kubemoe.proto import kubemoe_pb2 as pb

log = logging.getLogger(__name__)

SOCKET_PREFIX = "kubemoe-device"
TOKEN_BYTES = 16
QUEUED, REFUSED = 0, 1  # a step packet's answer: its first byte (REFUSED: then why, in UTF-8)
_STEP = struct.Struct("<II")  # rows, layers; then per layer its id (uint32) and the experts' bitmask
_LAYER = struct.Struct("<I")
ACCEPT_SECONDS = 10.0
DRAIN_SECONDS = 5.0  # how long a closing link lets a step in flight finish before it voids it


class LinkError(ConnectionError):
    """The link cannot serve (closed, refused, timed out): the caller sends the layers another way."""


# -- packets --------------------------------------------------------------------------------------


def experts_mask(experts: Sequence[int], num_experts: int) -> bytes:
    mask = bytearray((num_experts + 7) // 8)
    for e in experts:
        mask[e // 8] |= 1 << (e % 8)
    return bytes(mask)


def mask_experts(mask: bytes, num_experts: int) -> list[int]:
    return [e for e in range(num_experts) if mask[e // 8] >> (e % 8) & 1]


def max_packet_bytes(num_layers: int, num_experts: int) -> int:
    return _STEP.size + num_layers * (_LAYER.size + (num_experts + 7) // 8)


def pack_step(rows: int, plan: Mapping[int, Sequence[int]], num_experts: int) -> bytes:
    """A step packet: its rows, and per linked layer (in the order the step runs them) the experts the
    frontend takes from this function."""
    return _STEP.pack(rows, len(plan)) + b"".join(_LAYER.pack(layer) + experts_mask(experts, num_experts)
                                                  for layer, experts in plan.items())


def unpack_step(packet: bytes, num_experts: int, max_rows: int, layers: Sequence[int]) -> tuple[int, dict[int, list[int]]]:
    """-> (rows, {layer: experts}); ValueError saying what is wrong with the packet. `layers`: the model's MoE layers."""
    mask_bytes = (num_experts + 7) // 8
    if len(packet) < _STEP.size:
        raise ValueError(f"a step packet starts with {_STEP.size} bytes (rows, layers), got {len(packet)}")
    rows, count = _STEP.unpack_from(packet)
    if len(packet) != max_packet_bytes(count, num_experts):
        raise ValueError(f"a step packet of {count} layers of this model is {max_packet_bytes(count, num_experts)} "
                         f"bytes, got {len(packet)}")
    if not 0 < rows <= max_rows:
        raise ValueError(f"rows {rows} must be 1..{max_rows} (the attached buffers' rows)")
    plan: dict[int, list[int]] = {}
    for i in range(count):
        at = _STEP.size + i * (_LAYER.size + mask_bytes)
        (layer,) = _LAYER.unpack_from(packet, at)
        mask = packet[at + _LAYER.size:at + _LAYER.size + mask_bytes]
        if layer not in layers or layer in plan:
            raise ValueError(f"layer {layer} is not an MoE layer of this model, or named twice")
        if num_experts % 8 and mask[-1] >> (num_experts % 8):
            raise ValueError(f"the experts' bitmask of layer {layer} names experts beyond the model's {num_experts}")
        plan[layer] = mask_experts(mask, num_experts)
        if not plan[layer]:
            raise ValueError(f"layer {layer} names no expert")
    if not plan:
        raise ValueError("a step packet must name at least one layer")
    return rows, plan


# -- buffers --------------------------------------------------------------------------------------


def share(t: torch.Tensor) -> pb.CudaIpcBuffer:
    """A contiguous CUDA tensor as another process on its GPU opens it (`open_buffer`)."""
    assert t.is_cuda and t.is_contiguous() and t.storage_offset() == 0
    (_, (_, size, _, _, _, _, _, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset, event_handle,
         event_sync)) = reduce_tensor(t)
    return pb.CudaIpcBuffer(shape=list(size), handle=handle, storage_bytes=storage_bytes, storage_offset=storage_offset,
                            ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event_handle,
                            event_sync_required=event_sync)


def open_buffer(shared: pb.CudaIpcBuffer, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    shape = list(shared.shape)
    if not shape or any(n <= 0 for n in shape) or math.prod(shape) * dtype.itemsize > shared.storage_bytes:
        raise ValueError(f"a shared buffer of shape {shape} in {dtype} does not fit its {shared.storage_bytes} bytes")
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(shape), tuple(stride), 0, torch.UntypedStorage, dtype,
                               indexed(device).index, shared.handle, shared.storage_bytes, shared.storage_offset, False,
                               shared.ref_counter_handle, shared.ref_counter_offset, shared.event_handle,
                               shared.event_sync_required)


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def indexed(device: torch.device) -> torch.device:
    """`cuda` as `cuda:N`: CUDA IPC's calls take a device index."""
    return device if device.index is not None else torch.device(device.type, torch.cuda.current_device())


# -- whose rows -----------------------------------------------------------------------------------


def row_groups(ends: torch.Tensor, rows: int) -> torch.Tensor:  # [G] cumulative ends -> [rows] group of each row
    """The group (expert; E: the spare rows') each of the first `rows` sorted rows is in, on the device."""
    return torch.searchsorted(ends, torch.arange(rows, dtype=ends.dtype, device=ends.device), right=True)


def expert_table(experts: dict[int, int], groups: int, device: torch.device) -> torch.Tensor:
    """[groups + 1] int64: a group's index among `experts` ({expert: local index}), -1 for the others'."""
    table = torch.full((groups + 1,), -1, dtype=torch.int64)
    for e, i in experts.items():
        table[e] = i
    return table.to(device)


def owned_rows(ends: torch.Tensor, rows: int, table: torch.Tensor, local_experts: int,
               scratch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of the first `rows` sorted rows (their groups' cumulative `ends`), those whose group `table` maps
    to a local expert, gathered to the front, without waiting for the device: -> (src [S]: the sorted
    rows to read, own ones first in order, then 0; dst [S]: where each result goes, `scratch` for the
    rows past the own ones; ends [local_experts] int32 of the gathered rows). On a GPU one kernel,
    where these steps take about fifteen."""
    if moe_kernels.runs_here(ends.device):
        return _owned_rows_kernel(ends, rows, table, local_experts, scratch)
    groups = row_groups(ends, rows)
    local = table[groups]  # [S]
    own = local >= 0
    rank = own.cumsum(0) - 1
    index = torch.arange(rows, device=groups.device)
    src = torch.zeros(rows + 1, dtype=torch.int64, device=groups.device)
    src.scatter_(0, torch.where(own, rank, rows), index)  # the others' rows all land on the extra slot
    src = src[:rows]
    dst = torch.where(index < own.sum(), src, scratch)
    counts = torch.zeros(local_experts, dtype=torch.int64, device=groups.device).index_add_(
        0, local.clamp(min=0), own.to(torch.int64))
    return src, dst, counts.cumsum(0, dtype=torch.int32)


def run_owned(rows: torch.Tensor, ends: torch.Tensor, table: torch.Tensor, experts: StackedExperts,
              act: Callable, out: torch.Tensor) -> None:
    """The FFN of the rows [S, H] `table` makes this side's (their groups' cumulative `ends`), each into
    its row of `out` [>= S + 1, H] (the last row is scratch); the other rows of `out` are left as they are."""
    src, dst, local_ends = owned_rows(ends, rows.shape[0], table, experts.num_experts, out.shape[0] - 1)
    sorted_ffn(rows, local_ends, experts, act, order=src, scatter=(out, dst))  # the last GEMM writes its rows of out


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def owned_rows(ends_ptr, table_ptr, src_ptr, dst_ptr, local_ends_ptr, S, G, L, scratch,
                   BLOCK_S: tl.constexpr, CHUNK: tl.constexpr):
        r = tl.arange(0, BLOCK_S)
        live = r < S
        g = tl.zeros_like(r)  # each row's group: how many group ends are <= the row
        for g0 in range(0, G, CHUNK):
            e = g0 + tl.arange(0, CHUNK)
            g += tl.sum((tl.load(ends_ptr + e, mask=e < G, other=S)[None, :] <= r[:, None]).to(tl.int32), axis=1)
        local = tl.load(table_ptr + g, mask=live, other=-1)
        own = (local >= 0) & live
        rank = tl.cumsum(own.to(tl.int32), axis=0) - 1
        owned = tl.sum(own.to(tl.int32), axis=0)
        rows = r.to(tl.int64)
        tl.store(src_ptr + rank, rows, mask=own)  # own rows to the front, in order
        tl.store(dst_ptr + rank, rows, mask=own)
        rest = live & (r >= owned)
        tl.store(src_ptr + r, rows * 0, mask=rest)
        tl.store(dst_ptr + r, rows * 0 + scratch, mask=rest)
        for l0 in range(0, L, CHUNK):  # each local expert's end: own rows of it or an earlier one
            le = l0 + tl.arange(0, CHUNK)
            counted = tl.sum(((local[None, :] <= le[:, None]) & own[None, :]).to(tl.int32), axis=1)
            tl.store(local_ends_ptr + le, counted, mask=le < L)

    return owned_rows


def _owned_rows_kernel(ends: torch.Tensor, rows: int, table: torch.Tensor, local_experts: int,
                       scratch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import triton

    src = torch.empty(rows, dtype=torch.int64, device=ends.device)
    dst = torch.empty(rows, dtype=torch.int64, device=ends.device)
    local_ends = torch.empty(local_experts, dtype=torch.int32, device=ends.device)
    if rows:
        _kernels()[(1,)](ends, table, src, dst, local_ends, rows, ends.shape[0], local_experts, scratch,
                         BLOCK_S=max(16, triton.next_power_of_2(rows)), CHUNK=32, num_warps=4)
    else:
        local_ends.zero_()
    return src, dst, local_ends


# -- the flags ----------------------------------------------------------------------------------


def flag_count(num_layers: int) -> int:
    """A link's flags: go[layer] (the frontend signals, the function waits), done[layer] (the other way),
    then void (set by a function that ran a step out without its rows: that step's outputs are void)."""
    return 2 * num_layers + 1


def go_flags(flags: torch.Tensor) -> torch.Tensor:
    return flags[:(flags.shape[0] - 1) // 2]


def done_flags(flags: torch.Tensor) -> torch.Tensor:
    layers = (flags.shape[0] - 1) // 2
    return flags[layers:2 * layers]


def go_flag(flags: torch.Tensor, layer: int) -> torch.Tensor:
    return go_flags(flags)[layer:layer + 1]


def done_flag(flags: torch.Tensor, layer: int) -> torch.Tensor:
    return done_flags(flags)[layer:layer + 1]


def void_flag(flags: torch.Tensor) -> torch.Tensor:
    return flags[-1:]


# -- the function's side --------------------------------------------------------------------------


@dataclass
class _StepProgram:
    """A function's side of one step packet, captured: per layer wait for go, its rows' FFN, done."""

    graph: torch.cuda.CUDAGraph
    stacks: list[tuple[int, object]]  # (layer, the LayerStack it read): a replaced stack makes it stale
    tables: list[torch.Tensor]  # read by the graph: kept alive with it


class ServerLink:
    """One attached frontend: its buffers opened here, a thread answering its socket's step packets by
    replaying (capturing on first sight) the function's side of each step on a stream of its own."""

    def __init__(self, folder: Path, rows: torch.Tensor, ends: torch.Tensor, out: torch.Tensor, flags: torch.Tensor,
                 num_experts: int, layers: Sequence[int], stack_of: Callable, act: Callable,
                 flag_ops: gpu_flags.Flags | None):
        self.rows, self.ends, self.out, self.flags = rows, ends, out, flags
        self.num_experts, self.layers, self._stack_of, self._act = num_experts, tuple(layers), stack_of, act
        self._flag_ops = flag_ops
        self.programs: dict[bytes, _StepProgram] = {}
        self.stream = torch.cuda.Stream(rows.device) if rows.is_cuda else None
        self._pool: tuple | None = None  # graph_pool()
        self._ran = False  # a step was queued: closing must let it finish or void it
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._listener, self.path = listen_socket(Path(folder), SOCKET_PREFIX)
        self._listener.setblocking(True)
        self._listener.settimeout(ACCEPT_SECONDS)
        self._sock: socket.socket | None = None
        self.closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=f"device-link-{self.path.name[-6:]}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            sock = self._accept()
            if sock is None:
                return
            max_bytes = max_packet_bytes(len(self.layers), self.num_experts)
            while not self.closed:
                packet = sock.recv(max_bytes + 1)
                if not packet:
                    return
                sock.send(self.run_step(packet))
        except OSError as e:
            if not self.closed:
                log.info("device link %s ended: %s", self.path.name, e)
        finally:
            self.close()

    def run_step(self, packet: bytes) -> bytes:
        """Queue the function's side of the step `packet` describes -> the answer packet."""
        program = self.programs.get(packet)
        if program is None or self._stale(program):
            # Stale programs go now: each holds the stack map it read, and the store reuses an emptied slot
            # only once no map that named it lives (store.py)
            self.programs = {k: p for k, p in self.programs.items() if not self._stale(p)}
            try:
                rows, plan = unpack_step(packet, self.num_experts, self.rows.shape[0], self.layers)
                program = self._capture(rows, plan)
            except Exception as e:  # noqa: BLE001 - the frontend voids the step and sends its layers as calls
                log.warning("device link %s: a step refused: %s", self.path.name, e)
                return bytes([REFUSED]) + f"{type(e).__name__}: {e}".encode()[:1000]
            if len(self.programs) >= 64:  # many row sizes: start again
                self.programs = {}
            self.programs[packet] = program
        with torch.cuda.stream(self.stream):
            program.graph.replay()
        self._ran = True
        return bytes([QUEUED])

    def _stale(self, program: _StepProgram) -> bool:
        return any(self._stack_of(layer) is not stack for layer, stack in program.stacks)

    def _capture(self, rows: int, plan: dict[int, list[int]]) -> _StepProgram:
        stacks, tables = [], []
        for layer, experts in plan.items():
            stack = self._stack_of(layer)
            lacking = [e for e in experts if stack is None or e not in stack.local]
            if lacking:
                raise LookupError(f"this function lacks experts {lacking} of layer {layer}")
            stacks.append((layer, stack))
            tables.append(expert_table({e: stack.local[e] for e in experts}, self.num_experts + 1, self.rows.device))
        flags, stream = self._flag_ops, self.stream
        if flags is None or stream is None:
            raise RuntimeError("device links need a GPU")
        self._pool = graph_pool(self._pool, held=bool(self.programs))  # stale programs went: maybe every one

        def step(out: torch.Tensor, wait: bool) -> None:
            for (layer, stack), table in zip(stacks, tables):
                if wait:
                    flags.wait(go_flag(self.flags, layer))
                run_owned(self.rows[:rows], self.ends, table, stack.experts, self._act, out)
                if wait:
                    flags.signal(done_flag(self.flags, layer))

        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.stream(stream):
            # Once without the flags, outside the capture (kernels compiled, the allocator warm), into a
            # buffer of its own: the frontend may still be taking an earlier step's rows from `out`.
            step(torch.empty_like(self.out), wait=False)
            stream.synchronize()
            with captured(graph, self._pool):
                step(self.out, wait=True)
        return _StepProgram(graph, stacks, tables)

    def _accept(self) -> socket.socket | None:
        try:
            sock, _ = self._listener.accept()
        except (TimeoutError, OSError):
            log.info("device link %s: no client connected in %.0f s", self.path.name, ACCEPT_SECONDS)
            return None
        finally:
            self._listener.close()
            with contextlib.suppress(OSError):
                self.path.unlink()
        sock.settimeout(ACCEPT_SECONDS)
        if peer_uid(sock) != os.geteuid() or not hmac.compare_digest(sock.recv(TOKEN_BYTES + 1), self.token):
            log.warning("device link %s: a client of another user or with a wrong token; refused", self.path.name)
            sock.close()
            return None
        sock.settimeout(None)
        self._sock = sock
        return sock

    def close(self) -> None:
        """End the link. A step still queued gets DRAIN_SECONDS to finish; one still waiting for its rows
        then (the frontend gone or stuck) is voided and run out, so this function's stream goes on."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        for s in (self._sock, self._listener):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        if self._ran and self.stream is not None:
            drained = torch.cuda.Event()
            drained.record(self.stream)
            deadline = time.monotonic() + DRAIN_SECONDS
            while not drained.query() and time.monotonic() < deadline:
                time.sleep(0.001)
            if not drained.query():
                log.warning("device link %s: a step still waits for its frontend after %.0f s; voided",
                            self.path.name, DRAIN_SECONDS)
                gpu_flags.release(void_flag(self.flags))  # first: the frontend must see it before any done
                gpu_flags.release(go_flags(self.flags))


# -- the frontend's side --------------------------------------------------------------------------


class DeviceBuffers:
    """The frontend's buffers every link of it shares: a layer's sorted rows, their group ends, and the
    rows' outputs (plus the scratch row)."""

    def __init__(self, max_rows: int, hidden: int, groups: int, dtype: torch.dtype, device: torch.device):
        self.rows = torch.zeros(max_rows, hidden, dtype=dtype, device=device)
        self.ends = torch.zeros(groups, dtype=torch.int32, device=device)
        self.out = torch.zeros(max_rows + 1, hidden, dtype=dtype, device=device)
        self.device, self.dtype = device, dtype

    def request(self, model: str, flags: torch.Tensor) -> pb.DeviceAttachRequest:
        return pb.DeviceAttachRequest(model=model, gpu_uuid=gpu_uuid(self.device), dtype=wire.TO_WIRE[self.dtype],
                                      rows=share(self.rows), ends=share(self.ends), out=share(self.out),
                                      flags=share(flags))

    def stage(self, rows: torch.Tensor, ends: torch.Tensor) -> None:
        """Queue a layer's rows (unless gathered into `self.rows` already) and ends into the buffers, on this stream."""
        if rows.data_ptr() != self.rows.data_ptr():
            self.rows[:rows.shape[0]].copy_(rows)
        self.ends[:ends.shape[0]].copy_(ends)


class ClientLink:
    """A connected link to one expert function: its `flags` and its socket."""

    def __init__(self, folder: Path, answer: pb.DeviceAttachResponse, flags: torch.Tensor):
        if not answer.socket.startswith(SOCKET_PREFIX + "-") or "/" in answer.socket:
            raise LinkError(f"the server named a device socket {answer.socket!r} outside the protocol")
        self.flags = flags
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with socket_address(Path(folder) / answer.socket) as address:
                self.sock.connect(address)
            self.sock.send(answer.token)
        except OSError as e:
            self.sock.close()
            raise LinkError(f"cannot connect to the device link {answer.socket}: {e}") from None

    def send(self, packet: bytes) -> None:
        try:
            self.sock.send(packet)
        except OSError as e:
            raise LinkError(f"device link: {e}") from None

    def receive(self, timeout: float) -> None:
        """Return once the function queued the step; LinkError if it refused it, closed, or took too long."""
        try:
            self.sock.settimeout(timeout)
            answer = self.sock.recv(1024)
        except OSError as e:  # a timeout too; a socket this side closed
            raise LinkError(f"device link: {e or 'no answer in time'}") from None
        if not answer:
            raise LinkError("device link: the expert function closed it")
        if answer[0] != QUEUED:
            raise LinkError(f"device link refused the step: {answer[1:].decode('utf-8', 'replace')}")

    def closed(self) -> bool:
        """Whether the function ended the link (or this side dropped it), found without waiting and without
        reading: the watchdog asks while the engine thread may be receiving an answer."""
        fd = self.sock.fileno()
        if fd < 0:
            return True
        poller = select.poll()
        poller.register(fd, select.POLLRDHUP)
        ended = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL
        return any(events & ended for _, events in poller.poll(0))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass
class _Replay:
    failed: dict[str, str]  # address -> why its link failed this replay
    end: object = None  # a CUDA event recorded after the replay was queued
    deadline: float = math.inf
    released: set[str] = field(default_factory=set)  # the links whose waits in it were released


class InFlight:
    """A program's linked replays queued and not yet finished, oldest first, and what bounds them.

    Behind a replay whose function died, anything waiting for the GPU (its finish; the engine reading
    a tally or moving a batch's rows before that) would wait for ever. So a watchdog thread looks at
    every replay in flight (`check`, every WATCH_SECONDS): a link that failed it, a link whose function
    closed it, and every link once it is past its deadline (the call timeout) has its waits in it
    released (`release(address)`), and the replay is marked failed for its finish to report."""

    def __init__(self, links: dict[str, "ClientLink"], timeout: float, release: Callable[[str], None]):
        self.links, self.timeout, self._release = links, timeout, release
        self._replays: collections.deque[_Replay] = collections.deque()
        self._lock = threading.Lock()

    def add(self, failed: dict[str, str]) -> None:
        with self._lock:
            self._replays.append(_Replay(failed))

    def launched(self, end: object) -> None:
        with self._lock:
            replay = self._replays[-1]
            replay.end, replay.deadline = end, time.monotonic() + self.timeout
        _watchdog().watch(self)

    def oldest(self) -> _Replay:
        with self._lock:
            return self._replays[0]

    def pop(self) -> _Replay:
        with self._lock:
            return self._replays.popleft()

    def fail(self, replay: _Replay, address: str, why: str) -> None:
        """`address`'s link failed `replay` (the first reason stays), its waits in it released now."""
        with self._lock:
            self._fail(replay, address, why)

    def _fail(self, replay: _Replay, address: str, why: str) -> None:
        replay.failed.setdefault(address, why)
        if address not in replay.released:
            replay.released.add(address)
            self._release(address)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._replays)

    def check(self, now: float) -> bool:
        """Release what no one will signal -> whether replays are still in flight."""
        with self._lock:
            for replay in self._replays:
                if replay.end is None or replay.end.query():  # type: ignore[attr-defined]
                    continue
                for address, link in self.links.items():
                    if address in replay.failed:
                        self._fail(replay, address, "")
                    elif now > replay.deadline:
                        self._fail(replay, address, f"the step did not finish in {self.timeout:g} s")
                    elif link.closed():
                        self._fail(replay, address, "the expert function closed the link during the step")
            return bool(self._replays)


WATCH_SECONDS = 0.05


class _Watchdog:
    def __init__(self):
        self._watched: set[InFlight] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="device-link-watchdog", daemon=True)
        self._thread.start()

    def watch(self, in_flight: InFlight) -> None:
        with self._lock:
            self._watched.add(in_flight)

    def _run(self) -> None:
        while True:
            time.sleep(WATCH_SECONDS)
            with self._lock:
                watched = list(self._watched)
            for in_flight in watched:
                try:
                    busy = in_flight.check(time.monotonic())
                except Exception:  # noqa: BLE001 - a watchdog that dies bounds nothing: log, go on
                    log.exception("device link watchdog")
                    busy = True
                if not busy:
                    with self._lock:  # launched() adds its replay before it watches: looked at again under the lock
                        if not in_flight.busy():
                            self._watched.discard(in_flight)


@functools.cache
def _watchdog() -> _Watchdog:
    return _Watchdog()


class StepLinks:
    """The device links of one captured decode program (frontend/graphs.py): the layers it runs through
    them, queued while it is captured (`run_layer`), and the host's part of each replay: `start` sends
    each function its step packet, `launched` marks the replay's end on the stream, `finish` waits for
    the functions' answers and for that end. Two replays may be in flight (the engine launches the next
    pass before it settles this one): each finish takes the oldest (`InFlight`)."""

    def __init__(self, buffers: DeviceBuffers, links: dict[str, ClientLink], plans: dict[int, dict[str, list[int]]],
                 flags: gpu_flags.Flags, num_experts: int, timeout: float,
                 on_finish: Callable[["StepLinks", dict[str, str]], None]):
        self.buffers, self.links, self.plans, self.flags = buffers, links, plans, flags
        self.num_experts, self.timeout, self._on_finish = num_experts, timeout, on_finish
        self._rows = 0
        self._void = torch.zeros(len(links), dtype=torch.int32, pin_memory=True)  # each link's, after a replay
        self._packets: dict[str, bytes] = {}
        self._in_flight = InFlight(links, timeout, lambda address: gpu_flags.release(done_flags(links[address].flags)))
        self.answers_s = self.end_s = 0.0  # the last replay's waits: for the answers, then for its end

    def covers(self, layer: int) -> bool:
        return layer in self.plans

    @property
    def rows(self) -> torch.Tensor:
        """Where a layer's sorted rows are best gathered (`run_layer` copies them there otherwise)."""
        return self.buffers.rows

    def run_layer(self, layer: int, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Queue a layer (while the program is captured): its sorted rows [S, H] and group ends staged,
        each of its functions' go, then each one's done -> the rows' outputs [S, H], a view of the shared
        `out`, valid until the next layer's go."""
        self.buffers.stage(rows, ends)
        plan = self.plans[layer]
        for address in plan:
            self.flags.signal(go_flag(self.links[address].flags, layer))
        for address in plan:
            self.flags.wait(done_flag(self.links[address].flags, layer))
        self._rows = rows.shape[0]
        return self.buffers.out[:self._rows]

    def capture_end(self) -> None:
        """The program's last work: each link's void flag read back to the host."""
        for i, link in enumerate(self.links.values()):
            self._void[i:i + 1].copy_(void_flag(link.flags), non_blocking=True)
        for address in self.links:
            layers = {layer: plan[address] for layer, plan in self.plans.items() if address in plan}
            self._packets[address] = pack_step(self._rows, layers, self.num_experts)

    def start(self) -> None:
        failed = {}
        for address, packet in self._packets.items():
            try:
                self.links[address].send(packet)
            except LinkError as e:
                failed[address] = str(e)
        self._in_flight.add(failed)

    def launched(self) -> None:
        end = torch.cuda.Event()
        end.record()
        self._in_flight.launched(end)

    def finish(self) -> bool:
        """For the oldest replay in flight: each function's answer, then the replay's end (the watchdog
        bounds it, `InFlight`). -> whether the step's outputs hold; when not, its waits were released."""
        replay = self._in_flight.oldest()
        start = time.perf_counter()
        for address, link in self.links.items():
            if address in replay.failed:
                self._in_flight.fail(replay, address, "")  # its packet was not sent: released now, not at the next look
                continue
            try:
                link.receive(self.timeout)
            except LinkError as e:
                self._in_flight.fail(replay, address, str(e))
        answered = time.perf_counter()
        self.answers_s = answered - start
        end = replay.end
        assert isinstance(end, torch.cuda.Event)
        while not end.query():
            if time.monotonic() > replay.deadline + self.timeout:  # the watchdog released every wait by then
                raise RuntimeError("a device-linked step did not finish even with every wait of it released")
            time.sleep(0)  # the GIL let go between polls
        self._in_flight.pop()
        self.end_s = time.perf_counter() - answered
        failed = dict(replay.failed)
        for i, address in enumerate(self.links):
            if self._void[i] and address not in failed:
                failed[address] = "the expert function voided the step (it ended the link)"
        self._on_finish(self, failed)
        return not failed
