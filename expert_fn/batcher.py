"""Micro-batching: requests for the same (layer, expert) from different calls run as ONE FFN call,
and a round's experts of one layer as ONE grouped computation where the store stacks them.

A frontend sends each expert function one request per layer and step; several frontends (and the
layers of several sequences) reach one expert function at once. Their tokens for one expert are
concatenated, run through the expert once (one read of its weights: what bounds a small-batch
expert on a GPU), and split back. Where the store holds a layer's experts as one stack (store.py)
and a round has enough of them (the servicer's `group_min_experts`), their rows are gathered in the
stack's order and run through moe.sorted_ffn: two grouped GEMMs for the layer instead of an FFN (or
a graph launch) per expert, each of which cost 10-30 us of host time on the H200 host. A function
holding 32 of Qwen3-30B-A3B's 128 experts of a layer gets ~32 of them per call at batch 32: one FFN
per expert, a layer took 24 ms for 4 functions at 32 tokens; grouped, 8.8 ms
(benchmarks/results/dispatch_calls_h200.json). Fewer experts of a layer still run one by one (their
graphs, graphs.py): 2 Mixtral-size experts grouped took longer than their 2 graphs.

When to run a batch (the same policy as Triton's dynamic batcher, plus a bounded wait):
- compute runs one round at a time, on the event loop; requests that arrive meanwhile join the next;
- an isolated request (nothing pending, no other call in progress when it arrived) runs at once, in
  its caller's task: waiting could only add latency (a single frontend calling layer after layer
  never waits, nor hops to the dispatcher);
- once arrivals overlap (a request arrived while others were pending or running), the next round
  waits up to `wait_s` from its oldest request's arrival for more to join, or until `max_tokens`.

Shapes: T = tokens of one request, H = hidden size, N = tokens of one expert in a round, S = rows of
a grouped layer in a round, E = experts of a layer's stack.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from kubemoe.bundles import ExpertKey
from kubemoe.expert import ExpertWeights, expert_ffn
from kubemoe.expert_fn.errors import ExpertFnError
from kubemoe.expert_fn.graphs import ExpertGraphs
from kubemoe.expert_fn.round_graph import RoundGraph
from kubemoe.expert_fn.shm import copy_into
from kubemoe.expert_fn.store import LayerStack
from kubemoe.moe import StackedExperts, sorted_ffn, upload_ends


@dataclass(eq=False)
class Job:
    """One request's tokens: rows of `x` grouped by expert, group after group."""

    x: torch.Tensor  # [T, H] as decoded from the request (CPU, request dtype, read-only)
    groups: list[tuple[ExpertKey, int]]  # (key, tokens) per group, in row order
    out_buffer: torch.Tensor | None = None  # [T, H] where the reply goes (a shared-memory region); None: new
    pinned: bool = False  # x and out_buffer are that region, registered with CUDA: copies to and from it are DMAs
    arrived: float = field(default_factory=time.perf_counter)
    # Set by the round that runs it:
    out: torch.Tensor | None = None  # [T, H], CPU, request dtype
    error: Exception | None = None
    queue_seconds: float = 0.0
    compute_seconds: float = 0.0
    done: asyncio.Future | None = None

    def __post_init__(self) -> None:
        if self.pinned and self.out_buffer is None:
            raise ValueError("a pinned job replies into its registered region: give it as out_buffer")

    @property
    def tokens(self) -> int:
        return self.x.shape[0]


class Part(NamedTuple):
    """Rows of one job: one of its groups, or (in a grouped layer) adjacent groups of it."""

    job: int  # index into the round's jobs
    start: int  # first row in the job's x
    tokens: int


def plan_round(jobs: list[Job]) -> dict[ExpertKey, list[Part]]:
    """Which rows of which jobs each expert runs on, in arrival order: one FFN call per key."""
    plan: dict[ExpertKey, list[Part]] = {}
    for j, job in enumerate(jobs):
        start = 0
        for key, tokens in job.groups:
            plan.setdefault(key, []).append(Part(j, start, tokens))
            start += tokens
    return plan


class GroupedLayer(NamedTuple):
    """Experts of one layer in a round, run as one sorted_ffn over the stack that holds them."""

    experts: StackedExperts
    parts: list[Part]  # their rows in the stack's expert order, a job's adjacent rows as one part
    ends: list[int]  # [E] end row, in the parts' rows one after another, of each expert of the stack


