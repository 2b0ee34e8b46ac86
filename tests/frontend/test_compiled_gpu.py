"""On a GPU (-m gpu, the lent H200): decode passes compiled (compiled.py, Triton kernels) and replayed as
CUDA graphs (graphs.py) compute what uncompiled passes do.

In bfloat16 the tiny models' best two logits are often tied or one rounding step apart, and Triton's
reductions add in another order than the eager kernels: a tie can go either way in either. So bfloat16
tokens are checked as greedy choices up to that rounding, and float32 tokens exactly."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from kubemoe.frontend.compiled import CompiledDecode
from kubemoe.frontend.graphs import DecodeGraphs, padded_rows

from .test_correctness import PROMPTS, generate_all, local_frontend, reference_greedy
from .test_graphs_gpu import _joined

pytestmark = pytest.mark.gpu

BF16_LOGITS = 2e-2  # rtol and atol of a tiny model's bfloat16 logits (test_graphs_gpu.py's)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_compiled_graphed_passes_equal_uncompiled_ones_in_bfloat16(arch, tiny_checkpoint):
    """bfloat16, every layer's experts captured (the grouped GEMM): four steps of 3 sequences through
    the compiled program of 4 rows (the eager first run, which compiles, the capture, replays) against
    the same steps as uncompiled ordinary passes fed the same tokens: logits within bfloat16's
    tolerance, greedy tokens equal wherever the uncompiled pass's best two are further apart than that."""
    fe = local_frontend(tiny_checkpoint(arch), device="cuda", dtype="bfloat16", predictor="router",
                        cuda_graphs=False)
    try:
        fe.dispatcher.apply_pending()
        assert set(fe.dispatcher._stacked) == set(fe.adapter.moe_layers)
        compiled = CompiledDecode(fe.model)
        graphs = DecodeGraphs(compiled, lambda: fe.dispatcher.generation)
        plain, graphed = _joined(fe, PROMPTS[:3]), _joined(fe, PROMPTS[:3])
        tokens, padded = [5, 6, 7], padded_rows(3)
        with torch.inference_mode():
            for _ in range(4):
                expected = fe.model(**plain.decode_inputs(tokens), use_cache=True).logits[:, -1].float()
                graphed.advance(tokens, padded)
                got = graphs.decode(graphed, padded, 3).float()
                torch.testing.assert_close(got, expected, rtol=BF16_LOGITS, atol=BF16_LOGITS)
                best = expected.topk(2, dim=-1).values
                clear = best[:, 0] - best[:, 1] > 2 * BF16_LOGITS
                assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
                tokens = expected.argmax(-1).tolist()
        assert compiled.enabled and graphs.enabled and graphs.captures == 1
    finally:
        fe.close()


def test_compiled_engine_with_graphs_and_look_ahead_chooses_greedy_tokens_in_bfloat16(tiny_checkpoint):
    """bfloat16, served as on the H200 (CUDA graphs, look-ahead, every expert captured): requests of
    different lengths, one joining late, pass through the programs of 4, 2 and 1 rows (one row compiles
    apart); compiled and captured throughout, every token is the uncompiled model's greedy choice up to
    rounding (its logit within the tolerance of the best, read from one uncompiled pass over the text)."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = [*PROMPTS, [9, 8, 7, 6]]
    lengths = (12, 3, 6, 5)
    fe = local_frontend(path, device="cuda", dtype="bfloat16", predictor="router", compile=True)
    fe.engine.eos_ids = set()

    async def run():
        first = [asyncio.create_task(generate_all(fe, [p], max_tokens=n)) for p, n in zip(prompts[:3], lengths)]
        await asyncio.sleep(0.05)
        late = await generate_all(fe, prompts[3:], max_tokens=lengths[3])
        return [t for (t,) in await asyncio.gather(*first)] + late

    try:
        got = asyncio.run(run())
        graphs = fe.engine.graphs
        assert fe.engine.lookahead is not None and graphs is not None and graphs.enabled and graphs.captures >= 2
        assert isinstance(graphs.model, CompiledDecode) and graphs.model.enabled
        with torch.inference_mode():
            for prompt, tokens, length in zip(prompts, got, lengths):
                assert len(tokens) == length
                text = torch.tensor([prompt + tokens[:-1]], device="cuda")
                logits = fe.model(input_ids=text).logits[0, len(prompt) - 1:].float()  # [tokens, V]
                chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
                assert (chosen >= logits.max(-1).values - 2 * BF16_LOGITS).all()
    finally:
        fe.close()


def test_compiled_engine_with_graphs_and_cuts_gives_transformers_tokens_in_float32(tiny_checkpoint):
    """float32: the grouped GEMM does not run, so every MoE layer is a cut (the per-expert path on the
    host between captured segments of compiled code, as for remote experts). A request that outlives
    two others passes through the programs of 4 rows and of 1; every request gets transformers' tokens."""
    path = tiny_checkpoint("qwen3_moe")
    fe = local_frontend(path, device="cuda", dtype="float32", predictor="router", compile=True)
    fe.engine.eos_ids = set()
    lengths = (16, 4, 4)
    try:
        async def together():
            return await asyncio.gather(*(generate_all(fe, [p], max_tokens=n) for p, n in zip(PROMPTS, lengths)))

        got = [tokens for (tokens,) in asyncio.run(together())]
        graphs = fe.engine.graphs
        assert graphs is not None and graphs.enabled and graphs.captures >= 2 and graphs.model.enabled
    finally:
        fe.close()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert got == [reference_greedy(model, [p], n)[0] for p, n in zip(PROMPTS, lengths)]
