"""The step-time model on hand-worked timelines.

Costs: t_io = 2 (100-byte experts at 50 B/s), t_g(n) = 0.5, t_c(n) = n + 1, attention 1 per layer.
A timeline line reads `what: start -> end`.
"""

import random
from dataclasses import replace

import pytest

from kubemoe.frontend.offload.baselines import FiddlerLike, GatePrefetch, OnDemand, Oracle
from kubemoe.frontend.offload.costs import CostLine, OffloadProfile
from kubemoe.frontend.offload.pipeline import LayerRouting, StepTrace, simulate, simulate_step, step_lower_bound
from kubemoe.frontend.offload.presched import PreSched


@pytest.fixture
def profile(make_costs):
    return OffloadProfile("model", (make_costs(),), CostLine(0.0, 1.0), source="assumed")


def step(*layers, tokens=4):
    """layers: (actual, predicted) per layer."""
    return StepTrace(tokens, tuple(LayerRouting(i, a, p) for i, (a, p) in enumerate(layers)))


def run(policy, trace_step, profile, resident=frozenset(), slots=1):
    return simulate_step(trace_step, policy, profile, 100, frozenset(resident), slots)


def test_on_demand_copies_one_after_another_through_two_buffers(profile):
    # attn 0 -> 1; copy e0 1 -> 3, compute 3 -> 3.5; copy e1 3 -> 5, compute 5 -> 5.5;
    # copy e2 5 -> 7 (its buffer, e0's, was free at 3.5), compute 7 -> 7.5.
    stats = run(OnDemand(), step(({0: 3, 1: 2, 2: 1}, {})), profile)
    assert stats.seconds == 7.5 and stats.copies == 3 and stats.hits == 0 and stats.activated == 3
    assert [c[3:] for c in stats.copy_log] == [(1, 3), (3, 5), (5, 7)]


def test_a_third_load_waits_for_its_buffer(profile, make_costs):
    slow_gpu = OffloadProfile("model", (make_costs(t_g=3.0),), CostLine(0.0, 1.0))
    # copy e0 1 -> 3, compute 3 -> 6; copy e1 3 -> 5, compute 6 -> 9; e2 goes into e0's buffer, free at 6:
    # copy 6 -> 8 (not 5 -> 7), compute 9 -> 12.
    stats = run(OnDemand(), step(({0: 3, 1: 2, 2: 1}, {})), slow_gpu)
    assert [c[3:] for c in stats.copy_log] == [(1, 3), (3, 5), (6, 8)] and stats.seconds == 12


def test_loads_that_group_are_priced_as_their_shares_of_one_grouped_ffn(make_costs):
    grouped = OffloadProfile("model", (replace(make_costs(t_g=3.0), grouped=CostLine(0.0, 0.25)),), CostLine(0.0, 1.0))
    # Four loads group: each computes in its 0.25 share. copy e0 1 -> 3, compute 3 -> 3.25; e1 3 -> 5, 5 -> 5.25;
    # e2 5 -> 7, 7 -> 7.25; e3 7 -> 9, 9 -> 9.25. Three do not: one FFN each, as test_a_third_load_waits_for_its_buffer.
    assert run(OnDemand(), step(({0: 4, 1: 3, 2: 2, 3: 1}, {})), grouped).seconds == 9.25
    assert run(OnDemand(), step(({0: 3, 1: 2, 2: 1}, {})), grouped).seconds == 12


def test_cpu_experts_run_beside_the_gpu(profile):
    # Fiddler: e0 (t_c 9 >= 2.5) is loaded: copy 1 -> 3, compute 3 -> 3.5. e1 (t_c 2) on the CPU: 1 -> 3.
    stats = run(FiddlerLike(), step(({0: 8, 1: 1}, {})), profile)
    assert stats.seconds == 3.5 and stats.cpu_tokens == 1 and stats.gpu_tokens == 8


def test_resident_experts_need_no_copy(profile):
    # attn 0 -> 1, e0 resident: 1 -> 1.5.
    stats = run(OnDemand(), step(({0: 3}, {})), profile, resident={(0, 0)})
    assert stats.seconds == 1.5 and stats.hits == 1 and stats.copies == 0


def test_a_right_prefetch_hides_a_copy_and_compute_waits_for_it(profile):
    # Layer 0: attn 0 -> 1; copy e0 1 -> 3, compute 3 -> 3.5; prefetch (1, e1) 3 -> 5.
    # Layer 1: attn 3.5 -> 4.5; e1 is resident but lands at 5: compute 5 -> 5.5. On demand: 7.
    trace = step(({0: 1}, {}), ({1: 1}, {1: 1}))
    stats = run(GatePrefetch(), trace, profile)
    assert stats.seconds == 5.5 and stats.hits == 1 and stats.prefetched == stats.prefetch_used == 1
    # On demand, layer 1: attn 3.5 -> 4.5, copy 4.5 -> 6.5, compute 6.5 -> 7.
    assert run(OnDemand(), trace, profile).seconds == 7


