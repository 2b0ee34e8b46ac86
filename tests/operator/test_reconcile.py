"""The Reconciler against an in-memory API (no cluster): status, events and the warm pool's decisions."""

import asyncio
import copy
import json
import threading
import time
from collections import Counter

from kubemoe.operator import conditions as c
from kubemoe.operator import events as ev
from kubemoe.operator.config import OperatorConfig
from kubemoe.operator.kube import ApiError
from kubemoe.operator.plan import Loads, NodeInfo
from kubemoe.operator.pod_security import ENFORCE_LABEL as ENFORCE
from kubemoe.operator.reconcile import Reconciler, Watched
from kubemoe.operator.render import COMPONENT, RETIRED_KEY, function_of, pod_spec_of, service_of
from kubemoe.operator.spec import KIND
from kubemoe.operator.status_follower import StatusFollower

NOW = 1_000_000.0
SKEWED = Loads({(0, 0): 800.0, (0, 1): 100.0, (0, 2): 100.0, (0, 3): 100.0}, 50.0, 1)
MOVED = Loads({(0, 0): 100.0, (0, 1): 100.0, (0, 2): 100.0, (0, 3): 800.0}, 50.0, 1)


class MemoryKube:
    """What the Reconciler uses of `Kube`, over a dict: apply, create, merge patch, list by labels, delete, status."""

    def __init__(self, nodes, namespace_labels=None):
        self.objects, self.nodes, self.status = {}, nodes, {}
        self.namespace_labels, self.namespaces_read = namespace_labels or {}, 0
        self.listed: Counter[str] = Counter()
        self.moed: dict | None = None  # the MoEDeployment as the API serves it (get)

    def get(self, api_version, kind, namespace, name):
        if kind == KIND:
            return copy.deepcopy(self.moed)
        assert (api_version, kind) == ("v1", "Namespace"), kind
        self.namespaces_read += 1
        return {"metadata": {"name": name, "labels": dict(self.namespace_labels)}}

    def list(self, api_version, kind, namespace=None, label_selector=""):
        self.listed[kind] += 1
        if kind == "Node":
            return copy.deepcopy(self.nodes)
        wanted = dict(p.split("=") for p in label_selector.split(",") if p)
        return [copy.deepcopy(o) for (v, k, _), o in self.objects.items() if (v, k) == (api_version, kind)
                and wanted.items() <= o["metadata"].get("labels", {}).items()]

    def apply(self, obj):
        self.objects[(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])] = copy.deepcopy(obj)

    def create(self, obj):
        if (obj["apiVersion"], obj["kind"], obj["metadata"]["name"]) in self.objects:
            raise ApiError(409, f'{obj["kind"]} "{obj["metadata"]["name"]}" already exists')
        self.apply(obj)

    def merge_patch(self, obj, patch):
        meta = self.objects[(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])]["metadata"]
        for field, values in patch["metadata"].items():
            meta[field] = {k: v for k, v in {**meta.get(field, {}), **values}.items() if v is not None}

    def delete(self, api_version, kind, namespace, name):
        self.objects.pop((api_version, kind, name), None)

    def patch_status(self, namespace, name, status):
        self.status = copy.deepcopy(status)

    def request(self, *_):
        return {}


def api_nodes(count, gpus=8, gpu_memory_mib=None, memory="512Gi"):
    """Nodes as the API serves them; with gpu_memory_mib, labelled as GPU feature discovery does."""
    labels = {"nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.memory": str(gpu_memory_mib)} if gpu_memory_mib else {}
    return [{"metadata": {"name": f"node-{i}", "labels": dict(labels)}, "spec": {},
             "status": {"allocatable": {"nvidia.com/gpu": str(gpus), "memory": memory},
                        "conditions": [{"type": "Ready", "status": "True"}]}} for i in range(count)]


class Clock:
    def __init__(self):
        self.now = NOW

    def __call__(self):
        return self.now


def setup(f, nodes=4, **experts):
    body = f.moed_body(experts={"runtime": "pods", "bundleBytes": "128Mi",
                                "scaling": {"keepAlive": "10m", "maxReplicasPerExpert": 4}, **experts})
    kube, clock = MemoryKube(api_nodes(nodes)), Clock()
    return body, kube, clock, Reconciler(kube, OperatorConfig(), clock)


