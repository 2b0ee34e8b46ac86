"""Expert functions following the routing table: experts gained and dropped in place, over a real
server on port 0 and a real table file; the bundle is never dropped; no memory, no load."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
import torch

from kubemoe.bundles import Bundle
from kubemoe.errors import KubemoeError
from kubemoe.expert_fn.config import ExpertFnConfig
from kubemoe.expert_fn import store as store_module
from kubemoe.expert_fn.follow import TableFollower
from kubemoe.expert_fn.node_lock import NodeLoadLock
from kubemoe.expert_fn.server import follow_routing_table
from kubemoe.routing_table import table_for_bundles, to_json

ARCH = "qwen3_moe"  # tiny: 2 MoE layers of 16 experts, hidden 128
OTHER = "10.0.0.9:80"


def table(address: str, extra: tuple[tuple[int, int], ...], version: int):
    """Every expert at OTHER; `extra` also at `address` (beside OTHER: a loaded replica stays in the table)."""
    bundles = [Bundle(f"l{layer}-e{e}", ((layer, e),)) for layer in (0, 1) for e in range(16)]
    return table_for_bundles("m", bundles, {b.name: [OTHER, address] if b.experts[0] in extra else [OTHER]
                                            for b in bundles}, version)


async def until(condition, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_function_loads_what_the_table_sends_it_and_drops_it_after_the_table_moves_on(
        tiny_checkpoint, serve, tmp_path):
    path = tmp_path / "routing.json"
    async with serve(tiny_checkpoint(ARCH), "0:0-1", model="m") as server:
        shared = tmp_path / "node"  # the node folder functions share (--shm-dir): Loads take its lock
        shared.mkdir()
        config = dataclasses.replace(server.config, routing_table=str(path), address=server.address, drop_after=0.3,
                                     shm_dir=shared)
        path.write_text(to_json(table(server.address, ((1, 5), (1, 6)), 1)))
        following = follow_routing_table(config, server.servicer)
        try:
            store = server.servicer.store
            await until(lambda: {(1, 5), (1, 6)} <= set(store.held()))
            assert NodeLoadLock(shared).path.exists()
            client = server.client()
            hidden = torch.randn(3, 128)
            out = await client.forward(1, [5], [3], hidden)  # served in place
            assert out.shape == (3, 128)
            # The next table sends (1, 6) elsewhere only and names the bundle nowhere: (1, 6) goes
            # after drop_after, the bundle stays (the function's readiness is about it).
            path.write_text(to_json(table(server.address, ((1, 5),), 2)))
            written = asyncio.get_running_loop().time()
            await until(lambda: (1, 6) not in store.held())
            # Not before drop_after: a frontend still on table 1 may send a last call.
            assert asyncio.get_running_loop().time() - written >= 0.3
            assert set(store.held()) == {(0, 0), (0, 1), (1, 5)}
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.forward(1, [6], [3], hidden)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND  # the frontend retries another replica
            await client.close()
        finally:
            following.cancel()


async def test_an_expert_wanted_again_before_its_drop_stays_and_no_memory_means_no_load(tiny_checkpoint, serve):
    async with serve(tiny_checkpoint(ARCH), "0:0", model="m") as server:
        store = server.servicer.store
        follower = TableFollower(server.servicer, server.address, drop_after=0.2)
        await follower.on_table(table(server.address, ((1, 2),), 1))
        await follower.on_table(table(server.address, (), 2))
        await follower.on_table(table(server.address, ((1, 2),), 3))  # back before its drop
        await asyncio.sleep(0.4)
        assert set(store.held()) == {(0, 0), (1, 2)}
        full = TableFollower(server.servicer, server.address, free_bytes=lambda: 0)
        await full.on_table(table(server.address, ((1, 2), (1, 3)), 4))
        assert (1, 3) not in store.held()


async def test_a_load_the_device_refuses_leaves_the_follower_following(tiny_checkpoint, serve, monkeypatch, caplog):
    async with serve(tiny_checkpoint(ARCH), "0:0", model="m") as server:
        store = server.servicer.store
        follower = TableFollower(server.servicer, server.address, drop_after=0.2)

        def full(*_args, **_kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.31 GiB.")

        with monkeypatch.context() as patched:
            patched.setattr(store_module.StackedExperts, "empty", full)
            await follower.on_table(table(server.address, ((1, 2),), 1))  # no exception: logged
        assert (1, 2) not in store.held() and "not loaded: loading 1:2 ran out of device memory" in caplog.text
        await follower.on_table(table(server.address, ((1, 2), (1, 3)), 2))  # room again: both come
        assert {(1, 2), (1, 3)} <= set(store.held())


def test_following_the_table_needs_the_address_it_names_the_function_by(tiny_checkpoint):
    with pytest.raises(KubemoeError, match="--address"):
        ExpertFnConfig.build(tiny_checkpoint(ARCH), "0:0", device="cpu", routing_table="/x")
    with pytest.raises(KubemoeError, match="NAMESPACE/NAME"):
        ExpertFnConfig.build(tiny_checkpoint(ARCH), "0:0", device="cpu", routing_configmap="x", address="a:1")


async def test_a_table_that_wants_an_expert_again_while_its_drop_waits_for_a_load_keeps_it(tiny_checkpoint, serve,
                                                                                          monkeypatch):
    async with serve(tiny_checkpoint(ARCH), "0:0", model="m") as server:
        store = server.servicer.store
        follower = TableFollower(server.servicer, server.address, drop_after=0.1)
        await follower.on_table(table(server.address, ((1, 2),), 1))
        await follower.on_table(table(server.address, (), 2))  # (1, 2) goes in 0.1 s
        read = store.adapter.read_expert_into  # meanwhile a slow Load holds the store: the drop waits for it
        monkeypatch.setattr(store.adapter, "read_expert_into", lambda *a, **k: (time.sleep(1.0), read(*a, **k))[1])
        loading = asyncio.create_task(server.servicer.load([(0, 5)]))
        await until(lambda: (1, 2) not in follower._drops)  # the drop began
        await follower.on_table(table(server.address, ((1, 2),), 3))  # the newest table sends it here again
        await loading
        await until(lambda: (1, 2) in store.held() and not follower._drops, timeout=10)
        await asyncio.sleep(0.3)
        assert (1, 2) in store.held()


async def test_a_load_that_fails_to_read_leaves_the_function_following_later_tables(tiny_checkpoint, serve, tmp_path,
                                                                                    monkeypatch):
    path = tmp_path / "routing.json"
    async with serve(tiny_checkpoint(ARCH), "0:0", model="m") as server:
        store = server.servicer.store
        read, failed = store.adapter.read_expert_into, []

        def flaky(*args, **kwargs):  # one I/O error reading the checkpoint (a network volume's hiccup)
            if not failed:
                failed.append(True)
                raise OSError(5, "Input/output error")
            return read(*args, **kwargs)

        monkeypatch.setattr(store.adapter, "read_expert_into", flaky)
        path.write_text(to_json(table(server.address, ((1, 2),), 1)))
        config = dataclasses.replace(server.config, routing_table=str(path), address=server.address)
        following = follow_routing_table(config, server.servicer)
        try:
            await until(lambda: failed)
            path.write_text(to_json(table(server.address, ((1, 3),), 2)))
            await until(lambda: (1, 3) in store.held(), timeout=10)
            assert not following.done()
        finally:
            following.cancel()
