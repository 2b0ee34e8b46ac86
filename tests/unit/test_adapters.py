"""Every seed architecture: kubemoe's adapters against transformers on a generated checkpoint."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kubemoe.adapters import MoEAdapter
from kubemoe.checkpoint import Checkpoint
from kubemoe.errors import UnsupportedModelError
from kubemoe.presets import get_preset
from kubemoe.synth import build_config
from kubemoe.verify import verify_checkpoint

ARCHS = ["mixtral", "phimoe", "llama4", "deepseek_v2", "qwen3_moe", "deepseek_v3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_experts_routers_and_forward_match_transformers(arch, tiny_checkpoint):
    report = verify_checkpoint(tiny_checkpoint(arch))
    assert report.layers, "no MoE layer was checked"
    for row in report.layers:
        assert row.expert_rel_err < 1e-5, row
        assert row.router_same_experts, row
        assert row.router_weight_rel_err < 1e-5, row
    assert report.logits_rel_err < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_generated_checkpoint_is_laid_out_as_save_pretrained_writes_it(arch, tiny_checkpoint, tmp_path):
    path = tiny_checkpoint(arch)
    generated = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    model = AutoModelForCausalLM.from_config(build_config(get_preset(arch, "tiny")))
    model.save_pretrained(tmp_path, max_shard_size="1MB")
    written = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"])
    assert generated == written
    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    assert len(set(Checkpoint(path).weight_map.values())) > 1, "tiny checkpoints are sharded like real ones"


@pytest.mark.parametrize(
    "arch, moe_layers, num_experts, top_k, shared",
    [
        ("mixtral", (0, 1), 8, 2, False),
        ("phimoe", (0, 1), 8, 2, False),
        ("llama4", (1, 3), 8, 1, True),  # interleaved dense and MoE layers
        ("deepseek_v2", (1, 2), 8, 2, True),  # first_k_dense_replace = 1
        ("qwen3_moe", (0, 1), 16, 4, False),
        ("deepseek_v3", (1, 2), 16, 4, True),
    ],
)
def test_structure(arch, moe_layers, num_experts, top_k, shared, tiny_checkpoint):
    adapter = MoEAdapter.from_checkpoint(tiny_checkpoint(arch))
    assert (adapter.moe_layers, adapter.num_experts, adapter.top_k, adapter.has_shared_experts) == (
        moe_layers, num_experts, top_k, shared)
    expected = 3 * adapter.hidden_size * adapter.expert_intermediate_size * 2
    assert adapter.expert_bytes(torch.bfloat16) == expected


def test_checkpoint_names_come_from_transformers_conversion_tables(tiny_checkpoint):
    mixtral = MoEAdapter.from_checkpoint(tiny_checkpoint("mixtral"))
    names = mixtral.expert_tensors(1, 3)
    assert (names.gate, names.up, names.down) == tuple(
        f"model.layers.1.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w3", "w2"))
    assert mixtral.router_tensors(1).weight == "model.layers.1.block_sparse_moe.gate.weight"
    llama4 = MoEAdapter.from_checkpoint(tiny_checkpoint("llama4")).expert_tensors(3, 5)
    assert (llama4.gate, llama4.index) == ("model.layers.3.feed_forward.experts.gate_up_proj", 5)
    v3 = MoEAdapter.from_checkpoint(tiny_checkpoint("deepseek_v3")).router_tensors(2)
    assert v3.bias == "model.layers.2.mlp.gate.e_score_correction_bias"


def test_out_of_range_layer_and_expert_are_refused(tiny_checkpoint):
    adapter = MoEAdapter.from_checkpoint(tiny_checkpoint("deepseek_v3"))
    with pytest.raises(ValueError, match="not an MoE layer"):
        adapter.expert_tensors(0, 0)
    with pytest.raises(ValueError, match="out of range"):
        adapter.expert_tensors(1, 16)


def test_every_architecture_has_a_tiny_and_a_bench_preset():
    from kubemoe.adapters import arch_names
    from kubemoe.presets import PRESETS

    assert ARCHS == [a for a in ARCHS if a in arch_names()] and sorted(ARCHS) == arch_names()
    for arch in ARCHS:
        assert (arch, "tiny") in PRESETS
        assert any(a == arch and p != "tiny" for a, p in PRESETS)


def test_unsupported_architecture_names_the_supported_ones():
    from transformers import LlamaConfig

    with pytest.raises(UnsupportedModelError, match="mixtral"):
        MoEAdapter(LlamaConfig(num_hidden_layers=1))
