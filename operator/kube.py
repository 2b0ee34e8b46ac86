"""The few Kubernetes API calls the operator makes, over the `kubernetes` client's connection.

Server-side apply for every child (re-applying is a no-op, a restart mid-way creates nothing twice),
plain list/delete, and a merge patch of the status subresource. Paths come from a fixed table of
the kinds kubemoe renders (no discovery round trips); every call is counted for the benchmarks.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from typing import Any, Mapping
from urllib.parse import urlencode

from kubemoe.operator.spec import GROUP, PLURAL, VERSION

# (apiVersion, kind) -> (path prefix, plural, namespaced)
RESOURCES: dict[tuple[str, str], tuple[str, str, bool]] = {
    ("v1", "ConfigMap"): ("/api/v1", "configmaps", True),
    ("v1", "Service"): ("/api/v1", "services", True),
    ("v1", "ServiceAccount"): ("/api/v1", "serviceaccounts", True),
    ("v1", "Pod"): ("/api/v1", "pods", True),
    ("v1", "Node"): ("/api/v1", "nodes", False),
    ("v1", "Namespace"): ("/api/v1", "namespaces", False),
    ("apps/v1", "Deployment"): ("/apis/apps/v1", "deployments", True),
    ("rbac.authorization.k8s.io/v1", "Role"): ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    ("serving.knative.dev/v1", "Service"): ("/apis/serving.knative.dev/v1", "services", True),
    ("resource.k8s.io/v1", "ResourceClaim"): ("/apis/resource.k8s.io/v1", "resourceclaims", True),
    ("resource.k8s.io/v1", "ResourceSlice"): ("/apis/resource.k8s.io/v1", "resourceslices", False),
    ("kopf.dev/v1", "ClusterKopfPeering"): ("/apis/kopf.dev/v1", "clusterkopfpeerings", False),
    ("kopf.dev/v1", "KopfPeering"): ("/apis/kopf.dev/v1", "kopfpeerings", True),
    (f"{GROUP}/{VERSION}", "MoEDeployment"): (f"/apis/{GROUP}/{VERSION}", PLURAL, True),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


def path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None) -> str:
    prefix, plural, namespaced = RESOURCES[(api_version, kind)]
    parts = [prefix] + ([f"namespaces/{namespace}"] if namespaced and namespace else []) + [plural]
    return "/".join(parts + ([name] if name else []))


class Kube:
    def __init__(self, api_client, field_manager: str):
        self.api, self.field_manager = api_client, field_manager
        self.calls: Counter[str] = Counter()  # by verb: apply, list, delete, patch, ...
        self._lock = threading.Lock()  # applies run in a thread pool

    def request(self, verb: str, method: str, url: str, body: Any = None, query: Mapping[str, str] | None = None,
                content_type: str = "application/json") -> dict[str, Any]:
        with self._lock:
            self.calls[verb] += 1
        if query:
            url = f"{url}?{urlencode(query)}"
        headers = {"Accept": "application/json", "Content-Type": content_type}
        # The client JSON-encodes dict bodies for JSON and YAML content types alike (JSON is YAML).
        method, full_url, headers, payload, _ = self.api.param_serialize(
            method=method, resource_path=url, header_params=headers, body=body, auth_settings=["BearerToken"])
        response = self.api.call_api(method, full_url, header_params=headers, body=payload)
        response.read()
        if response.status >= 300:
            # A Status object, or plain text: a group the server does not serve (no Knative) is "404 page not found".
            try:
                message = json.loads(response.data).get("message")
            except (ValueError, AttributeError):
                message = None
            raise ApiError(response.status, message or response.data.decode(errors="replace").strip())
        return json.loads(response.data or b"{}")

    def apply(self, obj: Mapping[str, Any], force: bool = True) -> dict[str, Any]:
        """Server-side apply: the operator owns every field it renders, and only those."""
        meta = obj["metadata"]
        url = path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        return self.request("apply", "PATCH", url, body=obj, content_type="application/apply-patch+yaml",
                            query={"fieldManager": self.field_manager, "force": str(force).lower()})

    def merge_patch(self, obj: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the object `obj` names (its apiVersion, kind, namespace and name)."""
        meta = obj["metadata"]
        return self.request("patch", "PATCH", path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]),
                            body=patch, content_type="application/merge-patch+json")

    def list(self, api_version: str, kind: str, namespace: str | None = None, label_selector: str = "") -> list[dict]:
        data = self.request("list", "GET", path(api_version, kind, namespace),
                            query={"labelSelector": label_selector} if label_selector else None)
        # Lists drop apiVersion/kind from their items; put them back so items look like what was applied.
        return [{"apiVersion": api_version, "kind": kind, **item} for item in data.get("items", [])]

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any]:
        return self.request("get", "GET", path(api_version, kind, namespace, name))

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self.request("create", "POST", path(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj)

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> None:
        try:
            # Background: the garbage collector removes the pods (and a Knative Service's revisions).
            self.request("delete", "DELETE", path(api_version, kind, namespace, name),
                         body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
        except ApiError as e:
            if e.status != 404:  # already gone is what we wanted
                raise

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        url = path(f"{GROUP}/{VERSION}", "MoEDeployment", namespace, name) + "/status"
        self.request("patch", "PATCH", url, body={"status": status}, content_type="application/merge-patch+json")
