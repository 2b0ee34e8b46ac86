"""The dispatcher: runs a layer's routed experts wherever the routing table says they live.

A layer whose experts all run in this process is one grouped computation over its stacked
weights (`kubemoe.moe.grouped_ffn`) that never waits for the device; its loads are counted on the
device (`tally.py`). Otherwise, per MoE layer it sorts the batch's (token, choice) pairs by expert
where they live (`kubemoe.moe.sort_pairs`), reads the group ends once, and sends each expert
function ONE call carrying the rows of every expert it serves in that layer, whichever bundles they
belong to (all calls of the layer at once), computes in-process experts on the calling thread while
remote calls are in flight, and adds the outputs back with the routing weights. A call's rows are
usually one run of the sorted rows: it goes out as a view and its reply is copied straight into
place, so a layer's host work is the calls alone (in a decode graph, graphs.py, the sorting and the
adding back are captured on either side of the cut: on the H200 host the grouping, gathering and
scattering around the calls cost ~1 ms a layer of torch calls at batch 1). A hot
expert's tokens are split across several of its warm replicas in the same step
(`kubemoe.planning.split`): how many from the tokens predicted for this layer d layers earlier (the
online predictor's; without one, this step's tokens), each part at least `split_min_tokens`, which
by join-the-shortest-queue on in-flight tokens, and the parts sized to level those queues.
Lossless: every token goes to exactly one replica of the expert its router chose, and each part's
output is added back at its own rows.
A replica that fails or times out is put aside for a moment and its part is retried on another,
so a dead replica loses no request while another one lives; a function that answers it lacks some
experts (NOT_FOUND: unloaded, loading in place) is put aside for those experts only.
Shapes: T = tokens, H = hidden size, K = experts per token, N = a call's rows.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Mapping, Protocol, Sequence

import grpc
import torch

from kubemoe.adapters import MoEAdapter
from kubemoe.busy_poll import SHARED_CORES_BUSY_POLL_US
from kubemoe.checkpoint import Checkpoint
from kubemoe.expert import ExpertWeights, expert_ffn
from kubemoe.expert_fn import gpu_flags
from kubemoe.expert_fn.device_link import ClientLink, DeviceBuffers, LinkError, StepLinks, flag_count
from kubemoe.expert_fn.errors import lacking_of
from kubemoe.frontend.graphs import Recorder, recording
from kubemoe.frontend.loads import LoadRecorder
from kubemoe.frontend.loop_thread import LoopThread
from kubemoe.frontend.tally import DeviceTally
from kubemoe.moe import (SortedPairs, StackedExperts, can_group, expert_counts, grouped_ffn, sort_pairs,
                         unsort_pairs, weighted_sum)
from kubemoe.planning.split import split_layer
from kubemoe.routing_table import LOCAL, BundleRoute, RouteMap

if TYPE_CHECKING:  # for its type only: the module is imported where the first client is made
    from kubemoe.expert_fn.client import ExpertClient

log = logging.getLogger(__name__)

NOT_RETRYABLE = {grpc.StatusCode.INVALID_ARGUMENT}  # a malformed request fails the same everywhere
LINK_RETRY_SECONDS = 60.0  # how long a function that could not link sees its layers as calls before the next try
LINK_WAITS_KEPT = 4096  # linked steps whose waits the dispatcher keeps
LINK_MIN_ROWS = 256  # device link buffers' rows at least (then powers of two): a few graph sizes share them


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
    max_attempts: int = 4  # at least: a call tries each of its expert's replicas once (_call)
    cooldown: float = 2.0  # seconds a failed replica is avoided while others are healthy
    # The smallest part of an expert's tokens worth a replica of its own: below the FFN's knee a part
    # costs a whole weight read (a Mixtral expert on the H200 takes 0.13 ms from 1 to 64 tokens).
    split_min_tokens: int = 64
    # One call per (bundle, address) instead of one per address: the dispatch before calls were
    # merged, kept as the baseline benchmarks/dispatch_calls.py measures against. Not for serving.
    calls_per_bundle: bool = False
    # Same GPU: lend expert functions device buffers (expert_fn/device_link.py) and run decode graphs
    # whose every remote expert has one replica, on a linked function, with no host work within a step.
    device_links: bool = True


class Predictions(Protocol):
    def predicted_counts(self, layer: int) -> Sequence[int] | None:
        """This forward pass's predicted tokens per expert of `layer` (made d layers earlier), or None."""


