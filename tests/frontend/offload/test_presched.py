"""PreSched (LayerScope Algorithm 1) on hand-worked cases.

Unless a test says otherwise: t_io = 2, t_g(n) = 0.5, t_c(n) = n + 1, next layer's attention 1.
Notation: T_G / T_C are the window's GPU and CPU sums of step 2; span(k) is this layer's makespan
max(GPU side, CPU side) with its k missing experts with most tokens loaded (step 4).
"""

import math
import random
from dataclasses import replace

import pytest

from kubemoe.frontend.offload.costs import CostLine
from kubemoe.frontend.offload.presched import PreSched, prefetch_count


def test_all_resident_nothing_moves(make_demand, costs):
    # Both layers fully resident: no candidates, nothing to load or prefetch, and no layer beyond.
    schedule = PreSched().schedule(make_demand({0: 5, 1: 3}, {0, 1}, [{2: 4}], [{2}]), costs)
    assert (schedule.gpu, schedule.load, schedule.cpu, schedule.prefetch) == ((0, 1), (), (), ())


def test_all_resident_the_idle_copy_engine_prefetches_the_next_layer(make_demand, costs):
    # This layer resident: T_G = t_g + t_g = 1.0; next layer missing {2: 4, 3: 1}: T_C = 5 + 2 = 7.
    # Sorted: e2 (4), e3 (1). 1 < 7: e2 moves (T_G 3.5, T_C 2); 3.5 >= 2: stop. Prefetchable: [e2].
    # k = 0, span = 1.0, no copies: T_gap = 1.0; f = (1.0 + 1.0) / 2 = 1.
    schedule = PreSched().schedule(make_demand({0: 5, 1: 3}, {0, 1}, [{2: 4, 3: 1}]), costs)
    assert schedule.gpu == (0, 1) and schedule.load == () and schedule.prefetch == ((1, 2),)


def test_nothing_resident(make_demand, costs):
    # Sorted: (this e0, 8) (next e3, 6) (this e1, 4) (next e4, 2) (this e2, 1).
    # T_C = 9 + 7 + 5 + 3 + 2 = 26, T_G = 0. e0 moves: T_G 2.5, T_C 17; e3: 5, 10; e1: 7.5, 5; stop.
    # This layer's loads: e0, e1 (k = 2). Re-check: span(1) = max(2.5, 5 + 2) = 7, span(2) = max(5, 2) = 5,
    # span(3) = max(7.5, 0) = 7.5: k stays 2. T_gap = 5 - 2 copies x 2 = 1; f = (1 + 1) / 2 = 1: prefetch e3.
    schedule = PreSched().schedule(make_demand({0: 8, 1: 4, 2: 1}, ahead=[{3: 6, 4: 2}]), costs)
    assert (schedule.gpu, schedule.load, schedule.cpu, schedule.prefetch) == ((0, 1), (0, 1), (2,), ((1, 3),))


def test_cpu_is_faster_for_small_token_counts(make_demand, make_costs):
    costs = make_costs(beta=0.5, c=0.5)  # t_c(1) = 1 < t_io + t_g = 2.5
    # Window: T_C = 2, T_G = 0: e0 moves (T_G 2.5, T_C 1), stop: k = 1. Re-check: span(1) = max(2.5, 1) = 2.5,
    # span(0) = max(0, 1 + 1) = 2 is shorter: both one-token experts go back to the CPU.
    schedule = PreSched().schedule(make_demand({0: 1, 1: 1}), costs)
    assert schedule.gpu == () and schedule.cpu == (0, 1)
    # With 20 tokens, e0 is worth its copy: span(1) = max(2.5, 1) beats span(0) = 10.5 + 1 and span(2) = 5.
    schedule = PreSched().schedule(make_demand({0: 20, 1: 1}), costs)
    assert schedule.load == (0,) and schedule.cpu == (1,)


