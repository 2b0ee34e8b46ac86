"""Following the routing table: watch a file or a ConfigMap for new versions.

The table's format and validation are the contract in `kubemoe.routing_table`, shared with the
operator. Frontends follow it (the dispatcher switches between engine steps, so no request ever
sees half a table), and so do expert functions that gain and drop experts in place
(`kubemoe.expert_fn.follow`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any, Awaitable, Callable, Coroutine

from kubemoe.proto import kubemoe_pb2 as pb
from kubemoe.routing_table import CONFIGMAP_KEY, RoutingTableError, parse_table

log = logging.getLogger(__name__)


async def watch_file(path: Path, on_table: Callable[[pb.RoutingTable], Awaitable[None]], interval: float = 1.0) -> None:
    """Call `on_table` with the file's table whenever its content changes (polling: works on any volume)."""
    last: str | None = None
    while True:
        text: str | None
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
            except Exception:  # noqa: BLE001 - one table that could not be followed ends nothing: the next may be
                log.exception("following routing table %s failed; watching on for the next", path)
        await asyncio.sleep(interval)


async def watch_configmap(namespace: str, name: str, on_table: Callable[[pb.RoutingTable], Coroutine[Any, Any, None]],
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
