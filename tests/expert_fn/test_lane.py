"""The lane: shared-memory calls over a Unix socket, its handshake, per-request errors, and bad packets."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubemoe import wire
from kubemoe.expert_fn.lane import LANE_METADATA_KEY, MAX_PACKET_BYTES, ClientLane, _Packets, socket_address
from kubemoe.expert_fn.shm import ATTACHED, HEADER_BYTES, METADATA_KEY, Segment
from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc

from .conftest import left_in

ARCH = "mixtral"  # tiny: MoE layers 0 and 1, 8 experts, hidden 128, float32
H = 128


@pytest.fixture
async def shm_server(tiny_checkpoint, serve, tmp_path):
    async with serve(tiny_checkpoint(ARCH), shm_dir=tmp_path) as running:
        yield running


@contextlib.asynccontextmanager
async def open_stream(server, folder, segment: Segment):
    """A ForwardStream that offered `segment`; yields (call, the lane's file name)."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        call = pb_grpc.ExpertServiceStub(channel).ForwardStream(metadata=((METADATA_KEY, segment.offer),))
        metadata = dict(await call.initial_metadata())
        assert metadata[METADATA_KEY] == ATTACHED
        try:
            yield call, metadata[LANE_METADATA_KEY]
        finally:
            call.cancel()


class Replies:
    """A lane's responses by request id, for tests that drive ClientLane themselves."""

    def __init__(self):
        self.waiting: dict[str, asyncio.Future] = {}
        self.closed = asyncio.get_running_loop().create_future()

    def expect(self, request_id: str) -> asyncio.Future:
        future = self.waiting[request_id] = asyncio.get_running_loop().create_future()
        return future

    def on_response(self, response: pb.ForwardResponse) -> None:
        self.waiting.pop(response.request_id).set_result(response)

    def on_responses(self, responses: list[pb.ForwardResponse]) -> None:  # a carrier's own callback (frames.py)
        for response in responses:
            self.on_response(response)

    def on_closed(self, why) -> None:
        if not self.closed.done():
            self.closed.set_result(why)


def request(server, request_id: str, offset: int, tokens: int, experts=(3,), counts=None) -> pb.ForwardRequest:
    req = pb.ForwardRequest(model=server.config.model, request_id=request_id, layer=1, experts=list(experts),
                            counts=counts or [tokens])
    wire.describe_shared(req.hidden, torch.float32, [tokens, H], offset)
    return req


async def test_shared_memory_calls_take_the_lane_whose_file_is_then_gone(shm_server, tmp_path):
    x = torch.randn(6, H)
    want = await shm_server.client(streaming=False).forward(1, [2, 5], [4, 2], x)
    client = shm_server.client(shm_dir=tmp_path)
    got = await asyncio.gather(*(client.forward(1, [2, 5], [4, 2], x) for _ in range(5)))
    assert client._stream.lane is not None and not client._stream.lane.closed
    assert all(torch.allclose(g, want, rtol=1e-6, atol=1e-7) for g in got)
    assert not left_in(tmp_path)  # neither the segment's file nor the lane's socket is left
    await client.close()


async def test_a_lone_request_is_answered_in_the_readers_callback_and_requests_sent_together_share_a_round(
        shm_server, tmp_path):
    servicer, answered_now = shm_server.servicer, []
    answer_now = servicer.answer_now
    servicer.answer_now = lambda request, segment: answered_now.append(answer_now(request, segment)) or answered_now[-1]
    client = shm_server.client(shm_dir=tmp_path)
    x = torch.randn(4, H)
    want = await shm_server.client(streaming=False).forward(1, [2], [4], x)
    await client.forward(1, [2], [4], x)  # opens the stream and its lane
    answered_now.clear()
    rounds = servicer.batcher.rounds
    for _ in range(3):  # one after the other: each alone
        assert torch.allclose(await client.forward(1, [2], [4], x), want, rtol=1e-6, atol=1e-7)
    assert len(answered_now) == 3 and all(r is not None and not r.HasField("error") for r in answered_now)
    assert servicer.batcher.rounds == rounds + 3
    together = await asyncio.gather(*(client.forward(1, [2], [4], x) for _ in range(3)))  # sent in one loop turn
    assert all(torch.allclose(got, want, rtol=1e-6, atol=1e-7) for got in together)
    assert len(answered_now) == 3  # not answered alone...
    assert servicer.batcher.rounds == rounds + 4  # ...but in one round
    await client.close()


async def test_a_refused_request_on_the_lane_gets_its_status_and_the_lane_keeps_serving(shm_server, tmp_path):
    client = shm_server.client(shm_dir=tmp_path)
    x = torch.randn(3, H)
    assert (await client.forward(1, [2], [3], x)).shape == (3, H)
    stream = client._stream
    for call, code, words in (
        (client.forward(7, [2], [3], x), grpc.StatusCode.INVALID_ARGUMENT, "not an MoE layer"),
        (client.forward(1, [2], [3], torch.randn(3, H + 1)), grpc.StatusCode.INVALID_ARGUMENT, f"[tokens, {H}]"),
        (client.forward(1, [2], [2], x), grpc.StatusCode.INVALID_ARGUMENT, "counts sum to 2"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == code and words in refused.value.details()
    assert client._stream is stream and not stream.lane.closed  # the same lane, still open
    assert stream.allocator.in_use == 0  # the refused calls' regions are free again
    assert shm_server.metrics.value("calls_total", method="ForwardStream", code="INVALID_ARGUMENT") == 3
    assert (await client.forward(1, [2], [3], x)).shape == (3, H)
    await client.close()


async def test_the_lane_takes_only_its_streams_offer_and_only_once(shm_server, tmp_path):
    loop = asyncio.get_running_loop()
    segment = Segment.create(tmp_path, 1 << 16)
    async with open_stream(shm_server, tmp_path, segment) as (_, name):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock, socket_address(tmp_path / name) as address:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            await loop.sock_sendall(sock, b"kubemoe-" + b"0" * 32 + b":" + b"0" * 32)  # another segment's offer
            answer = await asyncio.wait_for(loop.sock_recv(sock, 1024), 10)
            assert answer.startswith(b"refused: the first packet is not this stream's offer")
            assert await asyncio.wait_for(loop.sock_recv(sock, 1024), 10) == b""  # and the server hung up
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock, socket_address(tmp_path / name) as address:
            with pytest.raises(FileNotFoundError):
                sock.connect(address)  # one connection per stream: the file went with the first
    segment.unlink()


@pytest.mark.parametrize("packet", [b"\xff" * 40, b"\x00" * (MAX_PACKET_BYTES + 1)], ids=["not-protobuf", "too-large"])
async def test_a_packet_the_server_cannot_read_closes_that_lane_only(shm_server, tmp_path, packet):
    segment = Segment.create(tmp_path, 1 << 16)
    async with open_stream(shm_server, tmp_path, segment) as (_, name):
        replies = Replies()
        lane = await ClientLane.connect(tmp_path, name, segment.offer, on_response=replies.on_response,
                                        on_closed=replies.on_closed, timeout=10)
        lane._carrier.sock.send(packet)
        await asyncio.wait_for(replies.closed, 10)  # the server closed this lane ...
        assert lane.closed
    segment.unlink()
    client = shm_server.client(shm_dir=tmp_path)  # ... and serves everyone else as before
    assert (await client.forward(1, [6], [2], torch.randn(2, H))).shape == (2, H)
    assert client._stream.lane is not None
    await client.close()


async def test_when_the_server_stops_calls_on_the_lane_fail_as_unavailable(tiny_checkpoint, serve, tmp_path):
    async with serve(tiny_checkpoint(ARCH), shm_dir=tmp_path) as server:
        client = server.client(shm_dir=tmp_path)
        await client.forward(1, [2], [1], torch.randn(1, H))
        lane = client._stream.lane
        server.servicer.end_streams()  # what SIGTERM does: open streams, and their lanes, end
        for _ in range(100):
            if lane.closed:
                break
            await asyncio.sleep(0.02)
        assert lane.closed and client._stream is None  # the next call opens a new stream
        await client.close()


def test_property_malformed_lane_requests_are_each_answered_and_the_lane_keeps_serving(tiny_checkpoint, serve,
                                                                                      tmp_path):
    """1000 requests naming random regions, dtypes, shapes, experts and counts, 25 at a time: each gets a
    response with its request id (an error that says what is wrong, or a result); then a valid one."""
    segment_bytes = 1 << 16
    malformed = st.fixed_dictionaries({
        "offset": st.one_of(st.integers(0, segment_bytes + HEADER_BYTES), st.sampled_from([HEADER_BYTES, 2 ** 40])),
        "dtype": st.sampled_from([pb.FLOAT32, pb.BFLOAT16, pb.FLOAT16, pb.DTYPE_UNSPECIFIED, 7]),
        "shape": st.lists(st.integers(-2, 300), max_size=3),
        "layer": st.integers(-1, 3),
        "experts": st.lists(st.integers(-1, 9), max_size=3),
        "counts": st.lists(st.integers(-1, 80), max_size=3),
    })
    refusals = {grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.NOT_FOUND.value[0]}
    outcomes: dict[str, int] = {}

    with asyncio.Runner() as runner:
        context = serve(tiny_checkpoint(ARCH), shm_dir=tmp_path)
        server = runner.run(context.__aenter__())
        segment = Segment.create(tmp_path, segment_bytes)
        stream = open_stream(server, tmp_path, segment)
        _, name = runner.run(stream.__aenter__())

        async def connect():
            replies = Replies()
            return replies, await ClientLane.connect(tmp_path, name, segment.offer, on_response=replies.on_response,
                                                     on_closed=replies.on_closed, timeout=10)
        replies, lane = runner.run(connect())
        ids = iter(range(10 ** 6))

        async def send(fields) -> None:
            req = pb.ForwardRequest(model=server.config.model, request_id=str(next(ids)), layer=fields["layer"],
                                    experts=fields["experts"], counts=fields["counts"])
            req.hidden.dtype, req.hidden.shape[:] = fields["dtype"], fields["shape"]
            req.hidden.shared.offset = fields["offset"]
            answered = replies.expect(req.request_id)
            lane.send(req)
            response = await asyncio.wait_for(answered, 10)
            if response.HasField("error"):
                assert response.error.code in refusals, response
                assert len(response.error.message) > 20, response.error.message
                outcomes["error"] = outcomes.get("error", 0) + 1
            else:
                assert response.hidden == req.hidden, (response, req)
                outcomes["OK"] = outcomes.get("OK", 0) + 1

        @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(st.lists(malformed, min_size=25, max_size=25))
        def batches(batch):
            async def send_all():
                await asyncio.gather(*(send(fields) for fields in batch))
            runner.run(send_all())

        try:
            batches()
            x = torch.randn(4, H)
            segment.view(HEADER_BYTES, torch.float32, [4, H]).copy_(x)
            want = runner.run(server.client(streaming=False).forward(1, [3, 4], [1, 3], x))
            runner.run(send({"offset": HEADER_BYTES, "dtype": pb.FLOAT32, "shape": [4, H], "layer": 1,
                             "experts": [3, 4], "counts": [1, 3]}))
            assert torch.allclose(segment.view(HEADER_BYTES, torch.float32, [4, H]), want, rtol=1e-5, atol=1e-6)
            assert not lane.closed
        finally:
            lane.close()
            runner.run(stream.__aexit__(None, None, None))
            segment.unlink()
            runner.run(context.__aexit__(None, None, None))
    assert sum(outcomes.values()) == 1001 and outcomes["error"] > 500, outcomes


async def test_packets_sent_faster_than_the_peer_reads_wait_in_order_and_never_block_the_sender():
    """More packets than the socket buffers hold while the peer does not read (a busy server): each send
    returns at once (the call's deadline keeps running), and all arrive, in order, once it reads."""
    one, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    one.setblocking(False)
    other.setblocking(False)
    got: list[str] = []
    sender = _Packets(one, pb.ForwardResponse, lambda messages: None, lambda why: None)
    receiver = _Packets(other, pb.ForwardRequest, lambda messages: got.extend(m.request_id for m in messages),
                        lambda why: None)
    await sent_unread_then_read(sender, receiver, got, lambda n: pb.ForwardRequest(
        model="m", request_id=str(n), layer=1, experts=[0], counts=[8]))


async def sent_unread_then_read(sender, receiver, got: list[str], message, count: int = 3000) -> None:
    """`count` messages (`message(n)`, request id n) sent while `receiver` does not read: the socket takes what
    it can and the rest waits in the sender's backlog; once it reads, all arrive (into `got`), in order."""
    for n in range(count):
        sender.send(message(n))
    assert sender._backlog
    receiver.start_reading()
    for _ in range(500):
        if len(got) == count:
            break
        await asyncio.sleep(0.01)
    assert got == [str(n) for n in range(count)] and not sender._backlog
    assert not sender.closed and not receiver.closed
    sender.close()
    receiver.close()
