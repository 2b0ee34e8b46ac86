"""Expert bundles: the sets of (layer, expert) pairs one expert function loads and serves.

Large experts (Mixtral: 336 MB) make a bundle each; small ones (Qwen3-30B-A3B: 9 MB) are grouped
within a layer up to a byte budget. The embedded mode instead splits every layer's experts over N
local processes. A bundle spec on the command line reads `LAYER:EXPERTS[;LAYER:EXPERTS...]` with
EXPERTS as `0-3,6` (ranges and single ids) or `*` for all, e.g. `1:0-3;3:*`.
"""

from __future__ import annotations

from dataclasses import dataclass

ExpertKey = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class Bundle:
    name: str  # DNS-1123 label: it names Kubernetes objects
    experts: tuple[ExpertKey, ...]

    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.experts})

    def spec(self) -> str:
        return format_bundle_spec(self.experts)


def bundles_by_bytes(moe_layers, num_experts: int, expert_bytes: int, bundle_bytes: int) -> list[Bundle]:
    """Group each layer's experts, in order, into bundles of at most `bundle_bytes` (at least one expert)."""
    if expert_bytes <= 0 or bundle_bytes <= 0:
        raise ValueError("expert_bytes and bundle_bytes must be positive")
    per_bundle = max(1, bundle_bytes // expert_bytes)
    return [
        Bundle(f"l{layer}-e{first}-{min(first + per_bundle, num_experts) - 1}",
               tuple((layer, e) for e in range(first, min(first + per_bundle, num_experts))))
        for layer in moe_layers
        for first in range(0, num_experts, per_bundle)
    ]


def bundles_by_count(moe_layers, num_experts: int, count: int) -> list[Bundle]:
    """Split every layer's experts over `count` bundles: bundle i holds the i-th slice of each layer."""
    if not 1 <= count <= num_experts:
        raise ValueError(f"need between 1 and {num_experts} bundles, got {count}")
    bounds = [round(i * num_experts / count) for i in range(count + 1)]
    return [
        Bundle(f"part{i}-of-{count}", tuple((layer, e) for layer in moe_layers for e in range(bounds[i], bounds[i + 1])))
        for i in range(count)
    ]


def parse_bundle_spec(spec: str, moe_layers, num_experts: int) -> tuple[ExpertKey, ...]:
    """`1:0-3;3:*` -> ((1, 0), (1, 1), (1, 2), (1, 3), (3, 0), ...); `*` alone means everything."""
    spec = spec.strip()
    if spec == "*":
        return tuple((layer, e) for layer in moe_layers for e in range(num_experts))
    keys: list[ExpertKey] = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        layer_text, sep, experts_text = part.partition(":")
        if not sep or not layer_text.strip().isdigit():
            raise ValueError(f"bundle part {part!r} must look like LAYER:EXPERTS, e.g. 1:0-3")
        layer = int(layer_text)
        if layer not in moe_layers:
            raise ValueError(f"layer {layer} in bundle {spec!r} is not an MoE layer (MoE layers: {list(moe_layers)})")
        for expert in _parse_ids(experts_text.strip(), num_experts):
            keys.append((layer, expert))
    if not keys:
        raise ValueError(f"bundle spec {spec!r} names no expert")
    if len(set(keys)) != len(keys):
        raise ValueError(f"bundle spec {spec!r} names an expert twice")
    return tuple(keys)


def _parse_ids(text: str, num_experts: int) -> list[int]:
    if text == "*":
        return list(range(num_experts))
    ids: list[int] = []
    for item in text.split(","):
        lo, _, hi = item.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"expert list {text!r} must be ids and ranges like 0-3,6")
        first, last = int(lo), int(hi or lo)
        if not 0 <= first <= last < num_experts:
            raise ValueError(f"experts {item.strip()!r} out of range 0..{num_experts - 1}")
        ids.extend(range(first, last + 1))
    return ids


def format_bundle_spec(keys) -> str:
    by_layer: dict[int, list[int]] = {}
    for layer, expert in sorted(keys):
        by_layer.setdefault(layer, []).append(expert)
    parts = []
    for layer, experts in by_layer.items():
        runs, start = [], experts[0]
        for prev, cur in zip(experts, [*experts[1:], None]):
            if cur is None or cur != prev + 1:
                runs.append(f"{start}-{prev}" if prev != start else f"{start}")
                if cur is not None:
                    start = cur
        parts.append(f"{layer}:{','.join(runs)}")
    return ";".join(parts)
