"""On a GPU (-m gpu, the lent H200): the engine's fast paths, exact where the CPU tests cannot reach."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_an_in_process_layer_never_waits_for_the_gpu_and_equals_the_per_expert_path(make_frontend):
    frontend = make_frontend(device="cuda", dtype="bfloat16", predictor="router")
    dispatcher = frontend.dispatcher
    dispatcher.apply_pending()
    layer = frontend.adapter.moe_layers[0]
    assert layer in dispatcher._stacked, "bfloat16 on CUDA runs the grouped path"
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(32, frontend.adapter.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
    logits = torch.randn(32, frontend.adapter.num_experts, device="cuda", generator=g)
    weights, index = logits.softmax(-1).topk(2, dim=-1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        grouped = dispatcher.run_layer(layer, hidden, index, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stack = dispatcher._stacked.pop(layer)  # the same layer through the per-expert loop
    try:
        loop = dispatcher.run_layer(layer, hidden, index, weights)
    finally:
        dispatcher._stacked[layer] = stack
    torch.testing.assert_close(grouped, loop, rtol=1.6e-2, atol=1e-2)  # bfloat16 rounding of two sums
    dispatcher.tally.flush()
    report = frontend.loads.report()
    assert sum(l.tokens for l in report.loads if l.layer == layer) >= 64


def test_a_cuda_frontend_keeps_padded_attention_off_cudnn(make_frontend):
    """cuDNN's attention plans each new key length on first sight (tens of ms): a decode batch meets a
    new one whenever its cache rows grow, so the frontend leaves SDPA's masked case to the
    memory-efficient kernel."""
    make_frontend(device="cuda", dtype="bfloat16")
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_a_long_prompts_chunks_ride_with_a_running_request_through_the_decode_kernels(tiny_checkpoint):
    """float32 on the GPU: the running request's decode row in each pass of the long prompt's prefill attends
    through attention.py's kernels, over a slice of the pass's queries; both requests get their tokens alone."""
    from .test_chunked_prefill import long_prompt_behind_a_running_request
    from .test_correctness import local_frontend

    fe = local_frontend(tiny_checkpoint("mixtral"), device="cuda", dtype="float32", predictor="none", max_step_tokens=8)
    assert fe.engine.step_passes
    together, alone, passes = long_prompt_behind_a_running_request(fe)
    assert together == alone
    assert passes.count((("running", "r0"), (1, 7))) >= 6, passes
