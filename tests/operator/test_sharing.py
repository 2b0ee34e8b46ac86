"""GPUs shared by expert functions (spec.experts.gpuSharing): what the planner packs into each GPU and
what every mode renders. Nodes are read (NodeInfo.from_node) from the devcluster's fake nodes, which
carry the NVIDIA device plugin's and GPU feature discovery's real resource names and labels, so the
operator is tested against what it reads on a cluster."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubemoe.devcluster import GpuSharing, gpu_node, gpu_resource_slice
from kubemoe.operator.config import OperatorConfig
from kubemoe.operator.plan import (Loads, NodeInfo, PlanError, decisions, function_bytes, node_of, plan,
                                   with_dra_devices)
from kubemoe.operator.render import (CLAIM, MPS_MEMORY_LIMIT_ENV, NODE_ANNOTATION, RESOURCE_CLAIM, observe,
                                     pod_spec_of, render, service_of)
from kubemoe.operator.spec import MoEDeployment, MoESpec, SpecError

NOW = 1_000_000.0
H100 = ("NVIDIA-H100-80GB-HBM3", 81559)
TIME_SLICED = GpuSharing("time-slicing", replicas=48, rename=True)


def nodes(count: int, gpus: int = 4, sharing: GpuSharing = TIME_SLICED, memory_mib: int = H100[1],
          **labels) -> list[NodeInfo]:
    made, slices = [], []
    for i in range(count):
        node = gpu_node(f"gpu-{i}", gpus, H100[0], memory_mib, sharing=sharing)
        node["metadata"]["labels"].update(labels)
        node["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
        made.append(NodeInfo.from_node(node))
        if sharing.strategy == "dra":
            slices.append(gpu_resource_slice(f"gpu-{i}", gpus, H100[0], memory_mib))
    return with_dra_devices(made, slices)


def sample_spec(f, name: str, **experts) -> MoESpec:
    spec = f.sample(name)["spec"]
    spec["experts"].update(experts)
    return MoESpec.parse(spec)


def shared(f, mode: str, **sharing) -> MoEDeployment:
    runtime = "pods" if mode == "dra" else "knative"
    return MoEDeployment.from_body(f.moed_body(experts={"runtime": runtime, "bundleBytes": "256Mi",
                                                        "gpuSharing": {"mode": mode, **sharing}}))


def hot(spec: MoESpec, factor: float = 50.0) -> Loads:
    """Expert 0 of every layer far hotter than the rest: the scaler wants many replicas of it."""
    return Loads({(layer, e): factor if e == 0 else 1.0 for layer in spec.layout.moe_layers
                  for e in range(spec.layout.experts_per_layer)}, 100.0, 1)


# -- planning ------------------------------------------------------------------------------------------------

def test_mixtral_sample_fits_one_node_of_four_time_sliced_80gb_gpus(f):
    spec = sample_spec(f, "mixtral-8x7b")
    p = plan(spec, Loads(), nodes(1), None, NOW)
    assert p.replicas == len(spec.bundles()) == 64 and not p.unplaced
    assert p.gpus_held <= 4 and p.node_names == {"gpu-0"}
    # Scaled out for a skewed load it still stays inside the node (4 GPUs), unplaced replicas reported.
    scaled = plan(spec, hot(spec), nodes(1), p, NOW + 60)
    assert scaled.replicas > 64 and scaled.gpus_held <= 4


def test_the_mixtral_sample_on_unshared_gpus_is_refused_with_what_to_configure(f):
    spec = sample_spec(f, "mixtral-8x7b")
    with pytest.raises(PlanError) as refused:  # the 3 x 8 exclusive GPUs that could not hold 256 replicas
        plan(spec, Loads(), nodes(3, gpus=8, sharing=GpuSharing()), None, NOW)
    assert refused.value.reason == "InsufficientCapacity"
    assert "advertising nvidia.com/gpu.shared (time-slicing shares of the NVIDIA device plugin" in str(refused.value)


def test_a_node_sharing_its_gpus_another_way_is_not_eligible(f):
    spec = sample_spec(f, "mixtral-8x7b")
    mps_nodes = nodes(1, sharing=GpuSharing("mps", replicas=8, rename=True))
    with pytest.raises(PlanError, match="time-slicing"):
        plan(spec, Loads(), mps_nodes, None, NOW)
    # Without the strategy label (older device plugins) the shares alone decide.
    unlabelled = nodes(1)
    unlabelled = [NodeInfo(n.name, n.gpus, n.gpu_memory_bytes,
                           {k: v for k, v in n.labels.items() if k != "nvidia.com/gpu.sharing-strategy"},
                           allocatable=n.allocatable, pods=n.pods) for n in unlabelled]
    assert plan(spec, Loads(), unlabelled, None, NOW).replicas == 64


def test_dra_plans_only_the_gpus_a_dra_driver_publishes(f):
    spec = sample_spec(f, "llama-4-scout")
    device_plugin_nodes = nodes(2, gpus=8) + [dataclasses.replace(n, name="plain-0") for n in nodes(1, gpus=8, sharing=GpuSharing())]
    with pytest.raises(PlanError, match="ResourceSlices of the gpu.nvidia.com DRA driver"):
        plan(spec, Loads(), device_plugin_nodes, None, NOW)
    dra = [dataclasses.replace(n, name="dra-0") for n in nodes(1, gpus=4, sharing=GpuSharing("dra"))]
    p = plan(spec, Loads(), [*device_plugin_nodes, *dra], None, NOW)
    assert p.node_names == {"dra-0"} and p.replicas == 96 and p.gpus_held <= 4
    assert {site.partition("/")[2] for sites in p.nodes.values() for site in sites} <= {f"gpu{i}" for i in range(4)}


def test_shares_bound_the_functions_per_gpu(f):
    spec = sample_spec(f, "mixtral-8x7b", scaling={"maxReplicasPerExpert": 1})
    # 4 shares per GPU: 16 functions on one node, 64 bundles: 48 without a GPU.
    with pytest.raises(PlanError, match="48 of 64 expert bundles .* fit on no GPU.*16 nvidia.com/gpu.shared shares"):
        plan(spec, Loads(), nodes(1, sharing=GpuSharing("time-slicing", replicas=4, rename=True)), None, NOW)
    assert plan(spec, Loads(), nodes(4, sharing=GpuSharing("time-slicing", replicas=4, rename=True)),
                None, NOW).replicas == 64


def test_an_mps_share_too_small_for_a_function_is_refused_with_the_reason(f):
    spec = sample_spec(f, "qwen3-30b-a3b")  # functions of 1.6 GiB; 64 MPS clients of an 80 GB GPU get 1.24 GiB
    with pytest.raises(PlanError, match="MPS gives each share 1/replicas of a GPU's memory.*fewer MPS replicas"):
        plan(spec, Loads(), nodes(2, sharing=GpuSharing("mps", replicas=64, rename=True)), None, NOW)
    assert plan(spec, Loads(), nodes(1, sharing=GpuSharing("mps", replicas=32, rename=True)), None, NOW).replicas == 96


MODES = {"timeSlicing": GpuSharing("time-slicing", replicas=8, rename=True),
         "mps": GpuSharing("mps", replicas=8, rename=True), "dra": GpuSharing("dra")}


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(sorted(MODES)), node_count=st.integers(1, 3), gpus=st.integers(1, 4),
       memory_gib=st.integers(8, 48), experts=st.integers(2, 8), layers=st.integers(1, 3),
       expert_mib=st.integers(50, 600), skew=st.floats(1.0, 100.0), max_replicas=st.integers(1, 6))
def test_the_planner_never_fills_a_gpu_beyond_its_memory_or_shares(f, mode, node_count, gpus, memory_gib, experts,
                                                                     layers, expert_mib, skew, max_replicas):
    body = f.moed_body(model={"uri": "pvc://m/x", "layout": {"moeLayers": list(range(layers)),
                                                             "expertsPerLayer": experts,
                                                             "expertBytes": f"{expert_mib}Mi"}},
                       experts={"runtime": "pods", "bundleBytes": f"{expert_mib}Mi",
                                "scaling": {"maxReplicasPerExpert": max_replicas},
                                "gpuSharing": {"mode": mode, "functionOverhead": "512Mi",
                                               **({} if mode == "dra" else {"resourceName": "nvidia.com/gpu.shared"})}})
    spec = MoESpec.parse(body["spec"])
    cluster = nodes(node_count, gpus, MODES[mode], memory_mib=memory_gib * 1024)
    try:
        p = plan(spec, hot(spec, skew), cluster, None, NOW)
    except PlanError as refused:
        assert refused.reason == "InsufficientCapacity"
        return
    sizes = {b.name: function_bytes(spec, b) for b in spec.bundles()}
    per_site, count = Counter(), Counter()
    for bundle, sites in p.nodes.items():
        for site in sites:
            per_site[site] += sizes[bundle]
            count[node_of(site)] += 1
    by_name = {n.name: n for n in cluster}
    for site, used in per_site.items():
        node = by_name[node_of(site)]
        if mode == "dra":  # the plan's GPU is the claim's GPU: exact
            assert site != node.name and used <= node.gpu_memory_bytes
        else:  # the device plugin picks the GPU: the node's memory, shares and MPS slices bound it
            assert used <= node.physical_gpus * node.gpu_memory_bytes
            assert count[node.name] <= node.allocatable["nvidia.com/gpu.shared"]
            if mode == "mps":
                assert max(sizes.values()) <= node.gpu_memory_bytes // MODES[mode].replicas
    assert p.gpus_held <= sum(n.physical_gpus for n in cluster)


@pytest.mark.parametrize("mode", ["timeSlicing", "mps"])
def test_scale_out_is_hosted_in_place_only_where_the_driver_does_not_cap_a_function(f, mode):
    """Under MPS each function may hold its planned bytes and no more (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT): a
    replica hosted in place would be a Load past that. Time-sliced functions take them where memory allows."""
    spec = MoESpec.parse(f.moed_body(model={"uri": "pvc://m/x", "layout": {
        "moeLayers": [0, 1], "expertsPerLayer": 8, "expertBytes": "256Mi"}}, experts={
        "runtime": "pods", "bundleBytes": "256Mi", "scaling": {"maxReplicasPerExpert": 4},
        "gpuSharing": {"mode": mode, "resourceName": "nvidia.com/gpu.shared"}})["spec"])
    cluster = nodes(2, 4, MODES[mode])
    even = plan(spec, Loads({(layer, e): 10.0 for layer in (0, 1) for e in range(8)}, 100.0, 1), cluster, None, NOW)
    scaled = plan(spec, hot(spec), cluster, even, NOW + 60)
    assert scaled.replicas_of("l0-e0-0") > 1 and not scaled.unplaced
    assert bool(scaled.hosted) == (mode == "timeSlicing")


# -- rendering -----------------------------------------------------------------------------------------------

def expert_pods(objects):
    """The pod specs of the expert functions: their pods (runtime pods), or their Knative Services' templates."""
    return [pod_spec_of(o) for o in objects if service_of(o) is not None]


