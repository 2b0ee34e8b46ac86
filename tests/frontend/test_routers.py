"""The one-kernel router selection: under Triton's CPU interpreter each SOFTMAX_TOP_K class fused gives
what its own forward gives (logits, weights in its dtype, experts); off the GPU a fused model's routers
run their own forward."""

from __future__ import annotations

import importlib

import torch

from kubemoe.frontend.routers import SOFTMAX_TOP_K, fuse
from tests.frontend.test_norms import tiny_qwen3_moe

MODULES = {"MixtralTopKRouter": "mixtral", "Qwen3MoeTopKRouter": "qwen3_moe", "Qwen2MoeTopKRouter": "qwen2_moe",
           "OlmoeTopKRouter": "olmoe"}


def test_every_fused_class_is_a_transformers_router():
    assert set(MODULES) == set(SOFTMAX_TOP_K)
    for name, model in MODULES.items():
        module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
        assert hasattr(module, name)


def test_a_fused_router_gives_what_its_class_gives_under_tritons_interpreter(triton_interpreted):
    triton_interpreted(f"""
    import importlib
    import torch
    from transformers import AutoConfig
    from kubemoe import moe_kernels
    from kubemoe.frontend import routers
    moe_kernels.available = lambda device: True  # the interpreter runs the kernels on the CPU
    g = torch.Generator().manual_seed(0)
    for name, model in {MODULES!r}.items():
        cls = getattr(importlib.import_module(f"transformers.models.{{model}}.modeling_{{model}}"), name)
        for normalize in (True, False):
            config = AutoConfig.for_model(model, hidden_size=48, num_experts_per_tok=3, num_experts=20,
                                          num_local_experts=20, norm_topk_prob=normalize)
            for dtype in (torch.float32, torch.float16):
                router = cls(config).to(dtype)
                with torch.no_grad():
                    router.weight.copy_(torch.randn(20, 48, generator=g))
                x = torch.randn(2, 5, 48, generator=g).to(dtype)
                want = router(x)
                assert routers.fuse(router) == 1
                got = router(x)
                assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]), (name, dtype)
                assert got[1].dtype == want[1].dtype, (name, dtype)
                assert torch.allclose(got[1].float(), want[1].float(), rtol=1e-3, atol=1e-6), (name, dtype)
    print("equal")
    """)


def test_off_the_gpu_a_fused_model_runs_its_own_routers():
    model = tiny_qwen3_moe()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = model(ids).logits
        assert fuse(model) == 2
        assert torch.equal(model(ids).logits, want)
