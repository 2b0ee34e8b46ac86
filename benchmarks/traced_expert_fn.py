"""`kubemoe expert-fn` that stamps each ForwardStream request (for expert_fn_overhead.py's timeline).

Wraps the generated handlers' (de)serializers and ExpertServicer._forward to record
time.perf_counter() (CLOCK_MONOTONIC: comparable across processes of one host) when a request is
parsed, when _forward starts and ends, and when its reply is serialized for sending. At exit it
writes {request_id: {stamp: seconds}} as JSON to $KUBEMOE_STAMPS. Arguments are expert-fn's.
"""

import atexit
import json
import os
import runpy
import sys
import time
import types

from kubemoe.expert_fn import servicer
from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc

STAMPS: dict[str, dict[str, float]] = {}


def parse(data: bytes) -> pb.ForwardRequest:
    parsed_at = time.perf_counter()
    request = pb.ForwardRequest.FromString(data)
    STAMPS.setdefault(request.request_id, {})["server_parsed"] = parsed_at
    return request


def serialize(response: pb.ForwardResponse) -> bytes:
    STAMPS.setdefault(response.request_id, {})["server_sends"] = time.perf_counter()
    return response.SerializeToString()


class _Messages:  # what the generated module sees as kubemoe_pb2: the two stream messages traced
    ForwardRequest = types.SimpleNamespace(FromString=parse)
    ForwardResponse = types.SimpleNamespace(SerializeToString=serialize)

    def __getattr__(self, name):
        return getattr(pb, name)


_forward = servicer.ExpertServicer._forward


async def traced_forward(self, request, segment=None):
    stamps = STAMPS.setdefault(request.request_id, {})
    stamps["forward_starts"] = time.perf_counter()
    response = await _forward(self, request, segment)
    stamps["forward_ends"] = time.perf_counter()
    return response


pb_grpc.kubemoe_dot_v1_dot_kubemoe__pb2 = _Messages()
servicer.ExpertServicer._forward = traced_forward
atexit.register(lambda: open(os.environ["KUBEMOE_STAMPS"], "w").write(json.dumps(STAMPS)))
sys.argv = ["kubemoe.expert_fn.cli", *sys.argv[1:]]
runpy.run_module("kubemoe.expert_fn.cli", run_name="__main__")
