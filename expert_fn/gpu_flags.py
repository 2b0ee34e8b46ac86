"""Flags in device memory: how a CUDA stream waits for a stream of another process on the same GPU.

A flag is an int32 the signalling stream sets to 1 and the waiting stream waits for, then sets back
to 0 (it consumes it). Both are queued on streams and captured in CUDA graphs: nothing waits on the
host, which is what lets a frontend and its expert functions each launch a whole decode step at once
(device_link.py). CUDA events cannot do this: a stream waits for the last record made *before* its
wait was queued, so the host would have to learn of each record first.

How a stream waits (benchmarks/experiments/step_flags_probe.py, H200 at 486e2e6, a layer handed to
another process and back, 48 times a step): a one-warp Triton kernel spinning on the flag, 5 us a
layer under MPS; the driver's stream memory operations (cuStreamWaitValue32, which wait in the GPU's
front end and hold no SM), 21 us. Without MPS the two processes' contexts take turns on the GPU:
285 us with memory operations, 4.4 ms spinning (a spinning kernel keeps its context on the GPU for
its whole time slice). So: spin where the GPU is shared through MPS, memory operations elsewhere.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger(__name__)

_MPS_ENABLED = 133  # CU_DEVICE_ATTRIBUTE_MPS_ENABLED
_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_DEFAULT = 0  # CU_STREAM_WRITE_VALUE_DEFAULT: ordered after the stream's earlier writes


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return lib


def _check(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"{what} failed: CUresult {code}")


def mps_enabled(device: torch.device) -> bool:
    """Whether this process's contexts on `device` are MPS clients (kernels of processes run side by side)."""
    lib, dev, value = _driver(), ctypes.c_int(), ctypes.c_int()
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.init()  # the driver API needs cuInit, which torch makes
    if lib.cuDeviceGet(ctypes.byref(dev), index) or lib.cuDeviceGetAttribute(ctypes.byref(value), _MPS_ENABLED, dev):
        return False  # a driver too old to say: memory operations work either way
    return bool(value.value)


class Flags:
    """Waits and signals on flags ([1] int32 views of device memory), queued on the current stream."""

    def __init__(self, device: torch.device, spin: bool | None = None):
        self.spin = mps_enabled(device) if spin is None else spin
        if self.spin:
            self._wait_kernel, self._signal_kernel = _kernels()
            warm = torch.zeros(1, dtype=torch.int32, device=device)
            self.signal(warm)  # compiled and loaded now: the first use may be inside a graph's capture
            self.wait(warm)
            torch.cuda.synchronize(device)

    def wait(self, flag: torch.Tensor) -> None:
        """The stream waits until `flag` is set, then clears it."""
        if self.spin:
            self._wait_kernel[(1,)](flag, num_warps=1)
            return
        stream, lib = torch.cuda.current_stream(flag.device).cuda_stream, _driver()
        _check(lib.cuStreamWaitValue32_v2(stream, flag.data_ptr(), 1, _WAIT_GEQ), "cuStreamWaitValue32")
        _check(lib.cuStreamWriteValue32_v2(stream, flag.data_ptr(), 0, _WRITE_DEFAULT), "cuStreamWriteValue32")

    def signal(self, flag: torch.Tensor) -> None:
        """Set `flag` once the stream's earlier work is done and its writes are visible."""
        if self.spin:
            self._signal_kernel[(1,)](flag, num_warps=1)
            return
        stream = torch.cuda.current_stream(flag.device).cuda_stream
        _check(_driver().cuStreamWriteValue32_v2(stream, flag.data_ptr(), 1, _WRITE_DEFAULT), "cuStreamWriteValue32")


def release(flags: torch.Tensor) -> None:
    """Set `flags` from the host, on a stream of their own, and wait for that: streams waiting on them
    go on (their step's outputs are void). For a step whose other side will not signal."""
    side = torch.cuda.Stream(flags.device)
    with torch.cuda.stream(side):
        flags.fill_(1)
    side.synchronize()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def wait(flag_ptr):
        while tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys") < 1:
            pass
        tl.store(flag_ptr, 0)

    @triton.jit
    def signal(flag_ptr):
        tl.atomic_xchg(flag_ptr, 1, sem="release", scope="sys")

    return wait, signal
