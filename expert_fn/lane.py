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

Both sides run the lane on their event loop with add_reader; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
import struct
from pathlib import Path
from typing import Awaitable, Callable, Coroutine

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
    """The other side closed the lane, or sent what is not a packet of the protocol."""


class _Packets:
    """A connected SOCK_SEQPACKET socket read from the event loop: the packets there when it turns
    readable go to `on_packets` together, and the end of the connection (or an oversized packet) to
    `on_closed`, once."""

    def __init__(self, sock: socket.socket, on_packets: Callable[[list[bytes]], None],
                 on_closed: Callable[[LaneClosed], None]):
        self.sock, self._on_packets, self._on_closed = sock, on_packets, on_closed
        self._loop = asyncio.get_running_loop()
        self._reading = False
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
        packets, closed = [], None
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
                closed = LaneClosed(f"a packet over {MAX_PACKET_BYTES} bytes")
                break
            packets.append(data)
        if packets:
            self._on_packets(packets)
        if closed is not None:
            self.close(closed)

    def try_send(self, data: bytes) -> bool:
        """Send one packet if the socket's buffer has room for it (False: not now). Raises LaneClosed
        when the lane is gone. A buffer holds hundreds of packets: this is rarely False."""
        if self.closed:
            raise LaneClosed("the lane is closed")
        try:
            self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            raise LaneClosed(f"lane broke: {e.strerror}") from None
        return True

    async def send(self, data: bytes) -> None:
        """One packet, once the buffer has room. Raises LaneClosed when the lane is gone."""
        if not self.try_send(data):
            try:
                await self._loop.sock_sendall(self.sock, data)
            except OSError as e:
                raise LaneClosed(f"lane broke: {e.strerror}") from None

    def close(self, why: LaneClosed | None = None) -> None:
        if self.closed:
            return
        self.stop_reading()
        self.closed = True
        self.sock.close()
        if why is not None:
            self._on_closed(why)


@contextlib.contextmanager
def _socket_address(path: Path):
    """`path` as AF_UNIX takes it: at most 107 bytes, else through /proc/self/fd/ of its folder."""
    if len(os.fsencode(path)) < 108:
        yield str(path)
        return
    folder = os.open(path.parent, os.O_PATH)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)


