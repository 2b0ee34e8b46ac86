"""The one-kernel RMSNorm: under Triton's CPU interpreter it computes what each class it replaces computes
(every LLAMA_FORMULA class, float32 and float16 rows, widths that are not a power of two); on the CPU a
fused model's norms still run their own forward."""

from __future__ import annotations

import importlib

import torch

from kubemoe.frontend.norms import LLAMA_FORMULA, fuse

MODULES = {"MixtralRMSNorm": "mixtral", "Qwen3MoeRMSNorm": "qwen3_moe", "Qwen2MoeRMSNorm": "qwen2_moe",
           "DeepseekV2RMSNorm": "deepseek_v2", "DeepseekV3RMSNorm": "deepseek_v3", "OlmoeRMSNorm": "olmoe",
           "Glm4MoeRMSNorm": "glm4_moe"}


def test_every_fused_class_is_a_transformers_rmsnorm():
    assert set(MODULES) == LLAMA_FORMULA
    for name, model in MODULES.items():
        module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
        norm = getattr(module, name)(16, eps=1e-5)
        assert norm.variance_epsilon == 1e-5 and norm.weight.shape == (16,)


def test_the_kernel_computes_what_each_class_computes_under_tritons_interpreter(triton_interpreted):
    triton_interpreted(f"""
    import importlib
    import torch
    from kubemoe.frontend.norms import rms_norm
    g = torch.Generator().manual_seed(0)
    for name, model in {MODULES!r}.items():
        cls = getattr(importlib.import_module(f"transformers.models.{{model}}.modeling_{{model}}"), name)
        for dtype, width in ((torch.float32, 96), (torch.float16, 100), (torch.float16, 128)):
            norm = cls(width, eps=1e-6).to(dtype)
            with torch.no_grad():
                norm.weight.copy_(torch.randn(width, generator=g))
            x = (torch.randn(3, 5, width, generator=g) * 4).to(dtype)
            want = norm(x)
            got = rms_norm(x, norm.weight, norm.variance_epsilon)
            assert got.dtype == want.dtype and got.shape == want.shape
            # the sum of squares in another order: float32 within rounding, float16 within one unit in the last place
            tolerance = 1e-6 if dtype == torch.float32 else 1e-3
            assert torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance), (name, dtype, width)
            strided = x[:, ::2]  # rows that are not contiguous with each other
            assert torch.allclose(rms_norm(strided, norm.weight, 1e-6).float(), norm(strided).float(),
                                  rtol=tolerance, atol=tolerance)
    print("equal")
    """)


def tiny_qwen3_moe() -> torch.nn.Module:
    """A 2-layer Qwen3-MoE of random weights (seed 0) on transformers' SDPA, in eval mode."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


def test_off_the_gpu_a_fused_model_runs_its_own_norms():
    model = tiny_qwen3_moe()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = model(ids).logits
        assert fuse(model) == 2 * 4 + 1  # per layer: input, post-attention, query, key; and the final norm
        assert torch.equal(model(ids).logits, want)
