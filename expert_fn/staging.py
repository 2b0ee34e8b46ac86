"""Host -> GPU copies of weights being loaded, through two pinned buffers, chunk by chunk, on one stream.

A tensor read from the checkpoint lies in pageable memory (a view of the memory-mapped file). A
copy from there is staged by the CUDA driver, and while it lasts the process's other CUDA work
waits: on the H200 a round an expert function served during such a Load took 15-20 ms instead of
0.2 ms (about one 117 MB tensor's copy), whether the round synchronised the device or only its own
stream (benchmarks/experiments/load_interference_probe.py). Copied through pinned memory, each
chunk is a DMA queued on the load's stream: the thread fills the other buffer meanwhile, rounds
go on (0.4-0.5 ms), and the Load itself took 63-88 ms for four Mixtral experts instead of 215-240.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_BYTES = 16 << 20  # ~0.7 ms of DMA at the H200's host link: what a round may queue behind


class PinnedStaging:
    """Copies CPU tensors into GPU tensors on `stream`. One copy at a time (the store's lock)."""

    def __init__(self, stream: torch.cuda.Stream, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.stream, self.chunk_bytes = stream, chunk_bytes
        self._buffers: list[torch.Tensor] = []  # pinned, made on the first copy: a function that never loads pins nothing
        self._emptied: list[torch.cuda.Event] = []  # recorded after each buffer's last DMA was queued

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """target (GPU, contiguous) <- source (CPU, same shape and dtype); returns target. The copy is
        queued on the stream: synchronise it before anyone may read target."""
        if target.shape != source.shape or target.dtype != source.dtype:
            raise ValueError(f"cannot copy a {source.dtype} tensor of shape {list(source.shape)} into a {target.dtype} "
                             f"one of shape {list(target.shape)}")
        if not target.is_contiguous() or target.device.type != "cuda":
            raise ValueError("the target must be a contiguous tensor on the GPU")
        if not self._buffers:
            self._buffers = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self._emptied = [torch.cuda.Event() for _ in range(2)]
        into = target.view(-1).view(torch.uint8)
        out_of = source.contiguous().view(-1).view(torch.uint8)
        for n, start in enumerate(range(0, out_of.numel(), self.chunk_bytes)):
            size = min(self.chunk_bytes, out_of.numel() - start)
            buffer, emptied = self._buffers[n % 2], self._emptied[n % 2]
            emptied.synchronize()  # its previous chunk is on the GPU (an event never recorded is done)
            buffer[:size].copy_(out_of[start:start + size])  # the host's part, while the other buffer's DMA runs
            with torch.cuda.stream(self.stream):
                into[start:start + size].copy_(buffer[:size], non_blocking=True)
                emptied.record(self.stream)
        return target
