"""The lane over TCP: a ForwardStream's calls between pods and nodes, tensor bytes straight into place.

Without a shared folder (another node, or a pod that mounts none: shm.py) tensors would travel
inline through Python gRPC, which frames, parses and copies every byte: about 2 ms for a 64-token
Mixtral call, 10 ms at 256 tokens. Here both sides hold an *arena*, private memory of the same size
(shm.Segment.private; pinned where the process computes on a GPU): the client's own, and one the
server makes for the stream. A call's tensor lies at the same offset in both. Its message names
that region (a SharedRegion, as on shared memory) and its frame carries the region's bytes right
behind it, which the receiver reads straight into the same region of its own arena. The server
computes from there and writes its reply over the region, as with shared memory, so everything
above the carrier (client.py's regions, the servicer's jobs, lane.py's request handling) is the
code the shared-memory path runs.

A frame: an 8-byte header (little-endian u32 message length, u32 payload length), the serialized
message (at most MAX_MESSAGE_BYTES), then exactly the bytes of the region the message's tensor
names (none when it names none, e.g. a reply that carries an error). A frame whose payload is not
its tensor's size, a message that does not parse or names a region outside the arena (or, to a
client, not the region its request was sent in), and a connection that ends mid-frame close the
lane: its calls fail as UNAVAILABLE and are retried; other streams go on.

The handshake (kubemoe.proto, ExpertService): the client offers `kubemoe-tcp: <arena bytes>:<token>`
in the stream's metadata; a server with a data port, where shared memory did not attach, makes the
arena and answers `kubemoe-tcp-lane: [<host>:]<port>` in its initial metadata. The client connects
there and sends the token (32 hex digits); the server answers `attached`, and from then on the
connection carries that stream's calls. The token is the stream's: it serves once, a connection
that does not present a pending one within ACCEPT_SECONDS is dropped with a log line, and it is
never logged. gRPC stays the control plane and the fallback for what the lane cannot carry.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import socket
import struct
from dataclasses import dataclass
from typing import Callable, Generic

from google.protobuf.message import DecodeError

from kubemoe import wire
from kubemoe.expert_fn.lane import ACCEPT_SECONDS, LaneClosed, LaneViolation, Received, Sent, SocketCarrier
from kubemoe.expert_fn.shm import ALIGN, ATTACHED, HEADER_BYTES, Segment, SharedMemoryError
from kubemoe.proto import kubemoe_pb2 as pb

TCP_METADATA_KEY = "kubemoe-tcp"
TCP_LANE_METADATA_KEY = "kubemoe-tcp-lane"
MAX_MESSAGE_BYTES = 64 << 10
TOKEN_CHARS = 32
_HEADER = struct.Struct("<II")
_TOKEN = re.compile(rb"[0-9a-f]{32}")
# Header, message and the start of a small payload come in reads of at most _READ_AHEAD bytes (the
# payload's part of them is copied once more, into its region; a longer message takes several reads);
# a larger payload's rest is read straight into its region. The staging buffer holds the largest message.
_STAGING_BYTES = 128 << 10
_READ_AHEAD = 8 << 10
_MAX_PIECES = 512  # buffers per sendmsg, below Linux's IOV_MAX of 1024
log = logging.getLogger(__name__)

# Where a received message's payload goes: (offset, bytes) in the arena; raises ValueError saying
# why the message may not write there.
Placement = Callable[[Received], tuple[int, int]]
# Where a sent message's payload lies when not in its arena region (the caller's tensor); None: the region.
Source = Callable[[Sent], memoryview | None]


def tensor_region(message: pb.ForwardRequest | pb.ForwardResponse, arena_bytes: int) -> tuple[int, int]:
    """(offset, bytes) of the arena region `message.hidden` names; (0, 0) when it names none.
    Raises ValueError when the region is not one of an arena of `arena_bytes` bytes."""
    if not message.HasField("hidden") or message.hidden.WhichOneof("payload") != "shared":
        return 0, 0
    dtype = wire.FROM_WIRE.get(message.hidden.dtype)
    if dtype is None:
        raise ValueError(f"tensor dtype {message.hidden.dtype} is not one kubemoe sends")
    nbytes = dtype.itemsize
    for d in message.hidden.shape:
        if d < 0:
            raise ValueError(f"tensor shape {list(message.hidden.shape)} has a negative dimension")
        nbytes *= d
    offset = message.hidden.shared.offset
    if offset % ALIGN or offset < HEADER_BYTES or offset + nbytes > arena_bytes:
        raise ValueError(f"a region of {nbytes} bytes at offset {offset} is not inside the arena")
    return offset, nbytes


def new_offer(arena: Segment) -> tuple[str, bytes]:
    """(metadata value, token) for a client's offer of `arena`."""
    token = secrets.token_hex(TOKEN_CHARS // 2)
    return f"{arena.size}:{token}", token.encode()


def parse_offer(offer: str, *, max_bytes: int) -> tuple[int, bytes]:
    """(arena bytes, token) of a client's offer; raises SharedMemoryError saying what is wrong."""
    size, _, token = offer.partition(":")
    if not size.isdigit() or not _TOKEN.fullmatch(token.encode()):
        raise SharedMemoryError(f"a TCP lane offer is <arena bytes>:<{TOKEN_CHARS} hex digits>")
    if not HEADER_BYTES < int(size) <= HEADER_BYTES + max_bytes:
        raise SharedMemoryError(f"an arena of {size} bytes; this server makes at most {HEADER_BYTES + max_bytes}")
    return int(size), token.encode()


@dataclass
class _Payload(Generic[Received]):
    """A frame whose payload is still arriving: the arena region it is read into, how much is in, its message."""

    region: memoryview
    read: int
    message: Received


class Frames(SocketCarrier[Received, Sent]):
    """A connected TCP socket carrying one message (and its tensor's bytes) per frame."""

    def __init__(self, sock: socket.socket, arena: Segment, message_type: type[Received], place: Placement[Received],
                 on_messages: Callable[[list[Received]], None], on_closed: Callable[[LaneClosed], None],
                 source: Source[Sent] | None = None):
        super().__init__(sock, message_type, on_messages, on_closed)
        self._place, self._source = place, source
        self._arena, self._arena_bytes = memoryview(arena.buffer), arena.size
        self._staging = memoryview(bytearray(_STAGING_BYTES))
        self._staged = 0  # bytes in _staging not parsed yet
        self._payload: _Payload[Received] | None = None  # a frame's payload being read straight into the arena
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # -- reading -----------------------------------------------------------------------------------

    def _readable(self) -> None:
        messages, closed = [], None
        while True:  # drain what is there: one wake-up for all of it
            into = (self._payload.region[self._payload.read:] if self._payload is not None
                    else self._staging[self._staged:self._staged + _READ_AHEAD])
            try:
                n = self.sock.recv_into(into)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                closed = LaneClosed(f"lane broke: {e.strerror}")
                break
            if n == 0:
                closed = (LaneViolation("the connection ended in the middle of a frame")
                          if self._payload is not None or self._staged else LaneClosed("the other side closed the lane"))
                break
            try:
                if self._payload is not None:
                    self._payload.read += n
                    if self._payload.read == len(self._payload.region):
                        messages.append(self._payload.message)
                        self._payload = None
                else:
                    self._staged += n
                    self._parse_staged(messages)
            except LaneViolation as e:
                closed = e
                break
        if messages:
            self._on_messages(messages)
        if closed is not None:
            self.close(closed)

    def _parse_staged(self, messages: list[Received]) -> None:
        """Take the complete frames out of _staging; a frame whose payload is only partly there leaves
        its region to be read into next."""
        staging, at = self._staging, 0
        while self._staged - at >= _HEADER.size:
            message_bytes, payload_bytes = _HEADER.unpack_from(staging, at)
            if message_bytes > MAX_MESSAGE_BYTES:
                raise LaneViolation(f"a frame announcing a {message_bytes}-byte message (at most {MAX_MESSAGE_BYTES})")
            body = at + _HEADER.size
            if self._staged - body < message_bytes:
                break
            try:
                message = self._parse(staging[body:body + message_bytes])
            except DecodeError:
                raise LaneViolation(f"a frame whose message is not a {self._type.__name__}") from None
            try:
                offset, nbytes = self._place(message)
            except ValueError as e:
                raise LaneViolation(f"a frame whose tensor has no place here: {e}") from None
            if nbytes != payload_bytes:
                raise LaneViolation(f"a frame announcing {payload_bytes} payload bytes for a tensor of {nbytes}")
            start = body + message_bytes
            here = min(payload_bytes, self._staged - start)
            region = self._arena[offset:offset + payload_bytes]
            region[:here] = staging[start:start + here]
            at = start + here
            if here < payload_bytes:  # the rest goes straight into the region
                self._payload = _Payload(region, here, message)
                break
            messages.append(message)
        rest = self._staged - at
        if at and rest:
            staging[:rest] = bytes(staging[at:self._staged])
        self._staged = rest

    # -- writing -----------------------------------------------------------------------------------

    def send(self, message: Sent) -> None:
        """Queue one frame: what the socket takes now goes now, the rest when it is writable (the client's
        arena bounds what can be queued). Raises LaneClosed when the lane is gone."""
        if self.closed:
            raise LaneClosed("the lane is closed")
        data = message.SerializeToString()
        offset, nbytes = tensor_region(message, self._arena_bytes)
        pieces = [memoryview(_HEADER.pack(len(data), nbytes) + data)]
        if nbytes:
            source = None if self._source is None else self._source(message)
            if source is not None and source.nbytes != nbytes:  # the sender's own bookkeeping: a bug
                raise RuntimeError(f"a frame's payload of {source.nbytes} bytes for a region of {nbytes}")
            pieces.append(self._arena[offset:offset + nbytes] if source is None else source)
        if self._backlog:  # frames go out whole and in order
            self._backlog.extend(pieces)
        else:
            self._write(pieces)

    def _write(self, pieces: list[memoryview]) -> None:
        batch = pieces[:_MAX_PIECES]  # sendmsg takes at most IOV_MAX buffers
        try:
            sent = self.sock.sendmsg(batch)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            raise LaneClosed(f"lane broke: {e.strerror}") from None
        for i, piece in enumerate(batch):
            if sent < len(piece):
                self._backlog.extend([piece[sent:], *pieces[i + 1:]])
                self._loop.add_writer(self.sock, self._writable)
                return
            sent -= len(piece)
        if len(pieces) > len(batch):
            self._backlog.extend(pieces[len(batch):])
            self._loop.add_writer(self.sock, self._writable)

    def _writable(self) -> None:
        pieces = list(self._backlog)
        self._backlog.clear()
        self._loop.remove_writer(self.sock)
        try:
            self._write(pieces)
        except LaneClosed as e:
            self.close(e)



class DataPort:
    """The server's TCP listener for lanes: each connection goes to the stream whose token it presents."""

    def __init__(self, host: str, port: int, advertise: str | None = None):
        try:
            self._sock = socket.create_server((host, port), family=_family(host), backlog=128)
        except OSError as e:
            raise OSError(f"cannot listen for TCP lanes on {host}:{port}: {e.strerror}; choose another "
                          "--data-port (0: any free port, -1: no TCP lanes)") from None
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        # What clients connect to: the pod's IP in a cluster, else the host they dialled for gRPC.
        self.address = f"{advertise}:{self.port}" if advertise else str(self.port)
        self._waiting: dict[bytes, asyncio.Future] = {}
        self._handshakes: set[asyncio.Task] = set()
        self._accepting: asyncio.Task | None = None

    def start(self) -> None:
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    def expect(self, token: bytes) -> asyncio.Future:
        """A future for the connection that presents `token`; cancel it to stop waiting."""
        if token in self._waiting:
            raise SharedMemoryError("that TCP lane token is already in use: offer a fresh one")
        future = self._waiting[token] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda _: self._waiting.pop(token, None))
        return future

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, peer = await loop.sock_accept(self._sock)
            task = loop.create_task(self._handshake(conn, peer))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, conn: socket.socket, peer) -> None:
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        token = b""
        try:
            async with asyncio.timeout(ACCEPT_SECONDS):
                while len(token) < TOKEN_CHARS:
                    chunk = await loop.sock_recv(conn, TOKEN_CHARS - len(token))
                    if not chunk:
                        break
                    token += chunk
        except (OSError, TimeoutError):
            pass
        waiter = next((f for t, f in self._waiting.items() if secrets.compare_digest(t, token)), None) \
            if len(token) == TOKEN_CHARS else None
        if waiter is None or waiter.done():
            log.warning("TCP lane: dropped a connection from %s that presented no pending stream's token", peer)
            conn.close()
            return
        try:
            await loop.sock_sendall(conn, ATTACHED.encode())
        except OSError as e:
            log.info("TCP lane: the handshake with %s failed (%s)", peer, e.strerror)
            conn.close()
            waiter.cancel()
            return
        waiter.set_result(conn)

    def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        for task in list(self._handshakes):
            task.cancel()
        for future in list(self._waiting.values()):
            future.cancel()
        self._sock.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


