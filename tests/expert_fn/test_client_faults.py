"""Callers that time out, go away or fail, against real servers: what that leaves of the stream, its
shared-memory regions and the other calls on it. A request id is never answered with another call's
reply; a region is never held for a call that cannot be answered; one caller's cancellation is its own."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kubemoe.expert_fn import client as client_module
from kubemoe.expert_fn.client import ExpertClient
from kubemoe.expert_fn.shm import SharedMemoryError
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc

H = 128
SLOW = 7  # the expert a slowed server answers late


def slowed(servicer, seconds: float) -> None:
    """Requests for expert SLOW are answered `seconds` late (a busy function)."""
    answer, answer_now = servicer._answer, servicer.answer_now

    async def late(request, segment):
        if SLOW in request.experts:
            await asyncio.sleep(seconds)
        return await answer(request, segment)

    servicer._answer = late
    servicer.answer_now = lambda request, segment: None if SLOW in request.experts else answer_now(request, segment)


@pytest.fixture
def shm_dir(tmp_path):
    folder = tmp_path / "shm"
    folder.mkdir()
    return folder


@pytest.mark.parametrize("transport", ["inline", "shm"])
async def test_an_id_whose_call_timed_out_is_refused_until_its_late_reply_is_dropped(tiny_checkpoint, serve, shm_dir,
                                                                                      transport):
    options = {"shm_dir": shm_dir} if transport == "shm" else {}
    async with serve(tiny_checkpoint("mixtral"), **options) as server:
        slowed(server.servicer, 0.5)
        client = server.client(tcp=False, **options)
        x = torch.randn(4, H)
        await client.forward(0, [1], [1], x[:1])
        stream = client._stream
        assert client.transport == transport
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await client.forward(0, [SLOW], [4], x, request_id="r", timeout=0.1)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(ValueError, match="already in flight"):  # its reply would answer this one
            await client.forward(0, [SLOW], [4], torch.randn(4, H), request_id="r")
        await asyncio.sleep(0.8)  # the late reply came and was dropped
        assert not stream.abandoned and not stream.regions
        if stream.allocator is not None:
            assert stream.allocator.in_use == 0
        y = torch.randn(4, H)
        want = await server.client(streaming=False).forward(0, [SLOW], [4], y)
        assert torch.allclose(await client.forward(0, [SLOW], [4], y, request_id="r"), want, atol=1e-6)
        await client.close()


async def test_a_call_cancelled_while_its_request_waits_to_be_written_frees_its_region(tiny_checkpoint, serve, shm_dir,
                                                                                        monkeypatch):
    async def no_lane(*args, **kwargs):  # requests go on the gRPC stream, behind its write lock
        raise SharedMemoryError("no lane in this test")
    monkeypatch.setattr(client_module.ClientLane, "connect", no_lane)
    async with serve(tiny_checkpoint("mixtral"), shm_dir=shm_dir) as server:
        client = server.client(tcp=False, shm_dir=shm_dir)
        await client.forward(0, [1], [1], torch.randn(1, H))
        stream = client._stream
        assert client.transport == "shm" and stream.lane is None
        async with stream.write_lock:  # another caller is writing
            waiting = asyncio.create_task(client.forward(0, [1], [4], torch.randn(4, H)))
            await asyncio.sleep(0.05)
            assert stream.allocator.in_use == 1  # its tensor is in its region
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        # The write goes on once the lock is free (cancelling a write would end the stream): the reply nobody
        # waits for frees the region.
        for _ in range(100):
            if stream.allocator.in_use == 0:
                break
            await asyncio.sleep(0.05)
        assert stream.allocator.in_use == 0 and not stream.regions and not stream.abandoned
        await client.forward(0, [1], [2], torch.randn(2, H))
        assert client._stream is stream
        await client.close()


async def test_a_caller_cancelled_while_its_request_is_written_fails_no_other_call(tiny_checkpoint, serve):
    async with serve(tiny_checkpoint("mixtral")) as server:
        slowed(server.servicer, 0.5)
        client = server.client(tcp=False)
        await client.forward(0, [1], [1], torch.randn(1, H))
        stream = client._stream
        other = asyncio.create_task(client.forward(0, [SLOW], [2], torch.randn(2, H), timeout=10))
        await asyncio.sleep(0.05)
        large = asyncio.create_task(client.forward(0, [1], [60000], torch.randn(60000, H)))  # 30 MB inline
        await asyncio.sleep(0.01)
        large.cancel()
        await asyncio.gather(large, return_exceptions=True)
        assert (await other).shape == (2, H)  # grpc.aio would have cancelled the whole stream with the write
        assert client._stream is stream
        await client.close()


class Unread(pb_grpc.ExpertServiceServicer):
    """A server whose stream handler stops reading requests (a hung function): writes block on flow control."""

    async def ForwardStream(self, request_iterator, context):
        async for _ in request_iterator:
            await asyncio.sleep(60)


async def test_a_calls_timeout_covers_a_request_the_stream_cannot_take():
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    pb_grpc.add_ExpertServiceServicer_to_server(Unread(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = ExpertClient(f"127.0.0.1:{port}", model="m", tcp=False)
    try:
        with pytest.raises(grpc.aio.AioRpcError):  # read, never answered
            await client.forward(0, [0], [1], torch.randn(1, H), timeout=0.2)

        async def code(rows: int) -> grpc.StatusCode:
            try:
                await asyncio.wait_for(client.forward(0, [0], [rows], torch.randn(rows, H), timeout=0.5), 10)
            except grpc.aio.AioRpcError as e:
                return e.code()
            raise AssertionError("answered by a server that answers nothing")

        # 30 MB that flow control holds back, and a small call queued behind its write: both give up in time
        assert await asyncio.gather(code(60000), code(1)) == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2
    finally:
        await client.close()
        await server.stop(None)


async def test_a_caller_cancelled_while_the_stream_opens_leaves_no_stream_open_on_the_server(tiny_checkpoint, serve,
                                                                                             shm_dir):
    async with serve(tiny_checkpoint("mixtral"), shm_dir=shm_dir) as server:
        attach = server.servicer._attach

        async def slow_attach(context, spawn):  # as pinning a segment on a GPU takes a while
            await asyncio.sleep(0.3)
            return await attach(context, spawn)
        server.servicer._attach = slow_attach
        client = server.client(tcp=False, shm_dir=shm_dir)
        opening = asyncio.create_task(client.forward(0, [1], [1], torch.randn(1, H)))
        await asyncio.sleep(0.1)
        opening.cancel()
        await asyncio.gather(opening, return_exceptions=True)
        await asyncio.sleep(0.5)
        assert client._stream is None and server.servicer._open_streams == 0
        await client.forward(0, [1], [1], torch.randn(1, H))
        assert server.servicer._open_streams == 1
        await client.close()


async def test_a_split_call_whose_part_fails_stops_its_other_parts(tiny_checkpoint, serve):
    async with serve(tiny_checkpoint("mixtral")) as server:
        slowed(server.servicer, 0.3)
        client = server.client(tcp=False, max_message_bytes=(64 << 10) + 8 * H * 4)  # parts of 8 rows
        out = torch.zeros(16, H)
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # rows 0-7: no expert 99; rows 8-15: the slow one
            await client.call(0, [99, SLOW], [8, 8], torch.randn(16, H), out=out)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await asyncio.sleep(0.6)  # the slow part's reply came meanwhile
        assert bool((out == 0).all())  # nothing written into `out` after call() raised
        await client.close()
