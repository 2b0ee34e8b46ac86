"""One reconcile of a MoEDeployment: observe -> plan -> render -> apply what changed -> prune -> status.

The only place that combines the pure modules with API calls; handlers call `Reconciler.reconcile`
and turn its outcome into events and Kopf errors. Everything it needs to continue after a restart
is in the cluster (children's annotations, the routing ConfigMap), never in memory.
"""

from __future__ import annotations

import datetime as dt
import itertools
import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Iterable, Mapping, Sequence

from kubemoe.operator import conditions as c
from kubemoe.operator import pod_security
from kubemoe.operator.capacity import with_taken
from kubemoe.operator.config import OperatorConfig
from kubemoe.operator.diff import Diff, Object, ObjectKey, diff, is_ready, key_of
from kubemoe.operator.kube import ApiError, Kube
from kubemoe.operator.loads import LoadSource
from kubemoe.operator.plan import (NO_LOADS, Decisions, Loads, NodeInfo, Plan, PlanError, decisions,
                                   keep_alive_ends, plan, short_of_replicas, with_dra_devices)
from kubemoe.operator.render import (COMPONENT, EXPERT, FRONTEND, KINDS, OPTIONAL_KINDS, ROUTING, function_of,
                                     observe, render, selector, service_of)
from kubemoe.operator.spec import API_VERSION, KIND, MoEDeployment, MoESpec, SpecError

log = logging.getLogger(__name__)
# A pod this process created that the watch has not shown within this long is looked for again (client-go's
# expectations wait 5 minutes).
EXPECTATIONS_S = 60.0


@dataclass
class Changes:
    applied: list[str] = field(default_factory=list)   # kind/name created or changed
    deleted: list[str] = field(default_factory=list)
    unchanged: int = 0
    decisions: Decisions | None = None                  # scaling and warm-pool decisions, once applied
    seconds: dict[str, float] = field(default_factory=dict)  # where the reconcile's time went, by phase


@dataclass
class Outcome:
    plan: Plan | None
    changes: Changes
    status: dict[str, Any]
    error: c.Condition | None = None   # PlanApplied False: why nothing (more) was applied
    retry: bool = True                 # the error may clear by itself (capacity, Knative installed later)
    applied: c.Condition | None = None  # PlanApplied as reported in the status (the error, if any)
    loads: Loads = NO_LOADS             # what the plan was made with (the handler keeps them for the next one)
    loads_error: str | None = None      # why the frontends' loads could not be asked for
    deployment: MoEDeployment | None = None  # the spec as parsed (None when it did not parse)


@dataclass(frozen=True)
class Watched:
    """What the operator's watches hold (Kopf indices, see handlers.py), so that a reconcile does not list
    every node and pod of the cluster again: at 1000 nodes those lists were megabytes a tick."""

    nodes: Sequence[NodeInfo]                 # as the planner reads them, parsed once per change of a node
    pods: Iterable[Mapping[str, Any]] | None  # every pod (what each holds on its node: operator/capacity.py);
                                              # None: the watch sees only some namespaces, so they are listed


@dataclass(frozen=True)
class _Applied:
    """The last plan a reconcile applied, for re-evaluating the status when children change."""

    deployment: MoEDeployment
    plan: Plan
    loads: Loads
    generation: int
    services: Mapping[ObjectKey, str] | None = None  # its expert objects' keys -> function (what ExpertsReady counts)