def group_round(plan: dict[ExpertKey, list[Part]], stacks: dict[int, LayerStack],
                min_grouped: int = 2) -> tuple[list[GroupedLayer], dict[ExpertKey, list[Part]]]:
    """Split a round's plan: the experts of a layer that `stacks` holds, `min_grouped` or more, as one
    GroupedLayer; the others (too few of their layer, one of a layer without a stack, one its stack
    lacks) one FFN each."""
    stacked: dict[int, list[ExpertKey]] = {}
    for key in plan:
        stack = stacks.get(key[0])
        if stack is not None and key[1] in stack.local:
            stacked.setdefault(key[0], []).append(key)
    grouped, alone = [], dict(plan)
    for layer, keys in stacked.items():
        if len(keys) < max(2, min_grouped):
            continue
        stack = stacks[layer]
        counts = [0] * stack.experts.num_experts  # [E]; an expert not in this round has no rows
        parts: list[Part] = []
        for local, key in sorted((stack.local[key[1]], key) for key in keys):
            counts[local] = sum(part.tokens for part in plan[key])
            for part in alone.pop(key):
                last = parts[-1] if parts else None
                if last is not None and last.job == part.job and last.start + last.tokens == part.start:
                    parts[-1] = Part(part.job, last.start, last.tokens + part.tokens)  # one slice, one copy back
                else:
                    parts.append(part)
        grouped.append(GroupedLayer(stack.experts, parts, list(itertools.accumulate(counts))))
    return grouped, alone


class ComputeClock:
    """Times a round's FFNs. On a GPU with CUDA events around each expert's (or grouped layer's)
    kernels, so copies and kernels queue up without a synchronisation in between (one, at the end,
    of the serving stream alone: a Load's copies on its own stream are no round's business), or
    with the events of the round graphs it `include`s; on a CPU with the wall clock. One per
    device, reused round after round (rounds run one at a time, on the device's current stream)."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.current_stream(device) if self._cuda else None
        self._events: list[torch.cuda.Event] = []  # start, stop, start, stop... of this round; grown, reused
        self._recorded = 0
        self._graphs: list[RoundGraph] = []  # launched in this round
        self._started = self._seconds = 0.0

    def start(self) -> None:
        if self._cuda:
            self._record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self._cuda:
            self._record()
        else:
            self._seconds += time.perf_counter() - self._started

    def include(self, graph: RoundGraph) -> None:
        """Count the FFN time of `graph`'s launch in this round."""
        self._graphs.append(graph)

    def _record(self) -> None:
        if self._recorded == len(self._events):
            self._events.append(torch.cuda.Event(enable_timing=True))
        self._events[self._recorded].record()
        self._recorded += 1

    def seconds(self) -> float:
        """The round's time between starts and stops, and a fresh start for the next round. On a GPU
        this waits for all the round's work, copies back included, and for nothing else."""
        if self._stream is not None:
            self._stream.synchronize()
            events = self._events[:self._recorded]
            self._seconds = sum(a.elapsed_time(b) for a, b in zip(events[::2], events[1::2])) / 1e3
            self._seconds += sum(graph.seconds() for graph in self._graphs)
            self._recorded = 0
            self._graphs.clear()
        seconds, self._seconds = self._seconds, 0.0
        return seconds


_clock = functools.cache(ComputeClock)
CPU = torch.device("cpu")


def run_round(
    jobs: list[Job],
    weights_of: Callable[[ExpertKey], ExpertWeights],
    act: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    graphs: ExpertGraphs | None = None,
    stack_of: Callable[[int], LayerStack | None] | None = None,
    min_grouped: int = 2,
) -> dict[ExpertKey, int]:
    """Run every job's groups: the experts of a layer that `stack_of(layer)` holds (store.stack), at least
    `min_grouped` of them, as one grouped computation, any other expert as one FFN; fills job.out /
    job.error. Returns tokens per key.

    Every step here is on the request's path, where a Python or torch call costs 10-30 us on a
    core whose caches the FFN just flushed: hence no inference_mode (neither weights nor requests
    carry autograd history), a clock made once, and no slicing of rows that are the whole job.
    """
    plan = plan_round(jobs)
    clock = _clock(device)
    # Each layer's stack read once: a Load or Unload meanwhile makes a new one, and this round keeps the old
    stacks = {} if stack_of is None else {
        layer: stack for layer in {layer for layer, _ in plan} if (stack := stack_of(layer)) is not None}
    grouped, alone = group_round(plan, stacks, min_grouped)
    experts = _experts(alone, jobs, weights_of)
    if device.type == "cpu":
        _cpu_round(jobs, grouped, experts, act, dtype, clock)
    else:
        _device_round(jobs, grouped, experts, act, device, dtype, clock, graphs)
    compute = clock.seconds()
    for job in jobs:
        job.compute_seconds = compute
    return {key: sum(p.tokens for p in parts) for key, parts in plan.items()}


