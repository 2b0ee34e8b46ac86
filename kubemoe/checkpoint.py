"""Lazy reads from a safetensors checkpoint folder, one tensor (or one slice of one) at a time.

A checkpoint folder looks like a downloaded Hugging Face model: `config.json`, and either one
`model.safetensors` or several shards listed by `model.safetensors.index.json`. Shards are
memory-mapped by `safe_open`; reading one expert touches only that expert's bytes, so an expert
function holding a bundle never pages in the rest of the checkpoint.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from kubemoe.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def default_model_id(path: str | Path) -> str:
    """The model id clients and expert functions use when none is given: the checkpoint folder's name.

    Frontends and expert functions must agree on it, so both take it from here.
    """
    return Path(path).resolve().name


class Checkpoint:
    """A read-only view of a checkpoint folder."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise CheckpointError(
                f"{self.path} is not a checkpoint folder (no config.json); "
                "make one with `kubemoe checkpoint make` or point at a downloaded model folder"
            )
        self.weight_map = self._read_weight_map()
        self._handles: dict[str, object] = {}

    def _read_weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a safetensors index ({e}); re-create or re-download it") from e
            missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if missing:
                raise CheckpointError(f"{self.path} lacks shard files listed in its index: {', '.join(missing[:3])}")
            return weight_map
        single = self.path / SINGLE_FILE
        if single.is_file():
            with safe_open(single, framework="pt") as f:
                return {name: SINGLE_FILE for name in f.keys()}
        raise CheckpointError(f"{self.path} holds no {INDEX_FILE} and no {SINGLE_FILE}")

    @cached_property
    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        try:
            shard = self.weight_map[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {self.path}") from None
        if shard not in self._handles:
            self._handles[shard] = safe_open(self.path / shard, framework="pt")
        return self._handles[shard]

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def read(
        self,
        name: str,
        index: int | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        copy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Read one tensor, or only its `index`-th slice along dim 0, into `dtype` on `device`.

        `copy(target, source)`: how the tensor, as read (a view of the mapped file), gets into an empty
        one on a device other than the CPU (an expert function's goes through pinned memory,
        expert_fn/staging.py): in the checkpoint's dtype, converted to `dtype` there. None: `Tensor.to`."""
        tensor = self._read_mapped(name, index)
        if copy is None or torch.device(device).type == "cpu":
            return tensor.to(device=device, dtype=dtype or tensor.dtype)
        return _place(torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device=device), tensor, copy)

    def read_into(
        self,
        target: torch.Tensor,
        name: str,
        index: int | None = None,
        copy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """As read(), into `target` (e.g. a slot of a stack on the GPU): no tensor of its size is allocated
        where the checkpoint's dtype is target's (else one, to convert on the device as read() does)."""
        tensor = self._read_mapped(name, index)
        if list(tensor.shape) != list(target.shape):
            raise ValueError(f"{name}{'' if index is None else f'[{index}]'} has shape {list(tensor.shape)}, "
                             f"not the target's {list(target.shape)}")
        return _place(target, tensor, copy)

    def _read_mapped(self, name: str, index: int | None) -> torch.Tensor:
        part = self._handle(name).get_slice(name)
        return part[index] if index is not None else part[:]

    def nbytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in set(self.weight_map.values()))


def _place(target: torch.Tensor, tensor: torch.Tensor,
           copy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """target <- tensor (as read: a view of the mapped file) through `copy` where target is off the CPU: straight
    in where their dtypes match, else through a tensor of the checkpoint's dtype there, converted on the device."""
    if copy is None or target.device.type == "cpu":
        return target.copy_(tensor)
    if tensor.dtype == target.dtype:
        return copy(target, tensor)
    return target.copy_(copy(torch.empty(tensor.shape, dtype=tensor.dtype, device=target.device), tensor))
