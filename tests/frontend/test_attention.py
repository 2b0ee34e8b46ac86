"""kubemoe's decode attention: its Triton kernels against softmax attention written out in torch, under
Triton's CPU interpreter (float32 and float16: the interpreter's bfloat16 dot is wrong), GQA groups,
key and value widths apart (DeepSeek's 192 / 128), columns cut into slices, sliding-window and broadcast
masks, a row that attends nothing, a row's bits the same in any batch; and on the CPU the attention function is transformers' SDPA."""

from __future__ import annotations

import torch

from kubemoe.frontend.attention import attention

from .test_norms import tiny_qwen3_moe

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
        # rows, query heads, key/value heads, columns, key and value widths, columns per slice
        for b, h, kvh, w, dk, dv, per_slice in ((3, 8, 2, 70, 32, 32, 128), (2, 4, 4, 130, 48, 32, 64),
                                              (1, 16, 2, 200, 64, 64, 64), (2, 8, 1, 64, 192, 128, 128),
                                              (1, 4, 2, 1100, 32, 32, 64)):  # 18 slices: two rounds of the merge
            q = torch.randn(b, h, 1, dk, generator=g).to(dtype)
            k, v = torch.randn(b, kvh, w, dk, generator=g).to(dtype), torch.randn(b, kvh, w, dv, generator=g).to(dtype)
            at = torch.randint(0, w, (b,), generator=g)
            columns = torch.arange(w)
            window = ((columns[None, :] <= at[:, None]) & (columns[None, :] > at[:, None] - 50)).view(b, 1, 1, w)
            window[-1] = False  # a row that attends nothing gives zeros
            full = (columns < w - 3).view(1, 1, 1, w).expand(b, 1, 1, w)  # broadcast: stride 0 over rows
            # one early column and the last 100: the later slices hold the largest scores
            ends = ((columns == 5) | (columns >= w - 100)).view(1, 1, 1, w).expand(b, 1, 1, w)
            for mask in (window, full, ends):
                got = decode_attention(q, k, v, mask, dk ** -0.5, slice_columns=per_slice)
                assert got.shape == (b, 1, h, dv) and got.dtype == dtype
                error = (got.float() - reference(q, k, v, mask, dk ** -0.5)).abs().max().item()
                assert error < tolerance, (dtype, b, h, kvh, w, dk, dv, per_slice, error)
    print("equal")
    """)


def test_a_rows_result_does_not_depend_on_its_batch_under_tritons_interpreter(triton_interpreted):
    """The same sequence decoded alone and in a wider batch whose cache has grown further gives the
    same bits: what keeps a sequence's tokens the same in any batch."""
    triton_interpreted("""
    import torch
    from kubemoe.frontend.attention import decode_attention
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 8, 1, 32, generator=g), torch.randn(1, 2, 200, 32, generator=g), torch.randn(1, 2, 200, 32, generator=g)
    alone = decode_attention(q, k, v, (torch.arange(200) < 150).view(1, 1, 1, 200), 0.2)
    # in a batch of 3 whose cache is 460 columns wide, our row second
    wide = lambda t: torch.cat([t, torch.randn(1, 2, 260, 32, generator=g)], 2)
    batch = lambda t: torch.cat([torch.randn(1, *t.shape[1:], generator=g), t, torch.randn(1, *t.shape[1:], generator=g)])
    kb, vb = batch(wide(k)), batch(wide(v))
    qb = batch(q)
    mask = (torch.arange(460) < torch.tensor([[400], [150], [460]])).view(3, 1, 1, 460)
    together = decode_attention(qb, kb, vb, mask, 0.2)
    assert torch.equal(together[1:2], alone), (together[1:2] - alone).abs().max()
    print("equal")
    """)


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


def test_a_model_on_kubemoes_attention_gets_sdpas_masks():
    """A left-padded batch and a prompt chunk continuing a cache: the same logits as on transformers' SDPA
    (with no mask function under kubemoe's name, transformers would build no mask at all)."""
    from transformers import DynamicCache

    from kubemoe.frontend.attention import use

    model = tiny_qwen3_moe()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])
    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])

    def passes():
        with torch.no_grad():
            padded = model(ids, attention_mask=padding).logits
            cache = DynamicCache()
            model(ids[1:, :4], cache=cache)
            continued = model(ids[1:, 4:], cache=cache).logits  # a chunk over 4 cached positions
        return padded, continued

    want = passes()
    use(model)
    assert model.config._attn_implementation == "kubemoe"
    for got, expected in zip(passes(), want):
        torch.testing.assert_close(got, expected)


def test_only_a_one_query_pass_with_a_boolean_mask_per_row_takes_the_kernel(monkeypatch):
    from kubemoe import moe_kernels
    from kubemoe.frontend.attention import _decodes_here

    monkeypatch.setattr(moe_kernels, "available", lambda device: True)  # as on a GPU
    q, k = torch.randn(3, 8, 1, 16), torch.randn(3, 2, 40, 16)
    rows = torch.ones(3, 1, 1, 40, dtype=torch.bool)
    assert _decodes_here(q, k, rows, {})
    assert not _decodes_here(q.expand(3, 8, 2, 16), k, rows, {})  # two queries a row: a prompt chunk
    assert not _decodes_here(q, k, None, {})
    assert not _decodes_here(q, k, torch.zeros(3, 1, 1, 40), {})  # an additive float mask
    assert not _decodes_here(q, k, rows[:1], {})  # one mask row for the batch: its stride would be read per row
    assert not _decodes_here(q, k, rows[..., :39], {})  # a mask narrower than the cache
    assert not _decodes_here(q, k, rows, {"softcap": 30.0})
