"""The gRPC API of a frontend: kubemoe.v1.Generator, the standard health service and reflection.

Refusals leave with the exact status code and a message saying what to fix: INVALID_ARGUMENT
(bad parameters, a prompt that does not fit), NOT_FOUND (another model), RESOURCE_EXHAUSTED (the
queue is full: retry later), UNAVAILABLE (not ready, or the generation failed: retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kubemoe.expert_fn.transport import EXCLUSIVE_PORT, listen
from kubemoe.frontend.app import NOT_READY
from kubemoe.frontend.engine import InvalidPrompt, QueueFull
from kubemoe.frontend.sampling import SamplingParams
from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_background: set[asyncio.Task] = set()  # readiness followers, referenced until their server stops


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def sampling_params(proto: pb.SamplingParams) -> SamplingParams:
    """proto3 optional fields left unset take the documented defaults."""
    def get(name, default):
        return getattr(proto, name) if proto.HasField(name) else default

    try:
        return SamplingParams(temperature=get("temperature", 1.0), top_p=get("top_p", 1.0), top_k=get("top_k", 0),
                              seed=get("seed", None), stop=tuple(proto.stop), max_tokens=get("max_tokens", 16))
    except ValueError as e:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}") from None


class GeneratorServicer(pb_grpc.GeneratorServicer):
    def __init__(self, frontend):
        self.frontend = frontend

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        which = request.WhichOneof("input")
        if which is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "set prompt (text) or prompt_ids (token ids)")
        return self.frontend.tokenizer.encode(request.prompt) if which == "prompt" else list(request.prompt_ids.ids)

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        code = grpc.StatusCode.OK
        try:
            if request.model != self.frontend.model_id:
                raise Refused(grpc.StatusCode.NOT_FOUND, f"this frontend serves model {self.frontend.model_id!r}, "
                                                         f"not {request.model!r}")
            ids, params = self._prompt_ids(request), sampling_params(request.sampling)
            if not self.frontend.ready:
                raise Refused(grpc.StatusCode.UNAVAILABLE, NOT_READY)
            request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
            async with contextlib.aclosing(self.frontend.engine.generate(request_id, ids, params)) as deltas:
                try:
                    async for delta in deltas:
                        if delta.finish_reason == "error":
                            raise Refused(grpc.StatusCode.UNAVAILABLE, f"generation failed: {delta.error}; retry")
                        usage = pb.Usage(prompt_tokens=delta.prompt_tokens, completion_tokens=delta.completion_tokens)
                        yield pb.GenerateResponse(request_id=request_id, token_ids=delta.token_ids, text=delta.text,
                                                  finish_reason=delta.finish_reason or "",
                                                  usage=usage if delta.finish_reason else None)
                except InvalidPrompt as e:  # empty, unknown token ids, or longer than the context
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
                except QueueFull as e:
                    raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the server is busy: {e}") from None
        except Refused as e:
            code = e.code
            await context.abort(e.code, e.message)
        except asyncio.CancelledError:  # the client went away (aclosing has freed the batch slot)
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.frontend.metrics.requests.labels(api="grpc_generate", status=code.name).inc()


async def _follow_readiness(server: grpc.aio.Server, health: health_aio.HealthServicer, frontend,
                            interval: float) -> None:
    """Report frontend.ready as the health status until the server stops."""
    serving = None
    while True:
        if frontend.ready != serving:
            serving = frontend.ready
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for service in ("", SERVICE_NAME):
                await health.set(service, status)
        if not await server.wait_for_termination(timeout=interval):  # True: timed out, still serving
            return


async def create_grpc_server(address: str, frontend, *,
                             readiness_interval: float = 1.0) -> tuple[grpc.aio.Server, int]:
    """A server for `frontend` bound to `address` (port 0: any free port), not yet started."""
    server = grpc.aio.server(options=[EXCLUSIVE_PORT])
    pb_grpc.add_GeneratorServicer_to_server(GeneratorServicer(frontend), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = listen(server, address)
    task = asyncio.get_running_loop().create_task(_follow_readiness(server, health, frontend, readiness_interval))
    _background.add(task)
    task.add_done_callback(_background.discard)
    return server, port
