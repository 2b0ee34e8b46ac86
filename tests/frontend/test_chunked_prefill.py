"""Chunked prefill on the real engine: exact tokens, prompts of one length in one pass, and a running
request that keeps decoding while a long prompt is prefilled (the order of the forward passes)."""

import asyncio

import pytest

from kubemoe.frontend.sampling import SamplingParams
from kubemoe.frontend.scheduler import SchedulerConfig

from .test_correctness import ARCHS, generate_all, local_frontend

LONG = [(7 * i + 3) % 200 + 1 for i in range(50)]  # 50 tokens: 4 chunks at 16 tokens a step
SAME_LENGTH = [[(5 * i + k) % 150 + 2 for i in range(12)] for k in (1, 2)]


def _forwards(fe):
    """Record each forward pass's rows: [(requests, lengths)]."""
    seen = []
    fe.engine.on_forward = lambda rows: seen.append((rows.requests, rows.lengths))
    return seen


def test_chunked_and_grouped_prefill_give_the_tokens_of_one_shot_prefill(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    prompts = [LONG] + SAME_LENGTH
    fe = local_frontend(path, predictor="none", max_step_tokens=512)
    fe.engine.eos_ids = set()
    try:
        one_shot = [asyncio.run(generate_all(fe, [p], max_tokens=8))[0] for p in prompts]
        assert fe.metrics.registry.get_sample_value("kubemoe_frontend_prefill_chunks_total") == 3
    finally:
        fe.close()
    fe = local_frontend(path, predictor="none", max_step_tokens=16)
    fe.engine.eos_ids = set()
    seen = _forwards(fe)
    try:
        chunked = asyncio.run(generate_all(fe, [LONG], max_tokens=8))
        assert fe.metrics.registry.get_sample_value("kubemoe_frontend_prefill_chunks_total") == 4
        assert [lengths for _, lengths in seen[:4]] == [(16,), (16,), (16,), (2,)]
        fe.engine.scheduler.config = SchedulerConfig(max_step_tokens=64)  # both prompts in one step
        seen.clear()
        grouped = asyncio.run(generate_all(fe, SAME_LENGTH, max_tokens=8))
    finally:
        fe.close()
    assert seen[0] == (("r0", "r1"), (12, 12))  # one pass, two rows, no padding
    assert chunked + grouped == one_shot


def long_prompt_behind_a_running_request(fe):
    """A request decoding when LONG arrives, greedy, through `fe` (closed after) -> (the tokens of both,
    the tokens of each alone, each forward pass's (requests, lengths) while they ran together)."""
    fe.engine.eos_ids = set()
    seen = _forwards(fe)
    try:
        async def staggered():
            first = fe.engine.generate("running", [5, 17, 33], SamplingParams(temperature=0, max_tokens=24))
            tokens = (await anext(first)).token_ids  # it is in the batch now
            rest = asyncio.ensure_future(_drain(first))
            long = await generate_all(fe, [LONG], max_tokens=2)
            return tokens + await rest, long[0]

        together = list(asyncio.run(staggered()))
        passes = list(seen)  # the passes of the staggered run only
        alone = [asyncio.run(generate_all(fe, [p], max_tokens=n))[0] for p, n in (([5, 17, 33], 24), (LONG, 2))]
    finally:
        fe.close()
    return together, alone, passes


@pytest.mark.parametrize("arch", ARCHS)
def test_a_running_request_decodes_in_every_pass_of_a_long_prompts_prefill(arch, tiny_checkpoint):
    """Each chunk of the long prompt rides in one pass with the running request's decode row (a model whose
    attention cannot mix parts, Llama-4 and DeepSeek's latent attention, decodes in a pass before each
    chunk's), and both requests get the tokens they get alone."""
    fe = local_frontend(tiny_checkpoint(arch), predictor="none", max_step_tokens=8)
    mixes = fe.engine.step_passes
    together, alone, seen = long_prompt_behind_a_running_request(fe)
    assert together == alone
    assert mixes == (arch not in ("llama4", "deepseek_v2", "deepseek_v3"))
    chunks = [i for i, (requests, lengths) in enumerate(seen) if "r0" in requests and lengths[-1] > 1]
    assert len(chunks) >= 7  # 50 tokens at 7 a step (8 less the running request's decode token)
    for i in chunks:
        if mixes:
            assert seen[i] == (("running", "r0"), (1, 7)) or seen[i][1][0] == 1 and i == chunks[-1], seen
        else:
            assert seen[i][0] == ("r0",) and seen[i - 1] == (("running",), (1,)), seen


@pytest.mark.parametrize("arch", ARCHS)
def test_prompts_of_different_lengths_share_one_pass_with_the_running_batch(arch, tiny_checkpoint):
    fe = local_frontend(tiny_checkpoint(arch), predictor="none", max_step_tokens=64)
    fe.engine.eos_ids = set()
    seen = _forwards(fe)
    prompts = [LONG[:20], SAME_LENGTH[0], SAME_LENGTH[1], LONG[:7]]
    try:
        async def joined():
            first = fe.engine.generate("running", [5, 17, 33], SamplingParams(temperature=0, max_tokens=24))
            tokens = (await anext(first)).token_ids
            rest = asyncio.ensure_future(_drain(first))
            together = await generate_all(fe, prompts, max_tokens=6)
            return tokens + await rest, together

        running, together = asyncio.run(joined())
        passes = list(seen)
        alone = [asyncio.run(generate_all(fe, [p], max_tokens=6))[0] for p in prompts]
        running_alone = asyncio.run(generate_all(fe, [[5, 17, 33]], max_tokens=24))[0]
        mixes = fe.engine.step_passes
    finally:
        fe.close()
    assert together == alone and running == running_alone
    if mixes:  # the four prompts (the two of one length stacked) and the running row: one pass, no padding
        assert (("running", "r0", "r1", "r2", "r3"), (1, 20, 12, 12, 7)) in passes, passes


async def _drain(stream):
    tokens = []
    async for delta in stream:
        assert delta.error is None, delta.error
        tokens += delta.token_ids
    return tokens


@pytest.mark.gpu
def test_chunked_prefill_on_the_gpu_gives_the_tokens_of_one_shot_prefill(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    results = []
    for budget in (512, 16):  # one shot; 4 chunks of the long prompt, the short ones in between
        fe = local_frontend(path, predictor="none", device="cuda", dtype="float32", max_step_tokens=budget)
        fe.engine.eos_ids = set()
        try:
            results.append(asyncio.run(generate_all(fe, [LONG] + SAME_LENGTH, max_tokens=8)))
        finally:
            fe.close()
    assert results[0] == results[1]
