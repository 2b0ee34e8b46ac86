"""Decode passes compiled with torch.compile (compiled.py) compute what uncompiled ones do: on the CPU,
through Inductor's C++ kernels, as served (greedy tokens against transformers and the uncompiled engine)
and as a CUDA-graph program runs them (graphs.run_eagerly); a compile that fails leaves the frontend
decoding uncompiled. The capture and replay of compiled passes are -m gpu (test_compiled_gpu.py)."""

from __future__ import annotations

import asyncio
import collections
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from kubemoe.frontend.compiled import CompiledDecode
from kubemoe.frontend.graphs import padded_rows, run_eagerly

from .test_correctness import PROMPTS, generate_all, local_frontend, reference_greedy
from .test_graphs import _counted, _joined


@pytest.mark.slow  # 40-50 s on 2 cores with Inductor's cache cold (compiling two uncached models)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_compiled_engine_gives_the_greedy_tokens_of_transformers_and_of_the_uncompiled_engine(arch, tiny_checkpoint):
    """Three requests decode together (batch 3, then fewer as they end, then one alone: the one-row
    variant too), prefilled uncompiled; each gets transformers' tokens, as from the uncompiled engine."""
    path = tiny_checkpoint(arch)
    lengths = (12, 3, 6)

    def served(compile: bool) -> list[list[int]]:
        fe = local_frontend(path, compile=compile)
        fe.engine.eos_ids = set()

        async def together():
            return await asyncio.gather(*(generate_all(fe, [p], max_tokens=n) for p, n in zip(PROMPTS, lengths)))

        try:
            got = [tokens for (tokens,) in asyncio.run(together())]
            if compile:
                assert isinstance(fe.engine.decode_model, CompiledDecode) and fe.engine.decode_model.enabled
            return got
        finally:
            fe.close()

    compiled = served(True)
    assert compiled == served(False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert compiled == [reference_greedy(model, [p], n)[0] for p, n in zip(PROMPTS, lengths)]


@pytest.mark.parametrize("stacked", [True, False], ids=["captured-experts", "experts-at-a-cut"])
def test_a_compiled_program_pass_equals_an_ordinary_pass_and_counts_only_real_rows(stacked, tiny_checkpoint):
    """A CUDA-graph program's pass (what graphs.py captures) through the compiled model, 3 sequences in
    the program of 4 rows, two steps: the logits of an uncompiled ordinary pass, the loads of the real rows;
    with every layer's experts in the program, and with each a cut (as remote experts are)."""
    # The first pass compiles for half a minute on 2 cores: the load window must not drop the counts before it.
    fe = local_frontend(tiny_checkpoint("mixtral"), predictor="router", load_window_seconds=3600)
    try:
        fe.dispatcher.apply_pending()
        if not stacked:  # every layer through the per-expert path: what a layer of remote experts takes
            fe.dispatcher._stacked.clear()
        compiled = CompiledDecode(fe.model)
        plain, program = _joined(fe, PROMPTS), _joined(fe, PROMPTS)
        rows, padded = len(PROMPTS), padded_rows(len(PROMPTS))
        tokens = [5, 6, 7]
        with torch.inference_mode():
            for _ in range(2):
                before = _counted(fe)[0]
                expected = fe.model(**plain.decode_inputs(tokens), use_cache=True).logits[:, -1]
                ordinary = _counted(fe)[0] - before
                program.advance(tokens, padded)
                got = run_eagerly(compiled, program, padded, rows)
                assert _counted(fe)[0] - before - ordinary == ordinary == rows * fe.adapter.top_k * len(fe.adapter.moe_layers)
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
                tokens = expected.argmax(-1).tolist()
        assert compiled.enabled
    finally:
        fe.close()


def test_other_row_buckets_and_a_grown_cache_compile_nothing_again(tiny_checkpoint):
    """Once a pass of several rows has compiled, passes of other sizes reuse it: another row bucket, the
    same bucket in a state of more rows allocated, wider cache columns (sizes are dynamic and not tied
    to each other), each still the uncompiled pass's logits."""
    fe = local_frontend(tiny_checkpoint("mixtral"), predictor="none")
    try:
        fe.dispatcher.apply_pending()
        compiled = CompiledDecode(fe.model)
        long = list(range(1, 80))  # past the first 64 columns
        with torch.inference_mode():
            for n, (prompts, rows) in enumerate([(PROMPTS, 4), (PROMPTS + [[3, 4], [9]], 8),
                                                  (PROMPTS + [[3, 4], [9]], 4), ([long, [2, 3]], 2)]):
                plain, program = _joined(fe, prompts), _joined(fe, prompts)
                if len(prompts) > rows:  # the same state's rows allocated, fewer sequences in them
                    plain.keep(list(range(3)))
                    program.keep(list(range(3)))
                tokens = [5] * len(plain)
                expected = fe.model(**plain.decode_inputs(tokens), use_cache=True).logits[:, -1]
                program.advance(tokens, rows)
                got = run_eagerly(compiled, program, rows, len(program))
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
                if n == 0:
                    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert program.capacity[1] > 64
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    finally:
        fe.close()


def test_the_graph_breaks_only_at_the_routed_experts_and_attention(tiny_checkpoint):
    """dynamo traces norms, rotary, routers and the cache's update whole: every break is a MoE layer's
    routed experts, which stay Python (dispatch.py), or kubemoe's attention function, whose Triton
    kernels run as they are (attention.py)."""
    fe = local_frontend(tiny_checkpoint("qwen3_moe"), predictor="none")
    try:
        fe.dispatcher.apply_pending()
        state = _joined(fe, PROMPTS)
        state.advance([5, 6, 7], 4)
        with torch.inference_mode():
            explained = torch._dynamo.explain(fe.model)(**state.pass_inputs(4), use_cache=True, logits_to_keep=1)
    finally:
        fe.close()
    where = collections.Counter("_LayerExperts.forward" if "_LayerExperts.forward" in str(r.reason)
                                else "attention" if "function attention at" in str(r.reason) else str(r.reason)
                                for r in explained.break_reasons)
    assert set(where) == {"_LayerExperts.forward", "attention"}, where
    assert where["_LayerExperts.forward"] >= len(fe.adapter.moe_layers)
    assert where["attention"] >= fe.checkpoint.config.num_hidden_layers


def test_a_compile_that_fails_is_logged_once_and_decoding_goes_on_uncompiled(tiny_checkpoint, caplog):
    def failing(graph, example_inputs):
        raise RuntimeError("no compiler here")

    fe = local_frontend(tiny_checkpoint("mixtral"))
    fe.engine.decode_model = CompiledDecode(fe.model, backend=failing)
    fe.engine.eos_ids = set()
    try:
        with caplog.at_level(logging.ERROR, logger="kubemoe.frontend.compiled"):
            got = asyncio.run(generate_all(fe, PROMPTS[:2], max_tokens=4))
        assert not fe.engine.decode_model.enabled
    finally:
        fe.close()
    assert len([r for r in caplog.records if "compiling the decode pass failed" in r.getMessage()]) == 1
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("mixtral"), dtype=torch.float32)
    assert got == reference_greedy(model, PROMPTS[:2], 4)
