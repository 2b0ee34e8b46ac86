"""The engine's look-ahead (engine.py): a greedy batch's next decode pass launched before this pass's tokens
are read. On a CPU nothing overlaps, but every step's bookkeeping is the GPU's: sequences that end while
a pass is ahead (their end-of-sequence token, their length), requests that join or go away meanwhile."""

from __future__ import annotations

import asyncio
import collections

import pytest
import torch
from transformers import AutoModelForCausalLM

from kubemoe.frontend.graphs import VoidStep, padded_rows, run_eagerly
from kubemoe.frontend.sampling import SamplingParams

from .test_correctness import PROMPTS, generate_all, local_frontend, reference_greedy


LENGTHS, LATE = (12, 3, 6), [9, 8, 7, 6]


def with_late_join(fe) -> tuple[list[list[int]], list[int]]:
    """Three requests of LENGTHS tokens decoding together and a fourth (LATE, 5 tokens) joining
    mid-flight, greedy, through `fe`'s engine -> (the three's tokens, the fourth's)."""
    async def run():
        decoding = asyncio.Event()  # the batch has decoded a token: the fourth joins it mid-flight

        async def one(i, prompt, n):
            tokens = []
            async for delta in fe.engine.generate(f"first-{i}", prompt, SamplingParams(temperature=0, max_tokens=n)):
                assert delta.error is None, delta.error
                tokens += delta.token_ids
                if len(tokens) == 2:
                    decoding.set()
            return tokens

        first = [asyncio.create_task(one(i, p, n)) for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))]
        await decoding.wait()
        joined = await generate_all(fe, [LATE], max_tokens=5)
        return await asyncio.gather(*first), joined[0]

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
    prefill, passes = fe.engine._prefill, []  # whether each prefill pass carried the batch's decode rows

    def recorded(groups, decode, failed):
        passes.append(([c.seq.request_id for g in groups for c in g], decode is not None))
        return prefill(groups, decode, failed)

    fe.engine._prefill = recorded
    try:
        got, got_late = with_late_join(fe)
    finally:
        fe.close()
    assert launched[0] > 0
    # the late prompt came while a pass was ahead: it waited for that pass and rode in the next with the batch
    assert passes[-1] == (["r0"], True), passes
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


class VoidingGraphs:
    """DecodeGraphs with device links, as the engine sees it, on a CPU: each pass runs as a program's
    eager run, is left unsettled when asked (at most two in flight), and the passes numbered in `void`
    come out void, as a linked expert function's failure leaves them: garbage logits, which settling
    reports (VoidStep)."""

    enabled, captures = True, 0

    def __init__(self, model, void: set[int]):
        self.model, self.void, self.passes, self.voided = model, void, 0, 0
        self.unsettled: collections.deque[bool] = collections.deque()

    def rows(self, rows: int) -> int | None:
        return padded_rows(rows)

    def launches_behind(self, state, padded: int) -> bool:
        return self.passes % 4 != 0  # now and then a pass the engine must settle this one before

    def decode(self, state, padded: int, rows: int, settle: bool = True) -> torch.Tensor:
        self.passes += 1
        logits = run_eagerly(self.model, state, padded, rows)
        void = self.passes in self.void
        self.unsettled.append(void)
        assert len(self.unsettled) <= 2, "the engine settles a pass before it launches a third"
        if settle:
            try:
                self.settle()
            except VoidStep:
                return run_eagerly(self.model, state, padded, rows)
        return torch.randn_like(logits) if void else logits

    def settle(self, keep: int = 0) -> None:
        void = False
        while len(self.unsettled) > keep:
            void |= self.unsettled.popleft()
        if void:
            self.voided += 1
            raise VoidStep("a device-linked expert function failed the step")


@pytest.mark.parametrize("void", [{3}, {4, 5}, {2, 8, 9, 15}], ids=["one", "two in a row", "several"])
def test_a_void_pass_ahead_or_not_is_undone_and_decoded_again(tiny_checkpoint, void):
    """Passes left unsettled, the next launched before this one settles: a void one (and whatever was
    launched from its logits) is undone and decoded again, so every request still gets transformers'
    greedy tokens, through ends and a join."""
    path = tiny_checkpoint("mixtral")
    fe = local_frontend(path, max_batch=4)
    fe.engine.eos_ids = set()
    graphs = fe.engine.graphs = VoidingGraphs(fe.decode_model, void)
    launched = counting(fe)
    try:
        got, got_late = with_late_join(fe)
    finally:
        fe.close()
    assert launched[0] > 0 and graphs.voided > 0 and not graphs.unsettled
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert got == [reference_greedy(model, [p], n)[0] for p, n in zip(PROMPTS, LENGTHS)]
    assert got_late == reference_greedy(model, [LATE], 5)[0]
