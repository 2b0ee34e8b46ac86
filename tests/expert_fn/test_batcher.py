"""Micro-batching without a server: round planning, merged and grouped compute, and when rounds run."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
import torch.nn.functional as F

from kubemoe.expert import ExpertWeights, expert_ffn
from kubemoe.expert_fn import batcher
from kubemoe.expert_fn.batcher import Job, MicroBatcher, Part, group_round, plan_round, run_round
from kubemoe.expert_fn.errors import ExpertFnError
from kubemoe.expert_fn.store import LayerStack
from kubemoe.moe import StackedExperts, can_group, sorted_ffn
from kubemoe.verify import rel_err

H, I = 16, 8
CPU = torch.device("cpu")


def make_job(*groups: tuple[int, int], dtype=torch.float32, layer: int = 0) -> Job:
    """A job over `layer`: groups as (expert, tokens)."""
    x = torch.randn(sum(t for _, t in groups), H).to(dtype)
    return Job(x, [((layer, e), t) for e, t in groups])


def make_weights(n: int, layers=(0,)) -> dict[tuple[int, int], ExpertWeights]:
    gen = torch.Generator().manual_seed(0)
    return {(layer, e): ExpertWeights(torch.randn(2 * I, H, generator=gen), torch.randn(H, I, generator=gen))
            for layer in layers for e in range(n)}


def stacked(weights: dict[tuple[int, int], ExpertWeights], layer: int) -> LayerStack:
    """The experts of `layer` in `weights` as one stack, as the store holds them: ascending ids."""
    ids = sorted(e for l, e in weights if l == layer)
    experts = StackedExperts(torch.stack([weights[(layer, e)].gate_up for e in ids]),
                             torch.stack([weights[(layer, e)].down for e in ids]))
    return LayerStack(experts, {e: i for i, e in enumerate(ids)})


def test_plan_groups_parts_of_all_jobs_by_expert():
    jobs = [make_job((1, 2), (3, 1)), make_job((3, 4)), make_job((1, 0), (2, 5))]
    assert plan_round(jobs) == {
        (0, 1): [Part(0, 0, 2), Part(2, 0, 0)],
        (0, 3): [Part(0, 2, 1), Part(1, 0, 4)],
        (0, 2): [Part(2, 0, 5)],
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


def test_a_layers_stacked_experts_group_in_the_stacks_order_and_the_others_run_alone():
    stack = LayerStack(StackedExperts(torch.zeros(4, 2, 1), torch.zeros(4, 1, 1)), {1: 0, 3: 1, 5: 2, 7: 3})
    jobs = [make_job((5, 2), (1, 1), (3, 3)),  # not in the stack's order
            make_job((1, 1), (3, 2), (9, 1)),  # 9: not in the stack (a Load raced the round)
            make_job((5, 2), layer=1)]  # a layer without a stack
    grouped, alone = group_round(plan_round(jobs), {0: stack})
    assert len(grouped) == 1 and grouped[0].experts is stack.experts
    # Expert 1's rows of jobs 0 and 1, then expert 3's, then expert 5's; expert 7 has none.
    assert grouped[0].parts == [Part(0, 2, 1), Part(1, 0, 1), Part(0, 3, 3), Part(1, 1, 2), Part(0, 0, 2)]
    assert grouped[0].ends == [2, 7, 9, 9]
    assert alone == {(0, 9): [Part(1, 3, 1)], (1, 5): [Part(2, 0, 2)]}

    in_order = [make_job((1, 2), (3, 0), (7, 4))]  # as a frontend sends them: ascending ids
    grouped, alone = group_round(plan_round(in_order), {0: stack})
    assert grouped[0].parts == [Part(0, 0, 6)] and grouped[0].ends == [2, 2, 2, 6] and not alone  # one slice: the job
    lone = [make_job((3, 4))]
    assert group_round(plan_round(lone), {0: stack}) == ([], plan_round(lone))  # a lone expert keeps its graph
    # Fewer of a layer's experts than min_grouped keep their graphs too (the servicer's group_min_experts)
    assert group_round(plan_round(jobs), {0: stack}, min_grouped=4) == ([], plan_round(jobs))  # 3 of layer 0's
    assert len(group_round(plan_round(jobs), {0: stack}, min_grouped=3)[0]) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_round_over_stacked_layers_matches_the_per_expert_one(dtype, monkeypatch):
    assert can_group(dtype, CPU, H, I)
    weights = {key: ExpertWeights(w.gate_up.to(dtype), w.down.to(dtype))
               for key, w in make_weights(6, layers=(0, 1, 2)).items()}
    stacks = {layer: stacked(weights, layer) for layer in (0, 1, 2)}
    grouped = []
    monkeypatch.setattr(batcher, "sorted_ffn", lambda *args: grouped.append(args[0].shape[0]) or sorted_ffn(*args))
    # Layer 0: two jobs over three experts, one in its reply's region (a shared-memory call); layer 1:
    # two jobs micro-batched, in ascending order (one slice each); layer 2: one expert alone.
    specs = [(0, ((4, 3), (1, 2), (3, 1)), False), (0, ((3, 4), (1, 1)), True), (1, ((0, 2), (5, 3)), False),
             (1, ((0, 1), (2, 2)), False), (2, ((4, 5),), True)]
    xs = [torch.randn(sum(t for _, t in groups), H, generator=torch.Generator().manual_seed(j)).to(dtype)
          for j, (_, groups, _) in enumerate(specs)]

    def jobs() -> list[Job]:
        made = []
        for (layer, groups, in_place), x in zip(specs, xs):
            x = x.clone()
            made.append(Job(x, [((layer, e), t) for e, t in groups], out_buffer=x if in_place else None))
        return made

    want, got = jobs(), jobs()
    run_round(want, weights.__getitem__, F.silu, CPU, dtype)
    assert not grouped
    tokens = run_round(got, weights.__getitem__, F.silu, CPU, dtype, stack_of=stacks.get)
    assert sorted(grouped) == [8, 11]  # layers 1 and 0, all their rows; layer 2's one expert ran alone
    assert tokens == {(0, 4): 3, (0, 1): 3, (0, 3): 5, (1, 0): 3, (1, 5): 3, (1, 2): 2, (2, 4): 5}
    for w, g in zip(want, got):
        assert g.error is None and g.out.dtype == dtype and g.out.shape == g.x.shape
        assert g.out_buffer is None or g.out is g.out_buffer  # written in place
        torch.testing.assert_close(g.out, w.out)  # float32: within 1.3e-6 relative


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
    start = time.perf_counter()
    jobs = await asyncio.gather(*(batcher.submit(make_job((0, 1))) for _ in range(10)))
    elapsed = time.perf_counter() - start
    assert run.rounds == [10] and all(job.out is not None for job in jobs)
    # The first arrival waited out the window (a loop timer may fire a little early), and each job's
    # reported wait lies within the time the gather took: bounds a busy CI machine cannot break.
    assert max(job.queue_seconds for job in jobs) >= 0.2 * 0.9
    assert all(0 <= job.queue_seconds <= elapsed for job in jobs)
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
