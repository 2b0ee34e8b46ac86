"""What a GPU budget of the offload path must hold and what it may take of a GPU, defined once: the operator
refuses or derives budgets from it (operator/mode.py, the CRD's rule) and the frontend checks its own
(frontend/offload/runtime.py), so the two cannot disagree on the minimum.
"""

from __future__ import annotations

ON_DEMAND_BUFFERS = 2  # used alternately: one is copied into while the other is computed
PREFETCH_GROUPS = 2  # this layer's prefetched experts and the next layer's

# The frontend's GPU holds more than experts: the attention, embedding, norm and LM-head weights (1.5 to
# 3.5 GiB in bfloat16 for Mixtral-8x7B, Phi-3.5-MoE, DeepSeek-V2-Lite, Qwen3-30B-A3B), activations, and
# the KV cache, which the frontend sizes from what is free once it has loaded (--kv-cache-fraction). A
# derived budget leaves a quarter of the GPU to them: 6 GB of a 24 GB GPU, the non-expert weights plus a
# KV cache of ~20k Mixtral tokens (128 KiB per token). Models whose dense part is larger (Llama-4-Scout's
# shared experts) need spec.offload.gpuMemoryBudget / --gpu-budget set by hand.
RESERVED_FRACTION = 0.25


def working_set_bytes(expert_bytes: int, prefetch_slots: int) -> int:
    """GPU bytes the streaming path needs whatever the hot table holds: the on-demand buffers and the
    prefetch groups of `prefetch_slots` experts (the model's experts per token unless configured)."""
    return (ON_DEMAND_BUFFERS + PREFETCH_GROUPS * prefetch_slots) * expert_bytes


def suggested_budget(gpu_bytes: int) -> int:
    """The GPU budget a GPU of `gpu_bytes` gets when none is given: all but RESERVED_FRACTION of it."""
    return int(gpu_bytes * (1 - RESERVED_FRACTION))
