"""The disaggregated model against transformers: logits and greedy generation, every architecture."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from kubemoe.bundles import bundles_by_count
from kubemoe.frontend.app import Frontend, FrontendConfig
from kubemoe.routing_table import LOCAL, table_for_bundles
from kubemoe.frontend.sampling import SamplingParams
from kubemoe.verify import rel_err

ARCHS = ["mixtral", "phimoe", "llama4", "deepseek_v2", "qwen3_moe", "deepseek_v3"]
PROMPTS = [[5, 17, 33, 80, 12, 9, 100, 7, 3], [44, 2], [7, 8, 9, 10, 11]]
NEW_TOKENS = 10


def local_frontend(path, **kwargs) -> Frontend:
    fe = Frontend(FrontendConfig(checkpoint=path, **kwargs))
    bundles = bundles_by_count(fe.adapter.moe_layers, fe.adapter.num_experts, 2)
    fe.set_routing_table(table_for_bundles(fe.model_id, bundles, {b.name: [LOCAL] for b in bundles}))
    return fe


async def generate_all(fe: Frontend, prompts, max_tokens=NEW_TOKENS):
    async def one(i, prompt):
        tokens = []
        async for delta in fe.engine.generate(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens)):
            assert delta.error is None, delta.error
            tokens += delta.token_ids
        return tokens

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def reference_greedy(model, prompts, new_tokens=NEW_TOKENS):
    """transformers' generate on all prompts in one left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_generation_match_transformers(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    fe = local_frontend(path)
    try:
        fe.dispatcher.apply_pending()
        assert fe.dispatcher._stacked.keys() == set(fe.adapter.moe_layers)  # the grouped path is what is compared
        ids = torch.tensor([PROMPTS[0], PROMPTS[2] + PROMPTS[1] + [1, 2]])
        with torch.no_grad():
            assert rel_err(fe.model(ids).logits, reference(ids).logits) < 1e-4
        # eos never ends these sequences early: the comparison covers every token
        fe.engine.eos_ids = set()
        ours = asyncio.run(generate_all(fe, PROMPTS))
    finally:
        fe.close()
    assert ours == reference_greedy(reference, PROMPTS)


def test_frontend_never_loads_routed_expert_weights(tiny_checkpoint):
    fe = Frontend(FrontendConfig(checkpoint=tiny_checkpoint("qwen3_moe"), name="frontend-7f9c"))
    try:
        assert fe.loads.report().frontend == "frontend-7f9c"  # the pod name the operator passes in
        names = [n for n, _ in fe.model.named_parameters()]
        assert not [n for n in names if ".experts." in n]
        assert any("mlp.gate.weight" in n for n in names) and any("embed_tokens" in n for n in names)
        assert fe.dispatcher._local == {} and not fe.ready
    finally:
        fe.close()


def test_requests_joining_mid_flight_decode_as_if_alone(tiny_checkpoint):
    fe = local_frontend(tiny_checkpoint("mixtral"), max_batch=2)
    fe.engine.eos_ids = set()
    try:
        async def staggered():
            first = asyncio.ensure_future(generate_all(fe, PROMPTS[:1], max_tokens=16))
            await asyncio.sleep(0.05)
            rest = await generate_all(fe, PROMPTS[1:], max_tokens=4)
            return (await first) + rest

        together = asyncio.run(staggered())
        alone = [asyncio.run(generate_all(fe, [p], max_tokens=n))[0] for p, n in zip(PROMPTS, (16, 4, 4))]
    finally:
        fe.close()
    assert together == alone


def test_prompt_longer_than_the_context_is_refused(tiny_checkpoint):
    from kubemoe.frontend.engine import PromptTooLong

    fe = local_frontend(tiny_checkpoint("mixtral"))
    try:
        async def too_long():
            async for _ in fe.engine.generate("r", [1] * 512, SamplingParams()):
                pass

        with pytest.raises(PromptTooLong, match="context is 512 tokens"):
            asyncio.run(too_long())
    finally:
        fe.close()
