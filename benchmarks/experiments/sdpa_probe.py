#!/usr/bin/env python3
"""Why a padded decode batch's attention may cost tens of milliseconds on a GPU: SDPA at decode shapes
(one query per row, a padding mask, the key length growing by one per step, as the engine's left-padded
batch runs it), per backend, the first call at each key length against a repeated one.

  python benchmarks/experiments/sdpa_probe.py    # on the lent GPU; prints one line per backend
"""

import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, HEADS, KV_HEADS, D = 8, 32, 8, 128  # Mixtral's attention, a batch of 8


def calls(lengths, backends, repeat: bool) -> float:
    """Median milliseconds of one SDPA call per key length (a fresh length each call unless `repeat`)."""
    times = []
    for length in lengths:
        q = torch.randn(B, HEADS, 1, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, HEADS, length, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.ones(B, 1, 1, length, device="cuda", dtype=torch.bool)
        mask[0, ..., :1] = False  # one row left-padded by a column
        with sdpa_kernel(backends):
            for _ in range(2 if repeat else 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


everything = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
result = {"torch": torch.__version__, "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled()}
for name, backends in {"default": everything, "no-cudnn": everything[1:], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
                       "math": [SDPBackend.MATH]}.items():
    try:
        result[name] = {"new_length_ms": calls(range(17, 81), backends, repeat=False),
                        "repeated_length_ms": calls(range(17, 81), backends, repeat=True)}
    except RuntimeError as e:
        result[name] = {"error": str(e)[:200]}
print(json.dumps(result, indent=1))