class Reconciler:
    def __init__(self, kube: Kube, config: OperatorConfig, clock: Callable[[], float] = time.time):
        self.kube, self.config, self.clock = kube, config, clock
        # Per object: one reconcile at a time (planning, applies, prune); and, apart, the last applied plan
        # with the status writes. A status refresh takes only the second, so it never waits for a reconcile's
        # applies or prune (at 1000 nodes: 20 s of applies, 9 s deleting the 844 objects a move retires).
        self._locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._status_locks: defaultdict[str, threading.RLock] = defaultdict(threading.RLock)
        self._applied: dict[str, _Applied] = {}  # by uid; only a cache: a restart reconciles everything (resume)
        # By uid: pods created (monotonic time) that the pod watch has not shown yet: made, not missing
        self._expected: defaultdict[str, dict[ObjectKey, float]] = defaultdict(dict)

    def reconcile(self, body: Mapping[str, Any], loads: Loads | None = None,
                  source: LoadSource | None = None, watched: Watched | None = None) -> Outcome:
        """Plan with `loads`, or with what `source` (the frontends) reports now when it reports anything;
        nodes and pods from `watched` where the caller keeps them, else listed."""
        # Handlers and the timer run in worker threads: one reconcile per object at a time.
        uid = body["metadata"]["uid"]
        with self._locks[uid]:
            # The status (and the plan refreshes evaluate) is published by `_finish` as soon as the plan is
            # applied; what left the plan is deleted after that (prune), the status following the pods meanwhile.
            return self._reconcile(body, loads or NO_LOADS, source, watched)

    def refresh_status(self, uid: str, children: Callable[[], Iterable[Object]]) -> Outcome | None:
        """The status again from the last applied plan and the children as watched now (their readiness
        changed): no planning, no applies, one GET and one status patch. None when this process has applied
        no plan for `uid` yet, or the spec changed since (the reconcile that follows writes the status).
        `children` reads the watch; it is called once no other status write is under way, so that what is
        written is as new as what is watched."""
        with self._status_locks[uid]:
            last = self._applied.get(uid)
            if last is None:
                return None
            body = self.kube.get(API_VERSION, KIND, last.deployment.namespace, last.deployment.name)
            if body["metadata"]["uid"] != uid or int(body["metadata"].get("generation", 0)) != last.generation:
                return None
            mine = [o for o in children() if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])]
            return self._finish(body, last.deployment, last.plan, mine, Changes(), last.loads, None, retry=False,
                                services=last.services, publish=False)

    def keep_alive_over(self, uid: str) -> bool:
        """Whether a service the last plan applied for `uid` keeps warm is past its keepAlive: the next
        reconcile deletes it (and the status stops counting it)."""
        last = self._applied.get(uid)
        if last is None:
            return False
        ends = keep_alive_ends(last.plan, last.deployment.spec.experts.scaling.keep_alive_s)
        return ends is not None and self.clock() >= ends

    def short_of_replicas(self, uid: str, source: LoadSource) -> Loads | None:
        """The frontends' loads now, if the plan last applied for `uid` is short of replicas under them (a hot
        expert needs more: `plan.short_of_replicas`), for a re-plan before the next loadsInterval tick; else None
        (no plan applied yet, no frontend answered, or replicas enough)."""
        last = self._applied.get(uid)
        if last is None or last.plan.mode == "offload":  # an offload plan has no replicas to add
            return None
        loads = source.fetch(last.deployment)
        if loads is None:
            return None
        short = short_of_replicas(last.deployment.spec, last.plan, loads)
        if not short:
            return None
        log.info("%s/%s: plan version %d is short of replicas for %d bundles (%s%s) under the loads now: re-planning",
                 last.deployment.namespace, last.deployment.name, last.plan.version, len(short),
                 ", ".join(short[:5]), " ..." if len(short) > 5 else "")
        return loads

    def forget(self, uid: str) -> None:
        self._applied.pop(uid, None)
        self._expected.pop(uid, None)

    def _reconcile(self, body: Mapping[str, Any], loads: Loads, source: LoadSource | None,
                   watched: Watched | None) -> Outcome:
        now = self.clock()
        try:
            deployment = MoEDeployment.from_body(body)  # the one parse of this reconcile
        except SpecError as e:
            failed = c.Condition(c.PLAN_APPLIED, False, c.INVALID_SPEC, str(e))
            return self._finish(body, None, None, [], Changes(), loads, failed, retry=False)
        loads_error = None
        if source is not None:
            try:
                loads = source.fetch(deployment) or loads  # None: no frontend answered, keep the last loads
            except ApiError as e:
                loads_error = f"cannot list frontend pods: {e.message}"
        outcome = self._apply(body, deployment, loads, now, watched)
        outcome.loads_error = loads_error
        return outcome

    def _apply(self, body: Mapping[str, Any], deployment: MoEDeployment, loads: Loads, now: float,
               watched: Watched | None) -> Outcome:
        changes = Changes()
        mark = [time.monotonic()]

        def took(phase: str) -> None:
            changes.seconds[phase] = round(time.monotonic() - mark[0], 3)
            mark[0] = time.monotonic()

        children = self._children(deployment, watched)
        previous = self._previous_plan(body, deployment, children)
        nodes = self._capacity(deployment, watched)
        took("observe")

        def refused(new: Plan | None, condition: c.Condition, done: Changes | None = None) -> Outcome:
            return self._finish(body, deployment, new, list(children.values()), done or Changes(), loads, condition,
                                retry=True, running=previous if children else None)

        try:
            new = plan(deployment.spec, loads, nodes, previous, now)
        except PlanError as e:
            return refused(None, c.Condition(c.PLAN_APPLIED, False, e.reason, str(e)))
        if new.mode == "distributed" and deployment.spec.experts.runtime == "knative" and not self._has_knative():
            return refused(new, c.Condition(c.PLAN_APPLIED, False, c.RUNTIME_MISSING,
                                            "runtime knative needs Knative Serving (serving.knative.dev/v1 Services): "
                                            "install it (see the chart's README) or set spec.experts.runtime: pods"))
        took("plan")
        wanted = render(deployment, new, self.config)
        forbidden = self._pod_security_refusal(deployment, wanted)
        if forbidden is not None:  # a Deployment would be stored, and its pods then refused out of sight
            return refused(new, c.Condition(c.PLAN_APPLIED, False, c.POD_SECURITY_FORBIDDEN, forbidden))
        wanted.sort(key=_apply_order)
        expected = self._expected[deployment.uid]  # pods created, until the watch shows them (diff.py)
        for key in [k for k, at in expected.items() if k in children or time.monotonic() - at > EXPECTATIONS_S]:
            del expected[key]
        todo = diff(wanted, children, expected.keys())
        changes.unchanged = todo.unchanged
        try:
            self._make(todo.made, children, expected, changes)
        except ApiError as e:
            return refused(new, c.Condition(c.PLAN_APPLIED, False, c.APPLY_FAILED,
                                            f"the API server refused an object ({e.message}); the operator retries"),
                           changes)
        took("apply")
        changes.decisions = decisions(previous, new)
        services = planned_functions(new, wanted)
        # The plan is in the cluster (routing table included): its status now, and refreshes from here on
        # follow its pods while what left the plan is deleted.
        outcome = self._finish(body, deployment, new, list(children.values()), changes, loads, None, retry=False,
                               fresh={key_of(o) for o in todo.made}, services=services)
        took("status")
        try:
            self._prune(todo, children, deployment.namespace, changes)
        except ApiError as e:
            return refused(new, c.Condition(c.PLAN_APPLIED, False, c.APPLY_FAILED,
                                            f"the API server refused a change ({e.message}); the operator retries"),
                           changes)
        took("prune")
        log.info("%s/%s: plan version %d, %d applied, %d unchanged, %d deleted in %.2fs (%s)", deployment.namespace,
                 deployment.name, new.version, len(changes.applied), changes.unchanged, len(todo.gone),
                 sum(changes.seconds.values()), ", ".join(f"{k} {v:.2f}s" for k, v in changes.seconds.items()))
        return outcome

    def _previous_plan(self, body: Mapping[str, Any], deployment: MoEDeployment,
                       children: Mapping[ObjectKey, Object]) -> Plan:
        """The plan this process applied last, while the spec is unchanged: the watch may not show all its pods
        yet, and a plan observed from some of them would re-place the functions it does not see. After a
        restart or a spec change, the plan the cluster holds."""
        last = self._applied.get(deployment.uid)
        if last is not None and last.generation == int(body["metadata"].get("generation", 0)):
            return last.plan
        return observe(deployment.spec, deployment.spec.mode, children.values())

    def _capacity(self, deployment: MoEDeployment, watched: Watched | None) -> list[NodeInfo]:
        """The nodes as the plan may fill them: with DRA, where a driver offers GPUs; less what other pods
        (frontends, other MoEDeployments) hold."""
        nodes = list(watched.nodes) if watched else [NodeInfo.from_node(n) for n in self.kube.list("v1", "Node")]
        if deployment.spec.experts.sharing.mode == "dra":
            nodes = with_dra_devices(nodes, self._resource_slices())
        pods = watched.pods if watched and watched.pods is not None else self.kube.list("v1", "Pod")
        return with_taken(deployment.spec, nodes, pods, deployment.namespace, deployment.name)

    def _make(self, made: list[Object], children: Mapping[ObjectKey, Object], expected: dict[ObjectKey, float],
              changes: Changes) -> None:
        """Apply in order groups (accounts, experts, frontend, routing table last), each group concurrently:
        a DeepSeek-V3-sized plan is ~650 objects, one round trip each. Created pods are expected until the
        watch shows them."""
        with ThreadPoolExecutor(max_workers=self.config.apply_concurrency) as pool:
            for _, group in itertools.groupby(made, key=lambda o: _apply_order(o)[0]):
                batch = list(group)
                for o, created in zip(batch, pool.map(lambda o: self._write(o, children.get(key_of(o))), batch)):
                    if created:
                        expected[key_of(o)] = time.monotonic()
                changes.applied += [f"{o['kind']}/{o['metadata']['name']}" for o in batch]

    def _prune(self, todo: Diff, children: Mapping[ObjectKey, Object], namespace: str, changes: Changes) -> None:
        """Running pods' labels and annotations, and what left the plan (its keep-alive over) or is no longer
        rendered, concurrently: one at a time, the 844 functions a move retires at 1000 nodes took 23 s
        (concurrently still ~9 s on 2 cores)."""
        with ThreadPoolExecutor(max_workers=self.config.apply_concurrency) as pool:
            list(pool.map(lambda o: self._write(o, children[key_of(o)]), todo.annotate))
            changes.applied += [f"Pod/{o['metadata']['name']}" for o in todo.annotate]
            list(pool.map(lambda key: self.kube.delete(key[0], key[1], namespace, key[2]), todo.gone))
        changes.deleted += [f"{key[1]}/{key[2]}" for key in todo.gone]

    def _write(self, obj: Object, live: Mapping[str, Any] | None) -> bool:
        """Server-side apply, except for pods: created, and once they exist only their labels and annotations
        patched (a pod's spec cannot change: a new spec is a new pod, render.py). An apply of a whole pod costs
        the API server more (the DeepSeek-V3 plan's 645 took 7.7 s on 2 cores). True: a pod was created."""
        if obj["kind"] != "Pod":
            self.kube.apply(obj)
            return False
        meta = obj["metadata"]
        if live is None:
            try:
                self.kube.create(obj)
            except ApiError as e:
                if e.status != 409:  # 409: made already, the watch this reconcile read has not shown it yet
                    raise
            return True
        dropped = {k: None for k in live["metadata"].get("annotations") or {}
                   if k.startswith("kubemoe.io/") and k not in meta["annotations"]}  # one no longer rendered
        self.kube.merge_patch(obj, {"metadata": {"labels": meta["labels"],
                                                 "annotations": {**meta["annotations"], **dropped}}})
        return False

    # -- observation --------------------------------------------------------------------------------

    def _children(self, deployment: MoEDeployment, watched: Watched | None) -> dict[ObjectKey, Object]:
        found: dict[ObjectKey, Object] = {}
        for api_version, kind in KINDS:
            items: Iterable[Mapping[str, Any]]
            try:
                if kind == "Pod" and watched is not None and watched.pods is not None:
                    # From the watch: ~1000 expert pods listed every reconcile were megabytes a tick. One it
                    # does not show yet is expected if this process made it (_apply), else created (a 409).
                    items = [p for p in watched.pods if p["metadata"].get("namespace") == deployment.namespace]
                else:
                    items = self.kube.list(api_version, kind, deployment.namespace, selector(deployment, ""))
            except ApiError as e:
                if e.status == 404 and (api_version, kind) in OPTIONAL_KINDS:
                    continue  # Knative not installed, or no DRA API: nothing of that kind to find
                raise
            for item in items:
                owners = item["metadata"].get("ownerReferences") or []
                if any(o.get("uid") == deployment.uid for o in owners):  # never touch what is not ours
                    found[key_of(item)] = dict(item)
        return found

    def _resource_slices(self) -> list[Object]:
        try:
            return self.kube.list("resource.k8s.io/v1", "ResourceSlice")
        except ApiError as e:
            if e.status == 404:
                return []  # no DRA API (Kubernetes before 1.34): no node offers DRA GPUs
            raise

    def _pod_security_refusal(self, deployment: MoEDeployment, wanted: list[Object]) -> str | None:
        volumes = pod_security.host_path_volumes(wanted)
        if not volumes:
            return None  # the pods pass the restricted level: no need to ask
        namespace = self.kube.get("v1", "Namespace", None, deployment.namespace)
        return pod_security.refusal(deployment.namespace, namespace["metadata"].get("labels") or {}, volumes)

    def _has_knative(self) -> bool:
        try:
            self.kube.request("discovery", "GET", "/apis/serving.knative.dev/v1")
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    # -- status -------------------------------------------------------------------------------------

    def _finish(self, body: Mapping[str, Any], deployment: MoEDeployment | None, new: Plan | None,
                children: list[Object], changes: Changes, loads: Loads, error: c.Condition | None, retry: bool,
                fresh: AbstractSet[ObjectKey] = frozenset(), services: Mapping[ObjectKey, str] | None = None,
                publish: bool = True, running: Plan | None = None) -> Outcome:
        """Writes the status; with `publish` (a reconcile), the plan becomes what refreshes evaluate (or none,
        on an error), in the same step, so that no refresh writes the status of a plan older than the last.
        On an error, status.plan and status.cost describe the plan `running` (what the cluster holds), not the
        refused one."""
        meta = body["metadata"]
        with self._status_locks[meta["uid"]]:
            if publish:
                if error is None and new is not None and deployment is not None:
                    self._applied[meta["uid"]] = _Applied(deployment, new, loads, int(meta.get("generation", 0)), services)
                else:
                    self._applied.pop(meta["uid"], None)
            return self._write_status(body, deployment, new, children, changes, loads, error, retry, fresh, services,
                                      running)

    def _write_status(self, body: Mapping[str, Any], deployment: MoEDeployment | None, new: Plan | None,
                      children: list[Object], changes: Changes, loads: Loads, error: c.Condition | None, retry: bool,
                      fresh: AbstractSet[ObjectKey], services: Mapping[ObjectKey, str] | None,
                      running: Plan | None) -> Outcome:
        meta = body["metadata"]
        generation = int(meta.get("generation", 0))
        live = {key_of(o): o for o in children if key_of(o) not in fresh}
        if error:
            applied = error
        else:
            assert new is not None, "a reconcile without an error has a plan"
            applied = _plan_applied(new)
        parts = [_frontend_ready(live, error), _experts_ready(new, live, error, services), applied]
        # A refused plan is why nothing (more) starts: Ready names it first, not a part still "progressing".
        ready = c.ready_from([applied, *parts[:2]] if error else parts)
        if ready.status and new is not None and new.unplaced:
            ready = c.Condition(c.READY, True, c.REPLICAS_UNPLACED, f"the model serves, but {parts[1].message}")
        status: dict[str, Any] = {
            "observedGeneration": generation,
            "conditions": c.to_status([ready, *parts], (body.get("status") or {}).get("conditions"),
                                      generation, dt.datetime.fromtimestamp(self.clock(), dt.timezone.utc)),
            "loads": {"frontends": loads.frontends, "tokensPerSecond": round(loads.tokens_per_second, 3)},
        }
        shown = new if error is None else running  # a refused plan runs nowhere: neither its replicas nor its cost
        if deployment is not None and shown is not None:
            status["mode"], status["modeReason"] = shown.mode, shown.mode_reason
            # A merge patch: null removes what an earlier offload plan wrote.
            status["offload"] = {"gpuMemoryBudget": shown.gpu_budget} if shown.gpu_budget is not None else None
            status["plan"] = _plan_status(shown)
            status["cost"] = _cost(deployment.spec, shown, loads)
        elif deployment is not None and error is not None:  # nothing of this deployment runs
            status["plan"] = status["cost"] = None
        self.kube.patch_status(meta["namespace"], meta["name"], status)
        return Outcome(new, changes, status, error, retry, applied, loads, deployment=deployment)


