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
    order, ends, positions = group_pairs(chosen, experts)
    want_ends = torch.zeros(experts, dtype=torch.int64, device="cuda").index_add_(0, chosen, torch.ones_like(chosen))
    assert torch.equal(order, chosen.sort(stable=True).indices)
    assert torch.equal(ends.long(), want_ends.cumsum(0))
    assert torch.equal(order[positions.long()], torch.arange(pairs, device="cuda"))


@pytest.mark.parametrize("tokens,k,experts,hidden,inter", [(32, 8, 128, 2048, 768), (1, 2, 8, 4096, 14336),
                                                           (5, 2, 8, 100, 72)])
def test_a_decode_sized_layer_in_four_kernels_computes_the_layers_experts(tokens, k, experts, hidden, inter):
    """grouped_ffn's fused path (grouping, gathered SwiGLU GEMM, down GEMM, weighted sum) against the
    layer computed expert by expert in float64, at Qwen3-30B-A3B's and Mixtral's sizes and odd ones."""
    from kubemoe.moe import StackedExperts, grouped_ffn

    g = torch.Generator(device="cuda").manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    stack = StackedExperts(torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g).bfloat16() / hidden ** 0.5,
                           torch.randn(experts, hidden, inter, device="cuda", generator=g).bfloat16() / inter ** 0.5)
    weights, index = torch.randn(tokens, experts, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
    exact = torch.zeros(tokens, hidden, dtype=torch.float64, device="cuda")
    for t in range(tokens):
        for j in range(k):
            gate_up = stack.gate_up[index[t, j]].double() @ x[t].double()
            exact[t] += weights[t, j].double() * (stack.down[index[t, j]].double() @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
    for weights_dtype in (torch.float32, torch.bfloat16):  # Mixtral's routers give float32 weights, Qwen3's bf16
        got = grouped_ffn(x, index, weights.to(weights_dtype), stack, F.silu, weight_on_input=False)
        assert got.dtype == torch.bfloat16 and got.shape == (tokens, hidden)
        assert ((got.double() - exact).norm() / exact.norm()).item() < 1e-2


def test_the_top_k_kernel_picks_torchs_experts_with_torchs_weights():
    from kubemoe.moe_kernels import top_k

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 128, device="cuda", generator=g)  # float32: no two scores of a row equal
    weights, chosen = top_k(logits, 8, softmax=True, normalize=True, dtype=torch.bfloat16)
    want, want_chosen = logits.float().softmax(-1).topk(8, dim=-1)
    assert torch.equal(chosen, want_chosen)
    torch.testing.assert_close(weights, (want / want.sum(-1, keepdim=True)).bfloat16())


# decode sizes (kubemoe's kernels), and more rows than GROUPED_SMALL_ROWS (torch's grouped GEMM)
@pytest.mark.parametrize("rows_per_expert", [[3, 0, 1, 2], [100, 100, 100, 0]])
def test_a_stack_of_strided_views_is_read_in_place_not_copied(rows_per_expert):
    """The offload store's slot stack (each slot's gate/up and down side by side in one buffer, so neither
    stack is contiguous): sorted_ffn over it equals sorted_ffn over a contiguous copy, and the call allocates
    nothing like the stack (a .contiguous() of it copied every slot at every call, 3 ms at Qwen3 sizes)."""
    from kubemoe.moe import StackedExperts, sorted_ffn, upload_ends

    slots, hidden, inter = 64, 256, 128
    g = torch.Generator(device="cuda").manual_seed(sum(rows_per_expert))
    split = 2 * inter * hidden
    memory = torch.randn(slots, split + hidden * inter, device="cuda", generator=g).bfloat16() / hidden ** 0.5
    strided = StackedExperts(memory[:, :split].view(slots, 2 * inter, hidden), memory[:, split:].view(slots, hidden, inter))
    assert not strided.gate_up.is_contiguous() and not strided.down.is_contiguous()
    dense = StackedExperts(strided.gate_up.contiguous(), strided.down.contiguous())
    counts = rows_per_expert + [0] * (slots - len(rows_per_expert))  # rows for the first slots only
    ends = upload_ends(list(torch.tensor(counts).cumsum(0).tolist()), torch.device("cuda"))
    x = torch.randn(sum(counts), hidden, device="cuda", generator=g).bfloat16()
    want = sorted_ffn(x, ends, dense, F.silu)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = sorted_ffn(x, ends, strided, F.silu)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < memory.nbytes // 4
    torch.testing.assert_close(got, want)
