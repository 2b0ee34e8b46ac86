"""Grouped GEMM for decode-sized batches on a GPU: one Triton kernel, the semantics of `F.grouped_mm`.

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

import torch

GROUPED_SMALL_ROWS = 256  # at most this many rows: this kernel; more: torch's grouped GEMM


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_mm_small(x_ptr, w_ptr, ends_ptr, out_ptr, N, K, stride_xs, stride_we, stride_wn, stride_os,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_os + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])

    return grouped_mm_small



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
                     config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [S, K] (rows sorted by expert), weights [E, N, K], ends [E] int32 (each expert's end row,
    cumulative, as `F.grouped_mm`'s offs) -> [S, N] in x's dtype: row s times its expert's weights.
    `config`: (BLOCK_N, BLOCK_K, warps, stages[, BLOCK_M]), default `blocks(N, K)` and a BLOCK_M
    from the rows."""
    import triton

    rows, k = x.shape
    experts, n, _ = weights.shape
    block_n, block_k, num_warps, num_stages, *chosen_m = config or blocks(n, k)
    x, weights = x.contiguous(), weights.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_m = chosen_m[0] if chosen_m else min(64, max(16, triton.next_power_of_2(rows)))
    _kernel()[(experts, triton.cdiv(n, block_n))](x, weights, ends, out, n, k, x.stride(0), weights.stride(0),
                                                  weights.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                                                  BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out


def available(device: torch.device) -> bool:
    """Whether kubemoe's Triton kernels can run for tensors on `device` (a CUDA device and Triton installed)."""
    return device.type == "cuda" and triton_installed()


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
    def group_pairs(experts_ptr, order_ptr, ends_ptr, S, E, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
                    CHUNK: tl.constexpr):
        s = tl.arange(0, BLOCK_S)
        live = s < S
        mine = tl.load(experts_ptr + s, mask=live, other=0)  # [BS]
        before = tl.zeros((BLOCK_S,), dtype=tl.int32)  # pairs that sort ahead of each: a smaller expert, or
        for c0 in range(0, S, CHUNK):  # the same expert at an earlier pair (stable)
            c = c0 + tl.arange(0, CHUNK)
            theirs = tl.load(experts_ptr + c, mask=c < S, other=0)  # [C]
            ahead = (theirs[None, :] < mine[:, None]) | ((theirs[None, :] == mine[:, None]) & (c[None, :] < s[:, None]))
            before += tl.sum((ahead & (c[None, :] < S)).to(tl.int32), axis=1)
        tl.store(order_ptr + before, s.to(tl.int64), mask=live)
        e = tl.arange(0, BLOCK_E)
        ends = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for c0 in range(0, S, CHUNK):
            c = c0 + tl.arange(0, CHUNK)
            theirs = tl.load(experts_ptr + c, mask=c < S, other=E)  # past every expert: counts for none
            ends += tl.sum((theirs[None, :] <= e[:, None]).to(tl.int32), axis=1)
        tl.store(ends_ptr + e, ends, mask=e < E)

    return group_pairs



def group_pairs(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [S] int64 (each (token, choice) pair's expert; S at most GROUPED_SMALL_ROWS) -> (order [S]
    int64: the pairs sorted by expert, stably, as `experts.sort(stable=True)`'s indices; ends [E] int32:
    each expert's end row in that order, cumulative). One kernel of S x (S + E) comparisons, where a
    stable sort of 256 keys took 27 us on the H200 (decode_step_probe at 0c40a9b) and the counts and
    their cumsum four more kernels."""
    import triton

    (s,) = experts.shape
    if s > GROUPED_SMALL_ROWS:
        raise ValueError(f"group_pairs takes at most {GROUPED_SMALL_ROWS} pairs, got {s}: sort larger batches")
    order = torch.empty(s, dtype=torch.int64, device=experts.device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=experts.device)
    # one block of GROUPED_SMALL_ROWS for every S: compiled once per model, not once per batch size
    _group_kernel()[(1,)](experts.contiguous(), order, ends, s, num_experts, BLOCK_S=GROUPED_SMALL_ROWS,
                          BLOCK_E=max(16, triton.next_power_of_2(num_experts)), CHUNK=32)
    return order, ends
