import hashlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from kubemoe.adapters import MoEAdapter
from kubemoe.checkpoint import Checkpoint
from kubemoe.errors import CheckpointError, KubemoeError
from kubemoe.moe import StackedExperts
from kubemoe.presets import Preset, get_preset
from kubemoe.synth import make_checkpoint

# 2 layers x 8 experts of 12 MiB (float32): 192 MiB of experts in 32 MiB shards.
LARGE = Preset("mixtral", "lazy-test", dict(vocab_size=512, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                                           num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                                           tie_word_embeddings=False), shard_bytes=32 << 20)


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory):
    return make_checkpoint(LARGE, tmp_path_factory.mktemp("large") / "ckpt", progress=False)


def test_loading_one_expert_reads_only_that_expert(large_checkpoint):
    # Measured in a fresh process: resident memory grows by about one expert, not the checkpoint.
    script = textwrap.dedent(f"""
        import json, torch
        from kubemoe.adapters import MoEAdapter
        from kubemoe.checkpoint import Checkpoint
        def rss():
            fields = dict(l.split(":") for l in open("/proc/self/status") if l.startswith("Rss"))
            return sum(int(v.split()[0]) for v in fields.values()) * 1024
        ckpt = Checkpoint({str(large_checkpoint)!r}); adapter = MoEAdapter(ckpt.config)
        adapter.expert_tensors(1, 5)  # name resolution happens before the measurement
        before = rss()
        w = adapter.load_expert(ckpt, 1, 5, dtype=torch.bfloat16)
        print(json.dumps({{"grew": rss() - before, "expert": w.nbytes, "dtype": str(w.gate_up.dtype)}}))
    """)
    result = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    checkpoint_bytes = Checkpoint(large_checkpoint).nbytes()
    expert_fp32 = 2 * result["expert"]
    assert result["dtype"] == "torch.bfloat16"
    assert checkpoint_bytes > 10 * expert_fp32
    assert result["grew"] < 3 * expert_fp32, f"loading one expert grew RSS by {result['grew']:,} bytes"


def test_expert_tensors_match_the_full_tensors(large_checkpoint):
    ckpt = Checkpoint(large_checkpoint)
    adapter = MoEAdapter(ckpt.config)
    w = adapter.load_expert(ckpt, 0, 2)
    names = adapter.expert_tensors(0, 2)
    assert torch.equal(w.gate_up, torch.cat([ckpt.read(names.gate), ckpt.read(names.up)]))
    assert torch.equal(w.down, ckpt.read(names.down))


def test_fused_slices_read_one_expert(tiny_checkpoint):
    ckpt = Checkpoint(tiny_checkpoint("llama4"))
    adapter = MoEAdapter(ckpt.config)
    names = adapter.expert_tensors(1, 6)
    assert torch.equal(ckpt.read(names.gate, 6), ckpt.read(names.gate)[6])
    assert torch.equal(adapter.load_expert(ckpt, 1, 6).gate_up, ckpt.read(names.gate)[6].t())


def _digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.suffix == ".safetensors"}


def test_weights_are_seeded_and_reproducible(tmp_path, tiny_checkpoint):
    preset = get_preset("qwen3_moe", "tiny")
    again = make_checkpoint(preset, tmp_path / "again", progress=False)
    other = make_checkpoint(preset, tmp_path / "other", seed=1, progress=False)
    assert _digest(again) == _digest(tiny_checkpoint("qwen3_moe"))
    assert _digest(other) != _digest(again)


def test_tiny_checkpoint_looks_downloaded_and_loads_fast(tiny_checkpoint):
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoint("mixtral")
    for name in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors.index.json"]:
        assert (path / name).is_file(), name
    assert sum(f.stat().st_size for f in path.iterdir()) < 16 << 20
    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(path)
    assert time.perf_counter() - start < 1.0
    tok = AutoTokenizer.from_pretrained(path)
    text = "Hello, wörld! 你好 🙂"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_errors_say_what_to_do(tmp_path, tiny_checkpoint):
    with pytest.raises(CheckpointError, match="kubemoe checkpoint make"):
        Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not in the checkpoint"):
        Checkpoint(tiny_checkpoint("mixtral")).read("model.layers.9.nothing")
    with pytest.raises(KubemoeError, match="--force"):
        make_checkpoint(get_preset("mixtral", "tiny"), tiny_checkpoint("mixtral"), progress=False)


