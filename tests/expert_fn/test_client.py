"""ExpertClient's stream handling against real servers: matching replies, breaks, reopening, timeouts."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kubemoe.expert_fn.client import ExpertClient
from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc

H = 128


async def test_concurrent_calls_on_one_stream_get_their_own_replies(tiny_checkpoint, serve):
    async with serve(tiny_checkpoint("mixtral"), batch_wait_ms=5) as server:
        client = server.client(streaming=True)
        plain = server.client(streaming=False)
        xs = [torch.randn(n, H) for n in range(1, 30)]
        got = await asyncio.gather(*(client.forward(1, [n % 8], [len(x)], x) for n, x in enumerate(xs)))
        want = [await plain.forward(1, [n % 8], [len(x)], x) for n, x in enumerate(xs)]
        for g, w in zip(got, want):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="already in flight"):
            await asyncio.gather(*(client.forward(1, [0], [1], xs[0], request_id="same") for _ in range(2)))
        await client.close()
        await plain.close()


class ScriptedServer(pb_grpc.ExpertServiceServicer):
    """A real ExpertService whose first stream ends without answering and later streams echo."""

    def __init__(self, first_stream: str):
        self.first_stream, self.streams = first_stream, 0

    async def ForwardStream(self, request_iterator, context):
        self.streams += 1
        if self.streams == 1:
            async for _ in request_iterator:
                if self.first_stream == "silent":
                    await asyncio.sleep(60)
                return  # ends the stream with OK and no reply
        async for request in request_iterator:
            yield pb.ForwardResponse(request_id=request.request_id, hidden=request.hidden)


async def scripted(first_stream: str):
    servicer = ScriptedServer(first_stream)
    server = grpc.aio.server()
    pb_grpc.add_ExpertServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", servicer


async def test_a_broken_stream_fails_pending_calls_unavailable_and_the_next_call_reopens():
    server, address, servicer = await scripted("ends")
    client = ExpertClient(address, model="m", tcp=False)  # a scripted server answers no offers
    x = torch.randn(2, H)
    with pytest.raises(grpc.aio.AioRpcError) as broken:
        await client.forward(0, [0], [2], x)
    assert broken.value.code() == grpc.StatusCode.UNAVAILABLE and address in broken.value.details()
    assert torch.equal(await client.forward(0, [0], [2], x), x)  # echoed over a new stream
    assert servicer.streams == 2
    await client.close()
    await server.stop(None)


async def test_a_call_times_out_with_deadline_exceeded_and_the_stream_survives():
    server, address, servicer = await scripted("silent")
    client = ExpertClient(address, model="m", tcp=False)  # a scripted server answers no offers
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await client.forward(0, [0], [1], torch.randn(1, H), timeout=0.2)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await client.close()
    await server.stop(None)


async def test_server_gone_is_unavailable_and_a_new_server_on_the_port_is_used(tiny_checkpoint, serve):
    checkpoint = tiny_checkpoint("mixtral")
    async with serve(checkpoint) as first:
        address = first.address
        client = first.client()
        x = torch.randn(3, H)
        want = await client.forward(0, [1], [3], x)
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await client.forward(0, [1], [3], x, timeout=5)
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
    from kubemoe.expert_fn.config import ExpertFnConfig
    from kubemoe.expert_fn.server import create_server

    again, _ = await create_server(address, ExpertFnConfig.build(checkpoint, device="cpu", metrics_port=None))
    await again.start()
    try:
        for _ in range(100):  # the channel reconnects with backoff
            try:
                got = await client.forward(0, [1], [3], x, timeout=5)
                break
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                await asyncio.sleep(0.1)
        assert torch.allclose(got, want)
    finally:
        await client.close()
        await again.stop(None)


def test_split_rows_keeps_every_row_in_order_and_no_part_over_the_limit():
    from kubemoe.expert_fn.client import split_rows

    parts = split_rows([3, 5, 1], [4, 7, 2], rows=5)
    assert parts == [(0, [3, 5], [4, 1]), (5, [5], [5]), (10, [5, 1], [1, 2])]
    assert split_rows([2], [3], rows=8) == [(0, [2], [3])]
    assert split_rows([], [], rows=4) == []


async def test_a_call_larger_than_a_message_goes_as_several_with_the_same_result(tiny_checkpoint, serve, monkeypatch):
    """A long prefill's call (more bytes than --max-message-bytes) is cut at row boundaries, not refused; its
    timing is the server's time on all the parts (what a frontend counts as the experts' busy time)."""
    from kubemoe.expert_fn.servicer import ExpertServicer

    async with serve(tiny_checkpoint("mixtral"), max_message_bytes=1 << 20) as server:
        x = torch.randn(3000, H)  # 1.5 MiB of float32: two messages' worth
        plain = server.client(streaming=False)
        want = torch.cat([await plain.forward(1, [2], [1000], x[:1000]), await plain.forward(1, [5], [2000], x[1000:])])
        reported, respond = [], ExpertServicer._response

        def recorded(servicer, request, job, started):
            response = respond(servicer, request, job, started)
            reported.append(response.timing.total_seconds)
            return response
        monkeypatch.setattr(ExpertServicer, "_response", recorded)
        client = server.client(max_message_bytes=1 << 20, tcp=False)
        got, timing = await client.call(1, [2, 5], [1000, 2000], x)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        assert len(reported) == 2 and timing.total_seconds == pytest.approx(sum(reported))
        await client.close()
        await plain.close()
