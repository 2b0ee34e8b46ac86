"""Softmax top-k routers with their selection as one kernel on a GPU.

`transformers`' top-k routers run the router's matmul, then a softmax, a top-k (two kernels), the
weights' sum, a division and a cast: at decode sizes each a launch of a few microseconds for a few
hundred bytes, twice per layer with the load predictor's top-k, about as long as the layer's attention
projections in a CUDA-graph decode pass of Qwen3-30B-A3B (decode_step_probe.py at efa80d5). Here the
matmul stays torch's and everything after it is `moe_kernels.top_k`: the same softmax in float32, the
same selection (the lower expert first where two scores are equal; torch.topk leaves that open), the
same division and cast.

Only the classes in SOFTMAX_TOP_K are fused: their forward is exactly that formula
(`tests/frontend/test_routers.py` checks each against the kernel). Elsewhere, off the GPU, and inside a
pass that TorchDynamo compiles, the module's own forward runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kubemoe import moe_kernels
from kubemoe.frontend import fusion

# transformers' routers whose forward is: logits = hidden @ weight^T; softmax in float32; top-k; the K
# weights divided by their sum (always, or where `norm_topk_prob` says). Value: whether the weights are
# then cast to the logits' dtype (else they stay float32).
SOFTMAX_TOP_K = {"MixtralTopKRouter": False, "Qwen3MoeTopKRouter": True, "Qwen2MoeTopKRouter": True,
                 "OlmoeTopKRouter": True}


def _select(router: torch.nn.Module, hidden_states: torch.Tensor):
    logits = F.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)  # [T, E]
    dtype = logits.dtype if SOFTMAX_TOP_K[type(router).__name__] else torch.float32
    weights, index = moe_kernels.top_k(logits, router.top_k, softmax=True,
                                       normalize=getattr(router, "norm_topk_prob", True), dtype=dtype)
    return logits, weights, index


def fuse(model: torch.nn.Module) -> int:
    """Give every SOFTMAX_TOP_K router of `model` the one-kernel selection (it falls back to its own
    forward off the GPU); returns how many."""
    return fusion.swap_forward(model, SOFTMAX_TOP_K, _select)
