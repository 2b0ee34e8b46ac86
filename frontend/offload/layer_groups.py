"""LLaPor's layer groups (input, middle, output), found from a model's own routing records.

LayerScope gives the layers near the input and the output shallow predictors on a strongly compressed
hidden state, and the middle layers deeper ones on a milder compression. Where one group ends and the
next begins differs from model to model, so it is read from the routing, never from layer indices:

1. For every pair of consecutive MoE layers (l, l+1), the *routing correlation* is the normalised mutual
   information between the experts chosen at l and at l+1: the joint distribution of (expert at l,
   expert at l+1) over every token and every pair of its top-k choices, I(X; Y) / sqrt(H(X) H(Y)),
   in [0, 1] (0: the next layer's choice says nothing of this one's). With top-k routing the k x k
   pairs of a token include k(k-1) crossed ones, so even a next layer fully determined by this one
   stays well below 1 (about 0.26 for 16 experts, top-2): only the curve's shape over layers is used.
   Pair l is the one LLaPor's predictor at layer l must bridge.
2. The pairs are cut into three contiguous, non-empty groups by the piecewise-constant fit of that
   curve with the least squared error (first the input group, then the middle, then the output): the
   cuts sit where the correlation changes level, which is where a predictor's task changes.
3. With fewer than three pairs there is nothing to cut: every pair is in the middle group (the deeper
   predictor, the safe choice when the data cannot tell).

Shapes: N = rows, L = MoE layers, K = experts per token, E = experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUPS = ("input", "middle", "output")


@dataclass(frozen=True)
class LayerGroups:
    """Per source MoE layer (every MoE layer but the last, in order): its group and routing correlation."""

    sources: tuple[int, ...]
    groups: tuple[str, ...]
    correlation: tuple[float, ...]

    def of(self, source: int) -> str:
        return self.groups[self.sources.index(source)]

    def members(self, group: str) -> tuple[int, ...]:
        return tuple(s for s, g in zip(self.sources, self.groups) if g == group)


def routing_correlation(experts: torch.Tensor, num_experts: int) -> list[float]:  # [N, L, K] -> L - 1 values
    """Normalised mutual information between the experts of each pair of consecutive MoE layers."""
    scores = []
    for here, there in zip(experts.unbind(1)[:-1], experts.unbind(1)[1:]):  # [N, K] each
        pairs = (here.unsqueeze(-1) * num_experts + there.unsqueeze(-2)).reshape(-1)  # every (k, k') pair
        joint = torch.bincount(pairs, minlength=num_experts ** 2).double().reshape(num_experts, num_experts)
        joint /= joint.sum()
        px, py = joint.sum(1), joint.sum(0)
        nz = joint > 0
        mutual = (joint[nz] * (joint[nz] / (px[:, None] * py[None, :])[nz]).log()).sum()
        entropy = [-(p[p > 0] * p[p > 0].log()).sum() for p in (px, py)]
        scale = (entropy[0] * entropy[1]).sqrt()
        scores.append(float(mutual / scale) if scale > 0 else 1.0)  # a constant layer determines its neighbour
    return scores


def three_segments(values: list[float]) -> tuple[int, int]:
    """Cuts (a, b), 0 < a < b < n: values[:a], values[a:b], values[b:] with the least squared error
    about each segment's mean. Ties keep the first cuts found (smallest a, then smallest b)."""
    n = len(values)
    if n < 3:
        raise ValueError(f"three segments need at least three values, got {n}")
    prefix, square = [0.0], [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
        square.append(square[-1] + v * v)

    def sse(i: int, j: int) -> float:  # of values[i:j]
        total = prefix[j] - prefix[i]
        return square[j] - square[i] - total * total / (j - i)

    _, a, b = min((sse(0, a) + sse(a, b) + sse(b, n), a, b) for a in range(1, n - 1) for b in range(a + 1, n))
    return a, b


def find_layer_groups(experts: torch.Tensor, moe_layers: tuple[int, ...], num_experts: int) -> LayerGroups:
    """The groups of the rule above from routing records' experts [N, L, K]."""
    correlation = routing_correlation(experts, num_experts)
    sources = tuple(moe_layers[:-1])
    if len(sources) < 3:
        return LayerGroups(sources, ("middle",) * len(sources), tuple(correlation))
    a, b = three_segments(correlation)
    groups = ("input",) * a + ("middle",) * (b - a) + ("output",) * (len(sources) - b)
    return LayerGroups(sources, groups, tuple(correlation))
