"""The client a frontend uses to call one expert-function endpoint.

With `streaming=True` (the default) every call goes over ONE long-lived ForwardStream per
client: no per-call HTTP/2 stream setup, and replies, which may come out of order, are matched to
callers by request_id. If the stream breaks, the calls waiting on it fail with UNAVAILABLE (expert
calls have no side effects: retrying them is safe) and the next call opens a new stream.

With `shm_dir` set, each new stream offers the server a shared-memory segment (shm.py). A server on
this node that sees the same folder attaches it; a call then copies its hidden states into a region
of the segment, sends only the region's offset, and gets back a tensor over the same region, where
the server wrote the reply (the region is reused once that tensor and its views are gone). Those
calls go over the stream's lane (lane.py), a Unix socket, when the server offers one. A server
elsewhere refuses, and tensors travel inline, as do calls that find no free region large enough.

Errors surface as grpc.aio.AioRpcError: `.code()` is the status, `.details()` says what was wrong.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

import grpc
import torch

from kubemoe import wire
from kubemoe.expert_fn.errors import code_of, status_metadata
from kubemoe.expert_fn.frames import TCP_LANE_METADATA_KEY, TCP_METADATA_KEY, lane_address, new_offer, tensor_region
from kubemoe.expert_fn.frames import connect as connect_tcp
from kubemoe.expert_fn.lane import LANE_METADATA_KEY, ClientLane, LaneClosed, each
from kubemoe.expert_fn.shm import ATTACHED, HEADER_BYTES, METADATA_KEY, Allocator, Segment, SharedMemoryError
from kubemoe.expert_fn.transport import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_SHM_SEGMENT_BYTES, grpc_options
from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def rpc_error(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class _Stream:
    """One open ForwardStream: its calls in flight and, when the server attached one, its segment
    (shared memory) or the arena its TCP lane mirrors (frames.py)."""

    def __init__(self, call: grpc.aio.StreamStreamCall):
        self.call = call
        self.segment: Segment | None = None
        self.allocator: Allocator | None = None
        self.transport = "inline"  # how its tensors travel: inline, shm or tcp
        self.lane: ClientLane | None = None  # carries the calls whose tensors are in the segment
        self.write_lock = asyncio.Lock()  # one writer at a time
        self.pending: dict[str, asyncio.Future] = {}  # request_id -> its caller's future
        self.regions: dict[str, int] = {}  # request_id -> offset of its region, until the reply is read
        self.abandoned: set[str] = set()  # requests sent whose callers stopped waiting, until their late replies
        # A TCP lane's requests whose bytes are sent from the caller's tensor, not copied into the arena first.
        self.sending: dict[str, memoryview] = {}
        # Regions whose replies' last view went on another thread: freed by the next place() (_free_soon).
        self.freed_elsewhere: collections.deque[int] = collections.deque()
        self.reader: asyncio.Task | None = None

    def use(self, segment: Segment, transport: str) -> None:
        self.segment, self.transport = segment, transport
        self.allocator = Allocator(HEADER_BYTES, segment.size)

    def _memory(self) -> tuple[Segment, Allocator]:
        """The segment (or arena) and its allocator; asked of a stream whose tensors travel inline, a bug."""
        if self.segment is None or self.allocator is None:
            raise RuntimeError(f"a stream whose tensors travel {self.transport} has no segment of regions")
        return self.segment, self.allocator

    def end(self) -> None:
        """The stream is over: its segment (or TCP lane arena) is registered with CUDA if a call pinned
        it; unregister it before the mapping can go (CUDA would keep the range, and a later mapping at
        the same address could not be pinned). Replies still held stay readable."""
        if self.segment is not None:
            self.segment.unpin()

    def region_of_reply(self, response: pb.ForwardResponse) -> tuple[int, int]:
        """Where a TCP lane reply's tensor goes: the region its request was sent in, nowhere else."""
        segment, allocator = self._memory()
        offset, nbytes = tensor_region(response, segment.size)
        if nbytes and (self.regions.get(response.request_id) != offset or offset + nbytes > allocator.end(offset)):
            raise ValueError(f"request {response.request_id!r} was not sent in a region of {nbytes} bytes at {offset}")
        return offset, nbytes

    def deliver(self, response: pb.ForwardResponse) -> None:
        """A reply, from the stream or the lane, to its caller; a late one (the caller timed out or went) is
        dropped and frees its region."""
        rid = response.request_id
        waiter = self.pending.get(rid)
        if waiter is not None and not waiter.done() and rid not in self.abandoned:
            waiter.set_result(response)
        else:
            self.abandoned.discard(rid)
            self.release(rid)

    def place(self, request_id: str, hidden: torch.Tensor, msg: pb.Tensor) -> bool:
        """Copy `hidden` into a free region and name it in `msg`; False when none is large enough."""
        if self.segment is None or self.allocator is None or hidden.dtype not in wire.TO_WIRE:
            return False
        if hidden.device.type == "cuda" and not self.segment.tried_pinning:
            # Requests leave the GPU into it and replies go back from it by DMA, not through CUDA's
            # staging buffer (the expert function pins its own mapping of a shared segment too).
            self.segment.pin()
        while self.freed_elsewhere:
            self.allocator.free(self.freed_elsewhere.popleft())
        offset = self.allocator.alloc(hidden.nbytes)
        if offset is None:
            return False
        if self.transport == "tcp" and hidden.device.type == "cpu" and hidden.is_contiguous() and hidden.nbytes:
            # The frame's payload goes out from where the tensor lies (sent_from): one copy of the bytes
            # fewer. The reply still lands in the region. The caller keeps the tensor until the call returns.
            self.sending[request_id] = hidden.reshape(-1).view(torch.uint8).numpy().data
        else:
            self.segment.write(offset, hidden)
        wire.describe_shared(msg, hidden.dtype, list(hidden.shape), offset)
        self.regions[request_id] = offset
        return True

    def sent_from(self, request: pb.ForwardRequest) -> memoryview | None:
        """Where a TCP lane request's payload is, when not in its arena region (frames.Frames' `source`)."""
        return self.sending.pop(request.request_id, None) if self.sending else None

    def release(self, request_id: str) -> None:
        offset = self.regions.pop(request_id, None)
        if offset is not None:  # only a stream with a segment has regions
            self._memory()[1].free(offset)

    def hand_over(self, request_id: str, reply: pb.Tensor, sent: pb.Tensor) -> torch.Tensor:
        """The reply where it lies, as a tensor of its own; its region is freed once no view of it is left.

        No copy: the caller's tensor keeps the region. A caller that holds replies for long only
        makes later calls travel inline once the segment is full. Raises ValueError when the
        reply does not name exactly the region, dtype and shape the request was sent in.
        """
        if reply != sent:
            self.release(request_id)
            raise ValueError("inline, not the way it was sent" if reply.WhichOneof("payload") != "shared" else
                             "in another region, dtype or shape than it was sent in")
        offset = self.regions.pop(request_id)
        loop, (segment, allocator) = asyncio.get_running_loop(), self._memory()
        return segment.view(offset, wire.FROM_WIRE[sent.dtype], list(sent.shape),
                                 on_release=lambda: _free_soon(loop, allocator, offset, self.freed_elsewhere))


