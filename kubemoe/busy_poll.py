"""Event loops that poll before they sleep, so a reply due within microseconds needs no wake-up.

An expert call is: send, wait a few hundred microseconds, go on. A loop that waits in a blocking
epoll_wait pays for it twice when the reply comes: the kernel's wake-up of the thread (30-60 us on
the H200 host, more on the 2-core machine) and then a cold core: on the 2-core machine the same
20 lines of Python took 9 us back to back, 70 us after a 7 ms sleep and 225 us after 50 ms.
Like Linux's SO_BUSY_POLL, this selector first polls (epoll_wait with timeout 0) for up to
`busy_poll_s`, then blocks for the rest of the timeout.

Cost: up to `busy_poll_s` of one core after each burst of activity; 0 turns it off. An expert
function spins by default: it waits for its frontend's next call while the frontend works on
another core. A frontend waits while expert functions compute; on a node with few cores they
compute on the core it would spin on (2 cores, a Qwen3-size expert: the call took 1 ms longer),
so frontends, and expert functions that share their cores (`kubemoe serve`), spin only on nodes
with many cores.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import time
import weakref
from typing import Coroutine, TypeVar

T = TypeVar("T")
DEFAULT_BUSY_POLL_US = 1000.0  # covers a GPU expert call's round trip and the gap to the next call
SHARED_CORES_BUSY_POLL_US = DEFAULT_BUSY_POLL_US if (os.cpu_count() or 1) >= 8 else 0.0


class BusyPollSelector(selectors.EpollSelector):
    def __init__(self, busy_poll_s: float):
        super().__init__()
        self.busy_poll_s = busy_poll_s
        self.last_ready = 0  # how many files the last select() returned

    def select(self, timeout: float | None = None):
        ready = self._select(timeout)
        self.last_ready = len(ready)
        return ready

    def _select(self, timeout: float | None):
        if (timeout is not None and timeout <= 0) or self.busy_poll_s <= 0:
            return super().select(timeout)
        spin = self.busy_poll_s if timeout is None else min(timeout, self.busy_poll_s)
        start = time.perf_counter()
        while True:
            ready = super().select(0)
            elapsed = time.perf_counter() - start
            if ready or elapsed >= spin:
                break
        if ready:
            return ready
        return super().select(None if timeout is None else max(0.0, timeout - elapsed))


_selectors: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, BusyPollSelector] = weakref.WeakKeyDictionary()


def new_event_loop(busy_poll_us: float) -> asyncio.AbstractEventLoop:
    """A loop that polls for `busy_poll_us` before it sleeps (0: sleeps at once, as asyncio's own)."""
    selector = BusyPollSelector(max(busy_poll_us, 0.0) / 1e6)
    loop = asyncio.SelectorEventLoop(selector)
    _selectors[loop] = selector
    return loop


def only_event(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the loop's last wait woke for a single file: a callback of that file's may take it that
    nothing else arrived with what it reads. False on loops not made by new_event_loop (unknown)."""
    selector = _selectors.get(loop)
    return selector is not None and selector.last_ready == 1


def run(main: Coroutine[object, object, T], busy_poll_us: float) -> T:
    """asyncio.run(main) on a loop that polls for `busy_poll_us` before it sleeps."""
    with asyncio.Runner(loop_factory=lambda: new_event_loop(busy_poll_us)) as runner:
        return runner.run(main)
