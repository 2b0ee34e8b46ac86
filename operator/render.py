"""Rendering: a MoEDeployment and its plan -> every Kubernetes object the operator applies.

Pure: no I/O, same input -> same objects, so applying twice changes nothing. Children carry an
owner reference (the garbage collector deletes them with the MoEDeployment), `app.kubernetes.io/*`
labels, and a fingerprint annotation that lets the operator skip objects that did not change.

Expert addresses in the routing table are cluster DNS names, never pod IPs: with runtime knative the
Knative Service's address `<ksvc>.<ns>.svc.cluster.local:80` (Knative's ingress-free private path
through the activator or straight to the pods when warm, speaking h2c); with runtime pods the
pods' own names under one headless Service of the deployment's expert functions,
`<function>.<deployment>-experts.<ns>.svc.cluster.local:8080` (each function's pods take its name as
their hostname). One address per (bundle, node) service, so the frontend's join-the-shortest-queue
chooses between the nodes of a bundle. One headless Service, not a ClusterIP Service per function:
at 1000 functions a Service each cost the API server a third of its writes (the Service, its cluster
IP's IPAddress, Endpoints and EndpointSlices created and updated as pods turn Ready;
benchmarks/operator_plan.py), and every node's kube-proxy a rule set each. For the same reason a
function's pods are the operator's own, not a Deployment's: ReplicaSets, their and the Deployments' status
and events were two thirds of the writes when ~640 functions start (benchmarks/experiments/
workload_kinds_probe.py: 640 bare pods Ready in 4.8 s, 640 one-replica Deployments in 12.2 s). The
operator does what the Deployment did: it re-creates a pod that ended and replaces a changed one only
once its successor is Ready (diff.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any, Iterable, Mapping

from kubemoe import offload_env, ports
from kubemoe.pod_args import NODE_SHM_HOST_PATH, NODE_SHM_MOUNT, ExpertFnArgs, FrontendArgs, node_shm_dir
from kubemoe.bundles import Bundle
from google.protobuf import json_format

from kubemoe.operator.config import OperatorConfig
from kubemoe.operator.plan import (GPU, GPU_COUNT_LABEL, NVIDIA_DRA_DRIVER, Plan, Retired, ServiceKey, function_bytes,
                                   node_of)
from kubemoe.operator.spec import API_VERSION, KIND, MoEDeployment, MoESpec
from kubemoe.routing_table import CONFIGMAP_KEY, LOCAL, RoutingTableError, parse_table, table_for_bundles

Object = dict[str, Any]

# Labels and annotations (their values are what `observe` reads back after a restart).
NAME, INSTANCE, COMPONENT = "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"
PART_OF, MANAGED_BY = "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by"
BUNDLE_LABEL = "kubemoe.io/bundle"
FUNCTION_LABEL = "kubemoe.io/function"     # runtime pods: the function (its hostname) a pod is a replica of
NODE_LABEL = "kubemoe.io/node-hash"         # node names may exceed the 63 characters of a label value
NODE_ANNOTATION = "kubemoe.io/node"
GPU_ANNOTATION = "kubemoe.io/gpu"           # gpuSharing dra: the GPU of the node (site node/gpuN) it runs on
# On expert pods, for other MoEDeployments' plans (operator/capacity.py): the GPU memory one function takes.
FUNCTION_MEMORY_ANNOTATION = "kubemoe.io/gpu-memory"
VERSION_ANNOTATION = "kubemoe.io/plan-version"
# In the routing ConfigMap beside its table: the services out of the plan, kept warm until their keep-alive ends,
# [[bundle, site, replicas, since (unix seconds)], ...]. The table holds the plan's services and their replicas.
RETIRED_KEY = "retired.json"
FINGERPRINT_ANNOTATION = "kubemoe.io/fingerprint"
MANAGER = "kubemoe-operator"
FRONTEND, EXPERT, ROUTING = "frontend", "expert", "routing"

HTTP_PORT, GRPC_PORT, EXPERT_PORT, METRICS_PORT = (ports.FRONTEND_HTTP, ports.FRONTEND_GRPC, ports.EXPERT_GRPC,
                                                  ports.EXPERT_METRICS)
KNATIVE_PORT = 80  # a Knative Service's cluster-local address listens on 80 and forwards to the h2c port
MODEL_MOUNT = "/models"
KNATIVE = ("serving.knative.dev/v1", "Service")
RESOURCE_CLAIM = ("resource.k8s.io/v1", "ResourceClaim")  # GA since Kubernetes 1.34
# Kinds the operator renders and prunes: (apiVersion, kind) in apply order (a Role before its binding,
# a GPU's ResourceClaim before the pods that use it).
KINDS = (("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "Role"),
         ("rbac.authorization.k8s.io/v1", "RoleBinding"), RESOURCE_CLAIM, ("v1", "ConfigMap"), ("v1", "Service"),
         ("v1", "Pod"), ("apps/v1", "Deployment"), KNATIVE)
# The kinds of an expert function's objects: runtime pods, one per replica; runtime knative, one a function.
EXPERT_KINDS = (("v1", "Pod"), KNATIVE)
# Kinds whose API a cluster may not serve (Knative not installed, Kubernetes before 1.34): nothing to list.
OPTIONAL_KINDS = (KNATIVE, RESOURCE_CLAIM)
# The API version of the NVIDIA DRA driver's opaque GpuConfig.
NVIDIA_GPU_CONFIG = "resource.nvidia.com/v1beta1"
MPS_MEMORY_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"  # an MPS client's device memory limit, "0=<MiB>M"
CLAIM = "gpu"  # the pod's name for its GPU claim
NODE_SHM_VOLUME = "node-shm"  # spec.dataPath.sameNode hostShm: the node's /dev/shm


def child_name(*parts: str, limit: int = 63) -> str:
    """A DNS-1035 label from parts (what Services need: a MoEDeployment named phi-3.5-moe is a valid
    DNS subdomain, but its dots may not reach a Service's name); too long or changed -> cut and suffixed
    with a hash of the whole, so still unique."""
    whole = "-".join(p.strip("-") for p in parts if p).lower()
    name = re.sub(r"[^a-z0-9-]", "-", whole)
    if len(name) <= limit and name == whole:
        return name
    return f"{name[:limit - 9].rstrip('-')}-{_digest(whole)[:8]}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def node_hash(node: str) -> str:
    return _digest(node)[:10]


def expert_name(deployment: MoEDeployment, bundle: str, site: str) -> str:
    # Knative names revisions <ksvc>-00001, and a revision name is a label too: keep 6 characters spare.
    return child_name(deployment.name, bundle, node_hash(site)[:6], limit=57)


def labels(deployment: MoEDeployment, component: str) -> dict[str, str]:
    return {NAME: "kubemoe", INSTANCE: deployment.name, COMPONENT: component, PART_OF: "kubemoe",
            MANAGED_BY: MANAGER}


def selected(deployment: MoEDeployment, component: str) -> dict[str, str]:
    """The labels that pick one component's children (or all children when component is empty)."""
    return {INSTANCE: deployment.name, MANAGED_BY: MANAGER, **({COMPONENT: component} if component else {})}


def selector(deployment: MoEDeployment, component: str) -> str:
    """`selected` as a label selector."""
    return ",".join(f"{k}={v}" for k, v in selected(deployment, component).items())


def render(deployment: MoEDeployment, plan: Plan, config: OperatorConfig) -> list[Object]:
    """Every object of the deployment for this plan: frontend, routing table, expert services."""
    objects = [*_frontend(deployment, plan, config), _routing_configmap(deployment, plan)]
    if deployment.spec.experts.sharing.mode == "dra" and plan.mode != "offload":
        objects += [_gpu_claim(deployment, site) for site in sorted(plan.sites())]
    if deployment.spec.experts.runtime == "pods" and plan.mode != "offload":
        objects.append(_experts_service(deployment))
    bundles = {b.name: b for b in plan.bundles}
    for (bundle, node), replicas in plan.services().items():
        objects.extend(_expert(deployment, bundles[bundle], node, replicas, config))
    for (bundle, node), retired in sorted(plan.retired.items()):
        if bundle in bundles:  # a bundle the new spec no longer has is deleted, not kept warm
            objects.extend(_expert(deployment, bundles[bundle], node, retired.replicas, config))
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
    args = FrontendArgs(checkpoint=checkpoint_path(spec), routing_configmap=f"{deployment.namespace}/{routing}",
                        model=deployment.name, dtype=spec.dtype,
                        prediction_distance=spec.experts.scaling.prediction_distance,
                        shm_dir=shm_dir(deployment, plan.mode))
    # The mode and the offload settings, as `kubemoe frontend` reads them (kubemoe/offload_env.py): the budget
    # the plan chose (auto derives one), the predictor by name or as the file's path in the pod.
    predictor = None
    if spec.offload:
        predictor = spec.offload.predictor
        if spec.offload.predictor_file:
            predictor = f"{args.checkpoint}/{spec.offload.predictor_file}"
    env = [*args.env(), *offload_env.render(plan.mode, plan.gpu_budget, predictor)]
    container = {
        "name": FRONTEND, "image": spec.frontend.image or config.frontend_image, "args": args.args(), "env": env,
        "ports": [{"name": "http", "containerPort": args.port}, {"name": "grpc", "containerPort": args.grpc_port}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 20,
                          "failureThreshold": 6},
        "resources": _resources(spec.frontend.resources, spec.frontend.gpus),
    }
    pod = _pod_spec(spec, container, spec.frontend.placement.node_selector, spec.frontend.placement.tolerations,
                    config, args.shm_dir)
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
        for bundle, hosts in plan.hosted.items():  # replicas loaded in place into running functions
            addresses[bundle] += [expert_address(deployment, *host) for host in hosts]
    table = table_for_bundles(deployment.name, bundles, addresses, plan.version)
    services = plan.services()
    for route in table.routes:  # replicas and load share per endpoint, as planned
        nodes = sorted(set(plan.nodes.get(route.bundle, ())))
        for endpoint, node in zip(route.endpoints, nodes + [None] * len(plan.hosted.get(route.bundle, ()))):
            endpoint.replicas = services[(route.bundle, node)] if node is not None else 1
            endpoint.weight = endpoint.replicas / plan.replicas_of(route.bundle)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": routing_configmap_name(deployment), "labels": labels(deployment, ROUTING),
                         "annotations": {VERSION_ANNOTATION: str(plan.version)}},
            "data": {CONFIGMAP_KEY: compact_json(table),
                     RETIRED_KEY: json.dumps([[b, site, r.replicas, round(r.since)] for (b, site), r in
                                              sorted(plan.retired.items())], separators=(",", ":"))}}