@dataclass(frozen=True)
class Piece:
    """Tokens [start, start + count) of one expert's tokens in a layer (in its group's order)."""

    expert: int
    start: int
    count: int


CallKey = tuple[str, str]  # (address, tag): one call each


def plan_calls(experts: Sequence[int], counts: Sequence[int], candidates: Sequence[Sequence[str]],
               inflight: Mapping[str, int], predicted: Sequence[int] | None, min_tokens: int,
               tags: Sequence[str] | None = None) -> dict[CallKey, list[Piece]]:
    """A layer's remote experts (their tokens, the replicas each may use now) -> calls -> their pieces.

    The layer is split as one (`kubemoe.planning.split.split_layer`): the tokens given to an address
    count as queued there when the next expert is split, so one step's parts level the addresses'
    queues. Everything one address gets is one call (tag ""), unless `tags` gives experts tags that
    must not share a call (the per-bundle calls of the benchmark's baseline). A call's pieces follow
    `experts`' order, so a call of sorted rows stays one run of them.
    """
    guesses = [None if predicted is None or len(addresses) == 1 or expert >= len(predicted) else predicted[expert]
               for expert, addresses in zip(experts, candidates)]
    queued = dict(inflight)  # a copy: split_layer adds this layer's parts to it
    parts = split_layer(counts, candidates, queued, guesses, min_tokens)
    calls: dict[CallKey, list[Piece]] = {}
    for n, (expert, expert_parts) in enumerate(zip(experts, parts)):
        for address, part in expert_parts:
            calls.setdefault((address, tags[n] if tags else ""), []).append(Piece(expert, part.start, part.count))
    return calls


def pick_replica(replicas: list[Replica], exclude: Collection[str], now: float,
                 lacking: Collection[str] = ()) -> Replica:
    """Join-the-shortest-queue on in-flight tokens, preferring replicas that have not just failed
    (nor just said they lack the expert: `lacking`)."""
    fresh = [r for r in replicas if r.address not in exclude] or replicas
    healthy = [r for r in fresh if r.failed_until <= now and r.address not in lacking] or fresh
    return min(healthy, key=lambda r: (r.inflight_tokens, r.picks))


@dataclass
class _Call:
    """One call's work: its pieces, in row order, and the sorted rows each is (`spans`, of `pairs`)."""

    pieces: list[Piece]
    spans: list[tuple[int, int]]  # [start, end) of pairs' rows, one per piece
    pairs: SortedPairs

    @functools.cached_property
    def x(self) -> torch.Tensor:  # [N, H] the call's input: a view when its rows are contiguous
        return _rows(self.pairs.x, self.spans)

    @property
    def run(self) -> tuple[int, int] | None:
        return _run(self.spans)

    def tokens(self) -> list[int]:
        """The batch rows the call's pairs belong to (read from the device: on a failure only)."""
        return sorted({t for a, b in self.spans for t in self.pairs.tokens(a, b).tolist()})

    def subset(self, indices: Sequence[int]) -> "_Call":
        """The call made of some of its pieces (a retry sends them elsewhere)."""
        if len(indices) == len(self.pieces):
            return self
        return _Call([self.pieces[i] for i in indices], [self.spans[i] for i in indices], self.pairs)


def _run(spans: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """[start, end) when `spans` follow one another without a gap (one run of rows), else None."""
    if all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(spans)):
        return spans[0][0], spans[-1][1]
    return None


