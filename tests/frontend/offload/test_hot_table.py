"""The hot-expert table: hottest first until the budget is used, deterministic ties, a clear minimum."""

import pytest

from kubemoe.frontend.offload.hot_table import TokenCounter, build_hot_table, working_set_bytes

ALL = [(l, e) for l in range(2) for e in range(4)]


def test_hottest_experts_fill_the_budget_in_order():
    counter = TokenCounter()
    counter.add(0, {0: 5, 1: 9})
    counter.add(1, {2: 7, 0: 1})
    counter.add(0, {1: 1})
    # working set: (2 on-demand + 2 groups x 1 slot) x 10 bytes = 40; 40 more bytes hold 4 experts.
    table = build_hot_table(counter, ALL, expert_bytes=10, budget_bytes=85, prefetch_slots=1)
    assert table.reserved_bytes == 40 and table.bytes_used == 40
    assert table.experts == ((0, 1), (1, 2), (0, 0), (1, 0))  # 10, 7, 5, 1 tokens
    assert table.layer(0) == {0, 1} and (1, 2) in table.resident()


def test_ties_and_uncounted_experts_rank_by_layer_then_expert():
    counter = TokenCounter({(1, 3): 4, (0, 2): 4, (1, 0): 4})
    table = build_hot_table(counter, ALL, expert_bytes=1, budget_bytes=4 + 5, prefetch_slots=1)
    assert table.experts == ((0, 2), (1, 0), (1, 3), (0, 0), (0, 1))


def test_budget_below_the_working_set_says_the_minimum():
    assert working_set_bytes(100, 3) == 800
    with pytest.raises(ValueError, match="at least 800 bytes"):
        build_hot_table(TokenCounter(), ALL, expert_bytes=100, budget_bytes=799, prefetch_slots=3)
    assert build_hot_table(TokenCounter(), ALL, expert_bytes=100, budget_bytes=800, prefetch_slots=3).experts == ()
