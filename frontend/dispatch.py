"""The dispatcher: runs a layer's routed experts wherever the routing table says they live.

A layer whose experts all run in this process is one grouped computation over its stacked
weights (`kubemoe.moe.grouped_ffn`) that never waits for the device; its loads are counted on the
device (`tally.py`). Otherwise, per MoE layer it groups the batch's tokens by expert, sends each bundle's tokens to its replicas
(all bundles of the layer at once), computes in-process bundles on the calling thread while remote
calls are in flight, and adds the outputs back with the routing weights. A hot expert's tokens are
split across several of its bundle's warm replicas in the same step (`kubemoe.planning.split`): how
many from the tokens predicted for this layer d layers earlier (the online predictor's; without one,
this step's tokens), each part at least `split_min_tokens`, and which by join-the-shortest-queue on
in-flight tokens. Lossless: every token goes to exactly one replica of the expert its router chose,
and the parts' outputs are put back in order. A replica that fails or times out is put aside for a
moment and its part is retried on another, so a dead replica loses no request while another one
lives. Shapes: T = tokens, H = hidden size, K = experts per token, N = a bundle call's rows.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

import grpc
import torch

from kubemoe.adapters import MoEAdapter
from kubemoe.busy_poll import SHARED_CORES_BUSY_POLL_US
from kubemoe.checkpoint import Checkpoint
from kubemoe.expert import ExpertWeights, expert_ffn
from kubemoe.frontend.loads import LoadRecorder
from kubemoe.frontend.loop_thread import LoopThread
from kubemoe.frontend.tally import DeviceTally
from kubemoe.moe import StackedExperts, can_group, combine, expert_counts, expert_inputs, grouped_ffn, group_tokens
from kubemoe.planning.split import split
from kubemoe.routing_table import LOCAL, BundleRoute, RouteMap

log = logging.getLogger(__name__)

NOT_RETRYABLE = {grpc.StatusCode.INVALID_ARGUMENT}  # a malformed request fails the same everywhere


class DispatchError(RuntimeError):
    """No replica of a bundle could run a layer's experts. `rows`: the batch's token rows whose
    experts did not run (the requests they belong to fail; the others' need not), None if unknown."""

    def __init__(self, message: str, rows: Sequence[int] | None = None):
        super().__init__(message)
        self.rows = rows


@dataclass
class Replica:
    address: str
    inflight_tokens: int = 0
    failed_until: float = 0.0
    picks: int = 0


@dataclass(frozen=True)
class DispatchConfig:
    model: str
    streaming: bool = True
    call_timeout: float = 30.0  # seconds per attempt
    shm_dir: Path | None = None  # shared with expert functions on this node (expert_fn/shm.py); None: inline
    busy_poll_us: float = SHARED_CORES_BUSY_POLL_US  # the I/O loop polls this long before sleeping (busy_poll.py)
    max_attempts: int = 4
    cooldown: float = 2.0  # seconds a failed replica is avoided while others are healthy
    # The smallest part of an expert's tokens worth a replica of its own: below the FFN's knee a part
    # costs a whole weight read (a Mixtral expert on the H200 takes 0.13 ms from 1 to 64 tokens).
    split_min_tokens: int = 64


class Predictions(Protocol):
    def predicted_counts(self, layer: int) -> Sequence[int] | None:
        """This forward pass's predicted tokens per expert of `layer` (made d layers earlier), or None."""


@dataclass(frozen=True)
class Piece:
    """Rows [row, row + count) of a bundle call's input: one part of one expert's tokens."""

    expert: int
    row: int
    count: int


def split_bundle_call(experts: Sequence[int], counts: Sequence[int], inflight: Sequence[int],
                      predicted: Sequence[int] | None, min_tokens: int) -> dict[int, list[Piece]]:
    """A bundle call's experts (their rows consecutive, in this order) -> replica index -> its pieces.

    Each expert is split on its own (`kubemoe.planning.split`); the tokens given to a replica count
    as in flight on it when the next expert is split, so one step's parts spread over the replicas.
    """
    load = list(inflight)
    parts: dict[int, list[Piece]] = {}
    row = 0
    for expert, count in zip(experts, counts):
        guess = None if predicted is None or expert >= len(predicted) else predicted[expert]
        for part in split(count, load, guess, min_tokens):
            parts.setdefault(part.replica, []).append(Piece(expert, row + part.start, part.count))
            load[part.replica] += part.count
        row += count
    return parts


@dataclass
class _BundleCall:
    route: BundleRoute
    experts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    groups: list = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)


