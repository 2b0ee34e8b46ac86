"""Counting routed tokens on the device: over the first `rows` rows only (a CUDA-graph program's real
rows), predictions scored against the router's choice, drains that lose nothing added meanwhile; the
GPU's Triton kernel checked against the torch ops under Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch

from kubemoe.frontend.tally import DeviceTally, count_rows, drain


def _choices(rows: int, k: int, experts: int, seed: int) -> torch.Tensor:  # [T, k], distinct within a row
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(rows)])


def _by_hand(index: torch.Tensor, against: torch.Tensor, rows: int, experts: int) -> tuple[list[int], int]:
    counts, hits = [0] * experts, 0
    for t in range(rows):
        for e in index[t].tolist():
            counts[e] += 1
            hits += e in against[t].tolist()
    return counts, hits


@pytest.mark.parametrize("rows", [None, 0, 7, 40])
def test_only_the_first_rows_are_counted_and_scored(rows):
    index, against = _choices(40, 4, 16, 1), _choices(40, 6, 16, 2)
    counts, hits = torch.zeros(16, dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    limit = None if rows is None else torch.tensor(rows, dtype=torch.int32)
    count_rows(index, limit, counts, against, hits)
    count_rows(index, limit, counts)  # counts add up; hits only where `against` is given
    want_counts, want_hits = _by_hand(index, against, 40 if rows is None else rows, 16)
    assert counts.tolist() == [2 * c for c in want_counts]
    assert int(hits) == want_hits


def test_a_drain_takes_what_was_added_and_keeps_what_comes_after():
    tally = torch.zeros(2, 3, dtype=torch.int64)
    tally[0, 1] += 5
    assert drain(tally) == [[0, 5, 0], [0, 0, 0]]
    tally[1, 2] += 1
    assert drain(tally) == [[0, 0, 0], [0, 0, 1]]
    assert drain(tally) == [[0, 0, 0], [0, 0, 0]]


def test_the_tally_records_each_layer_at_a_flush():
    recorded = []
    tally = DeviceTally([3, 5], 4, lambda layer, counts: recorded.append((layer, counts)))
    tally.add_rows(5, torch.tensor([[0, 1], [1, 2], [3, 0]]), torch.tensor(2, dtype=torch.int32))
    tally.add(3, torch.tensor([0, 0, 4, 0]))
    tally.flush()
    assert recorded == [(3, [(2, 4)]), (5, [(0, 1), (1, 2), (2, 1)])]
    tally.flush()
    assert len(recorded) == 2  # nothing new: nothing recorded


def test_the_gpu_kernel_equals_the_torch_ops_under_tritons_interpreter(triton_interpreted):
    triton_interpreted("""
        import torch
        from kubemoe.frontend.tally import _count_rows_kernel, count_rows
        g = torch.Generator().manual_seed(0)
        for t, k, a, e in ((3, 2, 2, 8), (300, 8, 8, 128)):  # 300 rows: two programs of 256
            index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            against = torch.stack([torch.randperm(e, generator=g)[:a] for _ in range(t)])
            for rows in (None, torch.tensor(t - 1, dtype=torch.int32), torch.tensor(0, dtype=torch.int32)):
                got = torch.zeros(e, dtype=torch.int64), torch.zeros((), dtype=torch.int64)
                want = torch.zeros(e, dtype=torch.int64), torch.zeros((), dtype=torch.int64)
                _count_rows_kernel(index, rows, got[0], against, got[1])
                count_rows(index, rows, want[0], against, want[1])
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (t, rows, got, want)
        print("equal")
    """)