async def _written(stream: _Stream, request: pb.ForwardRequest, reply: asyncio.Future) -> None:
    """Write `request` on the gRPC stream, or stop waiting once its `reply` future is done (the call's deadline,
    or the stream's end) while the write still waits for the stream. The write itself goes on in a task of its
    own, whatever the caller does: grpc.aio ends the whole stream, every call on it, when a write is cancelled."""
    writing = asyncio.ensure_future(_write(stream, request))
    writing.add_done_callback(_retrieve)
    if not writing.done():
        await asyncio.wait((writing, reply), return_when=asyncio.FIRST_COMPLETED)
    if writing.done():
        writing.result()  # its error, if any: the stream broke


async def _write(stream: _Stream, request: pb.ForwardRequest) -> None:
    async with stream.write_lock:  # one writer at a time
        await stream.call.write(request)


def _retrieve(task: asyncio.Future) -> None:
    """A write whose caller stopped waiting: its error is the stream's, which its reader reports."""
    if not task.cancelled():
        task.exception()


def _delivered(reply: torch.Tensor, device: torch.device, out: torch.Tensor | None) -> torch.Tensor:
    """A reply where the caller wants it: in `out`, else on the request's device (as it lies, on a CPU).
    A copy from the shared region waits until it is done: the region is freed once `reply` is dropped."""
    if out is not None:
        if out.shape != reply.shape:
            raise ValueError(f"a reply of shape {tuple(reply.shape)} does not fit out= of shape {tuple(out.shape)}")
        with torch.inference_mode():  # `out` may be made in inference mode (a frontend's pass) on another thread
            return out.copy_(reply)
    return reply if device.type == "cpu" else reply.to(device)


