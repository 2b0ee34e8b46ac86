"""An asyncio event loop on its own thread, for I/O started from synchronous model code."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Coroutine

from kubemoe import busy_poll


class LoopThread:
    def __init__(self, name: str = "kubemoe-io", *, busy_poll_us: float = 0.0):
        self.loop = busy_poll.new_event_loop(busy_poll_us)
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine, timeout: float | None = None):
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
