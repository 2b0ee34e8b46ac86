"""A MoEDeployment's status follows its children: when a child pod, Deployment or Knative Service changes
(its pods became Ready), the owner's status is evaluated again soon after, not at the next timer tick.

Changes come in bursts (hundreds of expert pods turn Ready within seconds of each other), so each
owner is refreshed at most once per `delay_s`, one refresh at a time: the first change schedules a refresh,
later ones until it runs ride along with it, and changes while it runs make one more after it. The refresh
itself (one GET and one status patch) runs in a worker thread and reads the watch when it starts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

log = logging.getLogger(__name__)


class StatusFollower:
    def __init__(self, delay_s: float = 0.5):
        self.delay_s = delay_s
        self._pending: dict[str, Callable[[], object]] = {}  # uid -> its refresh, not yet started
        self._tasks: dict[str, asyncio.Task] = {}  # uid -> what refreshes it (held: the loop keeps only weak references)

    def changed(self, uid: str, refresh: Callable[[], object]) -> None:
        """A child of the MoEDeployment `uid` changed: `refresh` it soon (in a thread). Call from the event
        loop (a Kopf handler)."""
        self._pending[uid] = refresh
        if uid in self._tasks:
            return  # the refresh due, or the one after the running one, rides along
        task = asyncio.get_running_loop().create_task(self._follow(uid))
        self._tasks[uid] = task

    async def _follow(self, uid: str) -> None:
        # One refresh of an owner at a time: changes while one runs make exactly one more, delay_s later.
        # (Each change's own refresh, started while earlier ones still ran, queued them on the status lock
        # and filled the event loop's few worker threads at 1000 nodes.)
        try:
            while uid in self._pending:
                await asyncio.sleep(self.delay_s)
                refresh = self._pending.pop(uid)  # a change from here on makes the next refresh
                try:
                    await asyncio.to_thread(refresh)
                except Exception:  # noqa: BLE001 - the timer's reconcile writes the status anyway; say why this did not
                    log.exception("refreshing the status of MoEDeployment %s failed; the next reconcile writes it", uid)
        finally:
            # In the same step as the last look at _pending (a done callback would run later: a change between
            # the two would find this follower still listed, and wait for nobody)
            self._tasks.pop(uid, None)
