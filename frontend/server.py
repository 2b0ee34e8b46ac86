"""Run a frontend: its routing-table watch, the HTTP API and the gRPC API, until a signal.

Kubernetes stops a pod with SIGTERM: both servers then stop accepting, requests in flight get up
to `grace` seconds to finish, and the frontend (engine thread, expert clients) is closed last.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Callable

from kubemoe.frontend.grpc_api import create_grpc_server
from kubemoe.frontend.http_api import start_http_server

log = logging.getLogger(__name__)


async def serve_frontend(frontend, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 50051,
                         on_ready: Callable[[int, int], None] | None = None, grace: float = 30.0) -> None:
    """Serve until cancelled or SIGTERM/SIGINT; ports may be 0 (any free port: on_ready gets the real ones)."""
    frontend.start_watching()
    runner = grpc_server = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
    try:
        runner, http_port = await start_http_server(frontend, host, http_port, grace=grace)
        grpc_server, grpc_port = await create_grpc_server(f"{host}:{grpc_port}", frontend)
        await grpc_server.start()
        for sig in signals:
            loop.add_signal_handler(sig, stop.set)
        log.info("frontend for %s: HTTP on %s:%d, gRPC on %s:%d", frontend.model_id, host, http_port, host, grpc_port)
        if on_ready:
            on_ready(http_port, grpc_port)
        await stop.wait()
        log.info("stopping: in-flight requests get up to %.0fs", grace)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        # Both stop accepting at once; each lets its running requests finish within the grace period.
        await asyncio.gather(*([runner.cleanup()] if runner else []),
                             *([grpc_server.stop(grace)] if grpc_server else []))
        frontend.close()
        log.info("stopped")
