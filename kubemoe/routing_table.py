"""The routing table contract: which endpoints serve each (layer, expert), as the operator writes it.

The operator renders it into a ConfigMap key `routing.json`; `kubemoe serve` writes it to a file;
frontends, and expert functions that load experts in place, watch either (`kubemoe.routing_watch`)
and validate what they read here. Its format is the protobuf JSON form of `kubemoe.v1.RoutingTable`.
Every side imports this module, never another side.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import json_format

from kubemoe.bundles import Bundle, format_bundle_spec
from kubemoe.proto import kubemoe_pb2 as pb

LOCAL = "local"  # the endpoint address of experts computed inside the frontend process
CONFIGMAP_KEY = "routing.json"


class RoutingTableError(ValueError):
    """A routing table that cannot be used; the message says what is wrong."""


@dataclass(frozen=True)
class BundleRoute:
    bundle: str
    addresses: tuple[str, ...]  # replicas of the bundle: JSQ picks among them per call


@dataclass(frozen=True)
class RouteMap:
    """A validated routing table: (layer, expert) -> the bundle serving it and its endpoints."""

    version: int
    routes: dict[tuple[int, int], BundleRoute]

    def addresses(self) -> set[str]:
        return {a for r in self.routes.values() for a in r.addresses}


def parse_table(text: str) -> pb.RoutingTable:
    try:
        return json_format.Parse(text, pb.RoutingTable())
    except json_format.ParseError as e:
        raise RoutingTableError(f"routing table is not a kubemoe.v1.RoutingTable in JSON: {e}") from None


def to_json(table: pb.RoutingTable) -> str:
    return json_format.MessageToJson(table, indent=2)


def table_for_bundles(model: str, bundles: list[Bundle], addresses: dict[str, list[str]], version: int = 1) -> pb.RoutingTable:
    """A table routing each bundle to its addresses (`LOCAL` for in-process experts)."""
    return pb.RoutingTable(model=model, version=version, routes=[
        pb.Route(bundle=b.name, experts=[pb.ExpertKey(layer=l, expert=e) for l, e in b.experts],
                 endpoints=[pb.Endpoint(address=a, replicas=1, weight=1.0 / len(addresses[b.name])) for a in addresses[b.name]])
        for b in bundles
    ])


def build_route_map(table: pb.RoutingTable, model: str, moe_layers, num_experts: int) -> RouteMap:
    """Check that the table serves exactly every routed expert of the model, once."""
    if table.model and table.model != model:
        raise RoutingTableError(f"routing table is for model {table.model!r}, this frontend serves {model!r}")
    routes: dict[tuple[int, int], BundleRoute] = {}
    for route in table.routes:
        if not route.endpoints:
            raise RoutingTableError(f"bundle {route.bundle!r} has no endpoint")
        target = BundleRoute(route.bundle, tuple(e.address for e in route.endpoints))
        for key in route.experts:
            k = (key.layer, key.expert)
            if key.layer not in moe_layers or not 0 <= key.expert < num_experts:
                raise RoutingTableError(f"bundle {route.bundle!r} names ({key.layer}, {key.expert}), not an expert of this model")
            if k in routes:
                raise RoutingTableError(f"expert {k} is in two bundles: {routes[k].bundle!r} and {route.bundle!r}")
            routes[k] = target
    missing = [(l, e) for l in moe_layers for e in range(num_experts) if (l, e) not in routes]
    if missing:
        raise RoutingTableError(f"routing table serves no endpoint for experts {format_bundle_spec(missing)}")
    return RouteMap(table.version, routes)


ExpertKey = tuple[int, int]  # (layer, expert)


def held_by_address(table: pb.RoutingTable) -> dict[str, frozenset[ExpertKey]]:
    """address -> the experts the table sends there: what the expert function at that address must
    hold before the table may be used (`LOCAL` left out: the frontend's own)."""
    held: dict[str, set[ExpertKey]] = {}
    for route in table.routes:
        keys = {(k.layer, k.expert) for k in route.experts}
        for endpoint in route.endpoints:
            if endpoint.address != LOCAL:
                held.setdefault(endpoint.address, set()).update(keys)
    return {address: frozenset(keys) for address, keys in held.items()}


@dataclass(frozen=True)
class Moves:
    """From one table to the next, in place: experts to Load where the new table sends them first,
    and to Unload where no table sends them any more. Lossless order: load, switch tables, unload."""

    load: dict[str, tuple[ExpertKey, ...]]
    unload: dict[str, tuple[ExpertKey, ...]]

    @property
    def empty(self) -> bool:
        return not self.load and not self.unload


def moves_between(before: pb.RoutingTable | None, after: pb.RoutingTable) -> Moves:
    old = held_by_address(before) if before is not None else {}
    new = held_by_address(after)
    gain = {a: tuple(sorted(keys - old.get(a, frozenset()))) for a, keys in new.items()}
    drop = {a: tuple(sorted(keys - new.get(a, frozenset()))) for a, keys in old.items()}
    return Moves({a: k for a, k in gain.items() if k}, {a: k for a, k in drop.items() if k})