def step(body, reconciler, kube, loads):
    """One reconcile, as the handler runs it: events from the status the object had before."""
    outcome = reconciler.reconcile(body, loads)
    found = ev.events(outcome, body.get("status"))
    body["status"] = kube.status
    return outcome, {e.reason: e for e in found}


def kept_warm(kube):
    """The (bundle, site) services the routing ConfigMap says are kept warm."""
    [table] = [o for (_, k, _), o in kube.objects.items() if k == "ConfigMap" and o["metadata"]["labels"][COMPONENT] == "routing"]
    return {(bundle, site) for bundle, site, _, _ in json.loads(table["data"][RETIRED_KEY])}


def services(kube, retired):
    """The expert functions (their pods' function label) in the API, those kept warm or those of the plan."""
    warm = kept_warm(kube)
    return {function_of(o) for o in expert_pods(kube) if (service_of(o) in warm) == retired}


def expert_pods(kube):
    return [o for (_, k, _), o in kube.objects.items()
            if k == "Pod" and o["metadata"]["labels"].get("app.kubernetes.io/component") == "expert"]


def test_status_and_events_follow_the_warm_pool(f):
    body, kube, clock, reconciler = setup(f)
    outcome, found = step(body, reconciler, kube, SKEWED)
    plan_status = kube.status["plan"]
    assert plan_status["layers"][0] == {"layer": 0, "replicas": 7, "cvBefore": 1.1022, "cvAfter": 0.3149}
    assert plan_status["layers"][1]["replicas"] == 4 and plan_status["unplaced"] == 0
    assert plan_status["cvBefore"] == 1.1022 and plan_status["cv"] == 0.3149
    assert "l0-e0-0 0->4" in found[ev.SCALED_OUT].message and ev.APPLIED in found
    assert not any(e.type == "Warning" for e in found.values())
    hot_services = services(kube, retired=False)

    clock.now += 60  # the load moves: expert 0's extra services retire, kept warm
    _, found = step(body, reconciler, kube, MOVED)
    assert "l0-e0-0 4->1" in found[ev.SCALED_IN].message and "l0-e3-3 1->4" in found[ev.SCALED_OUT].message
    assert found[ev.RETIRED].message.count("l0-e0-0 on") == 3 and kube.status["plan"]["retired"] == 3
    kept = services(kube, retired=True)
    assert len(kept) == 3 and kept <= hot_services

    clock.now += 120  # it comes back within keepAlive: the warm services serve again
    _, found = step(body, reconciler, kube, SKEWED)
    assert found[ev.WARM_REUSED].message.count("l0-e0-0 on") == 3 and kept <= services(kube, retired=False)

    clock.now += 60
    step(body, reconciler, kube, MOVED)
    clock.now += 601  # and leaves for longer than keepAlive: the retired services are deleted
    _, found = step(body, reconciler, kube, MOVED)
    assert found[ev.EXPIRED].message.count("l0-e0-0 on") == 3 and not services(kube, retired=True)
    assert kube.status["plan"]["retired"] == 0


class MeetingKube(MemoryKube):
    """Deletes wait until `meet` are in flight at once: deletes made one after another never get past the first."""

    def __init__(self, nodes, meet: int):
        super().__init__(nodes)
        self.meet = threading.Barrier(meet, timeout=5)

    def delete(self, api_version, kind, namespace, name):
        self.meet.wait()  # BrokenBarrierError after 5 s alone
        super().delete(api_version, kind, namespace, name)


def test_expired_services_are_deleted_concurrently(f):
    """A move at 1000 nodes retires hundreds of functions: deleted one round trip at a time they held the
    deployment's lock (and so its status) for 23 s."""
    body, _, clock, _ = setup(f)
    kube = MeetingKube(api_nodes(4), meet=3)  # the three retired functions' pods
    reconciler = Reconciler(kube, OperatorConfig(), clock)
    step(body, reconciler, kube, SKEWED)
    clock.now += 60
    step(body, reconciler, kube, MOVED)
    retired = [o["metadata"]["name"] for o in expert_pods(kube) if service_of(o) in kept_warm(kube)]
    assert len(retired) == 3
    clock.now += 601  # past keepAlive: all three go in one reconcile
    outcome, found = step(body, reconciler, kube, MOVED)
    assert outcome.error is None and not services(kube, retired=True)
    assert sorted(outcome.changes.deleted) == sorted(f"Pod/{name}" for name in retired)


