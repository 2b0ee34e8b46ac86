import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubemoe.planning.split import Part, layer_order, split, split_layer


def test_hand_worked_split_goes_to_the_shortest_queues_and_levels_them():
    # 10 tokens, 3 parts worth a replica each (>= 3 tokens): the least-busy replicas. Levelling the queues
    # 0, 3 and 5 would give the one at 5 a single token, under 3: it gets none, and the others end at 7 and 6.
    assert split(10, [5, 0, 3], predicted_tokens=10, min_tokens_per_replica=3) == [Part(1, 0, 7), Part(2, 7, 3)]
    # On equal queues the parts are even, larger parts first (the old split's answer).
    assert split(10, [0, 0, 0], predicted_tokens=10, min_tokens_per_replica=3) == [
        Part(0, 0, 4), Part(1, 4, 3), Part(2, 7, 3)]
    # A small prediction keeps the tokens on one replica (another would only read the weights again).
    assert split(10, [5, 0, 3], predicted_tokens=50, min_tokens_per_replica=100) == [Part(1, 0, 10)]
    assert split(0, [1]) == []


def test_hand_worked_layer_splits_the_least_flexible_experts_first():
    # Expert 0 lives on a only, 1 on a or b, 2 on b or c. Split in index order with even parts, a ends
    # with 4 + 5 tokens; least flexible first with levelled parts, no queue ends above 7 (20 / 3 = 6.7).
    assert layer_order([4, 10, 6], [["a"], ["a", "b"], ["b", "c"]]) == [0, 1, 2]
    assert layer_order([4, 6, 10], [["a", "b"], ["b", "c"], ["c"]]) == [2, 1, 0]
    queued: dict[str, int] = {}
    parts = split_layer([4, 10, 6], [["a"], ["a", "b"], ["b", "c"]], queued, [None] * 3, 2)
    assert parts == [[("a", Part(0, 0, 4))], [("b", Part(1, 0, 7)), ("a", Part(0, 7, 3))], [("c", Part(1, 0, 6))]]
    assert queued == {"a": 7, "b": 7, "c": 6}


def test_an_expert_without_replicas_is_an_error_that_names_the_table():
    with pytest.raises(ValueError, match="routing table"):
        split(3, [])


@settings(max_examples=300, deadline=None)
@given(tokens=st.integers(0, 5000), inflight=st.lists(st.integers(0, 1000), min_size=1, max_size=12),
       predicted=st.one_of(st.none(), st.floats(0, 1e5)), minimum=st.integers(1, 512))
def test_split_is_lossless(tokens, inflight, predicted, minimum):
    parts = split(tokens, inflight, predicted, minimum)
    assert sum(p.count for p in parts) == tokens
    assert [p.start for p in parts] == [sum(q.count for q in parts[:i]) for i in range(len(parts))]
    assert all(p.count >= 1 for p in parts) and len({p.replica for p in parts}) == len(parts) <= len(inflight)
    if parts:  # JSQ: no unchosen replica has fewer in-flight tokens than a chosen one
        chosen = {p.replica for p in parts}
        assert max(inflight[i] for i in chosen) <= min((inflight[i] for i in range(len(inflight)) if i not in chosen),
                                                       default=float("inf"))
    # Levelled: the replicas that got a part end within a token of one another.
    ends = [inflight[p.replica] + p.count for p in parts]
    assert not ends or max(ends) - min(ends) <= 1


@settings(max_examples=200, deadline=None)
@given(data=st.data(), experts=st.integers(1, 8), queues=st.integers(1, 5), minimum=st.integers(1, 64))
def test_a_layers_split_is_lossless_and_counts_every_part_in_its_queue(data, experts, queues, minimum):
    tokens = data.draw(st.lists(st.integers(0, 500), min_size=experts, max_size=experts))
    replicas = [data.draw(st.lists(st.integers(0, queues - 1), min_size=1, max_size=queues, unique=True))
                for _ in range(experts)]
    predicted = data.draw(st.lists(st.one_of(st.none(), st.floats(0, 1e3)), min_size=experts, max_size=experts))
    queued = {0: 5}
    parts = split_layer(tokens, replicas, queued, predicted, minimum)
    for count, where, expert_parts in zip(tokens, replicas, parts):
        assert sum(p.count for _, p in expert_parts) == count
        assert all(q == where[p.replica] for q, p in expert_parts)
    given_to = {q: 0 for q in range(queues)}
    for expert_parts in parts:
        for q, p in expert_parts:
            given_to[q] += p.count
    assert {q: queued.get(q, 0) for q in range(queues)} == {q: n + (5 if q == 0 else 0) for q, n in given_to.items()}
