"""The offload frontend's settings as environment variables: what the operator renders into the frontend
pod and what `kubemoe frontend` reads, defined once here so the two sides cannot drift apart."""

from __future__ import annotations

import os
from typing import Mapping

MODE = "KUBEMOE_MODE"  # distributed | offload: the mode the operator resolved
GPU_BUDGET = "KUBEMOE_OFFLOAD_GPU_MEMORY_BUDGET"  # bytes of GPU memory for experts (--gpu-budget)
PREDICTOR = "KUBEMOE_OFFLOAD_PREDICTOR"  # llapor | frequency | a file's path (--offload-predictor)
OFFLOAD = "offload"
# Predictor llapor without a file named: this one in the checkpoint folder (else the next layer's router).
LLAPOR_FILE = "llapor.safetensors"


def render(mode: str, gpu_budget_bytes: int | None = None, predictor: str | None = None) -> list[dict]:
    """Container env entries for a frontend in `mode` (offload settings only when given)."""
    env = [{"name": MODE, "value": mode}]
    if mode == OFFLOAD and gpu_budget_bytes is not None:
        env.append({"name": GPU_BUDGET, "value": str(gpu_budget_bytes)})
    if mode == OFFLOAD and predictor is not None:
        env.append({"name": PREDICTOR, "value": predictor})
    return env


def offload_mode(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment puts the frontend in offload mode (the default of --offload)."""
    return environ.get(MODE) == OFFLOAD
