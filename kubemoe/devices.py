"""Device and dtype choices, resolved once from flags and the checkpoint (shared by every component)."""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Iterator

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


# What a CUDA process holds outside its allocator: the context, cuBLAS workspaces (0.75 GiB on the H100,
# moeless_live.py). A function's memory in the plan (spec functionOverhead) covers it beside the allocator's.
CUDA_CONTEXT_BYTES = 768 << 20


# PyTorch's caching allocator may not empty its cache while a CUDA graph capture of the process is underway,
# on any thread: an internal assertion fails in the thread that asked (captures_underway.empty()). So a capture
# (captured()) holds this lock from capture_begin to capture_end, and empty_cache() takes it: an expert
# function's store gives memory back from a thread of its own (expert_fn/store.py) while rounds may capture.
CAPTURING = threading.RLock()


@contextlib.contextmanager
def captured(graph: torch.cuda.CUDAGraph, pool: tuple) -> Iterator[None]:
    """Capture what the body launches on this thread into `graph`, from `pool`, under CAPTURING. Thread-local:
    work other threads launch meanwhile (a Load's copies) is not part of it."""
    with CAPTURING:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()


def empty_cache() -> None:
    """torch.cuda.empty_cache(), never during a CUDA graph capture of this process (CAPTURING)."""
    import torch

    with CAPTURING:
        torch.cuda.empty_cache()


def graph_pool(pool: tuple | None, held: bool) -> tuple:
    """The memory pool the next CUDA graph capture goes into: `pool` while graphs captured into it are
    `held`, else a fresh one. A pool is held only by the graphs captured into it: once they are all gone
    (a re-plan retired every expert of a function), a capture naming it fails an assertion of PyTorch's
    allocator ("use_count > 0"), as moeless_live.py's re-plans did on the H100. Not a torch.cuda.MemPool:
    replacing one that graphs still held aborted the process (torch 2.11)."""
    import torch

    return pool if held and pool is not None else torch.cuda.graph_pool_handle()


def cap_device_memory(device: torch.device, nbytes: int) -> None:
    """Let this process's CUDA allocator hold at most `nbytes` of `device` (0: no cap; on the CPU, nothing).

    Processes sharing a GPU by time-slicing each keep an allocator cache, and nothing stops one from
    keeping cached what another's plan counts on: eight expert functions on the H100, re-planned in place,
    held 8-14 GiB each for plans of 4.6 until a Load ran out of memory (moeless_live.py). Capped, the
    allocator frees its cache when it reaches the cap, as it does when the device is full. MPS clients
    are capped by the driver the same way (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT). May be called again: an
    expert function's cap follows what it holds (expert_fn/store.py)."""
    import torch

    if device.type != "cuda":
        return
    index = _cuda_index(device)
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(nbytes, total) / total if nbytes > 0 else 1.0, index)


def allocator_reserved(device: torch.device) -> int:
    """What this process's CUDA allocator holds on `device`, its cache included."""
    import torch

    return torch.cuda.memory_reserved(_cuda_index(device))


def allocator_cap(device: torch.device) -> int:
    """The most this process's CUDA allocator may hold on `device` (cap_device_memory); 0: no cap."""
    import torch

    index = _cuda_index(device)
    fraction = torch.cuda.get_per_process_memory_fraction(index)
    return int(fraction * torch.cuda.get_device_properties(index).total_memory) if fraction < 1 else 0


def _cuda_index(device: torch.device) -> int:
    """The memory fraction's setter and getter take no bare `cuda` (the H100 refused it): its index."""
    import torch

    return torch.cuda.current_device() if device.index is None else device.index


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


def serving_attention(device: torch.device) -> None:
    """Attention kernels for serving on `device`: on a GPU, not cuDNN's. cuDNN's attention builds a plan for
    every new key length the first time it sees it (56 ms per call on the H200, benchmarks/experiments/
    sdpa_probe.py); a decode pass has a mask (the case SDPA hands to cuDNN) and, whenever its cache rows grow,
    a new key length: 33 ms per layer in the engine when the padded cache grew every step, and 50 ms in one
    step of the offload benchmark's first configuration, which met each key length first (the others
    found its plans built). The memory-efficient kernel takes it at 0.07 ms from the first call. A
    process-wide switch: call it where the process decides how it serves."""
    import torch

    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
