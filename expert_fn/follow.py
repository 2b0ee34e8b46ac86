"""An expert function that follows the routing table: it gains and drops experts in place.

Besides its bundle (loaded at start, never dropped: Knative's readiness is about it), a function
holds whatever the table sends to its own address (`--address`, as the table names it): when a new
table names it for experts it does not hold, it Loads them through its store, if the device has the
memory for them (else, or if the Load runs out of it, it logs and leaves them out: the frontends' calls
there fail NOT_FOUND and go to the expert's other replicas); when a table stops naming it for an
expert it gained, it drops it after `drop_after` seconds, because frontends switch tables a moment
apart and one still on the old table may send a last call. Until the weights are in, a call gets
UNAVAILABLE and the frontend retries it on another replica: nothing is lost as long as the table
keeps a loaded replica beside one being loaded, which is how the in-place path adds replicas.
With a node Load lock (node_lock.py: functions sharing a node folder), one function of the node Loads at
a time, and each checks the device's free memory once it holds the lock.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import torch

from kubemoe.expert_fn.errors import ExpertFnError
from kubemoe.expert_fn.node_lock import NodeLoadLock, holding
from kubemoe.expert_fn.servicer import ExpertServicer
from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.routing_table import ExpertKey, held_by_address

log = logging.getLogger(__name__)
MEMORY_HEADROOM = 1 << 30  # left free on the GPU for activations and CUDA graphs


def cuda_free_bytes(device: torch.device) -> int | None:
    """Memory a Load can have on a CUDA device: what is free, and what this process's allocator holds cached
    (it frees that before it fails an allocation); None (no limit known) elsewhere."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class TableFollower:
    def __init__(self, servicer: ExpertServicer, address: str, drop_after: float = 30.0,
                 free_bytes: Callable[[], int | None] | None = None, load_lock: NodeLoadLock | None = None):
        self.servicer, self.address, self.drop_after, self.load_lock = servicer, address, drop_after, load_lock
        store = servicer.store
        self.free_bytes = free_bytes or (lambda: cuda_free_bytes(store.device))
        self._drops: dict[ExpertKey, asyncio.TimerHandle] = {}
        self._wanted: frozenset[ExpertKey] = frozenset()  # what the newest table sends here (and the bundle)

    @property
    def store(self):
        return self.servicer.store

    async def on_table(self, table: pb.RoutingTable) -> None:
        wanted = self._wanted = held_by_address(table).get(self.address, frozenset()) | self.store.bundle
        held = set(self.store.held())
        for key in wanted & self._drops.keys():  # wanted again before its drop: keep it
            self._drops.pop(key).cancel()
        gains = sorted(wanted - held)
        if gains:
            await self._gain(gains)
        loop = asyncio.get_running_loop()
        for key in sorted(held - wanted - self._drops.keys()):
            self._drops[key] = loop.call_later(self.drop_after, self._start_drop, key)

    async def _gain(self, keys: list[ExpertKey]) -> None:
        async with holding(self.load_lock):
            await self._load(keys)

    async def _load(self, keys: list[ExpertKey]) -> None:
        need = self.store.load_bytes(keys)  # a new stack of each layer it changes beside the old one, and reads
        free = self.free_bytes()
        if free is not None and need + MEMORY_HEADROOM > free:
            log.warning("routing table names %s for %d more experts (a Load of %.0f MiB) but the device has %.0f MiB "
                        "free: not loading them; frontends send their tokens to the other replicas", self.address,
                        len(keys), need / 2**20, free / 2**20)
            return
        try:
            response = await self.servicer.load(keys)
        except Exception as e:  # noqa: BLE001 - refused (out of memory) or failed (a read's I/O error): as no room
            log.warning("routing table names %s for %d more experts, not loaded: %s; frontends send their tokens to "
                        "the other replicas", self.address, len(keys), e, exc_info=not isinstance(e, ExpertFnError))
            return
        log.info("loaded %d experts in place (%.0f MiB in %.2fs) for the routing table", len(keys),
                 response.bytes_loaded / 2**20, response.seconds)

    def _start_drop(self, key: ExpertKey) -> None:  # a call_later callback: the drop itself awaits
        asyncio.get_running_loop().create_task(self._drop(key))

    async def _drop(self, key: ExpertKey) -> None:
        self._drops.pop(key, None)
        if key in self._wanted:  # a newer table wants it again
            return
        freed = await asyncio.to_thread(self.store.unload, [key])  # may wait for a Load: tables arrive meanwhile
        await self.servicer.report_health()
        log.info("dropped expert %s in place (%.0f MiB): no routing table sends it here any more", key, freed / 2**20)
        if key in self._wanted:  # a table that arrived while it was dropped wants it: it saw it held, gained nothing
            await self._gain([key])
