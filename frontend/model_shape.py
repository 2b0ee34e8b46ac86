"""What routing records and predictor files share with the checkpoint they belong to: the model's
shape, and the reading and writing of per-layer predictor files that carry it.

A records folder or a predictor file made for one model is refused for another with a message that
says what to do; both predictors (the load predictor, LLaPor) read and write their files here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kubemoe.errors import KubemoeError


@dataclass(frozen=True)
class ModelShape:
    """What routing records and predictors must share with the checkpoint they are used with."""

    model_type: str
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int

    @classmethod
    def of(cls, adapter) -> "ModelShape":
        return cls(adapter.config.model_type, tuple(adapter.moe_layers), adapter.num_experts, adapter.top_k,
                   adapter.hidden_size)

    def to_metadata(self) -> dict[str, str]:
        return {"model_type": self.model_type, "moe_layers": ",".join(map(str, self.moe_layers)),
                "num_experts": str(self.num_experts), "top_k": str(self.top_k), "hidden_size": str(self.hidden_size)}

    @classmethod
    def from_metadata(cls, meta: dict[str, str], where: Path) -> "ModelShape":
        try:
            return cls(meta["model_type"], tuple(int(x) for x in meta["moe_layers"].split(",")),
                       int(meta["num_experts"]), int(meta["top_k"]), int(meta["hidden_size"]))
        except (KeyError, ValueError) as e:
            raise KubemoeError(f"{where} does not say which model it belongs to ({e}); it was not written by kubemoe") from None

    def describe(self) -> str:
        return (f"{self.model_type}, {len(self.moe_layers)} MoE layers of {self.num_experts} experts (top-{self.top_k}), "
                f"hidden size {self.hidden_size}")

    def check(self, other: "ModelShape", what: str, fix: str) -> None:
        """Raise, saying what to do, unless `other` (of `what`) matches this checkpoint's shape."""
        if other != self:
            raise KubemoeError(f"{what} belongs to another model ({other.describe()}); this checkpoint is "
                               f"{self.describe()}: {fix}")


def save_predictor(path: str | Path, modules: dict[int, torch.nn.Module], prefix: str, meta: dict[str, str],
                   shape: ModelShape, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write per-layer modules (`{prefix}.{layer}.{param}`) and `extra` tensors with the model's shape."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"{prefix}.{layer}.{k}": v.detach().cpu().contiguous() for layer, m in modules.items()
               for k, v in m.state_dict().items()}
    tensors.update({k: v.detach().cpu().contiguous() for k, v in (extra or {}).items()})
    save_file(tensors, path, metadata={**meta, **shape.to_metadata()})
    return path


def read_predictor(path: str | Path, file_format: str, what: str, expect: ModelShape,
                   hint: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a predictor file of `file_format` made for a model of shape `expect`;
    anything else raises KubemoeError ending in `hint` (what to do)."""
    path = Path(path)
    if not path.is_file():
        raise KubemoeError(f"no {what} file at {path}; {hint}")
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad file
        raise KubemoeError(f"{path} is not a {what} file ({e}); {hint}") from None
    if meta.get("format") != file_format:
        raise KubemoeError(f"{path} is not a {what} file (format {meta.get('format')!r}); {hint}")
    expect.check(ModelShape.from_metadata(meta, path), f"the {what} {path}", hint)
    return meta, tensors


def layer_state(tensors: dict[str, torch.Tensor], prefix: str, layer: int) -> dict[str, torch.Tensor]:
    """The state dict of layer `layer`'s module in a file `save_predictor` wrote."""
    head = f"{prefix}.{layer}."
    return {k[len(head):]: v for k, v in tensors.items() if k.startswith(head)}