def compact_json(table) -> str:
    """The table's protobuf JSON without whitespace: a ConfigMap holds at most 1 MiB, and a
    DeepSeek-V3-sized table (58 x 256 experts, ~600 endpoints) is ~0.5 MB compact, >1 MiB indented."""
    return json.dumps(json_format.MessageToDict(table), separators=(",", ":"))


def expert_address(deployment: MoEDeployment, bundle: str, node: str) -> str:
    name, namespace = expert_name(deployment, bundle, node), deployment.namespace
    if deployment.spec.experts.runtime == "knative":
        return f"{name}.{namespace}.svc.cluster.local:{KNATIVE_PORT}"
    return f"{name}.{experts_service_name(deployment)}.{namespace}.svc.cluster.local:{EXPERT_PORT}"


def experts_service_name(deployment: MoEDeployment) -> str:
    return child_name(deployment.name, "experts")


def _experts_service(deployment: MoEDeployment) -> Object:
    """Runtime pods: the headless Service under which each expert function's pods are found by its
    name (their hostname); the cluster DNS answers with the pods' IPs once they are Ready."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": experts_service_name(deployment), "labels": labels(deployment, EXPERT)},
            "spec": {"clusterIP": "None", "selector": {INSTANCE: deployment.name, COMPONENT: EXPERT},
                     "ports": [{"name": "h2c", "port": EXPERT_PORT, "targetPort": "h2c",
                                "appProtocol": "kubernetes.io/h2c"}]}}


# -- expert functions ---------------------------------------------------------------------------------

def _expert(deployment: MoEDeployment, bundle: Bundle, site: str, replicas: int,
            config: OperatorConfig) -> list[Object]:
    """One (bundle, site) service: a site is a node, or one GPU of it (node/gpuN) with gpuSharing dra.
    A retired one renders exactly as when it was active, so it is not written at all (its pods stay warm;
    changing a Knative template would start a new revision with cold pods): only the routing ConfigMap
    says it is retired (RETIRED_KEY), and its table no longer names it."""
    spec = deployment.spec
    bundle_name, node = bundle.name, node_of(site)
    name = expert_name(deployment, bundle_name, site)
    pod_labels = {**labels(deployment, EXPERT), BUNDLE_LABEL: bundle_name, NODE_LABEL: node_hash(site)}
    annotations = {NODE_ANNOTATION: node}
    if site != node:
        annotations[GPU_ANNOTATION] = site.partition("/")[2]
    meta = {"name": name, "labels": pod_labels, "annotations": annotations}
    # Its pods say where they were planned and what GPU memory they take, so that another MoEDeployment's
    # plan counts them (also while Pending), as the scheduler will.
    pod_annotations = {k: v for k, v in annotations.items() if k in (NODE_ANNOTATION, GPU_ANNOTATION)}
    if spec.experts.sharing.shared:
        pod_annotations[FUNCTION_MEMORY_ANNOTATION] = str(function_bytes(spec, bundle))
    args = ExpertFnArgs(checkpoint=checkpoint_path(spec), bundle=bundle.spec(), model=deployment.name,
                        dtype=spec.dtype, routing_configmap=f"{deployment.namespace}/{routing_configmap_name(deployment)}",
                        address=expert_address(deployment, bundle_name, site),
                        drop_after=int(spec.experts.scaling.keep_alive_s),
                        working_memory_mib=spec.experts.sharing.working_memory >> 20,
                        shm_dir=shm_dir(deployment, "distributed"))
    container = {
        "name": "expert-fn", "image": spec.experts.image or config.expert_image, "args": args.args(),
        "env": args.env(), "ports": [{"name": "h2c", "containerPort": args.port}],
        **_gpu_share(spec, bundle),
    }
    tolerations = spec.experts.placement.tolerations
    pod = _pod_spec(spec, container, {}, tolerations, config, args.shm_dir)
    pod["affinity"] = _on_node(node)  # exact placement: one node per service
    if spec.experts.sharing.mode == "dra":  # every function on this GPU shares its claim
        pod["resourceClaims"] = [{"name": CLAIM, "resourceClaimName": claim_name(deployment, site)}]
    # It reads the routing ConfigMap, and nothing else: the frontend's account may only read that.
    pod["serviceAccountName"] = frontend_name(deployment)
    if spec.experts.runtime == "knative":
        scaling = spec.experts.scaling
        template_annotations = {
            "autoscaling.knative.dev/min-scale": str(replicas),
            # The plan is the autoscaler: replicas Knative added on its own would hold GPU memory the placer
            # gave to other functions, and several services of a bundle each allowed maxReplicasPerExpert
            # would together pass it.
            "autoscaling.knative.dev/max-scale": str(replicas),
            "autoscaling.knative.dev/initial-scale": str(replicas),
            "autoscaling.knative.dev/scale-down-delay": scaling.keep_alive,
            "serving.knative.dev/progress-deadline": spec.experts.knative.progress_deadline,
            **pod_annotations,
        }
        pod["containerConcurrency"] = spec.experts.knative.container_concurrency
        return [{"apiVersion": KNATIVE[0], "kind": KNATIVE[1], "metadata": meta, "spec": {"template": {
            "metadata": {"labels": pod_labels, "annotations": template_annotations}, "spec": pod}}}]
    # Ready once the function serves its bundle (grpc.health.v1 says SERVING after the weights load), so the
    # headless Service names only pods that answer. (_pod_spec copied the container: set it on the pod's.)
    pod["containers"][0]["readinessProbe"] = {"grpc": {"port": args.port}, "periodSeconds": 5}
    pod["hostname"], pod["subdomain"] = name, experts_service_name(deployment)  # its address (expert_address)
    # A pod's spec cannot change: its name carries the spec's hash, so a changed spec renders new pods (the old
    # ones are deleted once these are Ready: diff.py). No plan changes a pod's labels or annotations.
    revision = _digest(json.dumps(pod, sort_keys=True))[:8]
    return [{"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": f"{name}-{revision}-{i}", "labels": {**pod_labels, FUNCTION_LABEL: name},
                          "annotations": {**annotations, **pod_annotations}},
             "spec": pod} for i in range(replicas)]


def pod_spec_of(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod spec an object runs: a Pod's own, a Deployment's or Knative Service's template's; None for
    objects that run none."""
    spec = obj.get("spec") or {}
    return spec if obj.get("kind") == "Pod" else (spec.get("template") or {}).get("spec")


