"""A MoEDeployment's status follows its children: when a child Deployment or Knative Service changes (its
pods became Ready), the owner's status is evaluated again soon after, not at the next timer tick.

Changes come in bursts (hundreds of expert Deployments turn Ready within seconds of each other), so each
owner is refreshed at most once per `delay_s`: the first change schedules a refresh, later ones until it
runs ride along with it. The refresh itself (one GET and one status patch) runs in a worker thread.
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
        self._tasks: set[asyncio.Task] = set()  # held, so that the loop does not drop a running refresh

    def changed(self, uid: str, refresh: Callable[[], object]) -> None:
        """A child of the MoEDeployment `uid` changed: `refresh` it soon (in a thread). Call from the event
        loop (a Kopf handler)."""
        scheduled = uid in self._pending
        self._pending[uid] = refresh
        if scheduled:
            return
        task = asyncio.get_running_loop().create_task(self._refresh_soon(uid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refresh_soon(self, uid: str) -> None:
        await asyncio.sleep(self.delay_s)
        refresh = self._pending.pop(uid)  # a change from here on schedules the next refresh
        try:
            await asyncio.to_thread(refresh)
        except Exception:  # noqa: BLE001 - the timer's reconcile writes the status anyway; say why this did not
            log.exception("refreshing the status of MoEDeployment %s failed; the next reconcile writes it", uid)