def test_experts_on_the_device_priced_grouped_leave_the_gpu_free_for_a_copy(make_demand, make_costs):
    # Eight resident one-token experts and a missing one with 4 tokens (t_c = 5). Priced one FFN each, the
    # resident ones keep the GPU busy 8 x 0.5 = 4: span(0) = max(4, 5) = 5 beats span(1) = 4 + 2 + 0.5 = 6.5, so
    # e8 runs on the CPU. As one grouped FFN they take 8 x 0.05 = 0.4: span(1) = 0.4 + 2.5 = 2.9 beats 5.
    demand = make_demand({**{e: 1 for e in range(8)}, 8: 4}, resident=range(8))
    alone = make_costs()
    assert PreSched().schedule(demand, alone).cpu == (8,)
    grouped = replace(alone, grouped=CostLine(0.0, 0.05))
    schedule = PreSched().schedule(demand, grouped)
    assert schedule.load == (8,) and schedule.cpu == ()


def test_loads_priced_as_the_grouped_batches_they_run_in(make_demand, make_costs):
    # Eight missing one-token experts, t_io = 0.1, one FFN alone 0.5, on the CPU 0.6 each (T_C = 4.8).
    # Priced alone, a load costs the GPU what it saves the CPU (0.6): T_G reaches T_C at four loads, and
    # span(4) = max(2.4, 2.4) is the shortest. Loads run as one grouped FFN from four on (0.05 each):
    # the GPU side is 0.15 k at k >= 4 against the CPU's 0.6 (8 - k): span(7) = max(1.05, 0.6) is the shortest.
    demand = make_demand({e: 1 for e in range(8)})
    alone = make_costs(t_io=0.1, beta=0.0, c=0.6)
    assert len(PreSched().schedule(demand, alone).load) == 4
    schedule = PreSched().schedule(demand, replace(alone, grouped=CostLine(0.0, 0.05)))
    assert schedule.load == tuple(range(7)) and schedule.cpu == (7,)


@pytest.mark.parametrize(("t_attn", "xi", "expected"), [
    # f = (T_gap 0.5 + t_attn) / 2: 1.4 has fraction 0.4, 1.6 has 0.6; round up when fraction > 1 - xi.
    (2.3, 0.3, 1), (2.3, 0.5, 1), (2.3, 0.7, 2),
    (2.7, 0.3, 1), (2.7, 0.5, 2), (2.7, 0.7, 2),
])
def test_prefetch_count_rounding_follows_xi(make_demand, costs, t_attn, xi, expected):
    # This layer: e0 resident (T_G = 0.5). Next: {1: 9, 2: 8, 3: 7, 4: 6} missing, T_C = 10 + 9 + 8 + 7 = 34.
    # e1 moves (3, 24), e2 (5.5, 15), e3 (8, 7), stop: prefetchable e1, e2, e3. span = 0.5, no copies.
    demand = make_demand({0: 4}, {0}, [{1: 9, 2: 8, 3: 7, 4: 6}], t_attn=t_attn)
    assert PreSched(xi=xi).schedule(demand, costs).prefetch == ((1, 1), (1, 2))[:expected]


def test_prefetch_count_edges():
    assert prefetch_count(4.0, 2.0, 0.99) == 2 and prefetch_count(4.0, 2.0, 0.0) == 2  # exact: no rounding
    assert prefetch_count(2.2, 2.0, 1.0) == 2 and prefetch_count(3.8, 2.0, 0.0) == 1
    assert prefetch_count(1.0, 0.0, 0.5) == math.inf  # free copies


def test_prefetch_is_capped_by_the_slots(make_demand, costs):
    demand = make_demand({0: 4}, {0}, [{1: 9, 2: 8, 3: 7, 4: 6}], t_attn=20.0, slots=1)
    assert PreSched().schedule(demand, costs).prefetch == ((1, 1),)


def test_on_demand_loads_are_monotone_in_tokens(make_demand, make_costs):
    # Step 3 alone: a window that chose the third-largest expert loads the two larger ones too.
    demand = make_demand({0: 10, 1: 1, 2: 6, 3: 3})  # missing by tokens: e0, e2, e3, e1
    # Candidates are (-tokens, offset, expert): this layer's e3 (3 tokens) and the next layer's e7 (20).
    assert PreSched.monotone_loads(demand, [(-3, 0, 3), (-20, 1, 7)]) == 3
    assert PreSched.monotone_loads(demand, [(-20, 1, 7)]) == 0
    # And end to end on random layers: no CPU expert has more tokens than a loaded one.
    rng = random.Random(0)
    for _ in range(200):
        pending = {e: rng.randint(1, 40) for e in rng.sample(range(16), rng.randint(1, 8))}
        ahead = [{e: rng.randint(1, 40) for e in rng.sample(range(16), 4)}]
        resident = set(rng.sample(sorted(pending), rng.randint(0, len(pending))))
        cost = make_costs(t_io=rng.uniform(0.5, 20), beta=rng.uniform(0.1, 2))
        schedule = PreSched(xi=rng.random()).schedule(make_demand(pending, resident, ahead), cost)
        schedule.check(make_demand(pending, resident, ahead))
        if schedule.load and schedule.cpu:
            assert min(pending[e] for e in schedule.load) >= max(pending[e] for e in schedule.cpu)


