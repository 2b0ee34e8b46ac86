"""A layer's routed experts computed grouped (one pair of grouped GEMMs) against the per-expert loop."""

import pytest
import torch
import torch.nn.functional as F

from kubemoe.expert import expert_ffn
from kubemoe.moe import (LocalExperts, StackedExperts, can_group, expert_counts, group_tokens, grouped_ffn, sort_pairs,
                         sorted_ffn)

E, H, I, T = 8, 32, 48, 19


def _layer(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    stack = StackedExperts(torch.randn(E, 2 * I, H, generator=g, dtype=dtype) / H**0.5,
                           torch.randn(E, H, I, generator=g, dtype=dtype) / I**0.5)
    hidden = torch.randn(T, H, generator=g, dtype=dtype)
    return g, stack, hidden


@pytest.mark.parametrize("weight_on_input", [False, True])
def test_grouped_equals_the_per_expert_loop_bit_for_bit_with_two_experts_per_token(weight_on_input):
    g, stack, hidden = _layer(0)
    weights, index = torch.rand(T, E, generator=g).topk(2, dim=-1)
    index = index.sort(dim=-1).values  # as kubemoe.routing returns them
    index[index == 5] = 4  # expert 5 gets no token: an empty group
    index[:, 1] = torch.maximum(index[:, 1], index[:, 0] + 1)
    loop = LocalExperts({e: stack.expert(e) for e in range(E)}, F.silu, weight_on_input)
    assert can_group(torch.float32, torch.device("cpu"), H, I)
    assert torch.equal(grouped_ffn(hidden, index, weights, stack, F.silu, weight_on_input),
                       loop(hidden, index, weights))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_grouped_matches_the_loop_with_many_experts_per_token_in_any_order(dtype, tolerance):
    g, stack, hidden = _layer(1, dtype)
    weights, index = torch.rand(T, E, generator=g).topk(6, dim=-1)  # unsorted within a token
    loop = LocalExperts({e: stack.expert(e) for e in range(E)}, F.gelu, False)(hidden, index, weights)
    grouped = grouped_ffn(hidden, index, weights, stack, F.gelu, False)
    assert grouped.dtype == dtype
    torch.testing.assert_close(grouped.float(), loop.float(), rtol=tolerance, atol=tolerance)


def test_sorted_rows_go_through_their_own_expert_and_experts_without_rows_are_skipped():
    _, stack, hidden = _layer(2)
    counts = [3, 0, 5, 0, 0, 1, 10, 0]  # rows of each expert, in expert order: T in all
    ends = torch.tensor(counts).cumsum(0, dtype=torch.int32)
    want = torch.cat([expert_ffn(rows, stack.expert(e), F.silu) for e, rows in enumerate(hidden.split(counts))])
    assert torch.equal(sorted_ffn(hidden, ends, stack, F.silu), want)


@pytest.mark.parametrize("weight_on_input", [False, True])
def test_pairs_gathered_into_a_given_buffer_are_the_pairs_gathered_anew(weight_on_input):
    """`into`: the rows a device link's functions read, gathered (and weighed) straight into its buffer."""
    g, _, hidden = _layer(3)
    weights, index = torch.rand(T, E, generator=g).topk(2, dim=-1)
    buffer = torch.full((2 * T + 5, H), float("nan"))
    fresh = sort_pairs(hidden, index, weights, E, weight_on_input, real_rows=torch.tensor(T - 2))
    into = sort_pairs(hidden, index, weights, E, weight_on_input, real_rows=torch.tensor(T - 2), into=buffer)
    assert into.x.data_ptr() == buffer.data_ptr() and into.x.shape == (2 * T, H)
    assert torch.equal(into.x, fresh.x) and torch.equal(into.order, fresh.order) and torch.equal(into.ends, fresh.ends)
    assert buffer[2 * T:].isnan().all()  # nothing past the pairs' rows written


def test_expert_counts_counts_every_choice_and_sizes_by_the_layer():
    index = torch.tensor([[0, 3], [3, 1], [3, 0]])
    assert expert_counts(index, 6).tolist() == [2, 1, 0, 3, 0, 0]


def test_group_tokens_gives_each_routed_expert_its_pairs_in_order_and_skips_the_unrouted():
    top_k_index = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(t))[:8] for t in range(16)])
    top_k_index[top_k_index == 5] = 7  # expert 5 gets no token; 7 gets some tokens twice over (two slots)
    groups = group_tokens(top_k_index)
    flat = top_k_index.reshape(-1)
    assert [g.expert for g in groups] == sorted(set(flat.tolist()))
    for g in groups:
        pairs = (flat == g.expert).nonzero().squeeze(1)  # [N_e] in pair order
        assert torch.equal(g.tokens, pairs // 8) and torch.equal(g.slots, pairs % 8)
        assert g.count == len(pairs)
    assert group_tokens(torch.empty(0, 2, dtype=torch.int64)) == []


def test_the_grouping_kernel_sorts_pairs_by_expert_stably_under_tritons_interpreter(triton_interpreted):
    """moe_kernels.group_pairs (the GPU's grouping of decode-sized batches) gives a stable sort's order,
    each expert's cumulative end row and where each pair went, also for experts without pairs, sizes
    of no whole block, and with a graph's spare rows marked in the kernel (all rows real, some, none)."""
    triton_interpreted("""
        import torch
        from kubemoe.moe_kernels import group_pairs
        g = torch.Generator().manual_seed(0)
        for pairs, experts in ((1, 8), (2, 8), (64, 8), (256, 128), (200, 256), (37, 60)):
            chosen = torch.randint(0, experts, (pairs,), generator=g)
            order, ends, positions = group_pairs(chosen, experts)
            want_ends = torch.zeros(experts, dtype=torch.int64).index_add_(0, chosen, torch.ones_like(chosen)).cumsum(0)
            assert torch.equal(order, chosen.sort(stable=True).indices), (pairs, experts)
            assert torch.equal(ends.long(), want_ends), (pairs, experts)
            assert torch.equal(order[positions.long()], torch.arange(pairs)), (pairs, experts)
        for pairs, experts, k, real in ((8, 8, 2, 3), (8, 8, 2, 0), (8, 8, 2, 4), (256, 128, 8, 29), (36, 60, 4, 1)):
            # a graph's padding: the pairs of rows from `real` on are one more group, the last
            chosen = torch.randint(0, experts, (pairs,), generator=g)
            marked = torch.where(torch.arange(pairs) < real * k, chosen, experts)
            order, ends, positions = group_pairs(chosen, experts, torch.tensor(real, dtype=torch.int32), k)
            want_ends = torch.zeros(experts + 1, dtype=torch.int64).index_add_(0, marked, torch.ones_like(marked))
            assert torch.equal(order, marked.sort(stable=True).indices), (pairs, experts, real)
            assert torch.equal(ends.long(), want_ends.cumsum(0)), (pairs, experts, real)
            assert torch.equal(order[positions.long()], torch.arange(pairs)), (pairs, experts, real)
        print("equal")
    """)


def test_the_fused_layer_kernels_compute_the_unfused_steps_under_tritons_interpreter(triton_interpreted):
    """The kernels of a decode-sized layer on a GPU (moe_kernels): grouped_mm_small is each row times its
    expert's weights, written in place or scattered to given rows; swiglu_grouped_mm is silu(gate) * up
    of the sorted rows, gathered from the tokens or given sorted; combine_pairs is the weighted sum that
    sort_pairs / unsort_pairs compute, with float32 weights and with weights of the outputs' dtype; top_k
    is softmax, topk and the division, in either weights dtype, and topk of raw logits."""
    triton_interpreted("""
        import torch
        import torch.nn.functional as F
        from kubemoe import moe_kernels as mk
        from kubemoe.moe import sort_pairs, unsort_pairs
        g = torch.Generator().manual_seed(0)
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
            for tokens, k, experts, hidden_size, inter in ((5, 2, 4, 32, 24), (16, 8, 128, 64, 48), (1, 1, 3, 16, 16)):
                hidden = torch.randn(tokens, hidden_size, generator=g).to(dtype)
                index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
                order, ends, positions = mk.group_pairs(index.reshape(-1), experts)
                gate_up = (torch.randn(experts, 2 * inter, hidden_size, generator=g) / hidden_size ** 0.5).to(dtype)
                rows = hidden[order // k]
                starts = [0] + ends.tolist()[:-1]
                gate, up = torch.cat([rows[a:b] @ gate_up[e].T for e, (a, b) in enumerate(zip(starts, ends.tolist()))]
                                     ).chunk(2, dim=-1)
                plain = mk.grouped_mm_small(rows, gate_up, ends)  # the same kernel without SwiGLU: both halves
                assert torch.allclose(plain.float(), torch.cat([gate, up], dim=-1).float(), atol=tolerance, rtol=tolerance)
                dst = torch.arange(tokens * k).flip(0) + 1  # scattered: row r's result to row dst[r]
                out = torch.zeros(tokens * k + 2, 2 * inter, dtype=dtype)
                assert mk.grouped_mm_small(rows, gate_up, ends, scatter=(out, dst)) is out
                assert torch.equal(out[dst], plain) and not out[0].any() and not out[-1].any()
                gathered = mk.swiglu_grouped_mm(hidden, gate_up, ends, grouping=(order, k))
                assert gathered.dtype == dtype and gathered.shape == (tokens * k, inter)
                assert torch.allclose(gathered.float(), (F.silu(gate) * up).float(), atol=tolerance, rtol=tolerance)
                assert torch.equal(mk.swiglu_grouped_mm(rows, gate_up, ends), gathered)
                y = torch.randn(tokens * k, hidden_size, generator=g).to(dtype)
                for weights_dtype in (torch.float32, dtype):
                    weights = torch.randn(tokens, k, generator=g).softmax(-1).to(weights_dtype)
                    pairs = sort_pairs(hidden, index, weights, experts, False)
                    want = unsort_pairs(y * pairs.weights, pairs).to(dtype)
                    got = mk.combine_pairs(y, positions, weights, dtype)
                    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance)
            logits = torch.randn(7, 60, generator=g).to(dtype)
            for normalize in (True, False):
                for weights_dtype in (torch.float32, dtype):
                    weights, chosen = mk.top_k(logits, 4, softmax=True, normalize=normalize, dtype=weights_dtype)
                    want, want_chosen = logits.float().softmax(-1).topk(4, dim=-1)
                    want = want / want.sum(-1, keepdim=True) if normalize else want
                    assert torch.equal(chosen, want_chosen) and weights.dtype == weights_dtype
                    assert torch.allclose(weights.float(), want.to(weights_dtype).float(), atol=1e-6)
            assert torch.equal(mk.top_k(logits, 3, softmax=False, normalize=False)[1], logits.topk(3, dim=-1).indices)
        print("equal")
    """)


def test_the_grouped_kernels_read_experts_from_a_strided_stack_under_tritons_interpreter(triton_interpreted):
    """The offload executor's slots are one [N, S] tensor, each row an expert's gate | up | down: its stack
    (ExpertStore.stacked) is views whose experts are S apart. The kernels read it as they read a packed stack."""
    triton_interpreted("""
        import torch
        from kubemoe import moe_kernels as mk
        g = torch.Generator().manual_seed(0)
        slots, hidden_size, inter, k, tokens = 6, 32, 16, 2, 5
        memory = torch.randn(slots, 3 * inter * hidden_size, generator=g) / hidden_size ** 0.5
        split = 2 * inter * hidden_size
        gate_up = memory[:, :split].view(slots, 2 * inter, hidden_size)  # experts 3*I*H apart
        down = memory[:, split:].view(slots, hidden_size, inter)
        assert gate_up.stride(0) == down.stride(0) == memory.shape[1]
        index = torch.stack([torch.randperm(slots, generator=g)[:k] for _ in range(tokens)])
        order, ends, _ = mk.group_pairs(index.reshape(-1), slots)
        hidden = torch.randn(tokens, hidden_size, generator=g)
        h = mk.swiglu_grouped_mm(hidden, gate_up, ends, grouping=(order, k))
        assert torch.allclose(h, mk.swiglu_grouped_mm(hidden, gate_up.contiguous(), ends, grouping=(order, k)))
        assert torch.allclose(mk.grouped_mm_small(h, down, ends), mk.grouped_mm_small(h, down.contiguous(), ends))
        print("equal")
    """)
