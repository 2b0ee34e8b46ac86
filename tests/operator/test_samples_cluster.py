"""Every sample in manifests/samples/ served on a modest cluster: fake nodes of 4 x 80 GB GPUs shared the way
NVIDIA's components share them (device-plugin time-slicing and MPS with nvidia.com/gpu.shared, the DRA
driver's ResourceSlices), the chart installed, the real operator, the real scheduler and kwok's pods.

A control plane of its own (the session's nodes do not share GPUs): one node per sharing mechanism, plus
one whose whole GPUs take the frontends. Two things differ from the samples as shipped, because the test
control plane cannot provide them: the checkpoint is a host path (a PVC `models` does not exist here and
the scheduler would hold every pod), and runtime knative becomes pods (no Knative controller runs
here to make a Knative Service Ready); the Knative rendering is tested in test_knative.py and
test_operator_cluster.py.
"""

from __future__ import annotations

import copy
import signal

import pytest
from kubernetes import client

from kubemoe.devcluster import Cluster, ClusterConfig, GpuSharing

pytestmark = pytest.mark.cluster

MOED = dict(group="kubemoe.io", version="v1alpha1", plural="moedeployments")
# One sample per sharing mechanism in the default suite (about 30 s each); the other time-sliced ones,
# which add no mechanism, run with -m slow.
SAMPLES = ["mixtral-8x7b", "qwen3-30b-a3b", "llama-4-scout",
           *(pytest.param(name, marks=pytest.mark.slow) for name in ("phi-3.5-moe", "deepseek-v2-lite",
                                                                    "moonlight-16b-a3b"))]
# The node each sample's experts must land on: what its gpuSharing asks the cluster for.
POOLS = {"timeSlicing": "kwok-gpu-0", "mps": "kwok-gpu-1", "dra": "kwok-gpu-2"}
FRONTENDS = "kwok-gpu-3"
GPUS = 4  # per node: every sample fits one node of 4 x 80 GB


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory, f):
    with Cluster(ClusterConfig(nodes=0)) as running:
        for sharing in (GpuSharing("time-slicing", replicas=48, rename=True), GpuSharing("mps", replicas=32, rename=True),
                        GpuSharing("dra"), GpuSharing()):
            running.add_gpu_nodes(1, GPUS, sharing=sharing)
        f.install_chart(running)
        operator = f.start_operator(running, tmp_path_factory.mktemp("shared-operator"))
        try:
            yield running, operator
        finally:
            operator.kill(signal.SIGTERM)


def as_tested(f, name: str) -> dict:
    body = copy.deepcopy(f.sample(name))
    body["spec"]["model"]["uri"] = f"hostpath:///models/{name}"
    body["spec"]["experts"]["runtime"] = "pods"
    return body


