"""The Expert Scaler (MoEless Algorithm 1): how many replicas each expert of a layer gets.

Per layer every expert starts with one replica; a max-heap then gives one more replica to the
expert with the highest load per replica (its load split evenly over its replicas) until the
coefficient of variation (CV) of the layer's per-replica loads is at most V or the layer's memory cap
is reached. An expert that cannot take another replica (it has `max_per_expert`, or one more would
leave its replicas under `min_replica_load`) leaves the heap and the next expert is split. The
minimum is the expert curve's knee (`latency.ExpertCurve.knee_tokens`) in the loads' unit: below it
a replica's part costs a whole weight read, so the per-iteration split (`split`, the same minimum)
would leave the replica idle, while the placer had counted it as carrying load. At or above it a part
costs its FLOPs and nothing more, so splitting the other experts once the hottest is at its cap is
free in time and lets the placer even out the GPUs: a GPU's queue is the sum of its replicas, and
finer parts pack closer (on the trained model's recorded prefill loads at 8 GPUs, where every
layer's hottest expert reaches one replica a GPU with the CV still 0.3-0.7, the simulated MoE-layer
time falls 4%). Without a minimum (0) nothing says which parts are worth a replica, so an expert at
its cap still ends the layer. A layer without load keeps one replica per expert.
Shapes: L = MoE layers, E = experts per layer.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence


def cv(values: Sequence[float]) -> float:
    """Coefficient of variation (population std / mean); 0 for no values or a zero mean."""
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    if mean <= 0:
        return 0.0
    return math.sqrt(max(sum((v - mean) ** 2 for v in values) / len(values), 0.0)) / mean


def replica_loads(loads: Sequence[float], replicas: Sequence[int]) -> list[float]:
    """[E] loads and [E] replica counts -> the load of every replica, each expert's load split evenly."""
    return [load / count for load, count in zip(loads, replicas) for _ in range(count)]


def layer_cv(loads: Sequence[float], replicas: Sequence[int]) -> float:
    return cv(replica_loads(loads, replicas))


def scale(loads: Sequence[Sequence[float]], expert_bytes: int, cv_threshold: float,
          layer_memory_cap: int | None, max_per_expert: int, min_replica_load: float = 0.0) -> list[list[int]]:
    """loads [L][E] (tokens/s, or tokens) -> replicas [L][E], each >= 1.

    `layer_memory_cap` bounds a layer's replicas x expert_bytes (None: no cap); a layer whose
    experts alone exceed it still gets one replica each (an expert with no replica loses tokens).
    """
    if expert_bytes <= 0:
        raise ValueError(f"expert_bytes must be positive, got {expert_bytes}")
    if cv_threshold < 0 or math.isnan(cv_threshold):
        raise ValueError(f"cv_threshold must be >= 0 (e.g. 0.2), got {cv_threshold}")
    if max_per_expert < 1:
        raise ValueError(f"max_per_expert must be >= 1, got {max_per_expert}")
    if not min_replica_load >= 0:
        raise ValueError(f"min_replica_load must be >= 0 (0: no minimum), got {min_replica_load}")
    if layer_memory_cap is not None and layer_memory_cap <= 0:
        raise ValueError(f"layer_memory_cap must be positive bytes or None for no cap, got {layer_memory_cap}")
    max_replicas = math.inf if layer_memory_cap is None else layer_memory_cap // expert_bytes
    return [_scale_layer(row, cv_threshold, max_replicas, max_per_expert, min_replica_load, layer)
            for layer, row in enumerate(loads)]


def _scale_layer(loads: Sequence[float], threshold: float, max_replicas: float, max_per_expert: int,
                 min_replica_load: float, layer: int) -> list[int]:
    if any(load < 0 or not math.isfinite(load) for load in loads):
        raise ValueError(f"layer {layer}: loads must be finite and >= 0, got {list(loads)}")
    replicas = [1] * len(loads)
    peak = max(loads, default=0.0)
    if peak <= 0:
        return replicas
    loads = [load / peak for load in loads]  # CV is scale-free; this keeps the running sums in range
    min_replica_load /= peak
    total = sum(loads)
    # CV from running sums, O(1) per added replica: with R replicas and mean m = total / R,
    # variance = sum_e(load_e^2 / r_e) / R - m^2.
    count, squares = len(loads), sum(load * load for load in loads)

    def current_cv() -> float:
        mean = total / count
        return math.sqrt(max(squares / count - mean * mean, 0.0)) / mean

    heap = [(-load, expert) for expert, load in enumerate(loads) if load > 0]
    heapq.heapify(heap)
    while heap and current_cv() > threshold and count + 1 <= max_replicas:
        _, expert = heap[0]
        load, r = loads[expert], replicas[expert]
        if r >= max_per_expert or load / (r + 1) < min_replica_load:
            if min_replica_load <= 0:
                break  # no knee to tell a useful part from a wasted one: more replicas only cost memory
            heapq.heappop(heap)  # this expert is done; the others' parts still even out the GPUs
            continue
        squares += load * load / (r + 1) - load * load / r
        replicas[expert] = r + 1
        count += 1
        heapq.heapreplace(heap, (-load / (r + 1), expert))
    return replicas
