"""The node's Load lock (expert_fn/node_lock.py): one holder at a time, across processes, a cancelled wait
leaves nothing held; following functions that share a node folder Load one after another, and a function
starting on the node reads its bundle once the lock is free."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from kubemoe.expert_fn.config import ExpertFnConfig
from kubemoe.expert_fn.follow import TableFollower
from kubemoe.expert_fn.server import build_server
from kubemoe.expert_fn.node_lock import NodeLoadLock

from .conftest import NOT_SERVING, SERVING
from .test_follow import ARCH, table


async def test_one_holder_at_a_time_and_a_cancelled_wait_holds_nothing(tmp_path):
    lock, order = NodeLoadLock(tmp_path), []

    async def hold(name: str, seconds: float) -> None:
        async with lock.held():
            order.append(f"{name} in")
            await asyncio.sleep(seconds)
            order.append(f"{name} out")

    first = asyncio.create_task(hold("a", 0.2))
    await asyncio.sleep(0.05)
    waiting = asyncio.create_task(hold("cancelled", 0))
    second = asyncio.create_task(hold("b", 0))
    await asyncio.sleep(0.05)
    waiting.cancel()
    await asyncio.gather(first, second, waiting, return_exceptions=True)
    assert order == ["a in", "a out", "b in", "b out"]


async def test_a_lock_file_that_cannot_be_opened_leaves_loads_unlocked_and_is_said(tmp_path, caplog):
    lock = NodeLoadLock(tmp_path)  # in a folder every user writes in, another's link where the file would be
    lock.path.symlink_to(tmp_path / "elsewhere")
    for _ in range(2):
        async with lock.held():
            pass
    assert not (tmp_path / "elsewhere").exists()  # the link was not followed
    assert [r.getMessage() for r in caplog.records if "without the node's Load lock" in r.getMessage()] == [
        f"Loading without the node's Load lock: cannot open {lock.path} (Too many levels of symbolic links); "
        "check --shm-dir"]


async def test_another_process_holding_it_makes_a_load_wait(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(tmp_path / NodeLoadLock(tmp_path).path.name)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(0.5)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        async with NodeLoadLock(tmp_path).held():
            waited = time.monotonic() - started
    finally:
        holder.wait(timeout=10)
    assert waited > 0.3


async def test_following_functions_that_share_a_node_folder_load_one_after_another(tiny_checkpoint, serve, tmp_path):
    spans: dict[bool, list[tuple[float, float]]] = {}
    async with serve(tiny_checkpoint(ARCH), "0:0", model="m") as one, serve(tiny_checkpoint(ARCH), "0:1", model="m") as two:
        for servicer in (one.servicer, two.servicer):  # each Load takes a while: long enough to overlap if it can
            load = servicer.load

            async def slow(keys, load=load):
                started = time.monotonic()
                await asyncio.sleep(0.2)
                response = await load(keys)
                spans[locked].append((started, time.monotonic()))
                return response
            servicer.load = slow
        for version, locked in enumerate((True, False), start=1):
            spans[locked] = []
            lock = NodeLoadLock(tmp_path) if locked else None
            followers = [TableFollower(s.servicer, s.address, load_lock=lock) for s in (one, two)]
            gains = ((1, 2 * version), (1, 2 * version + 1))
            await asyncio.gather(*(f.on_table(table(s.address, gains, version)) for f, s in zip(followers, (one, two))))
            assert all(set(gains) <= set(s.servicer.store.held()) for s in (one, two))
    (a, b), (c, d) = sorted(spans[True])
    assert b <= c  # with the lock: the second Load began once the first had ended
    (a, b), (c, d) = sorted(spans[False])
    assert c < b  # without it they overlap (the test can tell the two apart)


async def test_a_function_starting_while_its_node_loads_reads_its_bundle_once_the_lock_is_free(
        tiny_checkpoint, tmp_path, health):
    config = ExpertFnConfig.build(tiny_checkpoint(ARCH), "*", device="cpu", metrics_port=None, shm_dir=tmp_path)
    async with NodeLoadLock(tmp_path).held():  # another function of the node is Loading
        built = await build_server("127.0.0.1:0", config)
        await built.server.start()
        try:
            await asyncio.sleep(0.5)
            assert not built.loading.done() and not built.servicer.store.held()
            assert await health(f"127.0.0.1:{built.port}") == NOT_SERVING
        except BaseException:
            await built.stop(None)
            raise
    try:
        await asyncio.wait_for(built.loading, 30)
        assert await health(f"127.0.0.1:{built.port}") == SERVING and built.servicer.store.held()
    finally:
        await built.stop(None)
