"""Generated checkpoints: seeded random weights laid out exactly like a downloaded model.

The tensor names and shapes come from the architecture's `transformers` model (on the meta device)
and its own save-time conversion, so a generated folder loads with `from_pretrained` and reads with
the adapters like a real one. Tensors are generated and written one shard at a time, so a bench
preset with real expert sizes never needs the whole model in memory.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from kubemoe.adapters import ARCHS, MoEAdapter
from kubemoe.checkpoint import INDEX_FILE
from kubemoe.errors import KubemoeError
from kubemoe.presets import Preset
from kubemoe.tokenizer import END_OF_TEXT, IM_END, save_tokenizer

MAX_TOKENIZER_VOCAB = 4096  # the shipped corpus cannot fill more merges; the model's vocab may be larger


def build_config(preset: Preset):
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[ARCHS[preset.arch].model_type](**preset.config)
    config.dtype = preset.dtype
    return config


def _init_tensor(name: str, shape: torch.Size, seed: int, std: float, dtype: torch.dtype) -> torch.Tensor:
    # One generator per tensor, seeded by its name: any tensor is reproducible on its own.
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.randn(shape, generator=gen, dtype=torch.float32)
    if "norm" in name and name.endswith(".weight"):
        values = 1.0 + 0.1 * values  # norm gains near 1, not exactly 1, so they matter in tests
    elif name.endswith(".bias"):
        values = 0.02 * values
    else:
        values = std * values
    return values.to(dtype)


def make_checkpoint(preset: Preset, out: str | Path, seed: int = 0, progress: bool = True) -> Path:
    """Write config, generation config, tokenizer and sharded safetensors weights into `out`."""
    out = Path(out)
    if (out / "config.json").exists():
        raise KubemoeError(f"{out} already holds a checkpoint; pass --force to overwrite it or choose another --out")
    out.mkdir(parents=True, exist_ok=True)

    config = build_config(preset)
    special = save_tokenizer(min(config.vocab_size, MAX_TOKENIZER_VOCAB), out)
    config.eos_token_id = [special[END_OF_TEXT], special[IM_END]]
    config.pad_token_id = config.bos_token_id = special[END_OF_TEXT]
    config.architectures = [type(MoEAdapter(config).meta_model).__name__]
    layout = MoEAdapter(config).checkpoint_layout()

    dtype = getattr(torch, preset.dtype)
    shards = _plan_shards(layout, dtype.itemsize, preset.shard_bytes)
    weight_map, total = {}, 0
    bar = tqdm(total=sum(_numel(s) for s in layout.values()) * dtype.itemsize, unit="B", unit_scale=True,
               desc=f"writing {out.name}", disable=not progress)
    def init(name: str) -> torch.Tensor:
        return _init_tensor(name, layout[name], seed, config.initializer_range, dtype)

    # Tensors drawn on threads (torch's sampling releases the GIL; one thread draws ~150M values/s, so a
    # 30B-parameter model takes minutes alone); each has its own generator, so the values are the same.
    with ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1))) as pool:
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = dict(zip(names, pool.map(init, names)))
            save_file(tensors, out / file, metadata={"format": "pt"})
            size = sum(t.nbytes for t in tensors.values())
            total += size
            bar.update(size)
            weight_map.update({n: file for n in names})
    bar.close()
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))

    config.save_pretrained(out)
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _plan_shards(layout: dict, itemsize: int, shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name in layout:  # layout keeps the model's order, so a layer's tensors sit together
        nbytes = _numel(layout[name]) * itemsize
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return shards + [current] if current else shards