def _expire(reply: asyncio.Future) -> None:
    """A call's deadline passed: its caller stops waiting (a late reply frees its region, _Stream.deliver)."""
    if not reply.done():
        reply.set_exception(TimeoutError())


def _free_soon(loop: asyncio.AbstractEventLoop, allocator: Allocator, offset: int, later: collections.deque) -> None:
    """Free a region on its stream's loop, from whichever thread dropped the last view of it.

    Soon, not now: a finalizer may run in the middle of the allocator's own code. From the loop's
    thread in its next turn; from another (a frontend's model thread drops a layer's replies) into
    `later`, which the stream's next call frees before it allocates: waking the loop's thread for it
    (call_soon_threadsafe) cost a write and a context switch a call."""
    try:
        on_loop = asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs on this thread
        on_loop = False
    if not on_loop:
        later.append(offset)  # deque.append is atomic: no lock against the loop's popleft
        return
    with contextlib.suppress(RuntimeError):  # the loop is closed: so is the stream, and the segment with it
        loop.call_soon(allocator.free, offset)


class ExpertClient:
    def __init__(self, address: str, *, model: str, streaming: bool = True,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, shm_dir: str | Path | None = None,
                 shm_bytes: int = DEFAULT_SHM_SEGMENT_BYTES, tcp: bool = True):
        self.address, self.model, self.streaming = address, model, streaming
        self.shm_dir, self.shm_bytes, self.tcp = shm_dir, shm_bytes, tcp
        self._options = grpc_options(max_message_bytes)
        # A call's tensor is at most this large; a larger one (a long prefill) goes as several calls.
        self.max_call_bytes = max_message_bytes - CALL_HEADROOM_BYTES
        self._channel: grpc.aio.Channel | None = None  # made on first use, inside the event loop
        self._stream: _Stream | None = None
        self._open_lock = asyncio.Lock()
        self._told_inline = False  # said once in the log why tensors travel inline
        self._ids = (f"{os.getpid():x}-{id(self):x}-{n}" for n in itertools.count())

    @property
    def shared_memory(self) -> bool:
        """Whether the open stream moves tensors through shared memory."""
        return self.transport == "shm"

    @property
    def transport(self) -> str | None:
        """How the open stream's tensors travel: inline, shm (shared memory) or tcp (a TCP lane); None: no stream."""
        return None if self._stream is None else self._stream.transport

    @property
    def _stub(self) -> pb_grpc.ExpertServiceStub:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=self._options)
            self._stub_cached = pb_grpc.ExpertServiceStub(self._channel)
        return self._stub_cached

    async def forward(
        self,
        layer: int,
        experts: Sequence[int],
        counts: Sequence[int],
        hidden: torch.Tensor,  # [sum(counts), H]: group after group
        *,
        request_id: str = "",
        timeout: float | None = None,
        out: torch.Tensor | None = None,  # [sum(counts), H] where the reply goes; None: a tensor of its own
    ) -> torch.Tensor:  # [sum(counts), H], hidden's dtype and device (`out` when given)
        return (await self.call(layer, experts, counts, hidden, request_id=request_id, timeout=timeout, out=out))[0]

    async def call(self, layer: int, experts: Sequence[int], counts: Sequence[int], hidden: torch.Tensor, *,
                   request_id: str = "", timeout: float | None = None,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, pb.ServerTiming]:
        """forward(), and the server's timing of the call. A tensor larger than one part goes as several
        calls, cut at row boundaries (the timing is their sum: the server's time on all of them); their
        outputs are joined in order. With `out` the reply is copied from where it arrived straight into it (a
        frontend's buffer on the GPU: one copy, no tensor of its own)."""
        stream = None if not self.streaming else self._stream if self._stream is not None else await self._open(timeout)
        # Through a segment (shared memory, or a TCP lane's arena) a part is at most half of it, two in flight:
        # a long prefill's call then never waits for a region or falls back to inline (60x slower on the H200).
        shared = stream is not None and stream.segment is not None
        part_bytes = min(self.max_call_bytes, self.shm_bytes // 2) if shared else self.max_call_bytes
        if hidden.nbytes > part_bytes and hidden.shape[0] > 1:  # one row too large goes as it is
            rows = max(1, part_bytes // (hidden.nbytes // hidden.shape[0]))
            rid = request_id or next(self._ids)
            spans = [(start, start + sum(part_counts), part_experts, part_counts)
                     for start, part_experts, part_counts in split_rows(experts, counts, rows)]
            if shared and out is None:  # each part's reply leaves its region at once, for the parts after it
                out = torch.empty_like(hidden)
            in_flight = asyncio.Semaphore(2 if shared else len(spans))

            async def part(n: int, start: int, end: int, part_experts: list[int], part_counts: list[int]):
                async with in_flight:
                    return await self.call(layer, part_experts, part_counts, hidden[start:end], request_id=f"{rid}/{n}",
                                           timeout=timeout, out=None if out is None else out[start:end])

            tasks = [asyncio.ensure_future(part(n, *span)) for n, span in enumerate(spans)]
            try:
                parts = await asyncio.gather(*tasks)
            except BaseException:  # one part failed (or the caller went): the others stop, and write nothing into out
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            timing = pb.ServerTiming()
            for _, part_timing in parts:
                timing.queue_seconds += part_timing.queue_seconds
                timing.compute_seconds += part_timing.compute_seconds
                timing.total_seconds += part_timing.total_seconds
            return (torch.cat([y for y, _ in parts]) if out is None else out), timing
        request = pb.ForwardRequest(model=self.model, request_id=request_id or next(self._ids), layer=layer,
                                    experts=experts, counts=counts)
        if stream is not None:
            return await self._call_streamed(stream, request, hidden, timeout, out)
        wire.encode_into(hidden, request.hidden)  # in place: no second copy of the bytes
        response = await self._stub.Forward(request, timeout=timeout)
        reply = wire.decode(response.hidden)  # aliases the response's bytes, which nothing else holds
        return _delivered(reply, hidden.device, out), response.timing

    async def _call_streamed(self, stream: _Stream, request: pb.ForwardRequest, hidden: torch.Tensor,
                             timeout: float | None, out: torch.Tensor | None) -> tuple[torch.Tensor, pb.ServerTiming]:
        rid = request.request_id
        if rid in stream.pending or rid in stream.abandoned:  # abandoned: its late reply may still come
            raise ValueError(f"request_id {rid!r} is already in flight on this client; ids must be unique")
        loop = asyncio.get_running_loop()
        done = stream.pending[rid] = loop.create_future()
        # A timer on the reply's future, not asyncio.wait_for (a task and more callbacks: ~10 us a call).
        expiry = None if timeout is None else loop.call_later(timeout, _expire, done)
        sent = answered = False  # once the request may reach the server, its reply frees its region, late or not
        try:
            shared = stream.place(rid, hidden, request.hidden)
            if not shared:
                wire.encode_into(hidden, request.hidden)
            if not (shared and stream.lane is not None and stream.lane.send(request)):
                sent = True  # the write goes on, whatever this caller does (_written)
                await _written(stream, request, done)
            sent = True
            response = await done
            answered = True
            if response.HasField("error"):
                stream.release(rid)
                # As a unary call fails: the experts the server lacks ride in the trailing metadata.
                raise rpc_error(code_of(response.error), response.error.message, status_metadata(response.error))
            try:
                if shared:
                    reply = stream.hand_over(rid, response.hidden, request.hidden)
                elif response.hidden.WhichOneof("payload") == "shared":
                    raise ValueError("in shared memory, not the way it was sent")
                else:
                    reply = wire.decode(response.hidden)
            except ValueError as e:  # wire.WireError too
                raise rpc_error(grpc.StatusCode.DATA_LOSS, f"{self.address} answered request {rid!r} {e}") from None
            return _delivered(reply, hidden.device, out), response.timing
        except TimeoutError:  # a region stays reserved until the late reply comes (the reader frees it)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no reply to request {rid!r} from {self.address} within {timeout}s") from None
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError, LaneClosed) as e:
            verdict = done.exception() if done.done() and not done.cancelled() else None
            if verdict is not None:
                raise verdict from None  # the reader's verdict is the more precise one
            # A write into a stream the server has just dropped fails with INTERNAL ("Failed
            # execute_batch") before the reader notices: that is a broken stream, safe to retry.
            if isinstance(e, grpc.aio.AioRpcError) and e.code() != grpc.StatusCode.INTERNAL:
                raise
            if self._stream is stream:
                self._stream = None  # the next call opens a new stream
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"stream to {self.address} closed: {e}") from None
        finally:
            stream.pending.pop(rid, None)
            if not sent:  # cancelled, or the lane failed, before the request left: no reply will free its region
                stream.release(rid)
            elif not answered:  # timed out or cancelled: its reply, if it comes, is nobody's
                stream.abandoned.add(rid)
            if stream.sending:  # not sent on the lane (it closed first): nothing reads it any more
                stream.sending.pop(rid, None)
            if expiry is not None:
                expiry.cancel()

    async def _open(self, timeout: float | None) -> _Stream:
        if self._stream is None:
            async with self._open_lock:  # callers arriving meanwhile share the one new stream
                if self._stream is None:
                    self._stream = await self._new_stream(timeout)
        return self._stream

    async def _new_stream(self, timeout: float | None) -> _Stream:
        segment = self._offer_segment()
        arena, tcp_offer, token = None, None, b""
        if self.tcp:
            with contextlib.suppress(SharedMemoryError):  # no memory for it: tensors travel inline
                arena = Segment.private(HEADER_BYTES + self.shm_bytes)
                tcp_offer, token = new_offer(arena)
        offers = ([(METADATA_KEY, segment.offer)] if segment else []) + ([(TCP_METADATA_KEY, tcp_offer)] if arena else [])
        call = self._stub.ForwardStream(metadata=tuple(offers) or None)
        try:
            metadata = {}
            if offers:
                try:  # the server answers in its initial metadata, before any reply
                    metadata = dict(await asyncio.wait_for(call.initial_metadata(), timeout) or ())
                except TimeoutError:
                    raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"{self.address} did not open a stream within {timeout}s") from None
                finally:
                    if segment is not None:
                        segment.unlink()  # attached or not, nobody needs the name any more
            stream = _Stream(call)
            stream.reader = asyncio.get_running_loop().create_task(self._read_replies(stream))
            lane_timeout = timeout or LANE_CONNECT_SECONDS
            if segment is not None and metadata.get(METADATA_KEY) == ATTACHED:
                stream.use(segment, "shm")
                if LANE_METADATA_KEY in metadata and self.shm_dir is not None:  # always: the segment is made in shm_dir
                    try:
                        stream.lane = await ClientLane.connect(
                            self.shm_dir, metadata[LANE_METADATA_KEY], segment.offer, on_response=stream.deliver,
                            on_closed=lambda why: self._lane_closed(stream, why), timeout=lane_timeout)
                    except SharedMemoryError as e:
                        log.info("calls to %s go over the gRPC stream, not a lane: %s", self.address, e)
            elif arena is not None and TCP_LANE_METADATA_KEY in metadata:
                try:
                    host, port = lane_address(metadata[TCP_LANE_METADATA_KEY], self.address)
                    stream.use(arena, "tcp")  # before the lane reads: its replies' regions are the stream's
                    stream.lane = ClientLane.serving(await connect_tcp(
                        host, port, token, arena, stream.region_of_reply, source=stream.sent_from,
                        on_responses=lambda responses: each(responses, stream.deliver),
                        on_closed=lambda why: self._lane_closed(stream, why), timeout=lane_timeout))
                except SharedMemoryError as e:
                    stream.segment, stream.allocator, stream.transport = None, None, "inline"
                    self._tell_inline(str(e))
            elif segment is not None or arena is not None:
                self._tell_inline(metadata.get(METADATA_KEY) or "the server offered no shared memory and no TCP lane")
            return stream
        except BaseException:  # cancelled, or failed, while opening: the server's end of it goes too
            call.cancel()
            raise

    def _lane_closed(self, stream: _Stream, why: LaneClosed) -> None:
        """The lane ended (the server stops, or went away): so does its stream; its calls may be retried."""
        if self._stream is stream:
            self._stream = None
        self._fail_pending(stream, rpc_error(grpc.StatusCode.UNAVAILABLE, f"the lane to {self.address} closed: {why}"))
        stream.call.cancel()

    def _offer_segment(self) -> Segment | None:
        if self.shm_dir is None:
            return None
        try:
            return Segment.create(self.shm_dir, self.shm_bytes)
        except SharedMemoryError as e:
            self._tell_inline(str(e))
            return None

    def _tell_inline(self, why: str) -> None:
        if not self._told_inline:
            self._told_inline = True
            log.info("tensors to %s travel inline, not through shared memory: %s", self.address, why)

    async def _read_replies(self, stream: _Stream) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            async for response in stream.call:
                stream.deliver(response)
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the client was closed")
        finally:
            if self._stream is stream:
                self._stream = None  # the next call opens a new stream
            stream.end()
            self._fail_pending(stream, error or rpc_error(grpc.StatusCode.UNAVAILABLE,
                                                          f"the server at {self.address} ended the stream"))

    def _fail_pending(self, stream: _Stream, error: grpc.aio.AioRpcError) -> None:
        # A stream ends for all its calls alike (a refused request gets its own error response):
        # statuses about every call (_PASS_THROUGH) pass on; the others may simply be retried.
        retry = rpc_error(grpc.StatusCode.UNAVAILABLE,
                          f"the stream to {self.address} broke ({error.code().name}: {error.details()}); retry the call")
        for waiter in list(stream.pending.values()):
            if not waiter.done():
                waiter.set_exception(error if error.code() in _PASS_THROUGH else retry)

    async def describe(self) -> pb.DescribeResponse:
        return await self._stub.Describe(pb.DescribeRequest())

    async def attach_device(self, request: pb.DeviceAttachRequest, timeout: float) -> pb.DeviceAttachResponse:
        return await self._stub.AttachDevice(request, timeout=timeout)

    async def load(self, keys: Iterable[tuple[int, int]]) -> pb.LoadResponse:
        return await self._stub.Load(pb.LoadRequest(model=self.model, experts=_keys(keys)))

    async def unload(self, keys: Iterable[tuple[int, int]]) -> pb.UnloadResponse:
        return await self._stub.Unload(pb.UnloadRequest(model=self.model, experts=_keys(keys)))

    async def close(self) -> None:
        """End the stream cleanly (the server sees the client finish, not a cancel), then the channel."""
        stream, self._stream = self._stream, None
        if stream is not None:
            if stream.lane is not None:
                stream.lane.close()
            try:  # a stream that takes no more (its server stopped reading) is cut after a second
                await asyncio.wait_for(stream.call.done_writing(), CLOSE_SECONDS)
                if stream.reader is not None:
                    await asyncio.wait_for(asyncio.shield(stream.reader), CLOSE_SECONDS)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, TimeoutError):
                stream.call.cancel()
            if stream.reader is not None:  # set as the stream opened
                await asyncio.gather(stream.reader, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
        self._channel = None

    async def __aenter__(self) -> "ExpertClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


# Statuses that are about every pending call alike (not one bad request), passed on as they are.
_PASS_THROUGH = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                 grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}

CALL_HEADROOM_BYTES = 64 << 10  # a message's fields besides its tensor


def split_rows(experts: Sequence[int], counts: Sequence[int], rows: int) -> list[tuple[int, list[int], list[int]]]:
    """Groups (expert, count), in order, cut into parts of at most `rows` rows: [(first row, experts, counts)].
    A group may be cut across parts: its expert then appears in both."""
    parts, start, experts_now, counts_now, filled = [], 0, [], [], 0
    for expert, count in zip(experts, counts):
        while count:
            take = min(count, rows - filled)
            experts_now.append(expert)
            counts_now.append(take)
            filled, count = filled + take, count - take
            if filled == rows:
                parts.append((start, experts_now, counts_now))
                start, experts_now, counts_now, filled = start + rows, [], [], 0
    if filled:
        parts.append((start, experts_now, counts_now))
    return parts
LANE_CONNECT_SECONDS = 5.0
CLOSE_SECONDS = 1.0  # how long close() waits for the server to see the stream end and answer what is in flight


def _keys(keys: Iterable[tuple[int, int]]) -> list[pb.ExpertKey]:
    return [pb.ExpertKey(layer=layer, expert=expert) for layer, expert in keys]