def test_the_operator_knows_when_a_warm_service_is_past_its_keepalive(f):
    """What the operator's daemon asks every second (handlers.between_ticks): a service kept warm is deleted
    within a second of its keepAlive's end, not at the next loads tick."""
    body, kube, clock, reconciler = setup(f)
    uid = body["metadata"]["uid"]
    assert not reconciler.keep_alive_over(uid)  # no plan applied yet
    step(body, reconciler, kube, SKEWED)
    clock.now += 60
    assert not reconciler.keep_alive_over(uid)  # nothing kept warm
    step(body, reconciler, kube, MOVED)
    assert kept_warm(kube)
    clock.now += 599
    assert not reconciler.keep_alive_over(uid)
    clock.now += 2  # keepAlive (10m) over: the reconcile it triggers deletes the warm services
    assert reconciler.keep_alive_over(uid)
    step(body, reconciler, kube, MOVED)
    assert not kept_warm(kube) and not services(kube, retired=True) and not reconciler.keep_alive_over(uid)


def names(pods):
    return {o["metadata"]["name"] for o in pods}


def test_a_pod_that_ended_is_deleted_and_made_again(f):
    """Runtime pods: what a Deployment's controller did for an evicted pod (or one of a lost node), the
    operator does: delete it, and make it again once its name is free."""
    body, kube, clock, reconciler = setup(f)
    reconciler.reconcile(body, Loads())
    pod = expert_pods(kube)[0]
    name, count = pod["metadata"]["name"], len(expert_pods(kube))
    pod["status"] = {"phase": "Failed", "reason": "Evicted"}
    outcome = reconciler.reconcile(body, Loads())
    assert outcome.error is None and outcome.changes.deleted == [f"Pod/{name}"]
    assert name not in names(expert_pods(kube)) and f"Pod/{name}" not in outcome.changes.applied
    again = reconciler.reconcile(body, Loads())
    assert f"Pod/{name}" in again.changes.applied and len(expert_pods(kube)) == count


def test_a_changed_spec_replaces_the_pods_once_their_successors_are_ready(f):
    """Pods are immutable: a new image makes new pods; the old ones keep serving until those are Ready (a
    Deployment's surge), then the next reconcile deletes them."""
    body, kube, clock, reconciler = setup(f)
    reconciler.reconcile(body, Loads())
    old = names(expert_pods(kube))
    body["spec"]["experts"]["image"] = "kubemoe/expert-fn:new"
    outcome = reconciler.reconcile(body, Loads())
    new = names(expert_pods(kube)) - old
    assert len(new) == len(old) and old <= names(expert_pods(kube)) and not outcome.changes.deleted
    assert reconciler.reconcile(body, Loads()).changes.deleted == []  # still starting: the old ones stay
    for key, o in list(kube.objects.items()):
        if o["metadata"]["name"] in new:
            kube.objects[key] = _ready(o)
    outcome = reconciler.reconcile(body, Loads())
    assert names(expert_pods(kube)) == new and sorted(outcome.changes.deleted) == sorted(f"Pod/{n}" for n in old)


def test_replicas_that_fit_nowhere_are_in_the_status_and_warned_about_once(f):
    body, kube, clock, reconciler = setup(f, nodes=5, gpus=4)  # 4 GPUs a replica: 10 slots for 8 bundles
    outcome, found = step(body, reconciler, kube, Loads({(0, 0): 1000.0, (0, 1): 1.0}, 10.0, 1))
    applied = next(x for x in kube.status["conditions"] if x["type"] == c.PLAN_APPLIED)
    assert (applied["status"], applied["reason"]) == ("True", c.REPLICAS_UNPLACED)
    assert "l0-e0-0 x1" in applied["message"] and "add GPU nodes" in applied["message"]
    assert kube.status["plan"]["unplaced"] == 1
    assert found[c.REPLICAS_UNPLACED].type == "Warning"
    clock.now += 30
    _, found = step(body, reconciler, kube, Loads({(0, 0): 1000.0, (0, 1): 1.0}, 10.0, 1))
    assert c.REPLICAS_UNPLACED not in found  # nothing changed: no second warning


# -- conditions of every failure the operator knows (issue 16 item 7) --------------------------------------

class RefusingKube(MemoryKube):
    """The API server refuses every write (a webhook, a quota): the reconcile's ApplyFailed."""

    def apply(self, obj):
        from kubemoe.operator.kube import ApiError
        raise ApiError(403, f"{obj['kind']} {obj['metadata']['name']} is forbidden: exceeded quota")

    create = apply


