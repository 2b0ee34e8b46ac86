"""Model sizes for generated checkpoints: `tiny` for tests, bench presets with real expert sizes.

A preset is a set of keyword arguments for the architecture's own `transformers` config class.
Bench presets keep the hidden size, attention shape, expert count and expert size of the published
model and cut the layer count (and the vocabulary, to 32k, so embeddings do not dominate the file):
what they measure is expert traffic, which those settings fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kubemoe.errors import KubemoeError

_TINY_COMMON = dict(vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False, hidden_size=128)
_BENCH_VOCAB = 32768
_MLA_TINY = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, num_attention_heads=4, num_key_value_heads=4)
_MLA_BENCH = dict(kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                  num_attention_heads=16, num_key_value_heads=16, hidden_size=2048, first_k_dense_replace=1)


@dataclass(frozen=True)
class Preset:
    arch: str
    name: str
    config: dict = field(hash=False)
    dtype: str = "float32"
    shard_bytes: int = 1 << 20  # tiny checkpoints still get several shards, like real ones

    @property
    def is_tiny(self) -> bool:
        return self.name == "tiny"


def _tiny(arch: str, **config) -> Preset:
    return Preset(arch, "tiny", {**_TINY_COMMON, **config})


def _bench(arch: str, name: str, **config) -> Preset:
    config = {"vocab_size": _BENCH_VOCAB, "max_position_embeddings": 4096, "tie_word_embeddings": False, **config}
    return Preset(arch, name, config, dtype="bfloat16", shard_bytes=2 << 30)


PRESETS: dict[tuple[str, str], Preset] = {
    (p.arch, p.name): p
    for p in [
        _tiny("mixtral", intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_local_experts=8, num_experts_per_tok=2),
        _tiny("phimoe", intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_local_experts=8, num_experts_per_tok=2),
        # Llama-4 interleaves dense and MoE layers: with step 2, layers 1 and 3 are MoE.
        _tiny("llama4", intermediate_size=128, intermediate_size_mlp=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2),
        # DeepSeek-V2 with group-limited greedy routing (as the full V2); the Lite preset is greedy.
        _tiny("deepseek_v2", intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3, first_k_dense_replace=1,
              n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, q_lora_rank=None,
              topk_method="group_limited_greedy", n_group=4, topk_group=2, **_MLA_TINY),
        _tiny("qwen3_moe", intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
        _tiny("deepseek_v3", intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3, first_k_dense_replace=1,
              n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, q_lora_rank=48,
              routed_scaling_factor=2.5, norm_topk_prob=True, **_MLA_TINY),
        _bench("mixtral", "mixtral-4l", hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
               num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2),
        _bench("phimoe", "phi-3.5-moe-4l", hidden_size=4096, intermediate_size=6400, num_hidden_layers=4,
               num_attention_heads=32, num_key_value_heads=8, num_local_experts=16, num_experts_per_tok=2),
        _bench("llama4", "llama4-scout-4l", hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
               num_hidden_layers=4, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
               num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1),
        _bench("deepseek_v2", "deepseek-v2-lite-4l", intermediate_size=10944, moe_intermediate_size=1408,
               num_hidden_layers=4, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
               topk_method="greedy", routed_scaling_factor=1.0, **_MLA_BENCH),
        _bench("qwen3_moe", "qwen3-30b-a3b-8l", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
               num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
               num_experts_per_tok=8, norm_topk_prob=True),
        _bench("deepseek_v3", "moonlight-4l", intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=4,
               n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
               routed_scaling_factor=2.446, norm_topk_prob=True, **_MLA_BENCH),
    ]
}


def get_preset(arch: str, name: str) -> Preset:
    try:
        return PRESETS[(arch, name)]
    except KeyError:
        choices = ", ".join(p for a, p in PRESETS if a == arch) or "none: unknown architecture"
        raise KubemoeError(f"no preset {name!r} for architecture {arch!r}; choose one of: {choices}") from None
