import pytest

from kubemoe.operator.plan import (Loads, NodeInfo, Plan, PlanError, Retired, decisions, eligible_nodes,
                                   min_replica_load, plan, short_of_replicas, tolerated)
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


def _zipf(spec: MoESpec, seed: int) -> Loads:
    """Skewed expert popularity per layer, as routers produce (tokens/s of each layer's experts)."""
    import random

    rng, rates = random.Random(seed), {}
    for layer in spec.layout.moe_layers:
        order = list(range(spec.layout.experts_per_layer))
        rng.shuffle(order)
        rates.update({(layer, e): 1000.0 / (rank + 1) for rank, e in enumerate(order)})
    return Loads(rates, 5000.0, 4)


def test_a_replica_hosted_in_place_stays_with_its_host_when_the_warm_services_beside_it_expire(f):
    """The hot experts move; the services that left the plan are kept warm, then expire and free their
    memory. The placer, which sees services alone, then put some hosted replicas on other nodes (new pods
    for nothing: 49 of DeepSeek-V3's in the operator benchmark); a plan of the same loads keeps each with
    its host while that runs and the bundle has as many replicas."""
    spec = spec_of(f, model={"uri": "pvc://models/x", "layout": {"moeLayers": list(range(16)), "expertsPerLayer": 64,
                                                                 "expertBytes": 88 * 2**20}},
                   experts={"bundleBytes": "1Gi", "scaling": {"keepAlive": "1s"}})
    nodes = f.gpu_nodes(64, memory_gib=141)
    first = plan(spec, _zipf(spec, 1), nodes, plan(spec, Loads(), nodes, None, NOW), NOW + 10)
    moved = plan(spec, _zipf(spec, 2), nodes, plan(spec, _zipf(spec, 1), nodes, first, NOW + 20), NOW + 30)
    assert moved.retired and len(moved.hosted) > 10  # services kept warm, replicas hosted in place
    expired = plan(spec, _zipf(spec, 2), nodes, moved, NOW + 32)
    assert not set(moved.retired) & set(expired.retired)  # keepAlive over
    stayed = [b for b, hosts in moved.hosted.items()
              if all(h in expired.services() for h in hosts) and expired.replicas_of(b) == moved.replicas_of(b)]
    assert len(stayed) > 10 and all(set(moved.hosted[b]) <= set(expired.hosted.get(b, ())) for b in stayed)


def test_a_warm_service_moves_only_when_another_node_is_clearly_better(f):
    spec, nodes = spec_of(f, experts=NO_SCALING), f.gpu_nodes(2)
    # As observe() reads a cluster where both bundles of layer 0 ended up on node-0.
    stacked = Plan("distributed", spec.bundles(), {"l0-e0-1": ("node-0",), "l0-e2-3": ("node-0",),
                                                   "l1-e0-1": ("node-1",), "l1-e2-3": ("node-0",)}, {}, 3)
    hot = Loads({(0, 0): 100.0, (0, 2): 100.0}, 10.0, 1)
    moved = plan(spec, hot, nodes, stacked, NOW)
    assert moved.nodes["l0-e0-1"] != moved.nodes["l0-e2-3"] and moved.version == 4
    [left] = [b for b in ("l0-e0-1", "l0-e2-3") if moved.nodes[b] == ("node-1",)]
    assert moved.retired == {(left, "node-0"): Retired(1, NOW)} and moved.cv == 0.0
    # A small imbalance is not worth a cold start: layer 1 stays where it is.
    assert moved.nodes["l1-e0-1"] == ("node-1",) and moved.nodes["l1-e2-3"] == ("node-0",)
    slight = plan(spec, Loads({(0, 0): 100.0, (0, 2): 100.0, (1, 0): 30.0}, 10.0, 1), nodes, moved, NOW + 30)
    assert slight.nodes == moved.nodes and slight.version == moved.version