class NoKnativeKube(MemoryKube):
    def request(self, *_):
        from kubemoe.operator.kube import ApiError
        raise ApiError(404, "the server could not find the requested resource")


def conditions(kube):
    return {x["type"]: x for x in kube.status["conditions"]}


def failures(f):
    """(reason, body, kube, what the message must tell the user): every way a plan is refused."""
    deployment = {"runtime": "pods", "bundleBytes": "128Mi"}
    no_layout = f.moed_body(experts=deployment)
    del no_layout["spec"]["model"]["layout"]
    return [
        (c.INVALID_SPEC, no_layout, MemoryKube(api_nodes(2)), "spec.model.layout is required"),
        (c.INSUFFICIENT_CAPACITY, f.moed_body(experts=deployment), MemoryKube([]), "no node can run expert functions"),
        (c.INSUFFICIENT_CAPACITY, f.moed_body(experts={**deployment, "gpuSharing": {"mode": "timeSlicing"}}),
         MemoryKube(api_nodes(2)), "advertising nvidia.com/gpu (time-slicing shares"),
        (c.INSUFFICIENT_CAPACITY, f.moed_body(experts={**deployment, "gpus": 8}), MemoryKube(api_nodes(1)),
         "fit on no node"),
        (c.RUNTIME_MISSING, f.moed_body(experts={"runtime": "knative"}), NoKnativeKube(api_nodes(2)),
         "install it (see the chart's README) or set spec.experts.runtime: pods"),
        (c.APPLY_FAILED, f.moed_body(experts=deployment), RefusingKube(api_nodes(2)), "exceeded quota"),
        (c.POD_SECURITY_FORBIDDEN, f.moed_body(experts=deployment, dataPath={"sameNode": "hostShm"}),
         MemoryKube(api_nodes(2), {ENFORCE: "restricted"}),
         f"kubectl label namespace default {ENFORCE}=privileged --overwrite"),
        (c.GPU_BUDGET_TOO_LARGE, f.moed_body(mode="offload", offload={"gpuMemoryBudget": "30Gi"}),
         MemoryKube(api_nodes(1, gpus=1, gpu_memory_mib=24576)), "lower it to 18.00 GiB"),
        (c.INSUFFICIENT_CAPACITY, f.moed_body(mode="auto", experts=deployment),
         MemoryKube(api_nodes(1, gpus=1, gpu_memory_mib=24576, memory="512Mi")),
         "no node with one GPU has the host memory for every expert"),
    ]


def test_a_refused_plan_is_what_ready_frontend_and_experts_report(f):
    for reason, body, kube, fix in failures(f):
        outcome = Reconciler(kube, OperatorConfig(), Clock()).reconcile(body, Loads())
        if reason != c.APPLY_FAILED:
            assert not kube.objects, (reason, "a refused plan creates nothing")
            # ... and the status shows neither its replicas nor its cost: nothing of it runs
            assert kube.status.get("plan") is None and kube.status.get("cost") is None, (reason, kube.status)
        assert [e.message for e in ev.events(outcome, None) if e.type == "Warning" and e.reason == reason] == [
            found_message := conditions(kube)[c.PLAN_APPLIED]["message"]] and fix in found_message, reason
        found = conditions(kube)
        for kind in (c.READY, c.PLAN_APPLIED, c.EXPERTS_READY, c.FRONTEND_READY):
            assert (found[kind]["status"], found[kind]["reason"]) == ("False", reason), (reason, kind, found[kind])
            assert fix in found[kind]["message"], (reason, kind, found[kind]["message"])
        assert "being created" not in found[c.FRONTEND_READY]["message"] and "no plan yet" not in str(found)


def test_a_refused_update_keeps_the_running_plan_and_says_the_new_one_was_refused(f):
    body, kube, clock, reconciler = setup(f, nodes=2)
    step(body, reconciler, kube, Loads())
    for key, o in kube.objects.items():  # every pod ready, as the controllers would report
        kube.objects[key] = _ready(o)
    assert conditions(kube)[c.PLAN_APPLIED]["status"] == "True"
    kube.nodes = []  # every GPU node gone: the next plan is refused
    clock.now += 30
    step(body, reconciler, kube, Loads())
    found = conditions(kube)
    assert (found[c.READY]["status"], found[c.READY]["reason"]) == ("False", c.INSUFFICIENT_CAPACITY)
    experts = found[c.EXPERTS_READY]
    assert (experts["status"], experts["reason"]) == ("False", c.INSUFFICIENT_CAPACITY)
    assert found[c.FRONTEND_READY]["status"] == "True"  # the frontend that runs still serves
    assert services(kube, retired=False), "a refused plan deletes nothing"
    assert kube.status["plan"]["replicas"] == len(services(kube, retired=False))  # what runs, still


