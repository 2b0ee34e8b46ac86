"""The expert-function server: `create_server` builds one (tests bind port 0), `serve` runs it until a signal.

Knative scales a pod down with SIGTERM: `serve` then stops accepting calls, answers the requests
in flight within the grace period, ends the frontends' open streams (they reconnect elsewhere),
and exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kubemoe.errors import KubemoeError
from kubemoe.gc_freeze import settle
from kubemoe.adapters import MoEAdapter
from kubemoe.checkpoint import Checkpoint
from kubemoe.devices import allocator_cap, allocator_reserved
from kubemoe.expert_fn.config import ExpertFnConfig
from kubemoe.expert_fn.frames import DataPort
from kubemoe.expert_fn.follow import TableFollower
from kubemoe.expert_fn.node_lock import node_load_lock
from kubemoe.expert_fn.metrics import ExpertFnMetrics
from kubemoe.expert_fn.servicer import SERVICE_NAME, ExpertServicer
from kubemoe.expert_fn.store import ExpertStore
from kubemoe.expert_fn.transport import EXCLUSIVE_PORT, grpc_options, listen
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc
from kubemoe.routing_watch import watch_configmap, watch_file

log = logging.getLogger(__name__)


@dataclass
class ExpertFunction:
    """A built expert-function server: the gRPC server, its port and the servicer behind it."""

    server: grpc.aio.Server
    port: int
    servicer: ExpertServicer
    loading: asyncio.Task | None = None  # the bundle's preload, when asked for

    async def stop(self, grace: float | None) -> None:
        """End every open stream (each answers what it has read), then refuse new calls, answer the
        requests in flight, and stop.

        Frontends hold their ForwardStreams open: a plain server.stop(grace) would wait out the
        whole grace period (Knative's scale-down) and then cancel whatever was running. The streams
        end while the server still runs: a stream whose final status raced the server's shutdown
        failed to send it, and gRPC logged the failure with a traceback."""
        deadline = None if grace is None else time.monotonic() + grace
        self.servicer.end_streams()
        await self.servicer.streams_ended(grace)
        # One grace period for both waits, as Knative allows one before it kills the pod.
        await self.server.stop(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self.servicer.data_port is not None:
            self.servicer.data_port.close()
        for link in self.servicer.device_links:  # their frontends send the next steps' layers on ForwardStream
            await asyncio.to_thread(link.close)  # a step in flight may take a moment to finish
        await self.servicer.batcher.close()


# Beside a round's rows: CUDA graphs, cuBLAS workspaces, the lanes' device buffers (moeless_live.py on the H100:
# 0.9 GiB in use beside the experts while prefill rounds of 4096 tokens ran)
ROUND_SLACK = 256 << 20


def working_memory(config: ExpertFnConfig, adapter: MoEAdapter) -> int:
    """--working-memory-mib, raised where it is less than a round of max_batch_tokens needs (its rows gathered,
    in and out, the gate and up projections, the activation, ROUND_SLACK): under a cap too small for them,
    rounds would fail."""
    asked = config.working_memory_bytes
    need = config.max_batch_tokens * (4 * adapter.hidden_size + 3 * adapter.expert_intermediate_size) * \
        config.dtype.itemsize + ROUND_SLACK
    if 0 < asked < need:
        log.warning("--working-memory-mib %d is less than a round of %d tokens needs: capping at %d MiB beside the "
                    "experts instead (where the operator renders it, raise spec.experts.gpuSharing.functionOverhead "
                    "by the difference, so that the plan counts it)", asked >> 20, config.max_batch_tokens,
                    -(-need >> 20))
        return need
    return asked


async def build_server(
    address: str,
    config: ExpertFnConfig,
    *,
    metrics: ExpertFnMetrics | None = None,
    preload: bool = True,
) -> ExpertFunction:
    """A server for `config`'s bundle bound to `address` (port 0: any free port), not yet started.

    With `preload` the bundle's weights start loading now, in a thread; health reports NOT_SERVING
    until they are in. Without it nothing loads until a Load call (tests use this).
    """
    checkpoint = Checkpoint(config.checkpoint)
    adapter = MoEAdapter(checkpoint.config)
    store = ExpertStore(checkpoint, adapter, config.bundle, config.dtype, config.device, working_memory(config, adapter))
    servicer = ExpertServicer(config, store, metrics or ExpertFnMetrics(config.bundle_spec),
                              health_aio.HealthServicer())
    if config.device.type == "cuda":
        servicer.metrics.watch_device(lambda: allocator_reserved(config.device), lambda: allocator_cap(config.device))
    server = grpc.aio.server(options=[*grpc_options(config.max_message_bytes), EXCLUSIVE_PORT])
    pb_grpc.add_ExpertServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(servicer.health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    port = listen(server, address)
    if config.data_port is not None:
        servicer.data_port = DataPort(config.host, config.data_port, config.data_host)
        servicer.data_port.start()
    await servicer.report_health()  # NOT_SERVING until the bundle is in
    return ExpertFunction(server, port, servicer, servicer.start_loading() if preload else None)


async def create_server(address: str, config: ExpertFnConfig, **options) -> tuple[grpc.aio.Server, int]:
    """build_server(), as (server, port)."""
    built = await build_server(address, config, **options)
    return built.server, built.port


async def serve(config: ExpertFnConfig) -> None:
    """Serve until SIGTERM or SIGINT, then drain in-flight calls for up to `config.grace_seconds`."""
    metrics = ExpertFnMetrics(config.bundle_spec)
    built = await build_server(f"{config.host}:{config.port}", config, metrics=metrics)
    if config.metrics_port is not None:
        metrics.serve_http(config.metrics_port, config.host)
    await built.server.start()
    log.info("expert function for %s bundle %s on port %d (%s, %s)%s", config.model, config.bundle_spec, built.port,
             config.device, str(config.dtype).removeprefix("torch."),
             f"; TCP lanes on port {built.servicer.data_port.port}" if built.servicer.data_port else "")

    if built.loading is not None:  # once the bundle is in, what this process holds stays: out of the GC's sight
        built.loading.add_done_callback(lambda _: settle())
    following = follow_routing_table(config, built.servicer)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if following is not None:
        following.cancel()
    log.info("stopping: answering the requests in flight for up to %.0fs", config.grace_seconds)
    await built.stop(config.grace_seconds)
    log.info("stopped")


def follow_routing_table(config: ExpertFnConfig, servicer: ExpertServicer) -> asyncio.Task | None:
    """Gain and drop experts in place as the routing table names this function (follow.py), if asked."""
    table, configmap = config.routing_table, config.routing_configmap
    if not (table or configmap):
        return None
    if not config.address:  # ExpertFnConfig refuses following without one
        raise KubemoeError("following the routing table needs --address: how the table names this expert function")
    on_table = TableFollower(servicer, config.address, config.drop_after, load_lock=node_load_lock(config.shm_dir)).on_table
    if table:
        return asyncio.create_task(watch_file(Path(table), on_table))
    namespace, name = (configmap or "").split("/")  # NAMESPACE/NAME, checked by ExpertFnConfig
    return asyncio.create_task(watch_configmap(namespace, name, on_table))