def working_memory_mib(container) -> int:
    args = container["args"]
    return int(args[args.index("--working-memory-mib") + 1])


def test_each_mode_renders_what_its_mechanism_schedules_by(f):
    exclusive = MoEDeployment.from_body(f.moed_body())
    for mode, cluster in [("exclusive", nodes(2, sharing=GpuSharing())), ("timeSlicing", nodes(2)),
                          ("mps", nodes(2, sharing=GpuSharing("mps", replicas=8, rename=True)))]:
        deployment = exclusive if mode == "exclusive" else shared(f, mode, resourceName="nvidia.com/gpu.shared")
        p = plan(deployment.spec, Loads(), cluster, None, NOW)
        pods = expert_pods(render(deployment, p, OperatorConfig()))
        assert len(pods) == 4
        for pod in pods:
            [container] = pod["containers"]
            limits = container["resources"]["limits"]
            assert limits == ({"nvidia.com/gpu": "1"} if mode == "exclusive" else {"nvidia.com/gpu.shared": "1"})
            env = {e["name"]: e.get("value") for e in container["env"]}
            # An MPS client limits itself to its function's bytes: 2 experts of 128 MiB + 1Gi overhead.
            assert env.get(MPS_MEMORY_LIMIT_ENV) == ("0=1280M" if mode == "mps" else None)
            # A time-sliced function caps its own allocator: functionOverhead (1Gi) less the CUDA context.
            assert working_memory_mib(container) == (256 if mode == "timeSlicing" else 0)
            assert "resourceClaims" not in pod


