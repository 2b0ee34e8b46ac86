"""Frontends over the tiny Mixtral checkpoint with in-process experts, and servers in front of them."""

from __future__ import annotations

import contextlib

import grpc
import openai
import pytest

from kubemoe.bundles import bundles_by_count
from kubemoe.frontend.app import Frontend, FrontendConfig
from kubemoe.frontend.grpc_api import create_grpc_server
from kubemoe.frontend.http_api import start_http_server
from kubemoe.routing_table import LOCAL, table_for_bundles


def _route_all(frontend: Frontend, address: str = LOCAL) -> None:
    """Route every expert to `address` (default: computed inside the frontend), in two bundles."""
    bundles = bundles_by_count(frontend.adapter.moe_layers, frontend.adapter.num_experts, 2)
    frontend.set_routing_table(table_for_bundles(frontend.model_id, bundles, {b.name: [address] for b in bundles}))


@pytest.fixture(scope="session")
def make_frontend(tiny_checkpoint):
    """make_frontend(routed=True, **FrontendConfig fields) -> a Frontend, closed at the end of the session."""
    made = []

    def make(routed: bool = True, **config) -> Frontend:
        frontend = Frontend(FrontendConfig(checkpoint=tiny_checkpoint("mixtral"), **config))
        made.append(frontend)
        if routed:
            _route_all(frontend)
        return frontend

    yield make
    for frontend in made:
        frontend.close()


@pytest.fixture(scope="session")
def frontend(make_frontend) -> Frontend:
    """A ready frontend shared by the API tests (its metrics and loads add up across them)."""
    return make_frontend()


@contextlib.asynccontextmanager
async def _http_server(frontend: Frontend):
    """The real aiohttp server on 127.0.0.1, any free port; yields its base URL."""
    runner, port = await start_http_server(frontend, "127.0.0.1", 0, grace=1.0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def _grpc_channel(frontend: Frontend, readiness_interval: float = 1.0):
    """The real gRPC server on 127.0.0.1, any free port; yields a channel to it."""
    server, port = await create_grpc_server("127.0.0.1:0", frontend, readiness_interval=readiness_interval)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


def _openai_client(base_url: str) -> openai.AsyncOpenAI:
    # No retries: a test sees each 429 and 503 as the server sent it.
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="session")
def route_all():
    """route_all(frontend, address=LOCAL): every expert of the model served at `address`."""
    return _route_all


@pytest.fixture(scope="session")
def http_server():
    """http_server(frontend): async context manager serving it over HTTP, yielding the base URL."""
    return _http_server


@pytest.fixture(scope="session")
def grpc_channel():
    """grpc_channel(frontend, readiness_interval=1.0): async context manager yielding a channel to it."""
    return _grpc_channel


@pytest.fixture(scope="session")
def openai_client():
    """openai_client(base_url) -> openai.AsyncOpenAI without retries."""
    return _openai_client


@pytest.fixture
async def base_url(frontend):
    async with _http_server(frontend) as url:
        yield url


@pytest.fixture
async def client(base_url):
    async with _openai_client(base_url) as c:
        yield c


@pytest.fixture
async def channel(frontend):
    async with _grpc_channel(frontend) as ch:
        yield ch