def _plan_applied(new: Plan) -> c.Condition:
    summary = (f"plan version {new.version}: {new.replicas} expert replicas in {len(new.services())} services "
               f"on {len(new.node_names)} nodes")
    if not new.unplaced:
        return c.Condition(c.PLAN_APPLIED, True, c.APPLIED, summary)
    # Applied (every bundle has a replica, the model serves), but the scaler wanted more than fits.
    shown = ", ".join(f"{b} x{n}" for b, n in list(new.unplaced.items())[:5])
    more = f" and {len(new.unplaced) - 5} more bundles" if len(new.unplaced) > 5 else ""
    return c.Condition(c.PLAN_APPLIED, True, c.REPLICAS_UNPLACED,
                       f"{summary}; {sum(new.unplaced.values())} scaled-out replicas fit on no node ({shown}{more}), "
                       "so those experts run with fewer replicas than their load asks for: add GPU nodes, shorten "
                       "spec.experts.scaling.keepAlive, or scale out less (a higher cvThreshold, a lower "
                       "maxReplicasPerExpert or layerMemoryCap)")


def _plan_status(new: Plan) -> dict[str, Any]:
    """status.plan: totals, plus one short entry per MoE layer (58 of them for DeepSeek-V3: ~3 KB)."""
    return {"replicas": new.replicas, "hostedInPlace": sum(map(len, new.hosted.values())),
            "functions": len(new.services()), "bundles": len(new.bundles),
            "nodes": len(new.node_names), "retired": len(new.retired), "unplaced": sum(new.unplaced.values()),
            "cv": new.cv, "cvBefore": max((x.cv_before for x in new.layers), default=0.0), "version": new.version,
            "layers": [{"layer": x.layer, "replicas": x.replicas, "cvBefore": x.cv_before, "cvAfter": x.cv_after}
                       for x in new.layers]}