@pytest.mark.parametrize("strategy", ["TimeSlicing", "MPS"])
def test_dra_renders_one_shared_claim_per_planned_gpu(f, strategy):
    deployment = shared(f, "dra", draStrategy=strategy)
    p = plan(deployment.spec, Loads(), nodes(1, gpus=2, sharing=GpuSharing("dra")), None, NOW)
    objects = render(deployment, p, OperatorConfig())
    claims = {o["metadata"]["name"]: o for o in objects if (o["apiVersion"], o["kind"]) == RESOURCE_CLAIM}
    sites = {site for sites in p.nodes.values() for site in sites}
    assert len(claims) == len(sites) == 2 and {node_of(s) for s in sites} == {"gpu-0"}
    for claim in claims.values():
        devices = claim["spec"]["devices"]
        assert devices["requests"] == [{"name": CLAIM, "exactly": {"deviceClassName": "gpu.nvidia.com"}}]
        config = devices["config"][0]["opaque"]
        assert config["driver"] == "gpu.nvidia.com" and config["parameters"]["kind"] == "GpuConfig"
        assert config["parameters"]["sharing"]["strategy"] == strategy
        assert ("mpsConfig" in config["parameters"]["sharing"]) == (strategy == "MPS")
        assert claim["metadata"]["annotations"][NODE_ANNOTATION] == "gpu-0"
    used = Counter()
    for pod in expert_pods(objects):
        assert working_memory_mib(pod["containers"][0]) == (256 if strategy == "TimeSlicing" else 0)
        [ref] = pod["resourceClaims"]
        assert ref["resourceClaimName"] in claims and pod["containers"][0]["resources"]["claims"] == [{"name": CLAIM}]
        assert "limits" not in pod["containers"][0]["resources"]
        term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["nodeSelectorTerms"][0]["matchFields"][0] == {"key": "metadata.name", "operator": "In", "values": ["gpu-0"]}
        used[ref["resourceClaimName"]] += 1
    assert sorted(used.values()) == [2, 2]  # 4 functions, two per GPU: each claim shared
    # Read back from the cluster, the services keep their GPU: a restarted operator plans from the same sites.
    assert observe(deployment.spec, "distributed", objects).nodes == p.nodes


