"""Tensors on the wire: torch tensors <-> `kubemoe.v1.Tensor` without copies where possible.

Decoding wraps the message's bytes with `torch.frombuffer` (no copy; the tensor is read-only in
spirit and must not be written to). Encoding takes the tensor's contiguous CPU storage as bytes
(one copy, which protobuf needs to own the data). A tensor may instead lie in a shared-memory
segment (kubemoe.expert_fn.shm): the message then names only its region, and decoding gives a view.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from kubemoe.proto import kubemoe_pb2 as pb

if TYPE_CHECKING:
    from kubemoe.expert_fn.shm import Segment

TO_WIRE = {torch.float32: pb.FLOAT32, torch.bfloat16: pb.BFLOAT16, torch.float16: pb.FLOAT16}
FROM_WIRE = {v: k for k, v in TO_WIRE.items()}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# Decoded tensors alias protobuf's immutable bytes on purpose (zero copy); nothing writes to them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class WireError(ValueError):
    """A tensor message that cannot be decoded; the message says what is wrong."""


def encode(tensor: torch.Tensor) -> pb.Tensor:
    return encode_into(tensor, pb.Tensor())


def encode_into(tensor: torch.Tensor, msg: pb.Tensor) -> pb.Tensor:
    """Fill `msg` (e.g. a request's `hidden` field) in place: cheaper than building and copying a Tensor."""
    if tensor.dtype not in TO_WIRE:
        raise WireError(f"dtype {tensor.dtype} cannot travel; use one of {', '.join(DTYPE_NAMES.values())}")
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    msg.dtype = TO_WIRE[tensor.dtype]
    msg.shape[:] = list(tensor.shape)
    msg.data = flat.view(torch.uint8).numpy().tobytes()
    return msg


def describe_shared(msg: pb.Tensor, dtype: torch.dtype, shape: list[int], offset: int) -> pb.Tensor:
    """Fill `msg` in place for a tensor at `offset` of the stream's shared-memory segment."""
    msg.dtype = TO_WIRE[dtype]
    msg.shape[:] = shape
    msg.shared.offset = offset
    return msg


def decode(msg: pb.Tensor, segment: "Segment | None" = None) -> torch.Tensor:
    """The tensor `msg` carries: a view of its bytes, or of `segment` when it names a shared region."""
    dtype = FROM_WIRE.get(msg.dtype)
    if dtype is None:
        raise WireError(f"tensor dtype {pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype} "
                        f"is not supported; send FLOAT32, BFLOAT16 or FLOAT16")
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"tensor shape {shape} has a negative dimension")
    if msg.WhichOneof("payload") == "shared":
        if segment is None:
            raise WireError("the tensor names a shared-memory region, but this call has no segment attached: "
                            "send the bytes inline, or use a ForwardStream that attached one")
        try:
            return segment.view(msg.shared.offset, dtype, shape)
        except ValueError as e:
            raise WireError(str(e)) from None
    numel = 1
    for d in shape:
        numel *= d
    expected = numel * dtype.itemsize
    data = msg.data  # every read of a bytes field copies it: read once
    if len(data) != expected:
        raise WireError(f"tensor of shape {shape} and dtype {DTYPE_NAMES[dtype]} needs {expected} bytes, got {len(data)}")
    if numel == 0:
        try:
            return torch.empty(shape, dtype=dtype)
        except RuntimeError as e:  # dimensions whose strides overflow: [0, 2**62, 2**62]
            raise WireError(f"tensor shape {shape} is not one a tensor can have: {str(e).splitlines()[0]}") from None
    return torch.frombuffer(data, dtype=dtype).view(shape)
