"""Forward over a real channel computes exactly what transformers' own experts compute."""

from __future__ import annotations

import pytest
import torch

from kubemoe.adapters import MoEAdapter, arch_names
from kubemoe.verify import reference_expert, rel_err


def transformers_model(checkpoint, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()


def expected(adapter, model, layer, experts, counts, x):  # [T, H]: each group through its expert
    with torch.no_grad():
        return torch.cat([reference_expert(adapter, model, layer, e, part)
                          for e, part in zip(experts, x.split(counts))])


@pytest.mark.parametrize("arch", arch_names())
async def test_forward_matches_transformers(arch, tiny_checkpoint, serve):
    checkpoint = tiny_checkpoint(arch)
    adapter = MoEAdapter.from_checkpoint(checkpoint)
    model = transformers_model(checkpoint, torch.float32)
    layer = adapter.moe_layers[-1]
    experts, counts = [0, 3, adapter.num_experts - 1, 5], [3, 1, 6, 0]
    x = torch.randn(sum(counts), adapter.hidden_size, generator=torch.Generator().manual_seed(1))
    want = expected(adapter, model, layer, experts, counts, x)
    async with serve(checkpoint) as server:
        for streaming in (False, True):
            client = server.client(streaming=streaming)
            got = await client.forward(layer, experts, counts, x)
            await client.close()
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert rel_err(got, want) < 1e-5, (arch, streaming)


async def test_bfloat16_within_rounding(tiny_checkpoint, serve):
    checkpoint = tiny_checkpoint("qwen3_moe")
    adapter = MoEAdapter.from_checkpoint(checkpoint)
    model = transformers_model(checkpoint, torch.bfloat16)
    layer, experts, counts = adapter.moe_layers[0], [1, 7], [5, 4]
    x = torch.randn(sum(counts), adapter.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    async with serve(checkpoint, dtype="bfloat16") as server:
        client = server.client()
        got = await client.forward(layer, experts, counts, x)
        # A float32 request to the bfloat16 server is converted in and answered in float32.
        got_from_fp32 = await client.forward(layer, experts, counts, x.float())
        await client.close()
    want = expected(adapter, model, layer, experts, counts, x)
    assert got.dtype == torch.bfloat16 and got_from_fp32.dtype == torch.float32
    assert rel_err(got, want) < 2 ** -7  # bfloat16 keeps 8 significant bits
    assert rel_err(got_from_fp32, want) < 2 ** -7