def test_a_deployment_scaled_to_zero_frontends_is_not_ready_and_says_how_to_serve_again(f):
    body, kube, clock, reconciler = setup(f, nodes=2)
    body["spec"]["frontend"] = {**body["spec"].get("frontend", {}), "replicas": 0}
    step(body, reconciler, kube, Loads())
    for key, o in kube.objects.items():  # every pod ready, the Deployment at its 0 replicas
        kube.objects[key] = _ready(o)
    step(body, reconciler, kube, Loads())
    found = conditions(kube)
    assert found[c.EXPERTS_READY]["status"] == "True"  # the experts stay
    assert (found[c.FRONTEND_READY]["status"], found[c.FRONTEND_READY]["reason"]) == ("False", c.SCALED_TO_ZERO)
    assert found[c.READY]["status"] == "False" and "replicas is 0" in found[c.READY]["message"]


def test_unplaced_replicas_leave_the_model_ready_and_say_so(f):
    body, kube, clock, reconciler = setup(f, nodes=5, gpus=4)  # 10 slots for 8 bundles and a hot one
    step(body, reconciler, kube, Loads({(0, 0): 1000.0, (0, 1): 1.0}, 10.0, 1))
    for key, o in kube.objects.items():
        kube.objects[key] = _ready(o)
    step(body, reconciler, kube, Loads({(0, 0): 1000.0, (0, 1): 1.0}, 10.0, 1))
    found = conditions(kube)
    for kind in (c.READY, c.EXPERTS_READY, c.PLAN_APPLIED):
        assert (found[kind]["status"], found[kind]["reason"]) == ("True", c.REPLICAS_UNPLACED), found[kind]
    assert "1 scaled-out replicas fit on no GPU" in found[c.READY]["message"]


class Frontends:
    """A LoadSource: what the frontends of a deployment report, or an API error listing their pods."""

    def __init__(self, answers):
        self.answers, self.asked = list(answers), []

    def fetch(self, deployment):
        self.asked.append(deployment)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_the_timer_plans_with_fresh_loads_and_keeps_the_last_ones_when_none_come(f, monkeypatch):
    from kubemoe.operator.kube import ApiError
    from kubemoe.operator.spec import MoESpec

    body, kube, clock, reconciler = setup(f)
    parsed = []
    parse = MoESpec.parse
    monkeypatch.setattr(MoESpec, "parse", classmethod(lambda cls, spec: parsed.append(spec) or parse(spec)))
    source = Frontends([SKEWED, None, ApiError(403, "pods is forbidden")])
    first = reconciler.reconcile(body, None, source=source)
    assert first.loads is SKEWED and first.plan.replicas > 4 and first.loads_error is None
    assert len(parsed) == 1 and source.asked[0].name == "tiny"  # one parse, and the loads asked with it
    silent = reconciler.reconcile(body, first.loads, source=source)  # no frontend answered
    assert silent.loads is SKEWED and silent.plan.replicas == first.plan.replicas
    refused = reconciler.reconcile(body, silent.loads, source=source)
    assert refused.loads is SKEWED and "pods is forbidden" in refused.loads_error
    assert len(parsed) == 3


# -- Pod Security and spec.dataPath.sameNode hostShm ----------------------------------------------------

def test_host_shm_is_applied_where_pod_security_allows_host_paths_and_tcp_never_asks(f):
    host_shm = f.moed_body(experts={"runtime": "pods", "bundleBytes": "128Mi"}, dataPath={"sameNode": "hostShm"})
    for labels in ({}, {ENFORCE: "privileged"}):
        kube = MemoryKube(api_nodes(2), labels)
        outcome = Reconciler(kube, OperatorConfig(), Clock()).reconcile(host_shm, Loads())
        assert outcome.error is None and kube.namespaces_read == 1
        pods = [pod_spec_of(o) for (_, k, _), o in kube.objects.items() if k in ("Deployment", "Pod")]
        assert len(pods) == 1 + 8 and all(any(v["name"] == "node-shm" for v in pod["volumes"]) for pod in pods)
    kube = MemoryKube(api_nodes(2), {ENFORCE: "restricted"})  # tcp renders no hostPath: nothing to ask
    outcome = Reconciler(kube, OperatorConfig(), Clock()).reconcile(f.moed_body(experts={"runtime": "pods"}),
                                                                     Loads())
    assert outcome.error is None and kube.namespaces_read == 0 and kube.objects


