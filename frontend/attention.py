"""Decode attention over the batch's cache on a GPU: one query per row, each row's columns chosen by its mask.

A decode pass (batch.py's SlotPass) attends each row's one query over every allocated column of its
cache row, with a boolean mask [B, 1, 1, W] saying which columns the row uses (causal, a sliding window
or chunks, as the model's config asks). Through SDPA that ran the memory-efficient kernel: about 55 us
per layer for Qwen3-30B-A3B at batch 32 on the H200, where the cache's bytes take about 8 us at HBM
bandwidth (issue 17, decode_step_probe.py), and 49 us at batch 1. Here two Triton kernels
("flash-decoding"): the first gives each program one row, one key/value head with the query heads that
share it (GQA), and a slice of the columns, reads the keys and values of the attended columns only (a
masked-off column's load is predicated off, so it costs no memory traffic) and keeps an online softmax;
the second, a program per query head, merges them MERGE_SLICES at a time. Slices are SLICE columns
from column 0 whatever the batch: a row's result then depends on its own query, keys, values and mask
only, never on the rows beside it or on how wide the cache has grown (a masked column adds exactly
nothing, an empty slice merges with weight 0), so a sequence decodes the same bits in any batch.
128 columns give a 512-token prompt at batch 1 five slices per head.

Registered with transformers' AttentionInterface as "kubemoe" (`use`); every other call (prefill, a
float or no mask, softcap, attention sinks, a tensor off the GPU) goes to transformers' SDPA function
unchanged. Opaque to TorchDynamo, so a compiled pass (compiled.py) calls the kernels as they are.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from kubemoe import moe_kernels
from kubemoe.frontend import step_pass

NAME = "kubemoe"
BLOCK_N = 64  # columns per step of the first kernel
SLICE = 128  # columns per program of the first kernel (a multiple of BLOCK_N)
MERGE_SLICES = 16  # slices the second kernel loads at once (2048 columns)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, part_ptr, max_ptr, sum_ptr, W, G, KVH, DK, DV, scale,
                     cols_per_split, SPLITS, sq_b, sq_h, sk_b, sk_h, sk_w, sv_b, sv_h, sv_w, sm_b, sm_w,
                     BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                     PRECISION: tl.constexpr):
        bh, split = tl.program_id(0), tl.program_id(1)
        b, h = bh // KVH, bh % KVH
        g, dk, dv = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
        q = tl.load(q_ptr + b.to(tl.int64) * sq_b + (h * G + g)[:, None] * sq_h + dk[None, :],
                    mask=(g < G)[:, None] & (dk < DK)[None, :], other=0.0)  # [BG, BDK]
        k_base = k_ptr + b.to(tl.int64) * sk_b + h.to(tl.int64) * sk_h
        v_base = v_ptr + b.to(tl.int64) * sv_b + h.to(tl.int64) * sv_h
        high = tl.full((BLOCK_G,), float("-inf"), tl.float32)  # the running maximum score per query head
        total = tl.zeros((BLOCK_G,), tl.float32)  # sum of exp(score - high)
        acc = tl.zeros((BLOCK_G, BLOCK_DV), tl.float32)
        start = split * cols_per_split
        end = tl.minimum(start + cols_per_split, W)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            live = (n < end) & (tl.load(mask_ptr + b.to(tl.int64) * sm_b + n * sm_w, mask=n < end, other=0) != 0)
            k = tl.load(k_base + n[:, None].to(tl.int64) * sk_w + dk[None, :], mask=live[:, None] & (dk < DK)[None, :],
                        other=0.0)  # [BN, BDK]
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BG, BN]
            s = tl.where(live[None, :], s, float("-inf"))
            new_high = tl.maximum(high, tl.max(s, axis=1))
            shift = tl.where(new_high == float("-inf"), 0.0, new_high)  # nothing attended yet: exp(-inf) = 0, no NaN
            p = tl.exp(s - shift[:, None])
            alpha = tl.exp(high - shift)
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + n[:, None].to(tl.int64) * sv_w + dv[None, :], mask=live[:, None] & (dv < DV)[None, :],
                        other=0.0)  # [BN, BDV]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            high = new_high
        at = (bh * SPLITS + split) * BLOCK_G + g
        tl.store(max_ptr + at, high)
        tl.store(sum_ptr + at, total)
        tl.store(part_ptr + at[:, None] * BLOCK_DV + dv[None, :], acc)

    @triton.jit
    def merge_kernel(part_ptr, max_ptr, sum_ptr, out_ptr, G, KVH, DV, SPLITS, so_b, so_h,
                     BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
        # One program per query head, BLOCK_S slices loaded at once (one round of loads up to BLOCK_S
        # slices: a slice after another took 11.5 us a call at batch 1 on the H200, 1355903).
        bh, g = tl.program_id(0), tl.program_id(1)
        b, h = bh // KVH, bh % KVH
        dv = tl.arange(0, BLOCK_DV)
        high = tl.max(tl.full((BLOCK_S,), float("-inf"), tl.float32), axis=0)
        total = tl.sum(tl.zeros((BLOCK_S,), tl.float32), axis=0)
        acc = tl.zeros((BLOCK_DV,), tl.float32)
        for s0 in range(0, SPLITS, BLOCK_S):
            split = s0 + tl.arange(0, BLOCK_S)
            live = split < SPLITS
            at = (bh * SPLITS + split) * BLOCK_G + g
            m = tl.load(max_ptr + at, mask=live, other=float("-inf"))
            new_high = tl.maximum(high, tl.max(m, axis=0))
            shift = tl.where(new_high == float("-inf"), 0.0, new_high)
            weight = tl.exp(m - shift)  # a slice with no attended column weighs 0
            alpha = tl.exp(high - shift)
            total = total * alpha + tl.sum(weight * tl.load(sum_ptr + at, mask=live, other=0.0), axis=0)
            part = tl.load(part_ptr + at[:, None] * BLOCK_DV + dv[None, :], mask=live[:, None], other=0.0)
            acc = acc * alpha + tl.sum(weight[:, None] * part, axis=0)
            high = new_high
        out = acc / tl.where(total == 0.0, 1.0, total)  # a row attending nothing gives zeros
        tl.store(out_ptr + b.to(tl.int64) * so_b + (h * G + g) * so_h + dv, out.to(out_ptr.dtype.element_ty),
                 mask=dv < DV)

    return split_kernel, merge_kernel



def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scale: float, slice_columns: int = SLICE) -> torch.Tensor:
    """query [B, H, 1, Dk], key [B, KVH, W, Dk], value [B, KVH, W, Dv], mask [B, 1, 1, W] bool (True: attend;
    broadcast strides allowed) -> [B, 1, H, Dv] in the query's dtype: softmax(q k^T * scale) v per row and
    head over the row's attended columns (zeros for a row that attends none). `slice_columns`: columns per
    slice, a multiple of BLOCK_N."""
    import triton

    split_kernel, merge_kernel = _kernels()
    rows, heads, _, dk = query.shape
    _, kv_heads, width, dv = value.shape
    group = heads // kv_heads
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot takes at least 16 rows
    block_dk, block_dv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    if slice_columns % BLOCK_N:
        raise ValueError(f"slices are whole blocks of {BLOCK_N} columns, got {slice_columns}")
    cut = math.ceil(width / slice_columns)
    part = torch.empty(rows * kv_heads * cut * block_g, block_dv, dtype=torch.float32, device=query.device)
    high = torch.empty(rows * kv_heads * cut * block_g, dtype=torch.float32, device=query.device)
    total = torch.empty_like(high)
    flags = mask.view(torch.uint8)
    out = torch.empty(rows, 1, heads, dv, dtype=query.dtype, device=query.device)
    split_kernel[(rows * kv_heads, cut)](
        query, key, value, flags, part, high, total, width, group, kv_heads, dk, dv, scale, slice_columns, cut,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), flags.stride(0), flags.stride(3),
        BLOCK_G=block_g, BLOCK_N=BLOCK_N, BLOCK_DK=block_dk, BLOCK_DV=block_dv, num_warps=4, num_stages=2,
        # float32 products in float32, not TF32 (Triton's default on tensor cores): a float32 model's decode
        # must equal its prefill's SDPA, or a token can flip (tests/frontend/test_chunked_prefill.py)
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32")
    merge_kernel[(rows * kv_heads, group)](part, high, total, out, group, kv_heads, dv, cut, out.stride(0),
                                           out.stride(2), BLOCK_G=block_g, BLOCK_DV=block_dv, BLOCK_S=MERGE_SLICES,
                                           num_warps=4)
    return out


def _decodes_here(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, kwargs: dict) -> bool:
    return (query.shape[2] == 1 and mask is not None and mask.dtype == torch.bool and mask.dim() == 4
            and mask.shape == (query.shape[0], 1, 1, key.shape[2]) and query.stride(-1) == key.stride(-1) == 1
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None and kwargs.get("position_bias") is None
            and moe_kernels.available(query.device))


@torch.compiler.disable
def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: a decode pass's attention through `decode_attention`,
    anything else through SDPA; a step pass's parts (step_pass.py) each through one of those."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    step = kwargs.pop(step_pass.KEYWORD, None)
    if step is not None:  # a pass over several parts (step_pass.py): each attends over its own keys
        return step.attend(module, query, attention, dropout=dropout, scaling=scaling, **kwargs), None
    if dropout == 0.0 and value.stride(-1) == 1 and _decodes_here(query, key, attention_mask, kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return decode_attention(query, key, value, attention_mask, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def use(model: torch.nn.Module) -> None:
    """Route `model`'s attention through `attention`, with the masks transformers makes for SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, attention)
    # Without a mask function of its own name transformers builds no mask at all for a pass, and SDPA
    # then takes a prompt chunk that continues a cache as causal from column 0 (it crops the keys).
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
