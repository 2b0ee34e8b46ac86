"""Rendering: a MoEDeployment and its plan -> every Kubernetes object the operator applies.

Pure: no I/O, same input -> same objects, so applying twice changes nothing. Children carry an
owner reference (the garbage collector deletes them with the MoEDeployment), `app.kubernetes.io/*`
labels, and a fingerprint annotation that lets the operator skip objects that did not change.

Expert addresses in the routing table are cluster DNS names, never pod IPs: with runtime knative the
Knative Service's address `<ksvc>.<ns>.svc.cluster.local:80` (Knative's ingress-free private path
through the activator or straight to the pods when warm, speaking h2c); with runtime deployment the
ClusterIP Service `<svc>.<ns>.svc.cluster.local:8080`. One address per (bundle, node) service, so the
frontend's join-the-shortest-queue chooses between the nodes of a bundle.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Mapping

from kubemoe import offload_env, ports
from kubemoe.bundles import Bundle
from google.protobuf import json_format

from kubemoe.operator.config import OperatorConfig
from kubemoe.operator.plan import GPU, GPU_COUNT_LABEL, Plan, Retired, ServiceKey
from kubemoe.operator.spec import API_VERSION, KIND, MoEDeployment, MoESpec
from kubemoe.routing_table import CONFIGMAP_KEY, LOCAL, table_for_bundles

Object = dict[str, Any]

# Labels and annotations (their values are what `observe` reads back after a restart).
NAME, INSTANCE, COMPONENT = "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"
PART_OF, MANAGED_BY = "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by"
BUNDLE_LABEL = "kubemoe.io/bundle"
NODE_LABEL = "kubemoe.io/node-hash"         # node names may exceed the 63 characters of a label value
NODE_ANNOTATION = "kubemoe.io/node"
REPLICAS_ANNOTATION = "kubemoe.io/replicas"
RETIRED_ANNOTATION = "kubemoe.io/retired-at"  # unix seconds; present = out of the plan, kept warm
VERSION_ANNOTATION = "kubemoe.io/plan-version"
FINGERPRINT_ANNOTATION = "kubemoe.io/fingerprint"
MANAGER = "kubemoe-operator"
FRONTEND, EXPERT, ROUTING = "frontend", "expert", "routing"

HTTP_PORT, GRPC_PORT, EXPERT_PORT, METRICS_PORT = (ports.FRONTEND_HTTP, ports.FRONTEND_GRPC, ports.EXPERT_GRPC,
                                                  ports.EXPERT_METRICS)
KNATIVE_PORT = 80  # a Knative Service's cluster-local address listens on 80 and forwards to the h2c port
MODEL_MOUNT = "/models"
KNATIVE = ("serving.knative.dev/v1", "Service")
# Kinds the operator renders and prunes: (apiVersion, kind) in apply order (a Role before its binding).
KINDS = (("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "Role"),
         ("rbac.authorization.k8s.io/v1", "RoleBinding"), ("v1", "ConfigMap"), ("v1", "Service"),
         ("apps/v1", "Deployment"), KNATIVE)


def child_name(*parts: str, limit: int = 63) -> str:
    """A DNS-1123 label from parts; too long -> cut and suffixed with a hash of the whole, so still unique."""
    name = "-".join(p.strip("-") for p in parts if p).lower()
    if len(name) <= limit:
        return name
    return f"{name[:limit - 9].rstrip('-')}-{_digest(name)[:8]}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def node_hash(node: str) -> str:
    return _digest(node)[:10]


def expert_name(deployment: MoEDeployment, bundle: str, node: str) -> str:
    # Knative names revisions <ksvc>-00001, and a revision name is a label too: keep 6 characters spare.
    return child_name(deployment.name, bundle, node_hash(node)[:6], limit=57)


def labels(deployment: MoEDeployment, component: str) -> dict[str, str]:
    return {NAME: "kubemoe", INSTANCE: deployment.name, COMPONENT: component, PART_OF: "kubemoe",
            MANAGED_BY: MANAGER}


def selector(deployment: MoEDeployment, component: str) -> str:
    """Label selector of one component's children (or all children when component is empty)."""
    chosen = {INSTANCE: deployment.name, MANAGED_BY: MANAGER, **({COMPONENT: component} if component else {})}
    return ",".join(f"{k}={v}" for k, v in chosen.items())


