import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubemoe.planning.baselines import (balanced_packing, eplb, oracle_layer_seconds, rebalance_experts,
                                        replicate_experts, static_ep)
from kubemoe.planning.latency import MIXTRAL_EXPERT_BYTES, MIXTRAL_FLOPS_PER_TOKEN, ExpertCurve, LatencyModel
from kubemoe.planning.placer import GPU

MIB = 2**20


def test_static_ep_deals_round_robin():
    pool = [GPU(f"g{i}", "n0", 10 * MIB) for i in range(3)]
    p = static_ep([[1.0] * 4, [1.0] * 4], pool, MIB)
    assert [p.gpu_of[(0, e, 0)] for e in range(4)] == ["g0", "g1", "g2", "g0"]
    assert p.gpu_of[(1, 0, 0)] == "g1" and len(p.gpu_of) == 8


def test_eplb_pieces_by_hand():
    assert replicate_experts([6.0, 2.0, 1.0], 5) == [0, 1, 2, 0, 0]  # 6 -> 3 | 2 -> ...
    assert balanced_packing([5.0, 4.0, 3.0, 2.0], 2) == [0, 1, 1, 0]
    # Hierarchical: 2 nodes x 2 GPUs, 4 groups of 2 experts; the hot group and its replicas stay on one node.
    plan = rebalance_experts([[8, 8, 1, 1, 1, 1, 1, 1]], 12, num_groups=4, num_nodes=2, num_gpus=4)
    node_of = {e: g // 2 for e, g in zip(plan.phy2log[0], plan.gpu_of[0])}
    assert node_of[0] == node_of[1] and plan.logcnt[0][0] == plan.logcnt[0][1] > 1


def test_eplb_refuses_impossible_layouts_with_a_reason():
    with pytest.raises(ValueError, match="logical experts"):
        rebalance_experts([[1, 1, 1, 1]], 3, 1, 1, 2)
    with pytest.raises(ValueError, match="groups"):
        rebalance_experts([[1, 1, 1, 1]], 4, 3, 1, 2)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), experts=st.sampled_from([4, 8, 16]), groups=st.sampled_from([1, 2, 4]),
       nodes=st.sampled_from([1, 2, 4]), gpus_per_node=st.integers(1, 4), redundant=st.integers(0, 12))
def test_eplb_fills_exactly_the_slots_and_covers_every_expert(data, experts, groups, nodes, gpus_per_node, redundant):
    weight = data.draw(st.lists(st.lists(st.floats(0, 1e3), min_size=experts, max_size=experts), min_size=1, max_size=3))
    slots, gpus = experts + redundant, nodes * gpus_per_node
    plan = rebalance_experts(weight, slots, groups, nodes, gpus)
    for phy2log, gpu_of, logcnt in zip(plan.phy2log, plan.gpu_of, plan.logcnt):
        assert len(phy2log) == slots == sum(logcnt) and set(phy2log) == set(range(experts))
        assert all(phy2log.count(e) == logcnt[e] for e in range(experts))
        per_gpu = np.bincount(gpu_of, minlength=gpus)
        assert per_gpu.max() <= math.ceil(slots / gpus)  # and exactly slots / gpus when they divide
        if slots % gpus == 0 and (groups % nodes or slots % nodes == 0):
            assert set(per_gpu) == {slots // gpus}


def test_eplb_placement_spreads_small_layers_over_many_gpus():
    pool = [GPU(f"g{i}", f"n{i // 8}", 10 * MIB) for i in range(16)]
    p = eplb([[1.0] * 4] * 4, pool, MIB, redundant=0)
    assert p.gpus_used() == 16


def test_oracle_is_a_lower_bound_of_any_layout():
    model = LatencyModel(ExpertCurve(MIXTRAL_EXPERT_BYTES, MIXTRAL_FLOPS_PER_TOKEN), token_bytes=8192)
    tokens = np.array([[4000.0, 100, 50, 10, 0, 0, 0, 0]])
    static = model.layer_seconds(np.arange(8), tokens)
    assert oracle_layer_seconds(model, tokens, 8)[0] < static[0]
    assert oracle_layer_seconds(model, np.zeros((1, 8)), 8)[0] == 0.0