def test_window_extends_when_the_next_layer_needs_no_prefetch(make_demand, costs):
    # Next layer's only expert e1 is resident: depth 1 has no candidates. Depth 2: T_G = t_g(4) + t_g(5) = 1,
    # candidate (layer 2, e2, 6): T_C = 7; it moves. span = 0.5: f = (0.5 + 1.5) / 2 = 1: prefetch (2, e2).
    demand = make_demand({0: 4}, {0}, [{1: 5}, {2: 6}], [{1}, ()], t_attn=1.5)
    assert PreSched().schedule(demand, costs).prefetch == ((2, 2),)
    assert PreSched(extend_window=False).schedule(demand, costs).prefetch == ()


@pytest.mark.parametrize(("t_attn", "filled", "bare"), [
    (1.0, ((1, 3),), ((1, 3),)),  # f = 1: the queue's own prefetch uses it
    (3.0, ((1, 3), (1, 2)), ((1, 3),)),  # f = 2: the second copy would idle without step 7
])
def test_idle_copies_go_to_the_window_s_other_predicted_experts(make_demand, costs, t_attn, filled, bare):
    # Sorted: (this e0, 6) (this e1, 5) (next e3, 3) (next e2, 1). T_C = 7 + 6 + 4 + 2 = 19, T_G = 0.
    # e0 moves (2.5, 12), e1 (5, 6), e3 (7.5, 2); stop: prefetchable [e3], e2 stays on the CPU side.
    # k = 2: span(2) = max(5, 0) = 5 < span(1) = 6. T_gap = 5 - 2 x 2 = 1; f = (1 + t_attn) / 2.
    demand = make_demand({0: 6, 1: 5}, ahead=[{2: 1, 3: 3}], t_attn=t_attn)
    assert PreSched().schedule(demand, costs).prefetch == filled
    assert PreSched(fill_idle_copies=False).schedule(demand, costs).prefetch == bare


def test_idle_copies_are_filled_when_the_queue_prefetches_nothing(make_demand, costs):
    # Sorted: (this e0, 6) (this e1, 5) (next e2, 1). T_C = 7 + 6 + 2 = 15: e0 moves (2.5, 8), e1 (5, 2); stop.
    # The queue holds no next-layer expert; k = 2, T_gap = 5 - 4 = 1, f = (1 + 1) / 2 = 1: one copy is idle.
    demand = make_demand({0: 6, 1: 5}, ahead=[{2: 1}])
    assert PreSched().schedule(demand, costs).prefetch == ((1, 2),)
    assert PreSched(fill_idle_copies=False).schedule(demand, costs).prefetch == ()


def test_invalid_xi():
    with pytest.raises(ValueError, match="xi"):
        PreSched(xi=1.5)