def test_a_wrong_prefetch_delays_the_next_on_demand_copy(profile):
    # The prefetch of e2 holds the copy engine 3 -> 5: layer 1's e1 copies 5 -> 7, computes 7 -> 7.5.
    stats = run(GatePrefetch(), step(({0: 1}, {}), ({1: 1}, {2: 1})), profile)
    assert stats.seconds == 7.5 and stats.prefetched == 1 and stats.prefetch_used == 0


def test_presched_fills_the_idle_copy_engine_with_a_predicted_expert(profile):
    # Layer 0: attn 0 -> 1; loads e0 1 -> 3 (compute 3 -> 3.5), e1 3 -> 5 (5 -> 5.5). The queue left layer 1's
    # predicted e2 on the CPU side, but f = 1 copy fits: prefetch (1, e2) 5 -> 7.
    # Layer 1: attn 5.5 -> 6.5; e2 lands at 7, computes 7 -> 7.5. Without the fill e2 runs on the CPU 6.5 -> 8.5.
    trace = step(({0: 6, 1: 5}, {}), ({2: 1}, {2: 1}))
    stats = run(PreSched(), trace, profile)
    assert stats.seconds == 7.5 and stats.prefetch_used == 1 and stats.cpu_tokens == 0
    bare = run(PreSched(fill_idle_copies=False), trace, profile)
    assert bare.seconds == 8.5 and bare.prefetched == 0 and bare.cpu_tokens == 1


def test_the_oracle_sees_the_actual_routing(profile):
    # Layer 0 {0: 1}: CPU (span 2 < 2.5), 1 -> 3. Layer 1's actual {1: 5} is best loaded (span 2.5 vs 6), so
    # the oracle prefetches it though the prediction said e2: copy 1 -> 3. Layer 1: attn 3 -> 4, compute 4 -> 4.5.
    stats = run(Oracle(), step(({0: 1}, {}), ({1: 5}, {2: 1})), profile)
    assert stats.seconds == 4.5 and stats.prefetch_used == 1


def test_bandwidth_scales_the_copies(profile):
    # Twice the bandwidth: t_io = 1. attn 0 -> 1; copies 1 -> 2, 2 -> 3, 3 -> 4; computes end 2.5, 3.5, 4.5.
    fast = profile.at_bandwidth(100.0, "2x")
    assert run(OnDemand(), step(({0: 3, 1: 2, 2: 1}, {})), fast).seconds == 4.5


def test_a_run_adds_up_its_steps(profile):
    trace = [step(({0: 3}, {})), step(({0: 3}, {}))]
    result = simulate(trace, PreSched(), profile, 100, frozenset(), 1)
    # Each step: attn 0 -> 1, e0 (t_c 4 vs 2.5): loaded 1 -> 3, computed 3 -> 3.5.
    assert result.steps == 2 and result.stats.seconds == 7 and result.tokens_per_s == pytest.approx(8 / 7)
    assert result.bytes_copied == 200 and result.hit_rate == 0 and result.cpu_share == 0
    assert result.summary()["policy"] == "kubemoe"


def test_lower_bound_by_hand(profile):
    # One layer {0: 3, 1: 2, 2: 1}, nothing resident. With k loaded: CPU side 9, 5, 2, 0; GPU side at
    # least 0, 0.5, 1, 1.5: phases 9, 5, 2, 1.5. lambda 0: 1 + 1.5 = 2.5 (copies free).
    # lambda 1.5: (1 + 1.5 + min(9, 5 + 3, 2 + 6, 1.5 + 9)) / 2.5 = 10.5 / 2.5 = 4.2.
    # The best schedule takes 5.5 (e0, e1 loaded, e2 on the CPU), so 4.2 is a bound, not a schedule.
    trace = step(({0: 3, 1: 2, 2: 1}, {}))
    assert step_lower_bound(trace, profile, 100, frozenset(), lambdas=(0.0,)) == 2.5
    assert step_lower_bound(trace, profile, 100, frozenset(), lambdas=(0.0, 1.5)) == pytest.approx(4.2)


def test_no_policy_beats_the_lower_bound(profile, make_costs):
    rng = random.Random(1)
    policies = [PreSched(), PreSched(xi=1.0), OnDemand(), GatePrefetch(), FiddlerLike(), Oracle()]
    for _ in range(40):
        layers = []
        for _ in range(3):
            actual = {e: rng.randint(1, 12) for e in rng.sample(range(8), 3)}
            layers.append((actual, {e: rng.randint(1, 12) for e in rng.sample(range(8), 3)}))
        cost = OffloadProfile("model", (make_costs(t_io=rng.uniform(0.2, 5), beta=rng.uniform(0.05, 1)),),
                              CostLine(0.0, rng.uniform(0.1, 2)))
        resident = frozenset((l, e) for l in range(3) for e in rng.sample(range(8), 2))
        bound = step_lower_bound(step(*layers), cost, 100, resident)
        for policy in policies:
            assert run(policy, step(*layers), cost, resident, slots=2).seconds >= bound - 1e-9
