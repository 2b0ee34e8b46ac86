"""The device link: a frontend and an expert function on the same GPU share a layer's rows there.

Through shared memory and the lane (shm.py, lane.py) a remote layer's rows still go device -> host ->
device and back, and the frontend waits for its GPU before each layer's calls and for the calls
before it launches anything more. On the H200 at 1bfb8e1 a 2-layer Mixtral decode step with its
experts in 2 expert functions on the frontend's GPU took 8.0 ms at batch 32 (MPS; 9.5 time-sliced)
against 2.2 ms in process: about 3 ms a remote layer, of which the experts' weights need 0.35.

Here the frontend lends the function device buffers through CUDA IPC (AttachDevice in the proto):
`rows` (a layer's rows sorted by expert), `ends` (where each expert's rows end) and one `out` per
function. Per layer the frontend queues its copies into `rows` and `ends` and records the ready
event, then sends each linked function one small packet (layer, rows, its experts); the function
queues, on its GPU stream, a wait for the ready event, the FFN of its own rows (found on the device
from `ends`: nothing waits for the GPU) written to their rows of `out`, and its done event, and
answers. The frontend's stream waits for each done event and takes each function's rows from its
`out`. Neither side waits for the GPU; the host work of both overlaps the GPU's. At 1f2c481 (same
setup) the step took 4.4 ms at batch 32 through links, 7.3 ms as calls: each layer still waited
about 0.4 ms for each function's answer (its ~25 launches), and about 1 ms a layer is not explained yet.
Since then a function's side of a layer is four launches on a GPU (`owned_rows` one kernel, the rows'
gather inside the first GEMM, the second GEMM, the copy into `out`) and the frontend takes each
function's rows in one (`take_own_rows`): checked under Triton's CPU interpreter, not yet timed on
the H200.

What both sides must agree on lives here: the packets, the buffers' sharing, and which rows are
whose (`owned_rows`, `row_groups`). Same GPU means same node: the socket lies in the shared
`--shm-dir`, and torch's IPC bookkeeping in the host's /dev/shm.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import math
import os
import secrets
import socket
import struct
import threading
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from kubemoe import moe_kernels, wire
from kubemoe.expert_fn.lane import listen_socket, peer_uid, socket_address
from kubemoe.moe import StackedExperts, sorted_ffn
from kubemoe.proto import kubemoe_pb2 as pb

log = logging.getLogger(__name__)

SOCKET_PREFIX = "kubemoe-device"
TOKEN_BYTES = 16
QUEUED, LACKING, REFUSED = 0, 1, 2
_GO = struct.Struct("<II")  # layer, rows
MAX_PACKET_BYTES = 4096
ACCEPT_SECONDS = 10.0


class LinkError(ConnectionError):
    """The link cannot serve (closed, refused, timed out): the caller sends the layer another way."""


# -- packets --------------------------------------------------------------------------------------


def experts_mask(experts: Sequence[int], num_experts: int) -> bytes:
    mask = bytearray((num_experts + 7) // 8)
    for e in experts:
        mask[e // 8] |= 1 << (e % 8)
    return bytes(mask)


def mask_experts(mask: bytes, num_experts: int) -> list[int]:
    return [e for e in range(num_experts) if mask[e // 8] >> (e % 8) & 1]


def pack_go(layer: int, rows: int, experts: Sequence[int], num_experts: int) -> bytes:
    return _GO.pack(layer, rows) + experts_mask(experts, num_experts)


def unpack_go(packet: bytes, num_experts: int, max_rows: int) -> tuple[int, int, list[int]]:
    """-> (layer, rows, experts); ValueError saying what is wrong with the packet."""
    if len(packet) != _GO.size + (num_experts + 7) // 8:
        raise ValueError(f"a layer packet of this model is {_GO.size + (num_experts + 7) // 8} bytes, got {len(packet)}")
    layer, rows = _GO.unpack_from(packet)
    if rows > max_rows:
        raise ValueError(f"rows {rows} exceed the attached buffers' {max_rows}")
    mask = packet[_GO.size:]
    if num_experts % 8 and mask[-1] >> (num_experts % 8):
        raise ValueError(f"the experts' bitmask names experts beyond the model's {num_experts}")
    experts = mask_experts(mask, num_experts)
    if not experts:
        raise ValueError("a layer packet must name at least one expert")
    return layer, rows, experts


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
    out.index_copy_(0, dst, sorted_ffn(rows, local_ends, experts, act, order=src).to(out.dtype))


def take_own_rows(y: torch.Tensor, out: torch.Tensor, ends: torch.Tensor, table: torch.Tensor) -> None:
    """Rows of y [S, H] whose group (cumulative `ends`) `table` maps to an expert, taken from `out`; on a
    GPU in one kernel."""
    rows = y.shape[0]
    if not moe_kernels.runs_here(y.device):
        torch.where((table[row_groups(ends, rows)] >= 0)[:, None], out[:rows], y, out=y)
        return
    import triton

    hidden = y.shape[1]
    block = min(1024, triton.next_power_of_2(hidden))
    if rows:
        _kernels()[1][(rows, triton.cdiv(hidden, block))](ends, table, out, y, ends.shape[0], hidden, out.stride(0),
                                                          y.stride(0), BLOCK_H=block, CHUNK=32)


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

    @triton.jit
    def take_own_rows(ends_ptr, table_ptr, out_ptr, y_ptr, G, H, stride_o, stride_y,
                      BLOCK_H: tl.constexpr, CHUNK: tl.constexpr):
        row = tl.program_id(0)
        e = tl.arange(0, CHUNK)
        g = tl.sum((tl.load(ends_ptr + e, mask=e < G, other=row + 1) <= row).to(tl.int32), axis=0)
        for g0 in range(CHUNK, G, CHUNK):  # the row's group: how many group ends are <= it
            e = g0 + tl.arange(0, CHUNK)
            g += tl.sum((tl.load(ends_ptr + e, mask=e < G, other=row + 1) <= row).to(tl.int32), axis=0)
        if tl.load(table_ptr + g) >= 0:
            cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
            live = cols < H
            taken = tl.load(out_ptr + row.to(tl.int64) * stride_o + cols, mask=live)
            tl.store(y_ptr + row.to(tl.int64) * stride_y + cols, taken, mask=live)

    return owned_rows, take_own_rows


def _owned_rows_kernel(ends: torch.Tensor, rows: int, table: torch.Tensor, local_experts: int,
                       scratch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import triton

    src = torch.empty(rows, dtype=torch.int64, device=ends.device)
    dst = torch.empty(rows, dtype=torch.int64, device=ends.device)
    local_ends = torch.empty(local_experts, dtype=torch.int32, device=ends.device)
    if rows:
        _kernels()[0][(1,)](ends, table, src, dst, local_ends, rows, ends.shape[0], local_experts, scratch,
                            BLOCK_S=max(16, triton.next_power_of_2(rows)), CHUNK=32, num_warps=4)
    else:
        local_ends.zero_()
    return src, dst, local_ends


# -- the function's side --------------------------------------------------------------------------


class ServerLink:
    """One attached frontend: its buffers opened here, a thread answering its socket's packets."""

    def __init__(self, folder: Path, rows: torch.Tensor, ends: torch.Tensor, out: torch.Tensor,
                 ready: torch.cuda.Event, num_experts: int, run: Callable[[int, int, list[int], "ServerLink"], bytes]):
        self.rows, self.ends, self.out, self.ready = rows, ends, out, ready
        self.done = torch.cuda.Event(interprocess=True)
        self.num_experts, self._run = num_experts, run
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._listener, self.path = listen_socket(Path(folder), SOCKET_PREFIX)
        self._listener.setblocking(True)
        self._listener.settimeout(ACCEPT_SECONDS)
        self._sock: socket.socket | None = None
        self.closed = False
        self.tables: dict[tuple, torch.Tensor] = {}  # ((expert, local index), ...) -> expert_table, for the server's run
        self._thread = threading.Thread(target=self._serve, name=f"device-link-{self.path.name[-6:]}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            sock = self._accept()
            if sock is None:
                return
            while not self.closed:
                packet = sock.recv(MAX_PACKET_BYTES)
                if not packet:
                    return
                try:
                    layer, rows, experts = unpack_go(packet, self.num_experts, self.rows.shape[0])
                except ValueError as e:
                    log.warning("device link %s: %s; ending it", self.path.name, e)
                    return
                sock.send(self._run(layer, rows, experts, self))
        except OSError as e:
            if not self.closed:
                log.info("device link %s ended: %s", self.path.name, e)
        finally:
            self.close()

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
        self.closed = True
        for s in (self._sock, self._listener):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
        with contextlib.suppress(OSError):
            self.path.unlink()


# -- the frontend's side --------------------------------------------------------------------------


class DeviceBuffers:
    """The frontend's buffers every link of it reads: a layer's sorted rows and their group ends."""

    def __init__(self, max_rows: int, hidden: int, groups: int, dtype: torch.dtype, device: torch.device):
        self.rows = torch.zeros(max_rows, hidden, dtype=dtype, device=device)
        self.ends = torch.zeros(groups, dtype=torch.int32, device=device)
        self.ready = torch.cuda.Event(interprocess=True)
        self.device, self.dtype = device, dtype

    def request(self, model: str, out: torch.Tensor) -> pb.DeviceAttachRequest:
        return pb.DeviceAttachRequest(model=model, gpu_uuid=gpu_uuid(self.device), dtype=wire.TO_WIRE[self.dtype],
                                      rows=share(self.rows), ends=share(self.ends), out=share(out),
                                      ready_event=self.ready.ipc_handle())

    def stage(self, rows: torch.Tensor, ends: torch.Tensor) -> None:
        """Queue a layer's rows and ends into the shared buffers, then the ready event, on this stream."""
        self.rows[:rows.shape[0]].copy_(rows)
        self.ends[:ends.shape[0]].copy_(ends)
        self.ready.record()


class ClientLink:
    """A connected link to one expert function: its `out` buffer and done event."""

    def __init__(self, folder: Path, answer: pb.DeviceAttachResponse, out: torch.Tensor, device: torch.device,
                 num_experts: int):
        if not answer.socket.startswith(SOCKET_PREFIX + "-") or "/" in answer.socket:
            raise LinkError(f"the server named a device socket {answer.socket!r} outside the protocol")
        self.out, self.num_experts = out, num_experts
        self.done = torch.cuda.Event.from_ipc_handle(indexed(device), answer.done_event)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with socket_address(Path(folder) / answer.socket) as address:
                self.sock.connect(address)
            self.sock.send(answer.token)
        except OSError as e:
            self.sock.close()
            raise LinkError(f"cannot connect to the device link {answer.socket}: {e}") from None

    def send(self, layer: int, rows: int, experts: Sequence[int]) -> None:
        try:
            self.sock.send(pack_go(layer, rows, experts, self.num_experts))
        except OSError as e:
            raise LinkError(f"device link: {e}") from None

    def receive(self, timeout: float) -> list[int]:
        """-> the experts the function lacks (nothing was queued), [] when it queued the layer."""
        self.sock.settimeout(timeout)
        try:
            answer = self.sock.recv(MAX_PACKET_BYTES)
        except OSError as e:  # a timeout too
            raise LinkError(f"device link: {e or 'no answer in time'}") from None
        if not answer:
            raise LinkError("device link: the expert function closed it")
        if answer[0] == QUEUED:
            return []
        if answer[0] == LACKING:
            return mask_experts(answer[1:], self.num_experts)
        raise LinkError(f"device link refused the layer: {answer[1:].decode('utf-8', 'replace')}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
