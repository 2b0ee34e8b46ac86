"""A decode pass run as a CUDA-graph program computes what an ordinary pass does, with its spare rows
unseen, whether a layer's experts are captured, called at a cut or placed there by the offload executor:
checked on the CPU by running the program's code eagerly (graphs.run_eagerly: the same layers' recorded
path, each cut at once, the afters at the end); the capture and replays are -m gpu."""

import pytest
import torch
from transformers import DynamicCache

from kubemoe.frontend.batch import BatchState
from kubemoe.frontend.graphs import padded_rows, run_eagerly

from .offload.test_offload_frontend import offload_frontend
from .test_correctness import PROMPTS, local_frontend


def _joined(fe, prompts) -> BatchState:
    state = BatchState(fe.engine.masks)
    for prompt in prompts:
        cache = DynamicCache()
        fe.model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
        state.join(cache, len(prompt))
    return state


def _counted(fe) -> tuple[int, int, int]:
    """Routed tokens, predicted tokens and tokens predicted for, so far (a report flushes the tallies)."""
    report = fe.loads.report()
    return (sum(load.tokens for load in report.loads), sum(load.predicted_tokens for load in report.loads),
            sum(p.tokens for p in report.predictions))


@pytest.mark.parametrize("experts", ["stacked", "per-expert", "offload"],
                         ids=["captured-experts", "experts-at-a-cut", "offload-at-a-cut"])
def test_a_program_pass_equals_an_ordinary_pass_and_counts_only_real_rows(experts, tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    # offload: every layer's experts placed by the offload executor at the cut, from a store smaller than the model
    fe = offload_frontend(path) if experts == "offload" else local_frontend(path, predictor="router")
    try:
        fe.dispatcher.apply_pending()
        if experts == "per-expert":  # every layer through the per-expert path: what a layer of remote experts takes
            fe.dispatcher._stacked.clear()
        seen: list[tuple[int, int]] = []

        class HostOnly:  # an observer with nothing to capture (as the routing recorder): the real rows, after
            def on_layer(self, layer, hidden, experts, weights):
                seen.append((layer, len(hidden)))

        fe.dispatcher.observers.append(HostOnly())
        plain, program = _joined(fe, PROMPTS), _joined(fe, PROMPTS)
        rows, padded = len(PROMPTS), padded_rows(len(PROMPTS))
        assert padded > rows  # spare rows in the pass
        tokens = [5, 6, 7]
        with torch.inference_mode():
            for _ in range(2):
                before = _counted(fe)
                expected = fe.model(**plain.decode_inputs(tokens), use_cache=True).logits[:, -1]
                between = _counted(fe)
                program.advance(tokens, padded)
                seen.clear()
                placed = fe.offload.stats.activated if fe.offload else 0
                got = run_eagerly(fe.model, program, padded, rows)
                assert seen == [(layer, rows) for layer in fe.adapter.moe_layers]
                if fe.offload:  # the executor placed the program's experts (the real rows' only)
                    assert 0 < fe.offload.stats.activated - placed <= rows * fe.adapter.top_k * len(fe.adapter.moe_layers)
                after = _counted(fe)
                ordinary = [b - a for a, b in zip(before, between)]
                in_program = [b - a for a, b in zip(between, after)]
                # tiny Mixtral: 2 MoE layers, the second predicted from the first
                assert in_program == ordinary == [rows * fe.adapter.top_k * 2, rows * fe.adapter.top_k, rows]
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
                tokens = expected.argmax(-1).tolist()
        assert program.lengths == plain.lengths
    finally:
        fe.close()