def pick_replica(replicas: list[Replica], exclude: set[str], now: float) -> Replica:
    """Join-the-shortest-queue on in-flight tokens, preferring replicas that have not just failed."""
    fresh = [r for r in replicas if r.address not in exclude] or replicas
    healthy = [r for r in fresh if r.failed_until <= now] or fresh
    return min(healthy, key=lambda r: (r.inflight_tokens, r.picks))


class Dispatcher:
    def __init__(self, adapter: MoEAdapter, checkpoint: Checkpoint, config: DispatchConfig, loads: LoadRecorder,
                 dtype: torch.dtype, device: str | torch.device = "cpu", metrics=None):
        self.adapter, self.checkpoint, self.config, self.loads = adapter, checkpoint, config, loads
        self.dtype, self.device, self.metrics = dtype, device, metrics
        self.io = LoopThread(busy_poll_us=config.busy_poll_us)
        self._routes: RouteMap | None = None
        self._pending: RouteMap | None = None
        self._local: dict[tuple[int, int], ExpertWeights] = {}
        # Layers with every expert in this process: their weights stacked for one grouped computation.
        self._stacked: dict[int, StackedExperts] = {}
        self.tally = DeviceTally(adapter.num_experts, self._record_counts)
        loads.before_report.append(self.tally.flush)
        self._replicas: dict[str, Replica] = {}
        self._clients: dict[str, object] = {}
        self._ids = itertools.count()
        # See each layer's router input and choice before its experts run: the load predictor and
        # the routing recorder. One that fails is dropped (logged): serving goes on without it.
        self.observers: list = []
        # Where a layer's predicted loads come from for the per-step split (the online predictor).
        self.predictions: Predictions | None = None
        # Offload mode: experts routed here run from the offload executor's store (weights in host memory,
        # a device cache), not from weights loaded whole onto the device.
        self.offload = None

    # -- routing table --------------------------------------------------------------------------

    def set_routes(self, routes: RouteMap) -> None:
        """Take a new table; it applies at the next step boundary (`apply_pending`)."""
        self._pending = routes

    @property
    def routes_version(self) -> int | None:
        """The version of the table steps use now (None before the first)."""
        return None if self._routes is None else self._routes.version

    @property
    def ready(self) -> bool:
        return self._routes is not None or self._pending is not None

    def apply_pending(self) -> None:
        routes = self._pending
        if routes is None:
            return
        wanted = {k for k, r in routes.routes.items() if LOCAL in r.addresses} if self.offload is None else set()
        self._stack_layers(wanted)
        for key in wanted - self._local.keys():
            self._local[key] = self.adapter.load_expert(self.checkpoint, *key, dtype=self.dtype, device=self.device)
        for key in self._local.keys() - wanted:
            del self._local[key]
        self._replicas = {a: self._replicas.get(a) or Replica(a) for a in routes.addresses() if a != LOCAL}
        for address in self._clients.keys() - self._replicas.keys():
            self.io.submit(self._clients.pop(address).close())
        if self._routes is None or routes.version != self._routes.version:
            log.info("routing table version %d: %d bundles, %d remote endpoints", routes.version,
                     len({r.bundle for r in routes.routes.values()}), len(self._replicas))
        self._routes = routes
        if self._pending is routes:  # cleared only now: `ready` never reads False while a table loads
            self._pending = None

    def _stack_layers(self, wanted: set[tuple[int, int]]) -> None:
        """Stack the weights of layers whose experts all run here; unstack layers that no longer do.

        An expert already held (alone or in a stack) is copied, not read again; each expert of a
        stack is an `ExpertWeights` view of it, so the per-expert path shares the same memory.
        """
        experts = range(self.adapter.num_experts)
        whole = {layer for layer in self.adapter.moe_layers if all((layer, e) in wanted for e in experts)}
        for layer in self._stacked.keys() - whole:  # keep what stays wanted, in memory of its own
            del self._stacked[layer]
            for e in experts:
                if (layer, e) in self._local:
                    w = self._local[(layer, e)]
                    self._local[(layer, e)] = ExpertWeights(w.gate_up.clone(), w.down.clone())
        shape = (self.adapter.hidden_size, self.adapter.expert_intermediate_size)
        if not can_group(self.dtype, self.device, *shape):
            return  # the per-expert path computes every layer
        for layer in sorted(whole - self._stacked.keys()):
            stack = StackedExperts.empty(self.adapter.num_experts, *shape, self.dtype, self.device)
            for e in experts:
                held = self._local.get((layer, e)) or self.adapter.load_expert(
                    self.checkpoint, layer, e, dtype=self.dtype, device=self.device)
                stack.gate_up[e].copy_(held.gate_up)
                stack.down[e].copy_(held.down)
                self._local[(layer, e)] = stack.expert(e)  # the separate copy, if any, is freed here
            self._stacked[layer] = stack

    def before_step(self) -> None:
        """Between engine steps: take a new routing table, flush the device tallies now and then."""
        self.apply_pending()
        self.tally.step()

    def _record_counts(self, layer: int, counts: list[tuple[int, int]]) -> None:
        self.loads.record(layer, counts)
        if self.metrics:
            self.metrics.record_expert_tokens(layer, counts)

    # -- the layer ------------------------------------------------------------------------------

    def layer_module(self, layer: int) -> torch.nn.Module:
        return _LayerExperts(self, layer)

    def run_layer(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:  # [T, H], [T, K], [T, K] -> [T, H]
        if self._routes is None:
            self.apply_pending()
            if self._routes is None:
                raise DispatchError("no routing table yet: the frontend is not ready")
        weight_on_input = self.adapter.routing.weight_on_input
        stack = self._stacked.get(layer)
        if stack is not None:  # every expert here: nothing in this branch waits for the device
            counts = expert_counts(top_k_index, self.adapter.num_experts)  # [E]
            self.tally.add(layer, counts)
            self._observe(layer, hidden, top_k_index, top_k_weights)
            return grouped_ffn(hidden, top_k_index, top_k_weights, stack, self.adapter.act, weight_on_input, counts)
        groups = group_tokens(top_k_index)
        self._record_counts(layer, [(g.expert, len(g.tokens)) for g in groups])
        self._observe(layer, hidden, top_k_index, top_k_weights)
        calls: dict[str, _BundleCall] = {}
        for g in groups:
            route = self._routes.routes[(layer, g.expert)]
            call = calls.setdefault(route.bundle, _BundleCall(route))
            call.experts.append(g.expert)
            call.counts.append(len(g.tokens))
            call.groups.append(g)
            if self.offload is None or LOCAL not in route.addresses:  # the offload executor gathers its own
                call.inputs.append(expert_inputs(hidden, top_k_weights, g, weight_on_input))
        request_id = f"{uuid.uuid4().hex[:8]}-{next(self._ids)}"
        # Read only where a bundle has several replicas to split across: reading it waits for the GPU.
        predicted = functools.cache(lambda: self._predicted(layer))
        # One id per bundle call: two bundles may share an endpoint (a function hosting experts of
        # several bundles, loaded in place), and ids are unique per call in flight on a client.
        remote = {name: self._submit(c, layer, f"{request_id}.b{n}", predicted)
                  for n, (name, c) in enumerate(calls.items()) if LOCAL not in c.route.addresses}
        out = torch.zeros_like(hidden)
        if self.offload is not None:  # every in-process expert of the layer, placed by the offload policy
            local = [g for name, call in calls.items() if name not in remote for g in call.groups]
            if local:
                self.offload.run_layer(layer, hidden, top_k_index, top_k_weights, local, out)
        for name, call in calls.items():  # in-process bundles run here while remote calls are in flight
            if name not in remote and self.offload is None:
                for g, x in zip(call.groups, call.inputs):
                    y = expert_ffn(x, self._local[(layer, g.expert)], self.adapter.act)
                    combine(out, top_k_weights, g, y, weight_on_input)
        for name, parts in remote.items():
            call = calls[name]
            try:
                results = [future.result() for _, future in parts]
            except DispatchError as e:  # name the tokens that went without their experts: their requests fail
                raise DispatchError(str(e), torch.cat([g.tokens for g in call.groups]).unique().tolist()) from e
            pieces = sorted((p.row, y) for (rows, _), result in zip(parts, results)
                            for p, y in zip(rows, result.split([p.count for p in rows])))
            joined = pieces[0][1] if len(pieces) == 1 else torch.cat([y for _, y in pieces])  # [N, H], call order
            for g, y in zip(call.groups, joined.split(call.counts)):
                combine(out, top_k_weights, g, y, weight_on_input)
        return out

    def _observe(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        for observer in list(self.observers):
            try:
                observer.on_layer(layer, hidden, top_k_index, top_k_weights)
            except Exception:  # noqa: BLE001 - observing must never fail a request
                log.exception("%s failed at layer %d and is switched off; serving goes on without it",
                              type(observer).__name__, layer)
                self.observers.remove(observer)

    def _predicted(self, layer: int) -> Sequence[int] | None:
        if self.predictions is None:
            return None
        try:
            return self.predictions.predicted_counts(layer)
        except Exception:  # noqa: BLE001 - a prediction is a hint: the step's own token counts do without it
            log.exception("predicted loads of layer %d unavailable; splitting by this step's tokens", layer)
            return None

    def _submit(self, call: _BundleCall, layer: int, request_id: str,
                predicted: Callable[[], Sequence[int] | None]) -> list:
        """The bundle call as one call per chosen replica -> [(its pieces, future of its output [rows, H])]."""
        x = torch.cat(call.inputs)  # [N, H]
        now = time.monotonic()
        # Replicas that just failed get no part while others are healthy (a retry may still reach them).
        addresses = [a for a in call.route.addresses if self._replicas[a].failed_until <= now] or call.route.addresses
        parts = split_bundle_call(call.experts, call.counts, [self._replicas[a].inflight_tokens for a in addresses],
                                  predicted() if len(addresses) > 1 else None, self.config.split_min_tokens)
        submitted = []
        for index, (replica, pieces) in enumerate(sorted(parts.items())):
            rows = x if len(parts) == 1 else torch.cat([x[p.row:p.row + p.count] for p in pieces])
            # Ids are unique per call in flight on a client: the parts of one layer get their own.
            part_id = request_id if index == 0 else f"{request_id}.{index}"
            coroutine = self._call(call.route, layer, [p.expert for p in pieces], [p.count for p in pieces], rows,
                                   part_id, first=addresses[replica])
            submitted.append((pieces, self.io.submit(coroutine)))
        return submitted

    async def _call(self, route: BundleRoute, layer: int, experts: list[int], counts: list[int], x: torch.Tensor,
                    request_id: str, first: str | None = None):
        replicas = [self._replicas[a] for a in route.addresses]
        tried: set[str] = set()
        errors = []
        for attempt in range(self.config.max_attempts):
            # The split chose the first replica; a retry goes to the shortest queue among the others.
            replica = self._replicas[first] if attempt == 0 and first else pick_replica(replicas, tried, time.monotonic())
            replica.picks += 1
            replica.inflight_tokens += x.shape[0]
            try:
                return await self._client(replica.address).forward(
                    layer, experts, counts, x, request_id=request_id, timeout=self.config.call_timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() in NOT_RETRYABLE:
                    raise DispatchError(f"bundle {route.bundle} at {replica.address} refused layer {layer}: {e.details()}") from e
                errors.append(f"{replica.address}: {e.code().name} {e.details()}")
                replica.failed_until = time.monotonic() + self.config.cooldown
                tried.add(replica.address)
                if self.metrics:
                    self.metrics.expert_retries.labels(bundle=route.bundle).inc()
                log.warning("bundle %s replica %s failed (%s); retrying", route.bundle, replica.address, e.code().name)
                if len(tried) >= len(replicas):  # every replica failed once: back off before going round again
                    tried.clear()
                    await asyncio.sleep(0.05 * 2**attempt)
            finally:
                replica.inflight_tokens -= x.shape[0]
        raise DispatchError(f"bundle {route.bundle}: no replica could run layer {layer} after "
                            f"{self.config.max_attempts} attempts: {'; '.join(errors)}")

    def _client(self, address: str):
        client = self._clients.get(address)
        if client is None:
            from kubemoe.expert_fn.client import ExpertClient

            client = self._clients[address] = ExpertClient(address, model=self.config.model, streaming=self.config.streaming,
                                                           shm_dir=self.config.shm_dir)
        return client

    def close(self) -> None:
        for client in self._clients.values():
            self.io.run(client.close(), timeout=5)
        self._clients.clear()
        self.io.stop()


class _LayerExperts(torch.nn.Module):
    """Stands in for a layer's routed experts module inside the transformers model."""

    def __init__(self, dispatcher: Dispatcher, layer: int):
        super().__init__()
        self.dispatcher, self.layer = dispatcher, layer

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.dispatcher.run_layer(self.layer, hidden_states, top_k_index, top_k_weights)
