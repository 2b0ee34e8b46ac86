"""The baseline policies and the shared interface, on small hand-worked layers.

Costs: t_io = 2, t_g(n) = 0.5, t_c(n) = n + 1. The common layer: pending {0: 8, 1: 4, 2: 1} with e1
resident; next layer predicted {3: 6, 4: 2, 5: 1} with e4 resident; two prefetch slots.
"""

from dataclasses import replace

import pytest

from kubemoe.frontend.offload.baselines import FiddlerLike, GatePrefetch, HybriMoELike, OnDemand, Oracle, StaticSplit
from kubemoe.frontend.offload.policy import Schedule


@pytest.fixture
def layer(make_demand):
    return make_demand({0: 8, 1: 4, 2: 1}, {1}, [{3: 6, 4: 2, 5: 1}], [{4}], slots=2)


def parts(schedule):
    return schedule.gpu, schedule.load, schedule.cpu, schedule.prefetch


def test_on_demand_loads_every_missing_expert(layer, costs):
    assert parts(OnDemand().schedule(layer, costs)) == ((1, 0, 2), (0, 2), (), ())


def test_gate_prefetch_fills_the_slots_with_the_predicted_next_layer(layer, costs):
    # Missing next: e3 (6), e5 (1); e4 is resident.
    assert parts(GatePrefetch().schedule(layer, costs)) == ((1, 0, 2), (0, 2), (), ((1, 3), (1, 5)))


def test_fiddler_computes_on_the_cpu_what_is_faster_there(layer, costs):
    # e0: t_c = 9 >= t_io + t_g = 2.5: loaded. e2: t_c = 2 < 2.5: CPU.
    assert parts(FiddlerLike().schedule(layer, costs)) == ((1, 0), (0,), (2,), ())


def test_hybrimoe_balances_greedily_and_prefetches_two(layer, costs, make_demand):
    # GPU side starts at t_g(e1) = 0.5. e0: GPU would end at 3.0, CPU at 9: GPU. e2: GPU 5.5, CPU 2: CPU.
    assert parts(HybriMoELike().schedule(layer, costs)) == ((1, 0), (0,), (2,), ((1, 3), (1, 5)))
    # Where Fiddler loads all three (t_c = 4 >= 2.5 each), the greedy split keeps one on the CPU:
    # e0 GPU 2.5 vs CPU 4: GPU; e1 GPU 5.0 vs CPU 4: CPU; e2 GPU 5.0 vs CPU 8: GPU.
    even = make_demand({0: 3, 1: 3, 2: 3})
    assert parts(HybriMoELike().schedule(even, costs)) == ((0, 2), (0, 2), (1,), ())
    assert FiddlerLike().schedule(even, costs).load == (0, 1, 2)


def test_static_split_keeps_whole_layers_on_the_gpu(costs, make_demand):
    # 4 experts x 10 bytes per layer: 85 bytes hold layers 0 and 1 whole.
    static = StaticSplit.layers_that_fit([0, 1, 2], 4, 10, 85)
    assert static.resident == {(l, e) for l in (0, 1) for e in range(4)}
    on_gpu = make_demand({0: 2, 3: 5}, {0, 1, 2, 3}, layer=1)
    on_cpu = make_demand({0: 2, 3: 5}, (), layer=2)
    assert parts(static.schedule(on_gpu, costs)) == ((3, 0), (), (), ())
    assert parts(static.schedule(on_cpu, costs)) == ((), (), (3, 0), ())


def test_oracle_takes_the_best_split_and_prefetches_what_the_next_layer_will_load(costs, make_demand):
    # This layer: span(0) = 16, span(1) = max(2.5, 7) = 7, span(2) = max(5, 2) = 5, span(3) = 7.5: k = 2.
    # Next layer (actual {3: 6, 4: 2}): span(0) = 10, span(1) = max(2.5, 3) = 3, span(2) = 5: it loads e3.
    demand = make_demand({0: 8, 1: 4, 2: 1}, ahead=[{3: 6, 4: 2}])
    assert Oracle.clairvoyant
    assert parts(Oracle().schedule(demand, costs)) == ((0, 1), (0, 1), (2,), ((1, 3),))


def test_the_oracle_splits_by_when_the_next_layer_can_start(make_demand, costs):
    # Two missing one-token experts (t_c = 2): span(1) = max(2.5, 2) = 2.5 is the paper's best split, but with a
    # host gap of 4 after the CPU side, finish(1) = max(2.5, 2 + 4) = 6 loses to loading both, finish(2) = 5;
    # the next layer ({2: 1, 3: 1}) is priced with the same gap: both prefetched.
    demand = replace(make_demand({0: 1, 1: 1}, ahead=[{2: 1, 3: 1}]), host_gap=4.0)
    assert parts(Oracle().schedule(demand, costs)) == ((0, 1), (0, 1), (), ((1, 2), (1, 3)))
    assert parts(Oracle().schedule(replace(demand, host_gap=0.0), costs)) == ((0,), (0,), (1,), ((1, 2),))


def test_every_policy_gives_a_valid_schedule_with_or_without_a_next_layer(layer, costs, make_demand):
    last = make_demand({0: 8, 1: 4, 2: 1}, {1})
    for policy in (OnDemand(), GatePrefetch(), FiddlerLike(), HybriMoELike(), Oracle(), StaticSplit(frozenset())):
        for demand in (layer, last):
            policy.schedule(demand, costs).check(demand)


def test_invalid_schedules_are_refused(layer):
    with pytest.raises(ValueError, match="exactly once"):
        Schedule((1, 0), (0,), ()).check(layer)  # e2 is nowhere
    with pytest.raises(ValueError, match="not resident"):
        Schedule((1, 0, 2), (0,), ()).check(layer)  # e2 on the GPU without a copy
    with pytest.raises(ValueError, match="already resident"):
        Schedule((1, 0), (0,), (2,), ((1, 4),)).check(layer)
    with pytest.raises(ValueError, match="prefetch slots"):
        Schedule((1, 0), (0,), (2,), ((1, 3), (1, 5), (1, 6))).check(layer)