def function_of(obj: Mapping[str, Any]) -> str:
    """The expert function an expert object belongs to: a pod's label, a Knative Service's own name."""
    meta = obj["metadata"]
    return (meta.get("labels") or {}).get(FUNCTION_LABEL) or meta["name"]


def _gpu_share(spec: MoESpec, bundle: Bundle) -> Object:
    """The container's resources (and env) for its GPUs, as spec.experts.gpuSharing says."""
    sharing = spec.experts.sharing
    resources = _resources(spec.experts.resources, 0 if sharing.shared else spec.experts.gpus)
    if sharing.mode == "exclusive":
        return {"resources": resources}
    if sharing.mode == "dra":
        resources["claims"] = [{"name": CLAIM}]
    else:  # one share of the device plugin's replicated resource (a limit: extended resources take no overcommit)
        resources.setdefault("limits", {})[sharing.resource_name] = "1"
    out: Object = {"resources": resources}
    if sharing.capped:
        # The MPS client limits itself to what the plan gave it (device 0: the one GPU the pod sees).
        out["env"] = [{"name": MPS_MEMORY_LIMIT_ENV, "value": f"0={_mib(function_bytes(spec, bundle))}M"}]
    return out


def _mib(n: int) -> int:
    return -(-n // 2**20)


def claim_name(deployment: MoEDeployment, site: str) -> str:
    # A claim's spec is immutable: a changed spec (DeviceClass, strategy) gets a new name, and pods move to it.
    spec_hash = _digest(json.dumps(_claim_spec(deployment.spec), sort_keys=True))[:6]
    return child_name(deployment.name, "gpu", node_hash(site)[:8], spec_hash)


def _claim_spec(spec: MoESpec) -> Object:
    sharing = spec.experts.sharing
    config: Object = {"strategy": sharing.strategy}
    if sharing.strategy == "MPS":
        largest = max(function_bytes(spec, b) for b in spec.bundles())
        config["mpsConfig"] = {"defaultPinnedDeviceMemoryLimit": f"{_mib(largest)}Mi"}
    return {"devices": {
        "requests": [{"name": CLAIM, "exactly": {"deviceClassName": sharing.device_class}}],
        "config": [{"requests": [CLAIM], "opaque": {"driver": NVIDIA_DRA_DRIVER, "parameters": {
            "apiVersion": NVIDIA_GPU_CONFIG, "kind": "GpuConfig", "sharing": config}}}]}}


def _gpu_claim(deployment: MoEDeployment, site: str) -> Object:
    """One GPU of the plan (dra): the pods of every function placed there reference this claim, so the
    scheduler allocates one device of the node for all of them (the first pod's node: they all have it)."""
    node, _, gpu = site.partition("/")
    return {"apiVersion": RESOURCE_CLAIM[0], "kind": RESOURCE_CLAIM[1],
            "metadata": {"name": claim_name(deployment, site), "labels": labels(deployment, EXPERT),
                         "annotations": {NODE_ANNOTATION: node, GPU_ANNOTATION: gpu}},
            "spec": _claim_spec(deployment.spec)}


# -- pods ---------------------------------------------------------------------------------------------

def checkpoint_path(spec: MoESpec) -> str:
    source = spec.source
    if source.scheme == "pvc" and source.sub_path:
        return f"{MODEL_MOUNT}/{source.sub_path}"
    return MODEL_MOUNT


def shm_dir(deployment: MoEDeployment, mode: str) -> str:
    """--shm-dir of the pods: with spec.dataPath.sameNode hostShm, the deployment's folder in the node's
    /dev/shm, where a frontend and an expert function on one node meet; else none (the TCP lane)."""
    return node_shm_dir(deployment.uid) if deployment.spec.data_path.host_shm and mode == "distributed" else ""


def _pod_spec(spec: MoESpec, container: Object, node_selector: Mapping[str, str],
              tolerations: Iterable[Mapping[str, Any]], config: OperatorConfig, shm: str) -> Object:
    """A pod around `container` with the model volume, a writable /tmp, the node's /dev/shm when `shm`
    (its --shm-dir) is in it, and a strict security context."""
    volumes, init = _model_volume(spec, config)
    mounts = [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}, {"name": "tmp", "mountPath": "/tmp"}]
    volumes.append({"name": "tmp", "emptyDir": {}})
    if shm:
        # The whole of /dev/shm, not a folder of it: a folder the kubelet creates (DirectoryOrCreate, or a
        # subPath) is root's, 0755, and the non-root pods could not write in it. /dev/shm is sticky and
        # writable by all; the pods make their folder in it, 0700, for their user (expert_fn/shm.py).
        volumes.append({"name": NODE_SHM_VOLUME, "hostPath": {"path": NODE_SHM_HOST_PATH, "type": "Directory"}})
        mounts.append({"name": NODE_SHM_VOLUME, "mountPath": NODE_SHM_MOUNT})
    container = {**container,
                 "env": [*container.get("env", []), {"name": "HOME", "value": "/tmp"}],
                 "volumeMounts": mounts, "securityContext": security_context(spec)}
    pod: Object = {"containers": [container], "volumes": volumes}
    if init:
        pod["initContainers"] = init
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod["tolerations"] = [dict(t) for t in tolerations]
    return pod


