"""The warm pool on a real control plane, on nodes whose GPUs many functions share: the trained model's
layout scaled by its recorded routing, and plans that share nodes with other pods.

A control plane of its own (the session's nodes do not share GPUs): the chart installed, the operator
as a process under the chart's ServiceAccount, kube-scheduler and kwok's pods.
- kwok-gpu-0, -1: 4 x 80 GB time-sliced (48 shares a GPU): the trained layout, 128 functions.
- kwok-gpu-2: 2 x 80 GB time-sliced with 4 shares a GPU (8 functions): two MoEDeployments share it.
- kwok-gpu-3: 4 whole GPUs: frontends and expert functions of one MoEDeployment on the same node.
The trained model is kubemoe's own MoE (benchmarks/train_moe.py, recipe base: Mixtral class, 8 MoE layers
x 16 experts, top-2, bf16, experts of 3 x 512 x 1024 weights = 3 MiB); its frontends' predicted loads are
its routing as recorded on the H200 (benchmarks/results/routing_trace_base_h200.safetensors: the router's
choices and the fine-tuned d=1 predictor's guesses for 64 held-out requests), served on the frontend pod's
IP as /loads answers. Two windows of the recording: requests 0-31, then 56-63, where some layers' hot
experts change (layer 0's from expert 1 to experts 10 and 2).
"""

from __future__ import annotations

import json
import signal
import time

import numpy as np
import pytest
from kubernetes import client

from kubemoe.devcluster import Cluster, ClusterConfig, GpuSharing
from kubemoe.load_report import parse_reports, rates
from kubemoe.planning.scaler import layer_cv

pytestmark = pytest.mark.cluster

MOED = dict(group="kubemoe.io", version="v1alpha1", plural="moedeployments")
SHARED = "nvidia.com/gpu.shared"
WINDOW_S = 10  # the reports' window: rates are the recorded tokens over it
KEEP_ALIVE_S = 30


@pytest.fixture(scope="module")
def shared(tmp_path_factory, f):
    with Cluster(ClusterConfig(nodes=0)) as running:
        running.add_gpu_nodes(2, 4, sharing=GpuSharing("time-slicing", replicas=48, rename=True))
        running.add_gpu_nodes(1, 2, sharing=GpuSharing("time-slicing", replicas=4, rename=True))
        running.add_gpu_nodes(1, 4)
        f.install_chart(running)
        operator = f.start_operator(running, tmp_path_factory.mktemp("shared-nodes-operator"))
        try:
            yield running, running.api_client(), operator
        finally:
            operator.kill(signal.SIGTERM)


@pytest.fixture
def in_namespace(shared, f, request):
    """A fresh namespace (its default service account made), deleted with its pods afterwards."""
    cluster, api, _ = shared
    core = client.CoreV1Api(api)
    name = f"t-{request.node.name[5:30].replace('_', '-').rstrip('-')}"
    core.create_namespace({"metadata": {"name": name}})
    f.wait(lambda: core.read_namespaced_service_account("default", name), 30, "the default service account")
    yield name
    core.delete_namespace(name)
    f.wait(lambda: not core.list_namespaced_pod(name).items, 120, f"{name}'s pods deleted")


def create(api, namespace: str, body: dict) -> None:
    body = {**body, "metadata": {"name": body["metadata"]["name"], "namespace": namespace}}
    client.CustomObjectsApi(api).create_namespaced_custom_object(namespace=namespace, body=body, **MOED)


def events(api, namespace: str, name: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for e in client.CoreV1Api(api).list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items:
        found.setdefault(e.reason, []).append(e.message)
    return found


def pods(api, namespace: str, component: str) -> list:
    return client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"app.kubernetes.io/component={component}").items


def experts(api, namespace: str) -> dict[str, dict]:
    """Expert functions' pods (runtime pods) by name."""
    return {p.metadata.name: p for p in client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector="app.kubernetes.io/component=expert").items}


