"""kubemoe's decode attention: its Triton kernels against softmax attention written out in torch, under
Triton's CPU interpreter (float32 and float16: the interpreter's bfloat16 dot is wrong), GQA groups,
key and value widths apart (DeepSeek's 192 / 128), columns cut into slices, sliding-window and broadcast
masks, a row that attends nothing; and on the CPU the attention function is transformers' SDPA."""

from __future__ import annotations

import torch

from kubemoe.frontend.attention import BLOCK_N, attention, splits

REFERENCE = """
    import torch
    from kubemoe.frontend.attention import decode_attention

    def reference(q, k, v, mask, scale):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
        scores = (q.float() @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        return (torch.softmax(scores, -1).nan_to_num(0.0) @ v).transpose(1, 2)
"""


def test_the_kernels_equal_softmax_attention_under_tritons_interpreter(triton_interpreted):
    triton_interpreted(REFERENCE + """
    g = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        # rows, query heads, key/value heads, columns, key and value widths, slices
        for b, h, kvh, w, dk, dv, slices in ((3, 8, 2, 70, 32, 32, 1), (2, 4, 4, 130, 48, 32, 3),
                                             (1, 16, 2, 200, 64, 64, 4), (2, 8, 1, 64, 192, 128, 9)):
            q = torch.randn(b, h, 1, dk, generator=g).to(dtype)
            k, v = torch.randn(b, kvh, w, dk, generator=g).to(dtype), torch.randn(b, kvh, w, dv, generator=g).to(dtype)
            at = torch.randint(0, w, (b,), generator=g)
            columns = torch.arange(w)
            window = ((columns[None, :] <= at[:, None]) & (columns[None, :] > at[:, None] - 50)).view(b, 1, 1, w)
            window[-1] = False  # a row that attends nothing gives zeros
            full = (columns < w - 3).view(1, 1, 1, w).expand(b, 1, 1, w)  # broadcast: stride 0 over rows
            for mask in (window, full):
                got = decode_attention(q, k, v, mask, dk ** -0.5, slices=slices)
                assert got.shape == (b, 1, h, dv) and got.dtype == dtype
                error = (got.float() - reference(q, k, v, mask, dk ** -0.5)).abs().max().item()
                assert error < tolerance, (dtype, b, h, kvh, w, dk, dv, slices, error)
    print("equal")
    """)


def test_columns_are_cut_to_fill_the_gpu_in_slices_of_at_least_a_block():
    assert splits(rows=1, kv_heads=4, width=8192, sms=132) == 66  # 264 programs for one row
    assert splits(rows=1, kv_heads=4, width=100, sms=132) == 2  # never a slice under BLOCK_N columns
    assert splits(rows=64, kv_heads=8, width=4096, sms=132) == 1  # 512 programs already
    assert BLOCK_N == 64


def test_on_the_cpu_the_attention_function_is_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 8, 1, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    mask = (torch.arange(9) < torch.tensor([[4], [9]])).view(2, 1, 1, 9)
    got, _ = attention(module, q, k, v, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert torch.equal(got, want)