def security_context(spec: MoESpec) -> Object:
    """Restricted Pod Security Standard, at container level (Knative accepts it there without feature
    flags). Every container runs as spec.dataPath.runAsUser, user and group: shared-memory segments and
    lanes open only between processes of one user. No fsGroup: it changes the group of emptyDir and PVC
    volumes only (never of a hostPath), and /tmp is the container's own."""
    user = spec.data_path.run_as_user
    return {"runAsNonRoot": True, "runAsUser": user, "runAsGroup": user,
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
             "securityContext": security_context(spec)}
    return [{"name": "model", "emptyDir": {}}], [fetch]


def _resources(resources: Mapping[str, Any], gpus: int) -> Object:
    out = {k: dict(v) for k, v in resources.items() if k in ("requests", "limits")}
    if gpus:
        out.setdefault("limits", {})[GPU] = str(gpus)
    return out


def _node_affinity(key: str, value: str) -> Object:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": key, "operator": "In", "values": [value]}]}]}}}


def _on_node(node: str) -> Object:
    """The node of this name, as the DaemonSet controller pins its pods: the name is what the planner
    knows (a kubernetes.io/hostname label may differ from it), and kube-scheduler filters that node
    alone for a pod so pinned, where a label selector had it filter every node for the one that fits."""
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}


