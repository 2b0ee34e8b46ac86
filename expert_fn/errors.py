"""Request errors with the gRPC status they leave with; the message says what was wrong."""

from __future__ import annotations

import grpc


class ExpertFnError(Exception):
    """A request the server refuses; `code` is the gRPC status the call ends with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def invalid(message: str) -> ExpertFnError:
    return ExpertFnError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> ExpertFnError:
    return ExpertFnError(grpc.StatusCode.NOT_FOUND, message)
