"""What an expert function's round costs beyond the FFN itself, in one process, without any transport.

At Mixtral size (4096 x 14336, or --hidden/--intermediate) and 64 tokens, on the GPU when there is
one, it times:
- `inproc`: expert_ffn on an input already on the device, then a synchronisation (the baseline);
- `round`: run_round on a job whose input and reply lie in a shared-memory segment (pinned on a
  GPU), as the server runs it for a lane call: copy in, FFN, copy back, one synchronisation;
- the CPU time of each step of one such round (stamps around each call; `device_wait` is the
  final synchronisation);
- `paced`: the same round once every 200 us from an event loop, as requests come to a server,
  with the loop polling (busy_poll) or sleeping in between, and with or without a grpc.aio server
  running in it: inside `kubemoe expert-fn` the round took 1.2-2.6x as long as `round` on the
  H200 host, and this tells which of these it is.

    python benchmarks/round_cost.py [--tokens 64] [--device cuda]   # prints JSON (H200: ~10 s)
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


async def paced(one_round, grpc_server: bool, gap_s: float = 200e-6, rounds: int = 300) -> float:
    """Median microseconds of one_round() run once every `gap_s` from this event loop."""
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
    return statistics.median(times[20:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--intermediate", type=int, default=INTERMEDIATE)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
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

        def one_round() -> Job:
            region.copy_(x)
            job = Job(region, [((0, 0), args.tokens)], out_buffer=region)
            run_round([job], lambda key: weights, act, device, dtype)
            return job

        x_device = x.to(device)
        result = {"device": str(device), "tokens": args.tokens, "segment_pinned": pinned,
                  "inproc_us": median_us(lambda: (expert_ffn(x_device, weights, act), sync())),
                  "round_us": median_us(one_round)}
        result["round_minus_inproc_us"] = result["round_us"] - result["inproc_us"]
        result["round_compute_us"] = statistics.median(one_round().compute_seconds for _ in range(50)) * 1e6

        # The CPU time of each call of one round: wrap what run_round calls.
        stamps: dict[str, list[float]] = {}

        def timed(name, function):
            def wrapper(*a, **k):
                start = time.perf_counter()
                out = function(*a, **k)
                stamps.setdefault(name, []).append(time.perf_counter() - start)
                return out
            return wrapper

        originals = (batcher.expert_ffn, batcher.copy_into, batcher._ComputeClock.seconds, torch.Tensor.to)
        batcher.expert_ffn = timed("ffn_calls", batcher.expert_ffn)
        batcher.copy_into = timed("copy_back_call", batcher.copy_into)
        batcher._ComputeClock.seconds = timed("device_wait", batcher._ComputeClock.seconds)
        torch.Tensor.to = timed("copy_in_call", torch.Tensor.to)
        try:
            for _ in range(100):
                one_round()
        finally:
            batcher.expert_ffn, batcher.copy_into, batcher._ComputeClock.seconds, torch.Tensor.to = originals
        result["round_steps_cpu_us"] = {name: statistics.median(values[10:]) * 1e6 for name, values in stamps.items()}
        result["paced_round_us"] = {
            f"busy_poll_{busy_us:.0f}us{'_grpc_server' if grpc_server else ''}":
                busy_poll.run(paced(one_round, grpc_server), busy_us)
            for busy_us in (0, busy_poll.DEFAULT_BUSY_POLL_US) for grpc_server in (False, True)}
        segment.unpin()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