def render(deployment: MoEDeployment, plan: Plan, config: OperatorConfig) -> list[Object]:
    """Every object of the deployment for this plan: frontend, routing table, expert services."""
    objects = [*_frontend(deployment, plan, config), _routing_configmap(deployment, plan)]
    bundles = {b.name: b for b in plan.bundles}
    for (bundle, node), replicas in plan.services().items():
        objects.extend(_expert(deployment, bundles[bundle], node, replicas, None, config))
    for (bundle, node), retired in sorted(plan.retired.items()):
        if bundle in bundles:  # a bundle the new spec no longer has is deleted, not kept warm
            objects.extend(_expert(deployment, bundles[bundle], node, retired.replicas, retired, config))
    return [_finish(deployment, obj) for obj in objects]


def _finish(deployment: MoEDeployment, obj: Object) -> Object:
    meta = obj["metadata"]
    meta["namespace"] = deployment.namespace
    meta["ownerReferences"] = [{"apiVersion": API_VERSION, "kind": KIND, "name": deployment.name,
                                "uid": deployment.uid, "controller": True, "blockOwnerDeletion": True}]
    meta.setdefault("annotations", {})[FINGERPRINT_ANNOTATION] = fingerprint(obj)
    return obj


def fingerprint(obj: Object) -> str:
    """Hash of an object as rendered (without its own fingerprint): equal hash = nothing to apply."""
    annotations = {k: v for k, v in obj["metadata"].get("annotations", {}).items() if k != FINGERPRINT_ANNOTATION}
    body = {**obj, "metadata": {**obj["metadata"], "annotations": annotations}}
    return _digest(json.dumps(body, sort_keys=True))[:16]


# -- frontend -----------------------------------------------------------------------------------------

def routing_configmap_name(deployment: MoEDeployment) -> str:
    return child_name(deployment.name, ROUTING)


def frontend_name(deployment: MoEDeployment) -> str:
    return child_name(deployment.name, FRONTEND)


def _frontend(deployment: MoEDeployment, plan: Plan, config: OperatorConfig) -> list[Object]:
    spec, name = deployment.spec, frontend_name(deployment)
    meta = {"name": name, "labels": labels(deployment, FRONTEND)}
    match = {INSTANCE: deployment.name, COMPONENT: FRONTEND}
    routing = routing_configmap_name(deployment)
    args = ["frontend", "--checkpoint", checkpoint_path(spec), "--routing-configmap",
            f"{deployment.namespace}/{routing}", "--host", "0.0.0.0", "--port", str(HTTP_PORT),
            "--grpc-port", str(GRPC_PORT), "--model", deployment.name, "--dtype", spec.dtype,
            # The predictor's d: at layer l the frontend predicts layer l+d's loads for /loads and the split.
            "--prediction-distance", str(spec.experts.scaling.prediction_distance)]
    # The mode and the offload settings, as `kubemoe frontend` reads them (kubemoe/offload_env.py).
    env = [{"name": "KUBEMOE_FRONTEND_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           *offload_env.render(plan.mode, spec.offload.gpu_memory_budget if spec.offload else None,
                               spec.offload.predictor if spec.offload else None)]
    container = {
        "name": FRONTEND, "image": spec.frontend.image or config.frontend_image, "args": args, "env": env,
        "ports": [{"name": "http", "containerPort": HTTP_PORT}, {"name": "grpc", "containerPort": GRPC_PORT}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 20,
                          "failureThreshold": 6},
        "resources": _resources(spec.frontend.resources, spec.frontend.gpus),
    }
    pod = _pod_spec(spec, container, spec.frontend.placement.node_selector, spec.frontend.placement.tolerations,
                    config)
    pod["serviceAccountName"] = name  # it watches the routing ConfigMap
    if plan.mode == "offload":
        # The offload path is for nodes with one (older, smaller) GPU: the whole node's GPU is the cache.
        pod["affinity"] = _node_affinity(GPU_COUNT_LABEL, "1")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": dict(meta),
         "rules": [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [routing],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": dict(meta),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": deployment.namespace}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": dict(meta), "spec": {
            "replicas": spec.frontend.replicas, "selector": {"matchLabels": match},
            "template": {"metadata": {"labels": labels(deployment, FRONTEND)}, "spec": pod}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": dict(meta), "spec": {
            "selector": match,
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http"},
                      {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "appProtocol": "kubernetes.io/h2c"}]}},
    ]