def test_labelling_the_namespace_privileged_lets_the_refused_plan_through(f):
    body = f.moed_body(experts={"runtime": "pods", "bundleBytes": "128Mi"}, dataPath={"sameNode": "hostShm"})
    kube, clock = MemoryKube(api_nodes(2), {ENFORCE: "baseline"}), Clock()
    reconciler = Reconciler(kube, OperatorConfig(), clock)
    refused = reconciler.reconcile(body, Loads())
    assert refused.error.reason == c.POD_SECURITY_FORBIDDEN and refused.retry  # the timer tries again
    assert "level 'baseline'" in refused.error.message and "set sameNode: tcp" in refused.error.message
    kube.namespace_labels[ENFORCE] = "privileged"
    clock.now += 30
    assert reconciler.reconcile(body, Loads()).error is None and kube.objects


def test_the_mode_auto_chose_is_in_the_status_and_an_event_when_it_changes(f):
    # 4 bundles of a whole GPU each, one node of one 24 GiB GPU: offload, 3/4 of the GPU for experts.
    body = f.moed_body(mode="auto", experts={"runtime": "pods", "bundleBytes": "256Mi"})
    kube, clock = MemoryKube(api_nodes(1, gpus=1, gpu_memory_mib=24576)), Clock()
    reconciler = Reconciler(kube, OperatorConfig(), clock)
    _, found = step(body, reconciler, kube, Loads())
    assert kube.status["mode"] == "offload" and kube.status["offload"] == {"gpuMemoryBudget": 18 * 2**30}
    assert "every eligible node has one GPU, too few or too small" in kube.status["modeReason"]
    assert found[ev.MODE_CHOSEN].message == f"mode offload: {kube.status['modeReason']}"
    asked = []  # an offload plan has no replicas to add: the check between re-plans asks no frontend
    assert reconciler.short_of_replicas(body["metadata"]["uid"], type("Source", (), {"fetch": asked.append})) is None
    assert asked == []
    clock.now += 30
    _, found = step(body, reconciler, kube, Loads())
    assert ev.MODE_CHOSEN not in found  # told once, not every timer tick

    kube.nodes = api_nodes(2, gpus=8, gpu_memory_mib=81920)  # multi-GPU nodes join: expert functions
    clock.now += 30
    _, found = step(body, reconciler, kube, Loads())
    assert kube.status["mode"] == "distributed" and kube.status["offload"] is None
    assert found[ev.MODE_CHOSEN].message == "mode distributed: mode auto: node node-1 has 8 GPUs for expert functions"


# -- watched nodes and pods, status following the children ---------------------------------------------

