"""The model shell: a `transformers` model holding every weight except the routed experts.

Embeddings, attention, norms, routers, shared experts and the LM head are read from the
checkpoint; each MoE layer's routed experts module is replaced, before any weight is read, by a
module that computes them elsewhere (a dispatcher). Routed expert weights are never loaded here.
On a GPU, decode attention, Llama-style RMSNorms and softmax top-k routers' selection run as kubemoe's
kernels (attention.py, norms.py, routers.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from kubemoe.adapters import MoEAdapter, install_routed_experts
from kubemoe.checkpoint import Checkpoint
from kubemoe.frontend import attention, norms, routers


def build_shell(
    checkpoint: Checkpoint,
    adapter: MoEAdapter,
    routed_experts: Callable[[int], torch.nn.Module],  # layer -> module with the transformers experts signature
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    # Built without initialisation: the expert tensors are allocated but never touched (so never
    # resident) and are dropped as soon as the dispatchers take their place.
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(checkpoint.config, dtype=dtype)
    attention.use(model)
    norms.fuse(model)
    routers.fuse(model)
    for layer in adapter.moe_layers:
        install_routed_experts(adapter, model, layer, routed_experts(layer))
    persistent = model.state_dict(keep_vars=True)
    tensors = dict(model.named_parameters())  # tied weights appear once
    tensors.update({n: b for n, b in model.named_buffers() if n in persistent})
    with torch.no_grad():
        for name, tensor in tensors.items():
            tensor.copy_(checkpoint.read(adapter.checkpoint_name(name), dtype=tensor.dtype))
    return model.to(device).eval()
