"""One forward pass over a step's decode rows and its prompt chunks: chunked prefill batched with decode.

A step's tokens are laid out as one row [1, T]: first the running batch's decode tokens (one per
sequence, over the batch's cache rows, batch.py's SlotPass), then each chunk group's tokens (scheduler.
chunk_groups: rows of one start and length, row after row, over the group's own DynamicCache). Every
layer but attention sees only tokens, so the projections, routers and experts run once over all T;
attention runs once per part, each over its own keys with its own mask: the decode part through the
batch's decode attention (attention.py's kernels on a GPU), each group's through SDPA, causal from its
start. A long prompt then costs the running requests one pass of the step's budget, not a pass of their
own behind the prompt's, and prompts of different lengths share one pass without padding.

`StepCache` is transformers' cache interface for such a pass; the model's attention function receives
it as the keyword `kubemoe_step` (transformers hands a forward's extra keywords down to it) and calls
`attend`. A model whose attention needs more of a pass than that runs its parts as passes of their
own (`supports`): Llama-4 (layers of several mask kinds, and NoPE layers scaled by a position counted
from the cache's length) and DeepSeek's multi-head latent attention (its cache holds latents that the
layer expands into keys and values between the cache and attention, from what the cache returns: one
tensor, where the parts have one each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from kubemoe.frontend.batch import DecodeMasks, SlotPass

KEYWORD = "kubemoe_step"  # the forward's keyword that carries the StepCache to the attention function


def supports(config, masks: DecodeMasks) -> bool:
    """Whether a model's passes can mix parts: one mask kind for every layer, no attention that scales
    queries by a position counted from the cache's length (Llama-4's temperature tuning), and keys and
    values that are what the cache holds (not latents, as DeepSeek's `kv_lora_rank` makes them)."""
    return (len(masks.kinds) == 1 and not getattr(config, "attn_temperature_tuning", False)
            and getattr(config, "kv_lora_rank", None) is None)


@dataclass(frozen=True)
class Group:
    """`rows` prompt rows of `length` tokens each, from position `start` on, over `cache` (a DynamicCache
    of `rows` rows holding positions [0, start))."""

    cache: Any
    rows: int
    start: int
    length: int
    mask: torch.Tensor | None  # [1, 1, length, start + length] bool; None: causal from column 0 (SDPA's own)

    @property
    def tokens(self) -> int:
        return self.rows * self.length


class StepCache:
    """transformers' cache interface for a pass over `decode` (a SlotPass over the batch's rows, with
    their masks [n, 1, 1, W]; None: no decode rows) and `groups`, laid out in that order along one row."""

    def __init__(self, decode: SlotPass | None, decode_mask: torch.Tensor | None, groups: list[Group]):
        self.decode, self.decode_mask, self.groups = decode, decode_mask, groups
        self.decode_rows = 0 if decode is None else decode.rows.shape[0]
        self._layers: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # layer -> (keys, values) per part

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs=None):
        """Write the pass's keys and values [1, h, T, d] into each part's cache; the attention function
        reads each part's (`attend`), so what this returns is only what the layer asked for."""
        parts = []
        if self.decode is not None:
            parts.append(self.decode.update(self._decode_part(key_states), self._decode_part(value_states), layer_idx))
        at = self.decode_rows
        for group in self.groups:
            # views: the cache's update concatenates them into tensors of its own
            parts.append(group.cache.update(self._group_part(key_states, at, group),
                                            self._group_part(value_states, at, group), layer_idx))
            at += group.tokens
        self._layers[layer_idx] = parts
        return key_states, value_states

    def attend(self, module: torch.nn.Module, query: torch.Tensor, attention: Callable, **kwargs) -> torch.Tensor:
        """Each part's queries of `query` [1, H, T, D] over its keys, through `attention` (the model's
        attention function, transformers' signature) -> [1, T, H, Dv]."""
        parts = iter(self._layers.pop(module.layer_idx))
        outputs = []
        if self.decode is not None:
            keys, values = next(parts)
            out, _ = attention(module, self._decode_part(query), keys, values, self.decode_mask, **kwargs)
            outputs.append(out.reshape(1, -1, *out.shape[-2:]))  # [n, 1, H, Dv] -> [1, n, H, Dv]
        at = self.decode_rows
        for group, (keys, values) in zip(self.groups, parts):
            out, _ = attention(module, self._group_part(query, at, group), keys, values, group.mask, **kwargs)
            outputs.append(out.reshape(1, -1, *out.shape[-2:]))  # [g, C, H, Dv] -> [1, g * C, H, Dv]
            at += group.tokens
        return torch.cat(outputs, dim=1)

    def _decode_part(self, states: torch.Tensor) -> torch.Tensor:  # [1, h, T, d] -> [n, h, 1, d]
        return states[0, :, :self.decode_rows].transpose(0, 1).unsqueeze(2)

    @staticmethod
    def _group_part(states: torch.Tensor, at: int, group: Group) -> torch.Tensor:  # [1, h, T, d] -> [g, h, C, d]
        return states[0, :, at:at + group.tokens].unflatten(1, (group.rows, group.length)).transpose(0, 1)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise NotImplementedError("a pass over several parts has no one cache length (step_pass.supports)")