def test_warm_pool_scales_out_retires_reuses_and_expires(f):
    # One expert per bundle, 4 nodes of 8 GPUs; predicted loads skewed to layer 0's expert 0.
    spec = spec_of(f, experts={"bundleBytes": "128Mi", "scaling": {"keepAlive": "10m", "maxReplicasPerExpert": 4}})
    nodes = f.gpu_nodes(4)
    skewed = Loads({(0, 0): 800.0, (0, 1): 100.0, (0, 2): 100.0, (0, 3): 100.0}, 50.0, 1)
    moved = Loads({(0, 0): 100.0, (0, 1): 100.0, (0, 2): 100.0, (0, 3): 800.0}, 50.0, 1)

    hot = plan(spec, skewed, nodes, None, NOW)
    assert len(hot.nodes["l0-e0-0"]) == 4 and len(set(hot.nodes["l0-e0-0"])) == 4  # scaled out, spread
    assert hot.layers[0].cv_before > 1.0 and hot.layers[0].cv_after < 0.32 and hot.layers[1].replicas == 4
    assert decisions(Plan("distributed", spec.bundles(), {}), hot).scaled_out == {"l0-e0-0": (0, 4)}

    # The load moves to expert 3: expert 0's extra replicas leave the plan and stay warm; expert 3's
    # new replicas go in place into functions running on their nodes (GPU memory to spare).
    after_move = plan(spec, moved, nodes, hot, NOW + 60)
    assert len(after_move.nodes["l0-e0-0"]) == 1 and after_move.replicas_of("l0-e3-3") == 4
    assert len(after_move.nodes["l0-e3-3"]) == 1 and len(after_move.hosted["l0-e3-3"]) == 3
    hosts = after_move.hosted["l0-e3-3"]
    assert all(host in after_move.services() and host in hot.services() for host in hosts)
    assert len({node for _, node in hosts} | set(after_move.nodes["l0-e3-3"])) == 4  # still one a node
    gone = {("l0-e0-0", n) for n in hot.nodes["l0-e0-0"]} - {("l0-e0-0", n) for n in after_move.nodes["l0-e0-0"]}
    assert len(gone) == 3 and all(after_move.retired[k] == Retired(1, NOW + 60) for k in gone)
    change = decisions(hot, after_move)
    assert change.scaled_in == {"l0-e0-0": (4, 1)} and change.scaled_out == {"l0-e3-3": (1, 4)}
    assert change.hosted == {"l0-e3-3": hosts}
    assert set(change.retired) >= gone and change.reused == () and change.unplaced == {}

    # It comes back before keepAlive is over: expert 0 takes its warm services again.
    back = plan(spec, skewed, nodes, after_move, NOW + 300)
    assert set(back.nodes["l0-e0-0"]) == set(hot.nodes["l0-e0-0"])
    assert set(decisions(after_move, back).reused) == gone

    # Or it stays away: after keepAlive the retired services are dropped (the operator deletes them).
    kept = plan(spec, moved, nodes, after_move, NOW + 60 + 599)
    assert gone <= set(kept.retired)
    expired = plan(spec, moved, nodes, kept, NOW + 60 + 601)
    assert not gone & set(expired.retired) and gone <= set(decisions(kept, expired).expired)


def test_services_of_bundles_a_spec_change_removed_are_not_kept_warm_or_counted(f):
    # bundleBytes changed: the running and retired services name bundles the new spec does not have; no
    # render has them, so the operator deletes them now, and the plan must not count them as warm.
    old = spec_of(f, experts={"bundleBytes": "128Mi", "scaling": {"keepAlive": "10m", "maxReplicasPerExpert": 4}})
    nodes = f.gpu_nodes(4)
    hot = plan(old, Loads({(0, 0): 800.0, (0, 1): 100.0, (0, 2): 100.0, (0, 3): 100.0}, 50.0, 1), nodes, None, NOW)
    cooled = plan(old, Loads(), nodes, hot, NOW + 60)
    assert cooled.retired  # expert 0's extra replicas, warm
    new = spec_of(f, experts={"bundleBytes": "256Mi", "scaling": {"keepAlive": "10m", "maxReplicasPerExpert": 4}})
    renamed = plan(new, Loads(), nodes, cooled, NOW + 120)
    names = {b.name for b in new.bundles()}
    assert not {b for b, _ in cooled.services()} & names  # every bundle was renamed
    assert renamed.retired == {} and renamed.gpus_held == renamed.replicas
    assert set(decisions(cooled, renamed).expired) >= set(cooled.retired)  # said as they go


