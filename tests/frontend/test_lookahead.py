"""The engine's look-ahead (engine.py): a greedy batch's next decode pass launched before this pass's tokens
are read. On a CPU nothing overlaps, but every step's bookkeeping is the GPU's: sequences that end while
a pass is ahead (their end-of-sequence token, their length), requests that join or go away meanwhile."""

from __future__ import annotations

import asyncio

import torch
from transformers import AutoModelForCausalLM

from kubemoe.frontend.sampling import SamplingParams

from .test_correctness import PROMPTS, generate_all, local_frontend, reference_greedy


LENGTHS, LATE = (12, 3, 6), [9, 8, 7, 6]


def with_late_join(fe) -> tuple[list[list[int]], list[int]]:
    """Three requests of LENGTHS tokens decoding together and a fourth (LATE, 5 tokens) joining
    mid-flight, greedy, through `fe`'s engine -> (the three's tokens, the fourth's)."""
    async def run():
        first = [asyncio.create_task(generate_all(fe, [p], max_tokens=n)) for p, n in zip(PROMPTS, LENGTHS)]
        await asyncio.sleep(0.05)
        joined = await generate_all(fe, [LATE], max_tokens=5)
        return [t for (t,) in await asyncio.gather(*first)], joined[0]

    return asyncio.run(run())


def counting(fe, force: bool = True) -> list[int]:
    """Count the passes launched ahead -> [count], updated as it runs. `force`: look-ahead on even where
    the frontend would not (a CPU; passes that wait for the host)."""
    launched = [0]
    look_ahead = fe.engine._look_ahead

    def counted(mb, logits):
        greedy = look_ahead(mb, logits)
        launched[0] += fe.engine._ahead is not None
        return greedy

    if force:
        fe.engine.lookahead = lambda: True
    fe.engine._look_ahead = counted
    return launched


def test_look_ahead_gives_transformers_tokens_with_ends_and_joins_in_flight(tiny_checkpoint):
    """Three requests of different lengths decode together, a fourth joins mid-flight: each ends while a
    pass is ahead or stops short of launching one, and every request gets transformers' greedy tokens."""
    path = tiny_checkpoint("mixtral")
    fe = local_frontend(path, max_batch=4)
    fe.engine.eos_ids = set()
    launched = counting(fe)
    try:
        got, got_late = with_late_join(fe)
    finally:
        fe.close()
    assert launched[0] > 0
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert got == [reference_greedy(model, [p], n)[0] for p, n in zip(PROMPTS, LENGTHS)]
    assert got_late == reference_greedy(model, [LATE], 5)[0]


def test_a_sequence_that_ends_on_its_eos_while_a_pass_is_ahead_leaves_the_others_exact(tiny_checkpoint):
    """The end-of-sequence token is one the first request samples early: that request ends at it, its
    row in the pass launched ahead is dropped, and the others' tokens equal an engine without look-ahead."""
    path = tiny_checkpoint("mixtral")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    alone = reference_greedy(model, [PROMPTS[0]], 10)[0]
    eos = alone[3]

    def served(look_ahead: bool) -> tuple[list[list[int]], list[str | None], int]:
        fe = local_frontend(path, max_batch=4)
        fe.engine.eos_ids = {eos}
        launched = counting(fe) if look_ahead else [0]

        async def one(prompt):
            tokens, reason = [], None
            async for delta in fe.engine.generate(f"p{len(prompt)}", prompt, SamplingParams(temperature=0, max_tokens=10)):
                tokens += delta.token_ids
                reason = delta.finish_reason or reason
            return tokens, reason

        async def run():
            return await asyncio.gather(*(one(p) for p in PROMPTS))

        try:
            results = asyncio.run(run())
        finally:
            fe.close()
        return [t for t, _ in results], [r for _, r in results], launched[0]

    want, want_reasons, _ = served(False)
    got, reasons, launched = served(True)
    assert launched > 0
    assert want[0] == alone[:alone.index(eos)] and want_reasons[0] == "stop"
    assert got == want and reasons == want_reasons
