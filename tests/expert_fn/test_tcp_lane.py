"""The TCP lane: calls between pods and nodes with their tensors' bytes in frames, its handshake, bad frames."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import struct

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubemoe import wire
from kubemoe.expert_fn.frames import (MAX_MESSAGE_BYTES, TCP_LANE_METADATA_KEY, TCP_METADATA_KEY, lane_address,
                                      new_offer, tensor_region)
from kubemoe.expert_fn.frames import connect as connect_tcp
from kubemoe.expert_fn.lane import ClientLane
from kubemoe.expert_fn.shm import HEADER_BYTES, Segment, SharedMemoryError
from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc

from .test_lane import Replies, sent_unread_then_read

ARCH = "mixtral"  # tiny: MoE layers 0 and 1, 8 experts, hidden 128, float32
H = 128


@pytest.fixture
async def tcp_server(tiny_checkpoint, serve):
    """A server with a data port and no shared folder: what a frontend on another node meets."""
    async with serve(tiny_checkpoint(ARCH), data_port=0) as running:
        yield running


async def offered_stream(server, arena: Segment):
    """(call, channel, token, (host, port)) for a ForwardStream that offered a TCP lane over `arena`."""
    channel = grpc.aio.insecure_channel(server.address)
    offer, token = new_offer(arena)
    call = pb_grpc.ExpertServiceStub(channel).ForwardStream(metadata=((TCP_METADATA_KEY, offer),))
    metadata = dict(await call.initial_metadata())
    return call, channel, token, lane_address(metadata[TCP_LANE_METADATA_KEY], server.address)


async def raw_lane(server, arena: Segment):
    """A TCP lane driven by hand: (lane, replies, call, channel)."""
    call, channel, token, (host, port) = await offered_stream(server, arena)
    replies = Replies()
    frames = await connect_tcp(host, port, token, arena, lambda m: tensor_region(m, arena.size),
                               on_responses=replies.on_responses, on_closed=replies.on_closed, timeout=10)
    return ClientLane.serving(frames), replies, call, channel


async def test_calls_between_processes_without_a_shared_folder_take_the_tcp_lane(tcp_server):
    x = torch.randn(300, H)  # 150 KiB: more than a frame's staging read, so the payload is read in place
    counts = [100, 120, 80]
    want = await tcp_server.client(streaming=False).forward(1, [2, 5, 7], counts, x)
    client = tcp_server.client()
    got = await asyncio.gather(*(client.forward(1, [2, 5, 7], counts, x) for _ in range(5)),
                               client.forward(0, [1], [3], x[:3]))
    assert client.transport == "tcp" and not client._stream.lane.closed
    assert all(torch.allclose(g, want, rtol=1e-6, atol=1e-7) for g in got[:5])
    assert got[5].shape == (3, H)
    assert client._stream.allocator.in_use == 6  # each reply is a view of its region: no copy
    del got
    for _ in range(100):  # gather's futures let go of the replies within a few loop turns
        gc.collect()
        await asyncio.sleep(0.01)
        if client._stream.allocator.in_use == 0:
            break
    assert client._stream.allocator.in_use == 0  # every region is free once its reply's views are gone
    assert tcp_server.metrics.value("tcp_lane_streams_total", result="opened") == 1
    await client.close()


async def test_a_call_larger_than_the_lanes_arena_goes_over_the_lane_in_parts(tcp_server, placed):
    """A long prefill's call over a TCP lane: parts of half the arena (none inline), each reply copied out of
    its region."""
    x = torch.randn(100, H)
    want = await tcp_server.client(streaming=False).forward(1, [2, 5], [60, 40], x)
    client = tcp_server.client(shm_bytes=16 * H * 4)  # an arena of 16 rows: parts of 8
    got = await client.forward(1, [2, 5], [60, 40], x)
    assert client.transport == "tcp" and not client._stream.lane.closed
    assert placed == [(8, True)] * 12 + [(4, True)]
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert client._stream.allocator.in_use == 0  # no part's region is held by the joined reply
    await client.close()


async def test_shared_memory_wins_where_both_sides_see_the_folder_and_no_data_port_means_inline(
        tiny_checkpoint, serve, tmp_path):
    async with serve(tiny_checkpoint(ARCH), data_port=0, shm_dir=tmp_path) as server:
        client = server.client(shm_dir=tmp_path)
        await client.forward(1, [2], [2], torch.randn(2, H))
        assert client.transport == "shm"
        await client.close()
    async with serve(tiny_checkpoint(ARCH)) as server:  # no data port: tensors travel inline, as before
        client = server.client()
        x = torch.randn(2, H)
        assert torch.allclose(await client.forward(1, [2], [2], x),
                              await server.client(streaming=False).forward(1, [2], [2], x))
        assert client.transport == "inline"
        await client.close()


async def test_a_refused_request_on_the_tcp_lane_gets_its_status_and_the_lane_keeps_serving(tcp_server):
    client = tcp_server.client()
    x = torch.randn(3, H)
    assert (await client.forward(1, [2], [3], x)).shape == (3, H)
    stream = client._stream
    for call, words in ((client.forward(7, [2], [3], x), "not an MoE layer"),
                        (client.forward(1, [2], [2], x), "counts sum to 2")):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details()
    assert client._stream is stream and not stream.lane.closed and stream.allocator.in_use == 0
    assert (await client.forward(1, [2], [3], x)).shape == (3, H)
    await client.close()


async def test_a_connection_without_the_streams_token_is_dropped_and_a_token_serves_once(tcp_server, caplog):
    arena = Segment.private(HEADER_BYTES + (1 << 16))
    call, channel, token, (host, port) = await offered_stream(tcp_server, arena)
    with caplog.at_level(logging.WARNING):
        for first in (b"0" * 32, b"not a token at all, but long enough"):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(first)
            try:  # the server hangs up without a word (a reset, when it left bytes unread)
                assert await asyncio.wait_for(reader.read(64), 20) == b""
            except ConnectionResetError:
                pass
            writer.close()
    assert "presented no pending stream's token" in caplog.text and token.decode() not in caplog.text
    frames = await connect_tcp(host, port, token, arena, lambda m: (0, 0), on_responses=lambda r: None,
                               on_closed=lambda why: None, timeout=10)  # the stream's own token still works ...
    frames.close()
    with pytest.raises(SharedMemoryError, match="refused"):  # ... once
        await connect_tcp(host, port, token, arena, lambda m: (0, 0), on_responses=lambda r: None,
                          on_closed=lambda why: None, timeout=10)
    call.cancel()
    await channel.close()


def _frame(message: bytes, payload: bytes = b"", announce: int | None = None) -> bytes:
    return struct.pack("<II", len(message), len(payload) if announce is None else announce) + message + payload


def _request(server, rid: str, tokens: int) -> pb.ForwardRequest:
    req = pb.ForwardRequest(model=server.config.model, request_id=rid, layer=1, experts=[3], counts=[tokens])
    wire.describe_shared(req.hidden, torch.float32, [tokens, H], HEADER_BYTES)
    return req


@pytest.mark.parametrize("case", ["too-long-message", "payload-longer-than-tensor", "not-protobuf",
                                  "region-outside-arena", "stops-mid-frame"])
async def test_a_frame_that_breaks_the_protocol_closes_that_lane_only(tcp_server, case, caplog):
    arena = Segment.private(HEADER_BYTES + (1 << 16))
    lane, replies, call, channel = await raw_lane(tcp_server, arena)
    good = _request(tcp_server, "r", 2).SerializeToString()
    far = _request(tcp_server, "r", 2)
    far.hidden.shared.offset = 1 << 30
    data = {
        "too-long-message": struct.pack("<II", MAX_MESSAGE_BYTES + 1, 0),
        "payload-longer-than-tensor": _frame(good, b"\0" * (2 * H * 4 + 8)),
        "not-protobuf": _frame(b"\xff" * 40),
        "region-outside-arena": _frame(far.SerializeToString(), b"\0" * (2 * H * 4)),
        "stops-mid-frame": _frame(good, b"\0" * 100, announce=2 * H * 4),
    }[case]
    with caplog.at_level(logging.WARNING):
        lane._carrier.sock.send(data)
        if case == "stops-mid-frame":
            lane._carrier.sock.shutdown(socket.SHUT_WR)
        await asyncio.wait_for(replies.closed, 10)  # the server closed this lane ...
    assert "closing the lane" in caplog.text
    call.cancel()
    await channel.close()
    client = tcp_server.client()  # ... and serves everyone else as before
    assert (await client.forward(1, [6], [2], torch.randn(2, H))).shape == (2, H)
    assert client.transport == "tcp"
    await client.close()


async def test_a_reply_naming_another_region_than_its_request_closes_the_client_lane(tcp_server):
    """The client writes a reply's bytes only into the region its request was sent in."""
    client = tcp_server.client()
    await client.forward(1, [2], [2], torch.randn(2, H))
    stream = client._stream
    reply = pb.ForwardResponse(request_id="nobody-sent-this")
    wire.describe_shared(reply.hidden, torch.float32, [2, H], HEADER_BYTES)
    with pytest.raises(ValueError, match="was not sent in a region"):
        stream.region_of_reply(reply)
    await client.close()