def _ready(workload):
    """A pod as the kubelet reports it once Ready; a Deployment as kube-controller-manager does once its pods
    are; anything else as it is."""
    ready = copy.deepcopy(workload)
    if workload["kind"] == "Pod":
        ready["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    elif workload["kind"] == "Deployment":
        ready["metadata"]["generation"] = 1
        ready["status"] = {"observedGeneration": 1, "readyReplicas": ready["spec"].get("replicas", 1)}
    return ready


def workloads_of(kube):
    """The frontend's Deployment and the expert functions' pods."""
    return [o for (_, k, _), o in kube.objects.items() if k in ("Deployment", "Pod")]


def test_watched_nodes_and_pods_are_planned_on_without_listing_the_cluster(f):
    body, kube, clock, reconciler = setup(f)
    listed = reconciler.reconcile(body, SKEWED)
    assert kube.listed["Node"] == 1 and kube.listed["Pod"] == 2  # the cluster's, and the deployment's own
    kube.listed.clear()
    # The watch holds every pod of the cluster: the deployment's own too, which it therefore does not list
    watched = Watched([NodeInfo.from_node(n) for n in api_nodes(4)], expert_pods(kube))
    again = reconciler.reconcile(body, SKEWED, watched=watched)
    assert kube.listed["Node"] == 0 and kube.listed["Pod"] == 0
    assert again.plan.nodes == listed.plan.nodes and not again.changes.applied
    # A watch of some namespaces only (pods None): pods are listed, capacity counts every namespace's.
    reconciler.reconcile(body, SKEWED, watched=Watched(watched.nodes, None))
    assert kube.listed["Node"] == 0 and kube.listed["Pod"] == 2


def test_a_watch_that_has_not_shown_the_pods_yet_neither_moves_them_nor_fails(f):
    """Right after a reconcile made the pods, the watch may not list them yet: the next plan is the one
    applied (not one re-placing what it does not see), the pods it made are not sent again, and pods made
    by another (409) are no failure."""
    body, kube, clock, reconciler = setup(f)
    first = reconciler.reconcile(body, SKEWED)
    made = names(expert_pods(kube))
    sent, create = [], kube.create
    kube.create = lambda obj: sent.append(obj["metadata"]["name"]) or create(obj)
    clock.now += 5
    lagging = Watched([NodeInfo.from_node(n) for n in api_nodes(4)], [])  # no pod of it seen yet
    again = reconciler.reconcile(body, SKEWED, watched=lagging)
    assert again.error is None and again.plan.version == first.plan.version and again.plan.nodes == first.plan.nodes
    assert names(expert_pods(kube)) == made and kube.status["plan"]["version"] == first.plan.version
    assert not sent  # expected: made by this process, not yet watched
    # Another operator's (or a restarted one's) reconcile knows of none of them: 409s, and no failure.
    other = Reconciler(kube, OperatorConfig(), clock)
    assert other.reconcile(body, SKEWED, watched=lagging).error is None and len(sent) == len(made)


def test_status_follows_the_children_without_planning_or_applying(f):
    body, kube, clock, reconciler = setup(f)
    outcome = reconciler.reconcile(body, SKEWED)
    assert conditions(kube)[c.READY]["status"] == "False"  # nothing Ready yet
    kube.moed = {**body, "status": kube.status}
    workloads = workloads_of(kube)
    applied, listed = dict(kube.objects), sum(kube.listed.values())
    functions = sorted({function_of(w) for w in workloads if w["kind"] == "Pod"})
    half = [_ready(w) if w["kind"] == "Deployment" or functions.index(function_of(w)) % 2 else w for w in workloads]
    reconciler.refresh_status("uid-1", lambda: half)
    assert conditions(kube)[c.READY]["status"] == "False"
    experts = len(functions) // 2  # every pod of every other function Ready
    assert 0 < experts and conditions(kube)[c.EXPERTS_READY]["message"].startswith(f"{experts}/")
    refreshed = reconciler.refresh_status("uid-1", lambda: [_ready(w) for w in workloads])
    assert conditions(kube)[c.READY]["status"] == "True" and refreshed.plan is outcome.plan
    assert kube.objects == applied and sum(kube.listed.values()) == listed  # no apply, no list
    # Another MoEDeployment's children count for nothing; a spec change waits for its reconcile.
    assert reconciler.refresh_status("uid-2", lambda: workloads) is None
    kube.moed["metadata"] = {**kube.moed["metadata"], "generation": 2}
    assert reconciler.refresh_status("uid-1", lambda: workloads) is None
    assert conditions(kube)[c.READY]["status"] == "True"


async def test_a_burst_of_child_changes_refreshes_the_owner_once():
    refreshed = []
    follower = StatusFollower(delay_s=0.05)
    for i in range(100):  # hundreds of Deployments turning Ready at once
        follower.changed("uid-1", lambda i=i: refreshed.append(("uid-1", i)))
    follower.changed("uid-2", lambda: refreshed.append(("uid-2", 0)))
    await asyncio.sleep(0.2)
    assert sorted(refreshed) == [("uid-1", 99), ("uid-2", 0)]  # once each, with the latest change's refresh
    follower.changed("uid-1", lambda: refreshed.append(("uid-1", 100)))  # a change after it ran: again
    await asyncio.sleep(0.2)
    assert refreshed[-1] == ("uid-1", 100) and len(refreshed) == 3


async def test_one_refresh_of_an_owner_at_a_time_and_one_more_for_changes_while_it_ran():
    running, ran, started = [], [], asyncio.Event()

    def refresh(i):
        running.append(i)
        assert len(running) == 1, "two refreshes of one owner at once"
        time.sleep(0.1)
        running.remove(i)
        ran.append(i)

    follower = StatusFollower(delay_s=0.02)
    follower.changed("uid-1", lambda: (started.set(), refresh(0)))
    await asyncio.wait_for(started.wait(), 1)
    for i in range(1, 50):  # changes while it runs: one refresh after it, with the latest
        follower.changed("uid-1", lambda i=i: refresh(i))
    await asyncio.sleep(0.4)
    assert ran == [0, 49]


class GatedKube(MemoryKube):
    """Deletes wait for a gate: a reconcile's prune takes as long as the test wants."""

    def __init__(self, nodes):
        super().__init__(nodes)
        self.gate, self.deleting = threading.Event(), threading.Event()

    def delete(self, api_version, kind, namespace, name):
        self.deleting.set()
        assert self.gate.wait(5)
        super().delete(api_version, kind, namespace, name)


def test_the_status_follows_the_pods_while_a_reconcile_deletes_what_left_the_plan(f):
    body, _, clock, _ = setup(f, scaling={"keepAlive": "1s", "maxReplicasPerExpert": 4})
    kube = GatedKube(api_nodes(4))
    reconciler = Reconciler(kube, OperatorConfig(), clock)
    reconciler.reconcile(body, SKEWED)
    kube.moed = {**body, "status": kube.status}
    clock.now += 60
    reconciler.reconcile(body, MOVED)  # retires the hot expert's extra services, kept warm for 1 s
    assert kube.status["plan"]["retired"] == 3
    gone_functions = services(kube, retired=True)
    clock.now += 60
    pruning = threading.Thread(target=reconciler.reconcile, args=(body, MOVED))  # expires them: deletes
    pruning.start()
    try:
        assert kube.deleting.wait(5)
        # The plan without them is published before the prune; refreshes are not held up by it.
        assert kube.status["plan"]["retired"] == 0
        workloads = [o for o in workloads_of(kube) if service_of(o) not in kept_warm(kube)]
        done = []
        refresher = threading.Thread(target=lambda: done.append(reconciler.refresh_status(
            "uid-1", lambda: [_ready(w) for w in workloads_of(kube)])))
        refresher.start()
        refresher.join(2)
        assert done and done[0] is not None and conditions(kube)[c.READY]["status"] == "True"
        # The plan's functions: not those being deleted (kept warm until now, out of the table)
        planned = {function_of(w) for w in workloads if w["metadata"]["labels"][COMPONENT] == "expert"} - gone_functions
        assert conditions(kube)[c.EXPERTS_READY]["message"].startswith(f"{len(planned)}/{kube.status['plan']['functions']} ")
    finally:
        kube.gate.set()
        pruning.join(5)
    assert not services(kube, retired=True)


def test_experts_ready_counts_the_plans_services_only(f):
    body, kube, clock, reconciler = setup(f)
    reconciler.reconcile(body, SKEWED)
    kube.moed = {**body, "status": kube.status}
    workloads = [_ready(o) for o in workloads_of(kube)]
    expert = next(w for w in workloads if w["metadata"]["labels"][COMPONENT] == "expert")
    # A ready expert pod the plan does not hold (a spec before's, not yet deleted) is no readiness of it.
    stranger = copy.deepcopy(expert)
    stranger["metadata"]["name"] += "-old"
    reconciler.refresh_status("uid-1", lambda: [w for w in workloads if w is not expert] + [stranger])
    want = conditions(kube)[c.EXPERTS_READY]["message"].split()[0].split("/")[1]
    assert conditions(kube)[c.EXPERTS_READY]["message"].startswith(f"{int(want) - 1}/{want} ")
    assert conditions(kube)[c.READY]["status"] == "False"


class ResolvingKube(MemoryKube):
    """A RoleBinding is refused while its Role is missing, as the API server's escalation check does; a Role
    takes a moment to store, so a binding sent beside it finds none."""

    def apply(self, obj):
        if obj["kind"] == "Role":
            time.sleep(0.05)
        if obj["kind"] == "RoleBinding" and ("rbac.authorization.k8s.io/v1", "Role", obj["roleRef"]["name"]) not in self.objects:
            raise ApiError(404, f'rolebindings.rbac.authorization.k8s.io "{obj["metadata"]["name"]}" not found')
        super().apply(obj)


def test_a_role_binding_is_applied_only_once_its_role_exists(f):
    body, _, clock, _ = setup(f)
    kube = ResolvingKube(api_nodes(4))
    step(body, Reconciler(kube, OperatorConfig(), clock), kube, Loads())
    applied = next(x for x in kube.status["conditions"] if x["type"] == c.PLAN_APPLIED)
    assert applied["status"] == "True", applied
    assert {"Role", "RoleBinding"} <= {k for (_, k, _) in kube.objects}
