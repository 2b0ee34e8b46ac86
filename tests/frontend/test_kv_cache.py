"""A bounded KV cache on the real engine: admission by free cache, preemption by recompute, exact tokens."""

import asyncio

import pytest
import torch

from kubemoe.frontend.batch import BatchState
from kubemoe.frontend.engine import PromptTooLong
from kubemoe.frontend.sampling import SamplingParams

from .test_correctness import PROMPTS, generate_all, local_frontend

MAX_TOKENS = 16
CAPACITY = 40  # positions: fits one sequence to its end (9 + 16), not three at their ends


def test_a_cache_too_small_for_the_batch_preempts_and_recomputes_with_the_same_tokens(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    fe = local_frontend(path, predictor="none")
    fe.engine.eos_ids = set()
    try:
        alone = [asyncio.run(generate_all(fe, [p], max_tokens=MAX_TOKENS))[0] for p in PROMPTS]
        per_token = fe.engine.kv_bytes_per_token
    finally:
        fe.close()
    assert fe.engine.kv_budget is None  # unbounded on the CPU unless given
    fe = local_frontend(path, predictor="none", kv_cache_bytes=CAPACITY * per_token)
    fe.engine.eos_ids = set()
    held = []

    def check(rows):  # before every forward pass: what the batch's cache holds
        held.append(len(fe.engine.batch.state) * fe.engine.batch.state.width)

    fe.engine.on_forward = check
    try:
        together = asyncio.run(generate_all(fe, PROMPTS, max_tokens=MAX_TOKENS))
        sample = fe.metrics.registry.get_sample_value
        assert fe.engine.scheduler.kv_capacity == CAPACITY
        assert sample("kubemoe_frontend_preemptions_total") >= 1
        assert sample("kubemoe_frontend_kv_cache_budget_bytes") == CAPACITY * per_token
        assert max(held) <= CAPACITY

        async def too_long():
            async for _ in fe.engine.generate("r", [1] * CAPACITY, SamplingParams()):
                pass

        with pytest.raises(PromptTooLong, match="KV cache holds 40"):
            asyncio.run(too_long())
    finally:
        fe.close()
    assert together == alone


def test_an_empty_batch_says_so_instead_of_decoding_nothing():
    state = BatchState()
    with pytest.raises(RuntimeError, match="holds no sequences"):
        state.decode_inputs([])
    with pytest.raises(RuntimeError, match="no decode step to undo"):
        state.undo_decode()
    state.keep([])  # emptying an empty batch is fine
    assert len(state) == 0 and state.width == 0


def test_every_allocation_of_cache_rows_gets_a_generation_of_its_own():
    """CUDA graphs are keyed by it (graphs.py): a state made after another was dropped, which may reuse
    its id(), must never look like the same allocation."""
    from transformers import DynamicCache

    def joined(length: int) -> BatchState:
        cache = DynamicCache()
        cache.update(torch.ones(1, 2, length, 4), torch.ones(1, 2, length, 4), 0)
        state = BatchState()
        state.join(cache, length)
        return state

    seen = set()
    for _ in range(3):
        state = joined(3)
        seen.add(state.generation)
        state.reserve(state.capacity[0] + 1, 8)  # grows: new tensors, a new generation
        seen.add(state.generation)
        del state
    assert len(seen) == 6


def test_cache_rows_grow_ahead_only_as_far_as_the_budget_allows_and_keep_moves_rows_whole():
    from transformers import DynamicCache

    state = BatchState()
    for row in range(3):  # rows whose keys say which sequence they are
        cache = DynamicCache()
        cache.update(torch.full((1, 2, 5, 4), float(row)), torch.full((1, 2, 5, 4), -float(row)), 0)
        state.join(cache, 5)
    state.budget = 100  # token positions
    state.reserve(5, 20)  # 4 rows allocated: doubling to 8 x 20 would take 160
    assert state.capacity == (5, 20)
    state.keep([2, 0])
    assert state.lengths == [5, 5]
    assert (state.keys[0][0, :, :5] == 2).all() and (state.keys[0][1, :, :5] == 0).all()
    assert (state.values[0][0, :, :5] == -2).all()


def test_a_request_the_scheduler_rejects_ends_even_when_its_step_then_fails(tiny_checkpoint):
    """Before the first prefill measured the cache, a prompt too long for it is admitted, then rejected by the
    scheduler in a step; that step failing before any pass (a routing table that cannot be applied) ends the
    step's requests with its error, and the rejected one with its own (it used to wait for ever)."""
    path = tiny_checkpoint("mixtral")
    probe = local_frontend(path, predictor="none")
    try:
        asyncio.run(generate_all(probe, PROMPTS[:1], max_tokens=1))  # measures a token's cache bytes
        per_token = probe.engine.kv_bytes_per_token
    finally:
        probe.close()
    fe = local_frontend(path, predictor="none", kv_cache_bytes=CAPACITY * per_token)
    engine, steps = fe.engine, []
    before_step = engine.before_step

    def failing_once():
        steps.append(engine.scheduler.kv_capacity)
        if engine.scheduler.kv_capacity is not None and len(steps) == 2:
            raise RuntimeError("the new routing table could not be applied")
        if before_step:
            before_step()
    engine.before_step = failing_once

    async def last_delta(request_id, prompt):
        async for delta in engine.generate(request_id, prompt, SamplingParams(temperature=0, max_tokens=4)):
            last = delta
        return last

    async def both():
        first = asyncio.ensure_future(last_delta("a", [5] * 9))
        await asyncio.sleep(0)
        return await asyncio.wait_for(asyncio.gather(first, last_delta("b", [7] * (2 * CAPACITY))), 30)

    try:
        a, b = asyncio.run(both())
    finally:
        fe.close()
    assert "could not be applied" in a.error and "KV cache holds 40" in b.error
