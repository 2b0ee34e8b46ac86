"""The running batch's KV cache: one row per sequence in tensors allocated ahead, a column per position.

Every attention layer has one key and one value tensor [S, heads, W, head_dim]. Sequence i owns
row i and keeps its tokens at columns 0..length-1, so a column is a position. A decode step writes
each row's new key and value at that row's own position (one scatter per tensor) and attends over
all W columns with a mask built from the positions on the device (causal, and the sliding window or
chunks the model's config asks for), so every sequence decodes exactly as it would alone. Nothing is
padded, concatenated or trimmed per step: a sequence joins after its own prefill (its cache copied
into the next free row) and leaves by batch index (the rows after it move up). The tensors grow
geometrically when a sequence or a column more does not fit, within the KV budget where there is
one, and only then do their addresses change: that is what lets a decode pass be replayed as a CUDA
graph over fixed addresses (graphs.py), with `generation` telling it when to capture again.

Freshly allocated columns are zeros and every column a pass writes is a real key, so a masked column
never holds a NaN: attention multiplies masked values by zero weights, and zero times NaN is NaN.
Shapes: B = sequences, S = rows allocated (>= B), W = columns allocated (>= the longest sequence + 1).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch.nn.attention.bias import causal_lower_right
from transformers import DynamicCache
from transformers.masking_utils import causal_mask_function, chunked_causal_mask_function, sliding_window_causal_mask_function


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


@dataclass(frozen=True)
class DecodeMasks:
    """Which attention masks a model's decode pass takes, read once from its config: one mask for every
    layer, or (a model whose layers attend in several ways, e.g. Llama-4's chunked and full layers) one
    per layer type, as `transformers`' own models build them from a padding mask."""

    kinds: tuple[str, ...]  # layer types, one entry: a single mask
    sliding_window: int | None
    chunk_size: int | None

    @classmethod
    def of(cls, config) -> "DecodeMasks":
        sliding = getattr(config, "sliding_window", None)
        default = "sliding_attention" if sliding is not None else "full_attention"
        kinds = tuple(dict.fromkeys(getattr(config, "layer_types", None) or [default]))
        return cls(kinds, sliding, getattr(config, "attention_chunk_size", None))

    def _function(self, kind: str, rows: int, device: torch.device) -> Callable:
        if kind == "sliding_attention":
            return sliding_window_causal_mask_function(self.sliding_window)
        if kind == "chunked_attention":
            return chunked_causal_mask_function(self.chunk_size, torch.zeros(rows, dtype=torch.long, device=device))
        return causal_mask_function

    def build(self, positions: torch.Tensor, width: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """[B, 1, 1, W] boolean masks (True: attend) for one query per row at `positions` [B]."""
        rows, device = positions.shape[0], positions.device
        batch = torch.arange(rows, device=device).view(-1, 1, 1, 1)
        q = positions.view(-1, 1, 1, 1)
        kv = torch.arange(width, device=device).view(1, 1, 1, -1)
        masks = {kind: self._function(kind, rows, device)(batch, None, q, kv).expand(rows, 1, 1, width)
                 for kind in self.kinds}
        return masks if len(masks) > 1 else masks[self.kinds[0]]

    def prompt(self, start: int, stop: int, device: torch.device) -> torch.Tensor | None:
        """The [1, 1, stop - start, stop] mask (True: attend) of prompt positions [start, stop) over columns
        [0, stop), for a model of one mask kind (step_pass.py): None where SDPA's own causal mask is the same
        (a prompt from position 0 that no window or chunk cuts, as transformers' prefill passes it); torch's
        lower-right causal bias where only causality cuts a chunk that continues a cache, which SDPA runs
        as flash attention (a boolean mask takes the slower memory-efficient kernel); else booleans."""
        kind = self.kinds[0]
        cut = {"sliding_attention": self.sliding_window, "chunked_attention": self.chunk_size}.get(kind)
        if cut is None or stop <= cut:
            return None if start == 0 else causal_lower_right(stop - start, stop)
        q = torch.arange(start, stop, device=device).view(1, 1, -1, 1)
        kv = torch.arange(stop, device=device).view(1, 1, 1, -1)
        batch = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
        return self._function(kind, 1, device)(batch, None, q, kv).expand(1, 1, stop - start, stop)


class SlotPass:
    """transformers' cache interface for one decode pass over rows [0, R) of a BatchState's tensors:
    each layer's update writes the new token's key and value at its row's position, and attention
    reads every column (the mask hides the ones a row does not use)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], positions: torch.Tensor,
                 seen: torch.Tensor):
        self.keys, self.values, self.positions, self.seen = keys, values, positions, seen
        self.rows = torch.arange(positions.shape[0], device=positions.device)

    def update(self, key_states, value_states, layer_idx: int, kwargs=None):  # [R, h, 1, d] each
        r = self.rows.shape[0]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.rows, :, self.positions] = key_states[:, :, 0]
        values[self.rows, :, self.positions] = value_states[:, :, 0]
        return keys[:r], values[:r]

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        """The batch's longest sequence before this token, as a left-padded cache would say (Llama-4's
        temperature-tuned layers read it); a device tensor, so a replayed graph sees the current one."""
        return self.seen


_allocations = itertools.count(1)  # one number per allocation of any BatchState's tensors, never reused


def _grown(have: int, need: int, floor: int) -> int:
    return have if need <= have else max(need, 2 * have, floor)


class BatchState:
    """The running micro-batch's cache rows; `budget` (token positions, set by the engine where the KV
    cache is bounded) caps how far the tensors grow ahead of what the batch needs."""

    MIN_ROWS, MIN_COLUMNS = 4, 64

    def __init__(self, masks: DecodeMasks | None = None) -> None:
        self.masks = masks or DecodeMasks(("full_attention",), None, None)
        self.budget: int | None = None
        self.generation = 0  # a new number whenever the tensors move (a captured graph must be captured again)
        self.keys: list[torch.Tensor] = []  # per attention layer [S, h, W, d]
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []  # real tokens per sequence (its next position)
        # Lengths before each of the last two decode steps (newest last): a step launched ahead of one not
        # yet known to hold (device links, engine.py) may have to be undone with it.
        self._before_decode: list[list[int]] = []
        self._inputs: torch.Tensor | None = None  # [3, S] int64 on the device: token, position, longest length
        # The same on the host (pinned where there is a GPU), twice: a step's upload may still be queued
        # behind the pass before it when the engine prepares the next (Engine's look-ahead), so
        # consecutive steps write alternate halves.
        self._staging: torch.Tensor | None = None  # [2, 3, S]
        self._steps = 0

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """Positions the longest sequence holds: rows x width is what the scheduler admits by."""
        return max(self.lengths, default=0)

    @property
    def capacity(self) -> tuple[int, int]:  # (rows, columns) allocated
        return (self.keys[0].shape[0], self.keys[0].shape[2]) if self.keys else (0, 0)

    # -- memory ---------------------------------------------------------------------------------

    def reserve(self, rows: int, columns: int) -> None:
        """Make room for `rows` sequences of `columns` positions: grow geometrically (less where the
        budget forbids), copying what the batch holds, or nothing if it fits already."""
        have_rows, have_columns = self.capacity
        if rows <= have_rows and columns <= have_columns:
            return
        new_rows, new_columns = _grown(have_rows, rows, self.MIN_ROWS), _grown(have_columns, columns, self.MIN_COLUMNS)
        if self.budget is not None:  # ahead of need only as far as the budget allows
            while new_columns > columns and new_rows * new_columns > self.budget:
                new_columns = max(columns, new_columns // 2)
            while new_rows > rows and new_rows * new_columns > self.budget:
                new_rows = max(rows, new_rows // 2)
        used, longest = len(self), self.width

        def moved(old: torch.Tensor) -> torch.Tensor:
            new = old.new_zeros(new_rows, old.shape[1], new_columns, old.shape[3])
            new[:used, :, :longest] = old[:used, :, :longest]
            return new

        self._allocate([moved(k) for k in self.keys], [moved(v) for v in self.values])

    def _allocate(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = keys, values
        rows, device = keys[0].shape[0], keys[0].device
        self._inputs = torch.zeros(3, rows, dtype=torch.long, device=device)
        self._staging = torch.zeros(2, 3, rows, dtype=torch.long, pin_memory=device.type == "cuda")
        self.generation = next(_allocations)  # unique across states: a new state may reuse a dropped one's id()

    def _first(self, cache, length: int) -> None:
        """The tensors, shaped after the first sequence's cache (every architecture caches its own way)."""
        layers = [l for _, l in _filled(cache)]
        if len(layers) != len(cache.layers):
            raise ValueError("every attention layer must have cached the prompt")
        rows, columns = self.MIN_ROWS, max(self.MIN_COLUMNS, length + 1)

        def empty(t: torch.Tensor) -> torch.Tensor:
            return t.new_zeros(rows, t.shape[1], columns, t.shape[3])

        self._allocate([empty(l.keys) for l in layers], [empty(l.values) for l in layers])

    # -- sequences ------------------------------------------------------------------------------

    def join(self, cache, length: int) -> None:
        """Append one sequence whose unpadded cache holds `length` tokens (copied into its row)."""
        if not self.keys:
            self._first(cache, length)
        self.reserve(len(self) + 1, length + 1)
        row = len(self)
        for (_, layer), keys, values in zip(_filled(cache), self.keys, self.values):
            keys[row, :, :length] = layer.keys[0, :, :length]
            values[row, :, :length] = layer.values[0, :, :length]
        self.lengths.append(length)

    def keep(self, indices: list[int]) -> None:
        """Keep only these sequences, in this order: the rows that change place are copied, as far as
        the longest of them reaches (one copy per tensor)."""
        moves = [(to, frm) for to, frm in enumerate(indices) if to != frm]
        if moves:
            to, frm = (upload_ints(side, self.keys[0].device) for side in zip(*moves))
            reach = max(self.lengths[f] for _, f in moves)
            for tensor in self.keys + self.values:
                tensor[to, :, :reach] = tensor[frm, :, :reach]  # the right side is gathered before the write
        # Steps launched ahead may still be undone (engine.py); with rows joined since the last one, none can be
        self._before_decode = [[before[i] for i in indices] for before in self._before_decode
                               if len(before) == len(self.lengths)]
        self.lengths = [self.lengths[i] for i in indices]

    def _joined(self) -> None:
        if not self.lengths:
            raise RuntimeError("the batch holds no sequences: join one before decoding or keeping rows")

    def decode_inputs(self, tokens: list[int]) -> dict:
        """Model inputs for one decode step feeding `tokens` (one per sequence, batch order)."""
        self.advance(tokens)
        return self.pass_inputs(len(self))

    def fits_step(self, rows: int) -> bool:
        """Whether a decode step over `rows` rows fits the tensors as they are (advance moves nothing)."""
        have_rows, have_columns = self.capacity
        return rows <= have_rows and self.width + 1 <= have_columns

    def advance(self, tokens: list[int] | torch.Tensor, rows: int | None = None) -> None:
        """Put one decode step's inputs on the device, feeding `tokens` (one per sequence, batch order:
        host ids, or a tensor of them on the device, e.g. the last pass's argmax), for a pass over
        `rows` rows (default: the sequences; more pads the pass with one-token sequences at position
        0 in the spare rows, whose outputs nobody reads), and count the step."""
        self._joined()
        rows = rows or len(self)
        self.reserve(rows, self.width + 1)
        assert self._inputs is not None and self._staging is not None
        self._before_decode = [*self._before_decode[-1:], self.lengths]
        staging = self._staging[self._steps % 2]
        self._steps += 1
        staging.zero_()
        on_device = isinstance(tokens, torch.Tensor)
        if not on_device:
            staging[0, :len(tokens)] = torch.tensor(tokens)
        staging[1, :len(self)] = torch.tensor(self.lengths)
        staging[2, 0] = self.width
        # All of it: a slice [:, :rows] of [3, S] is not contiguous, and torch copies such a slice through
        # pageable memory, which waits for the stream (the pass launched ahead) instead of queueing behind it
        self._inputs.copy_(staging, non_blocking=True)
        if on_device:  # queued after the upload, on the same stream: these ids win
            self._inputs[0, :len(tokens)].copy_(tokens)
        self.lengths = [n + 1 for n in self.lengths]

    def pass_inputs(self, rows: int) -> dict:
        """The inputs of a pass over the first `rows` rows, from the device buffers as `advance` left
        them: every tensor is a view of those buffers or made from them on the device, so a graph
        captured over a pass replays with each step's values."""
        assert self._inputs is not None
        ids, positions, seen = self._inputs[0, :rows], self._inputs[1, :rows], self._inputs[2, 0]
        columns = self.capacity[1]
        return {
            "input_ids": ids.view(-1, 1),
            "position_ids": positions.view(-1, 1),
            "attention_mask": self.masks.build(positions, columns),
            "cache": SlotPass(self.keys, self.values, positions, seen),
        }

    def undo_decode(self, steps: int = 1) -> None:
        """Forget the last `steps` (1 or 2) decode steps, which failed part-way: the positions they wrote are
        past every sequence's length again, hidden by the mask and overwritten by the next steps."""
        if not 1 <= steps <= len(self._before_decode):
            raise RuntimeError(f"no decode step to undo ({steps} asked, {len(self._before_decode)} held): "
                               "undo_decode follows decode_inputs")
        self.lengths = self._before_decode[-steps]
        del self._before_decode[-steps:]


def upload_ints(values, device: torch.device) -> torch.Tensor:
    """Host ints (a list, nested lists of one length, or a numpy array) on `device` as int64, without
    waiting for its stream (from pinned memory): a pass launched ahead may still be running, and through
    device links its end is not known to come (engine.py). Through numpy: torch.tensor reads a 4000-int
    list in about 0.5 ms, numpy in under 0.1 (a prompt chunk's ids and positions are on the step's path)."""
    host = torch.from_numpy(np.asarray(values, dtype=np.int64))
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
