"""On a GPU (-m gpu): kubemoe's small grouped GEMM computes what torch's grouped GEMM does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kubemoe.moe_kernels import grouped_mm_small

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows_per_expert", [[0, 3, 0, 1], [1, 0, 0, 0], [70, 0, 5, 0], [17, 16, 15, 64]])
@pytest.mark.parametrize("n,k", [(192, 256), (100, 136)])  # whole blocks, and neither dimension a block multiple
def test_small_grouped_mm_equals_torch_and_writes_every_row(rows_per_expert, n, k):
    g = torch.Generator(device="cuda").manual_seed(sum(rows_per_expert) + n)
    experts = len(rows_per_expert)
    rows = sum(rows_per_expert)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
    ends = torch.tensor(rows_per_expert, device="cuda").cumsum(0, dtype=torch.int32)
    want = F.grouped_mm(x, w.transpose(-2, -1), offs=ends).float()
    # reference in float64 per expert: both kernels accumulate in float32 over bf16 operands
    start, exact = 0, torch.empty(rows, n, dtype=torch.float64, device="cuda")
    for e, count in enumerate(rows_per_expert):
        exact[start:start + count] = x[start:start + count].double() @ w[e].double().T
        start += count
    got = grouped_mm_small(x, w, ends).float()
    assert got.shape == (rows, n) and torch.isfinite(got).all()
    assert ((got - exact).norm() / exact.norm()).item() < 1e-2
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("pairs,experts", [(1, 8), (64, 8), (256, 128), (200, 256)])
def test_grouping_kernel_is_a_stable_sort_with_each_experts_end(pairs, experts):
    from kubemoe.moe_kernels import group_pairs

    chosen = torch.randint(0, experts, (pairs,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(pairs))
    order, ends = group_pairs(chosen, experts)
    want_ends = torch.zeros(experts, dtype=torch.int64, device="cuda").index_add_(0, chosen, torch.ones_like(chosen))
    assert torch.equal(order, chosen.sort(stable=True).indices)
    assert torch.equal(ends.long(), want_ends.cumsum(0))
