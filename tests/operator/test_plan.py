import pytest

from kubemoe.operator.plan import Loads, NodeInfo, PlanError, Retired, eligible_nodes, plan, tolerated
from kubemoe.operator.spec import MoESpec

NOW = 1_000_000.0
# One replica per bundle: for tests about moving and retiring services, not about scaling them out.
NO_SCALING = {"scaling": {"maxReplicasPerExpert": 1}}


def spec_of(f, **overrides) -> MoESpec:
    return MoESpec.parse(f.moed_body(**overrides)["spec"])


def test_one_replica_per_bundle_spread_over_nodes(f):
    spec = spec_of(f)
    p = plan(spec, Loads(), f.gpu_nodes(2), None, NOW)
    assert {b: len(n) for b, n in p.nodes.items()} == {"l0-e0-1": 1, "l0-e2-3": 1, "l1-e0-1": 1, "l1-e2-3": 1}
    per_node = [sum(1 for nodes in p.nodes.values() if nodes == (f"node-{i}",)) for i in range(2)]
    assert per_node == [2, 2] and p.version == 1 and p.retired == {} and p.cv == 0.0


def test_same_inputs_same_plan_and_version(f):
    spec, nodes = spec_of(f), f.gpu_nodes(3)
    first = plan(spec, Loads(), nodes, None, NOW)
    again = plan(spec, Loads(), nodes, first, NOW + 60)
    assert again.nodes == first.nodes and again.version == first.version and again.retired == {}


def test_loads_move_bundles_off_the_busy_node_and_keep_the_old_service_warm(f):
    spec, nodes = spec_of(f, experts=NO_SCALING), f.gpu_nodes(2)
    first = plan(spec, Loads(), nodes, None, NOW)
    hot = {(0, 0): 100.0, (0, 1): 100.0}
    second = plan(spec, Loads(hot, 10.0, 1), nodes, first, NOW + 30)
    moved = {b for b in first.nodes if first.nodes[b] != second.nodes[b]}
    assert moved and second.version == first.version + 1
    assert set(second.retired) == {(b, first.nodes[b][0]) for b in moved}
    assert all(r == Retired(1, NOW + 30) for r in second.retired.values())
    assert second.cv > 0  # layer 0 has one hot bundle


def test_retired_service_expires_after_keep_alive_and_is_reused_before(f):
    spec, nodes = spec_of(f, experts={"scaling": {"keepAlive": "60s", "maxReplicasPerExpert": 1}}), f.gpu_nodes(2)
    first = plan(spec, Loads(), nodes, None, NOW)
    second = plan(spec, Loads({(0, 0): 100.0, (0, 1): 100.0}), nodes, first, NOW)
    assert second.retired
    kept = plan(spec, Loads({(0, 0): 100.0, (0, 1): 100.0}), nodes, second, NOW + 59)
    assert kept.retired == second.retired
    gone = plan(spec, Loads({(0, 0): 100.0, (0, 1): 100.0}), nodes, second, NOW + 61)
    assert gone.retired == {}
    back = plan(spec, Loads(), nodes, second, NOW + 10)  # loads vanish: warm services win
    assert {(b, n) for b, ns in back.nodes.items() for n in ns} >= set(second.retired)


def test_placement_respects_selector_taints_and_gpu_capacity(f):
    tainted = NodeInfo("tainted", 8, None, taints=({"key": "nvidia.com/gpu", "effect": "NoSchedule"},))
    other = NodeInfo("a100", 8, None, labels={"nvidia.com/gpu.product": "A100"})
    h100 = NodeInfo("h100", 8, None, labels={"nvidia.com/gpu.product": "H100"})
    spec = spec_of(f, experts={"runtime": "deployment", "bundleBytes": "256Mi",
                               "placement": {"nodeSelector": {"nvidia.com/gpu.product": "H100"}}})
    assert [n.name for n in eligible_nodes(spec, [tainted, other, h100])] == ["h100"]
    assert plan(spec, Loads(), [tainted, other, h100], None, NOW).node_names == {"h100"}
    assert tolerated({"key": "nvidia.com/gpu", "effect": "NoSchedule"}, [{"operator": "Exists"}])
    assert not tolerated({"key": "a", "value": "x", "effect": "NoSchedule"}, [{"key": "a", "value": "y"}])
    with pytest.raises(PlanError, match="do not fit") as full:
        plan(spec_of(f, experts={"gpus": 8}), Loads(), f.gpu_nodes(3, gpus=8), None, NOW)
    assert full.value.reason == "InsufficientCapacity"