def test_property_tcp_lane_requests_with_any_fields_are_each_answered_and_the_lane_keeps_serving(tiny_checkpoint,
                                                                                                serve):
    """400 requests with well-placed tensors but random layers, experts, counts and shapes, 20 at a
    time on one lane: each gets a response with its id (a result, or an error saying what is wrong)."""
    arena_bytes = HEADER_BYTES + (1 << 18)
    fields = st.fixed_dictionaries({
        "tokens": st.integers(0, 40), "width": st.sampled_from([H, H - 1, 1]),
        "layer": st.integers(-1, 3), "experts": st.lists(st.integers(-1, 9), max_size=3),
        "counts": st.lists(st.integers(-1, 50), max_size=3),
    })
    outcomes: dict[str, int] = {}
    with asyncio.Runner() as runner:
        context = serve(tiny_checkpoint(ARCH), data_port=0)
        server = runner.run(context.__aenter__())
        arena = Segment.private(arena_bytes)
        lane, replies, call, channel = runner.run(raw_lane(server, arena))
        ids = iter(range(10 ** 6))

        async def send(f, slot: int) -> None:
            req = pb.ForwardRequest(model=server.config.model, request_id=str(next(ids)), layer=f["layer"],
                                    experts=f["experts"], counts=f["counts"])
            wire.describe_shared(req.hidden, torch.float32, [f["tokens"], f["width"]], HEADER_BYTES + slot * 8192)
            answered = replies.expect(req.request_id)
            lane.send(req)
            response = await asyncio.wait_for(answered, 10)
            kind = "error" if response.HasField("error") else "OK"
            if kind == "error":
                assert len(response.error.message) > 20, response.error.message
            outcomes[kind] = outcomes.get(kind, 0) + 1

        @settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(st.lists(fields, min_size=20, max_size=20))
        def batches(batch):
            async def send_all():
                await asyncio.gather(*(send(f, i) for i, f in enumerate(batch)))
            runner.run(send_all())

        try:
            batches()
            assert not lane.closed
        finally:
            lane.close()
            call.cancel()
            runner.run(channel.close())
            runner.run(context.__aexit__(None, None, None))
    assert sum(outcomes.values()) == 400 and outcomes.get("error", 0) > 100, outcomes


