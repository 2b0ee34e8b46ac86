"""Device and dtype choices, resolved once from flags and the checkpoint (shared by every component)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kubemoe.errors import KubemoeError

if TYPE_CHECKING:
    import torch

DTYPE_CHOICES = ("bfloat16", "float16", "float32")  # what kubemoe computes in and sends on the wire


def resolve_device(device: str) -> torch.device:
    """`auto` is the GPU when there is one, else the CPU; an explicit CUDA device must exist."""
    import torch  # here, not at the top: command-line help must not wait for torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise KubemoeError(f"--device {device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise KubemoeError(f"--device {device}: no CUDA device is visible; use --device cpu or auto")
    return resolved


def resolve_dtype(dtype, model_config) -> torch.dtype:
    """The given dtype, else the checkpoint's (`config.dtype`), else float32."""
    import torch

    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = str(dtype or getattr(model_config, "dtype", None) or "float32").removeprefix("torch.")
    if name not in DTYPE_CHOICES:
        raise KubemoeError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPE_CHOICES)}")
    return getattr(torch, name)