async def serve_lane(lane, waiter: asyncio.Future, arena: Segment) -> None:
    """What a TCP lane runs until its client is there (lane.ServerLane.connect_with): wait for the
    connection that presents the stream's token (DataPort.expect's `waiter`), then serve the lane's
    requests from it; their tensors land in `arena`."""
    try:
        conn = await asyncio.wait_for(waiter, ACCEPT_SECONDS)
    except TimeoutError:
        log.info("no client connected to TCP lane %s within %.0fs; its stream goes on without it", lane.name,
                 ACCEPT_SECONDS)
        return
    lane.serve(Frames(conn, arena, pb.ForwardRequest, lambda m: tensor_region(m, arena.size), lane.take, lane.ended))


async def connect(host: str, port: int, token: bytes, arena: Segment, place: Placement[pb.ForwardResponse], *,
                  on_responses: Callable[[list[pb.ForwardResponse]], None], on_closed: Callable[[LaneClosed], None],
                  timeout: float | None, source: Source[pb.ForwardRequest] | None = None) -> Frames:
    """The client's end of a TCP lane; raises SharedMemoryError saying why it cannot be used."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, (host, port))
            await loop.sock_sendall(sock, token)
            answer = b""
            while len(answer) < len(ATTACHED):
                chunk = await loop.sock_recv(sock, len(ATTACHED) - len(answer))
                if not chunk:
                    break
                answer += chunk
    except (OSError, TimeoutError) as e:
        sock.close()
        raise SharedMemoryError(f"cannot connect a TCP lane to {host}:{port}: {e}") from None
    if answer != ATTACHED.encode():
        sock.close()
        raise SharedMemoryError(f"the TCP lane at {host}:{port} refused the stream's token")
    return Frames(sock, arena, pb.ForwardResponse, place, on_responses, on_closed, source)


def lane_address(advertised: str, dialled: str) -> tuple[str, int]:
    """(host, port) of a server's TCP lane: `[host:]port` as it advertised it, the host defaulting to
    the one this client dialled for gRPC (`host:port`, `[v6]:port`, `dns:///host:port`)."""
    host, _, port = advertised.rpartition(":")
    if not host:
        host = dialled.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:").rpartition(":")[0]
    if not port.isdigit() or not host:
        raise SharedMemoryError(f"cannot tell where the TCP lane {advertised[:80]!r} of {dialled} is")
    return host.strip("[]"), int(port)