def test_lane_addresses_default_to_the_dialled_host():
    assert lane_address("9096", "10.0.0.7:8080") == ("10.0.0.7", 9096)
    assert lane_address("10.1.2.3:9096", "svc.ns:8080") == ("10.1.2.3", 9096)
    assert lane_address("9096", "dns:///expert.ns.svc:80") == ("expert.ns.svc", 9096)
    assert lane_address("[fd00::1]:9096", "x:1") == ("fd00::1", 9096)
    with pytest.raises(SharedMemoryError):
        lane_address("not-a-port", "x:1")


async def loopback_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of one TCP connection over loopback: (the connecting one, the accepted one)."""
    listener = socket.create_server(("127.0.0.1", 0))
    loop = asyncio.get_running_loop()
    sender_sock = socket.socket()
    sender_sock.setblocking(False)
    await loop.sock_connect(sender_sock, listener.getsockname())
    receiver_sock, _ = await loop.sock_accept(listener)
    listener.close()
    return sender_sock, receiver_sock


async def test_frames_queued_faster_than_the_peer_reads_all_arrive_whole_and_in_order():
    """More frames than one sendmsg may carry (IOV_MAX), queued while the peer does not read, then read."""
    from kubemoe.expert_fn.frames import Frames

    arena = Segment.private(HEADER_BYTES + (1 << 20))
    sender_sock, receiver_sock = await loopback_pair()
    got: list[str] = []
    sender = Frames(sender_sock, arena, pb.ForwardRequest, lambda m: (0, 0), lambda ms: None, lambda why: None)
    receiver = Frames(receiver_sock, arena, pb.ForwardRequest, lambda m: tensor_region(m, arena.size),
                      lambda ms: got.extend(m.request_id for m in ms), lambda why: None)
    def request(n: int) -> pb.ForwardRequest:  # 4 KiB each: far more than the socket buffers hold unread
        req = pb.ForwardRequest(model="m", request_id=str(n), layer=1, experts=[0], counts=[8])
        wire.describe_shared(req.hidden, torch.float32, [8, H], HEADER_BYTES + (n % 8) * 4096)
        return req

    await sent_unread_then_read(sender, receiver, got, request)


async def test_a_frame_sent_from_its_source_lands_whole_and_a_message_longer_than_one_read_ahead_parses():
    """A client's payload sent from the caller's tensor (not its arena) arrives bit for bit in the region,
    and a message longer than the receiver's read-ahead (many experts in one call) is read whole first."""
    from kubemoe.expert_fn.frames import _READ_AHEAD, Frames

    sending, receiving = (Segment.private(HEADER_BYTES + (1 << 20)) for _ in range(2))
    sender_sock, receiver_sock = await loopback_pair()
    x = torch.randn(300, H)  # 150 KiB
    got: list[pb.ForwardRequest] = []
    sender = Frames(sender_sock, sending, pb.ForwardRequest, lambda m: (0, 0), lambda ms: None, lambda why: None,
                    source=lambda m: x.reshape(-1).view(torch.uint8).numpy().data)
    receiver = Frames(receiver_sock, receiving, pb.ForwardRequest, lambda m: tensor_region(m, receiving.size),
                      got.extend, lambda why: None)
    receiver.start_reading()
    experts = list(range(3000))
    req = pb.ForwardRequest(model="m", request_id="long", layer=1, experts=experts, counts=[0] * 2999 + [300])
    wire.describe_shared(req.hidden, torch.float32, [300, H], HEADER_BYTES)
    assert req.ByteSize() > _READ_AHEAD
    sender.send(req)
    for _ in range(300):
        if got:
            break
        await asyncio.sleep(0.01)
    assert [list(m.experts) for m in got] == [experts] and not receiver.closed
    assert torch.equal(receiving.view(HEADER_BYTES, torch.float32, [300, H]), x)
    assert not sending.view(HEADER_BYTES, torch.float32, [300, H]).any()  # nothing went through the sender's arena
    sender.close()
    receiver.close()
