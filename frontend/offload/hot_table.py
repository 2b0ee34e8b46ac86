"""The hot-expert table: which experts stay on the GPU for good, ranked by the tokens they processed.

A `TokenCounter` counts tokens per (layer, expert) (LayerScope's Counter, fed from routing records or
from serving); `build_hot_table` preloads the hottest experts in that order until the GPU budget is
used, after reserving the working set the streaming path needs on the GPU: two on-demand buffers used
alternately and two prefetch groups (this layer's and the next one's) of `prefetch_slots` experts each.
Ties are broken by (layer, expert), so the table is the same on every run and every replica.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping

# The working set is shared with the operator, which refuses budgets below it.
from kubemoe.offload_budget import ON_DEMAND_BUFFERS, PREFETCH_GROUPS, working_set_bytes  # noqa: F401

Key = tuple[int, int]  # (layer, expert)


class TokenCounter:
    """Tokens processed per (layer, expert)."""

    def __init__(self, counts: Mapping[Key, int] | None = None):
        self.counts: Counter[Key] = Counter(counts or {})

    def add(self, layer: int, expert_tokens: Mapping[int, int]) -> None:
        """One layer's routing: expert -> tokens routed to it."""
        for expert, tokens in expert_tokens.items():
            self.counts[(layer, expert)] += tokens

    def ranked(self) -> list[Key]:
        """Hottest first; equal counts by (layer, expert)."""
        return sorted(self.counts, key=lambda key: (-self.counts[key], key))


@dataclass(frozen=True)
class HotTable:
    experts: tuple[Key, ...]  # preloaded, hottest first
    expert_bytes: int
    budget_bytes: int
    reserved_bytes: int  # the working set, outside the table

    @property
    def bytes_used(self) -> int:
        return len(self.experts) * self.expert_bytes

    def resident(self) -> frozenset[Key]:
        return frozenset(self.experts)

    def layer(self, layer: int) -> frozenset[int]:
        return frozenset(e for l, e in self.experts if l == layer)


def build_hot_table(counter: TokenCounter, all_experts: Iterable[Key], expert_bytes: int, budget_bytes: int,
                    prefetch_slots: int) -> HotTable:
    """Fill `budget_bytes` (minus the working set) with the hottest of `all_experts`.

    Experts never counted rank after every counted one, by (layer, expert): a budget larger than the
    counted experts still fills deterministically.
    """
    reserved = working_set_bytes(expert_bytes, prefetch_slots)
    if budget_bytes < reserved:
        raise ValueError(
            f"a GPU budget of {budget_bytes} bytes is below one layer's working set: at least {reserved} bytes "
            f"({ON_DEMAND_BUFFERS} on-demand buffers + {PREFETCH_GROUPS} prefetch groups of {prefetch_slots} "
            f"experts, {expert_bytes} bytes each); raise the budget or lower the prefetch slots")
    ranked = counter.ranked()
    counted = set(ranked)
    ranked += sorted(set(all_experts) - counted)
    fits = (budget_bytes - reserved) // expert_bytes
    return HotTable(tuple(ranked[:fits]), expert_bytes, budget_bytes, reserved)
