"""Per iteration: how many of an expert's warm replicas its tokens are split across, and which.

The dispatcher calls this for every layer in every step. The number of parts comes from the
predicted load (the prediction for layer l+d made at layer l, so the calls can be prepared ahead):
an expert's FFN costs about the same from 1 token up to the curve's knee (it reads its weights
either way, `latency.ExpertCurve.knee_tokens`), so a part smaller than that only adds a weight read
on another GPU. The parts go to the replicas with the fewest queued tokens (join-the-shortest-queue)
and are sized to fill those queues to one level (water-filling): an even split on queues of
different lengths would leave the longest one longest. Within a layer the tokens given to one
expert's replicas count in the queues when the next expert is split, and experts are split least
flexible first (`layer_order`). Lossless: every token goes to exactly one replica of its expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, MutableMapping, Sequence, TypeVar

Q = TypeVar("Q", bound=Hashable)  # a queue: an expert function's address, or a GPU in the simulator


@dataclass(frozen=True)
class Part:
    replica: int  # index into the replicas given
    start: int    # the part is tokens [start, start + count) of the expert's tokens, in their order
    count: int


def split(tokens: int, queued: Sequence[int], predicted_tokens: float | None = None,
          min_tokens_per_replica: int = 1) -> list[Part]:
    """tokens of one expert, the tokens queued at each of its warm replicas -> contiguous parts.

    `predicted_tokens` None means "use the actual count"; `min_tokens_per_replica` is the smallest
    part worth a replica of its own. The prediction picks how many of the shortest queues may take a
    part; the parts then level them: each chosen replica ends with the same queue (within a token),
    and one whose part would be under the smallest worthwhile part (`min_tokens_per_replica`, or the
    even share when the prediction asked for smaller ones) gets none. On equal queues that is the
    even split, larger parts first.
    """
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if not queued:
        raise ValueError("an expert with tokens needs at least one warm replica: the routing table lists none")
    if min_tokens_per_replica < 1:
        raise ValueError(f"min_tokens_per_replica must be >= 1, got {min_tokens_per_replica}")
    if tokens == 0:
        return []
    if len(queued) == 1:
        return [Part(0, 0, tokens)]
    wanted = tokens if predicted_tokens is None else max(float(predicted_tokens), 0.0)
    parts = max(1, min(len(queued), tokens, math.ceil(wanted / min_tokens_per_replica)))
    chosen = sorted(range(len(queued)), key=lambda i: (queued[i], i))[:parts]
    smallest = min(min_tokens_per_replica, tokens // parts)
    # Water-filling: the longest chosen queue leaves while its share of the level is too small.
    k, total = parts, tokens + sum(queued[i] for i in chosen)  # total: the tokens the first k queues end with
    while k > 1 and total // k - queued[chosen[k - 1]] < smallest:
        k -= 1
        total -= queued[chosen[k]]
    level, extra = divmod(total, k)
    result, start = [], 0
    for rank, replica in enumerate(chosen[:k]):
        count = level - queued[replica] + (1 if rank < extra else 0)  # the shortest queues take the remainder
        result.append(Part(replica, start, count))
        start += count
    return result


def layer_order(tokens: Sequence[int], replicas: Sequence[Sequence[Q]]) -> list[int]:
    """The order a layer's experts are split in: fewest replicas first (an expert with one has no
    choice, so the queues it lengthens are known before the others fill around it), then most
    tokens first, as longest-processing-time-first scheduling places jobs. (Experts of one replica
    stay in index order: where each goes is fixed, so their order changes nothing, and sorting them
    costs the dispatcher's host time in every layer.)"""
    several = sorted((i for i in range(len(tokens)) if len(replicas[i]) > 1), key=lambda i: (len(replicas[i]), -tokens[i], i))
    return [i for i in range(len(tokens)) if len(replicas[i]) == 1] + several


def split_layer(tokens: Sequence[int], replicas: Sequence[Sequence[Q]], queued: MutableMapping[Q, int],
                predicted: Sequence[float | None], min_tokens_per_replica: int) -> list[list[tuple[Q, Part]]]:
    """A layer's experts: their tokens, the queues their replicas sit in, their predicted tokens ->
    for each expert its parts with the queue each goes to. `queued` (tokens already in each queue)
    is updated with what this layer gives; replicas of several experts may share a queue."""
    result: list[list[tuple[Q, Part]]] = [[] for _ in tokens]
    for i in layer_order(tokens, replicas):
        where = replicas[i]
        for part in split(tokens[i], [queued.get(q, 0) for q in where], predicted[i], min_tokens_per_replica):
            queued[where[part.replica]] = queued.get(where[part.replica], 0) + part.count
            result[i].append((where[part.replica], part))
    return result