def _experts(plan: dict[ExpertKey, list[Part]], jobs: list[Job], weights_of: Callable[[ExpertKey], ExpertWeights]):
    """(key, parts, weights) of each expert in the plan; the jobs of one gone missing get its error."""
    for key, parts in plan.items():
        try:
            weights = weights_of(key)  # an Unload may have raced the request's check
        except ExpertFnError as e:
            for part in parts:
                jobs[part.job].error = e
            continue
        yield key, parts, weights


def _rows(x: torch.Tensor, job: Job, part: Part) -> torch.Tensor:
    """The rows of `x` (a job's input or output) that `part` covers."""
    return x if part.tokens == job.tokens else x[part.start:part.start + part.tokens]


def _gather(inputs: list[torch.Tensor], jobs: list[Job], parts: list[Part]) -> torch.Tensor:  # [N, H]
    """The parts' rows of the jobs' `inputs`, one part after another."""
    rows = [_rows(inputs[p.job], jobs[p.job], p) for p in parts]
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _scatter(y: torch.Tensor, jobs: list[Job], outs: list[torch.Tensor], parts: list[Part],
             non_blocking: bool = False) -> None:
    """y [N, H], the parts' outputs one after another, into each part's rows of its job's output."""
    for part, piece in zip(parts, (y,) if len(parts) == 1 else y.split([p.tokens for p in parts])):  # split: ~15 us
        copy_into(_rows(outs[part.job], jobs[part.job], part), piece, non_blocking=non_blocking)


def _cpu_round(jobs: list[Job], grouped: list[GroupedLayer], experts, act, dtype: torch.dtype,
               clock: ComputeClock) -> None:
    """Each expert's (or grouped layer's) output goes into its rows of its job's output. A job whose
    reply has a region (shared memory) in `dtype` gets it written there, even where the region is
    its input: the input rows of a group are read by its own expert only, before its output exists."""
    inputs = [job.x if job.x.dtype == dtype else job.x.to(dtype) for job in jobs]
    outs = [job.out_buffer if job.out_buffer is not None and job.out_buffer.dtype == dtype else torch.empty_like(x)
            for job, x in zip(jobs, inputs)]
    clock.start()
    for layer in grouped:
        _scatter(sorted_ffn(_gather(inputs, jobs, layer.parts), upload_ends(layer.ends, CPU), layer.experts, act),
                 jobs, outs, layer.parts)
    for key, parts, weights in experts:
        if len(parts) == 1:  # no copy: expert_ffn writes its output rows itself (reading its input first)
            part, job = parts[0], jobs[parts[0].job]
            expert_ffn(_rows(inputs[part.job], job, part), weights, act, out=_rows(outs[part.job], job, part))
        else:
            _scatter(expert_ffn(_gather(inputs, jobs, parts), weights, act), jobs, outs, parts)
    clock.stop()
    for job, out in zip(jobs, outs):
        if job.error is not None:
            continue
        if out is job.out_buffer:
            job.out = out  # every group's rows hold its output already
        else:
            job.out = out.to(job.x.dtype) if job.out_buffer is None else copy_into(job.out_buffer, out)  # casts


def _device_round(jobs: list[Job], grouped: list[GroupedLayer], experts, act, device: torch.device,
                  dtype: torch.dtype, clock: ComputeClock, graphs: ExpertGraphs | None) -> None:
    """A grouped layer: its rows gathered on the device, one sorted_ffn, its output copied out to
    each job's reply. Any other expert: its rows copied in, its FFN (a CUDA graph when `graphs` has
    one for its size), its output copied out. A pinned job's rows go straight from and to its
    region, each a DMA (a job of a grouped layer: copied in whole, once); any other job is copied to
    the device and back once, whole (from pageable memory every copy is a synchronous, staged one).
    An expert whose rows all come from one pinned job is one graph launch, copies included
    (graphs.run_pinned). Nothing waits for the GPU here: the caller's clock.seconds() does, once."""
    whole = {part.job for layer in grouped for part in layer.parts}
    inputs = [job.x if job.pinned and j not in whole else job.x.to(device=device, dtype=dtype, non_blocking=True)
              for j, job in enumerate(jobs)]
    outs = [job.out_buffer if job.pinned and job.out_buffer is not None  # a pinned job always has one (Job checks)
            else torch.empty(job.x.shape, device=device, dtype=dtype) for job in jobs]
    for layer in grouped:
        x, ends = _gather(inputs, jobs, layer.parts), upload_ends(layer.ends, device)
        clock.start()
        y = sorted_ffn(x, ends, layer.experts, act)  # [S, H]
        clock.stop()
        _scatter(y, jobs, outs, layer.parts, non_blocking=True)
    for key, parts, weights in experts:
        if graphs is not None and len(parts) == 1 and jobs[parts[0].job].pinned:
            job, part = jobs[parts[0].job], parts[0]
            if graphs.run_pinned(key, weights, _rows(job.x, job, part), _rows(job.out_buffer, job, part), clock):
                continue
        rows = [_rows(inputs[p.job], jobs[p.job], p) for p in parts]
        y = graphs.run(key, weights, rows, clock) if graphs is not None else None
        if y is None:
            on_device = [r.to(device=device, dtype=dtype, non_blocking=True) for r in rows]
            x = on_device[0] if len(on_device) == 1 else torch.cat(on_device)
            clock.start()
            y = expert_ffn(x, weights, act)  # [N, H]
            clock.stop()
        _scatter(y, jobs, outs, parts, non_blocking=True)
    for job, out in zip(jobs, outs):
        if job.error is not None:
            continue
        if job.pinned:
            job.out = job.out_buffer  # each expert's rows went there
        elif job.out_buffer is not None:
            job.out = copy_into(job.out_buffer, out)  # one staged copy into the region (casts if need be)
        else:
            job.out = out.to(device="cpu", dtype=job.x.dtype)