def test_a_new_service_only_where_no_running_function_has_room(f):
    spec = spec_of(f, experts={"bundleBytes": "128Mi", "scaling": {"maxReplicasPerExpert": 4}})
    flat = Loads({(0, e): 100.0 for e in range(4)}, 50.0, 1)
    hot = Loads({(0, 0): 800.0, (0, 1): 100.0, (0, 2): 100.0, (0, 3): 100.0}, 50.0, 1)
    first = plan(spec, hot, f.gpu_nodes(4), None, NOW)
    assert first.hosted == {}  # nothing ran before: every replica a service of its own
    # Unlabelled GPU memory: no room is known, so scale-out replicas get services (cold starts).
    unknown = [NodeInfo(f"node-{i}", 8, None) for i in range(4)]
    even = plan(spec, flat, unknown, None, NOW)
    assert plan(spec, hot, unknown, even, NOW + 60).hosted == {}
    # With room: in place, and the version moves with the hosting (the routing table changes).
    even = plan(spec, flat, f.gpu_nodes(4), None, NOW)
    hosted = plan(spec, hot, f.gpu_nodes(4), even, NOW + 60)
    assert hosted.replicas_of("l0-e0-0") == 4 and len(hosted.hosted["l0-e0-0"]) == 3 and hosted.version == even.version + 1
    again = plan(spec, hot, f.gpu_nodes(4), hosted, NOW + 90)
    assert again.hosted == hosted.hosted and again.version == hosted.version


def test_retired_services_hold_their_gpus_and_extra_replicas_that_fit_nowhere_are_listed(f):
    spec = spec_of(f, experts={"bundleBytes": "128Mi", "gpus": 4, "scaling": {"maxReplicasPerExpert": 4}})
    nodes = f.gpu_nodes(2, gpus=8)  # 4 slots in all, 8 bundles: not even one replica each
    with pytest.raises(PlanError, match="fit on no node") as full:
        plan(spec, Loads(), nodes, None, NOW)
    assert full.value.reason == "InsufficientCapacity"
    nodes = f.gpu_nodes(5, gpus=8)  # 10 slots: every bundle once, two left for scale-out
    skewed = Loads({(0, 0): 1000.0, (0, 1): 1.0}, 10.0, 1)
    p = plan(spec, skewed, nodes, None, NOW)
    assert len(p.nodes) == 8 and p.nodes["l0-e0-0"] and p.unplaced == {"l0-e0-0": 1} and p.replicas == 10
    assert decisions(Plan("distributed", spec.bundles(), {}), p).unplaced == {"l0-e0-0": 1}
    # A retired service keeps its slot until keepAlive is over: still no room for the third replica.
    again = plan(spec, skewed, nodes, Plan("distributed", spec.bundles(), p.nodes,
                                           {("l1-e3-3", "node-4"): Retired(1, NOW)}, p.version), NOW + 1)
    assert sum(again.unplaced.values()) >= 1


