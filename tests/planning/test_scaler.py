import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubemoe.planning.scaler import cv, layer_cv, replica_loads, scale

MIB = 2**20

layer_loads = st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=16)


def test_hand_worked_layer():
    # [3, 1]: CV 0.5; splitting expert 0 gives [1.5, 1.5, 1], CV 0.177 <= 0.2; for 0.1 once more: all 1s.
    assert scale([[3, 1]], MIB, 0.2, None, 8) == [[2, 1]]
    assert layer_cv([3, 1], [2, 1]) == pytest.approx(math.sqrt(1 / 18) / (4 / 3))
    assert scale([[3, 1]], MIB, 0.1, None, 8) == [[3, 1]]


def test_caps_stop_the_scaler():
    assert scale([[3, 1]], 10, 0.0, 20, 8) == [[1, 1]]      # the experts alone fill the cap
    assert scale([[3, 1]], 10, 0.0, 30, 8) == [[2, 1]]
    assert scale([[100, 1, 1, 1]], MIB, 0.2, None, 3) == [[3, 1, 1, 1]]
    assert scale([[0, 0], [5, 5]], MIB, 0.2, None, 8) == [[1, 1], [1, 1]]


def test_no_replica_is_added_below_the_curves_knee():
    # [300, 100] with V = 0.2 wants [2, 1] (CV 0.2 exactly), but 150 tokens a replica are under a
    # knee of 200: the split would leave the second replica idle, so the expert keeps one.
    assert scale([[300, 100]], MIB, 0.2, None, 8) == [[2, 1]]
    assert scale([[300, 100]], MIB, 0.2, None, 8, min_replica_load=200) == [[1, 1]]
    assert scale([[900, 100]], MIB, 0.0, None, 8, min_replica_load=200) == [[4, 1]]  # 225 each, not 180


def test_past_a_capped_straggler_the_other_experts_are_split_down_to_the_knee():
    # [1600, 700, 700], at most 2 replicas an expert: the hottest is capped at 800 a replica while
    # the CV is still 0.37. Parts of 350 are above a knee of 300, so the others are split too
    # (finer parts for the placer to even out the GPUs); above a knee of 400 they are not.
    assert scale([[1600, 700, 700]], MIB, 0.0, None, 2, min_replica_load=300) == [[2, 2, 2]]
    assert scale([[1600, 700, 700]], MIB, 0.0, None, 2, min_replica_load=400) == [[2, 1, 1]]
    # Without a knee, nothing says a part is worth a replica: the capped straggler ends the layer.
    assert scale([[1600, 700, 700]], MIB, 0.0, None, 2) == [[2, 1, 1]]
    # The hottest per replica (220: a next part of 110) is under the knee, the other's next part is not.
    assert scale([[220, 600]], MIB, 0.0, None, 8, min_replica_load=150) == [[1, 4]]


@settings(max_examples=200, deadline=None)
@given(loads=st.lists(layer_loads, min_size=1, max_size=4), threshold=st.floats(0, 1.5),
       max_per_expert=st.integers(1, 12), knee=st.floats(1, 2e3))
def test_with_a_knee_the_scaler_stops_only_when_no_expert_can_take_a_useful_replica(loads, threshold, max_per_expert,
                                                                                   knee):
    for row, counts in zip(loads, scale(loads, MIB, threshold, None, max_per_expert, min_replica_load=knee)):
        assert all(1 <= c <= max_per_expert for c in counts)
        # Every added replica's part is at least the knee.
        assert all(c == 1 or row[e] / c >= knee * (1 - 1e-9) for e, c in enumerate(counts))
        if layer_cv(row, counts) > threshold + 1e-9:
            assert all(c == max_per_expert or row[e] / (c + 1) < knee for e, c in enumerate(counts))


@pytest.mark.parametrize("kwargs, message", [
    ({"expert_bytes": 0}, "expert_bytes"), ({"cv_threshold": -1}, "cv_threshold"),
    ({"max_per_expert": 0}, "max_per_expert"), ({"layer_memory_cap": 0}, "layer_memory_cap"),
    ({"loads": [[1, -1]]}, "layer 0"), ({"min_replica_load": -1}, "min_replica_load"),
])
def test_bad_inputs_say_what_to_pass(kwargs, message):
    args = {"loads": [[1, 2]], "expert_bytes": MIB, "cv_threshold": 0.2, "layer_memory_cap": None,
            "max_per_expert": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        scale(**args)


@settings(max_examples=200, deadline=None)
@given(loads=st.lists(layer_loads, min_size=1, max_size=4), threshold=st.floats(0, 1.5),
       cap_experts=st.one_of(st.none(), st.integers(1, 64)), max_per_expert=st.integers(1, 12))
def test_scaler_respects_caps_and_reaches_the_threshold_when_they_allow(loads, threshold, cap_experts, max_per_expert):
    cap = None if cap_experts is None else cap_experts * MIB
    replicas = scale(loads, MIB, threshold, cap, max_per_expert)
    for row, counts in zip(loads, replicas):
        assert len(counts) == len(row) and all(1 <= c <= max_per_expert for c in counts)
        if cap is not None and sum(counts) > len(row):
            assert sum(counts) * MIB <= cap
        if sum(row) == 0:
            assert counts == [1] * len(row)
            continue
        if layer_cv(row, counts) > threshold + 1e-9:
            # Stopped early: the memory cap is full, or the hottest expert per replica is at its cap.
            hottest = max(range(len(row)), key=lambda e: row[e] / counts[e])
            memory_full = cap is not None and (sum(counts) + 1) * MIB > cap
            assert memory_full or counts[hottest] == max_per_expert


@settings(max_examples=100, deadline=None)
@given(row=layer_loads)
def test_without_caps_the_threshold_is_reached(row):
    counts = scale([row], MIB, 0.3, None, 10_000)[0]
    assert layer_cv(row, counts) <= 0.3 + 1e-9


def test_cv_helpers():
    assert cv([]) == 0.0 and cv([0, 0]) == 0.0 and cv([2, 2]) == 0.0
    assert replica_loads([4, 1], [2, 1]) == [2, 2, 1]
