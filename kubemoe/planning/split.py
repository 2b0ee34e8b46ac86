"""Per iteration: how many of an expert's warm replicas its tokens are split across, and which.

The dispatcher calls this for every expert of a layer in every step. The number of parts comes from
the predicted load (the prediction for layer l+d made at layer l, so the calls can be prepared
ahead): an expert's FFN costs about the same from 1 token up to the curve's knee (it reads its
weights either way, `latency.ExpertCurve.knee_tokens`), so a part smaller than that only adds a
weight read on another GPU. The parts go to the replicas with the fewest in-flight tokens
(join-the-shortest-queue). Lossless: every token goes to exactly one replica of this expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Part:
    replica: int  # index into the replicas given
    start: int    # the part is tokens [start, start + count) of the expert's tokens, in their order
    count: int


def split(tokens: int, inflight: Sequence[int], predicted_tokens: float | None = None,
          min_tokens_per_replica: int = 1) -> list[Part]:
    """tokens of one expert, the in-flight tokens of each of its warm replicas -> contiguous parts.

    `predicted_tokens` None means "use the actual count"; `min_tokens_per_replica` is the smallest
    part worth a replica of its own. Parts are as even as the token count allows, larger parts first.
    """
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if not inflight:
        raise ValueError("an expert with tokens needs at least one warm replica: the routing table lists none")
    if min_tokens_per_replica < 1:
        raise ValueError(f"min_tokens_per_replica must be >= 1, got {min_tokens_per_replica}")
    if tokens == 0:
        return []
    wanted = tokens if predicted_tokens is None else max(float(predicted_tokens), 0.0)
    parts = max(1, min(len(inflight), tokens, math.ceil(wanted / min_tokens_per_replica)))
    chosen = sorted(range(len(inflight)), key=lambda i: (inflight[i], i))[:parts]
    base, extra = divmod(tokens, parts)
    result, start = [], 0
    for rank, replica in enumerate(chosen):
        count = base + (1 if rank < extra else 0)  # the least-busy replicas take the remainder
        result.append(Part(replica, start, count))
        start += count
    return result
