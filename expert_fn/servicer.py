"""The ExpertService servicer: checks requests at the boundary, runs them through the micro-batcher.

Requests may carry hidden states in any wire dtype (float32, bfloat16, float16): the server converts
them to the dtype it holds its weights in, computes there, and answers in the request's dtype. A
mismatch therefore costs one cast on each side, never a failed call; the precision is the server's.

ForwardStream answers each request as soon as it is done, so replies can come out of order; the
client matches them by request_id. A refused request gets a response whose `error` says why, and
the stream goes on serving. A client on the same node may attach a shared-memory segment to its
stream (see shm.py): requests then name regions of it instead of carrying bytes, replies overwrite
those regions, and the stream's lane (lane.py) carries them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import Callable, Coroutine, Iterable

import grpc
import torch
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from kubemoe import wire
from kubemoe.expert_fn.batcher import Job, MicroBatcher, run_round
from kubemoe.expert_fn.config import ExpertFnConfig
from kubemoe.expert_fn.frames import TCP_LANE_METADATA_KEY, TCP_METADATA_KEY, DataPort, parse_offer, serve_lane
from kubemoe.expert_fn import device_link, gpu_flags
from kubemoe.expert_fn.device_link import ServerLink
from kubemoe.expert_fn.errors import (ExpertFnError, code_of, failed_precondition, invalid, not_found, status,
                                     status_metadata)
from kubemoe.expert_fn.graphs import ExpertGraphs
from kubemoe.expert_fn.metrics import ExpertFnMetrics
from kubemoe.expert_fn.node_lock import holding, node_load_lock
from kubemoe.expert_fn.lane import LANE_METADATA_KEY, ServerLane
from kubemoe.expert_fn.shm import ATTACHED, METADATA_KEY, REFUSED, Segment, SharedMemoryError
from kubemoe.expert_fn.store import ExpertStore
from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.proto import kubemoe_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExpertService"].full_name
log = logging.getLogger(__name__)


class ExpertServicer(pb_grpc.ExpertServiceServicer):
    def __init__(self, config: ExpertFnConfig, store: ExpertStore, metrics: ExpertFnMetrics,
                 health: health_aio.HealthServicer):
        self.config, self.store, self.metrics, self.health = config, store, metrics, health
        self.batcher = MicroBatcher(self._run_round, wait_s=config.batch_wait_ms / 1e3,
                                    max_tokens=config.max_batch_tokens)
        self._dtype = wire.TO_WIRE[config.dtype]
        self._hidden_size = store.adapter.hidden_size  # read per request: a transformers config's attributes are slow
        self._graphs = ExpertGraphs(store.adapter.hidden_size, store.adapter.act, config.device, config.dtype,
                                    config.cuda_graph_tokens) \
            if config.device.type == "cuda" and config.cuda_graph_tokens > 0 else None
        self._forwards_in_progress = 0
        self._ending = asyncio.Event()  # set when the server stops: open streams end (see end_streams)
        self._open_streams = 0  # ForwardStreams whose final status is not sent yet
        self._no_open_streams = asyncio.Event()
        self._no_open_streams.set()
        self.data_port: DataPort | None = None  # where TCP lanes connect (frames.py); None: no TCP lanes
        self._tcp_lanes = itertools.count()
        self.device_links: list[ServerLink] = []  # frontends on this GPU (device_link.py)
        self._flags: gpu_flags.Flags | None = None  # how the links' streams wait (made at the first link)

    # -- Forward ------------------------------------------------------------------------------

    def _job(self, request: pb.ForwardRequest, segment: Segment | None) -> Job:
        if request.model != self.config.model:
            raise not_found(f"this expert function serves model {self.config.model!r}, not {request.model!r}; "
                            "check which endpoint the routing table gives for that model")
        experts, counts = list(request.experts), list(request.counts)
        if len(experts) != len(counts):
            raise invalid(f"experts and counts must pair up: got {len(experts)} experts and {len(counts)} counts")
        if any(c < 0 for c in counts):
            raise invalid(f"counts must not be negative, got {counts}")
        if not request.HasField("hidden"):
            raise invalid("hidden is missing: send the tokens as a [tokens, hidden_size] tensor")
        try:
            x = wire.decode(request.hidden, segment)
        except wire.WireError as e:
            raise invalid(f"hidden: {e}") from None
        hidden_size = self._hidden_size
        if x.dim() != 2 or x.shape[1] != hidden_size:
            raise invalid(f"hidden must have shape [tokens, {hidden_size}] for this model, got {list(x.shape)}")
        if sum(counts) != x.shape[0]:
            raise invalid(f"counts sum to {sum(counts)} but hidden has {x.shape[0]} rows")
        self.store.check_held(request.layer, experts)  # names every expert not in the model, or not held
        shared = request.hidden.WhichOneof("payload") == "shared"
        return Job(x, [((request.layer, e), c) for e, c in zip(experts, counts)], out_buffer=x if shared else None,
                   pinned=shared and segment is not None and segment.pinned)  # decode needs a segment to read shared

    def _run_round(self, jobs: list[Job]) -> None:
        tokens = run_round(jobs, lambda key: self.store.get(*key), self.store.adapter.act,
                           self.config.device, self.config.dtype, self._graphs, self.store.stack,
                           self.config.group_min_experts)
        # Off the requests' path: recorded in the loop's next turn (a lone request's reply is out by then).
        asyncio.get_running_loop().call_soon(self.metrics.round, tokens, jobs[0].compute_seconds,
                                             [job.queue_seconds for job in jobs])

    async def _forward(self, request: pb.ForwardRequest, segment: Segment | None = None) -> pb.ForwardResponse:
        started = time.perf_counter()
        job = self._job(request, segment)
        self.metrics.queue_depth.set(self.batcher.queue_depth + 1)
        self._forwards_in_progress += 1
        try:
            await self.batcher.submit(job, concurrent=self._forwards_in_progress > 1)
        finally:
            self._forwards_in_progress -= 1
        self.metrics.queue_depth.set(self.batcher.queue_depth)
        return self._response(request, job, started)

    def _response(self, request: pb.ForwardRequest, job: Job, started: float) -> pb.ForwardResponse:
        if job.error is not None:
            raise job.error
        response = pb.ForwardResponse(request_id=request.request_id)
        if job.out_buffer is not None:  # the reply is already in the request's region: same dtype, shape, offset
            response.hidden.CopyFrom(request.hidden)
        else:
            wire.encode_into(job.out, response.hidden)  # in place: no second copy of the bytes
        timing = response.timing
        timing.queue_seconds, timing.compute_seconds = job.queue_seconds, job.compute_seconds
        timing.total_seconds = time.perf_counter() - started
        return response

    async def _answer(self, request: pb.ForwardRequest, segment: Segment | None) -> pb.ForwardResponse:
        """_forward() for a stream or its lane: a refused request gets a response that says why, and
        the stream goes on (its other requests are not collateral damage)."""
        try:
            return await self._forward(request, segment)
        except Exception as e:
            return self._refusal(request, e)

    def answer_now(self, request: pb.ForwardRequest, segment: Segment | None) -> pb.ForwardResponse | None:
        """_answer() run to the end in this call, for a request that came alone (lane.py); None when
        other requests are pending: it should join them (spawn _answer)."""
        if not self.batcher.idle:
            return None
        started = time.perf_counter()
        try:
            return self._response(request, self.batcher.run_now(self._job(request, segment)), started)
        except Exception as e:
            return self._refusal(request, e)

    def _refusal(self, request: pb.ForwardRequest, error: Exception) -> pb.ForwardResponse:
        return pb.ForwardResponse(request_id=request.request_id, error=self._status(error, "ForwardStream"))

    async def Forward(self, request, context):
        return await self._call("Forward", context, self._forward(request))

    def end_streams(self) -> None:
        """Let every ForwardStream, open or opened from now on, answer what it has read and end (OK).

        Frontends keep their streams open for good: a stopping server would otherwise wait out its
        whole grace period. Requests a client sends meanwhile fail as UNAVAILABLE: it retries them
        on another replica."""
        self._ending.set()

    async def streams_ended(self, timeout: float | None) -> None:
        """Wait (at most `timeout` seconds) until every ForwardStream has sent its final status."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._no_open_streams.wait(), timeout)

    def _stream_done(self, _context) -> None:
        self._open_streams -= 1
        if not self._open_streams:
            self._no_open_streams.set()

    async def ForwardStream(self, request_iterator, context) -> None:
        # Each request runs in its own task and writes its own reply (one writer at a time): no hop
        # through a queue and a generator per reply. Requests from the lane, if the client connects
        # one, run in `running` too.
        self._open_streams += 1
        self._no_open_streams.clear()
        context.add_done_callback(self._stream_done)  # once its status is sent (or the call is cancelled)
        loop = asyncio.get_running_loop()
        running: set[asyncio.Task] = set()

        def spawn(work: Coroutine) -> None:
            task = loop.create_task(work)
            running.add(task)
            task.add_done_callback(running.discard)

        segment, lane = await self._attach(context, spawn)
        write_lock = asyncio.Lock()

        async def answer(request: pb.ForwardRequest) -> None:
            response = await self._answer(request, segment)
            async with write_lock:
                await context.write(response)

        async def read_requests() -> None:
            async for request in request_iterator:
                spawn(answer(request))
            while running:  # the client sent its last request: answer the ones still running
                await asyncio.wait(set(running))

        reader = loop.create_task(read_requests())
        ending = loop.create_task(self._ending.wait())
        try:
            await asyncio.wait((reader, ending), return_when=asyncio.FIRST_COMPLETED)
            if not reader.done():  # the server stops: read no more, answer the rest
                reader.cancel()
                if lane is not None:
                    lane.stop_reading()
                await asyncio.gather(reader, return_exceptions=True)
                while running:
                    await asyncio.wait(set(running))
            if not reader.cancelled():
                reader.result()  # a broken request stream surfaces here
            self.metrics.call("ForwardStream", "OK")
        except asyncio.CancelledError:
            return  # the server is stopping (SIGTERM) or the client left: nobody is waiting for an answer
        finally:
            ending.cancel()
            reader.cancel()
            for task in list(running):
                task.cancel()
            if lane is not None:
                lane.close()
            if segment is not None:
                segment.unpin()  # no round is running: rounds run on this loop and end synchronised

    async def _attach(self, context: grpc.aio.ServicerContext,
                      spawn: Callable[[Coroutine], None]) -> tuple[Segment | None, ServerLane | None]:
        """Map the shared-memory segment the client offered, if any, and open its lane (lane.py); where
        none attached, open the TCP lane it offered when this server has a data port (frames.py).
        Tell the client the outcome either way. The segment returned is the one the stream's own
        requests may name (a TCP lane's arena is its lane's alone)."""
        offered = dict(context.invocation_metadata() or ())
        offer, tcp_offer = _text(offered.get(METADATA_KEY)), _text(offered.get(TCP_METADATA_KEY))
        if offer is None and tcp_offer is None:
            return None, None
        metadata, segment, lane = [], None, None
        shm_dir = self.config.shm_dir
        if offer is not None:
            try:
                if shm_dir is None:
                    raise SharedMemoryError("this expert function runs without --shm-dir")
                segment = Segment.attach(shm_dir, offer, max_bytes=4 * self.config.max_message_bytes)
                if self.config.device.type == "cuda":
                    await asyncio.to_thread(segment.pin)  # else its copies to the GPU go through a bounce buffer
                answer = ATTACHED
            except SharedMemoryError as e:
                answer = f"{REFUSED}: {e}"
                log.info("no shared memory with a client on %s: %s", context.peer(), e)
            self.metrics.shared_memory(answer == ATTACHED)
            metadata.append((METADATA_KEY, answer.encode("ascii", "replace").decode()))
        if segment is not None and shm_dir is not None and offer is not None:  # attached: offer and folder were there
            try:
                lane = ServerLane.over_unix(shm_dir, offer, lambda request: self._answer(request, segment),
                                            spawn, answer_now=lambda request: self.answer_now(request, segment))
                metadata.append((LANE_METADATA_KEY, lane.name))
            except SharedMemoryError as e:  # the stream still carries the calls
                log.warning("%s", e)
        elif tcp_offer is not None and self.data_port is not None:
            lane = await self._tcp_lane(self.data_port, tcp_offer, spawn)
            if lane is not None:
                metadata.append((TCP_LANE_METADATA_KEY, self.data_port.address))
        await context.send_initial_metadata(metadata)
        return segment, lane

    async def _tcp_lane(self, data_port: DataPort, offer: str, spawn: Callable[[Coroutine], None]) -> ServerLane | None:
        try:
            size, token = parse_offer(offer, max_bytes=4 * self.config.max_message_bytes)
            waiter = data_port.expect(token)
        except SharedMemoryError as e:
            log.info("no TCP lane for a client: %s", e)
            self.metrics.tcp_lane(False)
            return None
        arena = Segment.private(size)
        if self.config.device.type == "cuda":
            await asyncio.to_thread(arena.pin)  # tensors land in it, then go to the GPU by DMA
        lane = ServerLane(f"tcp-{next(self._tcp_lanes)}", lambda request: self._answer(request, arena), spawn,
                          answer_now=lambda request: self.answer_now(request, arena))
        lane.on_close(arena.unpin)  # no round is running then: rounds run on this loop
        lane.connect_with(serve_lane(lane, waiter, arena))
        self.metrics.tcp_lane(True)
        return lane

    # -- weights ------------------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.config.model:
            raise not_found(f"this expert function serves model {self.config.model!r}, not {model!r}")

    async def load(self, keys: Iterable[tuple[int, int]]) -> pb.LoadResponse:
        keys = list(keys)
        bytes_loaded, seconds = await asyncio.to_thread(self.store.load, keys)
        await self._prepare_graphs(keys)  # before health says ready: no call should wait for a capture
        self.metrics.loaded(seconds, self.store.nbytes, len(self.store.held()))
        await self.report_health()
        return pb.LoadResponse(bytes_loaded=bytes_loaded, seconds=seconds, held=self._held(),
                               device_bytes=self.store.device_bytes)

    async def _prepare_graphs(self, changed: list[tuple[int, int]]) -> None:
        """Capture the graphs of the held experts of the layers `changed` touches that lack them: a layer
        the store made a new stack gives each of its experts new weights; in the stack's own slots, only the
        experts a Load added are new."""
        if self._graphs is None:
            return
        layers = {layer for layer, _ in changed}
        started, experts = time.perf_counter(), self.store.held_weights(k for k in self.store.held() if k[0] in layers)
        await self._graphs.prepare(experts)  # graphs of weights still held are kept, not captured again
        log.info("CUDA graphs of %d experts x %d sizes ready in %.2fs", len(experts), len(self._graphs.sizes),
                 time.perf_counter() - started)

    def start_loading(self) -> asyncio.Task:
        """Read the whole bundle in the background, under the node's Load lock (node_lock.py); health turns
        SERVING when it is in."""
        self._loading = asyncio.get_running_loop().create_task(self._load_bundle())
        self._loading.add_done_callback(self._loaded)
        return self._loading

    async def _load_bundle(self) -> pb.LoadResponse:
        async with holding(node_load_lock(self.config.shm_dir)):
            return await self.load(self.config.bundle)

    def _loaded(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("loading bundle %s failed; health stays NOT_SERVING. Fix the checkpoint or --bundle and "
                      "restart", self.store.bundle_spec, exc_info=task.exception())
            return
        response = task.result()
        log.info("loaded bundle %s: %d experts, %.1f MiB in %.2fs", self.store.bundle_spec, len(response.held),
                 response.bytes_loaded / 2**20, response.seconds)

    async def _unload(self, request: pb.UnloadRequest) -> pb.UnloadResponse:
        self._check_model(request.model)
        keys = [(k.layer, k.expert) for k in request.experts]
        freed = await asyncio.to_thread(self.store.unload, keys)
        await self._prepare_graphs(keys)
        self.metrics.held(self.store.nbytes, len(self.store.held()))
        await self.report_health()
        return pb.UnloadResponse(bytes_freed=freed, held=self._held(), device_bytes=self.store.device_bytes)

    async def _load(self, request: pb.LoadRequest) -> pb.LoadResponse:
        self._check_model(request.model)
        return await self.load((k.layer, k.expert) for k in request.experts)

    async def Load(self, request, context):
        return await self._call("Load", context, self._load(request))

    async def Unload(self, request, context):
        return await self._call("Unload", context, self._unload(request))

    async def AttachDevice(self, request, context):
        return await self._call("AttachDevice", context, asyncio.to_thread(self._attach_device, request))

    def _attach_device(self, request: pb.DeviceAttachRequest) -> pb.DeviceAttachResponse:
        """Open a frontend's device buffers (device_link.py); FAILED_PRECONDITION where this server cannot."""
        self._check_model(request.model)
        device, folder = self.config.device, self.config.shm_dir
        if device.type != "cuda" or folder is None or not self.store.stacked:
            raise failed_precondition("device links need this expert function on a GPU, with --shm-dir and its experts "
                                      "stacked (bfloat16 on Ampere or newer): send tensors on ForwardStream")
        if request.gpu_uuid != device_link.gpu_uuid(device):
            raise failed_precondition("the frontend's GPU is not this expert function's: send tensors on ForwardStream")
        if wire.FROM_WIRE.get(request.dtype) != self.config.dtype:
            raise invalid(f"device buffers must be in this server's dtype {self.config.dtype}, got "
                          f"{pb.DType.Name(request.dtype)}")
        adapter = self.store.adapter
        hidden, groups, flags = self._hidden_size, adapter.num_experts + 1, device_link.flag_count(adapter.num_layers)
        try:
            rows = device_link.open_buffer(request.rows, self.config.dtype, device)
            ends = device_link.open_buffer(request.ends, torch.int32, device)
            out = device_link.open_buffer(request.out, self.config.dtype, device)
            flag_buffer = device_link.open_buffer(request.flags, torch.int32, device)
        except ValueError as e:  # shapes that do not fit the buffers' bytes
            raise invalid(f"cannot open the device buffers: {e}") from None
        except RuntimeError as e:  # CUDA or torch's IPC bookkeeping cannot open them here (another IPC namespace, say)
            raise failed_precondition(f"cannot open the frontend's device buffers here ({e}): send tensors on "
                                      "ForwardStream") from None
        if rows.dim() != 2 or rows.shape[1] != hidden or list(ends.shape) != [groups] \
                or list(out.shape) != [rows.shape[0] + 1, hidden] or list(flag_buffer.shape) != [flags]:
            raise invalid(f"device buffers must be rows [R, {hidden}], ends [{groups}], out [R + 1, {hidden}] and "
                          f"flags [{flags}]; got {list(rows.shape)}, {list(ends.shape)}, {list(out.shape)}, "
                          f"{list(flag_buffer.shape)}")
        if self._flags is None:
            self._flags = gpu_flags.Flags(device)
        link = device_link.ServerLink(folder, rows, ends, out, flag_buffer, adapter.num_experts, adapter.moe_layers,
                                      self.store.stack, adapter.act, self._flags)
        self.device_links = [k for k in self.device_links if not k.closed] + [link]
        log.info("device link %s attached: %d rows", link.path.name, rows.shape[0])
        return pb.DeviceAttachResponse(socket=link.path.name, token=link.token)

    async def Describe(self, request, context):
        return pb.DescribeResponse(
            model=self.config.model, arch=self.store.adapter.arch.name, dtype=self._dtype,
            hidden_size=self.store.adapter.hidden_size, device=str(self.config.device), held=self._held(),
            max_message_bytes=self.config.max_message_bytes,
        )

    def _held(self) -> list[pb.ExpertKey]:
        return [pb.ExpertKey(layer=layer, expert=expert) for layer, expert in self.store.held()]

    async def report_health(self) -> None:
        # Ready means able to serve the whole bundle: Knative sends no traffic before, or after an Unload of part of it.
        status = health_pb2.HealthCheckResponse.SERVING if self.store.ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    # -- errors -------------------------------------------------------------------------------

    async def _call(self, method: str, context: grpc.aio.ServicerContext, work):
        """Await a unary handler's work; a refused request leaves with its status code and message."""
        try:
            response = await work
        except Exception as e:
            refused = self._status(e, method)
            await context.abort(code_of(refused), refused.message, trailing_metadata=status_metadata(refused))
        self.metrics.call(method, "OK")
        return response

    def _status(self, error: Exception, method: str) -> pb.Status:
        if isinstance(error, ExpertFnError):
            code, message, lacking = error.code, str(error), error.lacking
        else:  # a bug: log it whole, tell the caller it is the server's fault
            log.error("%s failed", method, exc_info=error)
            code, message, lacking = (grpc.StatusCode.INTERNAL,
                                      f"{method} failed on the server: {type(error).__name__}: {error}", ())
        self.metrics.call(method, code.name)
        return status(code, message, lacking)


def _text(value: str | bytes | None) -> str | None:
    """A metadata value of a text key (gRPC gives bytes only for keys ending in -bin)."""
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value