# -- reading a previous plan back from the cluster ----------------------------------------------------

def observe(spec: MoESpec, mode: str, children: Iterable[Object]) -> Plan:
    """The plan the cluster holds: what `plan()` gets as `previous`, so a restarted operator continues where it
    stopped. The routing ConfigMap has it (its table: the plan's services, their replicas and the replicas
    hosted in place; RETIRED_KEY: those kept warm); the expert objects say which service a function name is."""
    version, table, retired_text = 0, None, None
    services: dict[str, ServiceKey] = {}  # function name (the first label of its address) -> (bundle, site)
    for obj in children:
        meta = obj["metadata"]
        if (meta.get("labels") or {}).get(COMPONENT) == ROUTING and obj["kind"] == "ConfigMap":
            version = max(version, int((meta.get("annotations") or {}).get(VERSION_ANNOTATION, "0") or 0))
            data = obj.get("data") or {}
            table, retired_text = data.get(CONFIGMAP_KEY), data.get(RETIRED_KEY)
        elif (key := service_of(obj)) is not None:
            services[function_of(obj)] = key
    retired = _retired(retired_text or "[]")
    nodes: dict[str, list[str]] = {}
    hosted: dict[str, list[ServiceKey]] = {}
    for bundle, endpoints in _endpoints(table or ""):
        for name, replicas in endpoints:
            host = services.get(name)
            if host is None or host in retired:
                continue  # its objects are gone: the plan places it anew
            if host[0] == bundle:
                nodes.setdefault(bundle, []).extend([host[1]] * replicas)
            else:
                hosted.setdefault(bundle, []).append(host)
    return Plan(mode, tuple(spec.bundles()), {b: tuple(sorted(n)) for b, n in nodes.items()}, retired, version,
                hosted={b: tuple(sorted(h)) for b, h in hosted.items()})