def _rows(x: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Rows `spans` of `x`, in order: a view when they are one run."""
    run = _run(spans)
    return x[run[0]:run[1]] if run is not None else torch.cat([x[a:b] for a, b in spans])


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
        self.generation = 0  # bumped when _stacked or the links change: a captured decode graph reads them
        self.tally = DeviceTally(adapter.moe_layers, adapter.num_experts, self._record_counts)
        loads.before_report.append(self.tally.flush)
        self._replicas: dict[str, Replica] = {}
        # (address, layer, expert) -> until when: the function there said it lacks that expert.
        self._lacking: dict[tuple[str, int, int], float] = {}
        self._clients: dict[str, ExpertClient] = {}
        self._ids = itertools.count()
        # See each layer's router input and choice before its experts run: the load predictor and
        # the routing recorder. One that fails is dropped (logged): serving goes on without it.
        self.observers: list = []
        # Where a layer's predicted loads come from for the per-step split (the online predictor).
        self.predictions: Predictions | None = None
        # Offload mode: experts routed here run from the offload executor's store (weights in host memory,
        # a device cache), not from weights loaded whole onto the device.
        self.offload = None
        self._links: dict[str, ClientLink] = {}
        self._link_retry: dict[str, float] = {}  # address -> not before then (its function could not link)
        self._link_buffers: DeviceBuffers | None = None
        self._link_plans: dict[tuple[int, int], dict[str, list[int]]] = {}  # (table version, layer) -> _link_plan
        self._flags: gpu_flags.Flags | None = None  # how this side's streams wait on the links' flags
        self.linked_layers = 0  # layers run through device links (a test and a benchmark read it)
        # The host's waits in the last linked steps that held, (for the functions' answers, for the step's
        # end) in seconds: a benchmark reads them
        self.link_waits: collections.deque[tuple[float, float]] = collections.deque(maxlen=LINK_WAITS_KEPT)

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

    @property
    def in_process(self) -> bool:
        """Whether every MoE layer's experts run here as one stack: a pass then never waits for the
        host (no remote calls, no offload decisions), so the engine may launch the next one ahead."""
        return self.offload is None and len(self._stacked) == len(self.adapter.moe_layers)

    @property
    def launches_ahead(self) -> bool:
        """Whether decode passes need no host work within them, so the engine may launch the next one
        ahead: every expert here (`in_process`), or remote ones through device links (their steps settle
        before anything reads them: graphs.py)."""
        return self.in_process or (self.config.device_links and bool(self._links))

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
            self.generation += 1
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
                stack.expert(e).copy_(held)
                self._local[(layer, e)] = stack.expert(e)  # the separate copy, if any, is freed here
            self._stacked[layer] = stack
            self.generation += 1

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
        self._table()
        weight_on_input = self.adapter.routing.weight_on_input
        recorder = recording()
        if recorder is not None:
            return self._run_recorded(recorder, layer, hidden, top_k_index, top_k_weights)
        stack = self._stacked.get(layer)
        if stack is not None:  # every expert here: nothing in this branch waits for the device
            counts = self._count_stacked(layer, hidden, top_k_index, top_k_weights)
            return grouped_ffn(hidden, top_k_index, top_k_weights, stack, self.adapter.act, weight_on_input, counts)
        pairs = sort_pairs(hidden, top_k_index, top_k_weights, self.adapter.num_experts, weight_on_input)
        # Every row is some expert's and each is written, but for the offload executor's (it adds its own)
        y = (torch.empty_like if self.offload is None else torch.zeros_like)(pairs.x)
        extra = self._run_sorted(layer, pairs, y, hidden, top_k_index, top_k_weights)
        out = self._combine(pairs, y)
        return out if extra is None else out + extra

    def _combine(self, pairs: SortedPairs, y: torch.Tensor) -> torch.Tensor:  # [S, H] sorted -> [T, H]
        """The rows' outputs weighted and summed per token, as the in-process layer sums them."""
        if self.adapter.routing.weight_on_input:
            return unsort_pairs(y, pairs)
        return weighted_sum(y, pairs, y.dtype)

    def _run_sorted(self, layer: int, pairs: SortedPairs, y: torch.Tensor, hidden: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, counted: bool = False,
                    observed: bool = False) -> torch.Tensor | None:
        """A layer's host work: each expert's rows of `pairs` through its expert, wherever it lives, into
        the same rows of `y` [S, H]. Remote experts go out first (one call per address, all at once),
        in-process ones run here meanwhile. Returns what the offload executor added for its experts
        ([T, H], their rows of `y` untouched), or None. The one wait for the device: the group ends.
        `counted`: the layer's tokens per expert were counted on the device already (a decode graph);
        `observed`: the observers saw the layer already."""
        ends = pairs.ends.tolist()
        num_experts = self.adapter.num_experts
        spans = [(ends[e - 1] if e else 0, ends[e]) for e in range(num_experts)]  # a spare group (E) stays out
        if not counted:
            self._record_counts(layer, [(e, b - a) for e, (a, b) in enumerate(spans) if b > a])
        if not observed:
            self._observe(layer, hidden, top_k_index, top_k_weights)
        routes = self._table().routes
        local, remote = [], {}
        for e, (a, b) in enumerate(spans):
            if b > a:
                route = routes[(layer, e)]
                if LOCAL in route.addresses:
                    local.append(e)
                else:
                    remote[e] = route
        calls = self._submit(layer, remote, pairs, spans, y) if remote else None
        extra = None
        if self.offload is not None:  # every in-process expert of the layer, placed by the offload policy
            if local:
                extra = self.offload.run_layer(layer, hidden, top_k_index, top_k_weights,
                                               [pairs.group(e, *spans[e]) for e in local])
        else:  # in-process experts run here while remote calls are in flight
            for e in local:
                a, b = spans[e]
                y[a:b] = expert_ffn(pairs.x[a:b], self._local[(layer, e)], self.adapter.act)
        if calls is not None:
            self._gather(calls, y)
        return extra

    def _table(self) -> RouteMap:
        if self._routes is None:
            self.apply_pending()
            if self._routes is None:
                raise DispatchError("no routing table yet: the frontend is not ready")
        return self._routes

    def _count_stacked(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:  # -> [E] tokens per expert, on the device
        counts = expert_counts(top_k_index, self.adapter.num_experts)
        self.tally.add(layer, counts)
        self._observe(layer, hidden, top_k_index, top_k_weights)
        return counts

    def _run_recorded(self, recorder: Recorder, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
        """The layer in a pass run as a CUDA graph program (graphs.py): captured whole where every expert
        is here (with its counting where the whole pass is captured, else its counting and observers
        after the pass, on the real rows), else a cut whose host work is this layer's ordinary path on the
        real rows, replying into a buffer the graph reads."""
        stack = self._stacked.get(layer)
        if stack is not None:
            if self.in_process or recorder.links is not None:  # the whole pass is captured: so is its counting
                self._count_captured(recorder, layer, hidden, top_k_index, top_k_weights)
            else:  # a pass with cuts: observers need the host anyway
                recorder.after(lambda rows: self._count_stacked(layer, hidden[:rows], top_k_index[:rows],
                                                                top_k_weights[:rows]))
            return grouped_ffn(hidden, top_k_index, top_k_weights, stack, self.adapter.act,
                               self.adapter.routing.weight_on_input)
        # Sorting the pairs, counting the tokens per expert and adding the outputs back are device work:
        # captured on either side of the cut, whose host work is the calls alone (not a Prometheus counter
        # and a load record per routed expert). The spare rows' pairs sort last, to no expert: their rows
        # of y stay 0 (a link's shared `out`: an earlier step's output there), so the spare rows' next
        # layers read a finite output.
        real_rows = recorder.real_rows(hidden.device)
        self.tally.add_rows(layer, top_k_index, real_rows)
        links = recorder.links
        if links is not None and links.covers(layer) and self.offload is None:  # to linked functions on the GPU
            pairs = sort_pairs(hidden, top_k_index, top_k_weights, self.adapter.num_experts,
                               self.adapter.routing.weight_on_input, real_rows=real_rows, into=links.rows)
            self._observe_captured(recorder, layer, hidden, top_k_index, top_k_weights)  # no cut: all captured
            return self._combine(pairs, links.run_layer(layer, pairs.x, pairs.ends))
        pairs = sort_pairs(hidden, top_k_index, top_k_weights, self.adapter.num_experts,
                           self.adapter.routing.weight_on_input, real_rows=real_rows)
        y = torch.zeros_like(pairs.x)
        extra = torch.zeros_like(hidden) if self.offload is not None else None  # what its experts add

        def call(rows: int) -> None:
            self._observe(layer, hidden[:rows], top_k_index[:rows], top_k_weights[:rows])
            added = self._run_sorted(layer, pairs, y, hidden[:rows], top_k_index[:rows], top_k_weights[:rows],
                                     counted=True, observed=True)
            if added is not None and extra is not None:
                extra[:rows] = added

        recorder.cut(call)
        out = self._combine(pairs, y)
        return out if extra is None else out + extra

    # -- device links (expert_fn/device_link.py) ------------------------------------------------

    def use_device_links(self, on: bool) -> None:
        """Device links on or off from the next decode step (programs that ran through them are captured again)."""
        self.config = dataclasses.replace(self.config, device_links=on)
        for address in list(self._links):
            self._unlink(address, None)
        self.generation += 1

    def link_step(self, padded: int) -> StepLinks | None:
        """The device links a decode program of `padded` rows runs its remote layers through: all of them
        or none (a cut's host work would wait for the GPU, unbounded, behind a link that failed)."""
        remote = [layer for layer in self.adapter.moe_layers if layer not in self._stacked]
        if not remote or self.offload is not None:
            return None
        plans = {}
        for layer in remote:
            plan = self._link_plan(layer)
            if not plan:
                return None
            plans[layer] = plan
        rows = padded * self.adapter.top_k  # a layer's (token, choice) pairs
        links = {}
        for address in sorted({a for plan in plans.values() for a in plan}):
            link = self._link(address, rows)
            if link is None:
                return None
            links[address] = link
        if any(a not in self._links for a in links):  # a later attach grew the buffers: the earlier ones went
            return None
        assert self._link_buffers is not None and self._flags is not None
        return StepLinks(self._link_buffers, links, plans, self._flags, self.adapter.num_experts,
                         self.config.call_timeout, self._step_linked)

    def _step_linked(self, links: StepLinks, failed: dict[str, str]) -> None:
        """A linked step settled (StepLinks.finish): the links that failed it ({address: why}) dropped, or it counted."""
        for address, why in failed.items():
            self._unlink(address, why)
        if self.metrics:
            self.metrics.linked_steps.labels("void" if failed else "ok").inc()
            if not failed:
                plans = links.plans.values()
                self.metrics.expert_calls.inc(sum(len(plan) for plan in plans))
                self.metrics.expert_parts.inc(sum(len(experts) for plan in plans for experts in plan.values()))
        if not failed:
            self.linked_layers += len(links.plans)
            self.link_waits.append((links.answers_s, links.end_s))

    def _link_plan(self, layer: int) -> dict[str, list[int]]:
        """{address: its experts} for a layer whose experts are each remote on one replica; else {}."""
        if not self.config.device_links or self.config.shm_dir is None or torch.device(self.device).type != "cuda":
            return {}
        routes = self._table()
        key = (routes.version, layer)
        if key not in self._link_plans:
            plan: dict[str, list[int]] = {}
            for e in range(self.adapter.num_experts):
                route = routes.routes.get((layer, e))
                if route is None or len(route.addresses) != 1 or route.addresses[0] == LOCAL:
                    plan = {}  # not every expert of the layer can go through a link
                    break
                plan.setdefault(route.addresses[0], []).append(e)
            self._link_plans = {k: v for k, v in self._link_plans.items() if k[0] == routes.version}
            self._link_plans[key] = plan
        plan = self._link_plans[key]
        if any(self._replicas[a].failed_until > time.monotonic() for a in plan):
            return {}  # the calls' retries know what to do with a replica that just failed
        return plan

    def _link(self, address: str, rows: int) -> ClientLink | None:
        """The device link to `address` with room for `rows` rows, attached now if need be; None if it cannot be."""
        link = self._links.get(address)
        if link is not None and self._link_buffers is not None and self._link_buffers.rows.shape[0] >= rows:
            return link
        folder = self.config.shm_dir
        if folder is None or time.monotonic() < self._link_retry.get(address, 0.0):
            return None
        buffers = self._link_buffers
        if buffers is None or buffers.rows.shape[0] < rows:  # bigger buffers: every link attaches again
            for linked in list(self._links):
                self._unlink(linked, None)
            size = max(LINK_MIN_ROWS, 1 << (rows - 1).bit_length())
            buffers = self._link_buffers = DeviceBuffers(size, self.adapter.hidden_size, self.adapter.num_experts + 1,
                                                         self.dtype, torch.device(self.device))
        flags = torch.zeros(flag_count(self.adapter.num_layers), dtype=torch.int32, device=self.device)
        try:
            if self._flags is None:
                self._flags = gpu_flags.Flags(torch.device(self.device))
            answer = self.io.run(self._client(address).attach_device(buffers.request(self.config.model, flags),
                                                                     timeout=self.config.call_timeout),
                                 timeout=self.config.call_timeout + 1)
            link = self._links[address] = ClientLink(folder, answer, flags)
        except (grpc.aio.AioRpcError, LinkError, RuntimeError, TimeoutError) as e:
            why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
            log.info("no device link to %s (%s): its layers go as calls", address, why)
            self._link_retry[address] = time.monotonic() + LINK_RETRY_SECONDS
            return None
        log.info("device link to %s: %d rows", address, buffers.rows.shape[0])
        return link

    def _unlink(self, address: str, error: Exception | str | None) -> None:
        link = self._links.pop(address, None)
        if link is not None:
            link.close()
            self.generation += 1  # programs that run through it are captured again
        if error is not None:
            log.warning("device link to %s broke (%s): its layers go as calls", address, error)
            self._link_retry[address] = time.monotonic() + LINK_RETRY_SECONDS

    def _count_captured(self, recorder: Recorder, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> None:
        """Count and observe a captured layer in the program itself, over its real rows (a device scalar
        each replay sets): after the replay, counting op by op on the real rows cost about 6 ms a step at
        48 layers (H200)."""
        self.tally.add_rows(layer, top_k_index, recorder.real_rows(hidden.device))
        self._observe_captured(recorder, layer, hidden, top_k_index, top_k_weights)

    def _observe_captured(self, recorder: Recorder, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> None:
        """Observers with device work to capture (`observe_rows`) capture it over the real rows and return
        their host part to run after each replay; the others see the real rows then."""
        rows = recorder.real_rows(hidden.device)
        for observer in list(self.observers):
            capture = getattr(observer, "observe_rows", None)
            if capture is None:
                recorder.after(functools.partial(self._observe_real_rows, observer, layer, hidden, top_k_index,
                                                 top_k_weights))
                continue
            host_part = self._observe_one(observer, layer, capture, layer, hidden, top_k_index, rows)
            if host_part is not None:
                recorder.after(functools.partial(self._observe_one, observer, layer, host_part))

    def _observe_real_rows(self, observer, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, real: int) -> None:
        self._observe_one(observer, layer, observer.on_layer, layer, hidden[:real], top_k_index[:real],
                          top_k_weights[:real])

    def _gather(self, calls: concurrent.futures.Future, y: torch.Tensor) -> None:
        """Wait for the remote calls and put each reply not already in place (`_call`) at its rows of y."""
        failed: list[DispatchError] = []
        for results in calls.result():
            if isinstance(results, DispatchError):  # the others still came back: only the rows without experts fail
                failed.append(results)
                continue
            if isinstance(results, BaseException):  # a cancellation or a bug: as it is
                raise results
            for call, reply in results:
                if reply is None:
                    continue
                offset = 0
                for a, b in call.spans:
                    y[a:b] = reply[offset:offset + b - a]
                    offset += b - a
        if failed:  # name the tokens that went without their experts: their requests fail, the others' need not
            raise DispatchError("; ".join(map(str, failed)), sorted({r for e in failed for r in e.rows or ()}))

    def _observe(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        for observer in list(self.observers):
            self._observe_one(observer, layer, observer.on_layer, layer, hidden, top_k_index, top_k_weights)

    def _observe_one(self, observer, layer: int, fn, *args):
        """fn(*args) for `observer`, which is switched off if it fails (or was before: a captured pass
        keeps calling its host part) -> what fn returned, None if it failed or is off."""
        if observer not in self.observers:
            return None
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - observing must never fail a request
            log.exception("%s failed at layer %d and is switched off; serving goes on without it",
                          type(observer).__name__, layer)
            self.observers.remove(observer)
            return None

    def _predicted(self, layer: int) -> Sequence[int] | None:
        if self.predictions is None:
            return None
        try:
            return self.predictions.predicted_counts(layer)
        except Exception:  # noqa: BLE001 - a prediction is a hint: the step's own token counts do without it
            log.exception("predicted loads of layer %d unavailable; splitting by this step's tokens", layer)
            return None

    def _usable(self, route: BundleRoute, layer: int, expert: int, now: float) -> Sequence[str]:
        """The expert's replicas that neither failed nor said they lack it just now (all, if none is left)."""
        lacking = self._lacking
        usable = [a for a in route.addresses if self._replicas[a].failed_until <= now
                  and (not lacking or lacking.get((a, layer, expert), 0.0) <= now)]
        return usable or route.addresses

    def _submit(self, layer: int, remote: dict[int, BundleRoute], pairs: SortedPairs,
                spans: Sequence[tuple[int, int]], y: torch.Tensor) -> concurrent.futures.Future:
        """The layer's remote experts as one call per address, started together -> a future of each call's
        [(call, reply [N, H] or None where it went straight into y)] or its exception, in call order."""
        now = time.monotonic()
        experts = list(remote)
        candidates = [self._usable(remote[e], layer, e, now) for e in experts]
        # Read only where an expert has several replicas to split across: reading it waits for the GPU.
        predicted = self._predicted(layer) if any(len(c) > 1 for c in candidates) else None
        plan = plan_calls(experts, [spans[e][1] - spans[e][0] for e in experts], candidates,
                          {a: self._replicas[a].inflight_tokens for c in candidates for a in c}, predicted,
                          self.config.split_min_tokens,
                          [remote[e].bundle for e in experts] if self.config.calls_per_bundle else None)
        # Ids are unique per call in flight on a client: every call of the layer gets its own.
        request_id = f"{uuid.uuid4().hex[:8]}-{next(self._ids)}"
        calls = [self._call(layer, remote, _Call(pieces, [(spans[p.expert][0] + p.start,
                                                             spans[p.expert][0] + p.start + p.count) for p in pieces],
                                                  pairs), address, f"{request_id}.{n}", y)
                 for n, ((address, _), pieces) in enumerate(plan.items())]
        # One hand-over to the I/O loop for the layer: each wakes its thread (a write, a context switch).
        return self.io.submit(_together(calls))

    async def _call(self, layer: int, routes: dict[int, BundleRoute], call: _Call, address: str, request_id: str,
                    y: torch.Tensor, attempt: int = 0, tried: frozenset[tuple[str, int]] = frozenset(),
                    errors: tuple[str, ...] = ()) -> list[tuple[_Call, torch.Tensor | None]]:
        """Run `call` at `address`, its reply straight into its rows of `y` when they are one run; on a
        failure put the replica (or only its lacking experts) aside and retry the pieces on the shortest
        queues among the others -> [(call, its reply, None when it is in y already)]."""
        replica = self._replicas[address]
        replica.picks += 1
        if self.metrics:
            self.metrics.expert_calls.inc()
            self.metrics.expert_parts.inc(len(call.pieces))
        tokens = sum(p.count for p in call.pieces)
        replica.inflight_tokens += tokens
        run = call.run
        try:
            reply, timing = await self._client(address).call(
                layer, [p.expert for p in call.pieces], [p.count for p in call.pieces], call.x, request_id=request_id,
                timeout=self.config.call_timeout, out=None if run is None else y[run[0]:run[1]])
            if self.metrics:
                self.metrics.expert_busy_seconds.inc(len(call.pieces) * timing.total_seconds)
            return [(call, None if run is not None else reply)]
        except grpc.aio.AioRpcError as e:
            error = e
        finally:
            replica.inflight_tokens -= tokens
        bundles = ", ".join(sorted({routes[p.expert].bundle for p in call.pieces}))
        rows = call.tokens()
        if error.code() in NOT_RETRYABLE:
            raise DispatchError(f"bundle {bundles} at {address} refused layer {layer}: {error.details()}", rows) from error
        lacking = self._sideline(address, layer, [p.expert for p in call.pieces], error)
        errors += (f"{address}: {error.code().name} {error.details()}",)
        tried |= {(address, e) for e in (lacking or {p.expert for p in call.pieces})}
        if self.metrics:
            for bundle in {routes[p.expert].bundle for p in call.pieces}:
                self.metrics.expert_retries.labels(bundle=bundle).inc()
        log.warning("bundle %s replica %s failed (%s%s); retrying", bundles, address, error.code().name,
                    f" for experts {sorted(lacking)} of layer {layer}" if lacking else "")
        # Every replica the table names gets its try, however many: replicas added in place are named before
        # their weights are in, and answer that they lack the expert meanwhile.
        attempts = max(self.config.max_attempts, max(len(routes[p.expert].addresses) for p in call.pieces))
        if attempt + 1 >= attempts:
            raise DispatchError(f"bundle {bundles}: no replica could run layer {layer} after "
                                f"{attempts} attempts: {'; '.join(errors)}", rows)
        if any(all((a, p.expert) in tried for a in routes[p.expert].addresses) for p in call.pieces):
            tried = frozenset()  # every replica of an expert failed once: back off before going round again
            await asyncio.sleep(0.05 * 2**attempt)
        # Each piece to the shortest queue among its expert's replicas it has not tried; those that
        # land on one address go together.
        now, again = time.monotonic(), dict[str, list[int]]()
        for i, p in enumerate(call.pieces):
            replicas = [self._replicas[a] for a in routes[p.expert].addresses]
            lacks = [a for a in routes[p.expert].addresses if self._lacking.get((a, layer, p.expert), 0.0) > now]
            chosen = pick_replica(replicas, {a for a, e in tried if e == p.expert}, now, lacks)
            again.setdefault(chosen.address, []).append(i)
        results = await asyncio.gather(*(
            self._call(layer, routes, call.subset(indices), target, f"{request_id}.{attempt + 1}.{n}", y, attempt + 1,
                       tried, errors)
            for n, (target, indices) in enumerate(again.items())), return_exceptions=True)
        for result in results:  # a cancellation or a bug: as it is
            if isinstance(result, BaseException) and not isinstance(result, DispatchError):
                raise result
        failed = [r for r in results if isinstance(r, DispatchError)]
        if failed:
            raise DispatchError("; ".join(map(str, failed)), sorted({r for e in failed for r in e.rows or ()}))
        return [part for result in results if not isinstance(result, BaseException) for part in result]

    def _sideline(self, address: str, layer: int, experts: Sequence[int], error: grpc.aio.AioRpcError) -> set[int]:
        """Put aside, for the cooldown, what the error says is wrong -> the experts put aside alone (empty:
        the whole replica). A function that says it lacks some experts (not held, loading in place) is
        up: only those (address, expert) pairs; NOT_FOUND that names none (an older server) means all
        the call's experts. Anything else (UNAVAILABLE, a timeout, a broken stream): the replica."""
        until = time.monotonic() + self.config.cooldown
        lacking = {e for l, e in lacking_of(error) if l == layer}
        if not lacking and error.code() == grpc.StatusCode.NOT_FOUND:
            lacking = set(experts)
        if not lacking:
            self._replicas[address].failed_until = until
            return lacking
        now = until - self.config.cooldown
        for key in [k for k, t in self._lacking.items() if t <= now]:  # forget the expired: the dict stays small
            del self._lacking[key]
        for expert in lacking:
            self._lacking[(address, layer, expert)] = until
        return lacking

    def _client(self, address: str) -> ExpertClient:
        client = self._clients.get(address)
        if client is None:
            from kubemoe.expert_fn.client import ExpertClient

            client = self._clients[address] = ExpertClient(address, model=self.config.model, streaming=self.config.streaming,
                                                           shm_dir=self.config.shm_dir)
        return client

    def close(self) -> None:
        for address in list(self._links):
            self._unlink(address, None)
        for client in self._clients.values():
            self.io.run(client.close(), timeout=5)
        self._clients.clear()
        self.io.stop()


async def _together(calls: list) -> list:
    return await asyncio.gather(*calls, return_exceptions=True)


class _LayerExperts(torch.nn.Module):
    """Stands in for a layer's routed experts module inside the transformers model."""

    def __init__(self, dispatcher: Dispatcher, layer: int):
        super().__init__()
        self.dispatcher, self.layer = dispatcher, layer

    # A compiled decode pass (compiled.py) breaks its graph here: the dispatcher reads the thread's CUDA-graph
    # recorder, calls expert functions and counts loads on the host, none of which a graph can hold.
    @torch.compiler.disable
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.dispatcher.run_layer(self.layer, hidden_states, top_k_index, top_k_weights)
