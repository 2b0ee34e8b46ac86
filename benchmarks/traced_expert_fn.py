"""`kubemoe expert-fn` that stamps each ForwardStream request (for expert_fn_overhead.py's timeline).

Records time.perf_counter() (CLOCK_MONOTONIC: comparable across processes of one host) when a
request is parsed, when ExpertServicer._forward (or answer_now) starts, when the request is checked,
when its round starts, when the round waits for the device (GPU) or is done computing (CPU), when
the round ends, when _forward (or answer_now) ends, and when its reply is sent, on the gRPC stream
and on the lane alike. The round's stamps go to the request being answered: the timeline sends one
at a time. At exit it writes {request_id: {stamp: seconds}} as JSON to $KUBEMOE_STAMPS. Arguments
are expert-fn's. `trace_messages` does the same for a client. With $KUBEMOE_TORCH_TRACE set, lone
lane requests 100 to 159 also run under torch.profiler, written there as a chrome trace (torch_trace.py).
"""

import atexit
import contextlib
import itertools
import json
import os
import runpy
import sys
import time
import types

from kubemoe.expert_fn import batcher, lane, servicer
from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc

import torch_trace  # beside this file

STAMPS: dict[str, dict[str, float]] = {}


@contextlib.contextmanager
def trace_messages(stamps: dict, received: type, received_stamp: str, sent: type, sent_stamp: str):
    """Stamp every `received` message as it is parsed and every `sent` one as it is serialized or sent,
    on the lane (patched while in the context) and on gRPC (the (deserializer, serializer) yielded)."""

    def parse(data: bytes):
        parsed_at = time.perf_counter()
        message = received.FromString(data)
        stamps.setdefault(message.request_id, {})[received_stamp] = parsed_at
        return message

    def serialize(message) -> bytes:
        stamps.setdefault(message.request_id, {})[sent_stamp] = time.perf_counter()
        return message.SerializeToString()

    class Messages:  # what a module sees as kubemoe_pb2: the received message's parsing traced
        def __getattr__(self, name):
            return types.SimpleNamespace(FromString=parse) if name == received.__name__ else getattr(pb, name)

    send = lane._Packets.send

    def traced_send(packets, message) -> None:
        stamps.setdefault(message.request_id, {})[sent_stamp] = time.perf_counter()
        send(packets, message)

    lane.pb, lane._Packets.send = Messages(), traced_send
    try:
        yield parse, serialize
    finally:
        lane.pb, lane._Packets.send = pb, send


def main() -> None:
    current: list[dict[str, float]] = [{}]  # the stamps of the request in _forward

    def stamped(function, before: str | None, after: str | None):
        def traced(*args, **kwargs):
            if before:
                current[0][before] = time.perf_counter()
            result = function(*args, **kwargs)
            if after:
                current[0][after] = time.perf_counter()
            return result
        return traced

    forward, answer_now = servicer.ExpertServicer._forward, servicer.ExpertServicer.answer_now

    async def traced_forward(self, request, segment=None):
        current[0] = STAMPS.setdefault(request.request_id, {})
        current[0]["forward_starts"] = time.perf_counter()
        response = await forward(self, request, segment)
        STAMPS[request.request_id]["forward_ends"] = time.perf_counter()
        return response

    lone_requests = itertools.count(1)
    trace_path, profiling = os.environ.get("KUBEMOE_TORCH_TRACE"), contextlib.ExitStack()

    def profile_window() -> None:  # lone requests 100 to 159 under torch.profiler
        n = next(lone_requests)
        if trace_path and n == 100:
            profiling.enter_context(torch_trace.window(trace_path))
        elif n == 160:
            profiling.close()

    def traced_answer_now(self, request, segment):  # a lone request on the lane (lane.py)
        profile_window()
        current[0] = STAMPS.setdefault(request.request_id, {})
        current[0]["forward_starts"] = time.perf_counter()
        response = answer_now(self, request, segment)
        STAMPS[request.request_id]["forward_ends"] = time.perf_counter()
        return response

    with trace_messages(STAMPS, pb.ForwardRequest, "server_parsed", pb.ForwardResponse, "server_sends") as (
            parse, serialize):
        class Messages:  # what the generated gRPC module sees as kubemoe_pb2
            ForwardRequest = types.SimpleNamespace(FromString=parse)
            ForwardResponse = types.SimpleNamespace(SerializeToString=serialize)

            def __getattr__(self, name):
                return getattr(pb, name)

        servicer.ExpertServicer._job = stamped(servicer.ExpertServicer._job, None, "request_checked")
        servicer.run_round = stamped(servicer.run_round, "round_starts", "round_ends")
        batcher.ComputeClock.seconds = stamped(batcher.ComputeClock.seconds, "device_wait_starts", None)
        pb_grpc.kubemoe_dot_v1_dot_kubemoe__pb2 = Messages()
        servicer.ExpertServicer._forward, servicer.ExpertServicer.answer_now = traced_forward, traced_answer_now
        atexit.register(lambda: open(os.environ["KUBEMOE_STAMPS"], "w").write(json.dumps(STAMPS)))
        sys.argv = ["kubemoe.expert_fn.cli", *sys.argv[1:]]
        runpy.run_module("kubemoe.expert_fn.cli", run_name="__main__")

if __name__ == "__main__":
    main()