def kept_warm(api, namespace: str, name: str) -> dict[str, dict]:
    """The expert pods of the services the routing ConfigMap says are kept warm, by name."""
    data = client.CoreV1Api(api).read_namespaced_config_map(f"{name}-routing", namespace).data
    warm = {(bundle, site) for bundle, site, _, _ in json.loads(data["retired.json"])}
    return {n: p for n, p in experts(api, namespace).items()
            if (p.metadata.labels["kubemoe.io/bundle"], p.metadata.annotations["kubemoe.io/node"]) in warm}


def replicas(table: dict) -> dict[str, int]:
    """bundle -> replicas the routing table sends its tokens to (own services and functions hosting it)."""
    return {r["bundle"]: sum(e.get("replicas", 1) for e in r["endpoints"]) for r in table["routes"]}


# -- the trained model's layout, scaled by its recorded routing ----------------------------------------

def planned_rates(report: dict) -> list[list[float]]:
    """[L][E] tokens/s the operator plans with: the predicted rate where the frontend sends one."""
    got = rates(parse_reports(json.dumps(report)))
    return [[got.get((layer, e), 0.0) for e in range(16)] for layer in range(8)]


def trained_body() -> dict:
    return {"apiVersion": "kubemoe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": "trained"}, "spec": {
        "model": {"uri": "hostpath:///models/moe-base", "dtype": "bfloat16",
                  "layout": {"moeLayers": list(range(8)), "expertsPerLayer": 16, "expertBytes": "3Mi"}},
        "frontend": {"replicas": 1, "gpus": 0},
        "experts": {"runtime": "pods", "bundleBytes": "3Mi",  # one expert a bundle: scaled per expert
                    "gpuSharing": {"mode": "timeSlicing", "resourceName": SHARED},
                    "scaling": {"cvThreshold": 0.2, "maxReplicasPerExpert": 4, "keepAlive": f"{KEEP_ALIVE_S}s"},
                    "placement": {"nodeSelector": {"nvidia.com/gpu.replicas": "48"}}},
        "cost": {"gpuHourPrice": 2.0}}}


