"""Request errors with the gRPC status they leave with; the message says what was wrong.

A refusal about some experts of a request (not held, still loading) names them (`lacking`): the
caller then sends only those elsewhere and keeps using this function for the others. The names
travel in `kubemoe.v1.Status.lacking`: in a stream's error response, and for unary calls serialized
in the trailing metadata `STATUS_METADATA_KEY` (`status_metadata` on the server, `status_of` on the
client read them, whichever way the call went).
"""

from __future__ import annotations

from typing import Iterable

import grpc
from google.protobuf.message import DecodeError

from kubemoe.bundles import ExpertKey
from kubemoe.proto import kubemoe_pb2 as pb

STATUS_METADATA_KEY = "kubemoe-status-bin"


class ExpertFnError(Exception):
    """A request the server refuses; `code` is the gRPC status the call ends with, `lacking` the
    experts of the request it is about (empty: about the whole request or the whole function)."""

    def __init__(self, code: grpc.StatusCode, message: str, lacking: Iterable[ExpertKey] = ()):
        super().__init__(message)
        self.code = code
        self.lacking = tuple(lacking)


def invalid(message: str) -> ExpertFnError:
    return ExpertFnError(grpc.StatusCode.INVALID_ARGUMENT, message)


def failed_precondition(message: str) -> ExpertFnError:
    return ExpertFnError(grpc.StatusCode.FAILED_PRECONDITION, message)


def not_found(message: str, lacking: Iterable[ExpertKey] = ()) -> ExpertFnError:
    return ExpertFnError(grpc.StatusCode.NOT_FOUND, message, lacking)


def status(code: grpc.StatusCode, message: str, lacking: Iterable[ExpertKey] = ()) -> pb.Status:
    return pb.Status(code=code.value[0], message=message,
                     lacking=[pb.ExpertKey(layer=layer, expert=expert) for layer, expert in lacking])


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def code_of(status: pb.Status) -> grpc.StatusCode:
    return _CODES.get(status.code, grpc.StatusCode.UNKNOWN)


def status_metadata(status: pb.Status) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata that carries `status` with a unary call's failure (nothing when it names no expert)."""
    return ((STATUS_METADATA_KEY, status.SerializeToString()),) if status.lacking else ()


def status_of(error: grpc.aio.AioRpcError) -> pb.Status | None:
    """The Status a failed call carried in its trailing metadata, if any (servers before it never send one)."""
    for key, value in error.trailing_metadata() or ():
        if key == STATUS_METADATA_KEY and isinstance(value, bytes):
            try:
                return pb.Status.FromString(value)
            except DecodeError:  # a garbled detail must not hide the status itself
                return None
    return None


def lacking_of(error: grpc.aio.AioRpcError) -> frozenset[ExpertKey]:
    """The experts a failed call says the function lacks; empty when it names none."""
    found = status_of(error)
    return frozenset((k.layer, k.expert) for k in found.lacking) if found is not None else frozenset()
