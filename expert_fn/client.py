"""The client a frontend uses to call one expert-function endpoint.

With `streaming=True` (the default) every forward() goes over ONE long-lived ForwardStream per
client: no per-call HTTP/2 stream setup, and replies, which may come out of order, are matched to
callers by request_id. If the stream breaks, the calls waiting on it fail with UNAVAILABLE (expert
calls have no side effects: retrying them is safe) and the next call opens a new stream.

Errors surface as grpc.aio.AioRpcError: `.code()` is the status, `.details()` says what was wrong.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Iterable, Sequence

import grpc
import torch

from kubemoe import wire
from kubemoe.expert_fn.servicer import REQUEST_ID_METADATA
from kubemoe.expert_fn.transport import grpc_options
from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class ExpertClient:
    def __init__(self, address: str, *, model: str, streaming: bool = True, max_message_bytes: int = 64 << 20):
        self.address, self.model, self.streaming = address, model, streaming
        self._options = grpc_options(max_message_bytes)
        self._channel: grpc.aio.Channel | None = None  # made on first use, inside the event loop
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task | None = None
        self._write_lock: asyncio.Lock | None = None  # one writer at a time on the stream
        self._pending: dict[str, asyncio.Future] = {}
        self._ids = (f"{os.getpid():x}-{id(self):x}-{n}" for n in itertools.count())

    @property
    def _stub(self) -> pb_grpc.ExpertServiceStub:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=self._options)
            self._stub_cached = pb_grpc.ExpertServiceStub(self._channel)
        return self._stub_cached

    async def forward(
        self,
        layer: int,
        experts: Sequence[int],
        counts: Sequence[int],
        hidden: torch.Tensor,  # [sum(counts), H]: group after group
        *,
        request_id: str = "",
        timeout: float | None = None,
    ) -> torch.Tensor:  # [sum(counts), H], hidden's dtype and device
        request = pb.ForwardRequest(model=self.model, request_id=request_id or next(self._ids), layer=layer,
                                    experts=experts, counts=counts)
        wire.encode_into(hidden, request.hidden)  # in place: no second copy of the bytes
        response = await self.forward_response(request, timeout=timeout)
        out = wire.decode(response.hidden)  # aliases the response's bytes, which nothing else holds
        return out if hidden.device.type == "cpu" else out.to(hidden.device)

    async def forward_response(self, request: pb.ForwardRequest, *, timeout: float | None = None) -> pb.ForwardResponse:
        """Send a prepared request; the whole response, ServerTiming included (for benchmarks and tools)."""
        if not request.request_id:
            request.request_id = next(self._ids)
        if self.streaming:
            return await self._forward_streamed(request, timeout)
        return await self._stub.Forward(request, timeout=timeout)

    async def _forward_streamed(self, request: pb.ForwardRequest, timeout: float | None) -> pb.ForwardResponse:
        rid = request.request_id
        if rid in self._pending:
            raise ValueError(f"request_id {rid!r} is already in flight on this client; ids must be unique")
        stream = self._open_stream()
        done = self._pending[rid] = asyncio.get_running_loop().create_future()
        try:
            async with self._write_lock:
                await stream.write(request)
            return await asyncio.wait_for(done, timeout)
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no reply to request {rid!r} from {self.address} within {timeout}s") from None
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as e:
            if done.done() and not done.cancelled() and done.exception() is not None:
                raise done.exception() from None  # the reader's verdict is the more precise one
            # A write into a stream the server has just dropped fails with INTERNAL ("Failed
            # execute_batch") before the reader notices: that is a broken stream, safe to retry.
            if isinstance(e, grpc.aio.AioRpcError) and e.code() != grpc.StatusCode.INTERNAL:
                raise
            if self._stream is stream:
                self._stream = None  # the next call opens a new stream
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"stream to {self.address} closed: {e}") from None
        finally:
            self._pending.pop(rid, None)

    def _open_stream(self) -> grpc.aio.StreamStreamCall:
        if self._stream is None:
            self._stream = self._stub.ForwardStream()
            self._write_lock = asyncio.Lock()
            self._reader = asyncio.get_running_loop().create_task(self._read_replies(self._stream))
        return self._stream

    async def _read_replies(self, stream: grpc.aio.StreamStreamCall) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            async for response in stream:
                waiter = self._pending.get(response.request_id)
                if waiter is not None and not waiter.done():  # else: the caller timed out; drop the late reply
                    waiter.set_result(response)
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the client was closed")
        finally:
            if self._stream is stream:
                self._stream = None  # the next call opens a new stream
            self._fail_pending(error or rpc_error(grpc.StatusCode.UNAVAILABLE, f"the server at {self.address} ended the stream"))

    def _fail_pending(self, error: grpc.aio.AioRpcError) -> None:
        # A refused request names itself in the trailers: it gets the real status; the others
        # were collateral damage and may simply be retried.
        culprit = dict(error.trailing_metadata() or ()).get(REQUEST_ID_METADATA)
        retry = rpc_error(grpc.StatusCode.UNAVAILABLE,
                          f"the stream to {self.address} broke ({error.code().name}: {error.details()}); retry the call")
        for rid, waiter in list(self._pending.items()):
            if not waiter.done():
                waiter.set_exception(error if rid == culprit or culprit is None and error.code() in _PASS_THROUGH else retry)

    async def describe(self) -> pb.DescribeResponse:
        return await self._stub.Describe(pb.DescribeRequest())

    async def load(self, keys: Iterable[tuple[int, int]]) -> pb.LoadResponse:
        return await self._stub.Load(pb.LoadRequest(model=self.model, experts=_keys(keys)))

    async def unload(self, keys: Iterable[tuple[int, int]]) -> pb.UnloadResponse:
        return await self._stub.Unload(pb.UnloadRequest(model=self.model, experts=_keys(keys)))

    async def close(self) -> None:
        """End the stream cleanly (the server sees the client finish, not a cancel), then the channel."""
        if self._stream is not None:
            try:
                await self._stream.done_writing()
                await asyncio.wait_for(asyncio.shield(self._reader), 1.0)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, TimeoutError):
                self._stream.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stream = self._reader = None

    async def __aenter__(self) -> "ExpertClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


# Statuses that are about every pending call alike (not one bad request), passed on as they are.
_PASS_THROUGH = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                 grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}


def _keys(keys: Iterable[tuple[int, int]]) -> list[pb.ExpertKey]:
    return [pb.ExpertKey(layer=layer, expert=expert) for layer, expert in keys]