def _apply_order(obj: Object) -> tuple[int, int]:
    """(group, kind's place): groups are applied one after another, the objects of one group concurrently.
    Accounts first (expert pods run as the frontend's account: they read the routing table), a RoleBinding
    only once its Role exists (the API server resolves the Role to check the binding grants no more than
    the operator holds, and answers NotFound while it is missing), then expert services before the routing
    table that names them, the table last, so frontends switch only to services that exist. Deletions
    (prune) come after everything."""
    kind = (obj["apiVersion"], obj["kind"])
    if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
        group = 1 if obj["kind"] == "RoleBinding" else 0
    else:
        group = 1 + {EXPERT: 1, FRONTEND: 2, ROUTING: 3}.get(obj["metadata"]["labels"].get(COMPONENT), 0)
    return group, KINDS.index(kind)


def _frontend_ready(live: Mapping[ObjectKey, Object], error: c.Condition | None) -> c.Condition:
    deployment = next((o for (v, k, n), o in live.items() if k == "Deployment"
                       and o["metadata"]["labels"].get(COMPONENT) == FRONTEND), None)
    if deployment is None:
        if error is not None:  # nothing was applied, so nothing is being created either
            return c.Condition(c.FRONTEND_READY, False, error.reason,
                               f"no frontend Deployment: the plan was not applied ({error.message})")
        return c.Condition(c.FRONTEND_READY, False, c.PROGRESSING, "the frontend Deployment is being created")
    want = deployment["spec"].get("replicas", 1)
    if want == 0:  # a stop the user asked for: the experts stay, but the model does not serve
        return c.Condition(c.FRONTEND_READY, False, c.SCALED_TO_ZERO,
                           "spec.frontend.replicas is 0: no frontend serves (the expert functions stay); raise it "
                           "to serve again")
    ready = _ready_replicas(deployment)
    if ready >= want:
        return c.Condition(c.FRONTEND_READY, True, c.AS_EXPECTED, f"{ready}/{want} frontend pods ready")
    return c.Condition(c.FRONTEND_READY, False, error.reason if error else c.PROGRESSING,
                       f"{ready}/{want} frontend pods ready (kubectl describe deployment {deployment['metadata']['name']})"
                       + (f"; the plan was not applied: {error.message}" if error else ""))


