"""Token grouping and output combination around a layer's routed experts.

This is the part of an MoE layer that does not depend on where the experts run: split a batch's
tokens by expert, and add each expert's output back to its tokens with the routing weight. The
in-process experts, the expert-function server and the frontend's remote dispatcher all use it.
Where a layer's experts all live in one process, `grouped_ffn` computes them at once from a
`StackedExperts`, without a per-expert loop and without waiting for the device; its core,
`sorted_ffn`, takes rows already sorted by expert (as an expert function's requests bring them).
Shapes: T = tokens, H = hidden size, K = experts per token, N_e = tokens routed to expert e,
E = experts, I = expert intermediate size, S = rows sorted by expert.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from kubemoe import moe_kernels
from kubemoe.expert import ExpertWeights, expert_ffn


@dataclass(frozen=True)
class ExpertGroup:
    expert: int
    tokens: torch.Tensor  # [N_e] token positions in the batch
    slots: torch.Tensor  # [N_e] which of the token's K choices this is
    count: int  # N_e, known on the host (a tensor's len() is a call into torch: ~1 us a group)


def merge_groups(groups: Sequence[ExpertGroup]) -> ExpertGroup:
    """The rows of `groups`, in their order, as one group (expert -1): one gather and one combine for them all."""
    return ExpertGroup(-1, torch.cat([g.tokens for g in groups]), torch.cat([g.slots for g in groups]),
                       sum(g.count for g in groups))


def group_tokens(top_k_index: torch.Tensor) -> list[ExpertGroup]:  # [T, K] -> groups, by expert id
    """The (token, choice) pairs of each routed expert, in ascending expert order, each group in
    token order: one stable sort and one count where the index lives, one read to the host (the
    group sizes), then views. No per-group tensor op: with 64 experts a loop of slices cost ~1.5 ms
    a layer on a busy 2-core CPU."""
    flat = top_k_index.reshape(-1)  # [T * K]
    order = flat.argsort(stable=True)  # [T * K] pairs grouped by expert, each group in pair order
    counts = torch.bincount(flat).tolist()  # [max id + 1]: the one wait for the device
    k = top_k_index.shape[1]
    experts = [e for e, n in enumerate(counts) if n]
    sizes = [counts[e] for e in experts]
    tokens, slots = (order // k).split(sizes), (order % k).split(sizes)
    return [ExpertGroup(e, t, s, n) for e, t, s, n in zip(experts, tokens, slots, sizes)]


def expert_inputs(
    hidden: torch.Tensor, top_k_weights: torch.Tensor, group: ExpertGroup, weight_on_input: bool
) -> torch.Tensor:  # [N_e, H]
    x = hidden[group.tokens]
    if weight_on_input:
        x = x * top_k_weights[group.tokens, group.slots, None].to(x.dtype)
    return x


def combine(
    out: torch.Tensor,  # [T, H], accumulated in place
    top_k_weights: torch.Tensor,  # [T, K]
    group: ExpertGroup,
    expert_out: torch.Tensor,  # [N_e, H]
    weight_on_input: bool,
) -> None:
    if not weight_on_input:
        expert_out = expert_out * top_k_weights[group.tokens, group.slots, None]
    out.index_add_(0, group.tokens, expert_out.to(out.dtype))


class LocalExperts(torch.nn.Module):
    """A layer's routed experts computed in this process, with the `transformers` experts signature."""

    def __init__(self, weights: dict[int, ExpertWeights], act: Callable, weight_on_input: bool):
        super().__init__()
        self.weights, self.act, self.weight_on_input = weights, act, weight_on_input

    def forward(self, hidden_states, top_k_index, top_k_weights):  # [T, H], [T, K], [T, K] -> [T, H]
        out = torch.zeros_like(hidden_states)
        for group in group_tokens(top_k_index):
            x = expert_inputs(hidden_states, top_k_weights, group, self.weight_on_input)
            combine(out, top_k_weights, group, expert_ffn(x, self.weights[group.expert], self.act), self.weight_on_input)
        return out


@dataclass(frozen=True)
class StackedExperts:
    """Every routed expert of one layer in one pair of tensors, expert e at index e."""

    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]

    @classmethod
    def empty(cls, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
              device: str | torch.device) -> "StackedExperts":
        return cls(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype, device=device),
                   torch.empty(num_experts, hidden, intermediate, dtype=dtype, device=device))

    def expert(self, e: int) -> ExpertWeights:  # views: the expert shares the stack's memory
        return ExpertWeights(self.gate_up[e], self.down[e])

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]