def _routing_configmap(deployment: MoEDeployment, plan: Plan) -> Object:
    bundles = [b for b in plan.bundles if plan.mode == "offload" or plan.nodes.get(b.name)]
    if plan.mode == "offload":
        addresses = {b.name: [LOCAL] for b in bundles}  # the offload frontend computes every expert itself
    else:
        addresses = {b.name: [expert_address(deployment, b.name, node) for node in sorted(set(plan.nodes[b.name]))]
                     for b in bundles}
    table = table_for_bundles(deployment.name, bundles, addresses, plan.version)
    services = plan.services()
    for route in table.routes:  # replicas and load share per endpoint, as planned
        nodes = sorted(set(plan.nodes.get(route.bundle, ())))
        for endpoint, node in zip(route.endpoints, nodes):
            endpoint.replicas = services[(route.bundle, node)]
            endpoint.weight = endpoint.replicas / len(plan.nodes[route.bundle])
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": routing_configmap_name(deployment), "labels": labels(deployment, ROUTING),
                         "annotations": {VERSION_ANNOTATION: str(plan.version)}},
            "data": {CONFIGMAP_KEY: compact_json(table)}}


def compact_json(table) -> str:
    """The table's protobuf JSON without whitespace: a ConfigMap holds at most 1 MiB, and a
    DeepSeek-V3-sized table (58 x 256 experts, ~600 endpoints) is ~0.5 MB compact, >1 MiB indented."""
    return json.dumps(json_format.MessageToDict(table), separators=(",", ":"))


def expert_address(deployment: MoEDeployment, bundle: str, node: str) -> str:
    port = KNATIVE_PORT if deployment.spec.experts.runtime == "knative" else EXPERT_PORT
    return f"{expert_name(deployment, bundle, node)}.{deployment.namespace}.svc.cluster.local:{port}"


# -- expert functions ---------------------------------------------------------------------------------

def _expert(deployment: MoEDeployment, bundle: Bundle, node: str, replicas: int, retired: Retired | None,
            config: OperatorConfig) -> list[Object]:
    """One (bundle, node) service. A retired one renders exactly as when it was active (so its pods
    stay warm: changing a Knative template would start a new revision with cold pods) plus a
    retired-at annotation, and the routing table no longer names it."""
    spec = deployment.spec
    bundle_name = bundle.name
    name = expert_name(deployment, bundle_name, node)
    pod_labels = {**labels(deployment, EXPERT), BUNDLE_LABEL: bundle_name, NODE_LABEL: node_hash(node)}
    annotations = {NODE_ANNOTATION: node, REPLICAS_ANNOTATION: str(replicas)}
    if retired is not None:
        annotations[RETIRED_ANNOTATION] = f"{retired.since:.0f}"
    meta = {"name": name, "labels": pod_labels, "annotations": annotations}
    container = {
        "name": "expert-fn", "image": spec.experts.image or config.expert_image,
        "args": ["expert-fn", "--checkpoint", checkpoint_path(spec), "--bundle", bundle.spec(),
                 "--port", str(EXPERT_PORT), "--metrics-port", str(METRICS_PORT), "--model", deployment.name,
                 "--dtype", spec.dtype, "--data-port", str(ports.EXPERT_DATA), "--data-host", "$(POD_IP)"],
        # Frontends on other nodes connect TCP lanes straight to this pod (expert_fn/frames.py).
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "h2c", "containerPort": EXPERT_PORT}],
        "resources": _resources(spec.experts.resources, spec.experts.gpus),
    }
    tolerations = spec.experts.placement.tolerations
    pod = _pod_spec(spec, container, {}, tolerations, config)
    pod["affinity"] = _node_affinity("kubernetes.io/hostname", node)  # exact placement: one node per service
    pod["automountServiceAccountToken"] = False  # expert functions never talk to the API server
    if spec.experts.runtime == "knative":
        scaling = spec.experts.scaling
        template_annotations = {
            "autoscaling.knative.dev/min-scale": str(replicas),
            "autoscaling.knative.dev/max-scale": str(max(replicas, scaling.max_replicas_per_expert)),
            "autoscaling.knative.dev/initial-scale": str(replicas),
            "autoscaling.knative.dev/scale-down-delay": scaling.keep_alive,
            "serving.knative.dev/progress-deadline": spec.experts.knative.progress_deadline,
        }
        pod["containerConcurrency"] = spec.experts.knative.container_concurrency
        return [{"apiVersion": KNATIVE[0], "kind": KNATIVE[1], "metadata": meta, "spec": {"template": {
            "metadata": {"labels": pod_labels, "annotations": template_annotations}, "spec": pod}}}]
    container["readinessProbe"] = {"grpc": {"port": EXPERT_PORT}, "periodSeconds": 5}
    match = {INSTANCE: deployment.name, COMPONENT: EXPERT, BUNDLE_LABEL: bundle_name, NODE_LABEL: node_hash(node)}
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {
            "replicas": replicas, "selector": {"matchLabels": match},
            "template": {"metadata": {"labels": pod_labels}, "spec": pod}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {**meta, "annotations": dict(annotations)}, "spec": {
            "selector": match,
            "ports": [{"name": "h2c", "port": EXPERT_PORT, "targetPort": "h2c", "appProtocol": "kubernetes.io/h2c"}]}},
    ]


