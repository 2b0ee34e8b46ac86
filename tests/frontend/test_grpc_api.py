"""kubemoe.v1.Generator, health and reflection over a real gRPC channel (port 0)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc

PROMPT = "The quick brown fox"


def request(frontend, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=frontend.model_id, request_id="r-1", prompt=PROMPT,
                              sampling=pb.SamplingParams(**sampling))


async def generate(channel, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [r async for r in pb_grpc.GeneratorStub(channel).Generate(req)]


async def test_greedy_stream_equals_the_http_completion(channel, frontend, client):
    replies = await generate(channel, request(frontend, temperature=0, max_tokens=12))
    http = await client.completions.create(model=frontend.model_id, prompt=PROMPT, max_tokens=12, temperature=0)
    assert "".join(r.text for r in replies) == http.choices[0].text
    assert {r.request_id for r in replies} == {"r-1"}
    assert sum(len(r.token_ids) for r in replies) == 12
    last = replies[-1]
    assert last.finish_reason == "length" and all(not r.finish_reason for r in replies[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (http.usage.prompt_tokens, 12)


async def test_unset_sampling_fields_take_the_defaults(channel, frontend):
    replies = await generate(channel, pb.GenerateRequest(model=frontend.model_id,
                                                         prompt_ids=pb.TokenIds(ids=frontend.tokenizer.encode(PROMPT))))
    last = replies[-1]  # max_tokens 16 by default; temperature 1.0 may sample an end-of-text token sooner
    assert (last.finish_reason, last.usage.completion_tokens) == ("length", 16) or (
        last.finish_reason == "stop" and last.usage.completion_tokens < 16)
    seeded = [await generate(channel, request(frontend, seed=3, max_tokens=8)) for _ in range(2)]
    assert seeded[0] == seeded[1]


@pytest.mark.parametrize("change, code, words", [
    ({"sampling": pb.SamplingParams(temperature=-1)}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ({"sampling": pb.SamplingParams(top_p=0)}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ({"sampling": pb.SamplingParams(max_tokens=0)}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ({"prompt": None, "prompt_ids": pb.TokenIds(ids=[1, 99999])}, grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ({"prompt": "hello " * 600}, grpc.StatusCode.INVALID_ARGUMENT, "shorten the prompt"),
    ({"model": "other"}, grpc.StatusCode.NOT_FOUND, "serves model"),
])
async def test_bad_requests_get_their_status_and_a_message(channel, frontend, change, code, words):
    fields = {"model": frontend.model_id, "prompt": PROMPT} | change
    req = pb.GenerateRequest(**{k: v for k, v in fields.items() if v is not None})
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(channel, req)
    assert refused.value.code() == code and words in refused.value.details()


async def test_a_request_without_a_prompt_is_invalid(channel, frontend):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(channel, pb.GenerateRequest(model=frontend.model_id))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in refused.value.details()


async def test_a_full_queue_is_resource_exhausted(make_frontend, grpc_channel, frontend):
    busy = make_frontend(max_batch=1, max_waiting=1)
    async with grpc_channel(busy) as ch:
        async def outcome():
            try:
                return (await generate(ch, request(busy, temperature=0, max_tokens=40)))[-1].finish_reason
            except grpc.aio.AioRpcError as e:
                return e.code()
        outcomes = await asyncio.gather(*(outcome() for _ in range(6)))
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in outcomes
    assert set(outcomes) == {grpc.StatusCode.RESOURCE_EXHAUSTED, "length"}


async def test_an_engine_failure_is_unavailable(make_frontend, route_all, grpc_channel):
    broken = make_frontend(routed=False, call_timeout=0.5)
    route_all(broken, "127.0.0.1:1")
    async with grpc_channel(broken) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await generate(ch, request(broken, max_tokens=4))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and "generation failed" in failed.value.details()


async def test_health_follows_readiness(make_frontend, route_all, grpc_channel):
    unrouted = make_frontend(routed=False)
    async with grpc_channel(unrouted, readiness_interval=0.05) as ch:
        health = health_pb2_grpc.HealthStub(ch)

        async def status(service=""):
            return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

        assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(ch, request(unrouted))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "routing table" in refused.value.details()
        route_all(unrouted)
        for _ in range(100):
            if await status("kubemoe.v1.Generator") == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.02)
        assert await status() == await status("kubemoe.v1.Generator") == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_the_services(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    replies = [r async for r in stub.ServerReflectionInfo(iter([ask]))]
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"kubemoe.v1.Generator", "grpc.health.v1.Health"} <= names


async def test_requests_are_counted_by_status(channel, frontend):
    def count(status):
        return frontend.metrics.registry.get_sample_value(
            "kubemoe_frontend_requests_total", {"api": "grpc_generate", "status": status}) or 0.0

    ok, invalid = count("OK"), count("INVALID_ARGUMENT")
    await generate(channel, request(frontend, max_tokens=2))
    with pytest.raises(grpc.aio.AioRpcError):
        await generate(channel, request(frontend, max_tokens=0))
    assert (count("OK"), count("INVALID_ARGUMENT")) == (ok + 1, invalid + 1)