def test_placement_respects_selector_taints_and_gpu_capacity(f):
    tainted = NodeInfo("tainted", 8, None, taints=({"key": "nvidia.com/gpu", "effect": "NoSchedule"},))
    other = NodeInfo("a100", 8, None, labels={"nvidia.com/gpu.product": "A100"})
    h100 = NodeInfo("h100", 8, None, labels={"nvidia.com/gpu.product": "H100"})
    spec = spec_of(f, experts={"runtime": "pods", "bundleBytes": "256Mi",
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


def test_auto_mode_offloads_on_single_gpu_nodes_too_few_for_the_bundles(f):
    spec = spec_of(f, mode="auto", offload={"gpuMemoryBudget": "20Gi"})
    offload = plan(spec, Loads(), f.gpu_nodes(2, gpus=1), None, NOW)  # 4 bundles of a whole GPU each
    assert offload.mode == "offload" and offload.replicas == 0 and offload.services() == {}
    assert offload.gpu_budget == 20 * 2**30
    assert plan(spec, Loads(), f.gpu_nodes(2, gpus=8), None, NOW).mode == "distributed"


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


def test_no_replica_is_made_for_less_than_the_knee_per_call(f):
    """With the frontends' passes known, a replica must get at least the expert curve's knee (~220 tokens in
    bfloat16, x2 for these two-expert bundles) per call: 1000 tokens/s over 1 pass/s make 2 parts of 500,
    not 3 of 333; without passes every part counts, as before."""
    spec = spec_of(f, experts={"scaling": {"maxReplicasPerExpert": 3}})
    knee = min_replica_load(spec, Loads({}, 0.0, 1, 1.0), 1)
    assert knee == 221 and min_replica_load(spec, Loads({}, 0.0, 1, 2.0), 2) == 4 * knee
    assert min_replica_load(spec, Loads(), 2) == 0.0
    skewed = {(0, 0): 1000.0, (0, 2): 1.0}
    assert len(plan(spec, Loads(skewed, 10.0, 1, 1.0), f.gpu_nodes(2), None, NOW).nodes["l0-e0-1"]) == 2
    assert len(plan(spec, Loads(skewed, 10.0, 1), f.gpu_nodes(2), None, NOW).nodes["l0-e0-1"]) == 3


def test_scaling_obeys_the_spec_caps(f):
    skewed = Loads({(0, 0): 1000.0, (0, 2): 1.0}, 10.0, 1)
    capped = plan(spec_of(f, experts={"scaling": {"maxReplicasPerExpert": 3}}), skewed, f.gpu_nodes(2), None, NOW)
    assert len(capped.nodes["l0-e0-1"]) == 3
    # 128 MiB experts, two a bundle: a 1 GiB layer cap holds 4 bundle replicas, 2 of them the layer's own.
    memory = plan(spec_of(f, experts={"scaling": {"layerMemoryCap": "1Gi"}}), skewed, f.gpu_nodes(2), None, NOW)
    assert len(memory.nodes["l0-e0-1"]) == 3 and len(memory.nodes["l0-e2-3"]) == 1
    loose = plan(spec_of(f, experts={"scaling": {"cvThreshold": 1.0}}), skewed, f.gpu_nodes(2), None, NOW)
    assert loose.replicas == 4


@pytest.mark.parametrize("nodes", [1, 2, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_plan_is_never_short_of_replicas_under_the_loads_it_was_made_with(f, nodes, seed):
    """What the operator checks every second between re-plans (handlers.between_ticks): were a plan short
    under its own loads, it would re-plan every second for nothing. One node leaves replicas unplaced."""
    spec = spec_of(f, experts={"bundleBytes": "128Mi", "scaling": {"maxReplicasPerExpert": 4}})
    loads = _zipf(spec, seed)
    p = plan(spec, loads, f.gpu_nodes(nodes), None, NOW)
    assert short_of_replicas(spec, p, loads) == []
    assert p.replicas > len(p.bundles) or p.unplaced  # it did scale out (or wanted to)


def test_loads_that_move_the_hot_experts_leave_the_plan_short_and_loads_that_cool_do_not(f):
    spec = spec_of(f, experts={"bundleBytes": "128Mi", "scaling": {"maxReplicasPerExpert": 4}})
    nodes, skewed = f.gpu_nodes(4), _zipf(spec, 0)
    p = plan(spec, skewed, nodes, None, NOW)
    moved = _zipf(spec, 1)
    short = short_of_replicas(spec, p, moved)
    again = plan(spec, moved, nodes, p, NOW + 1)
    assert short and all(again.replicas_of(b) > p.replicas_of(b) for b in short)
    even = Loads({key: 10.0 for key in skewed.per_expert}, 5000.0, 4)  # cooler: fewer replicas wanted, not more
    assert short_of_replicas(spec, p, even) == [] and plan(spec, even, nodes, p, NOW + 1).replicas < p.replicas
    assert short_of_replicas(spec, p, Loads()) == []  # no frontend answered: nothing to go by