def test_every_kind_the_operator_renders_has_an_api_path_and_rbac(f):
    from kubemoe.operator.kube import RESOURCES
    from kubemoe.operator.render import KINDS
    assert set(KINDS) <= set(RESOURCES)
    rules = (f.chart / "templates" / "_helpers.tpl").read_text()
    for kind in KINDS:
        prefix, plural, _ = RESOURCES[kind]
        group = prefix.removeprefix("/apis/").rpartition("/")[0] if prefix.startswith("/apis/") else ""
        assert f"apiGroups: [{group or chr(34) * 2}]" in rules and plural in rules, kind


def test_dra_with_knative_and_shared_gpus_above_one_are_refused_by_the_parser(f):
    with pytest.raises(SpecError, match="knative/serving#15332"):
        MoESpec.parse(f.moed_body(experts={"runtime": "knative", "gpuSharing": {"mode": "dra"}})["spec"])
    with pytest.raises(SpecError, match="applies to gpuSharing.mode exclusive"):
        MoESpec.parse(f.moed_body(experts={"gpus": 2, "gpuSharing": {"mode": "timeSlicing"}})["spec"])


def test_a_plan_under_unchanged_loads_stays_as_it_is(f):
    """Time-sliced nodes are one bin each (the device plugin picks the GPU): a serving replica stays on its
    node while the loads do not change. With a per-GPU guess, services hopped between nodes every window
    (each hop retiring a copy and restarting its keepAlive, so retired copies never expired)."""
    spec = MoESpec.parse(f.moed_body(model={"uri": "pvc://m/x", "layout": {
        "moeLayers": list(range(8)), "expertsPerLayer": 16, "expertBytes": "3Mi"}}, experts={
        "runtime": "pods", "bundleBytes": "3Mi", "scaling": {"maxReplicasPerExpert": 4},
        "gpuSharing": {"mode": "timeSlicing", "resourceName": "nvidia.com/gpu.shared"}})["spec"])
    rng = random.Random(0)
    rates = {}
    for layer in range(8):  # Zipf-like popularity per layer, as routers produce
        order = rng.sample(range(16), 16)
        rates.update({(layer, e): 1000.0 / (order.index(e) + 1) for e in range(16)})
    cluster = nodes(2, 4)
    p = plan(spec, Loads(), cluster, None, NOW)
    for t in (5, 10):
        p = plan(spec, Loads(rates, 100.0, 1), cluster, p, NOW + t)
    again = plan(spec, Loads(rates, 100.0, 1), cluster, p, NOW + 15)
    moved = decisions(p, again)
    assert again.version == p.version and again.nodes == p.nodes and again.hosted == p.hosted
    assert not (moved.retired or moved.reused or moved.scaled_out or moved.scaled_in)
    assert p.replicas + sum(map(len, p.hosted.values())) > 128 and not p.unplaced
