"""The lane: a shared-memory ForwardStream's calls over a Unix socket instead of HTTP/2.

Once tensors travel through the segment (shm.py), a call's messages are ~100 bytes, and what
is left of its cost is Python gRPC carrying them: each message wakes gRPC's event engine, its
completion-queue poller and the asyncio loop on each side. Measured with a 64-byte echo on the
H200 host: 180-200 us a round trip, 380 us when the server was busy computing (grpc_floor.py).
A SOCK_SEQPACKET socket read straight from each side's event loop is one syscall and one loop
wake-up per message: a few tens of microseconds.

The protocol is in kubemoe.proto (ExpertService). Per stream whose segment the server attached:
the server listens on a fresh socket file in the same folder, names it in the initial metadata,
and accepts exactly one connection: from its own user (SO_PEERCRED) whose first packet is the
stream's offer. The file is gone once the client connected (or after ACCEPT_SECONDS), like the
segment's. Each packet then holds one serialized ForwardRequest or ForwardResponse.

Both sides run the lane on their event loop with add_reader; nothing here blocks. Between nodes the
same lane runs over TCP, its tensors' bytes in the frames (frames.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import secrets
import socket
import struct
from pathlib import Path
from typing import Awaitable, Callable, Coroutine, Generic, Protocol, TypeVar

from google.protobuf.message import DecodeError

from kubemoe import busy_poll
from kubemoe.expert_fn.shm import ATTACHED, REFUSED, SharedMemoryError
from kubemoe.proto import kubemoe_pb2 as pb

LANE_METADATA_KEY = "kubemoe-shm-lane"
MAX_PACKET_BYTES = 64 << 10
ACCEPT_SECONDS = 10.0  # how long a stream's socket waits for its client to connect
_NAME = re.compile(r"kubemoe-lane-[0-9a-f]{32}")
log = logging.getLogger(__name__)


class LaneClosed(ConnectionError):
    """The lane ended: the other side closed it, or went away."""


class LaneViolation(LaneClosed):
    """The other side sent what is not a message of the protocol: the lane ends, and the server logs why."""


Message = TypeVar("Message", pb.ForwardRequest, pb.ForwardResponse)  # either side's
# A carrier reads one side's messages and sends the other's: the server's reads requests, the client's responses.
Received = TypeVar("Received", bound=pb.ForwardRequest | pb.ForwardResponse)
Sent = TypeVar("Sent", bound=pb.ForwardRequest | pb.ForwardResponse)
_Sent = TypeVar("_Sent", bound=pb.ForwardRequest | pb.ForwardResponse, contravariant=True)  # a Carrier only takes it in


class SocketCarrier(Generic[Received, Sent]):
    """A connected socket read from the event loop (add_reader): what both carriers share. Messages
    complete when it turns readable go to `on_messages` together; the end of the connection (or what
    breaks the protocol) to `on_closed`, once. What the socket cannot take yet waits in `_backlog`, in
    order, until it is writable (add_writer): a send never blocks, and senders never wait on the socket
    side by side (asyncio keeps one writer per socket: concurrent sock_sendall calls lost wake-ups)."""

    def __init__(self, sock: socket.socket, message_type: type[Received],
                 on_messages: Callable[[list[Received]], None], on_closed: Callable[[LaneClosed], None]):
        self.sock, self._on_closed = sock, on_closed
        self._type: type[Received] = message_type
        self._on_messages: Callable[[list[Received]], None] = on_messages
        self._loop = asyncio.get_running_loop()
        self._reading = False
        self._backlog: collections.deque = collections.deque()  # what the socket did not take yet
        self.closed = False

    def start_reading(self) -> None:
        if not self._reading and not self.closed:
            self._loop.add_reader(self.sock, self._readable)
            self._reading = True

    def stop_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self.sock)
            self._reading = False

    def _readable(self) -> None:
        raise NotImplementedError

    def _parse(self, data: bytes | memoryview) -> Received:
        # The ignore: mypy widens FromString's Self on a type[Received] to Received's bound (the union), and
        # protobuf's stub says bytes where FromString reads any buffer (a frame is parsed in place, uncopied)
        return self._type.FromString(data)  # type: ignore[return-value,arg-type]

    def close(self, why: LaneClosed | None = None) -> None:
        if self.closed:
            return
        if self._backlog:
            self._loop.remove_writer(self.sock)
            self._backlog.clear()
        self.stop_reading()
        self.closed = True
        self.sock.close()
        if why is not None:
            self._on_closed(why)


class _Packets(SocketCarrier[Received, Sent]):
    """A SOCK_SEQPACKET socket carrying one `message_type` message per packet (its backlog: whole packets)."""

    def _readable(self) -> None:
        messages, closed = [], None
        while True:  # drain what is there: one wake-up for all of it
            try:
                data, _, flags, _ = self.sock.recvmsg(MAX_PACKET_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                closed = LaneClosed(f"lane broke: {e.strerror}")
                break
            if not data:
                closed = LaneClosed("the other side closed the lane")
                break
            if flags & socket.MSG_TRUNC:
                closed = LaneViolation(f"a packet over {MAX_PACKET_BYTES} bytes")
                break
            try:
                messages.append(self._parse(data))
            except DecodeError:
                closed = LaneViolation(f"a packet that is not a {self._type.__name__}")
                break
        if messages:
            self._on_messages(messages)
        if closed is not None:
            self.close(closed)

    def send(self, message: Sent) -> None:
        """Send one message, or queue it behind what the socket's buffer could not take yet (a buffer holds
        hundreds of packets). Raises LaneClosed when the lane is gone."""
        if self.closed:
            raise LaneClosed("the lane is closed")
        data = message.SerializeToString()
        if self._backlog:  # packets go out in order
            self._backlog.append(data)
            return
        try:
            self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            self._backlog.append(data)
            self._loop.add_writer(self.sock, self._writable)
        except OSError as e:
            raise LaneClosed(f"lane broke: {e.strerror}") from None

    def _writable(self) -> None:
        while self._backlog:
            try:
                self.sock.send(self._backlog[0])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.close(LaneClosed(f"lane broke: {e.strerror}"))
                return
            self._backlog.popleft()
        self._loop.remove_writer(self.sock)

class Carrier(Protocol[_Sent]):
    """What moves a lane's messages: _Packets here, frames.Frames over TCP (both SocketCarriers). It
    sends `_Sent`; what it reads goes to the callback it was made with."""

    closed: bool

    def start_reading(self) -> None: ...
    def stop_reading(self) -> None: ...
    def send(self, message: _Sent) -> None: ...  # now, or queued in order: never blocks
    def close(self, why: LaneClosed | None = None) -> None: ...


@contextlib.contextmanager
def socket_address(path: Path):
    """`path` as AF_UNIX takes it: at most 107 bytes, else through /proc/self/fd/ of its folder."""
    if len(os.fsencode(path)) < 108:
        yield str(path)
        return
    folder = os.open(path.parent, os.O_PATH)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)


def listen_socket(folder: Path, prefix: str = "kubemoe-lane") -> tuple[socket.socket, Path]:
    """A SOCK_SEQPACKET socket listening for one connection on a fresh file of `folder` (mode 0600), non-blocking."""
    path = Path(folder) / f"{prefix}-{secrets.token_hex(16)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with socket_address(path) as address:
            sock.bind(address)
        os.chmod(path, 0o600)  # before listen(): nobody could connect in between
        sock.listen(1)
    except OSError as e:
        sock.close()
        with contextlib.suppress(OSError):
            path.unlink()
        raise SharedMemoryError(f"cannot listen on a socket in {folder}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock, path


def peer_uid(sock: socket.socket) -> int:
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


class ServerLane:
    """The server's end of one stream's lane: requests in, responses out in whatever order they finish.

    A request that came alone (the only message of the only file the loop woke for) is answered by
    `answer_now` in the reader's callback: no task, no loop turn, where each costs tens of
    microseconds on a cold core. Others, and one that answer_now declines (requests are pending
    that it should join), are answered by `answer` in a task that `spawn` starts (among the stream's):
    requests read together start together and can share a round (batcher.py).

    The lane serves once its carrier is connected: `over_unix` accepts it on a socket file of its
    own; frames.py's `over_tcp` takes it from the server's data port.
    """

    def __init__(self, name: str, answer: Callable[[pb.ForwardRequest], Awaitable[pb.ForwardResponse]],
                 spawn: Callable[[Coroutine], None], *,
                 answer_now: Callable[[pb.ForwardRequest], pb.ForwardResponse | None]):
        self.name, self._answer, self._answer_now, self._spawn = name, answer, answer_now, spawn
        self._carrier: Carrier[pb.ForwardResponse] | None = None  # set by serve(), once the client is there
        self._loop = asyncio.get_running_loop()
        self._connecting: asyncio.Task | None = None
        self._on_close: list[Callable[[], None]] = []

    @classmethod
    def over_unix(cls, folder: Path, offer: str, answer: Callable[[pb.ForwardRequest], Awaitable[pb.ForwardResponse]],
                  spawn: Callable[[Coroutine], None], *,
                  answer_now: Callable[[pb.ForwardRequest], pb.ForwardResponse | None]) -> "ServerLane":
        """A lane on a fresh socket file in `folder` (its name is `.name`), for the client that sends `offer`."""
        listener, path = listen_socket(folder)
        lane = cls(path.name, answer, spawn, answer_now=answer_now)
        lane.connect_with(lane._accept_unix(listener, path, offer))
        return lane

    def connect_with(self, connecting: Coroutine) -> None:
        """Run `connecting` until the client is there: it calls serve(), or returns without (no client came
        or it failed the handshake: the stream goes on without a lane). close() cancels it."""
        self._connecting = self._loop.create_task(connecting)

    def serve(self, carrier: Carrier[pb.ForwardResponse]) -> None:
        self._carrier = carrier
        carrier.start_reading()

    async def _accept_unix(self, listener: socket.socket, path: Path, offer: str) -> None:
        loop = self._loop
        try:
            conn, _ = await asyncio.wait_for(loop.sock_accept(listener), ACCEPT_SECONDS)
        except TimeoutError:
            log.info("no client connected to lane %s within %.0fs; its stream goes on without it", self.name,
                     ACCEPT_SECONDS)
            return
        finally:
            listener.close()
            path.unlink(missing_ok=True)
        conn.setblocking(False)
        try:
            sent = (await asyncio.wait_for(loop.sock_recv(conn, 1024), ACCEPT_SECONDS)).decode("ascii", "replace")
            if peer_uid(conn) != os.geteuid():
                answer = f"{REFUSED}: the client runs as another user"
            elif sent != offer:
                answer = f"{REFUSED}: the first packet is not this stream's offer"
            else:
                answer = ATTACHED
            conn.send(answer.encode())
        except (OSError, TimeoutError) as e:
            log.info("lane %s: the handshake failed (%s)", self.name, e)
            conn.close()
            return
        if answer != ATTACHED:
            log.warning("lane %s: %s", self.name, answer)
            conn.close()
            return
        self.serve(_Packets(conn, pb.ForwardRequest, self.take, self.ended))

    def ended(self, why: LaneClosed) -> None:
        """The carrier's end: a protocol violation is worth a warning, a client leaving is not."""
        if isinstance(why, LaneViolation):
            log.warning("lane %s: %s; closing the lane (its client's calls on it fail as UNAVAILABLE)", self.name, why)
        else:
            log.debug("lane %s: %s", self.name, why)

    def take(self, requests: list[pb.ForwardRequest]) -> None:
        """The requests the carrier read in one wake-up: answered alone now, or together in tasks."""
        if len(requests) == 1 and busy_poll.only_event(self._loop):
            response = self._answer_now(requests[0])
            if response is not None:
                return self._send(response)
        for request in requests:
            self._spawn(self._reply(request))

    async def _reply(self, request: pb.ForwardRequest) -> None:
        self._send(await self._answer(request))

    def _connected(self) -> Carrier[pb.ForwardResponse]:
        if self._carrier is None:  # requests come only through the carrier: a reply without one is a bug
            raise RuntimeError(f"lane {self.name} answered a request before serve() gave it a carrier")
        return self._carrier

    def _send(self, response: pb.ForwardResponse) -> None:
        with contextlib.suppress(LaneClosed):  # the client left: nobody waits for this reply
            self._connected().send(response)

    def stop_reading(self) -> None:
        """Take no more requests (the server is stopping); those already spawned are still answered."""
        if self._carrier is not None:
            self._carrier.stop_reading()

    def on_close(self, callback: Callable[[], None]) -> None:
        """Run `callback` when the lane closes (e.g. unpin memory only its carrier used)."""
        self._on_close.append(callback)

    def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self._carrier is not None:
            self._carrier.close()
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()


class ClientLane:
    """The client's end: `send` a request; each response goes to `on_response`, the lane's end to
    `on_closed` (after which the stream it belongs to is useless too)."""

    def __init__(self, carrier: Carrier[pb.ForwardRequest]):
        self._carrier = carrier

    @classmethod
    async def connect(cls, folder: str | Path, name: str, offer: str, *, on_response: Callable[[pb.ForwardResponse], None],
                      on_closed: Callable[[LaneClosed], None], timeout: float | None) -> "ClientLane":
        """Raises SharedMemoryError saying why the lane cannot be used (the stream still can)."""
        if not _NAME.fullmatch(name):
            raise SharedMemoryError(f"lane name {name[:80]!r} is not kubemoe-lane-<32 hex digits>")
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        try:
            with socket_address(Path(folder) / name) as address:
                await asyncio.wait_for(loop.sock_connect(sock, address), timeout)
            await loop.sock_sendall(sock, offer.encode())
            answer = (await asyncio.wait_for(loop.sock_recv(sock, 1024), timeout)).decode("ascii", "replace")
        except (OSError, TimeoutError) as e:
            sock.close()
            raise SharedMemoryError(f"cannot connect to lane {name}: {e}") from None
        if answer != ATTACHED:
            sock.close()
            raise SharedMemoryError(f"lane {name}: {answer or 'closed during the handshake'}")
        return cls.serving(_Packets(sock, pb.ForwardResponse, lambda responses: each(responses, on_response),
                                    on_closed))

    @classmethod
    def serving(cls, carrier: Carrier[pb.ForwardRequest]) -> "ClientLane":
        carrier.start_reading()
        return cls(carrier)

    @property
    def closed(self) -> bool:
        return self._carrier.closed

    def send(self, request: pb.ForwardRequest) -> bool:
        """Send `request`; False when it is too large for the lane (send it on the stream)."""
        if request.ByteSize() > MAX_PACKET_BYTES:
            return False
        self._carrier.send(request)
        return True

    def close(self) -> None:
        self._carrier.close()


def each(responses: list[pb.ForwardResponse], on_response: Callable[[pb.ForwardResponse], None]) -> None:
    """A carrier's responses to a client's one-at-a-time callback."""
    for response in responses:
        on_response(response)
