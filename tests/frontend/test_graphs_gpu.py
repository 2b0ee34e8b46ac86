"""On a GPU (-m gpu, the lent H200): decode passes replayed as CUDA graphs compute what ordinary passes do."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kubemoe.frontend.batch import BatchState
from kubemoe.frontend.graphs import DecodeGraphs, padded_rows

from .test_correctness import PROMPTS, generate_all, local_frontend, reference_greedy
from .test_graphs import _counted
from .test_lookahead import counting, with_late_join

pytestmark = pytest.mark.gpu


def _joined(fe, prompts) -> BatchState:
    """A batch holding `prompts`, each prefilled alone, as the engine joins them."""
    from transformers import DynamicCache

    state = BatchState(fe.engine.masks)
    with torch.inference_mode():
        for prompt in prompts:
            cache = DynamicCache()
            fe.model(input_ids=torch.tensor([prompt], device="cuda"), cache=cache, use_cache=True)
            state.join(cache, len(prompt))
    return state


def test_graphed_decode_equals_ordinary_passes_and_never_waits_for_the_gpu(tiny_checkpoint):
    """bfloat16: every layer's experts captured in the graph (the grouped GEMM); two steps through the
    program (the eager first run, then a replay) against the same steps as ordinary passes, 3 sequences
    in the program of 4 rows; the replay launches without one host synchronisation, and the tokens
    counted per expert (routed and predicted) are the real rows' only, counted inside the program."""
    fe = local_frontend(tiny_checkpoint("mixtral"), device="cuda", dtype="bfloat16", predictor="router",
                        cuda_graphs=False)
    try:
        fe.dispatcher.apply_pending()
        assert set(fe.dispatcher._stacked) == set(fe.adapter.moe_layers)
        graphs = DecodeGraphs(fe.model, lambda: fe.dispatcher.generation)
        plain, graphed = _joined(fe, PROMPTS[:3]), _joined(fe, PROMPTS[:3])
        tokens = [5, 6, 7]
        padded = padded_rows(3)
        assert padded == 4
        with torch.inference_mode():
            for step in range(2):
                expected = fe.model(**plain.decode_inputs(tokens), use_cache=True).logits[:, -1]
                before = _counted(fe)
                graphed.advance(tokens, padded)
                torch.cuda.synchronize()
                if step:  # the replay: any host synchronisation raises
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    got = graphs.decode(graphed, padded, 3)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
                assert got.shape[0] == 3
                counted = [b - a for a, b in zip(before, _counted(fe))]
                # no spare row counted: routed tokens of 2 MoE layers, the second predicted from the first
                assert counted == [3 * fe.adapter.top_k * 2, 3 * fe.adapter.top_k, 3], (
                    f"step {step}: captures {graphs.captures}, enabled {graphs.enabled}, real rows on the device "
                    f"{[p.rows_on_device for p in graphs._programs.values()]}")
                tokens = expected.argmax(-1).tolist()
        assert graphs.captures == 1 and graphs.enabled
        assert graphed.lengths == plain.lengths
    finally:
        fe.close()


def test_graphed_decode_with_cuts_gives_transformers_tokens(tiny_checkpoint):
    """float32: the grouped GEMM does not run, so every MoE layer is a cut (the dispatcher's per-expert
    path on the host between captured segments, as for remote experts). A request that outlives two
    others passes through the programs of 4 rows and of 1; every request gets transformers' tokens."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("mixtral")
    fe = local_frontend(path, device="cuda", dtype="float32", predictor="router")
    fe.engine.eos_ids = set()
    lengths = (16, 4, 4)
    try:
        assert fe.engine.graphs is not None

        async def together():
            return await asyncio.gather(*(generate_all(fe, [p], max_tokens=n) for p, n in zip(PROMPTS, lengths)))

        got = [tokens for (tokens,) in asyncio.run(together())]
        assert fe.engine.graphs.enabled and fe.engine.graphs.captures >= 2
    finally:
        fe.close()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert got == [reference_greedy(model, [p], n)[0] for p, n in zip(PROMPTS, lengths)]


def test_look_ahead_over_graphs_gives_the_tokens_of_an_engine_that_waits(tiny_checkpoint):
    """bfloat16, every layer captured: each next pass is replayed from the device's argmax before the
    host reads this pass's tokens. Requests of different lengths, one joining late, get exactly the
    tokens of the same engine reading every step's tokens first, and passes were launched ahead."""
    path = tiny_checkpoint("mixtral")

    def served(look_ahead: bool):
        fe = local_frontend(path, device="cuda", dtype="bfloat16", predictor="router", lookahead=look_ahead)
        fe.engine.eos_ids = set()
        launched = counting(fe, force=False)
        try:
            assert (fe.engine.lookahead is not None) == look_ahead
            return with_late_join(fe), launched[0], fe.engine.graphs.captures
        finally:
            fe.close()

    want, none_ahead, _ = served(False)
    got, launched, captures = served(True)
    assert none_ahead == 0 and launched > 0 and captures >= 2
    assert got == want