def test_no_expert_goes_to_the_cpu_when_the_gpu_would_finish_it_sooner(make_demand, make_costs):
    # On random layers: the CPU side holds an expert only where loading it too would not shorten the layer
    # (its t_c is more than the copy it saves waits for), and an expert whose t_c alone exceeds the GPU side
    # with every missing expert loaded (resident t_g + k_all x t_io + their t_g) never runs on the CPU.
    from kubemoe.frontend.offload.policy import PrefixSpans

    rng = random.Random(1)
    for _ in range(300):
        pending = {e: rng.randint(1, 60) for e in rng.sample(range(16), rng.randint(1, 8))}
        ahead = [{e: rng.randint(1, 60) for e in rng.sample(range(16), 4)}]
        resident = set(rng.sample(sorted(pending), rng.randint(0, len(pending))))
        cost = make_costs(t_io=rng.uniform(0.2, 20), t_g=rng.uniform(0.01, 1), beta=rng.uniform(0.01, 2),
                          c=rng.uniform(0.1, 10))
        demand = replace(make_demand(pending, resident, ahead, t_attn=rng.uniform(0, 5)),
                         host_gap=rng.choice([0.0, rng.uniform(0, 5)]))
        schedule = PreSched(xi=rng.random()).schedule(demand, cost)
        prefix = PrefixSpans(demand, cost)
        spans = [prefix.finish(k) for k in range(len(prefix))]
        k = len(schedule.load)
        if schedule.cpu:
            assert spans[k + 1] >= spans[k] - 1e-12, "loading the next CPU expert as well would finish the layer sooner"
        everything_loaded = prefix.times(len(prefix) - 1).gpu
        for e in schedule.cpu:
            assert cost.t_c(pending[e]) + demand.host_gap <= everything_loaded + 1e-12


def test_the_host_gap_keeps_experts_off_the_cpu_when_the_gpu_side_runs_during_it(make_demand, costs):
    # Two missing one-token experts (t_c = 2 each), nothing resident, no next layer.
    # Without a host gap: T_C = 4, T_G = 0: e0 moves (T_G 2.5, T_C 2); 2.5 >= 2: stop. span(1) = max(2.5, 2) = 2.5
    # beats span(0) = 4 and span(2) = 5: e1 runs on the CPU.
    demand = make_demand({0: 1, 1: 1})
    assert PreSched().schedule(demand, costs).cpu == (1,)
    # The host needs 4 between this layer and the next gate, and waits for CPU experts before it starts:
    # e0 moves (T_G 2.5 < 4 + 4), then e1 (2.5 < 2 + 4). finish(1) = max(2.5, 2 + 4) = 6 against finish(2) =
    # max(5, 0) = 5: both are copied, and their copies run while the host launches the next layer.
    schedule = PreSched().schedule(replace(demand, host_gap=4.0), costs)
    assert schedule.load == (0, 1) and schedule.cpu == ()
    # Where copies are slow (t_io = 20), the CPU still takes what the GPU side would make the host wait for.
    assert PreSched().schedule(replace(demand, host_gap=4.0), replace(costs, t_io=20.0)).cpu == (0, 1)


def test_each_prefix_span_is_the_sum_of_its_experts_costs(make_demand, make_costs):
    # PrefixSpans prices k loads in O(1) from token prefix sums; by definition the GPU side is the resident experts'
    # t_g_all, k copies and the loads' t_g_all (one grouped FFN from GROUPED_MIN_EXPERTS on), the CPU side the rest's t_c.
    from kubemoe.frontend.offload.policy import PrefixSpans

    rng = random.Random(2)
    for _ in range(300):
        pending = {e: rng.randint(1, 60) for e in rng.sample(range(32), rng.randint(1, 16))}
        resident = set(rng.sample(sorted(pending), rng.randint(0, len(pending))))
        cost = make_costs(t_io=rng.uniform(0.2, 20), t_g=rng.uniform(0.01, 1), beta=rng.uniform(0.01, 2), c=rng.uniform(0.1, 10))
        cost = replace(cost, gpu=CostLine(rng.uniform(0, 0.1), cost.gpu.intercept),
                       grouped=rng.choice([None, CostLine(rng.uniform(0, 0.01), rng.uniform(0, 0.2))]))
        demand = replace(make_demand(pending, resident), host_gap=rng.choice([0.0, rng.uniform(0, 5)]))
        missing = [n for _, n in demand.missing()]
        resident_t_g = cost.t_g_all([n for _, n in demand.resident_pending()])
        spans = PrefixSpans(demand, cost)
        assert len(spans) == len(missing) + 1
        for k in range(len(spans)):
            times = spans.times(k)
            assert times.gpu == pytest.approx(resident_t_g + k * cost.t_io + cost.t_g_all(missing[:k]))
            assert times.cpu == pytest.approx(sum(cost.t_c(n) for n in missing[k:]))
            assert times.copies == pytest.approx(k * cost.t_io)
            assert times.held == (demand.host_gap if k < len(missing) else 0.0)
            assert spans.finish(k) == times.finish
