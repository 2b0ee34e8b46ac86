"""Plans fill only what other pods leave (operator/capacity.py): frontends on the experts' nodes, a second
MoEDeployment on the first one's GPUs. The other pods are what the operator renders for a first
MoEDeployment, bound to the nodes it planned, so the annotations both sides read are the rendered ones."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubemoe.devcluster import GpuSharing, gpu_node, gpu_resource_slice
from kubemoe.operator.capacity import occupancy, pod_requests, reserve_frontends, with_taken
from kubemoe.operator.config import OperatorConfig
from kubemoe.operator.plan import (GPU, Loads, NodeInfo, PlanError, Taken, function_bytes, node_of, plan,
                                   with_dra_devices)
from kubemoe.operator.render import FUNCTION_MEMORY_ANNOTATION, render
from kubemoe.operator.spec import MoEDeployment

NOW = 1_000_000.0
H100 = ("NVIDIA-H100-80GB-HBM3", 81559)
MODES = {"exclusive": GpuSharing(), "timeSlicing": GpuSharing("time-slicing", replicas=8, rename=True),
         "mps": GpuSharing("mps", replicas=8, rename=True), "dra": GpuSharing("dra")}


def nodes(count: int, gpus: int, sharing: GpuSharing, memory_mib: int = H100[1], pods: int = 110) -> list[NodeInfo]:
    made, slices = [], []
    for i in range(count):
        node = gpu_node(f"gpu-{i}", gpus, H100[0], memory_mib, sharing=sharing)
        node["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
        node["status"]["allocatable"]["pods"] = str(pods)
        made.append(NodeInfo.from_node(node))
        if sharing.strategy == "dra":
            slices.append(gpu_resource_slice(f"gpu-{i}", gpus, H100[0], memory_mib))
    return with_dra_devices(made, slices)


def deployment(f, name: str, mode: str, layers: int = 2, experts: int = 4, expert_mib: int = 256,
               frontends: int = 1, frontend_gpus: int = 0, max_replicas: int = 4) -> MoEDeployment:
    sharing = {"mode": mode, "functionOverhead": "512Mi"} if mode != "exclusive" else {"mode": "exclusive"}
    if mode in ("timeSlicing", "mps"):
        sharing["resourceName"] = "nvidia.com/gpu.shared"
    body = f.moed_body(name=name, namespace="ns", uid=f"uid-{name}",
                       model={"uri": "pvc://m/x", "layout": {"moeLayers": list(range(layers)), "expertsPerLayer": experts,
                                                             "expertBytes": f"{expert_mib}Mi"}},
                       frontend={"replicas": frontends, "gpus": frontend_gpus},
                       experts={"runtime": "pods", "bundleBytes": f"{expert_mib}Mi", "gpuSharing": sharing,
                                "scaling": {"maxReplicasPerExpert": max_replicas}})
    return MoEDeployment.from_body(body)


def skewed(d: MoEDeployment, factor: float = 50.0) -> Loads:
    layout = d.spec.layout
    return Loads({(layer, e): factor if e == 0 else 1.0 for layer in layout.moe_layers
                  for e in range(layout.experts_per_layer)}, 100.0, 1)


def pods_of(d: MoEDeployment, p, frontend_nodes: list[str] = ()) -> list[dict]:
    """The pods the operator renders (expert functions, bound where they were planned) and its frontend
    Deployment makes (bound to `frontend_nodes`, in turn; Pending without)."""
    made = []
    for obj in render(d, p, OperatorConfig()):
        if obj["kind"] == "Pod":
            node = obj["metadata"]["annotations"]["kubemoe.io/node"]
            made.append({"metadata": obj["metadata"], "spec": {**obj["spec"], "nodeName": node},
                         "status": {"phase": "Running"}})
        if obj["kind"] != "Deployment":
            continue
        template = obj["spec"]["template"]
        annotations = obj["metadata"].get("annotations") or {}
        for i in range(obj["spec"]["replicas"]):
            node = annotations.get("kubemoe.io/node") or (frontend_nodes[i] if i < len(frontend_nodes) else None)
            made.append({"metadata": {"namespace": d.namespace, "labels": template["metadata"]["labels"],
                                      "annotations": template["metadata"].get("annotations", {})},
                         "spec": {**template["spec"], **({"nodeName": node} if node else {})},
                         "status": {"phase": "Running" if node else "Pending"}})
    return made


# -- reading pods ----------------------------------------------------------------------------------------

def test_a_pods_request_is_what_the_scheduler_sums():
    pod = {"spec": {"containers": [{"resources": {"limits": {GPU: "2", "cpu": "1"}}},
                                   {"resources": {"requests": {GPU: "1"}, "limits": {GPU: "1"}}}],
                    "initContainers": [{"resources": {"limits": {GPU: "4"}}}, {"resources": {"limits": {GPU: "1"}}}],
                    "overhead": {"example.com/x": "1"}}}
    assert pod_requests(pod) == {GPU: 4, "example.com/x": 1}  # cpu is not an extended resource
    assert pod_requests({"spec": {}}) == {}


def test_occupancy_counts_others_and_leaves_our_experts_to_the_plan(f):
    ours, other = deployment(f, "a", "timeSlicing", frontends=1, frontend_gpus=1), deployment(f, "b", "timeSlicing")
    cluster = nodes(2, 4, MODES["timeSlicing"])
    p_ours, p_other = plan(ours.spec, Loads(), cluster, None, NOW), plan(other.spec, Loads(), cluster, None, NOW)
    pods = [*pods_of(ours, p_ours, ["gpu-1"]), *pods_of(other, p_other)]
    pods[-1]["spec"].pop("nodeName")  # Pending: still counted where its plan put it
    pods.append({"metadata": {"namespace": "x"}, "spec": {"containers": [{"resources": {"limits": {GPU: "1"}}}]},
                 "status": {"phase": "Pending"}})  # nobody placed it: the scheduler does not count it either
    pods.append({"metadata": {"namespace": "x"}, "spec": {"nodeName": "gpu-0", "containers": [
        {"resources": {"limits": {"nvidia.com/gpu.shared": "3"}}}]}, "status": {"phase": "Succeeded"}})
    seen = occupancy(pods, "ns", "a")
    assert seen.frontends_bound == 1
    functions = Counter(node_of(site) for sites in p_other.nodes.values() for site in sites)
    for node in ("gpu-0", "gpu-1"):
        taken = seen.taken.get(node)
        expected = functions[node] + (node == "gpu-1")  # b's functions, and a's frontend on gpu-1
        assert taken.pods == expected
        assert taken.resources.get("nvidia.com/gpu.shared", 0) == functions[node]
        assert taken.resources.get(GPU, 0) == (node == "gpu-1")
        assert [b for _, b in taken.functions] == [function_bytes(other.spec, other.spec.bundles()[0])] * functions[node]


def test_frontends_not_yet_on_a_node_are_reserved_where_the_scheduler_puts_them(f):
    d = deployment(f, "a", "exclusive", frontends=3, frontend_gpus=2)
    cluster = nodes(3, 8, MODES["exclusive"])
    held = reserve_frontends(d.spec, cluster, frontends_bound=1)  # one is on a node already: two to come
    assert [n.taken.resources.get(GPU, 0) for n in held] == [0, 2, 2]  # the most free GPUs first (ties: by name)
    assert reserve_frontends(d.spec, cluster, frontends_bound=3) == cluster


# -- planning with what others hold --------------------------------------------------------------------

def test_frontend_gpus_on_the_experts_nodes_are_left_to_the_frontends(f):
    """The 100-node run's flaw: experts planned onto every GPU, frontends on the same nodes -> Pending pods."""
    d = deployment(f, "a", "exclusive", layers=1, experts=4, frontends=2, frontend_gpus=1)
    cluster = nodes(2, 4, MODES["exclusive"])  # 8 GPUs: 4 bundles scaled out to 7 replicas would leave one
    first = plan(d.spec, Loads(), with_taken(d.spec, cluster, [], "ns", "a"), None, NOW)
    per_node = Counter(node_of(site) for sites in first.nodes.values() for site in sites)
    assert sum(per_node.values()) == len(d.spec.bundles()) == 4
    scaled = plan(d.spec, skewed(d), with_taken(d.spec, cluster, [], "ns", "a"), first, NOW + 10)
    reserved = {n.name: n.taken.resources.get(GPU, 0) for n in with_taken(d.spec, cluster, [], "ns", "a")}
    per_node = Counter(node_of(site) for sites in scaled.nodes.values() for site in sites)
    for (_, node), retired in scaled.retired.items():  # kept warm: they hold their GPUs too
        per_node[node] += retired.replicas
    assert sum(reserved.values()) == 2 and scaled.unplaced  # the scaler wanted more than the 6 GPUs left
    assert all(per_node[n] + reserved[n] <= 4 for n in reserved), (per_node, reserved)
    # Once bound, the frontends count where they are (both on gpu-0), not where they were expected.
    bound = with_taken(d.spec, cluster, pods_of(d, scaled, ["gpu-0", "gpu-0"]), "ns", "a")
    assert [n.taken.resources.get(GPU, 0) for n in bound] == [2, 0]