def planned_functions(new: Plan, objects: Iterable[Mapping[str, Any]]) -> dict[ObjectKey, str]:
    """The objects of the plan's own expert services (not those kept warm) -> their function's name."""
    services = new.services()
    return {key_of(o): function_of(o) for o in objects if service_of(o) in services}


def _experts_ready(new: Plan | None, live: Mapping[ObjectKey, Object], error: c.Condition | None,
                   planned: Mapping[ObjectKey, str] | None = None) -> c.Condition:
    if new is None:
        if error is not None:
            return c.Condition(c.EXPERTS_READY, False, error.reason,
                               f"no expert functions: the plan was refused ({error.message})")
        return c.Condition(c.EXPERTS_READY, None, c.PROGRESSING, "no plan yet")
    if new.mode == "offload":
        return c.Condition(c.EXPERTS_READY, True, c.NOT_NEEDED, "mode offload: the frontend holds every expert")
    # The plan's own services' objects, not those it keeps warm; where not known (a reconcile that failed),
    # those of the cluster that are services of the plan.
    if planned is None:
        planned = planned_functions(new, live.values())
    functions: dict[str, bool] = {}  # a function is ready when each of its planned objects is
    for key, function in planned.items():
        functions[function] = functions.get(function, True) and key in live and is_ready(live[key])
    want = len(new.services())
    ready = sum(functions.values())
    if error is not None:  # the new plan is not (all) in the cluster: what runs is not what was planned
        return c.Condition(c.EXPERTS_READY, False, error.reason,
                           f"{ready}/{want} expert services of the new plan ready; it was not applied: {error.message}")
    if ready < want:
        return c.Condition(c.EXPERTS_READY, False, c.PROGRESSING,
                           f"{ready}/{want} expert services ready (pods starting or loading weights)")
    if new.unplaced:
        return c.Condition(c.EXPERTS_READY, True, c.REPLICAS_UNPLACED,
                           f"{ready}/{want} expert services ready; {sum(new.unplaced.values())} scaled-out replicas "
                           "fit on no GPU (PlanApplied says which and what to change)")
    return c.Condition(c.EXPERTS_READY, True, c.AS_EXPECTED, f"{ready}/{want} expert services ready")


def _ready_replicas(deployment: Mapping[str, Any]) -> int:
    status = deployment.get("status") or {}
    if status.get("observedGeneration", 0) < deployment["metadata"].get("generation", 0):
        return 0  # the controller has not seen the latest spec yet
    return int(status.get("readyReplicas", 0))


def _cost(spec: MoESpec, new: Plan, loads: Loads) -> dict[str, float]:
    # Expert functions: whole GPUs held, shared ones counted once (a GPU is paid for whoever shares it).
    gpus = spec.frontend.replicas * spec.frontend.gpus + new.gpus_held
    usd = gpus * spec.gpu_hour_price
    cost = {"gpuHoursPerHour": float(gpus), "usdPerHour": round(usd, 4)}
    if loads.tokens_per_second > 0:
        cost["usdPerMillionTokens"] = round(usd / (loads.tokens_per_second * 3600 / 1e6), 6)
    return cost
