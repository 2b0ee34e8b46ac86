"""The frontend follows a routing table ConfigMap on a real API server (as the operator writes it)."""

import asyncio

import pytest
from kubernetes import client

from kubemoe.bundles import bundles_by_count
from kubemoe.routing_watch import watch_configmap
from kubemoe.routing_table import CONFIGMAP_KEY, LOCAL, table_for_bundles, to_json


@pytest.mark.cluster
async def test_configmap_versions_reach_the_frontend(api, namespace):
    core = client.CoreV1Api(api)
    bundles = bundles_by_count((1, 3), 8, 2)

    def body(version, text=None):
        data = text if text is not None else to_json(table_for_bundles("m", bundles, {b.name: [LOCAL] for b in bundles}, version))
        return {"metadata": {"name": "routing"}, "data": {CONFIGMAP_KEY: data}}

    core.create_namespaced_config_map(namespace, body(1))
    seen = asyncio.Queue()

    async def on_table(table):
        await seen.put(table.version)

    watcher = asyncio.create_task(watch_configmap(namespace, "routing", on_table, api_client=api))
    try:
        assert await asyncio.wait_for(seen.get(), 30) == 1
        core.replace_namespaced_config_map("routing", namespace, body(2, "not json"))  # refused, logged
        core.replace_namespaced_config_map("routing", namespace, body(3))
        assert await asyncio.wait_for(seen.get(), 30) == 3
    finally:
        watcher.cancel()
