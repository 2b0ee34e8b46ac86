"""An MoE layer's device work at decode sizes on a GPU, as few Triton kernels: the router's top-k
(`top_k`), the pairs grouped by expert (`group_pairs`), the grouped GEMMs (`grouped_mm_small`, the
semantics of `F.grouped_mm`; `swiglu_grouped_mm`, the gate and up projections with SiLU and their
product), and each token's weighted sum of its experts' outputs (`combine_pairs`).

At decode sizes each of torch's kernels moves a few kilobytes, so a layer's time went on how many
there were: in a CUDA-graph decode pass of Qwen3-30B-A3B at batch 32 (decode_step_probe.py at efa80d5)
the kernels around the grouped GEMMs (router top-k, sort, gathers, weighting, unsort, sum) took about
as long as the GEMMs themselves.

torch's grouped GEMM tiles each expert's rows by 64 or 128 whatever their number: with the few
tokens per expert of a decode step it streamed the weights at 0.3-0.45 of the H200's HBM bandwidth
(`benchmarks/experiments/decode_step_probe.py`: 1.5 ms for a Mixtral layer whose 8 experts need
0.67 ms). Here each program takes one expert and a block of its output features, runs over that
expert's rows (BLOCK_M at a time, usually one block) while streaming the weight block once, and does
nothing at all for an expert no row chose, so a step reads only the weights of the experts it uses.
`GROUPED_SMALL_ROWS` is the largest size measured (the H200 sweep at 6fbf38a: still 0.74x torch's time
at 256 rows for Mixtral's gate/up); above it torch's kernel, which reuses each weight tile across many
rows (prefill), takes over.

Shapes: S = rows sorted by expert (token, choice pairs), K = input features, N = output features,
E = experts. Weights stay in their stored layout [E, N, K] (row n of expert e is a contiguous K).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

GROUPED_SMALL_ROWS = 256  # at most this many rows: this kernel; more: torch's grouped GEMM


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_mm_small(x_ptr, w_ptr, ends_ptr, out_ptr, dst_ptr, N, K, stride_xs, stride_we, stride_wn, stride_os,
                         SCATTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        e = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        end = tl.load(ends_ptr + e)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        w_base = w_ptr + e.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
        for m0 in range(start, end, BLOCK_M):  # no iteration, no weight read, for an expert without rows
            rows = m0 + tl.arange(0, BLOCK_M)
            rmask = rows < end
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                kmask = ks < K
                x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xs + ks[None, :],
                            mask=rmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(w_base + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)  # [BN, BK]
                acc += tl.dot(x, tl.trans(w))
            if SCATTER:  # row r's output to row dst[r]
                at = tl.load(dst_ptr + rows, mask=rmask, other=0)
            else:
                at = rows
            tl.store(out_ptr + at[:, None].to(tl.int64) * stride_os + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])

    return grouped_mm_small


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    """t itself where its last dimension has unit stride (the kernels take every other stride), else a
    contiguous copy. A stack of views into a larger buffer (the offload store's slot stack: every slot, each
    expert's gate/up and down side by side) is not contiguous, and .contiguous() copied all of it, 2.6 GB
    at Qwen3-30B-A3B's 274 slots, 3 ms a call where the kernel reads a few experts in 0.1 ms
    (grouped_slots_probe.py on the H200 at c55eab3)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def blocks(n: int, k: int) -> tuple[int, ...]:
    """(BLOCK_N, BLOCK_K, warps, stages[, BLOCK_M]) for weights of N x K, swept on the H200
    (decode_step_probe.py). Mixtral's experts at 6fbf38a, 2-256 rows: a long K (the down projection,
    K = 14336) streams best in 128 x 128 tiles on 8 warps, 0.25-0.28 ms against a 0.23 ms bound for 8
    experts; the gate/up projection (K = 4096) in 64 x 64 tiles, 0.45-0.49 ms against 0.46.
    Qwen3-30B-A3B's at 0c40a9b (K = 2048 and 768; 128 experts, about 2 rows each at batch 32): 64 x 128
    tiles with BLOCK_M 16, 0.187 / 0.108 ms at 256 rows against bounds of 0.181 / 0.091 (64 x 64 with
    BLOCK_M 64: 0.197 / 0.117)."""
    if k >= 8192:
        return (128, 128, 8, 3)
    if k >= 4096:
        return (64, 64, 4, 4)
    return (64, 128, 4, 4, 16)


def grouped_mm_small(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor,
                     config: tuple[int, ...] | None = None,
                     scatter: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [S, K] (rows sorted by expert), weights [E, N, K], ends [E] int32 (each expert's end row,
    cumulative, as `F.grouped_mm`'s offs) -> [S, N] in x's dtype: row s times its expert's weights.
    `config`: (BLOCK_N, BLOCK_K, warps, stages[, BLOCK_M]), default `blocks(N, K)` and a BLOCK_M
    from the rows. `scatter` = (out [>= S, N], dst [S] int64): row s's result written to out[dst[s]]
    (in out's dtype) for the rows of some expert, the others' rows of out untouched; -> out."""
    import triton

    rows, k = x.shape
    experts, n, _ = weights.shape
    block_n, block_k, num_warps, num_stages, *chosen_m = config or blocks(n, k)
    x, weights = _unit_rows(x), _unit_rows(weights)
    out, dst = scatter if scatter is not None else (torch.empty(rows, n, dtype=x.dtype, device=x.device), ends)
    if out.stride(1) != 1:
        raise ValueError("grouped_mm_small writes rows of unit stride")
    block_m = chosen_m[0] if chosen_m else min(64, max(16, triton.next_power_of_2(rows)))
    _kernel()[(experts, triton.cdiv(n, block_n))](x, weights, ends, out, dst, n, k, x.stride(0), weights.stride(0),
                                                  weights.stride(1), out.stride(0), SCATTER=scatter is not None,
                                                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                                  num_warps=num_warps, num_stages=num_stages)
    return out


def available(device: torch.device) -> bool:
    """Whether kubemoe's Triton kernels can run for tensors on `device` (a CUDA device and Triton installed)."""
    return device.type == "cuda" and triton_installed()


def runs_here(device: torch.device) -> bool:
    """Whether to launch kubemoe's kernels for tensors on `device` now: they can run there, and this is not
    a pass TorchDynamo is compiling (Inductor fuses the same steps itself, and a Triton launch would break
    its graph)."""
    return available(device) and not torch.compiler.is_compiling()


@functools.cache
def triton_installed() -> bool:
    """Asked once per process: the kernels' callers ask on every pass."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _group_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["S"])
    def group_pairs(experts_ptr, real_ptr, order_ptr, ends_ptr, positions_ptr, S, E, TOP_K, SPARE: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
        s = tl.arange(0, BLOCK_S)
        live = s < S
        if SPARE:  # pairs of rows from the real ones' count on: group E - 1, the spare rows'
            real = tl.load(real_ptr).to(tl.int32) * TOP_K
        else:
            real = S
        mine = tl.load(experts_ptr + s, mask=live, other=0)  # [BS]
        mine = tl.where(s < real, mine, E - 1)
        before = tl.zeros((BLOCK_S,), dtype=tl.int32)  # pairs that sort ahead of each: a smaller expert, or
        for c0 in range(0, S, CHUNK):  # the same expert at an earlier pair (stable)
            c = c0 + tl.arange(0, CHUNK)
            theirs = tl.load(experts_ptr + c, mask=c < S, other=0)  # [C]
            theirs = tl.where(c < real, theirs, E - 1)
            ahead = (theirs[None, :] < mine[:, None]) | ((theirs[None, :] == mine[:, None]) & (c[None, :] < s[:, None]))
            before += tl.sum((ahead & (c[None, :] < S)).to(tl.int32), axis=1)
        tl.store(order_ptr + before, s.to(tl.int64), mask=live)
        tl.store(positions_ptr + s, before, mask=live)
        e = tl.arange(0, BLOCK_E)
        ends = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for c0 in range(0, S, CHUNK):
            c = c0 + tl.arange(0, CHUNK)
            theirs = tl.load(experts_ptr + c, mask=c < S, other=E)  # past every expert: counts for none
            theirs = tl.where((c < real) | (c >= S), theirs, E - 1)
            ends += tl.sum((theirs[None, :] <= e[:, None]).to(tl.int32), axis=1)
        tl.store(ends_ptr + e, ends, mask=e < E)

    return group_pairs


class Grouping(NamedTuple):
    """Pairs sorted by expert: order [S] int64 (the pairs in sorted order, as a stable sort's indices),
    ends [E] int32 (each expert's end row, cumulative), positions [S] int32 (where each pair went:
    order's inverse)."""

    order: torch.Tensor
    ends: torch.Tensor
    positions: torch.Tensor


def group_pairs(experts: torch.Tensor, num_experts: int, real_rows: torch.Tensor | None = None,
                top_k: int = 1) -> Grouping:
    """experts [S] int64 (each (token, choice) pair's expert; S at most GROUPED_SMALL_ROWS) -> the pairs
    grouped by expert, stably (`Grouping`). One kernel of S x (S + E) comparisons, where a stable sort
    of 256 keys took 27 us on the H200 (decode_step_probe at 0c40a9b) and the counts and their cumsum
    four more kernels. With `real_rows` (an int device scalar; pair i is row i // top_k's), the pairs of
    the rows past the real ones form one more group, num_experts, last: a graph's padding, marked in
    the kernel where a where over an arange took four more."""
    import triton

    (s,) = experts.shape
    if s > GROUPED_SMALL_ROWS:
        raise ValueError(f"group_pairs takes at most {GROUPED_SMALL_ROWS} pairs, got {s}: sort larger batches")
    groups = num_experts + (real_rows is not None)
    order = torch.empty(s, dtype=torch.int64, device=experts.device)
    positions = torch.empty(s, dtype=torch.int32, device=experts.device)
    ends = torch.empty(groups, dtype=torch.int32, device=experts.device)
    # one block of GROUPED_SMALL_ROWS for every S: compiled once per model, not once per batch size
    _group_kernel()[(1,)](experts.contiguous(), experts if real_rows is None else real_rows, order, ends, positions,
                          s, groups, top_k, SPARE=real_rows is not None, BLOCK_S=GROUPED_SMALL_ROWS,
                          BLOCK_E=max(16, triton.next_power_of_2(groups)), CHUNK=32)
    return Grouping(order, ends, positions)


@functools.cache
def _swiglu_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_grouped_mm(x_ptr, order_ptr, w_ptr, ends_ptr, out_ptr, I, K, TOP_K, stride_xs, stride_we, stride_wn,
                          stride_os, GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
        e = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < I
        end = tl.load(ends_ptr + e)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        gate_base = w_ptr + e.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
        up_base = gate_base + I.to(tl.int64) * stride_wn  # row I + n of gate_up: feature n's up projection
        dt = out_ptr.dtype.element_ty
        for m0 in range(start, end, BLOCK_M):  # no iteration, no weight read, for an expert without rows
            rows = m0 + tl.arange(0, BLOCK_M)
            rmask = rows < end
            if GATHER:  # row r is pair order[r]: token order[r] // TOP_K's hidden state
                src = tl.load(order_ptr + rows, mask=rmask, other=0) // TOP_K
            else:
                src = rows
            gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                kmask = ks < K
                x = tl.load(x_ptr + src[:, None].to(tl.int64) * stride_xs + ks[None, :],
                            mask=rmask[:, None] & kmask[None, :], other=0.0)
                wmask = cmask[:, None] & kmask[None, :]
                gate += tl.dot(x, tl.trans(tl.load(gate_base + ks[None, :], mask=wmask, other=0.0)))
                up += tl.dot(x, tl.trans(tl.load(up_base + ks[None, :], mask=wmask, other=0.0)))
            # rounded where the unfused path rounds: gate and up as the GEMM's output, silu(gate), the product
            g = gate.to(dt).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            out = (act * up.to(dt).to(tl.float32)).to(dt)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_os + cols[None, :], out,
                     mask=rmask[:, None] & cmask[None, :])

    return swiglu_grouped_mm


def swiglu_grouped_mm(x: torch.Tensor, gate_up: torch.Tensor, ends: torch.Tensor,
                      grouping: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """The first half of a SwiGLU expert, silu(x W_gate^T) * (x W_up^T), for rows sorted by expert in one
    kernel: gate_up [E, 2I, K] (gate rows first, as StackedExperts holds them), ends [E] int32 -> [S, I]
    in x's dtype, rounded where `grouped_mm_small` then silu and a product would round.
    x: [S, K] the sorted rows; or, with `grouping` = (order [S], top_k), [T, K] the tokens, row r being
    token order[r] // top_k (the gather of the sorted rows done in the kernel's loads)."""
    import triton

    experts, two_i, k = gate_up.shape
    intermediate = two_i // 2
    rows = grouping[0].shape[0] if grouping is not None else x.shape[0]
    order, top_k = grouping if grouping is not None else (ends, 1)  # ends: any pointer, never read
    # Each program streams a block of gate rows and the same block of up rows: half blocks.n of the unfused
    # gate_up kernel's, the same weight bytes per program.
    block_n, block_k, num_warps, num_stages, *chosen_m = blocks(two_i, k)
    x, gate_up = _unit_rows(x), _unit_rows(gate_up)
    out = torch.empty(rows, intermediate, dtype=x.dtype, device=x.device)
    block_m = chosen_m[0] if chosen_m else min(64, max(16, triton.next_power_of_2(rows)))
    _swiglu_kernel()[(experts, triton.cdiv(intermediate, block_n // 2))](
        x, order, gate_up, ends, out, intermediate, k, top_k, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        out.stride(0), GATHER=grouping is not None, BLOCK_M=block_m, BLOCK_N=block_n // 2, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages)
    return out


@functools.cache
def _combine_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def combine_pairs(y_ptr, positions_ptr, w_ptr, out_ptr, H, stride_ys, stride_wt, stride_ot, TOP_K: tl.constexpr,
                      ROUND: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        live = cols < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):  # the K choices in order, as a sum over them would
            row = tl.load(positions_ptr + t * TOP_K + j).to(tl.int64)
            w = tl.load(w_ptr + t * stride_wt + j)
            product = tl.load(y_ptr + row * stride_ys + cols, mask=live, other=0.0).to(tl.float32) * w.to(tl.float32)
            if ROUND:  # y times a weight of y's dtype is a tensor of that dtype in torch
                product = product.to(w.dtype).to(tl.float32)
            acc += product
        tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=live)

    return combine_pairs


def combine_pairs(y: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [S, H] (the pairs' outputs, sorted by expert), positions [S] (pair t * K + j's row of y: the
    Grouping's), weights [T, K] -> [T, H] in `dtype`: each token's K outputs times their weights, summed
    in float32, in one kernel where the weighting, the unsort and the sum took four."""
    import triton

    tokens, top_k = weights.shape
    hidden = y.shape[1]
    product = torch.promote_types(y.dtype, weights.dtype)
    if product not in (torch.float32, weights.dtype):
        raise ValueError(f"combine_pairs weighs {y.dtype} outputs by float32 or {y.dtype} weights, not {weights.dtype}")
    y, weights = y.contiguous(), weights.contiguous()
    out = torch.empty(tokens, hidden, dtype=dtype, device=y.device)
    block = min(1024, triton.next_power_of_2(hidden))
    if tokens:
        _combine_kernel()[(tokens, triton.cdiv(hidden, block))](
            y, positions, weights, out, hidden, y.stride(0), weights.stride(0), out.stride(0), TOP_K=top_k,
            ROUND=product != torch.float32, BLOCK_H=block, num_warps=4)
    return out


@functools.cache
def _top_k_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def top_k(logits_ptr, weights_ptr, index_ptr, E, stride_l, stride_w, stride_i, TOP_K: tl.constexpr,
              SOFTMAX: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK_E)
        live = lanes < E
        scores = tl.load(logits_ptr + t * stride_l + lanes, mask=live, other=float("-inf")).to(tl.float32)
        if SOFTMAX:
            p = tl.exp(scores - tl.max(scores, axis=0))
            scores = tl.where(live, p / tl.sum(p, axis=0), float("-inf"))
        total = 1.0
        if NORMALIZE:  # the K best scores' sum first: the same selection twice, as cheap as storing it
            total = 0.0
            left = scores
            for _ in tl.static_range(TOP_K):
                best = tl.argmax(left, axis=0, tie_break_left=True)
                total += tl.max(left, axis=0)
                left = tl.where(lanes == best, float("-inf"), left)
        left = scores
        for j in tl.static_range(TOP_K):  # best first, as torch.topk's sorted output
            best = tl.argmax(left, axis=0, tie_break_left=True)
            value = tl.max(left, axis=0)
            tl.store(weights_ptr + t * stride_w + j, (value / total).to(weights_ptr.dtype.element_ty))
            tl.store(index_ptr + t * stride_i + j, best.to(tl.int64))
            left = tl.where(lanes == best, float("-inf"), left)

    return top_k


def top_k(logits: torch.Tensor, k: int, softmax: bool, normalize: bool,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, K] in `dtype`, experts [T, K] int64), best first: the K largest
    softmax scores (`softmax`) or logits, divided by their sum (`normalize`), in one kernel where
    torch's softmax, topk (two kernels), sum, division and cast take six. Equal scores: the lower
    expert first."""
    import triton

    tokens, experts = logits.shape
    if not 1 <= k <= experts:
        raise ValueError(f"top_k picks 1 to {experts} experts of {experts}, not {k}")
    logits = _unit_rows(logits)
    weights = torch.empty(tokens, k, dtype=dtype, device=logits.device)
    index = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
    if tokens:
        _top_k_kernel()[(tokens,)](logits, weights, index, experts, logits.stride(0), weights.stride(0),
                                   index.stride(0), TOP_K=k, SOFTMAX=softmax, NORMALIZE=normalize,
                                   BLOCK_E=triton.next_power_of_2(experts), num_warps=1 if experts <= 256 else 4)
    return weights, index