def test_no_eligible_node_and_bundle_larger_than_a_gpu_say_what_to_change(f):
    with pytest.raises(PlanError, match="spec.experts.placement"):
        plan(spec_of(f), Loads(), [], None, NOW)
    big = spec_of(f, model={"uri": "pvc://m/x", "layout": {"moeLayers": [0], "expertsPerLayer": 2, "expertBytes": "100Gi"}})
    with pytest.raises(PlanError, match="bundleBytes"):
        plan(big, Loads(), f.gpu_nodes(2, memory_gib=80), None, NOW)


def test_auto_mode_offloads_on_single_gpu_nodes(f):
    spec = spec_of(f, mode="auto", offload={"gpuMemoryBudget": "20Gi"})
    assert plan(spec, Loads(), f.gpu_nodes(2, gpus=1), None, NOW).mode == "offload"
    assert plan(spec, Loads(), f.gpu_nodes(2, gpus=8), None, NOW).mode == "distributed"
    offload = plan(spec, Loads(), f.gpu_nodes(2, gpus=1), None, NOW)
    assert offload.replicas == 0 and offload.services() == {}


def test_node_from_api_object():
    node = {"metadata": {"name": "g", "labels": {"nvidia.com/gpu.memory": "81559"}},
            "spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}, "conditions": [{"type": "Ready", "status": "True"}]}}
    info = NodeInfo.from_node(node)
    assert (info.gpus, info.gpu_memory_bytes, info.schedulable) == (8, 81559 * 2**20, True)
    assert not NodeInfo.from_node({**node, "spec": {"unschedulable": True}}).schedulable


def test_a_hot_bundle_gets_more_replicas_on_different_nodes(f):
    spec, nodes = spec_of(f), f.gpu_nodes(2)
    p = plan(spec, Loads({(0, 0): 300.0, (0, 1): 300.0, (0, 2): 100.0, (0, 3): 100.0}, 10.0, 1), nodes, None, NOW)
    # Layer 0's bundles carry 600 and 200 tokens/s: [300, 300, 200] has CV 0.18 <= 0.2.
    assert {b: len(n) for b, n in p.nodes.items()} == {"l0-e0-1": 2, "l0-e2-3": 1, "l1-e0-1": 1, "l1-e2-3": 1}
    assert set(p.nodes["l0-e0-1"]) == {"node-0", "node-1"} and p.cv == 0.1768


def test_scaling_obeys_the_spec_caps(f):
    skewed = Loads({(0, 0): 1000.0, (0, 2): 1.0}, 10.0, 1)
    capped = plan(spec_of(f, experts={"scaling": {"maxReplicasPerExpert": 3}}), skewed, f.gpu_nodes(2), None, NOW)
    assert len(capped.nodes["l0-e0-1"]) == 3
    # 128 MiB experts, two a bundle: a 1 GiB layer cap holds 4 bundle replicas, 2 of them the layer's own.
    memory = plan(spec_of(f, experts={"scaling": {"layerMemoryCap": "1Gi"}}), skewed, f.gpu_nodes(2), None, NOW)
    assert len(memory.nodes["l0-e0-1"]) == 3 and len(memory.nodes["l0-e2-3"]) == 1
    loose = plan(spec_of(f, experts={"scaling": {"cvThreshold": 5.0}}), skewed, f.gpu_nodes(2), None, NOW)
    assert loose.replicas == 4
