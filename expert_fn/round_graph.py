"""An expert's call from pinned shared memory as ONE graph launch: copy in, FFN, copy back.

graphs.py replays an expert's FFN as a CUDA graph, but the copy of the call's rows to the GPU and
the copy back were still calls of their own, and the GPU waited for each to be made: in the
expert function on the H200 host the FFN's first kernel started 55-63 us after the copy in had
ended (benchmarks/torch_trace.py), because there every torch or CUDA call costs 10-30 us of CPU.
Here both copies are nodes of one graph around the FFN's (a child graph), with an event recorded
on each side of it (the FFN's own time, which ServerTiming reports). Per call the copies are
pointed at the call's rows (cudaGraphExecMemcpyNodeSetParams1D) and the graph launched: the GPU
then runs copy, FFN and copy back with ~10 us between them (the copy engine handing over). In a
bare process that took a round from 190 to 173 us (benchmarks/experiments/round_graph_probe.py).

Through ctypes into the CUDA runtime torch loaded: torch offers a graph whole, not its nodes.
`runtime()` is None where that library cannot be found (then rounds copy as before).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from typing import Callable

import torch

_HOST_TO_DEVICE, _DEVICE_TO_HOST = 1, 2  # cudaMemcpyKind
log = logging.getLogger(__name__)


class CudaError(RuntimeError):
    pass


@functools.cache
def runtime() -> ctypes.CDLL | None:
    """The CUDA runtime torch uses, its graph functions typed; None when torch has none of its own
    (linked in statically, or a CUDA before 12, whose cudaGraphInstantiate takes other arguments)."""
    if not torch.cuda.is_available() or int((torch.version.cuda or "0").split(".")[0]) < 12:
        return None
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        path = next((line.split()[-1] for line in maps if "/libcudart.so" in line), None)
    if path is None:
        log.info("no libcudart.so loaded by torch: expert calls copy their rows with separate calls")
        return None
    lib = ctypes.CDLL(path)
    handle, out, size = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t
    for name, argtypes in {
        "cudaGraphCreate": (out, ctypes.c_uint),
        "cudaGraphAddMemcpyNode1D": (out, handle, out, size, handle, handle, size, ctypes.c_int),
        "cudaGraphAddChildGraphNode": (out, handle, out, size, handle),
        "cudaGraphAddEventRecordNode": (out, handle, out, size, handle),
        "cudaGraphInstantiate": (out, handle, ctypes.c_ulonglong),
        "cudaGraphExecMemcpyNodeSetParams1D": (handle, handle, handle, handle, size, ctypes.c_int),
        "cudaGraphLaunch": (handle, handle),
        "cudaEventCreate": (out,),
        "cudaEventElapsedTime": (ctypes.POINTER(ctypes.c_float), handle, handle),
        "cudaGraphExecDestroy": (handle,),
        "cudaGraphDestroy": (handle,),
        "cudaEventDestroy": (handle,),
    }.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    lib.cudaGetErrorString.argtypes, lib.cudaGetErrorString.restype = (ctypes.c_int,), ctypes.c_char_p
    return lib


def _check(lib: ctypes.CDLL, code: int, call: str) -> None:
    if code != 0:
        raise CudaError(f"{call} failed: {lib.cudaGetErrorString(code).decode()} ({code})")


class RoundGraph:
    """copy in -> event -> `ffn` -> event -> copy back, for calls of up to the rows of `input`.

    `input` and `output` are the static tensors `ffn` was captured on; `host` is any pinned host
    buffer at least as large (the copies must start out pointing at host memory)."""

    def __init__(self, ffn: torch.cuda.CUDAGraph, input: torch.Tensor, output: torch.Tensor, host: torch.Tensor):
        lib = runtime()
        if lib is None:
            raise RuntimeError("no CUDA runtime library to build a round graph with: check runtime() first")
        self._lib: ctypes.CDLL = lib
        self._ffn = ffn  # the child is a copy of its nodes; its memory pool holds their intermediates
        self._input, self._output, self.max_bytes = input.data_ptr(), output.data_ptr(), input.nbytes
        made: list[tuple[Callable, ctypes.c_void_p]] = []  # (how to destroy it, handle)
        weakref.finalize(self, _destroy, made)  # whatever was made, even if a step below fails

        def new(create, destroy, *args) -> ctypes.c_void_p:
            handle = ctypes.c_void_p()
            _check(lib, create(ctypes.byref(handle), *args), create.__name__)
            made.append((destroy, handle))
            return handle

        def node(add, after: ctypes.c_void_p | None, *args) -> ctypes.c_void_p:  # freed with the graph
            handle = ctypes.c_void_p()
            _check(lib, add(ctypes.byref(handle), graph, None if after is None else ctypes.byref(after),
                            0 if after is None else 1, *args), add.__name__)
            return handle

        self._start = new(lib.cudaEventCreate, lib.cudaEventDestroy)
        self._stop = new(lib.cudaEventCreate, lib.cudaEventDestroy)
        graph = new(lib.cudaGraphCreate, lib.cudaGraphDestroy, 0)
        self._copy_in = node(lib.cudaGraphAddMemcpyNode1D, None, self._input, host.data_ptr(), self.max_bytes,
                             _HOST_TO_DEVICE)
        start = node(lib.cudaGraphAddEventRecordNode, self._copy_in, self._start)
        child = node(lib.cudaGraphAddChildGraphNode, start, ffn.raw_cuda_graph())
        stop = node(lib.cudaGraphAddEventRecordNode, child, self._stop)
        self._copy_out = node(lib.cudaGraphAddMemcpyNode1D, stop, host.data_ptr(), self._output, self.max_bytes,
                              _DEVICE_TO_HOST)
        self._exec = new(lib.cudaGraphInstantiate, lib.cudaGraphExecDestroy, graph, 0)
        self._elapsed_ms = ctypes.c_float()

    def launch(self, source: int, target: int, nbytes: int, stream: int) -> None:
        """Queue the call on `stream`: `nbytes` from host address `source` through the FFN to `target`
        (pinned memory both; they may be the same rows)."""
        lib, run = self._lib, self._exec
        _check(lib, lib.cudaGraphExecMemcpyNodeSetParams1D(run, self._copy_in, self._input, source, nbytes,
                                                           _HOST_TO_DEVICE), "pointing the copy in")
        _check(lib, lib.cudaGraphExecMemcpyNodeSetParams1D(run, self._copy_out, target, self._output, nbytes,
                                                           _DEVICE_TO_HOST), "pointing the copy back")
        _check(lib, lib.cudaGraphLaunch(run, stream), "cudaGraphLaunch")

    def seconds(self) -> float:
        """The FFN's time in the last launch; call once the device has finished it."""
        _check(self._lib, self._lib.cudaEventElapsedTime(ctypes.byref(self._elapsed_ms), self._start, self._stop),
               "cudaEventElapsedTime")
        return self._elapsed_ms.value / 1e3


def _destroy(made: list[tuple[Callable, ctypes.c_void_p]]) -> None:
    for destroy, handle in reversed(made):  # the executable graph before the graph it came from
        destroy(handle)
