"""Sampling parameters and next-token sampling (temperature, top-k, top-p, per-request seed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int = 16

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        if len(self.stop) > 16 or any(not s for s in self.stop):
            raise ValueError("stop takes at most 16 non-empty strings")

    def generator(self) -> torch.Generator | None:
        return None if self.seed is None else torch.Generator().manual_seed(self.seed)


def greedy_tokens(logits: torch.Tensor, params: list[SamplingParams]) -> dict[int, int]:
    """The greedy rows' tokens of logits [n, V], {row: token id}, read back in one transfer: a read per
    row would wait for the device once per sequence of the batch, every step."""
    rows = [i for i, p in enumerate(params) if p.temperature == 0.0]
    if not rows:
        return {}
    picked = logits if len(rows) == len(params) else logits[torch.tensor(rows, device=logits.device)]
    return dict(zip(rows, picked.argmax(-1).tolist()))


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from logits [V]."""
    if params.temperature == 0.0:
        return int(logits.argmax())
    logits = logits.float()
    # Shifted to a largest logit of 0 first (softmax does not change), and by a temperature float32 can hold
    # (1e-300 is 0 there): at a tiny one the others become -inf, not NaN, and the draw is the argmax, the limit.
    logits = (logits - logits.max()) / max(params.temperature, torch.finfo(torch.float32).tiny)
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        probs = probs.scatter(0, order[drop], 0.0)
        probs = probs / probs.sum()
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
