"""A new routing table over running expert functions, in place: the cheapest warm start, lossless.

Where the next plan only moves replicas between functions that already run, nothing new starts:
each function Loads the experts the new table sends it (`kubemoe.routing_table.moves_between`),
then the frontend switches to the new table (at a step boundary), then each function Unloads what
no table sends it any more. No token reaches a replica before its weights are in, and none is sent
to one after they are out. A driver that holds both the table and the functions (the live
benchmark) re-plans this way, with one `Replanner` from one re-plan to the next; in a cluster each
expert function follows the table itself (`kubemoe.expert_fn.follow`), as the operator cannot reach
every frontend's step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.routing_table import ExpertKey, Moves, moves_between

if TYPE_CHECKING:  # for its type only: the module is imported where the first client is made
    from kubemoe.expert_fn.client import ExpertClient


@dataclass(frozen=True)
class Repointed:
    moves: Moves
    bytes_loaded: int
    bytes_freed: int
    device_bytes: dict[str, int]  # what the experts of each function it changed take on the device afterwards
    load_s: float     # until every gained expert was in
    load_spans: dict[str, tuple[float, float]]  # each loading function's Load: from and to, seconds into the re-plan
    switch_s: float   # until the frontend served with the new table
    unload_s: float


class Replanner:
    """Re-plans in place, one after another, over the running expert functions; one event loop's.

    Keeps one control channel per function it has called, until closed: a channel opened for each
    re-plan cost the frontend process ~0.8 ms of CPU per function (its GIL, taken from the steps
    being served meanwhile; measured on the 2-core machine) and each function a connection to accept.
    An idle channel to a function no table names any more costs nothing but its socket.

    `loads_at_once`: how many functions Load at the same time (None: all). Functions that share a host
    share its memory bandwidth and its link to the GPUs, which every step's calls also use: with 8 functions
    on one H100, steps beside Loads had a p99 1.37-1.38x steady's when all Loaded at once and 1.10-1.15x one
    at a time (run_h200.sh replan-ab at e8565fc), while a re-plan's Loads took 0.5 s instead of 0.17.
    """

    def __init__(self, model: str, loads_at_once: int | None = 1):
        if loads_at_once is not None and loads_at_once < 1:
            raise ValueError(f"loads_at_once must be at least 1 (or None: all at once), got {loads_at_once}")
        self.model = model
        self._loading = asyncio.Semaphore(loads_at_once) if loads_at_once else None
        self._clients: dict[str, ExpertClient] = {}

    def _client(self, address: str) -> ExpertClient:
        if address not in self._clients:
            from kubemoe.expert_fn.client import ExpertClient

            self._clients[address] = ExpertClient(address, model=self.model, streaming=False)
        return self._clients[address]

    async def repoint(self, before: pb.RoutingTable | None, after: pb.RoutingTable,
                      switch: Callable[[], Awaitable[None]]) -> Repointed:
        """Load, switch (`switch` returns once no step uses `before` any more), unload."""
        moves = moves_between(before, after)
        started = time.perf_counter()
        spans: dict[str, tuple[float, float]] = {}
        loaded = await asyncio.gather(*(self._load(a, keys, started, spans) for a, keys in moves.load.items()))
        load_s = time.perf_counter() - started
        await switch()
        switch_s = time.perf_counter() - started - load_s
        freed = await asyncio.gather(*(self._client(a).unload(keys) for a, keys in moves.unload.items()))
        unload_s = time.perf_counter() - started - load_s - switch_s
        device_bytes = {a: r.device_bytes for a, r in zip(moves.load, loaded)} | \
            {a: r.device_bytes for a, r in zip(moves.unload, freed)}  # the Unload's, where a function had both
        return Repointed(moves, sum(r.bytes_loaded for r in loaded), sum(r.bytes_freed for r in freed),
                         device_bytes, load_s, spans, switch_s, unload_s)

    async def _load(self, address: str, keys: tuple[ExpertKey, ...], started: float,
                    spans: dict[str, tuple[float, float]]) -> pb.LoadResponse:
        async with self._loading or contextlib.nullcontext():
            begun = time.perf_counter() - started
            loaded = await self._client(address).load(keys)
            spans[address] = (begun, time.perf_counter() - started)
            return loaded

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.close() for c in clients))


async def repoint(model: str, before: pb.RoutingTable | None, after: pb.RoutingTable,
                  switch: Callable[[], Awaitable[None]]) -> Repointed:
    """One re-plan (Replanner.repoint) over channels of its own, closed when it is done."""
    replanner = Replanner(model)
    try:
        return await replanner.repoint(before, after, switch)
    finally:
        await replanner.close()
