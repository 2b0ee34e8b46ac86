"""The operator's own list+watch (operator/watch.py) against the test control plane's API server."""

from __future__ import annotations

import threading
import time

import pytest
from kubernetes import client

from kubemoe.operator import kube
from kubemoe.operator import watch as watch_module
from kubemoe.operator.watch import ListWatch

pytestmark = pytest.mark.cluster


def until(check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError("not reached within the timeout")


def configmap(name: str, value: str, labels: dict[str, str]) -> dict:
    return {"metadata": {"name": name, "labels": labels}, "data": {"v": value}}


def test_a_list_watch_follows_creates_updates_and_deletes_across_watches(api, namespace, monkeypatch):
    monkeypatch.setattr(watch_module, "WATCH_S", 1)  # the server ends each watch after a second: resumed from its version
    core = client.CoreV1Api(api)
    core.create_namespaced_config_map(namespace, configmap("before", "0", {"team": "a"}))
    core.create_namespaced_config_map(namespace, configmap("other", "0", {"team": "b"}))
    seen: list[tuple[str, str]] = []
    lock = threading.Lock()

    def changed(obj):
        with lock:
            seen.append((obj["metadata"]["name"], obj["data"]["v"], obj["metadata"]["name"] in names(watch)))

    def names(watch) -> set[str]:
        return {o["metadata"]["name"] for o in watch.values()}

    watch = ListWatch(api, "v1", "ConfigMap", namespace, "team=a", on_change=changed).start()
    try:
        assert watch.synced.wait(20)
        assert [o["metadata"]["name"] for o in watch.values()] == ["before"]  # the selector: not "other"
        assert watch.values()[0]["kind"] == "ConfigMap"  # as applied, though lists drop it
        time.sleep(2.5)  # across a watch the server ended
        core.create_namespaced_config_map(namespace, configmap("after", "1", {"team": "a"}))
        core.patch_namespaced_config_map("before", namespace, {"data": {"v": "2"}})
        until(lambda: {(o["metadata"]["name"], o["data"]["v"]) for o in watch.values()} == {("before", "2"),
                                                                                             ("after", "1")})
        core.delete_namespaced_config_map("after", namespace)
        until(lambda: [o["metadata"]["name"] for o in watch.values()] == ["before"])
        with lock:  # each change told once the watch holds it; the delete once it is gone
            assert seen[0] == ("before", "0", True) and ("before", "2", True) in seen
            assert [s for s in seen if s[0] == "after"] == [("after", "1", True), ("after", "1", False)]
    finally:
        watch.stop()


def test_a_kind_the_server_does_not_serve_leaves_the_watch_empty_and_waiting(api, namespace, monkeypatch):
    monkeypatch.setattr(watch_module, "NOT_SERVED_RETRY_S", 0.2)
    monkeypatch.setitem(kube.RESOURCES, ("example.com/v1", "Widget"), ("/apis/example.com/v1", "widgets", True))
    watch = ListWatch(api, "example.com/v1", "Widget", namespace).start()
    try:
        time.sleep(1)
        assert not watch.synced.is_set() and watch.values() == [] and watch._thread.is_alive()
    finally:
        watch.stop()
