"""Per-call overhead of an expert function: gRPC round trip minus the server's own compute time.

For one expert at Mixtral size (hidden 4096 x intermediate 14336) and at Qwen3-30B-A3B size
(2048 x 768), and 1, 16, 64 and 256 tokens, it measures over loopback four ways of calling:
unary (`Forward`), streaming with tensors inline, streaming with tensors in shared memory
(`shm`: what ExpertClient does by default when the expert function is on its node), and
streaming over a TCP lane (`tcp`: its default towards a function on another node, frames.py),
the latter also against the loopback bandwidth one TCP connection reaches here:
- rtt: the client's round trip of ExpertClient.call (encode, send, server, receive, decode);
- compute: the server-reported ServerTiming.compute_seconds (the expert FFN itself);
- overhead = rtt - compute, and the transport rate (request + response bytes) / overhead;
- inproc: the same expert on the same input called in this process, and rtt / inproc.
The server runs in its own process (`kubemoe.expert_fn.cli`), as in production: the client's
event loop never shares a thread or the GIL with the server's compute. Weights: bfloat16 on CUDA,
float32 on CPU (CPU matmuls in bfloat16 are slow and not what a CPU deployment would use).

To see where the time goes it also times, for 64 tokens at Mixtral size, the pieces of the path:
protobuf building / serializing / parsing, tensor decode, and raw-bytes gRPC echoes with the same
channel options (the transport floor without kubemoe or protobuf): of the message's size (what an
inline call moves) and of 64 bytes (what a shared-memory call moves).

    python benchmarks/expert_fn_overhead.py --device cuda --out DIR   # writes DIR/expert_fn_<machine>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import multiprocessing
import re
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

# Client and server share the cores, as in `kubemoe serve`: idle OpenMP threads sleep rather than
# spin (read when torch loads; the server process inherits it).
from kubemoe.frontend.embedded import shared_cores_env

os.environ.update(shared_cores_env())

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, Goal, mixtral_layout_checkpoint, print_table, write_results  # noqa: E402

from kubemoe import busy_poll  # noqa: E402
from kubemoe.busy_poll import DEFAULT_BUSY_POLL_US, SHARED_CORES_BUSY_POLL_US  # noqa: E402

SIZES = {"mixtral": (4096, 14336), "qwen3-30b-a3b": (2048, 768)}  # hidden, expert intermediate
TOKENS = (1, 16, 64, 256)


# -- setup ------------------------------------------------------------------------------------------

def make_one_layer_checkpoint(hidden: int, intermediate: int, dtype: str, out: Path) -> Path:
    """A Mixtral-architecture checkpoint with one layer and two experts of the given size (no full model)."""
    return mixtral_layout_checkpoint(out, hidden, intermediate, dtype)


async def start_server(checkpoint: Path, device: str, shm_dir: Path, settings: list[str], stamps: Path | None = None):
    """The expert function in its own process, with `settings` (more flags); with `stamps`,
    traced_expert_fn.py writes its timeline there."""
    program = [str(Path(__file__).with_name("traced_expert_fn.py"))] if stamps else ["-m", "kubemoe.expert_fn.cli"]
    process = await asyncio.create_subprocess_exec(
        sys.executable, *program, "--checkpoint", str(checkpoint), "--bundle", "0:0",
        "--port", "0", "--host", "127.0.0.1", "--metrics-port", "-1", "--device", device, "--model", "bench",
        "--shm-dir", str(shm_dir), "--data-port", "0", *settings, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "KUBEMOE_STAMPS": str(stamps)} if stamps else None)
    port = None
    while True:
        line = (await asyncio.wait_for(process.stderr.readline(), 600)).decode()
        if not line:
            raise RuntimeError("the expert function exited during start")
        port = port or (m.group(1) if (m := re.search(r"on port (\d+)", line)) else None)
        if "loaded bundle" in line:
            asyncio.get_running_loop().create_task(_drain(process.stderr))
            return process, f"127.0.0.1:{port}"


async def _drain(stream) -> None:
    while await stream.readline():
        pass


# -- measurements -----------------------------------------------------------------------------------

def repeats(seconds_per_call: float, budget: float, lo: int = 5, hi: int = 300) -> int:
    return int(min(hi, max(lo, budget / max(seconds_per_call, 1e-6))))


def time_inprocess(x: torch.Tensor, weights, act, device: torch.device, budget: float) -> float:
    from kubemoe.expert import expert_ffn

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for _ in range(3):
            expert_ffn(x, weights, act)
        sync()
        start = time.perf_counter()
        expert_ffn(x, weights, act)
        sync()
        times = []
        for _ in range(repeats(time.perf_counter() - start, budget)):
            t0 = time.perf_counter()
            expert_ffn(x, weights, act)
            sync()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _inprocess_worker(checkpoint: Path, tokens: tuple[int, ...], hidden: int, dtype: torch.dtype, device: str,
                      budget: float, results) -> None:
    from kubemoe.adapters import MoEAdapter
    from kubemoe.checkpoint import Checkpoint

    ckpt = Checkpoint(checkpoint)
    adapter = MoEAdapter(ckpt.config)
    weights = adapter.load_expert(ckpt, 0, 0, dtype, torch.device(device))
    results.put({n: time_inprocess(bench_input(n, hidden, dtype).to(device), weights, adapter.act,
                                   torch.device(device), budget) for n in tokens})


def time_inprocess_all(checkpoint: Path, tokens: tuple[int, ...], hidden: int, dtype: torch.dtype, device: torch.device,
                       budget: float) -> dict[int, float]:
    """time_inprocess for each token count, in a process of its own that has ended when this returns.

    Not in this (the client's) process: a frontend's GPU context is not the expert function's,
    and a second process's context on the same GPU is not part of the call being measured."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    worker = context.Process(target=_inprocess_worker, args=(checkpoint, tokens, hidden, dtype, str(device), budget,
                                                            results))
    worker.start()
    try:
        return results.get(timeout=1200)
    finally:
        worker.join(60)


