import pytest
from kubernetes import client

from kubemoe.devcluster import wait_for

pytestmark = pytest.mark.cluster

PAUSE = "registry.k8s.io/pause:3.10"  # never pulled: kwok only pretends to run containers


def _pod_spec(gpus: int, node: str | None = None, tolerations: list | None = None) -> dict:
    spec = {"containers": [{"name": "main", "image": PAUSE,
                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
            "tolerations": tolerations or []}
    if node:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}}}
    return spec


def test_deployment_with_required_node_affinity_runs_on_exactly_that_node(api, namespace):
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    labels = {"app": "pinned"}
    apps.create_namespaced_deployment(namespace, {
        "metadata": {"name": "pinned"},
        "spec": {"replicas": 3, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": _pod_spec(gpus=2, node="kwok-gpu-1")}}})

    def all_running():
        pods = core.list_namespaced_pod(namespace, label_selector="app=pinned").items
        return len(pods) == 3 and all(p.status.phase == "Running" for p in pods) and pods

    pods = wait_for(all_running, 60, "3 pods of deployment pinned to be Running",
                    detail=lambda: str([(p.metadata.name, p.spec.node_name, p.status.phase) for p in
                                        core.list_namespaced_pod(namespace).items]))
    assert {p.spec.node_name for p in pods} == {"kwok-gpu-1"}
    wait_for(lambda: apps.read_namespaced_deployment(namespace=namespace, name="pinned").status.ready_replicas == 3,
             30, "deployment pinned to report 3 ready replicas")


def test_pod_asking_for_more_gpus_than_any_node_has_stays_pending(api, namespace):
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, {"metadata": {"name": "too-big"}, "spec": _pod_spec(gpus=9)})

    def failed_scheduling():
        events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=too-big").items
        return [e for e in events if e.reason == "FailedScheduling"]

    def scheduled_condition():  # the scheduler records the event and the pod's condition in two writes
        conditions = core.read_namespaced_pod("too-big", namespace).status.conditions or []
        return [c for c in conditions if c.type == "PodScheduled"]

    events = wait_for(failed_scheduling, 60, "a FailedScheduling event for pod too-big")
    assert "Insufficient nvidia.com/gpu" in events[0].message
    scheduled = wait_for(scheduled_condition, 30, "the PodScheduled condition of pod too-big")
    assert scheduled[0].status == "False" and scheduled[0].reason == "Unschedulable"
    pod = core.read_namespaced_pod("too-big", namespace)
    assert pod.status.phase == "Pending" and not pod.spec.node_name


def test_tainted_gpu_node_takes_only_pods_that_tolerate_the_taint(api, namespace):
    core = client.CoreV1Api(api)
    toleration = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    core.create_namespaced_pod(namespace, {"metadata": {"name": "tolerates"},
                                           "spec": _pod_spec(1, node="kwok-gpu-2", tolerations=toleration)})
    core.create_namespaced_pod(namespace, {"metadata": {"name": "intolerant"}, "spec": _pod_spec(1, node="kwok-gpu-2")})

    wait_for(lambda: core.read_namespaced_pod("tolerates", namespace).status.phase == "Running", 60,
             "pod tolerates to run on the tainted node kwok-gpu-2")
    events = wait_for(lambda: [e for e in core.list_namespaced_event(
        namespace, field_selector="involvedObject.name=intolerant").items if e.reason == "FailedScheduling"],
        60, "a FailedScheduling event for pod intolerant")
    assert "untolerated taint" in events[0].message
    assert core.read_namespaced_pod("intolerant", namespace).status.phase == "Pending"
