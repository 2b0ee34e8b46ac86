"""Expert-function fixtures: real servers on port 0, called over real channels."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kubemoe.expert_fn.client import ExpertClient, _Stream
from kubemoe.expert_fn.config import ExpertFnConfig
from kubemoe.expert_fn.metrics import ExpertFnMetrics
from kubemoe.expert_fn.node_lock import NodeLoadLock
from kubemoe.expert_fn.server import build_server
from kubemoe.expert_fn.servicer import ExpertServicer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Running:
    config: ExpertFnConfig
    address: str
    metrics: ExpertFnMetrics
    servicer: ExpertServicer

    def client(self, **kw) -> ExpertClient:
        return ExpertClient(self.address, model=self.config.model, **kw)


async def health_status(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))).status


async def wait_serving(address: str, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while await health_status(address) != SERVING:
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{address} is not SERVING after {timeout}s")
        await asyncio.sleep(0.02)


def left_in(shm_dir) -> list[str]:
    """What is left in a function's shared-memory folder besides the node's Load lock (which stays: node_lock.py)."""
    return sorted(p.name for p in shm_dir.iterdir() if p != NodeLoadLock(shm_dir).path)


@contextlib.asynccontextmanager
async def running_server(checkpoint, bundle: str = "*", *, preload: bool = True, **settings):
    """A started server for `checkpoint`'s `bundle` on 127.0.0.1:0; with `preload`, SERVING when yielded."""
    config = ExpertFnConfig.build(checkpoint, bundle, **{"device": "cpu", "metrics_port": None, **settings})
    metrics = ExpertFnMetrics(config.bundle_spec)
    built = await build_server("127.0.0.1:0", config, metrics=metrics, preload=preload)
    await built.server.start()
    running = Running(config, f"127.0.0.1:{built.port}", metrics, built.servicer)
    try:
        if preload:
            await wait_serving(running.address)
        yield running
    finally:
        await built.stop(None)


@pytest.fixture
def serve():
    """serve(checkpoint, bundle="*", preload=True, **config) -> async context manager yielding Running."""
    return running_server


@pytest.fixture
def health():
    return health_status


@pytest.fixture
def serving():
    return wait_serving


@pytest.fixture
def placed(monkeypatch) -> list[tuple[int, bool]]:
    """(rows, whether they went into the stream's segment or arena) of each call a client sends from now on:
    False is a call that found no free region and travelled inline."""
    calls, place = [], _Stream.place

    def watched(stream, request_id, hidden, msg):
        calls.append((len(hidden), place(stream, request_id, hidden, msg)))
        return calls[-1][1]

    monkeypatch.setattr(_Stream, "place", watched)
    return calls