def expert_counts(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:  # [T, K] -> [E] int64
    """Tokens per expert, computed where the index lives. index_add_, not bincount: bincount sizes
    its output from the largest id, which a CUDA tensor can only tell the host by waiting for the GPU."""
    flat = top_k_index.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def can_group(dtype: torch.dtype, device: torch.device, hidden: int, intermediate: int) -> bool:
    """Whether `grouped_ffn` and `sorted_ffn` run here: torch's grouped GEMM, on CPU any dtype; on
    CUDA bfloat16 (its kernels' dtype) on Ampere or newer, with rows of whole 16-byte units (the
    kernel's alignment)."""
    device = torch.device(device)
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return all(n * dtype.itemsize % 16 == 0 for n in (hidden, 2 * intermediate, intermediate))


@functools.lru_cache(maxsize=None)
def _small_kernel(device: torch.device) -> bool:
    return moe_kernels.available(device)


def _small(x: torch.Tensor) -> bool:
    """Whether rows of `x` [S, ...] are a decode-sized S on a GPU: kubemoe's kernels (moe_kernels.py)."""
    return x.shape[0] <= moe_kernels.GROUPED_SMALL_ROWS and _small_kernel(x.device)


def _grouped_mm(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor,
                scatter: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [S, K] sorted by expert, weights [E, N, K], ends [E] -> [S, N]: a decode-sized S on a GPU by
    kubemoe's kernel (moe_kernels.py), else torch's grouped GEMM. `scatter` = (out, dst): row s's
    result into out[dst[s]] (`sorted_ffn`'s), -> out."""
    if _small(x):
        return moe_kernels.grouped_mm_small(x, weights, ends, scatter=scatter)
    y = F.grouped_mm(x, weights.transpose(-2, -1), offs=ends)
    if scatter is None:
        return y
    out, dst = scatter
    return out.index_copy_(0, dst, y.to(out.dtype))


@dataclass(frozen=True)
class SortedPairs:
    """A layer's (token, choice) pairs sorted by expert, where the hidden states live: row i of `x` is
    pair `order[i]` (token order[i] // K, choice order[i] % K). Rows of one expert are contiguous, in
    pair order; `ends` says where each expert's rows end. S = T * K rows."""

    order: torch.Tensor  # [S] int64
    ends: torch.Tensor  # [E'] int32, cumulative (E' = E, or E + 1 whose last group is the spare rows)
    x: torch.Tensor  # [S, H] the rows' inputs, weighted where the architecture weighs inputs
    top_k_weights: torch.Tensor  # [T, K] the routing weights, in token order
    k: int
    positions: torch.Tensor | None = None  # [S] int32 pair t * K + j's row (order's inverse), where the kernel made it

    @functools.cached_property
    def weights(self) -> torch.Tensor:  # [S, 1] the rows' routing weights
        return self.top_k_weights.reshape(-1)[self.order, None]

    def tokens(self, start: int, end: int) -> torch.Tensor:  # [end - start] the batch rows of rows [start, end)
        return self.order[start:end] // self.k

    def group(self, expert: int, start: int, end: int) -> ExpertGroup:
        """Rows [start, end) (one expert's) as an ExpertGroup: views, no copy of the rows."""
        rows = self.order[start:end]
        return ExpertGroup(expert, rows // self.k, rows % self.k, end - start)


def sort_pairs(
    hidden: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, K]
    top_k_weights: torch.Tensor,  # [T, K]
    num_experts: int,
    weight_on_input: bool,
    counts: torch.Tensor | None = None,  # [E] from `expert_counts`, if the caller has it already
    real_rows: torch.Tensor | None = None,  # int device scalar: rows past it are spare (a graph's padding)
    into: torch.Tensor | None = None,  # [>= S, H] of hidden's dtype: where x is gathered (x is its first S rows)
) -> SortedPairs:
    """The pairs sorted by expert, without waiting for the device: the group boundaries stay a device
    tensor. With `real_rows`, the spare rows' pairs sort last as an expert of their own (id E), so a
    replayed graph can pad a batch without its spare rows reaching any expert. `into` saves a copy
    where the rows go to a buffer another process reads (device_link.py)."""
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)  # [S]
    positions = None
    if _small(flat):  # one kernel for what a sort, the counts, their cumsum and the spare rows' marking take several for
        order, ends, positions = moe_kernels.group_pairs(flat, num_experts, real_rows, k)
    else:
        if real_rows is not None:
            flat = torch.where(torch.arange(flat.shape[0], device=flat.device) < real_rows * k, flat, num_experts)
            num_experts, counts = num_experts + 1, None
        experts_sorted, order = flat.sort(stable=True)  # [S]
        if counts is None:
            counts = expert_counts(experts_sorted, num_experts)
        ends = counts.cumsum(0, dtype=torch.int32)
    tokens = order // k
    x = hidden[tokens] if into is None else torch.index_select(hidden, 0, tokens, out=into[:flat.shape[0]])  # [S, H]
    pairs = SortedPairs(order, ends, x, top_k_weights, k, positions)
    if weight_on_input:
        x.mul_(pairs.weights.to(x.dtype))  # x is a gathered copy: weighed in place
    return pairs


def unsort_pairs(y: torch.Tensor, pairs: SortedPairs) -> torch.Tensor:  # [S, H] in sorted order -> [T, H]
    """Each token's K rows summed, in a fixed order (deterministic, unlike index_add_'s atomics on CUDA)."""
    unsorted = torch.empty_like(y)
    unsorted[pairs.order] = y
    return unsorted.view(-1, pairs.k, y.shape[-1]).sum(dim=1)


def weighted_sum(y: torch.Tensor, pairs: SortedPairs, dtype: torch.dtype) -> torch.Tensor:  # [S, H] sorted -> [T, H]
    """Each token's K outputs (rows of y) times their routing weights, summed in float32 where the weights
    are (as transformers' experts sum), in `dtype`: one kernel where the grouping kernel ran (`positions`)."""
    if pairs.positions is not None:
        return moe_kernels.combine_pairs(y, pairs.positions, pairs.top_k_weights, dtype)
    return unsort_pairs(y * pairs.weights, pairs).to(dtype)


def sorted_ffn(
    x: torch.Tensor,  # [S, H] rows sorted by expert
    ends: torch.Tensor,  # [E] int32 end row of each expert's rows (cumulative: F.grouped_mm's offs), on x's device
    experts: StackedExperts,
    act: Callable[[torch.Tensor], torch.Tensor],
    order: torch.Tensor | None = None,  # [S] int64: row r is x[order[r]] (x then any number of rows)
    scatter: tuple[torch.Tensor, torch.Tensor] | None = None,  # (out [>= S, H], dst [S] int64)
) -> torch.Tensor:  # [S, H]
    """Each expert's FFN of its own rows, as two grouped GEMMs; an expert without rows costs nothing.
    With `order`, the rows are gathered from x as the first GEMM reads them, where the kernel can. With
    `scatter`, row r's output goes to out[dst[r]] (in out's dtype) as the last GEMM writes it, where the
    kernel can; -> out."""
    sorted_rows = x if order is None else order
    if _small(sorted_rows) and is_silu(act):  # gate, up, silu and their product in one kernel
        h = moe_kernels.swiglu_grouped_mm(x, experts.gate_up, ends, grouping=None if order is None else (order, 1))
        return _grouped_mm(h, experts.down, ends, scatter)
    if order is not None:
        x = x[order]
    gate, up = _grouped_mm(x, experts.gate_up, ends).chunk(2, dim=-1)  # [S, I] each
    return _grouped_mm(act(gate) * up, experts.down, ends, scatter)


# What SiLU is called where an activation comes from: torch, and transformers' ACT2FN["silu"].
SILU = frozenset({"SiLU", "SiLUActivation"})


def upload_ends(ends: Sequence[int], device: torch.device) -> torch.Tensor:  # [E] int32 on `device`
    """Group ends known on the host (`sorted_ffn`'s `ends`), on `device`. From pinned memory: a DMA queued
    in stream order, where from pageable memory torch would wait for the stream."""
    if device.type == "cpu":
        return torch.tensor(ends, dtype=torch.int32)
    return torch.tensor(ends, dtype=torch.int32, pin_memory=True).to(device, non_blocking=True)


def is_silu(act: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether `act` is SiLU (the SwiGLU experts of every seed architecture but GPT-OSS's), which
    kubemoe's kernels fuse into the grouped GEMM."""
    return act is F.silu or type(act).__name__ in SILU


def grouped_ffn(
    hidden: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, K]
    top_k_weights: torch.Tensor,  # [T, K]
    experts: StackedExperts,
    act: Callable[[torch.Tensor], torch.Tensor],
    weight_on_input: bool,
    counts: torch.Tensor | None = None,  # [E] from `expert_counts`, if the caller has it already
) -> torch.Tensor:  # [T, H]
    """A layer's routed experts as two grouped GEMMs over the (token, choice) pairs sorted by expert.

    Nothing here waits for the device, and a group of no rows costs the kernel nothing (its expert's
    weights are not read). The K outputs of a token are summed in float32, as transformers'
    grouped_mm experts do.
    """
    flat = top_k_index.reshape(-1)  # [S]
    if _small(flat) and is_silu(act) and not weight_on_input:
        # a decode-sized batch on a GPU: four kernels (grouping; the gather, gate, up and silu; down; the
        # weighted sum), where the steps below take about a dozen
        order, ends, positions = moe_kernels.group_pairs(flat, experts.num_experts)
        h = moe_kernels.swiglu_grouped_mm(hidden, experts.gate_up, ends, grouping=(order, top_k_index.shape[1]))
        return moe_kernels.combine_pairs(_grouped_mm(h, experts.down, ends), positions, top_k_weights, hidden.dtype)
    pairs = sort_pairs(hidden, top_k_index, top_k_weights, experts.num_experts, weight_on_input, counts)
    y = sorted_ffn(pairs.x, pairs.ends, experts, act)  # [S, H]
    return unsort_pairs(y, pairs).to(hidden.dtype) if weight_on_input else weighted_sum(y, pairs, hidden.dtype)
