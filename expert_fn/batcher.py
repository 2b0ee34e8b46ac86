"""Micro-batching: requests for the same (layer, expert) from different calls run as ONE matrix product.

A frontend sends each bundle endpoint one request per layer and step; several frontends (and the
layers of several sequences) reach one expert function at once. Their tokens for one expert are
concatenated, run through the expert once (one read of its weights: what bounds a small-batch
expert on a GPU), and split back.

When to run a batch (the same policy as Triton's dynamic batcher, plus a bounded wait):
- compute runs one round at a time, on the event loop; requests that arrive meanwhile join the next;
- an isolated request (nothing pending, no other call in progress when it arrived) runs at once, in
  its caller's task: waiting could only add latency (a single frontend calling layer after layer
  never waits, nor hops to the dispatcher);
- once arrivals overlap (a request arrived while others were pending or running), the next round
  waits up to `wait_s` from its oldest request's arrival for more to join, or until `max_tokens`.

Shapes: T = tokens of one request, H = hidden size, N = tokens of one expert in a round.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from kubemoe.bundles import ExpertKey
from kubemoe.expert import ExpertWeights, expert_ffn
from kubemoe.expert_fn.errors import ExpertFnError
from kubemoe.expert_fn.shm import copy_into


@dataclass(eq=False)
class Job:
    """One request's tokens: rows of `x` grouped by expert, group after group."""

    x: torch.Tensor  # [T, H] as decoded from the request (CPU, request dtype, read-only)
    groups: list[tuple[ExpertKey, int]]  # (key, tokens) per group, in row order
    out_buffer: torch.Tensor | None = None  # [T, H] where the reply goes (a shared-memory region); None: new
    arrived: float = field(default_factory=time.perf_counter)
    # Set by the round that runs it:
    out: torch.Tensor | None = None  # [T, H], CPU, request dtype
    error: Exception | None = None
    queue_seconds: float = 0.0
    compute_seconds: float = 0.0
    done: asyncio.Future | None = None

    @property
    def tokens(self) -> int:
        return self.x.shape[0]


class Part(NamedTuple):
    job: int  # index into the round's jobs
    group: int  # index into that job's groups
    start: int  # first row in the job's x
    tokens: int


def plan_round(jobs: list[Job]) -> dict[ExpertKey, list[Part]]:
    """Which rows of which jobs each expert runs on, in arrival order: one FFN call per key."""
    plan: dict[ExpertKey, list[Part]] = {}
    for j, job in enumerate(jobs):
        start = 0
        for g, (key, tokens) in enumerate(job.groups):
            plan.setdefault(key, []).append(Part(j, g, start, tokens))
            start += tokens
    return plan


class _ComputeClock:
    """Times a round's FFNs: CUDA events on a GPU, so the copies, kernels and copies back queue up
    without a synchronisation in between (one at the end); the wall clock on a CPU. One per device,
    reused round after round (rounds run one at a time)."""

    def __init__(self, device: torch.device):
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if device.type == "cuda" else None
        self._start = self._stop = 0.0

    def start(self) -> None:
        if self._events is None:
            self._start = time.perf_counter()
        else:
            self._events[0].record()

    def stop(self) -> None:
        if self._events is None:
            self._stop = time.perf_counter()
        else:
            self._events[1].record()

    def seconds(self) -> float:
        """After stop(); on a GPU this waits for all the round's work, copies back included."""
        if self._events is None:
            return self._stop - self._start
        torch.cuda.synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3


_clock = functools.cache(_ComputeClock)


def run_round(
    jobs: list[Job],
    weights_of: Callable[[ExpertKey], ExpertWeights],
    act: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[ExpertKey, int]:
    """Run every job's groups, one FFN per expert; fills job.out / job.error. Returns tokens per key.

    On a CPU, a job whose input lies in its reply's region (shared memory, already in `dtype`)
    gets each group's output written straight into that group's rows: the input rows of a group
    are read by its own expert only, before its output exists. No copy of the reply is left.

    Every step here is on the request's path, where a Python or torch call costs 10-30 us on a
    CPU whose caches the FFN just flushed: hence no inference_mode (neither weights nor requests
    carry autograd history), a clock made once, and no slicing of a group that is the whole job.
    """
    clock = _clock(device)
    inputs = [job.x if job.x.device == device and job.x.dtype == dtype else
              job.x.to(device=device, dtype=dtype, non_blocking=True) for job in jobs]
    in_place = [job.out_buffer is not None and x is job.x for job, x in zip(jobs, inputs)]  # on a GPU x is a copy
    plan = plan_round(jobs)
    pieces: list[list[torch.Tensor | None]] = [[None] * len(job.groups) for job in jobs]
    clock.start()
    for key, parts in plan.items():
        try:
            weights = weights_of(key)  # an Unload may have raced the request's check
        except ExpertFnError as e:
            for part in parts:
                jobs[part.job].error = e
            continue
        if len(parts) == 1:
            part = parts[0]
            x = inputs[part.job]
            rows = x if len(jobs[part.job].groups) == 1 else x[part.start:part.start + part.tokens]
            split = (expert_ffn(rows, weights, act, out=rows if in_place[part.job] else None),)
        else:
            rows = [inputs[p.job][p.start:p.start + p.tokens] for p in parts]
            y = expert_ffn(torch.cat(rows), weights, act)  # [N, H]
            split = y.split([p.tokens for p in parts])  # split costs ~15 us
            for part, piece, target in zip(parts, split, rows):
                if in_place[part.job]:
                    copy_into(target, piece)
        for part, piece in zip(parts, split):
            pieces[part.job][part.group] = piece
    clock.stop()
    for job, job_pieces, x, direct in zip(jobs, pieces, inputs, in_place):
        if job.error is not None:
            continue
        if direct:
            job.out = job.out_buffer  # every group's rows hold its output already
            continue
        out = x if not job_pieces else job_pieces[0] if len(job_pieces) == 1 else torch.cat(job_pieces)
        if job.out_buffer is None:
            job.out = out.to(device="cpu", dtype=job.x.dtype)  # [T, H]; no copy on CPU in dtype
        else:  # over the request's own region: every input of the round has been read by now
            job.out = copy_into(job.out_buffer, out, non_blocking=True)  # a DMA when pinned; waited for below
    compute = clock.seconds()
    for job in jobs:
        job.compute_seconds = compute
    return {key: sum(p.tokens for p in parts) for key, parts in plan.items()}


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
        if self._dispatcher is None:
            self._wakeup = asyncio.Event()
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch())
        self._wakeup.set()
        await job.done
        return job

    async def _dispatch(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._pending:
                continue
            if self._wait_s > 0:  # arrivals overlap (else submit() ran the job): more may come
                await self._gather_more()
            jobs, self._pending, self._pending_tokens = self._pending, [], 0
            self._run_jobs(jobs)
            for job in jobs:
                if not job.done.done():
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

    async def _gather_more(self) -> None:
        deadline = self._pending[0].arrived + self._wait_s
        while self._pending_tokens < self._max_tokens and (left := deadline - time.perf_counter()) > 0:
            try:
                await asyncio.wait_for(self._wakeup.wait(), left)
            except TimeoutError:
                return
            self._wakeup.clear()

    async def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)
            self._dispatcher = None
