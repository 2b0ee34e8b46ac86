"""On a GPU (-m gpu): kubemoe's decode attention in bfloat16 and float32 gives SDPA's result at the shapes of the models
it serves (Mixtral, Qwen3-30B-A3B, DeepSeek-V3's key and value widths), at one row (many slices) and at
many, and a decode call through the attention function takes the kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kubemoe.frontend import attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("heads,kv_heads,dk,dv", [(32, 8, 128, 128), (32, 4, 128, 128), (16, 16, 192, 128)])
@pytest.mark.parametrize("rows,width", [(1, 700), (32, 640), (5, 64), (2, 4000)])  # 4000: two merge rounds
@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])  # float32: no TF32
def test_decode_attention_equals_sdpa(heads, kv_heads, dk, dv, rows, width, dtype, tolerance):
    g = torch.Generator(device="cuda").manual_seed(rows + width + dk)
    q = torch.randn(rows, heads, 1, dk, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(rows, kv_heads, width, dk, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(rows, kv_heads, width, dv, device="cuda", dtype=dtype, generator=g)
    lengths = torch.randint(1, width + 1, (rows,), device="cuda", generator=g)
    mask = (torch.arange(width, device="cuda") < lengths[:, None]).view(rows, 1, 1, width)
    group = heads // kv_heads
    # the reference in float64 (SDPA's math kernel), so TF32 products would show
    want = F.scaled_dot_product_attention(q.double(), k.repeat_interleave(group, 1).double(),
                                          v.repeat_interleave(group, 1).double(), attn_mask=mask, scale=0.1)
    got = attention.decode_attention(q, k, v, mask, 0.1)
    assert got.shape == (rows, 1, heads, dv) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want.transpose(1, 2), atol=tolerance, rtol=tolerance)


def test_a_decode_call_through_the_attention_function_takes_the_kernel(monkeypatch):
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 100, 64, device="cuda", dtype=torch.bfloat16), torch.randn(2, 2, 100, 64, device="cuda", dtype=torch.bfloat16)
    mask = (torch.arange(100, device="cuda") < torch.tensor([[30], [100]], device="cuda")).view(2, 1, 1, 100)
    calls = []
    kernel = attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention", lambda *a, **kw: calls.append(a) or kernel(*a, **kw))
    got, _ = attention.attention(module, q, k, v, mask, scaling=0.125)
    assert len(calls) == 1
    prefill, _ = attention.attention(module, q.expand(2, 8, 3, 64), k, v, None, scaling=0.125)  # not a decode: SDPA
    assert len(calls) == 1 and prefill.shape == (2, 3, 8, 64)
    assert got.shape == (2, 1, 8, 64)
