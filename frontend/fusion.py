"""kubemoe's kernels in place of a `transformers` module's forward, where they run.

A module class whose forward computes exactly what one of kubemoe's Triton kernels computes gets a
forward that launches the kernel where kubemoe's kernels run (`moe_kernels.runs_here`: a GPU with
Triton, outside a pass TorchDynamo compiles) and runs the class's own forward everywhere else.
norms.py and routers.py name the classes and their kernels.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Collection

import torch

from kubemoe import moe_kernels


def swap_forward(model: torch.nn.Module, classes: Collection[str],
                 kernel: Callable[[torch.nn.Module, torch.Tensor], object]) -> int:
    """Give each module of `model` whose class is named in `classes` a forward that returns
    kernel(module, hidden_states) where kubemoe's kernels run; returns how many modules."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor):
        if moe_kernels.runs_here(hidden_states.device):
            return kernel(self, hidden_states)
        return type(self).forward(self, hidden_states)

    swapped = 0
    for module in model.modules():
        if type(module).__name__ in classes:
            module.forward = types.MethodType(forward, module)
            swapped += 1
    return swapped