def test_a_second_deployment_gets_what_the_first_left_or_a_clear_refusal(f):
    cluster = nodes(1, 2, MODES["timeSlicing"], memory_mib=4 * 1024)  # 2 GPUs of 4 GiB: 10 functions of 768 MiB
    first = deployment(f, "a", "timeSlicing", layers=1, experts=8)
    p_first = plan(first.spec, skewed(first), with_taken(first.spec, cluster, [], "ns", "a"), None, NOW)
    assert p_first.replicas == 10 and p_first.unplaced  # 8 experts, scaled out into every slot there is
    second = deployment(f, "b", "timeSlicing", layers=1, experts=2)
    with pytest.raises(PlanError) as refused:
        plan(second.spec, Loads(), with_taken(second.spec, cluster, pods_of(first, p_first), "ns", "b"), None, NOW)
    assert refused.value.reason == "InsufficientCapacity"
    assert "other pods hold 7.50 GiB of their memory and 10 of 16 nvidia.com/gpu.shared shares" in str(refused.value)
    # Unscaled, the first leaves two slots: the second gets exactly those, and says what else it wanted.
    p_small = plan(first.spec, Loads(), with_taken(first.spec, cluster, [], "ns", "a"), None, NOW)
    p_second = plan(second.spec, skewed(second), with_taken(second.spec, cluster, pods_of(first, p_small), "ns", "b"),
                    None, NOW)
    assert p_small.replicas == 8 and p_second.replicas == 2 and sum(p_second.unplaced.values()) > 0
    # Without reading the pods, the second would have planned the first one's GPUs as empty.
    assert plan(second.spec, skewed(second), cluster, None, NOW).replicas > 2


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(sorted(MODES)), node_count=st.integers(1, 3), gpus=st.integers(1, 4),
       memory_gib=st.integers(4, 24), experts=st.integers(2, 6), expert_mib=st.integers(100, 900),
       skew=st.floats(1.0, 100.0), frontend_gpus=st.integers(0, 2), pods_per_node=st.integers(4, 40))
