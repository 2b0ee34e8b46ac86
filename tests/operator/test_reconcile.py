"""The Reconciler against an in-memory API (no cluster): status, events and the warm pool's decisions."""

import copy

from kubemoe.operator import conditions as c
from kubemoe.operator import events as ev
from kubemoe.operator.config import OperatorConfig
from kubemoe.operator.plan import Loads
from kubemoe.operator.reconcile import Reconciler
from kubemoe.operator.render import RETIRED_ANNOTATION

NOW = 1_000_000.0
SKEWED = Loads({(0, 0): 800.0, (0, 1): 100.0, (0, 2): 100.0, (0, 3): 100.0}, 50.0, 1)
MOVED = Loads({(0, 0): 100.0, (0, 1): 100.0, (0, 2): 100.0, (0, 3): 800.0}, 50.0, 1)


class MemoryKube:
    """What the Reconciler uses of `Kube`, over a dict: apply, list by labels, delete, status."""

    def __init__(self, nodes):
        self.objects, self.nodes, self.status = {}, nodes, {}

    def list(self, api_version, kind, namespace=None, label_selector=""):
        if kind == "Node":
            return copy.deepcopy(self.nodes)
        wanted = dict(p.split("=") for p in label_selector.split(",") if p)
        return [copy.deepcopy(o) for (v, k, _), o in self.objects.items() if (v, k) == (api_version, kind)
                and wanted.items() <= o["metadata"].get("labels", {}).items()]

    def apply(self, obj):
        self.objects[(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])] = copy.deepcopy(obj)

    def delete(self, api_version, kind, namespace, name):
        self.objects.pop((api_version, kind, name), None)

    def patch_status(self, namespace, name, status):
        self.status = copy.deepcopy(status)

    def request(self, *_):
        return {}


def api_nodes(count, gpus=8):
    return [{"metadata": {"name": f"node-{i}", "labels": {}}, "spec": {},
             "status": {"allocatable": {"nvidia.com/gpu": str(gpus)},
                        "conditions": [{"type": "Ready", "status": "True"}]}} for i in range(count)]


class Clock:
    def __init__(self):
        self.now = NOW

    def __call__(self):
        return self.now


def setup(f, nodes=4, **experts):
    body = f.moed_body(experts={"runtime": "deployment", "bundleBytes": "128Mi",
                                "scaling": {"keepAlive": "10m", "maxReplicasPerExpert": 4}, **experts})
    kube, clock = MemoryKube(api_nodes(nodes)), Clock()
    return body, kube, clock, Reconciler(kube, OperatorConfig(), clock)


def step(body, reconciler, kube, loads):
    """One reconcile, as the handler runs it: events from the status the object had before."""
    outcome = reconciler.reconcile(body, loads)
    found = ev.events(outcome, body.get("status"))
    body["status"] = kube.status
    return outcome, {e.reason: e for e in found}


def services(kube, retired):
    return {o["metadata"]["name"] for (_, k, _), o in kube.objects.items() if k == "Deployment"
            and o["metadata"]["labels"].get("app.kubernetes.io/component") == "expert"
            and (RETIRED_ANNOTATION in o["metadata"]["annotations"]) == retired}


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
