"""The routing table: which endpoints serve each (layer, expert), read from a file or a ConfigMap.

The operator writes it (a ConfigMap key `routing.json`); `kubemoe serve` writes a file. Its format is
the protobuf JSON form of `kubemoe.v1.RoutingTable`. A watcher reports new versions; the dispatcher
switches to them between engine steps, so no request ever sees half a table.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from google.protobuf import json_format

from kubemoe.bundles import Bundle, format_bundle_spec
from kubemoe.proto import kubemoe_pb2 as pb

log = logging.getLogger(__name__)

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


async def watch_file(path: Path, on_table: Callable[[pb.RoutingTable], Awaitable[None]], interval: float = 1.0) -> None:
    """Call `on_table` with the file's table whenever its content changes (polling: works on any volume)."""
    last = None
    while True:
        try:
            text = path.read_text()
        except OSError as e:
            log.warning("cannot read routing table %s: %s", path, e)
            text = last
        if text != last and text is not None:
            last = text
            try:
                await on_table(parse_table(text))
            except RoutingTableError as e:
                log.error("ignoring routing table %s: %s", path, e)
        await asyncio.sleep(interval)


async def watch_configmap(namespace: str, name: str, on_table: Callable[[pb.RoutingTable], Awaitable[None]],
                          api_client=None) -> None:
    """Watch a ConfigMap's `routing.json` key until cancelled.

    Credentials: `api_client` if given, else in-cluster (the pod's service account), else kubeconfig.
    """
    from kubernetes import client, config, watch

    if api_client is None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
    api = client.CoreV1Api(api_client)
    loop = asyncio.get_running_loop()
    stop = threading.Event()

    def follow() -> None:  # the kubernetes client is synchronous: it watches on a thread of its own
        while not stop.is_set():
            try:
                for event in watch.Watch().stream(api.list_namespaced_config_map, namespace,
                                                  field_selector=f"metadata.name={name}", timeout_seconds=60):
                    if stop.is_set():
                        return
                    data = (event["object"].data or {}).get(CONFIGMAP_KEY)
                    if not data or event["type"] not in ("ADDED", "MODIFIED"):
                        continue
                    try:
                        table = parse_table(data)
                    except RoutingTableError as e:
                        log.error("ignoring ConfigMap %s/%s: %s", namespace, name, e)
                        continue
                    asyncio.run_coroutine_threadsafe(on_table(table), loop).result()
            except Exception as e:  # noqa: BLE001 - a broken watch is re-opened, never fatal
                if not stop.is_set():
                    log.warning("routing ConfigMap %s/%s watch ended (%s); re-opening", namespace, name, e)
                    stop.wait(1.0)

    threading.Thread(target=follow, name=f"watch-{namespace}-{name}", daemon=True).start()
    try:
        await asyncio.Event().wait()  # until cancelled
    finally:
        stop.set()
