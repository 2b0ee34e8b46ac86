"""What the operator reads, kept from a list and a watch of its own: the cluster's pods (capacity) and the
pods, Deployments and Knative Services it made (their readiness, for the status).

Kopf could keep them (indices), but it handles every event of every kind it watches through its whole
machinery (~1.5 ms an event, py-spy at 1000 nodes): a step that starts 1000 pods brings ~5000 pod and
Deployment events, and cluster-wide pods churn all the time in a large cluster. Here an event costs a JSON
decode and a dict update, in a thread of its own; Kopf keeps what it is for, the MoEDeployments' handlers.

One thread a (kind, namespace): a list, then a watch from its resourceVersion (bookmarks on), listed again
after any error, an expired resourceVersion (410) or the server ending the watch, with a growing pause
between failed tries. A kind the server does not serve (Knative not installed: 404) is tried again now and
then, so installing Knative later needs no restart.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Callable
from urllib.parse import urlencode

from kubemoe.operator.kube import path
from kubemoe.operator.render import Object

log = logging.getLogger(__name__)

RETRY_S = (1.0, 30.0)  # the pause after a failed list or watch: doubling from the first to the second
NOT_SERVED_RETRY_S = 60.0  # a kind the server does not serve (404)
WATCH_S = 300  # how long the server keeps one watch open before this lists again from where it was


class NotServed(Exception):
    pass


class ListWatch:
    """The objects of one kind (in one namespace, or all; matching a label selector) as the API server has
    them, by uid. `on_change(obj)` runs in the watch's thread for each object listed, added, modified or
    deleted (after it is gone from `values()`), so keep it short (the operator hands it to its event loop)."""

    def __init__(self, api_client, api_version: str, kind: str, namespace: str | None = None,
                 label_selector: str = "", on_change: Callable[[Object], None] | None = None):
        self.api, self.api_version, self.kind = api_client, api_version, kind
        self.url, self.selector, self.on_change = path(api_version, kind, namespace), label_selector, on_change
        self._objects: dict[str, Object] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.synced = threading.Event()  # the first list is in
        self._thread = threading.Thread(target=self._run, name=f"watch-{kind.lower()}-{namespace or 'all'}",
                                        daemon=True)

    def start(self) -> "ListWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()  # the thread ends after its current watch (a daemon: it never holds the exit)

    def values(self) -> list[Object]:
        """A copy of what is known now (empty until the first list, or while the kind is not served)."""
        with self._lock:
            return list(self._objects.values())

    def _run(self) -> None:
        pause, told = RETRY_S[0], False
        while not self._stopped.is_set():
            try:
                version = self._list()
                pause = RETRY_S[0]
                while not self._stopped.is_set():
                    version = self._watch(version)
            except NotServed:
                if not told:  # once: without Knative installed this stays so for good
                    log.info("%s %s are not served here (yet); looking again every %.0fs", self.api_version,
                             self.kind, NOT_SERVED_RETRY_S)
                    told = True
                self._stopped.wait(NOT_SERVED_RETRY_S)
            except Exception as e:  # noqa: BLE001 - the watch goes on: list again after a pause
                log.warning("watch of %s failed (%s); listing again in %.0fs", self.url, e, pause)
                self._stopped.wait(pause)
                pause = min(pause * 2, RETRY_S[1])

    def _get(self, query: dict[str, str], timeout):
        selector = {"labelSelector": self.selector} if self.selector else {}
        method, url, headers, _, _ = self.api.param_serialize(
            method="GET", resource_path=f"{self.url}?{urlencode({**selector, **query})}",
            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"])
        response = self.api.rest_client.request(method, url, headers=headers, _request_timeout=timeout)
        if response.status == 404:
            raise NotServed()
        if response.status != 200:
            raise RuntimeError(f"{response.status} {response.read()[:200]!r}")
        return response

    def _list(self) -> str:
        data = json.loads(self._get({}, 60).read())
        objects = {}
        for item in data.get("items", []):
            objects[item["metadata"]["uid"]] = {"apiVersion": self.api_version, "kind": self.kind, **item}
        with self._lock:
            self._objects = objects
        self.synced.set()
        if self.on_change:
            for obj in objects.values():
                self.on_change(obj)
        return data["metadata"]["resourceVersion"]

    def _watch(self, version: str) -> str:
        """One watch from `version` until the server ends it -> the last version seen (a bookmark's too)."""
        response = self._get({"watch": "true", "resourceVersion": version, "allowWatchBookmarks": "true",
                              "timeoutSeconds": str(WATCH_S)}, (10, WATCH_S + 30))
        for line in response.response:  # urllib3's response, a line an event as they arrive
            if not line.strip():
                continue
            event = json.loads(line)
            kind, obj = event["type"], event["object"]
            if kind == "ERROR":  # e.g. 410 Gone: the version is too old; _run lists again
                raise RuntimeError(obj.get("message", obj))
            version = obj["metadata"]["resourceVersion"]
            if kind == "BOOKMARK":
                continue
            obj = {"apiVersion": self.api_version, "kind": self.kind, **obj}
            with self._lock:
                if kind == "DELETED":
                    self._objects.pop(obj["metadata"]["uid"], None)
                else:
                    self._objects[obj["metadata"]["uid"]] = obj
            if self.on_change:
                self.on_change(obj)
            if self._stopped.is_set():
                break
        return version

