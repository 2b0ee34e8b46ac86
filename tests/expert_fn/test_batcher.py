"""Micro-batching without a server: round planning, merged compute, and when rounds run."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
import torch.nn.functional as F

from kubemoe.expert import ExpertWeights, expert_ffn
from kubemoe.expert_fn.batcher import Job, MicroBatcher, Part, plan_round, run_round
from kubemoe.expert_fn.errors import ExpertFnError
from kubemoe.verify import rel_err

H, I = 16, 8
CPU = torch.device("cpu")


def make_job(*groups: tuple[int, int], dtype=torch.float32) -> Job:
    """A job over layer 0: groups as (expert, tokens)."""
    x = torch.randn(sum(t for _, t in groups), H).to(dtype)
    return Job(x, [((0, e), t) for e, t in groups])


def make_weights(n: int) -> dict[tuple[int, int], ExpertWeights]:
    gen = torch.Generator().manual_seed(0)
    return {(0, e): ExpertWeights(torch.randn(2 * I, H, generator=gen), torch.randn(H, I, generator=gen)) for e in range(n)}


def test_plan_groups_parts_of_all_jobs_by_expert():
    jobs = [make_job((1, 2), (3, 1)), make_job((3, 4)), make_job((1, 0), (2, 5))]
    assert plan_round(jobs) == {
        (0, 1): [Part(0, 0, 0, 2), Part(2, 0, 0, 0)],
        (0, 3): [Part(0, 1, 2, 1), Part(1, 0, 0, 4)],
        (0, 2): [Part(2, 1, 0, 5)],
    }


def test_round_runs_each_expert_once_and_matches_separate_calls():
    weights = make_weights(4)
    jobs = [make_job((1, 2), (3, 1)), make_job((3, 4)), make_job((1, 0), (2, 5)), make_job()]
    tokens = run_round(jobs, weights.__getitem__, F.silu, CPU, torch.float32)
    assert tokens == {(0, 1): 2, (0, 3): 5, (0, 2): 5}
    for job in jobs:
        rows = job.x.split([t for _, t in job.groups])
        want = torch.cat([expert_ffn(r, weights[k], F.silu) for (k, _), r in zip(job.groups, rows)]) if rows else job.x
        assert job.error is None and job.out.shape == job.x.shape
        # One matmul over the merged rows may sum in another order than separate ones (the BLAS blocks
        # by row count, and by thread count under load): equal within float32 rounding, not bit for bit.
        assert job.out.numel() == 0 or rel_err(job.out, want) < 1e-5


def test_round_answers_in_the_request_dtype():
    weights = make_weights(2)
    job = make_job((0, 3), (1, 2), dtype=torch.bfloat16)
    run_round([job], weights.__getitem__, F.silu, CPU, torch.float32)
    assert job.out.dtype == torch.bfloat16


def test_an_expert_gone_missing_fails_only_the_jobs_that_use_it():
    weights = make_weights(2)

    def weights_of(key):
        if key == (0, 1):
            raise ExpertFnError(grpc.StatusCode.NOT_FOUND, "unloaded")
        return weights[key]

    uses, spared = make_job((0, 1), (1, 1)), make_job((0, 3))
    run_round([uses, spared], weights_of, F.silu, CPU, torch.float32)
    assert str(uses.error) == "unloaded" and uses.out is None
    assert spared.error is None and spared.out.shape == (3, H)


class Recorder:
    """A round runner that records the jobs of each round."""

    def __init__(self, seconds: float = 0.0):
        self.rounds: list[int] = []
        self.seconds = seconds

    def __call__(self, jobs):
        self.rounds.append(len(jobs))
        time.sleep(self.seconds)
        for job in jobs:
            job.out = job.x


async def test_an_isolated_request_does_not_wait():
    run = Recorder()
    batcher = MicroBatcher(run, wait_s=10.0, max_tokens=1000)
    start = time.perf_counter()
    for _ in range(3):  # one after another: never overlapping
        await batcher.submit(make_job((0, 1)))
    assert time.perf_counter() - start < 1.0 and run.rounds == [1, 1, 1]
    await batcher.close()


async def test_overlapping_requests_wait_and_merge():
    run = Recorder()
    batcher = MicroBatcher(run, wait_s=0.2, max_tokens=1000)
    jobs = await asyncio.gather(*(batcher.submit(make_job((0, 1))) for _ in range(10)))
    assert run.rounds == [10] and all(job.out is not None for job in jobs)
    assert all(job.queue_seconds < 0.2 + 0.1 for job in jobs)
    await batcher.close()


async def test_requests_arriving_during_a_round_join_the_next_one():
    run = Recorder(seconds=0.1)
    batcher = MicroBatcher(run, wait_s=0.0, max_tokens=1000)
    loop = asyncio.get_running_loop()
    later = [loop.create_future() for _ in range(5)]
    for future in later:  # due while the first round blocks the loop, as gRPC reads would be
        loop.call_later(0.02, lambda f=future: f.set_result(asyncio.ensure_future(batcher.submit(make_job((0, 1))))))
    await batcher.submit(make_job((0, 1)))
    await asyncio.gather(*[await future for future in later])
    assert run.rounds == [1, 5]
    await batcher.close()


async def test_a_full_batch_stops_waiting():
    run = Recorder()
    batcher = MicroBatcher(run, wait_s=30.0, max_tokens=8)
    start = time.perf_counter()
    await asyncio.gather(*(batcher.submit(make_job((0, 4))) for _ in range(2)))
    assert time.perf_counter() - start < 5.0
    await batcher.close()


def test_a_pinned_job_without_its_reply_region_is_refused():
    with pytest.raises(ValueError, match="out_buffer"):  # its replies would have nowhere to go
        Job(torch.zeros(2, 4), [((0, 0), 2)], pinned=True)
