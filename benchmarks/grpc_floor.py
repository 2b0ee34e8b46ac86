"""The floor under an expert call: a 64-byte Python grpc.aio stream echo, with and without a pause.

A round trip of a tiny message between two processes, with kubemoe's channel options, when the
server answers at once and when it first spins for 300 us or 1 ms (as a GPU round keeps it busy),
with the client idle in its event loop or spinning it meanwhile. What an expert call cannot go
below while both ends are Python gRPC. Prints microseconds (round trip minus the pause).

    python benchmarks/grpc_floor.py
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kubemoe.expert_fn.transport import grpc_options  # noqa: E402

PAUSES_US = (0, 300, 1000)


def _server(port_queue) -> None:
    async def run():
        async def echo(request_iterator, context):
            async for message in request_iterator:
                pause, start = int.from_bytes(message[:4], "little") / 1e6, time.perf_counter()
                while time.perf_counter() - start < pause:
                    pass
                await context.write(message)

        handler = grpc.method_handlers_generic_handler("floor.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(echo)})
        server = grpc.aio.server(options=grpc_options(1 << 20))
        server.add_generic_rpc_handlers((handler,))
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()
    asyncio.run(run())


async def _round_trips(port: int, pause_us: int, spin: bool, calls: int = 400) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=grpc_options(1 << 20)) as channel:
        call = channel.stream_stream("/floor.Echo/Stream")()
        message = pause_us.to_bytes(4, "little") + b"x" * 60
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            await call.write(message)
            if spin:  # keep the loop turning (never asleep in epoll) until the reply is in
                read = asyncio.ensure_future(call.read())
                while not read.done():
                    await asyncio.sleep(0)
                await read
            else:
                await call.read()
            times.append(time.perf_counter() - start - pause_us / 1e6)
        await call.done_writing()
    return statistics.median(times[calls // 8:]) * 1e6


def main() -> None:
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    server = context.Process(target=_server, args=(ports,), daemon=True)
    server.start()
    port = ports.get(timeout=60)
    try:
        for pause in PAUSES_US:
            idle, spinning = (asyncio.run(_round_trips(port, pause, spin)) for spin in (False, True))
            print(f"server pauses {pause:5d} us: round trip beyond the pause {idle:5.0f} us with the client idle, "
                  f"{spinning:5.0f} us with it spinning")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