@pytest.mark.parametrize("arch", ["mixtral", "llama4", "qwen3_moe"])  # per-expert, fused transposed, fused layouts
def test_an_expert_read_for_another_device_goes_through_the_given_copy_in_the_checkpoints_dtype(arch, tiny_checkpoint):
    """An expert function copies to the GPU through pinned memory (expert_fn/staging.py): every tensor
    an expert is made of reaches `copy` as read, and the weights come out as the plain read makes them."""
    ckpt = Checkpoint(tiny_checkpoint(arch))
    adapter = MoEAdapter(ckpt.config)
    layer = adapter.moe_layers[-1]
    copied = []

    def copy(target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        copied.append((source.device.type, source.dtype, target.device.type, target.dtype))
        return target

    got = adapter.load_expert(ckpt, layer, 1, torch.bfloat16, "meta", copy)
    want = adapter.load_expert(ckpt, layer, 1, torch.bfloat16)
    names = adapter.expert_tensors(layer, 1)
    assert len(copied) == (2 if names.index is not None else 3)
    assert set(copied) == {("cpu", torch.float32, "meta", torch.float32)}  # converted on the device, after the copy
    for ours, theirs in ((got.gate_up, want.gate_up), (got.down, want.down)):
        assert (ours.device.type, ours.dtype, ours.shape) == ("meta", torch.bfloat16, theirs.shape)


@pytest.mark.parametrize("arch", ["mixtral", "llama4", "qwen3_moe"])
def test_an_expert_read_into_a_stacks_slot_is_the_expert_read_alone_and_leaves_the_other_slots(arch, tiny_checkpoint):
    ckpt = Checkpoint(tiny_checkpoint(arch))
    adapter = MoEAdapter(ckpt.config)
    layer = adapter.moe_layers[-1]
    stack = StackedExperts.empty(3, adapter.hidden_size, adapter.expert_intermediate_size, torch.float32, "cpu")
    stack.gate_up.fill_(7.0)
    stack.down.fill_(7.0)
    adapter.read_expert_into(ckpt, layer, 1, stack.expert(2))
    want = adapter.load_expert(ckpt, layer, 1)
    assert torch.equal(stack.gate_up[2], want.gate_up) and torch.equal(stack.down[2], want.down)
    assert bool((stack.gate_up[:2] == 7.0).all()) and bool((stack.down[:2] == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_read_into_a_slot_on_another_device_copies_each_stored_tensor_into_its_place_in_the_checkpoints_dtype(
        dtype, tiny_checkpoint):
    """An expert function's Load reads into its stack's slots through pinned memory: in the checkpoint's
    dtype (float32 here) each tensor as stored is copied straight into the slot, nothing expert-sized
    allocated on the device; in another dtype into one tensor each, converted into the slot on the device."""
    ckpt = Checkpoint(tiny_checkpoint("mixtral"))
    adapter = MoEAdapter(ckpt.config)
    layer = adapter.moe_layers[0]
    stack = StackedExperts.empty(2, adapter.hidden_size, adapter.expert_intermediate_size, dtype, "meta")
    targets = []

    def copy(target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        assert (source.device.type, source.dtype, target.dtype) == ("cpu", torch.float32, torch.float32)
        targets.append(target)
        return target

    adapter.read_expert_into(ckpt, layer, 1, stack.expert(1), copy)
    assert len(targets) == 3  # gate, up and down, as Mixtral stores them
    into_stack = [t._base is stack.gate_up or t._base is stack.down for t in targets]
    assert into_stack == [dtype == torch.float32] * 3


def test_a_read_into_a_tensor_of_another_shape_names_both(tiny_checkpoint):
    ckpt = Checkpoint(tiny_checkpoint("mixtral"))
    name = MoEAdapter(ckpt.config).expert_tensors(1, 0).down
    with pytest.raises(ValueError, match=r"has shape \[\d+, \d+\], not the target's \[3, 4\]"):
        ckpt.read_into(torch.empty(3, 4), name)
