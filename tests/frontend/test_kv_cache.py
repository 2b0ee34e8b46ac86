"""A bounded KV cache on the real engine: admission by free cache, preemption by recompute, exact tokens."""

import asyncio

import pytest

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
        held.append(sum(len(mb.state) * mb.state.width for mb in fe.engine.micro))

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