def test_two_deployments_never_fill_a_gpu_beyond_its_memory_shares_or_pods(
        f, mode, node_count, gpus, memory_gib, experts, expert_mib, skew, frontend_gpus, pods_per_node):
    cluster = nodes(node_count, gpus, MODES[mode], memory_mib=memory_gib * 1024, pods=pods_per_node)
    frontends = 2 if mode == "exclusive" else 0  # whole GPUs: on the experts' nodes only without sharing
    plans = []
    pods: list[dict] = []
    for name in ("a", "b"):
        d = deployment(f, name, mode, experts=experts, expert_mib=expert_mib, frontends=frontends,
                       frontend_gpus=frontend_gpus)
        seen = occupancy(pods, "ns", name)
        held = [dataclasses.replace(n, taken=seen.taken.get(n.name, Taken())) for n in cluster]
        with_frontends = reserve_frontends(d.spec, held, seen.frontends_bound)
        try:
            p = plan(d.spec, skewed(d, skew), with_frontends, None, NOW)
        except PlanError as refused:
            assert refused.reason == "InsufficientCapacity"
            continue
        # Its frontends go where they were reserved, as the scheduler would put them.
        reserved = [a.name for a, b in zip(with_frontends, held) for _ in range(
            (a.taken.resources.get(GPU, 0) - b.taken.resources.get(GPU, 0)) // max(frontend_gpus, 1))]
        pods += pods_of(d, p, reserved)
        plans.append(p)
    by_name = {n.name: n for n in cluster}
    memory, shares, whole, count = Counter(), Counter(), Counter(), Counter()
    for pod in pods:
        site = pod["spec"].get("nodeName")
        if not site:
            continue
        annotations = pod["metadata"]["annotations"]
        if FUNCTION_MEMORY_ANNOTATION in annotations:
            gpu = annotations.get("kubemoe.io/gpu")
            memory[f"{site}/{gpu}" if gpu else site] += int(annotations[FUNCTION_MEMORY_ANNOTATION])
        requests = pod_requests(pod)
        shares[site] += requests.get("nvidia.com/gpu.shared", 0)
        whole[site] += requests.get(GPU, 0)
        count[site] += 1
    for site, used in memory.items():
        node = by_name[node_of(site)]
        assert used <= (node.gpu_memory_bytes if mode == "dra" else node.physical_gpus * node.gpu_memory_bytes)
    for name, node in by_name.items():
        assert count[name] <= node.pods
        assert whole[name] <= node.gpus or mode != "exclusive"
        assert shares[name] <= node.allocatable.get("nvidia.com/gpu.shared", 0) or mode in ("exclusive", "dra")
