"""The running batch's KV cache: sequences of different lengths, left-padded into one cache.

Sequences join after their own prefill (their cache is padded on the left to the batch's length,
or the batch's to theirs) and leave by batch index; columns that only padding uses are trimmed.
The attention mask marks padding, and each sequence keeps its own positions, so every sequence
decodes exactly as it would alone. Shapes: B = sequences, L = cache length (with padding).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache


def _pad_left(cache, n: int) -> None:
    if n:
        for layer in cache.layers:
            layer.keys = F.pad(layer.keys, (0, 0, n, 0))
            layer.values = F.pad(layer.values, (0, 0, n, 0))


def _filled(cache) -> list[tuple[int, Any]]:  # (index, a transformers cache layer)
    return [(i, l) for i, l in enumerate(cache.layers) if getattr(l, "keys", None) is not None]


def split_rows(cache, rows: int) -> list:
    """One cache per row of a cache of several unpadded rows (a prefill pass over several prompts)."""
    if rows == 1:
        return [cache]
    split = [DynamicCache() for _ in range(rows)]
    for index, layer in _filled(cache):
        for row, single in enumerate(split):
            single.update(layer.keys[row:row + 1], layer.values[row:row + 1], index)
    return split


class BatchState:
    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self.cache: DynamicCache | None = None  # [B, heads, L, head_dim] per layer; None while empty
        self.mask: torch.Tensor | None = None  # [B, L], 1 = real token; None while empty
        self.lengths: list[int] = []  # real tokens per sequence (its next position)
        self._before_decode: tuple[torch.Tensor, list[int]] | None = None  # (mask, lengths) before the last decode

    def _joined(self) -> tuple[DynamicCache, torch.Tensor]:
        """The cache and mask of a batch that holds sequences; an empty batch here is the caller's bug."""
        if self.cache is None or self.mask is None:
            raise RuntimeError("the batch holds no sequences: join one before decoding or keeping rows")
        return self.cache, self.mask

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def join(self, cache, length: int) -> None:
        """Append one sequence whose unpadded cache holds `length` tokens."""
        mask = torch.ones(1, length, dtype=torch.long)
        if self.cache is None:
            self.cache, self.mask, self.lengths = cache, mask, [length]
            return
        width = max(self.width, length)
        _pad_left(self.cache, width - self.width)
        _pad_left(cache, width - length)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([mine.keys, theirs.keys])
            mine.values = torch.cat([mine.values, theirs.values])
        self.mask = torch.cat([F.pad(self.mask, (width - self.width, 0)), F.pad(mask, (width - length, 0))])
        self.lengths.append(length)

    def keep(self, indices: list[int]) -> None:
        """Keep only these sequences (in this order); drop padding no one needs any more."""
        if not indices:
            self._clear()
            return
        cache, mask = self._joined()
        index = torch.tensor(indices)
        self.mask = mask[index]
        self.lengths = [self.lengths[i] for i in indices]
        start = int(self.mask.any(0).long().argmax())  # first column some sequence really uses
        for layer in cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]
        self.mask = self.mask[:, start:]

    def decode_inputs(self, tokens: list[int]) -> dict:
        """Model inputs for one decode step feeding `tokens` (one per sequence, batch order)."""
        cache, mask = self._joined()
        self._before_decode = (mask, self.lengths)
        self.mask = F.pad(mask, (0, 1), value=1)
        inputs = {
            "input_ids": torch.tensor(tokens).view(-1, 1),
            "attention_mask": self.mask,
            "position_ids": torch.tensor(self.lengths).view(-1, 1),
            "cache": cache,
        }
        self.lengths = [n + 1 for n in self.lengths]
        return inputs

    def undo_decode(self) -> None:
        """Forget the last decode step, which failed part-way: the layers it reached had grown by one
        column, so every layer is cut back to the width before it (DynamicCache.crop cuts every layer)."""
        if self._before_decode is None:
            raise RuntimeError("no decode step to undo: undo_decode follows decode_inputs")
        cache, _ = self._joined()
        self.mask, self.lengths = self._before_decode
        for layer in cache.layers:
            layer.keys = layer.keys[:, :, :self.width]
            layer.values = layer.values[:, :, :self.width]