class MicroBatcher:
    """Queues jobs and runs them in rounds, one at a time, on the event loop.

    On the loop, not on a compute thread: the hop to a thread and back costs 130-340 us of wake-ups
    (measured on a 2-core CPU), more than a whole GPU round. Requests that arrive while a round
    blocks the loop wait in gRPC's buffers; right after the round they are read and, being
    pending together, join the next round. Nothing is pending when a round ends, so its callers
    send their replies before the dispatcher can start another.
    """

    def __init__(self, run: Callable[[list[Job]], None], *, wait_s: float, max_tokens: int):
        self._run, self._wait_s, self._max_tokens = run, wait_s, max_tokens
        self._pending: list[Job] = []
        self._pending_tokens = 0
        self._wakeup: asyncio.Event | None = None
        self._dispatcher: asyncio.Task | None = None
        self.rounds = 0

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def idle(self) -> bool:
        """Nothing pending (and so nothing running: rounds run on the loop, which runs the caller)."""
        return not self._pending

    def run_now(self, job: Job) -> Job:
        """Run `job` alone in this call, when the caller knows no other request came with it (see idle)."""
        self._run_jobs([job])
        return job

    async def submit(self, job: Job, *, concurrent: bool = False) -> Job:
        """Run `job` in a round; returns it with `out` or `error` set.

        `concurrent`: the caller knows of other calls in progress (the servicer counts them), so
        more requests are likely to come: a round just run leaves no pending work to see that by.
        """
        job.done = asyncio.get_running_loop().create_future()
        self._pending.append(job)
        self._pending_tokens += job.tokens
        if len(self._pending) == 1 and not concurrent:
            await asyncio.sleep(0)  # requests read in the same breath reach submit() meanwhile
            if self._pending == [job]:  # still alone: run it now, in this task (no hop to the dispatcher)
                self._pending, self._pending_tokens = [], 0
                self._run_jobs([job])
                return job
        if self._dispatcher is None or self._wakeup is None:  # made together, with the first round to dispatch
            self._wakeup = asyncio.Event()
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch(self._wakeup))
        self._wakeup.set()
        await job.done
        return job

    async def _dispatch(self, wakeup: asyncio.Event) -> None:
        while True:
            await wakeup.wait()
            wakeup.clear()
            if not self._pending:
                continue
            if self._wait_s > 0:  # arrivals overlap (else submit() ran the job): more may come
                await self._gather_more(wakeup)
            jobs, self._pending, self._pending_tokens = self._pending, [], 0
            self._run_jobs(jobs)
            for job in jobs:
                if job.done is not None and not job.done.done():  # submit() gave every pending job its future
                    job.done.set_result(None)

    def _run_jobs(self, jobs: list[Job]) -> None:
        started = time.perf_counter()
        for job in jobs:
            job.queue_seconds = started - job.arrived
        try:
            self._run(jobs)
        except Exception as e:  # a bug, not a bad request: fail these jobs, keep serving
            for job in jobs:
                job.error = job.error or e
        self.rounds += 1

    async def _gather_more(self, wakeup: asyncio.Event) -> None:
        deadline = self._pending[0].arrived + self._wait_s
        while self._pending_tokens < self._max_tokens and (left := deadline - time.perf_counter()) > 0:
            try:
                await asyncio.wait_for(wakeup.wait(), left)
            except TimeoutError:
                return
            wakeup.clear()

    async def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)
            self._dispatcher = None
