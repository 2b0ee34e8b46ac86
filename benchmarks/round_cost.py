"""What an expert function's round costs beyond the FFN itself, in one process, without any transport.

At Mixtral size (4096 x 14336, or --hidden/--intermediate) and 64 tokens, on the GPU when there is
one, it times:
- `inproc`: expert_ffn on an input already on the device, then a synchronisation (the baseline),
  and `inproc_graph` the same as a CUDA graph replay (graphs.py);
- `eager_round` / `graph_round`: run_round on a job whose input and reply lie in a shared-memory
  segment (pinned on a GPU), as the server runs a lane call: copy in, FFN, copy back, one
  synchronisation; with the FFN's kernels launched one by one, or as one graph launch, copies
  included (round_graph.py); with the CPU time of each step (stamps around each call;
  `device_wait` is the final synchronisation);
- `*_paced_round`: the same round once every 200 us, as requests come to a server: from an event
  loop that polls (busy_poll) or sleeps in between, with or without a grpc.aio server running in
  it, or from a plain loop that spins in Python (no syscall in between). On the H200 host a round
  after a 200 us sleep took 1.7x as long as back to back; polling took 1.0-1.5x.

With --trace DIR (GPU), it also writes torch.profiler traces of graph rounds back to back and paced
by a polling loop (torch_trace.py summarises them).

    python benchmarks/round_cost.py [--tokens 64] [--device cuda] [--trace DIR]   # prints JSON (H200: ~10 s)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kubemoe import busy_poll
from kubemoe.expert import ExpertWeights, expert_ffn
from kubemoe.expert_fn import batcher
from kubemoe.expert_fn.batcher import Job, run_round
from kubemoe.expert_fn.graphs import ExpertGraphs
from kubemoe.expert_fn.shm import HEADER_BYTES, Segment

HIDDEN, INTERMEDIATE = 4096, 14336


def median_us(function, repeats: int = 200) -> float:
    for _ in range(10):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


async def paced(one_round, grpc_server: bool, gap_s: float = 200e-6, rounds: int = 300) -> list[float]:
    """Seconds of one_round() run once every `gap_s` from this event loop."""
    server = None
    if grpc_server:
        import grpc

        server = grpc.aio.server()
        server.add_insecure_port("127.0.0.1:0")
        await server.start()
    times = []
    for _ in range(rounds):
        await asyncio.sleep(gap_s)
        start = time.perf_counter()
        one_round()
        times.append(time.perf_counter() - start)
    if server is not None:
        await server.stop(None)
    return times


def spun(one_round, gap_s: float = 200e-6, rounds: int = 300) -> list[float]:
    """paced() without a loop: the gap spins in Python, no syscall."""
    times = []
    for _ in range(rounds):
        until = time.perf_counter() + gap_s
        while time.perf_counter() < until:
            pass
        start = time.perf_counter()
        one_round()
        times.append(time.perf_counter() - start)
    return times


def timeit(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--intermediate", type=int, default=INTERMEDIATE)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trace", type=Path, default=None, help="folder for torch.profiler traces of graph rounds")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    act = torch.nn.functional.silu
    generator = torch.Generator().manual_seed(0)
    weights = ExpertWeights((torch.randn(2 * args.intermediate, args.hidden, generator=generator) / 64).to(device, dtype),
                            (torch.randn(args.hidden, args.intermediate, generator=generator) / 64).to(device, dtype))
    x = torch.randn(args.tokens, args.hidden, generator=generator).to(dtype)

    # A tmpfs folder, as a server's --shm-dir: CUDA cannot register file mappings of other filesystems.
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as folder:
        segment = Segment.create(folder, 16 << 20)
        segment.unlink()
        pinned = segment.pin() if device.type == "cuda" else False
        region = segment.view(HEADER_BYTES, dtype, list(x.shape))

        graphs = ExpertGraphs(args.hidden, act, device, dtype) if device.type == "cuda" else None

        def one_round(graphed: bool = False) -> Job:
            region.copy_(x)
            job = Job(region, [((0, 0), args.tokens)], out_buffer=region, pinned=pinned)
            run_round([job], lambda key: weights, act, device, dtype, graphs if graphed else None)
            return job

        x_device = x.to(device)
        result = {"device": str(device), "tokens": args.tokens, "segment_pinned": pinned,
                  "inproc_us": median_us(lambda: (expert_ffn(x_device, weights, act), sync()))}
        if graphs is not None:
            clock = batcher.ComputeClock(device)
            result["inproc_graph_us"] = median_us(lambda: (graphs.run((0, 0), weights, [x_device], clock), sync()))
        # The CPU time of each call of one round: wrap what run_round calls.
        stamps: dict[str, list[float]] = {}

        def timed(name, function):
            def wrapper(*a, **k):
                start = time.perf_counter()
                out = function(*a, **k)
                stamps.setdefault(name, []).append(time.perf_counter() - start)
                return out
            return wrapper

        def variant(times: list[float]) -> dict[str, float]:
            """Median microseconds of the rounds and of each step, since the last variant."""
            medians = {name: round(statistics.median(values[20:]) * 1e6, 1) for name, values in stamps.items()}
            stamps.clear()
            return {"round_us": round(statistics.median(times[20:]) * 1e6, 1), **medians}

        originals = (batcher.expert_ffn, batcher.copy_into, batcher.ComputeClock.seconds, torch.Tensor.to,
                     ExpertGraphs.run, ExpertGraphs.run_pinned)
        batcher.expert_ffn = timed("ffn_calls", batcher.expert_ffn)
        batcher.copy_into = timed("copy_back_call", batcher.copy_into)
        batcher.ComputeClock.seconds = timed("device_wait", batcher.ComputeClock.seconds)
        torch.Tensor.to = timed("copy_in_call", torch.Tensor.to)
        ExpertGraphs.run = timed("graph_copy_in_and_replay_calls", ExpertGraphs.run)
        ExpertGraphs.run_pinned = timed("round_graph_call", ExpertGraphs.run_pinned)
        try:
            for graphed in (False, True) if graphs is not None else (False,):
                def this_round(graphed=graphed):
                    return one_round(graphed)
                name = "graph" if graphed else "eager"
                result[f"{name}_round_compute_us"] = statistics.median(
                    this_round().compute_seconds for _ in range(50)) * 1e6
                stamps.clear()
                result[f"{name}_round"] = variant([timeit(this_round) for _ in range(200)])
                result[f"{name}_paced_round"] = {
                    f"busy_poll_{busy_us:.0f}us{'_grpc_server' if grpc_server else ''}":
                        variant(busy_poll.run(paced(this_round, grpc_server), busy_us))
                    for busy_us in (0, busy_poll.DEFAULT_BUSY_POLL_US) for grpc_server in (False, True)}
                result[f"{name}_paced_round"]["python_spin"] = variant(spun(this_round))
        finally:
            (batcher.expert_ffn, batcher.copy_into, batcher.ComputeClock.seconds, torch.Tensor.to,
             ExpertGraphs.run, ExpertGraphs.run_pinned) = originals
        if args.trace is not None and graphs is not None:
            import torch_trace

            args.trace.mkdir(parents=True, exist_ok=True)
            with torch_trace.window(args.trace / "graph_rounds.json"):
                for _ in range(50):
                    one_round(True)
            with torch_trace.window(args.trace / "graph_rounds_paced.json"):
                busy_poll.run(paced(lambda: one_round(True), False, rounds=50), busy_poll.DEFAULT_BUSY_POLL_US)
        segment.unpin()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