def test_fake_nodes_advertise_what_the_nvidia_components_advertise(shared_cluster):
    cluster, _ = shared_cluster
    api = cluster.api_client()
    nodes = {n.metadata.name: n for n in client.CoreV1Api(api).list_node().items}
    sliced, mps, dra, whole = (nodes[f"kwok-gpu-{i}"] for i in range(4))
    assert sliced.status.allocatable["nvidia.com/gpu.shared"] == str(GPUS * 48)
    assert "nvidia.com/gpu" not in sliced.status.allocatable  # renameByDefault: whole GPUs are not offered
    assert {k: sliced.metadata.labels[k] for k in ("nvidia.com/gpu.replicas", "nvidia.com/gpu.sharing-strategy",
                                                    "nvidia.com/gpu.count", "nvidia.com/gpu.product")} == {
        "nvidia.com/gpu.replicas": "48", "nvidia.com/gpu.sharing-strategy": "time-slicing",
        "nvidia.com/gpu.count": "4", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED"}
    assert mps.metadata.labels["nvidia.com/gpu.sharing-strategy"] == "mps"
    assert mps.status.allocatable["nvidia.com/gpu.shared"] == str(GPUS * 32)
    assert whole.status.allocatable["nvidia.com/gpu"] == str(GPUS)
    assert "nvidia.com/gpu" not in dra.status.allocatable
    slices = client.CustomObjectsApi(api).list_cluster_custom_object("resource.k8s.io", "v1", "resourceslices")
    [dra_slice] = slices["items"]
    assert dra_slice["spec"]["nodeName"] == dra.metadata.name and len(dra_slice["spec"]["devices"]) == GPUS


@pytest.mark.parametrize("name", SAMPLES)
def test_every_sample_becomes_ready_on_one_node_of_four_shared_gpus(shared_cluster, f, name):
    cluster, operator = shared_cluster
    api = cluster.api_client()
    core, objects = client.CoreV1Api(api), client.CustomObjectsApi(api)
    body = as_tested(f, name)
    mode = body["spec"]["experts"]["gpuSharing"]["mode"]
    namespace = f"s-{name.replace('.', '-')}"
    core.create_namespace({"metadata": {"name": namespace}})
    f.wait(lambda: core.read_namespaced_service_account("default", namespace), 30, "the default service account")
    try:
        objects.create_namespaced_custom_object(namespace=namespace, body=body, **MOED)
        ready = f.wait(lambda: f.condition(moed := objects.get_namespaced_custom_object(
            namespace=namespace, name=name, **MOED), "Ready").get("status") == "True" and moed,
            150, f"{name} Ready", operator)
        plan = ready["status"]["plan"]
        assert plan["unplaced"] == 0 and plan["replicas"] == plan["functions"] and plan["nodes"] == 1
        assert ready["status"]["cost"]["gpuHoursPerHour"] <= 2 + GPUS  # two frontends' GPUs + the pool's
        pods = core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/component=expert").items
        assert len(pods) == plan["replicas"] and {p.spec.node_name for p in pods} == {POOLS[mode]}
        assert all(p.status.phase == "Running" for p in pods)
        frontends = core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/component=frontend").items
        assert {p.spec.node_name for p in frontends} == {FRONTENDS}
        if mode == "dra":  # the scheduler allocated each planned GPU's claim to a device of the planned node
            claims = objects.list_namespaced_custom_object("resource.k8s.io", "v1", namespace, "resourceclaims")["items"]
            devices = {c["status"]["allocation"]["devices"]["results"][0]["device"] for c in claims}
            assert len(devices) == len(claims) <= GPUS
            assert sum(len(c["status"]["reservedFor"]) for c in claims) == len(pods)
        else:
            assert all(p.spec.containers[0].resources.limits == {"nvidia.com/gpu.shared": "1"} for p in pods)
    finally:
        core.delete_namespace(namespace)
        # The next sample plans the same nodes as empty: wait until this one's pods are gone.
        f.wait(lambda: not core.list_namespaced_pod(namespace).items, 120, f"{namespace}'s pods deleted")


def test_a_sample_without_gpu_sharing_is_refused_and_every_condition_says_why(shared_cluster, f):
    cluster, operator = shared_cluster
    api = cluster.api_client()
    core, objects = client.CoreV1Api(api), client.CustomObjectsApi(api)
    body = as_tested(f, "mixtral-8x7b")
    body["spec"]["experts"]["gpuSharing"] = {"mode": "exclusive"}  # 64 functions of a whole GPU each
    core.create_namespace({"metadata": {"name": "unshared"}})
    try:
        objects.create_namespaced_custom_object(namespace="unshared", body=body, **MOED)
        moed = f.wait(lambda: f.condition(m := objects.get_namespaced_custom_object(
            namespace="unshared", name="mixtral-8x7b", **MOED), "PlanApplied") and m, 60, "PlanApplied", operator)
        for kind in ("Ready", "PlanApplied", "ExpertsReady", "FrontendReady"):
            found = f.condition(moed, kind)
            assert (found["status"], found["reason"]) == ("False", "InsufficientCapacity"), found
            assert "share GPUs (spec.experts.gpuSharing)" in found["message"], found
        assert not core.list_namespaced_pod("unshared").items  # nothing applied, nothing pending
    finally:
        core.delete_namespace("unshared")
