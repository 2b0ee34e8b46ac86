"""The daemon between the loads ticks (handlers.between_ticks) as kopf runs it: an async daemon whose
reconcile runs in a worker thread. Its Events must reach kopf's posting queue, which kopf.event finds
through context variables that a thread started with run_in_executor does not see unless the daemon hands
its context over (without it the daemon's first report raised and kopf restarted the daemon a minute later)."""

import asyncio
import dataclasses

import kopf
from kopf._core.engines import posting  # the context variables kopf sets for its handlers: no public setter

from kubemoe.operator import events as ev
from kubemoe.operator import handlers
from kubemoe.operator.plan import NodeInfo

from .test_reconcile import MOVED, SKEWED, api_nodes, kept_warm, services, setup, step


class Stopped:
    """kopf's `stopped` flag as an async daemon gets it; set once `done()` holds."""

    def __init__(self, done):
        self.done = done

    def __bool__(self) -> bool:
        return self.done()

    async def wait(self, timeout: float) -> None:
        await asyncio.sleep(timeout)


def run_daemon(body, memo, node_infos, done) -> list:
    """handlers.between_ticks until `done()`; the Events it posted to kopf."""
    async def run() -> list:
        queue: asyncio.Queue = asyncio.Queue()
        posting.settings_var.set(kopf.OperatorSettings())
        posting.event_queue_var.set(queue)
        posting.event_queue_loop_var.set(asyncio.get_running_loop())
        await asyncio.wait_for(handlers.between_ticks(body=body, memo=memo, node_infos=node_infos,
                                                      stopped=Stopped(done)), 30)
        await asyncio.sleep(0.05)  # the worker thread's events arrive through call_soon_threadsafe
        return [queue.get_nowait() for _ in range(queue.qsize())]

    return asyncio.run(run())


class Reported:
    """The frontends' /loads (operator/loads.LoadSource), as they report now."""

    def __init__(self, loads):
        self.loads, self.fetched = loads, 0

    def fetch(self, deployment):
        self.fetched += 1
        return self.loads


class Broken:
    """A load source that fails in a way nobody planned for."""

    def __init__(self):
        self.asked = 0

    def fetch(self, deployment):
        self.asked += 1
        raise RuntimeError("a frontend answered something unexpected")


def test_the_daemon_deletes_warm_services_past_keepalive_and_its_events_reach_kopf(f, monkeypatch):
    body, kube, clock, reconciler = setup(f)
    uid = body["metadata"]["uid"]
    step(body, reconciler, kube, SKEWED)
    clock.now += 60
    step(body, reconciler, kube, MOVED)
    assert kept_warm(kube)
    clock.now += 601  # keepAlive (10m) over
    memo = kopf.Memo(reconciler=reconciler, loads=MOVED, pods=None, load_source=Broken())
    node_infos = {None: [NodeInfo.from_node(n) for n in api_nodes(4)]}
    monkeypatch.setattr(handlers, "KEEP_ALIVE_CHECK_S", 0.01)
    monkeypatch.setattr(handlers, "CONFIG", dataclasses.replace(handlers.CONFIG, scale_out_check_s=0.01))
    # Runs on after two failed checks: a check that fails does not stop the daemon
    posted = run_daemon(body, memo, node_infos,
                        lambda: not reconciler.keep_alive_over(uid) and memo.load_source.asked >= 2)
    assert not kept_warm(kube)
    assert ev.EXPIRED in {e.reason for e in posted}, posted


def test_loads_that_leave_a_hot_expert_short_re_plan_before_the_next_tick(f, monkeypatch):
    """Expert 3 turns hot: within scaleOutCheck the daemon re-plans with the loads it read (not the timer's,
    loadsInterval later), and once the plan has the replicas it stops re-planning."""
    body, kube, clock, reconciler = setup(f)
    uid = body["metadata"]["uid"]
    step(body, reconciler, kube, SKEWED)
    hot = {function for function in services(kube, retired=False) if "-l0-e0-0-" in function}
    source = Reported(MOVED)
    memo = kopf.Memo(reconciler=reconciler, loads=SKEWED, pods=None, load_source=source)
    node_infos = {None: [NodeInfo.from_node(n) for n in api_nodes(4)]}
    monkeypatch.setattr(handlers, "CONFIG", dataclasses.replace(handlers.CONFIG, scale_out_check_s=0.01))
    assert reconciler.short_of_replicas(uid, source) is MOVED
    posted = run_daemon(body, memo, node_infos, lambda: source.fetched >= 4)
    assert reconciler.short_of_replicas(uid, source) is None and memo.loads is MOVED
    assert len({function for function in services(kube, retired=False) if "-l0-e3-3-" in function}) == 4
    assert len(hot & services(kube, retired=True)) == 3  # expert 0's extra replicas retire, kept warm
    reasons = [e.reason for e in posted]
    assert reasons.count(ev.SCALED_OUT) == 1, posted  # one re-plan: the later checks found replicas enough

    monkeypatch.setattr(handlers, "CONFIG", dataclasses.replace(handlers.CONFIG, scale_out_check_s=0.0))
    source.loads, source.fetched = SKEWED, 0  # back: short again, but the check is off
    monkeypatch.setattr(handlers, "KEEP_ALIVE_CHECK_S", 0.01)
    checks = iter(range(5))
    run_daemon(body, memo, node_infos, lambda: next(checks, None) is None)
    assert source.fetched == 0 and reconciler.short_of_replicas(uid, source) is SKEWED