@pytest.mark.timeout(900)  # a control plane, 128 functions, three windows and two keepAlives
def test_the_trained_layout_scales_its_hot_experts_out_reuses_warm_ones_and_retires_after_keepalive(
        shared, in_namespace, f, benchmark_module):
    cluster, api, operator = shared
    ns = in_namespace
    sim = benchmark_module("moeless_sim")
    trace = sim.read_routing_trace(sim.ROUTING_TRACE)
    assert (trace.experts.shape[1], trace.num_experts, trace.experts.shape[2]) == (8, 16, 2)  # the trained layout
    create(api, ns, trained_body())
    ready = f.wait(lambda: f.condition(m := f.moed(api, ns, "trained"), "Ready").get("status") == "True" and m,
                   300, "the trained layout Ready: 128 expert functions", operator)
    assert ready["status"]["plan"]["replicas"] == ready["status"]["plan"]["functions"] == 128
    assert all(p.status.phase == "Running" for p in pods(api, ns, "expert"))
    frontend = f.wait(lambda: [p for p in pods(api, ns, "frontend") if p.status.pod_ip], 60, "the frontend's IP")[0]

    def settled(report: dict) -> tuple[dict, dict]:
        """(routing table, status) once the operator plans with `report` (the status's tokens/s are its) and
        its plan has stayed for 5 s: under the same loads a second step may follow the first (replicas
        hosted in place, memory that retired services freed)."""
        seen: dict = {}
        tokens_per_second = round(int(report["tokens"]) / report["windowSeconds"], 3)

        def check():
            status = f.moed(api, ns, "trained")["status"]
            table = f.routing_table(api, ns, "trained")
            version = int(table["version"])
            if status["loads"]["tokensPerSecond"] != tokens_per_second or status["plan"]["version"] != version:
                return None
            if seen.get("version") != version:
                seen.update(version=version, since=time.monotonic())
                return None
            return time.monotonic() - seen["since"] >= 5 and (table, status)
        return f.wait(check, 180, f"a plan for {tokens_per_second} tokens/s that stays", operator)

    window_a = sim.load_report(trace, 0, 31, WINDOW_S, "trained", frontend.metadata.name)
    window_b = sim.load_report(trace, 56, 63, WINDOW_S, "trained", frontend.metadata.name)
    rates_a, rates_b = planned_rates(window_a), planned_rates(window_b)
    server = f.LoadServer(frontend.status.pod_ip, window_a)
    try:
        # Window A: every layer's hot experts scale out; status shows replicas and CV per layer.
        table, status = settled(window_a)
        f.wait(lambda: all(p.status.phase == "Running" for p in pods(api, ns, "expert")), 120,
               "window A's functions Running", operator)
        layers = status["plan"]["layers"]
        assert [x["layer"] for x in layers] == list(range(8))
        for x, row in zip(layers, rates_a):
            assert x["cvBefore"] == round(layer_cv(row, [1] * 16), 4)  # the recorded skew, as the operator saw it
            assert x["replicas"] > 16 and x["cvAfter"] < x["cvBefore"]
        count = replicas(table)
        for layer, row in enumerate(rates_a):
            hottest = int(np.argmax(row))
            assert count[f"l{layer}-e{hottest}-{hottest}"] >= 2, (layer, hottest, count)
        assert status["plan"]["unplaced"] == 0 and status["plan"]["cv"] == max(x["cvAfter"] for x in layers)
        f.wait(lambda: "ScaledOut" in events(api, ns, "trained"), 30, "a ScaledOut event", operator)

        # Window B: layer 0's hot expert moves (1 -> 10 and 2): replicas follow, the left ones are retired.
        hot_a, hot_b = int(np.argmax(rates_a[0])), int(np.argmax(rates_b[0]))
        assert hot_a != hot_b
        server.report = window_b
        table, status = settled(window_b)
        before, count = count, replicas(table)
        assert count[f"l0-e{hot_b}-{hot_b}"] > before[f"l0-e{hot_b}-{hot_b}"] >= 1
        assert count[f"l0-e{hot_a}-{hot_a}"] < before[f"l0-e{hot_a}-{hot_a}"]
        f.wait(lambda: {"ScaledIn", "Retired"} <= events(api, ns, "trained").keys(), 30, "ScaledIn and Retired events",
               operator)
        retired = {name: d.metadata.uid for name, d in kept_warm(api, ns, "trained").items()}
        assert retired and status["plan"]["retired"] > 0

        # Window A again, within keepAlive: retired services come back warm (the same objects, pods kept).
        server.report = window_a
        table, status = settled(window_a)
        assert replicas(table)[f"l0-e{hot_a}-{hot_a}"] >= 2
        f.wait(lambda: "WarmReused" in events(api, ns, "trained"), 30, "a WarmReused event", operator)
        now = experts(api, ns)
        warm = kept_warm(api, ns, "trained")
        back = [name for name, uid in retired.items() if name in now and now[name].metadata.uid == uid
                and name not in warm]
        assert back, "a retired service came back as the same object"

        # Loads unchanged from here: after keepAlive the services still retired expire and are deleted (the
        # memory they free lets the plan place what did not fit, which may retire a few more, once).
        status = f.wait(lambda: (s := f.moed(api, ns, "trained")["status"])["plan"]["retired"] == 0 and s,
                        2 * KEEP_ALIVE_S + 60, "every retired service expired", operator)
        assert "Expired" in events(api, ns, "trained")
        assert not kept_warm(api, ns, "trained")
        assert f.condition(f.moed(api, ns, "trained"), "Ready")["status"] == "True"
    finally:
        server.close()


# -- plans that share nodes with other pods ---------------------------------------------------------

def small_body(name: str, experts: int, node: str, **spec) -> dict:
    return {"apiVersion": "kubemoe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": name}, "spec": {
        "model": {"uri": f"hostpath:///models/{name}",
                  "layout": {"moeLayers": [0], "expertsPerLayer": experts, "expertBytes": "256Mi"}},
        "frontend": {"replicas": 1, "gpus": 0},
        "experts": {"runtime": "pods", "bundleBytes": "256Mi",
                    "placement": {"nodeSelector": {"kubernetes.io/hostname": node}}},
        "cost": {"gpuHourPrice": 2.0}, **spec}}


