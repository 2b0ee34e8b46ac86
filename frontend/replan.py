"""A new routing table over running expert functions, in place: the cheapest warm start, lossless.

Where the next plan only moves replicas between functions that already run, nothing new starts:
each function Loads the experts the new table sends it (`kubemoe.routing_table.moves_between`),
then the frontend switches to the new table (at a step boundary), then each function Unloads what
no table sends it any more. No token reaches a replica before its weights are in, and none is sent
to one after they are out. A driver that holds both the table and the functions (the live
benchmark) re-plans this way; in a cluster each expert function follows the table itself
(`kubemoe.expert_fn.follow`), as the operator cannot reach every frontend's step boundary.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.routing_table import Moves, moves_between


@dataclass(frozen=True)
class Repointed:
    moves: Moves
    bytes_loaded: int
    bytes_freed: int
    load_s: float     # until every gained expert was in
    switch_s: float   # until the frontend served with the new table
    unload_s: float


async def repoint(model: str, before: pb.RoutingTable | None, after: pb.RoutingTable,
                  switch: Callable[[], Awaitable[None]]) -> Repointed:
    """Load, switch (`switch` returns once no step uses `before` any more), unload."""
    from kubemoe.expert_fn.client import ExpertClient

    moves = moves_between(before, after)
    clients = {a: ExpertClient(a, model=model, streaming=False) for a in {*moves.load, *moves.unload}}
    try:
        started = time.perf_counter()
        loaded = await asyncio.gather(*(clients[a].load(keys) for a, keys in moves.load.items()))
        load_s = time.perf_counter() - started
        await switch()
        switch_s = time.perf_counter() - started - load_s
        freed = await asyncio.gather(*(clients[a].unload(keys) for a, keys in moves.unload.items()))
        unload_s = time.perf_counter() - started - load_s - switch_s
    finally:
        await asyncio.gather(*(c.close() for c in clients.values()))
    return Repointed(moves, sum(r.bytes_loaded for r in loaded), sum(r.bytes_freed for r in freed),
                     load_s, switch_s, unload_s)
