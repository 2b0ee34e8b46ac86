"""Bad requests leave with the right status and a message that says what was wrong; the server keeps serving."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubemoe import wire
from kubemoe.adapters import MoEAdapter
from kubemoe.expert import expert_ffn
from kubemoe.checkpoint import Checkpoint
from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc

ARCH = "mixtral"  # tiny: MoE layers 0 and 1, 8 experts, hidden 128, float32
BUNDLE = "0:0-3;1:*"
H = 128
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


def request(model: str, **fields) -> pb.ForwardRequest:
    defaults = dict(layer=0, experts=[1, 2], counts=[2, 1], hidden=wire.encode(torch.randn(3, H)))
    return pb.ForwardRequest(model=model, request_id="r", **{**defaults, **fields})


def tensor(dtype=pb.FLOAT32, shape=(3, H), nbytes=None) -> pb.Tensor:
    n = 1
    for d in shape:
        n *= max(d, 0)
    return pb.Tensor(dtype=dtype, shape=shape, data=b"\0" * (n * 4 if nbytes is None else nbytes))


BAD = {  # name: (request fields, status, words the message must contain)
    "wrong hidden size": (dict(hidden=wire.encode(torch.randn(3, H + 1))), INVALID, ["[tokens, 128]", "[3, 129]"]),
    "one-dimensional hidden": (dict(hidden=tensor(shape=(3,))), INVALID, ["[tokens, 128]"]),
    "no hidden": (dict(hidden=None), INVALID, ["hidden is missing"]),
    "unsupported dtype": (dict(hidden=tensor(dtype=pb.DTYPE_UNSPECIFIED)), INVALID, ["DTYPE_UNSPECIFIED", "FLOAT32"]),
    "unknown dtype number": (dict(hidden=tensor(dtype=9)), INVALID, ["9", "not supported"]),
    "byte length mismatch": (dict(hidden=tensor(nbytes=100)), INVALID, ["needs 1536 bytes", "got 100"]),
    "negative dimension": (dict(hidden=tensor(shape=(-3, H), nbytes=0)), INVALID, ["negative"]),
    # No elements, so no bytes to check against, but strides that overflow: not a server fault
    "overflowing empty shape": (dict(hidden=tensor(shape=(0, 2**62, 2**62), nbytes=0)), INVALID,
                                ["[0, 4611686018427387904, 4611686018427387904]", "not one a tensor can have"]),
    "counts do not sum to rows": (dict(counts=[2, 2]), INVALID, ["sum to 4", "3 rows"]),
    "negative count": (dict(counts=[4, -1]), INVALID, ["negative", "[4, -1]"]),
    "experts and counts differ": (dict(experts=[1], counts=[2, 1]), INVALID, ["1 experts and 2 counts"]),
    "layer not in the model": (dict(layer=7), INVALID, ["layer 7", "MoE layers: 0, 1"]),
    "expert not in the model": (dict(experts=[1, 8]), INVALID, ["expert 8", "0..7"]),
    "expert not in the bundle": (dict(experts=[1, 5]), NOT_FOUND, ["expert 5 of layer 0", "bundle 0:0-3;1:0-7"]),
}


@pytest.fixture
async def server(tiny_checkpoint, serve):
    async with serve(tiny_checkpoint(ARCH), BUNDLE) as running:
        yield running


async def forward_raw(address: str, req: pb.ForwardRequest, **channel_options):
    async with grpc.aio.insecure_channel(address, options=list(channel_options.items())) as channel:
        return await pb_grpc.ExpertServiceStub(channel).Forward(req)


async def assert_still_serves(server) -> None:
    client = server.client(streaming=False)
    x = torch.randn(4, H)
    assert (await client.forward(1, [6], [4], x)).shape == (4, H)
    await client.close()


@pytest.mark.parametrize("case", BAD)
async def test_bad_request_is_refused_with_a_clear_message(case, server):
    fields, code, words = BAD[case]
    req = request(server.config.model, **{k: v for k, v in fields.items() if v is not None})
    if "hidden" in fields and fields["hidden"] is None:
        req.ClearField("hidden")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await forward_raw(server.address, req)
    assert refused.value.code() == code, refused.value.details()
    for word in words:
        assert word in refused.value.details()
    await assert_still_serves(server)


async def test_wrong_model_is_not_found(server):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await forward_raw(server.address, request("llama-70b"))
    assert refused.value.code() == NOT_FOUND
    assert "'llama-70b'" in refused.value.details() and f"{server.config.model!r}" in refused.value.details()


async def test_load_of_an_expert_outside_the_model_is_refused(server):
    client = server.client()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.load([(0, 99)])
    assert refused.value.code() == INVALID and "expert 99" in refused.value.details()
    await client.close()


async def test_message_over_the_limit_is_resource_exhausted(tiny_checkpoint, serve):
    async with serve(tiny_checkpoint(ARCH), BUNDLE, max_message_bytes=64 << 10) as small:
        big = request(small.config.model, experts=[1], counts=[256], hidden=wire.encode(torch.randn(256, H)))  # 128 KiB
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await forward_raw(small.address, big, **{"grpc.max_send_message_length": 1 << 20})
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "65536" in refused.value.details()
        for streaming in (True, False):  # the client with its default limit sees the same
            client = small.client(streaming=streaming)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.forward(1, [1], [256], torch.randn(256, H))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await client.close()
        await assert_still_serves(small)


async def test_a_bad_request_on_a_stream_fails_only_itself_and_the_stream_goes_on(server):
    client = server.client(streaming=True)
    x = torch.randn(3, H)
    good, bad = await asyncio.gather(client.forward(0, [1, 2], [2, 1], x), client.forward(0, [1, 7], [2, 1], x),
                                     return_exceptions=True)
    assert isinstance(bad, grpc.aio.AioRpcError)
    assert bad.code() == NOT_FOUND and "expert 7 of layer 0" in bad.details()
    assert good.shape == (3, H)  # sent on the same stream at the same time: not collateral damage
    stream = client._stream
    assert (await client.forward(0, [1, 2], [2, 1], x)).shape == (3, H)
    assert client._stream is stream  # the same stream goes on
    await client.close()


# -- property: thousands of malformed requests, then a valid one --------------------------------

_dims = st.integers(-2, 40)
SERVED = "<the served model id>"
malformed = st.fixed_dictionaries({
    "model": st.sampled_from([SERVED] * 6 + ["", "mixtral-8x7b", "x" * 300]),
    "layer": st.integers(-3, 4),
    "experts": st.lists(st.integers(-2, 10), max_size=4),
    "counts": st.lists(st.integers(-3, 8), max_size=4),
    "dtype": st.integers(0, 5),
    "shape": st.lists(st.one_of(_dims, st.just(H)), max_size=3),
    "data_delta": st.one_of(st.just(0), st.integers(-64, 64)),
    "has_hidden": st.booleans(),
})


def build(fields: dict, model: str) -> pb.ForwardRequest:
    itemsize = {pb.FLOAT32: 4, pb.BFLOAT16: 2, pb.FLOAT16: 2}.get(fields["dtype"], 4)
    numel = 1
    for d in fields["shape"]:
        numel *= max(d, 0)
    req = pb.ForwardRequest(model=model if fields["model"] is SERVED else fields["model"], request_id="p",
                            layer=fields["layer"], experts=fields["experts"], counts=fields["counts"])
    if fields["has_hidden"]:
        req.hidden.CopyFrom(pb.Tensor(dtype=fields["dtype"], shape=fields["shape"],
                                      data=b"\x01" * max(0, numel * itemsize + fields["data_delta"])))
    return req


def test_property_malformed_requests_never_break_the_server(tiny_checkpoint, serve):
    """Batches of 25 random malformed requests, 100 times: each is refused cleanly (or, when hypothesis
    happens to build a valid one, answered); then a valid request still gets the right answer."""
    checkpoint = tiny_checkpoint(ARCH)
    ckpt = Checkpoint(checkpoint)
    adapter = MoEAdapter(ckpt.config)
    refusals = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
    outcomes: dict[str, int] = {}

    with asyncio.Runner() as runner:
        context = serve(checkpoint, BUNDLE)
        server = runner.run(context.__aenter__())
        channel = grpc.aio.insecure_channel(server.address)
        stub = pb_grpc.ExpertServiceStub(channel)

        async def send(req: pb.ForwardRequest) -> None:
            try:
                response = await stub.Forward(req)
            except grpc.aio.AioRpcError as e:
                assert e.code() in refusals, (e.code(), e.details(), req)
                assert len(e.details()) > 20, e.details()
                outcomes[e.code().name] = outcomes.get(e.code().name, 0) + 1
                return
            assert list(response.hidden.shape) == list(req.hidden.shape), req
            outcomes["OK"] = outcomes.get("OK", 0) + 1

        @settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(st.lists(malformed, min_size=25, max_size=25))
        def malformed_batches(batch):
            async def send_all():
                await asyncio.gather(*(send(build(fields, server.config.model)) for fields in batch))
            runner.run(send_all())

        try:
            malformed_batches()
            x = torch.randn(5, H)
            valid = pb.ForwardRequest(model=server.config.model, layer=1, experts=[3, 4], counts=[2, 3],
                                      hidden=wire.encode(x))

            async def call():
                return await stub.Forward(valid)
            got = runner.run(call())
            want = torch.cat([expert_ffn(x[:2], adapter.load_expert(ckpt, 1, 3), adapter.act),
                              expert_ffn(x[2:], adapter.load_expert(ckpt, 1, 4), adapter.act)])
            assert torch.allclose(wire.decode(got.hidden), want, rtol=1e-5, atol=1e-6)
        finally:
            runner.run(channel.close())
            runner.run(context.__aexit__(None, None, None))
    assert sum(outcomes.values()) == 2500 and outcomes["INVALID_ARGUMENT"] > 1000 and outcomes["NOT_FOUND"] > 100, outcomes


@pytest.mark.parametrize("streaming", [True, False])
async def test_a_refusal_names_every_expert_the_function_lacks_however_the_call_went(streaming, server):
    """The dispatcher puts aside only the (function, expert) pairs a refusal names (frontend/dispatch.py)."""
    from kubemoe.expert_fn.errors import lacking_of

    client = server.client(streaming=streaming)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await client.forward(0, [1, 5, 2, 7], [1, 1, 1, 1], torch.randn(4, H))  # bundle holds 0-3 of layer 0
    assert refused.value.code() == NOT_FOUND and "experts 5, 7 of layer 0" in refused.value.details()
    assert lacking_of(refused.value) == {(0, 5), (0, 7)}
    with pytest.raises(grpc.aio.AioRpcError) as wrong_model:  # about the whole function: names none
        await forward_raw(server.address, request("llama-70b"))
    assert wrong_model.value.code() == NOT_FOUND and lacking_of(wrong_model.value) == frozenset()
    await client.close()