def bench_input(tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(dtype)


async def time_remote(client, x: torch.Tensor, budget: float) -> dict:
    async def one() -> tuple[float, float]:
        t0 = time.perf_counter()
        _, timing = await client.call(0, [0], [x.shape[0]], x)
        return time.perf_counter() - t0, timing.compute_seconds

    for _ in range(3):
        rtt, _ = await one()
    samples = [await one() for _ in range(repeats(rtt, budget))]
    rtts, computes = [s[0] for s in samples], [s[1] for s in samples]
    overheads = sorted(r - c for r, c in samples)
    return {"rtt_us": statistics.median(rtts) * 1e6, "compute_us": statistics.median(computes) * 1e6,
            "overhead_us": statistics.median(overheads) * 1e6,
            "overhead_p10_us": overheads[len(overheads) // 10] * 1e6,
            "overhead_p90_us": overheads[len(overheads) * 9 // 10] * 1e6, "calls": len(samples)}


def time_codec(x: torch.Tensor) -> dict:
    """Microseconds per piece of the protobuf path for one message of x (each side does all of them)."""
    from kubemoe import wire
    from kubemoe.proto import kubemoe_pb2 as pb

    def build():
        req = pb.ForwardRequest(model="bench", layer=0, experts=[0], counts=[x.shape[0]])
        req.hidden.CopyFrom(wire.encode(x))
        return req

    req = build()
    data = req.SerializeToString()
    parsed = pb.ForwardRequest.FromString(data)
    pieces = {"build_message": build, "serialize": req.SerializeToString,
              "parse": lambda: pb.ForwardRequest.FromString(data), "decode": lambda: wire.decode(parsed.hidden)}
    out = {}
    for name, fn in pieces.items():
        fn()
        t0 = time.perf_counter()
        n = 50
        for _ in range(n):
            fn()
        out[name + "_us"] = (time.perf_counter() - t0) / n * 1e6
    return out


def _echo_server(port_queue, max_message_bytes: int) -> None:
    import grpc

    from kubemoe.expert_fn.transport import grpc_options

    async def run():
        async def echo(request, context):
            async for message in request:
                yield message
        handler = grpc.method_handlers_generic_handler("bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)})
        server = grpc.aio.server(options=grpc_options(max_message_bytes))
        server.add_generic_rpc_handlers((handler,))
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()
    asyncio.run(run())


async def time_raw_echo(sizes: list[int], budget: float) -> list[float]:
    """Median round trips (us) of each size's bytes each way over a stream with kubemoe's options, no protobuf."""
    import grpc

    from kubemoe.expert_fn.transport import grpc_options

    queue = multiprocessing.get_context("spawn").Queue()
    server = multiprocessing.get_context("spawn").Process(target=_echo_server, args=(queue, 64 << 20), daemon=True)
    server.start()
    port = queue.get(timeout=120)
    try:
        medians = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=grpc_options(64 << 20)) as channel:
            for nbytes in sizes:
                call = channel.stream_stream("/bench.Echo/Stream")()
                payload = b"\1" * nbytes
                times = []
                deadline = time.perf_counter() + budget
                while time.perf_counter() < deadline or len(times) < 20:
                    t0 = time.perf_counter()
                    await call.write(payload)
                    await call.read()
                    times.append(time.perf_counter() - t0)
                await call.done_writing()
                medians.append(statistics.median(times[5:]) * 1e6)
        return medians
    finally:
        server.kill()


TIMELINE = ("client_starts", "client_sends", "server_parsed", "forward_starts", "request_checked", "round_starts",
            "device_wait_starts", "round_ends", "forward_ends", "server_sends", "client_parsed", "client_ends")


async def time_timeline(checkpoint: Path, device: str, x: torch.Tensor, shm_dir: Path, workdir: Path,
                        settings: list[str], calls: int = 300) -> dict:
    """Median microseconds between the stamps of one shared-memory call (over the lane when the server
    offers one), client and server side."""
    import grpc

    from kubemoe.expert_fn.client import ExpertClient
    from kubemoe.proto import kubemoe_pb2 as pb

    from traced_expert_fn import trace_messages

    stamps_path = workdir / "stamps.json"
    client_stamps: dict[str, dict[str, float]] = {}
    process, address = await start_server(checkpoint, device, shm_dir, settings, stamps=stamps_path)
    tracing = trace_messages(client_stamps, pb.ForwardResponse, "client_parsed", pb.ForwardRequest, "client_sends")
    try:
        parse, send = tracing.__enter__()
        client = ExpertClient(address, model="bench", shm_dir=shm_dir)
        client._channel = grpc.aio.insecure_channel(address, options=client._options)
        client._stub_cached = types.SimpleNamespace(ForwardStream=client._channel.stream_stream(
            "/kubemoe.v1.ExpertService/ForwardStream", request_serializer=send, response_deserializer=parse))
        for n in range(calls):
            started = time.perf_counter()
            await client.call(0, [0], [x.shape[0]], x, request_id=f"t{n}")
            client_stamps[f"t{n}"].update(client_starts=started, client_ends=time.perf_counter())
        await client.close()
    finally:
        tracing.__exit__(None, None, None)
        process.terminate()
        await process.wait()
    server_stamps = json.loads(stamps_path.read_text())
    rows = [{**client_stamps[k], **server_stamps[k]} for k in list(client_stamps)[calls // 10:] if k in server_stamps]
    steps = {f"{a}->{b}": statistics.median(r[b] - r[a] for r in rows) * 1e6 for a, b in zip(TIMELINE, TIMELINE[1:])}
    # A sum of medians is not the median of sums: the whole call's median too.
    return {**steps, "whole_call": statistics.median(r[TIMELINE[-1]] - r[TIMELINE[0]] for r in rows) * 1e6}


def loopback_bandwidth(total_bytes: int = 1 << 30, chunk: int = 4 << 20) -> float:
    """Bytes per second one TCP connection moves over loopback, one way: a thread sends, another
    receives into one preallocated buffer (the bound for the TCP lane's frames)."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    listener.close()
    data, into = memoryview(bytearray(chunk)), memoryview(bytearray(chunk))

    def receive() -> None:
        left = total_bytes
        while left:
            left -= receiver.recv_into(into[:min(chunk, left)])

    reader = threading.Thread(target=receive)
    started = time.perf_counter()
    reader.start()
    for _ in range(total_bytes // chunk):
        sender.sendall(data)
    reader.join()
    seconds = time.perf_counter() - started
    sender.close()
    receiver.close()
    return total_bytes / seconds


# -- main -------------------------------------------------------------------------------------------

async def bench_size(name: str, hidden: int, intermediate: int, device: torch.device, dtype: torch.dtype,
                     tokens: tuple[int, ...], budget: float, settings: list[str], workdir: Path,
                     shm_dir: Path) -> tuple[list[dict], dict]:
    from kubemoe.expert_fn.client import ExpertClient

    t0 = time.perf_counter()
    checkpoint = make_one_layer_checkpoint(hidden, intermediate, str(dtype).removeprefix("torch."), workdir / name)
    print(f"# {name}: checkpoint in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    inprocs = await asyncio.to_thread(time_inprocess_all, checkpoint, tokens, hidden, dtype, device, budget)
    process, address = await start_server(checkpoint, str(device), shm_dir, settings)
    rows, breakdown = [], {}
    try:
        modes = {"unary": dict(streaming=False, tcp=False), "streaming": dict(streaming=True, tcp=False),
                 "shm": dict(streaming=True, shm_dir=shm_dir), "tcp": dict(streaming=True, tcp=True)}
        for n in tokens:
            x, inproc = bench_input(n, hidden, dtype), inprocs[n]
            payload = 2 * x.numel() * x.element_size()
            for mode, options in modes.items():
                # One client at a time, as a frontend has: no idle streams of the other modes meanwhile.
                async with ExpertClient(address, model="bench", **options) as client:
                    remote = await time_remote(client, x, budget)
                    if mode in ("shm", "tcp") and client.transport != mode:
                        raise RuntimeError(f"the {mode} call travelled {client.transport}: the expert function "
                                           f"did not attach the segment in {shm_dir} / open a TCP lane")
                rows.append({"size": name, "hidden": hidden, "intermediate": intermediate, "tokens": n, "mode": mode,
                             "dtype": str(dtype).removeprefix("torch."), **remote, "inproc_us": inproc * 1e6,
                             "ratio": remote["rtt_us"] / (inproc * 1e6), "bytes": payload,
                             "transport_gbps": payload / max(remote["overhead_us"], 1e-3) / 1e3})
                print(f"# {name} {n:4d} tokens {mode:9s}: overhead {remote['overhead_us']:8.0f} us", file=sys.stderr)
            if name == "mixtral" and n == 64:
                echo_message, echo_64 = await time_raw_echo([payload // 2, 64], budget)
                breakdown = {"message_bytes": payload // 2, **time_codec(x), "raw_grpc_echo_us": echo_message,
                             "raw_grpc_echo_64_bytes_us": echo_64,
                             "shm_call_timeline_us": await time_timeline(
                                 checkpoint, str(device), x, shm_dir, workdir, settings,
                                 calls=repeats(inproc, 2 * budget, lo=20))}
    finally:
        process.terminate()
        await process.wait()
    return rows, breakdown


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for expert_fn_<machine>.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--seconds", type=float, default=1.5, help="time budget per measurement")
    parser.add_argument("--batch-wait-ms", type=float, default=0.5, help="the server's setting (the default)")
    parser.add_argument("--busy-poll-us", type=float, default=DEFAULT_BUSY_POLL_US,
                        help="the expert function's busy polling (its default)")
    parser.add_argument("--cuda-graph-tokens", type=int, default=None,
                        help="the expert function's --cuda-graph-tokens (default: its default)")
    parser.add_argument("--client-busy-poll-us", type=float, default=SHARED_CORES_BUSY_POLL_US,
                        help="this client's busy polling (a frontend's default on this machine)")
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    server_settings = ["--batch-wait-ms", str(args.batch_wait_ms), "--busy-poll-us", str(args.busy_poll_us)]
    if args.cuda_graph_tokens is not None:
        server_settings += ["--cuda-graph-tokens", str(args.cuda_graph_tokens)]
    rows, breakdown = [], {}
    shm_dir = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="kubemoe-bench-") as workdir:
        for name in args.sizes:
            size_rows, size_breakdown = await bench_size(name, *SIZES[name], device, dtype, tuple(args.tokens),
                                                         args.seconds, server_settings, Path(workdir),
                                                         shm_dir or Path(workdir))
            rows += size_rows
            breakdown = breakdown or size_breakdown

    print_table(rows, [("size", "size", "s"), ("tokens", "tokens", "d"), ("mode", "mode", "s"),
                       ("rtt_us", "rtt us", ".0f"), ("compute_us", "compute us", ".0f"),
                       ("overhead_us", "overhead us", ".0f"), ("overhead_p10_us", "p10", ".0f"),
                       ("overhead_p90_us", "p90", ".0f"), ("inproc_us", "in-proc us", ".0f"),
                       ("ratio", "grpc/in-proc", ".2f"), ("transport_gbps", "GB/s", ".2f")])
    if breakdown:
        timeline = breakdown.get("shm_call_timeline_us", {})
        print("where the time goes, 64 tokens at Mixtral size, per message (us):",
              ", ".join(f"{k.removesuffix('_us')} {v:.0f}" for k, v in breakdown.items() if k != "shm_call_timeline_us"))
        print("one shared-memory call, stamp to stamp (us):", ", ".join(f"{k} {v:.0f}" for k, v in timeline.items()))
    goals = {}
    loopback = loopback_bandwidth()
    print(f"loopback TCP, one connection one way: {loopback / 1e9:.2f} GB/s")

    def row(mode: str, tokens: int) -> dict | None:
        return next((r for r in rows if r["size"] == "mixtral" and r["tokens"] == tokens and r["mode"] == mode), None)

    # The goals are for the default paths: a frontend on the expert function's node streams through
    # shared memory; one on another node through a TCP lane.
    if row("shm", 64):
        goal_name, bound = ("overhead_ms_64tok_h200", "<= 0.3") if device.type == "cuda" else ("overhead_ms_64tok_cpu", "<= 1.0")
        goals[goal_name] = Goal(row("shm", 64)["overhead_us"] / 1e3, bound)
    if row("tcp", 64) and device.type == "cuda":
        goals["overhead_ms_64tok_tcp_h200"] = Goal(row("tcp", 64)["overhead_us"] / 1e3, "<= 0.5")
    if row("tcp", 256):  # the request's and the reply's bytes, each at loopback speed
        need_us = row("tcp", 256)["bytes"] / loopback * 1e6
        goals["tcp_overhead_vs_loopback_256tok"] = Goal(row("tcp", 256)["overhead_us"] / need_us, "<= 2.0")
    write_results("expert_fn", device, rows, goals, args.out, breakdown_64tok_mixtral=breakdown,
                  loopback_tcp_bytes_per_second=loopback,
                  settings={"batch_wait_ms": args.batch_wait_ms, "busy_poll_us": args.busy_poll_us,
                            "client_busy_poll_us": args.client_busy_poll_us,
                            "cuda_graph_tokens": args.cuda_graph_tokens,
                            "seconds_per_point": args.seconds,
                            "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
                            "weights_dtype": str(dtype).removeprefix("torch.")})


if __name__ == "__main__":
    arguments = parse_args()
    busy_poll.run(main(arguments), arguments.client_busy_poll_us)