# -- pods ---------------------------------------------------------------------------------------------

def checkpoint_path(spec: MoESpec) -> str:
    source = spec.source
    if source.scheme == "pvc" and source.sub_path:
        return f"{MODEL_MOUNT}/{source.sub_path}"
    return MODEL_MOUNT


def _pod_spec(spec: MoESpec, container: Object, node_selector: Mapping[str, str],
              tolerations: Iterable[Mapping[str, Any]], config: OperatorConfig) -> Object:
    """A pod around `container` with the model volume, a writable /tmp and a strict security context."""
    volumes, init = _model_volume(spec, config)
    container = {**container,
                 "env": [*container.get("env", []), {"name": "HOME", "value": "/tmp"}],
                 "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True},
                                  {"name": "tmp", "mountPath": "/tmp"}],
                 "securityContext": SECURITY_CONTEXT}
    pod: Object = {"containers": [container], "volumes": [*volumes, {"name": "tmp", "emptyDir": {}}]}
    if init:
        pod["initContainers"] = init
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod["tolerations"] = [dict(t) for t in tolerations]
    return pod


# Restricted Pod Security Standard, at container level (Knative accepts it there without feature flags).
SECURITY_CONTEXT = {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def _model_volume(spec: MoESpec, config: OperatorConfig) -> tuple[list[Object], list[Object]]:
    source = spec.source
    if source.scheme == "pvc":
        return [{"name": "model", "persistentVolumeClaim": {"claimName": source.location, "readOnly": True}}], []
    if source.scheme == "hostpath":
        return [{"name": "model", "hostPath": {"path": source.location, "type": "Directory"}}], []
    # Object stores: an init container copies the checkpoint into an emptyDir before the server starts;
    # credentials come from the pod's identity (IRSA, workload identity), never from the spec.
    image, command = ((config.s3_fetch_image, ["aws", "s3", "sync", "--only-show-errors", source.location, MODEL_MOUNT])
                      if source.scheme == "s3" else
                      (config.gs_fetch_image, ["gcloud", "storage", "rsync", "--recursive", source.location, MODEL_MOUNT]))
    fetch = {"name": "fetch-model", "image": image, "command": command,
             "env": [{"name": "HOME", "value": "/tmp"}],
             "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}],
             "securityContext": SECURITY_CONTEXT}
    return [{"name": "model", "emptyDir": {}}], [fetch]


def _resources(resources: Mapping[str, Any], gpus: int) -> Object:
    out = {k: dict(v) for k, v in resources.items() if k in ("requests", "limits")}
    if gpus:
        out.setdefault("limits", {})[GPU] = str(gpus)
    return out


def _node_affinity(key: str, value: str) -> Object:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": key, "operator": "In", "values": [value]}]}]}}}


# -- reading a previous plan back from the cluster ----------------------------------------------------

def observe(spec: MoESpec, mode: str, children: Iterable[Object]) -> Plan:
    """The plan the cluster holds, from the expert services' annotations and the routing ConfigMap:
    what `plan()` gets as `previous`, so a restarted operator continues where it stopped."""
    nodes: dict[str, list[str]] = {}
    retired: dict[ServiceKey, Retired] = {}
    version = 0
    for obj in children:
        meta = obj["metadata"]
        annotations, obj_labels = meta.get("annotations") or {}, meta.get("labels") or {}
        if obj_labels.get(COMPONENT) == ROUTING and obj["kind"] == "ConfigMap":
            version = max(version, int(annotations.get(VERSION_ANNOTATION, "0") or 0))
            continue
        if obj_labels.get(COMPONENT) != EXPERT or (obj["apiVersion"], obj["kind"]) not in (("apps/v1", "Deployment"), KNATIVE):
            continue  # one object per expert service: its Service (runtime deployment) would count twice
        bundle, node = obj_labels.get(BUNDLE_LABEL), annotations.get(NODE_ANNOTATION)
        replicas = int(annotations.get(REPLICAS_ANNOTATION, "1"))
        if not bundle or not node:
            continue
        if RETIRED_ANNOTATION in annotations:
            retired[(bundle, node)] = Retired(replicas, float(annotations[RETIRED_ANNOTATION]))
        else:
            nodes.setdefault(bundle, []).extend([node] * replicas)
    return Plan(mode, tuple(spec.bundles()), {b: tuple(sorted(n)) for b, n in nodes.items()}, retired, version)
