"""Kopf handlers of MoEDeployment: thin wrappers around `Reconciler` (see reconcile.py).

    kubemoe operator --all-namespaces     # peering set up as the chart does (operator/cli.py)

Create, update and resume reconcile the spec; the timer pulls the frontends' /loads and re-plans; a
daemon re-plans between its ticks when a service kept warm is past keepAlive or the loads leave a hot
expert short of replicas; delete only reports (owner references let
the garbage collector remove the children, so no finalizer is needed). Settings come from the
environment once (`OperatorConfig.from_env`).

Nodes (a Kopf index), pods and the expert pods, frontend Deployments and Knative Services (watch.py: watches of
the operator's own, an event a dict update) are kept from watches: a reconcile lists none of the cluster's
nodes and pods, and a child's change (its pods Ready) brings the owner's status up to date within a second
(status_follower.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging

import kopf

from kubemoe.operator.config import OperatorConfig
from kubemoe.operator.events import events
from kubemoe.operator.kube import ApiError, Kube
from kubemoe.operator.loads import FrontendLoads
from kubemoe.operator.plan import Loads, NodeInfo
from kubemoe.operator.reconcile import Outcome, Reconciler, Watched
from kubemoe.operator.render import KNATIVE, MANAGED_BY, MANAGER
from kubemoe.operator.spec import GROUP, KIND, PLURAL, VERSION
from kubemoe.operator.status_follower import StatusFollower
from kubemoe.operator.watch import ListWatch

CONFIG = OperatorConfig.from_env()
RESOURCE = (GROUP, VERSION, PLURAL)
CHILD_LABELS = {MANAGED_BY: MANAGER}  # the workloads this operator made
CHILD_KINDS = (("v1", "Pod"), ("apps/v1", "Deployment"), KNATIVE)  # whose readiness the status follows
PODS_LISTED_S = 60.0
KEEP_ALIVE_CHECK_S = 1.0  # how often the daemon looks for a warm service past its keepAlive (between_ticks)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger, **_) -> None:
    from kubernetes import config as kube_config
    from kubernetes.client import ApiClient

    # Progress and the last handled spec live in annotations: the status schema is structural and
    # would prune Kopf's status fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = OwnDiffBase(prefix=GROUP, key="last-handled-configuration")
    # Log lines become Events only from WARNING up (not "Timer succeeded" every tick); report() posts
    # its Events with kopf.event, which this level does not filter.
    settings.posting.level = logging.WARNING
    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        kube_config.load_kube_config()
    kube = Kube(ApiClient(), CONFIG.field_manager)
    memo.reconciler = Reconciler(kube, CONFIG)
    memo.load_source = FrontendLoads(kube, CONFIG.loads_port, CONFIG.loads_timeout_s, pods=lambda: listed_pods(memo))
    memo.status_follower = StatusFollower()
    start_watches(kube.api, memo, asyncio.get_running_loop())
    logger.info("kubemoe operator: peering %r (priority %d), loads every %.0fs", settings.peering.name,
                settings.peering.priority, CONFIG.loads_interval_s)


class OwnDiffBase(kopf.AnnotationsDiffBaseStorage):
    """Kopf builds a diff base (a deep copy of the body) for every event of every kind it watches; only
    MoEDeployment has handlers that compare one (create, update, the timer's idling). At 1000 nodes the
    nodes', pods' and children's events (then all watched by Kopf) made that copy about a fifth of the
    operator's CPU (py-spy)."""

    def build(self, *, body: kopf.Body, extra_fields=None) -> kopf.BodyEssence:
        if body.get("kind", KIND) != KIND:  # kopf names the kind of listed items too
            return kopf.BodyEssence()
        return super().build(body=body, extra_fields=extra_fields)


def start_watches(api, memo: kopf.Memo, loop: asyncio.AbstractEventLoop) -> None:
    """The pods (capacity counts those of every namespace, so only when every namespace is watched) and the
    operator's pods, Deployments and Knative Services in the namespaces it watches (its pods from the
    cluster-wide watch where there is one); a child's change brings its owner's status up to date (Ready
    follows the pods within a second, not at the next timer tick)."""
    def changed(child: dict) -> None:  # in a watch's thread: the follower lives on Kopf's loop
        for uid in owner_uids(child):
            loop.call_soon_threadsafe(follow, uid)

    def follow(uid: str) -> None:
        # The children are read when the refresh writes, not before it waits for another status write.
        # (refresh_status keeps those `uid` owns.)
        memo.status_follower.changed(uid, lambda: memo.reconciler.refresh_status(uid, lambda: all_children(memo)))

    selector = ",".join(f"{k}={v}" for k, v in CHILD_LABELS.items())
    memo.pods = None if CONFIG.watch_namespaces else ListWatch(api, "v1", "Pod", on_change=changed).start()
    kinds = [kind for kind in CHILD_KINDS if memo.pods is None or kind != ("v1", "Pod")]
    memo.children = [ListWatch(api, api_version, kind, namespace, selector, on_change=changed).start()
                     for api_version, kind in kinds for namespace in CONFIG.watch_namespaces or [None]]


def listed_pods(memo: kopf.Memo) -> list[dict] | None:
    """The cluster's pods from the watch, once it has listed them; None where there is no such watch
    (namespaces watched one by one) or not yet."""
    pods = memo.get("pods")
    return pods.values() if pods is not None and pods.synced.is_set() else None


def all_children(memo: kopf.Memo) -> list[dict]:
    watches = [*memo.children, *([memo.pods] if memo.pods is not None else [])]
    return [child for watch in watches for child in watch.values()]


@kopf.on.cleanup()
async def stop_watches(memo: kopf.Memo, **_) -> None:
    for watch in [*memo.get("children", ()), memo.get("pods")]:
        if watch is not None:
            watch.stop()


# INDICES: kopf passes each index to every handler as a keyword argument named after it (node_infos); its
# callback protocols list only the arguments it always passes, so mypy refuses handlers that name an index.
# The `type: ignore[arg-type]` on their decorators is for that alone. The index function is async: kopf runs
# a sync handler in a thread and waits for it.
@kopf.index("v1", "nodes")
async def node_infos(body, **_) -> NodeInfo:
    # Parsed once per change of a node (kwok's and kubelets' heartbeats are leases: nodes rarely change).
    return NodeInfo.from_node(body)


def owner_uids(body) -> list[str]:
    return [ref["uid"] for ref in body["metadata"].get("ownerReferences") or [] if ref.get("kind") == KIND]


def watched(node_infos: kopf.Index, memo: kopf.Memo) -> Watched:
    # Copies: the watches keep changing while a reconcile runs in its thread. Nodes are cluster-wide always;
    # pods only when every namespace is watched (capacity counts pods of them all), and only once listed:
    # a plan on an empty list would fill GPUs that pods hold.
    pods = memo.pods
    if pods is not None and not pods.synced.wait(PODS_LISTED_S):
        raise kopf.TemporaryError(f"the cluster's pods are not listed yet (after {PODS_LISTED_S:.0f}s)", delay=10)
    return Watched([*node_infos.get(None, ())], None if pods is None else pods.values())


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")  # type: ignore[arg-type]  # see INDICES
def reconcile(body, memo: kopf.Memo, node_infos: kopf.Index, **_) -> None:
    # A spec change re-plans with the loads last seen (kept per object in memo by the timer).
    report(body, memo.reconciler.reconcile(body, memo.get("loads"), watched=watched(node_infos, memo)))


# sharp: every loadsInterval on a fixed grid, as the setting says, not loadsInterval after a reconcile that took
# seconds (a 1000-function move: 10 s, so its retired functions expired 15 s later, not 5).
@kopf.timer(*RESOURCE, interval=CONFIG.loads_interval_s, initial_delay=CONFIG.loads_interval_s, idle=None,  # type: ignore[arg-type]  # see INDICES
            sharp=True)
def replan(body, memo: kopf.Memo, node_infos: kopf.Index, **_) -> None:
    # Asks the frontends for fresh loads (or keeps the last ones when none answers) and re-plans with them.
    outcome = memo.reconciler.reconcile(body, memo.get("loads"), source=memo.load_source,
                                        watched=watched(node_infos, memo))
    memo.loads = outcome.loads
    if outcome.loads_error:
        kopf.event(body, type="Warning", reason="LoadsUnavailable", message=outcome.loads_error)
    report(body, outcome, retry_later=False)


@kopf.daemon(*RESOURCE, cancellation_timeout=5.0)  # type: ignore[arg-type]  # see INDICES
async def between_ticks(body, memo: kopf.Memo, node_infos: kopf.Index, stopped, **_) -> None:
    # What must not wait for the next loads tick (loadsInterval, 30 s by default): a service kept warm is
    # deleted within a second of its keepAlive's end (until then the status counts it and its GPU memory
    # stays taken), and loads that leave a hot expert short of replicas re-plan within scaleOutCheck.
    # A daemon, not a timer: a timer's every tick is a log line.
    loop, uid = asyncio.get_running_loop(), body["metadata"]["uid"]
    checked, pause = loop.time(), min(KEEP_ALIVE_CHECK_S, CONFIG.scale_out_check_s or KEEP_ALIVE_CHECK_S)
    while not stopped:
        loads = None
        if CONFIG.scale_out_check_s > 0 and loop.time() - checked >= CONFIG.scale_out_check_s:
            checked = loop.time()
            loads = await loop.run_in_executor(None, short_of_replicas, uid, memo)
        if loads is not None or memo.reconciler.keep_alive_over(uid):
            # in kopf's context: kopf.event reads its queue from a context variable
            await loop.run_in_executor(None, contextvars.copy_context().run, replan_now, body, memo, node_infos, loads)
        await stopped.wait(pause)


def short_of_replicas(uid: str, memo: kopf.Memo) -> Loads | None:
    try:
        return memo.reconciler.short_of_replicas(uid, memo.load_source)
    except ApiError as e:  # listing the frontends failed: the timer's re-plan says so in an Event
        logging.getLogger(__name__).info("cannot check the loads between re-plans: %s", e.message)
    except Exception:  # noqa: BLE001 - a failed check must not stop the daemon (keepAlive expiry); the timer re-plans
        logging.getLogger(__name__).exception("checking the loads between re-plans failed; the next loads tick re-plans")
    return None


def replan_now(body, memo: kopf.Memo, node_infos: kopf.Index, loads: Loads | None) -> None:
    if loads is not None:
        memo.loads = loads
    report(body, memo.reconciler.reconcile(body, memo.get("loads"), watched=watched(node_infos, memo)),
           retry_later=False)


@kopf.on.delete(*RESOURCE, optional=True)
def deleted(name, uid, memo: kopf.Memo, **_) -> None:
    memo.reconciler.forget(uid)
    # Nothing to clean up by hand: every child has an owner reference to this object.
    logging.getLogger(__name__).info("MoEDeployment %s deleted; the garbage collector removes its children", name)


def report(body, outcome: Outcome, retry_later: bool = True) -> None:
    """Events for what changed and was decided; Kopf errors for what did not work (status says why)."""
    for event in events(outcome, body.get("status")):
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    if outcome.error is None or not retry_later:  # the timer tries again on its own
        return
    if outcome.retry:
        raise kopf.TemporaryError(outcome.error.message, delay=max(10.0, CONFIG.loads_interval_s))
    raise kopf.PermanentError(outcome.error.message)

