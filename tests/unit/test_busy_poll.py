"""Busy-polling event loops: the same results as a plain loop, whether events come during the spin or after."""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading
import time

from kubemoe import busy_poll
from kubemoe.busy_poll import BusyPollSelector


def ready_after(seconds: float) -> tuple[socket.socket, socket.socket]:
    reader, writer = socket.socketpair()
    threading.Timer(seconds, writer.send, (b"x",)).start()
    return reader, writer


def test_an_event_during_the_spin_is_returned_at_once_and_one_after_it_by_the_blocking_wait():
    for spin, due in ((5.0, 0.02), (0.001, 0.1)):  # within the spin; long after it
        selector = BusyPollSelector(spin)
        start = time.perf_counter()  # before the timer starts, so `took` cannot be short by the set-up time
        reader, writer = ready_after(due)
        selector.register(reader, selectors.EVENT_READ)
        ready = selector.select(timeout=None)
        took = time.perf_counter() - start
        assert [key.fileobj for key, _ in ready] == [reader]
        assert due * 0.9 < took < due + 2.0, (spin, due, took)
        selector.close(), reader.close(), writer.close()


def test_a_timeout_shorter_than_the_spin_is_kept():
    selector = BusyPollSelector(5.0)
    reader, writer = socket.socketpair()
    selector.register(reader, selectors.EVENT_READ)
    start = time.perf_counter()
    assert selector.select(timeout=0.05) == []
    assert 0.05 <= time.perf_counter() - start < 2.0
    assert selector.select(timeout=0) == []  # a poll stays a poll
    selector.close(), reader.close(), writer.close()


def test_a_busy_polling_loop_runs_io_and_timers_like_any_loop():
    async def main() -> tuple[bytes, float]:
        loop = asyncio.get_running_loop()
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        loop.call_later(0.05, writer.send, b"x")
        start = time.perf_counter()
        data = await asyncio.wait_for(loop.sock_recv(reader, 1), 5)
        waited = time.perf_counter() - start
        await asyncio.sleep(0.01)
        reader.close(), writer.close()
        return data, waited

    data, waited = busy_poll.run(main(), busy_poll_us=1000)
    assert data == b"x" and 0.04 < waited < 5


def test_a_callback_knows_whether_its_file_woke_the_loop_alone():
    async def seen_by_callbacks(files_ready: int) -> list[bool]:
        loop, seen = asyncio.get_running_loop(), []
        pairs = [socket.socketpair() for _ in range(3)]
        for reader, _ in pairs:
            loop.add_reader(reader, lambda r=reader: (seen.append(busy_poll.only_event(loop)), r.recv(1)))
        await asyncio.sleep(0.01)  # the loop is waiting
        for _, writer in pairs[:files_ready]:
            writer.send(b"x")  # before the loop's next wait: all wake it together
        await asyncio.sleep(0.05)
        for reader, writer in pairs:
            loop.remove_reader(reader)
            reader.close(), writer.close()
        return seen

    for busy_poll_us in (0, 1000):
        assert busy_poll.run(seen_by_callbacks(1), busy_poll_us) == [True]
        assert busy_poll.run(seen_by_callbacks(2), busy_poll_us) == [False, False]
    assert asyncio.run(seen_by_callbacks(1)) == [False]  # another loop: unknown, so never "alone"