def service_of(obj: Mapping[str, Any]) -> ServiceKey | None:
    """(bundle, site) of an expert function's object (a pod of it, or its Knative Service); None for others."""
    meta = obj["metadata"]
    obj_labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    if obj_labels.get(COMPONENT) != EXPERT or (obj["apiVersion"], obj["kind"]) not in EXPERT_KINDS:
        return None  # the experts' headless Service (runtime pods) is no function
    bundle, node = obj_labels.get(BUNDLE_LABEL), annotations.get(NODE_ANNOTATION)
    if not bundle or not node:
        return None
    return bundle, f"{node}/{annotations[GPU_ANNOTATION]}" if annotations.get(GPU_ANNOTATION) else node


def _retired(text: str) -> dict[ServiceKey, Retired]:
    try:
        return {(bundle, site): Retired(int(replicas), float(since)) for bundle, site, replicas, since in json.loads(text)}
    except (ValueError, TypeError):
        return {}  # not ours to fix here: the next render writes a valid list


@functools.lru_cache(maxsize=4)
def _endpoints(table: str) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """(bundle, (service name, replicas) of each endpoint) per route of a routing table's text. Cached: the
    table changes only with the plan, and parsing a DeepSeek-V3-sized one (~0.5 MB) took a third of a reconcile."""
    if not table:
        return ()
    try:
        routes = parse_table(table).routes
    except RoutingTableError:
        return ()  # not ours to fix here: the next render writes a valid table
    return tuple((r.bundle, tuple((e.address.split(".", 1)[0], max(1, int(e.replicas))) for e in r.endpoints))
                 for r in routes)
