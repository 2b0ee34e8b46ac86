import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubemoe.planning.split import Part, split


def test_hand_worked_split_goes_to_the_shortest_queues():
    # 10 tokens, 3 parts worth a replica each (>= 3 tokens): the least-busy replicas, remainder first.
    assert split(10, [5, 0, 3], predicted_tokens=10, min_tokens_per_replica=3) == [
        Part(1, 0, 4), Part(2, 4, 3), Part(0, 7, 3)]
    # A small prediction keeps the tokens on one replica (another would only read the weights again).
    assert split(10, [5, 0, 3], predicted_tokens=50, min_tokens_per_replica=100) == [Part(1, 0, 10)]
    assert split(0, [1]) == []


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