def test_a_second_deployment_on_the_same_gpus_gets_what_is_left_or_a_clear_refusal(shared, in_namespace, f):
    cluster, api, operator = shared
    ns = in_namespace
    sharing = {"mode": "timeSlicing", "resourceName": SHARED}
    first = small_body("first", 6, "kwok-gpu-2")
    first["spec"]["experts"]["gpuSharing"] = sharing
    create(api, ns, first)
    f.wait(lambda: f.condition(f.moed(api, ns, "first"), "Ready").get("status") == "True", 120, "first Ready", operator)
    # 6 of the node's 8 shares taken: 4 more functions do not fit, and the second says so instead of
    # leaving pods Pending.
    too_big = small_body("second", 4, "kwok-gpu-2")
    too_big["spec"]["experts"]["gpuSharing"] = sharing
    create(api, ns, too_big)
    refused = f.wait(lambda: f.condition(m := f.moed(api, ns, "second"), "PlanApplied") and m, 60, "PlanApplied", operator)
    applied = f.condition(refused, "PlanApplied")
    assert (applied["status"], applied["reason"]) == ("False", "InsufficientCapacity"), applied
    assert "other pods hold" in applied["message"] and f"6 of 8 {SHARED} shares" in applied["message"], applied
    assert not pods(api, ns, "expert") or all(p.metadata.labels["app.kubernetes.io/instance"] == "first"
                                              for p in pods(api, ns, "expert"))
    # Two functions fit in what is left: the second gets exactly that, and every pod runs.
    client.CustomObjectsApi(api).delete_namespaced_custom_object(namespace=ns, name="second", **MOED)
    fits = small_body("third", 2, "kwok-gpu-2")
    fits["spec"]["experts"]["gpuSharing"] = sharing
    create(api, ns, fits)
    f.wait(lambda: f.condition(f.moed(api, ns, "third"), "Ready").get("status") == "True", 120, "third Ready", operator)
    running = f.wait(lambda: (ps := pods(api, ns, "expert")) and len(ps) == 8 and all(
        p.status.phase == "Running" for p in ps) and ps, 60, "8 expert pods Running on kwok-gpu-2")
    assert {p.spec.node_name for p in running} == {"kwok-gpu-2"}


def test_frontends_on_the_experts_node_keep_their_gpus_when_the_experts_scale_out(shared, in_namespace, f):
    """The 100-node run's flaw: the planner ignored the frontends' GPUs on nodes shared with experts."""
    cluster, api, operator = shared
    ns = in_namespace
    body = small_body("mixed", 2, "kwok-gpu-3")  # 4 whole GPUs: 2 frontends + 2 expert functions
    body["spec"]["frontend"] = {"replicas": 2, "gpus": 1,
                                "placement": {"nodeSelector": {"kubernetes.io/hostname": "kwok-gpu-3"}}}
    create(api, ns, body)
    f.wait(lambda: f.condition(f.moed(api, ns, "mixed"), "Ready").get("status") == "True", 120, "Ready", operator)
    frontends = [p for p in pods(api, ns, "frontend") if p.status.pod_ip]
    assert len(frontends) == 2
    # A skewed load: expert 0 wants more replicas than the 2 GPUs the frontends leave.
    server = f.LoadServer(frontends[0].status.pod_ip, {
        "model": "mixed", "frontend": frontends[0].metadata.name, "windowSeconds": 10, "tokens": "1000",
        "loads": [{"layer": 0, "expert": 0, "tokensPerSecond": 900.0}, {"layer": 0, "expert": 1, "tokensPerSecond": 100.0}]})
    try:
        status = f.wait(lambda: (s := f.moed(api, ns, "mixed")["status"])["plan"]["unplaced"] > 0 and s, 60,
                        "the scale-out that does not fit reported", operator)
        assert status["plan"]["replicas"] == 2
        applied = f.condition(f.moed(api, ns, "mixed"), "PlanApplied")
        assert (applied["status"], applied["reason"]) == ("True", "ReplicasUnplaced")
        every = [*pods(api, ns, "frontend"), *pods(api, ns, "expert")]
        assert len(every) == 4 and all(p.status.phase == "Running" for p in every), [
            (p.metadata.name, p.status.phase) for p in every]
    finally:
        server.close()