def _listen(folder: Path) -> tuple[socket.socket, Path]:
    path = Path(folder) / f"kubemoe-lane-{secrets.token_hex(16)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with _socket_address(path) as address:
            sock.bind(address)
        os.chmod(path, 0o600)  # before listen(): nobody could connect in between
        sock.listen(1)
    except OSError as e:
        sock.close()
        with contextlib.suppress(OSError):
            path.unlink()
        raise SharedMemoryError(f"cannot listen on a lane in {folder}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock, path


def _peer_uid(sock: socket.socket) -> int:
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


class ServerLane:
    """The server's end of one stream's lane: requests in, responses out in whatever order they finish.

    A request that came alone (the only packet of the only file the loop woke for) is answered by
    `answer_now` in the reader's callback: no task, no loop turn, where each costs tens of
    microseconds on a cold core. Others, and one that answer_now declines (requests are pending
    that it should join), are answered by `answer` in a task that `spawn` starts (among the stream's):
    requests read together start together and can share a round (batcher.py).
    """

    def __init__(self, folder: Path, offer: str, answer: Callable[[pb.ForwardRequest], Awaitable[pb.ForwardResponse]],
                 spawn: Callable[[Coroutine], None], *,
                 answer_now: Callable[[pb.ForwardRequest], pb.ForwardResponse | None]):
        self._listener, self._path = _listen(folder)
        self.name = self._path.name
        self._offer, self._answer, self._answer_now, self._spawn = offer, answer, answer_now, spawn
        self._packets: _Packets | None = None
        self._loop = asyncio.get_running_loop()
        self._accepting = self._loop.create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn, _ = await asyncio.wait_for(loop.sock_accept(self._listener), ACCEPT_SECONDS)
        except TimeoutError:
            log.info("no client connected to lane %s within %.0fs; its stream goes on without it", self.name,
                     ACCEPT_SECONDS)
            return
        finally:
            self._listener.close()
            self._path.unlink(missing_ok=True)
        conn.setblocking(False)
        try:
            offer = (await asyncio.wait_for(loop.sock_recv(conn, 1024), ACCEPT_SECONDS)).decode("ascii", "replace")
            if _peer_uid(conn) != os.geteuid():
                answer = f"{REFUSED}: the client runs as another user"
            elif offer != self._offer:
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
        self._packets = _Packets(conn, self._requests, lambda why: log.debug("lane %s: %s", self.name, why))
        self._packets.start_reading()

    def _requests(self, packets: list[bytes]) -> None:
        requests = []
        for data in packets:
            try:
                requests.append(pb.ForwardRequest.FromString(data))
            except DecodeError:
                # Nothing to answer to (no request id): the client's calls on this lane fail as UNAVAILABLE.
                log.warning("lane %s: a packet that is not a ForwardRequest; closing the lane", self.name)
                self._packets.close()
                break
        if len(packets) == 1 == len(requests) and busy_poll.only_event(self._loop):
            response = self._answer_now(requests[0])
            if response is not None:
                return self._send(response)
        for request in requests:
            self._spawn(self._reply(request))

    async def _reply(self, request: pb.ForwardRequest) -> None:
        self._send(await self._answer(request))

    def _send(self, response: pb.ForwardResponse) -> None:
        data = response.SerializeToString()
        with contextlib.suppress(LaneClosed):  # the client left: nobody waits for this reply
            if not self._packets.try_send(data):
                self._spawn(self._send_later(data))

    async def _send_later(self, data: bytes) -> None:
        with contextlib.suppress(LaneClosed):
            await self._packets.send(data)

    def stop_reading(self) -> None:
        """Take no more requests (the server is stopping); those already spawned are still answered."""
        if self._packets is not None:
            self._packets.stop_reading()

    def close(self) -> None:
        self._accepting.cancel()
        if self._packets is not None:
            self._packets.close()


class ClientLane:
    """The client's end: `send` a request; each response goes to `on_response`, the lane's end to
    `on_closed` (after which the stream it belongs to is useless too)."""

    def __init__(self, packets: _Packets):
        self._packets = packets

    @classmethod
    async def connect(cls, folder: Path, name: str, offer: str, *, on_response: Callable[[pb.ForwardResponse], None],
                      on_closed: Callable[[LaneClosed], None], timeout: float | None) -> "ClientLane":
        """Raises SharedMemoryError saying why the lane cannot be used (the stream still can)."""
        if not _NAME.fullmatch(name):
            raise SharedMemoryError(f"lane name {name[:80]!r} is not kubemoe-lane-<32 hex digits>")
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        try:
            with _socket_address(Path(folder) / name) as address:
                await asyncio.wait_for(loop.sock_connect(sock, address), timeout)
            await loop.sock_sendall(sock, offer.encode())
            answer = (await asyncio.wait_for(loop.sock_recv(sock, 1024), timeout)).decode("ascii", "replace")
        except (OSError, TimeoutError) as e:
            sock.close()
            raise SharedMemoryError(f"cannot connect to lane {name}: {e}") from None
        if answer != ATTACHED:
            sock.close()
            raise SharedMemoryError(f"lane {name}: {answer or 'closed during the handshake'}")

        def on_packets(datas: list[bytes]) -> None:
            for data in datas:
                try:
                    response = pb.ForwardResponse.FromString(data)
                except DecodeError:
                    packets.close(LaneClosed("the server sent a packet that is not a ForwardResponse"))
                    return
                on_response(response)

        packets = _Packets(sock, on_packets, on_closed)
        packets.start_reading()
        return cls(packets)

    @property
    def closed(self) -> bool:
        return self._packets.closed

    async def send(self, request: pb.ForwardRequest) -> bool:
        """Send `request`; False when it is too large for a packet (send it on the stream)."""
        data = request.SerializeToString()
        if len(data) > MAX_PACKET_BYTES:
            return False
        await self._packets.send(data)
        return True

    def close(self) -> None:
        self._packets.close()
