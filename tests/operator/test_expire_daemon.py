"""The keepAlive daemon (handlers.expire) as kopf runs it: an async daemon whose reconcile runs in a worker
thread. Its Events must reach kopf's posting queue, which kopf.event finds through context variables that
a thread started with run_in_executor does not see unless the daemon hands its context over (without it
the daemon's first report raised and kopf restarted the daemon a minute later)."""

import asyncio

import kopf
from kopf._core.engines import posting  # the context variables kopf sets for its handlers: no public setter

from kubemoe.operator import events as ev
from kubemoe.operator import handlers
from kubemoe.operator.plan import NodeInfo

from .test_reconcile import MOVED, SKEWED, api_nodes, kept_warm, setup, step


class Stopped:
    """kopf's `stopped` flag as an async daemon gets it; set once `done()` holds."""

    def __init__(self, done):
        self.done = done

    def __bool__(self) -> bool:
        return self.done()

    async def wait(self, timeout: float) -> None:
        await asyncio.sleep(timeout)


def test_the_daemon_deletes_warm_services_past_keepalive_and_its_events_reach_kopf(f, monkeypatch):
    body, kube, clock, reconciler = setup(f)
    uid = body["metadata"]["uid"]
    step(body, reconciler, kube, SKEWED)
    clock.now += 60
    step(body, reconciler, kube, MOVED)
    assert kept_warm(kube)
    clock.now += 601  # keepAlive (10m) over
    memo = kopf.Memo(reconciler=reconciler, loads=MOVED, pods=None)
    node_infos = {None: [NodeInfo.from_node(n) for n in api_nodes(4)]}
    monkeypatch.setattr(handlers, "KEEP_ALIVE_CHECK_S", 0.01)

    async def run() -> list:
        queue: asyncio.Queue = asyncio.Queue()
        posting.settings_var.set(kopf.OperatorSettings())
        posting.event_queue_var.set(queue)
        posting.event_queue_loop_var.set(asyncio.get_running_loop())
        stopped = Stopped(lambda: not reconciler.keep_alive_over(uid))
        await asyncio.wait_for(handlers.expire(body=body, memo=memo, node_infos=node_infos, stopped=stopped), 30)
        await asyncio.sleep(0.05)  # the worker thread's events arrive through call_soon_threadsafe
        return [queue.get_nowait() for _ in range(queue.qsize())]

    posted = asyncio.run(run())
    assert not kept_warm(kube)
    assert ev.EXPIRED in {e.reason for e in posted}, posted
