"""Decode passes through TorchInductor (`--compile`, off by default): the dense part of each layer fused.

With CUDA graphs (graphs.py) the host's launches are gone, but a decode pass of Qwen3-30B-A3B still ran
about 100 small kernels per layer on the H200 (issue 17): `transformers`' RMSNorm as ~7 ops, the q/k
norms, rotary, dtype copies, the router's softmax, top-k and renormalisation, residual adds. Compiled,
the ops between two MoE layers' routed experts run as a few Inductor graphs whose elementwise ops fuse.

What is compiled: the `transformers` model as the engine calls it for a decode pass (one query per row
over the batch's cache, batch.py's SlotPass), whole. The routed experts are not: `_LayerExperts.forward`
(dispatch.py) is `torch.compiler.disable`d, so every MoE layer breaks the graph there and the dispatcher
runs as Python (it reads the thread's CUDA-graph recorder, calls expert functions, counts loads on the
host). For Qwen3-MoE and Mixtral that leaves four graphs per MoE layer (`torch._dynamo.explain`):
norm + attention + residual + norm, the router, a reshape, the residual add. Prefill and chunked
prefill call the model itself, uncompiled: their passes are few and wide, so matmuls rather than small
kernels set their time, and they run on transformers' DynamicCache, which would be traced apart.

Shapes are dynamic (`dynamic=True`): every input dimension varies while serving (rows with the
CUDA-graph row bucket, the cache's rows and columns as it grows), and compiled statically each new
(bucket, cache size) would compile every layer again. Two things stay static, and they set the
recompile limit: a decoder layer picks its cache tensors by its `layer_idx`, an int on the module
that dynamo keeps constant, so each layer compiles its frame once for itself; and a one-row pass
(batch 1) is a variant of its own, as dynamo always specialises a dimension of size 1. No other
pass compiles again: not a new row bucket, not a grown cache. Compiling happens in the first decode
pass of each kind, which waits for it: on a busy 2-core machine, for a tiny Qwen3-MoE of 48 layers,
130 s (several rows) and 78 s (one row), most of it tracing each layer (the layers after the first
are the same graph: Inductor's graph cache serves them).

A compile that fails is logged once and the frontend decodes uncompiled from then on. The pass that
failed is run again uncompiled: the cache positions it wrote are written again with the same values;
the loads its earlier layers counted are counted twice, once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch._dynamo.exc import TorchDynamoException

log = logging.getLogger(__name__)

# Frames compiled per decoder layer: its own (layer_idx is static), for passes of one row and of more.
_FRAMES_PER_LAYER = 2
# Frames that every layer shares (the decorators' wrappers of transformers' forwards, the residual
# adds, the router) hold a few entries each; this leaves room for them.
_SHARED_FRAMES = 16


class CompiledDecode:
    """Calls as the model does, for decode passes; the model compiled, or the model itself once a
    compile has failed (`enabled` False)."""

    def __init__(self, model: torch.nn.Module, backend: Any = "inductor"):
        self.model = model
        self.enabled = True
        _configure_dynamo(_FRAMES_PER_LAYER * model.config.num_hidden_layers + _SHARED_FRAMES)
        import torch._inductor.config as inductor

        options = None
        if backend == "inductor" and hasattr(inductor, "emulate_precision_casts"):
            # Round where the model casts to bfloat16, as eager kernels do, not once per fused kernel: compiled
            # passes then give the uncompiled ones' logits (bit for bit on the CPU; without it up to 0.035 apart
            # on a tiny Qwen3-MoE, whose best two logits are often tied in bfloat16).
            options = {"emulate_precision_casts": True}
        self._compiled = torch.compile(model, backend=backend, dynamic=True, options=options)

    def __call__(self, **inputs: Any) -> Any:
        if self.enabled:
            try:
                return self._compiled(**inputs)
            except TorchDynamoException:  # what dynamo and Inductor raise; a failing pass raises its own error
                log.exception("compiling the decode pass failed: this frontend decodes uncompiled from now on")
                self.enabled = False
        return self.model(**inputs)


def _configure_dynamo(entries: int) -> None:
    """Process-wide settings, as dynamo has them: set once, the limits raised, never lowered."""
    config = torch._dynamo.config
    # Cache entries per code object: at 8, the default, the layers past the first few would run uncompiled
    # (with a warning in the log).
    config.recompile_limit = max(config.recompile_limit, entries)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, entries)
    # Duck shaping gives dimensions of equal size one symbol and guards that they stay equal: a batch
    # state's rows allocated (and the offset of its positions, a view past them) equalled the program's
    # rows at the first pass, and the first pass with other values compiled every layer again (19 s on
    # a 6-layer model; at 48 layers past the recompile limit above).
    import torch.fx.experimental._config as symbolic_shapes

    symbolic_shapes.use_duck_shape = False
