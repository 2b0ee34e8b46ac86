"""The server around the experts: health, Load/Unload/Describe, reflection, micro-batching, metrics."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kubemoe.adapters import MoEAdapter
from kubemoe.expert import expert_ffn
from kubemoe.checkpoint import Checkpoint
from kubemoe.expert_fn import batcher
from kubemoe.moe import sorted_ffn
from kubemoe.proto import kubemoe_pb2 as pb

ARCH, BUNDLE = "qwen3_moe", "0:0-3;1:5"  # tiny: 16 experts of 3 x 128 x 64 float32 each, hidden 128
SERVING, NOT_SERVING = 1, 2  # grpc.health.v1.HealthCheckResponse


def keys(response) -> list[tuple[int, int]]:
    return [(k.layer, k.expert) for k in response.held]


async def test_health_follows_the_bundle_load_and_unload_change_what_is_held(tiny_checkpoint, serve, health):
    checkpoint = tiny_checkpoint(ARCH)
    expert_bytes = MoEAdapter.from_checkpoint(checkpoint).expert_bytes(torch.float32)
    async with serve(checkpoint, BUNDLE, preload=False) as server:
        client = server.client()
        assert await health(server.address) == NOT_SERVING
        assert await health(server.address, "kubemoe.v1.ExpertService") == NOT_SERVING
        assert keys(await client.describe()) == []

        loaded = await client.load([(0, 0), (0, 1), (0, 2), (0, 3), (1, 5), (1, 9)])  # the bundle and one more
        assert loaded.bytes_loaded == 6 * expert_bytes
        assert keys(loaded) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 5), (1, 9)]
        assert await health(server.address) == SERVING
        assert await health(server.address, "kubemoe.v1.ExpertService") == SERVING
        assert server.metrics.value("bytes_loaded") == 6 * expert_bytes
        assert (await client.load([(1, 9)])).bytes_loaded == 0  # already held

        described = await client.describe()
        assert (described.model, described.arch, described.dtype, described.hidden_size, described.device) == (
            server.config.model, ARCH, pb.FLOAT32, 128, "cpu")
        assert described.max_message_bytes == 64 << 20
        assert (await client.forward(1, [9], [2], torch.randn(2, 128))).shape == (2, 128)

        unloaded = await client.unload([(0, 2), (1, 9)])
        assert unloaded.bytes_freed == 2 * expert_bytes and keys(unloaded) == [(0, 0), (0, 1), (0, 3), (1, 5)]
        assert keys(await client.describe()) == [(0, 0), (0, 1), (0, 3), (1, 5)]
        assert server.metrics.value("bytes_loaded") == 4 * expert_bytes
        assert await health(server.address) == NOT_SERVING  # no longer holds its whole bundle
        await client.close()


async def test_preload_turns_serving_by_itself(tiny_checkpoint, serve, health):
    async with serve(tiny_checkpoint(ARCH), BUNDLE) as server:  # the fixture waited for SERVING
        assert await health(server.address) == SERVING
        assert server.metrics.value("experts_held") == 5


async def test_a_second_server_on_a_taken_port_is_refused_not_sharing_it(tiny_checkpoint, serve):
    from kubemoe.expert_fn.server import build_server

    async with serve(tiny_checkpoint(ARCH), BUNDLE) as server:
        with pytest.raises(OSError, match="taken"):  # with SO_REUSEPORT the two would split its connections
            await build_server(server.address, server.config, preload=False)


async def test_reflection_lists_the_services(tiny_checkpoint, serve):
    async with serve(tiny_checkpoint(ARCH), BUNDLE) as server:
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            services = {s.name async for reply in call for s in reply.list_services_response.service}
    assert {"kubemoe.v1.ExpertService", "grpc.health.v1.Health"} <= services


async def test_concurrent_requests_for_one_expert_merge_into_fewer_matmuls(tiny_checkpoint, serve):
    checkpoint = tiny_checkpoint(ARCH)
    ckpt = Checkpoint(checkpoint)
    adapter = MoEAdapter(ckpt.config)
    weights = adapter.load_expert(ckpt, 0, 2)
    calls, tokens = 16, 3
    xs = [torch.randn(tokens, 128) for _ in range(calls)]
    async with serve(checkpoint, BUNDLE, batch_wait_ms=50) as server:
        clients = [server.client(streaming=i % 2 == 0) for i in range(calls)]  # as from 16 frontends
        await asyncio.gather(*(c.forward(0, [2], [1], xs[0][:1]) for c in clients))  # connected, streams open
        before = server.metrics.value("expert_runs_total", layer="0", expert="2")
        outs = await asyncio.gather(*(c.forward(0, [2], [tokens], x) for c, x in zip(clients, xs)))
        for c in clients:
            await c.close()
        runs = server.metrics.value("expert_runs_total", layer="0", expert="2") - before
        assert server.metrics.value("tokens_total", layer="0", expert="2") == calls * (tokens + 1)
    assert 1 <= runs <= calls // 2, f"{calls} concurrent requests ran as {runs} FFN calls"
    for x, out in zip(xs, outs):
        assert torch.allclose(out, expert_ffn(x, weights, adapter.act), rtol=1e-5, atol=1e-6)


async def test_a_load_or_unload_in_place_changes_the_layers_stack_and_the_next_call_sees_it(tiny_checkpoint, serve,
                                                                                           monkeypatch):
    checkpoint = tiny_checkpoint(ARCH)
    ckpt = Checkpoint(checkpoint)
    adapter = MoEAdapter(ckpt.config)
    grouped = []
    monkeypatch.setattr(batcher, "sorted_ffn", lambda *args: grouped.append(args[0].shape[0]) or sorted_ffn(*args))
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))

    def expected(experts: list[int], counts: list[int]) -> torch.Tensor:  # each group through its expert, alone
        return torch.cat([expert_ffn(rows, adapter.load_expert(ckpt, 0, e), adapter.act)
                          for e, rows in zip(experts, x.split(counts))])

    async with serve(checkpoint, BUNDLE, group_min_experts=2) as server:  # as few as two experts: grouped
        client, store = server.client(), server.servicer.store
        before = store.stack(0)
        assert before is not None and before.local == {0: 0, 1: 1, 2: 2, 3: 3}
        await client.load([(0, 9)])
        stack = store.stack(0)
        assert stack is not None and stack is not before and stack.local == {0: 0, 1: 1, 2: 2, 3: 3, 9: 4}
        torch.testing.assert_close(await client.forward(0, [9, 1, 3], [2, 3, 1], x), expected([9, 1, 3], [2, 3, 1]))
        assert grouped == [6]  # the three experts as one computation

        device_bytes = store.device_bytes
        unloaded = await client.unload([(0, 1)])  # its slot stays: what the function's experts take is unchanged
        assert unloaded.bytes_freed == store.expert_bytes and unloaded.device_bytes == device_bytes
        assert store.stack(0).experts is stack.experts and store.stack(0).local == {0: 0, 2: 2, 3: 3, 9: 4}
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.forward(0, [9, 1], [3, 3], x)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "expert 1 of layer 0" in refused.value.details()
        torch.testing.assert_close(await client.forward(0, [3, 9], [4, 2], x), expected([3, 9], [4, 2]))
        assert grouped == [6, 6]

        del before, stack  # nothing here names expert 1's slot any more: the next Load reads into it
        await client.load([(0, 5)])
        assert store.stack(0).local == {0: 0, 2: 2, 3: 3, 9: 4, 5: 1}
        torch.testing.assert_close(await client.forward(0, [5, 2, 9], [1, 2, 3], x), expected([5, 2, 9], [1, 2, 3]))
        assert grouped == [6, 6, 6]
        await client.close()


async def test_metrics_are_served_over_http(tiny_checkpoint, serve):
    async with serve(tiny_checkpoint(ARCH), BUNDLE) as server:
        client = server.client(streaming=False)
        await client.forward(0, [1, 3], [2, 2], torch.randn(4, 128))
        await client.close()
        port = server.metrics.serve_http(0, "127.0.0.1")
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
    bundle = f'bundle="{server.config.bundle_spec}"'
    assert f'kubemoe_expert_fn_calls_total{{{bundle},code="OK",method="Forward"}} 1.0' in text
    assert f'kubemoe_expert_fn_tokens_total{{{bundle},expert="3",layer="0"}} 2.0' in text
    for name in ("compute_seconds_count", "queue_seconds_count", "queue_depth", "bytes_loaded", "load_seconds_count"):
        assert f"kubemoe_expert_fn_{name}{{{bundle}}}" in text, name
    # On the CPU no allocator is watched: 0. On a GPU they are read at each scrape, as here.
    assert f"kubemoe_expert_fn_device_memory_cap_bytes{{{bundle}}} 0.0" in text
    server.metrics.watch_device(lambda: 3 << 30, lambda: 5 << 30)
    assert server.metrics.value("device_memory_reserved_bytes") == 3 << 30
    assert server.metrics.value("device_memory_cap_bytes") == 5 << 30


async def test_a_stopping_server_answers_the_request_in_flight_then_ends_the_streams(tiny_checkpoint, serve):
    async with serve(tiny_checkpoint(ARCH), BUNDLE) as server:
        client = server.client()
        x = torch.randn(2, 128)
        want = await client.forward(0, [1], [2], x)  # the stream is open
        batcher = server.servicer.batcher
        run = batcher._run

        def stop_arrives_mid_round(jobs):
            server.servicer.end_streams()  # as serve() does on SIGTERM, while this request is in flight
            run(jobs)

        batcher._run = stop_arrives_mid_round
        assert torch.equal(await client.forward(0, [1], [2], x), want)  # in flight: answered
        await asyncio.sleep(0.1)
        assert client._stream is None  # then the stream ended
        with pytest.raises(grpc.aio.AioRpcError) as ended:  # a stream opened now is ended at once
            await client.forward(0, [1], [2], x)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        await client.close()
