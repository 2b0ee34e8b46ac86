"""Every field of a MoEDeployment's spec, declared once: type, default, validation and description.

The CRD schema (`crd.py`), the parser (`spec.py`) and the field reference in the chart's README are
made from `SPEC`. Constraints across fields are `Rule`s: a CEL rule for the API server and the same
condition in Python for the parser, with one message for both (tests/operator/test_validation.py
sends every bad spec to both).
"""

from __future__ import annotations

from kubemoe.offload_budget import ON_DEMAND_BUFFERS, PREFETCH_GROUPS, working_set_bytes
from kubemoe.offload_env import LLAPOR_FILE
from kubemoe.operator.schema import (DURATION_PATTERN, Duration, Integer, List, Number, Object, Opaque, Quantity,
                                     Rule, String, parse_duration)

MODES = ("distributed", "offload", "auto")
RUNTIMES = ("knative", "pods")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}  # the weight dtypes a model may be served in
DTYPES = tuple(DTYPE_BYTES)
PREDICTORS = ("llapor", "frequency")
# How a frontend and an expert function on one node exchange tensors (spec.dataPath.sameNode): tcp, the
# TCP lane every pair uses (no node folder: restricted Pod Security holds); hostShm, shared memory and a
# Unix lane in a per-deployment folder of the node's /dev/shm, mounted as a hostPath (privileged only).
SAME_NODE = ("tcp", "hostShm")
# The UID/GID kubemoe's pods run as by default: distroless's "nonroot" user (also the images' USER).
DEFAULT_POD_USER = 65532
# How expert functions share a GPU (spec.experts.gpuSharing.mode), as clusters configure it:
# exclusive: whole GPUs per replica (spec.experts.gpus); timeSlicing / mps: one share of the NVIDIA device
# plugin's replicated resource per function; dra: a ResourceClaim per GPU, shared by the functions on it.
SHARING_MODES = ("exclusive", "timeSlicing", "mps", "dra")
DRA_STRATEGIES = ("TimeSlicing", "MPS")  # the NVIDIA DRA driver's GpuConfig sharing strategies
# An extended resource name (domain/name), what a device plugin advertises.
RESOURCE_NAME_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?[.])*[a-z0-9]([-a-z0-9]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
URI_PATTERN = r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|hostpath:///.+|s3://[^/]+/?.*|gs://[^/]+/?.*)$"

# Knative rejects a scale-down-delay above 1h, and keepAlive is rendered as that annotation: with runtime
# knative a longer keepAlive is refused.
KNATIVE_MAX_KEEP_ALIVE = "1h"
KNATIVE_KEEP_ALIVE_MESSAGE = (f"spec.experts.scaling.keepAlive is at most {KNATIVE_MAX_KEEP_ALIVE} with runtime knative "
                              "(Knative caps the scale-down-delay it is rendered as at 1h): write 1h or less, or set "
                              "spec.experts.runtime: pods, which keeps replicas warm for any keepAlive")
DRA_NEEDS_PODS_MESSAGE = ("spec.experts.gpuSharing.mode dra needs spec.experts.runtime: pods (Knative "
                          "Serving rejects pods with resourceClaims, knative/serving#15332): set runtime: "
                          "pods, or share GPUs with mode timeSlicing or mps")
SHARED_GPUS_MESSAGE = ("spec.experts.gpus counts whole GPUs per replica and applies to gpuSharing.mode exclusive; "
                       "with timeSlicing, mps or dra every function takes one share of one GPU: set gpus to 1 "
                       "(or remove it), or set gpuSharing.mode: exclusive")
SHARED_MEMORY_NEEDS_EXPERTS_MESSAGE = ("spec.dataPath.sameNode hostShm shares memory between frontends and expert "
                                       "functions, and mode offload runs no expert functions (the frontend holds "
                                       "every expert): remove it, or set mode: distributed or auto")
# Knative's webhook takes a hostPath volume only mounted read-only, and shared memory writes in the folder.
SHARED_MEMORY_NEEDS_PODS_MESSAGE = ("spec.dataPath.sameNode hostShm needs spec.experts.runtime: pods: Knative mounts "
                                    "hostPath volumes only read-only, and shared memory writes in the node's folder; "
                                    "or keep runtime knative with sameNode: tcp")
OFFLOAD_NEEDS_BUDGET_MESSAGE = ("mode offload needs spec.offload.gpuMemoryBudget (GPU memory for expert weights, "
                                "e.g. 20Gi), or mode auto, which derives it from the nodes' GPUs")
WORKING_SET_MESSAGE = (f"spec.offload.gpuMemoryBudget must hold one layer's working set: {ON_DEMAND_BUFFERS} on-demand "
                       f"buffers and {PREFETCH_GROUPS} prefetch groups of expertsPerToken experts (1 when "
                       "spec.model.layout.expertsPerToken is not given), expertBytes each: raise it to at least "
                       f"({ON_DEMAND_BUFFERS} + {PREFETCH_GROUPS} * expertsPerToken) * expertBytes")
# A path inside the checkpoint folder: relative, no '..' component (the pod mounts only the model). [.], not
# an escaped dot: the pattern is written into a CEL string literal, where \. is no escape.
_SEGMENT = "([.]?[^/.][^/]*|[.][.][^/]+|[.])"
RELATIVE_PATH_PATTERN = f"^{_SEGMENT}(/{_SEGMENT})*$"

_QUANTITY_MAP = {"type": "object", "additionalProperties": {"x-kubernetes-int-or-string": True,
                                                            "anyOf": [{"type": "integer"}, {"type": "string"}]}}


def resources(what: str) -> Object:
    return Object(f"Compute resources of each {what} container (core/v1 ResourceRequirements: requests and limits "
                  "of cpu, memory, ...). GPUs are set by the `gpus` field beside it, not here. Default: none.", {
                      "requests": Opaque("Minimum resources, e.g. {cpu: 4, memory: 32Gi}.", openapi=_QUANTITY_MAP),
                      "limits": Opaque("Maximum resources, e.g. {memory: 64Gi}.", openapi=_QUANTITY_MAP),
                  }, default={}, crd_default=False)


def placement(what: str) -> Object:
    return Object(f"Which nodes {what} may run on. Default: any node with a GPU.", {
        "nodeSelector": Opaque("Node labels that must all match, e.g. {nvidia.com/gpu.product: "
                               "NVIDIA-H100-80GB-HBM3}. Default: none.",
                               openapi={"type": "object", "additionalProperties": {"type": "string"}}),
        "tolerations": Opaque("core/v1 Tolerations for tainted (e.g. GPU) nodes. Default: none.", openapi={
            "type": "array", "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}),
    }, default={})


def _has(section, *path: str) -> bool:
    for key in path:
        if key not in section:
            return False
        section = section[key]
    return True


LAYOUT = Object(
    "Shape of the checkpoint's routed experts: the operator plans bundles and replicas from it without "
    "reading the checkpoint.", {
        "moeLayers": List("Indices of the decoder layers that have routed experts (e.g. 0..31 for Mixtral, "
                          "1..26 for DeepSeek-V2-Lite, whose layer 0 is dense).",
                          min_items=1, max_items=512, minimum=0, maximum=4095),
        "expertsPerLayer": Integer("Routed experts in every MoE layer (shared experts excluded).",
                                   minimum=1, maximum=4096, why=": a MoE layer has at least one routed expert"),
        "expertBytes": Quantity("Weights of one routed expert (gate, up and down projections) in the serving "
                                "dtype, e.g. 3*4096*14336*2 = 352321536 for Mixtral-8x7B in bfloat16."),
        "expertsPerToken": Integer("Routed experts each token goes to (the router's top-k: 2 for Mixtral, 8 for "
                                   "Qwen3-30B-A3B). The offload path prefetches this many experts per layer, so its "
                                   "GPU budget must hold 2 + 2 * expertsPerToken experts (checked here when given, "
                                   "else by the frontend when it starts).", minimum=1, maximum=4096),
    }, required=("moeLayers", "expertsPerLayer", "expertBytes"), rules=(
        Rule("!has(self.expertsPerToken) || self.expertsPerToken <= self.expertsPerLayer",
             "spec.model.layout.expertsPerToken is at most expertsPerLayer (a token's experts are distinct)",
             lambda l: l.get("expertsPerToken", 0) <= l["expertsPerLayer"]),
    ))

MODEL = Object("The checkpoint to serve.", {
    "uri": String("The safetensors checkpoint folder (config.json, tokenizer, *.safetensors): "
                  "pvc://CLAIM/path/in/claim, hostpath:///path/on/every/node, or s3://bucket/path and "
                  "gs://bucket/path, copied by an init container. Nothing is downloaded from a model hub.",
                  max_length=1024, pattern=URI_PATTERN,
                  message="must be pvc://CLAIM/path, hostpath:///path, s3://bucket/path or gs://bucket/path"),
    "dtype": String("Weight dtype the model is served in.", default="bfloat16", enum=DTYPES),
    "layout": LAYOUT,
}, required=("uri", "layout"))

FRONTEND = Object("The data-parallel frontend pods (attention, gates, batching, HTTP and gRPC APIs).", {
    "replicas": Integer("Frontend pods.", default=1, minimum=0, why=": 0 stops serving but keeps the experts"),
    "gpus": Integer("GPUs (nvidia.com/gpu) per frontend pod.", default=1, minimum=0),
    "image": String("Container image of the frontend. Default: the operator's --frontend-image "
                    "(Helm value images.frontend)."),
    "resources": resources("frontend"),
    "placement": placement("frontend pods"),
}, default={})

SCALING = Object("How expert replicas follow the predicted load (MoEless Expert Scaler).", {
    "cvThreshold": Number("Replicas are added until the coefficient of variation of per-replica loads in a layer "
                          "is at most this value. Unit: a ratio in (0, 1].", default=0.2,
                          cel="self > 0.0 && self <= 1.0", within=lambda v: 0 < v <= 1,
                          message="must be in (0, 1], e.g. 0.2"),
    "layerMemoryCap": Quantity("Upper bound of the GPU memory the replicas of one layer may take. Default: no cap."),
    "predictionDistance": Integer("Layers ahead the load predictor looks (gate of layer l+d on the hidden state of "
                                  "layer l).", default=1, minimum=1, maximum=8),
    "keepAlive": Duration("How long a replica that left the plan stays warm (pods kept, Knative scale-down-delay) "
                          "before it is deleted; a plan that brings it back reuses it. At most "
                          f"{KNATIVE_MAX_KEEP_ALIVE} with runtime knative (Knative's cap on scale-down-delay).",
                          default="10m"),
    "maxReplicasPerExpert": Integer("Upper bound of replicas of one expert bundle (summed over its Services: each runs the replicas "
                                    "the plan gives it, Knative's min-scale and max-scale).",
                                    default=8, minimum=1, maximum=1024, why=": every expert needs a replica"),
}, default={})

# Knative settings carry no schema default: a rule below tells whether the user wrote them.
KNATIVE = Object("Knative-only settings (runtime knative).", {
    "progressDeadline": Duration("How long a new revision may take to become ready (expert weights load before "
                                 "the pod is ready).", default="15m", positive=True),
    "containerConcurrency": Integer("Requests one expert pod handles at once; 0 = unlimited (the expert function "
                                    "batches them).", default=0, minimum=0, maximum=1000),
}, default={}, crd_default=False)

# Mode-specific fields carry no schema default (the parser fills it): a default would make has() true and
# the rules below could no longer tell a field the user wrote for another mode.
GPU_SHARING = Object(
    "How expert functions share GPUs. Choose what the cluster's GPU nodes are configured for (see the chart's "
    "README): exclusive gives each replica spec.experts.gpus whole GPUs; timeSlicing and mps pack many "
    "functions into each GPU's memory, each requesting one share of the NVIDIA device plugin's replicated "
    "resource; dra gives the functions the plan puts on one GPU one shared ResourceClaim.", {
        "mode": String("exclusive | timeSlicing | mps | dra.", default="exclusive", enum=SHARING_MODES),
        "resourceName": String("timeSlicing and mps: the extended resource one share is advertised as: "
                               "nvidia.com/gpu (device plugin sharing with renameByDefault false) or "
                               "nvidia.com/gpu.shared (renameByDefault true).",
                               default="nvidia.com/gpu", crd_default=False, pattern=RESOURCE_NAME_PATTERN,
                               message="must be an extended resource such as nvidia.com/gpu or nvidia.com/gpu.shared"),
        "functionOverhead": Quantity("GPU memory a function takes beside its experts' weights (CUDA context, "
                                     "activation buffers); the planner packs bundle bytes plus this into each "
                                     "GPU's memory.", default="1Gi"),
        "deviceClassName": String("dra: DeviceClass of the GPU claims (the NVIDIA DRA driver installs "
                                  "gpu.nvidia.com).", default="gpu.nvidia.com", crd_default=False),
        "draStrategy": String("dra: how the pods sharing one claim share its GPU (the NVIDIA DRA driver's GpuConfig "
                              "sharing strategy); MPS also limits each function's memory to its planned size.",
                              default="TimeSlicing", crd_default=False, enum=DRA_STRATEGIES),
    }, default={}, rules=(
        Rule("!has(self.resourceName) || self.mode == 'timeSlicing' || self.mode == 'mps'",
             "spec.experts.gpuSharing.resourceName is used with mode timeSlicing or mps: remove it or change mode",
             lambda s: "resourceName" not in s or s["mode"] in ("timeSlicing", "mps")),
        Rule("(!has(self.deviceClassName) && !has(self.draStrategy)) || self.mode == 'dra'",
             "spec.experts.gpuSharing.deviceClassName and draStrategy are used with mode dra: remove them or "
             "set mode: dra",
             lambda s: ("deviceClassName" not in s and "draStrategy" not in s) or s["mode"] == "dra"),
    ))

_MAX_KEEP_ALIVE_S = parse_duration(KNATIVE_MAX_KEEP_ALIVE, "KNATIVE_MAX_KEEP_ALIVE")

EXPERTS = Object("The expert functions: bundles of routed experts, one service per (bundle, node).", {
    "runtime": String("What runs expert functions: knative (Knative Services, scale per bundle) or pods "
                      "(pods the operator makes and replaces itself under one headless Service, for clusters "
                      "without Knative).",
                      default="knative", enum=RUNTIMES),
    "image": String("Container image of the expert functions. Default: the operator's --expert-image "
                    "(Helm value images.expertFn)."),
    "bundleBytes": Quantity("Experts of one layer are grouped into bundles of at most this size (at least one "
                            "expert each).", default="256Mi"),
    "gpus": Integer("GPUs (nvidia.com/gpu) per expert-function replica with gpuSharing.mode exclusive (0: CPU "
                    "only); with sharing it stays 1.", default=1, minimum=0, maximum=8),
    "gpuSharing": GPU_SHARING,
    "resources": resources("expert-function"),
    "scaling": SCALING,
    "placement": placement("expert functions"),
    "knative": KNATIVE,
}, default={}, rules=(
    Rule("self.runtime == 'knative' || !has(self.knative)",
         "spec.experts.knative is only used with runtime knative: remove it or set runtime: knative",
         lambda e: e["runtime"] == "knative" or "knative" not in e),
    # A keepAlive that is no duration fails its own rule (with its own message); CEL's duration() is Go's.
    Rule(f"self.runtime != 'knative' || !has(self.scaling) || !has(self.scaling.keepAlive) || "
         f"!self.scaling.keepAlive.matches('{DURATION_PATTERN}') || "
         f"duration(self.scaling.keepAlive) <= duration('{KNATIVE_MAX_KEEP_ALIVE}')", KNATIVE_KEEP_ALIVE_MESSAGE,
         lambda e: e["runtime"] != "knative" or parse_duration(e["scaling"]["keepAlive"], "keepAlive") <= _MAX_KEEP_ALIVE_S),
    Rule("!has(self.gpuSharing) || self.gpuSharing.mode == 'exclusive' || !has(self.gpus) || self.gpus == 1",
         SHARED_GPUS_MESSAGE, lambda e: e["gpuSharing"]["mode"] == "exclusive" or e["gpus"] == 1),
    Rule("!has(self.gpuSharing) || self.gpuSharing.mode != 'dra' || self.runtime == 'pods'",
         DRA_NEEDS_PODS_MESSAGE, lambda e: e["gpuSharing"]["mode"] != "dra" or e["runtime"] == "pods"),
))

OFFLOAD = Object("The offload path (LayerScope) for single-GPU nodes: the frontend holds every expert.", {
    "gpuMemoryBudget": Quantity("GPU memory for expert weights: the hot experts, 2 on-demand buffers and 2 "
                                "prefetch groups of expertsPerToken experts. Required with mode offload; with "
                                "mode auto the default is 3/4 of the smallest GPU of the nodes the frontend may "
                                "run on (the rest holds attention weights and the KV cache). At most that GPU's "
                                "memory."),
    "predictor": String("What predicts the next layer's experts for prefetching: llapor (LayerScope's learned "
                        "predictor, see predictorFile) or frequency (no prediction: the hot-expert table alone).",
                        default="llapor", enum=PREDICTORS),
    "predictorFile": String("predictor llapor: the file of `kubemoe predictor train --kind llapor`, as a path "
                            "inside the checkpoint folder (e.g. predictors/llapor.safetensors). A file trained "
                            "for another checkpoint stops the frontend with a message. Default: "
                            f"{LLAPOR_FILE} in the checkpoint folder, and when there is none the next layer's "
                            "router predicts instead (the frontend logs which it uses).",
                            max_length=1024, pattern=RELATIVE_PATH_PATTERN,
                            message="must be a path inside the checkpoint folder, such as "
                                    "predictors/llapor.safetensors (relative, without ..)"),
}, rules=(
    Rule("!has(self.predictorFile) || self.predictor == 'llapor'",
         "spec.offload.predictorFile is read by predictor llapor: remove it or set predictor: llapor",
         lambda o: "predictorFile" not in o or o["predictor"] == "llapor"),
))

# No schema default (the parser fills it): a default would make has() true and the mode rule below could
# no longer tell whether the user chose shared memory.
DATA_PATH = Object(
    "How tensors travel between frontends and expert functions. Across nodes they always take the TCP lane "
    "(a connection to the expert pod's data port, negotiated on the gRPC stream); sameNode chooses what a "
    "frontend and an expert function on the same node use (see \"Same-node shared memory\" in the chart's "
    "README for the trade-off).", {
        "sameNode": String("tcp: the TCP lane, as across nodes (no node folder; works under the restricted Pod "
                           "Security Standard). hostShm: shared memory and a Unix lane in a folder of the node's "
                           "/dev/shm that only this MoEDeployment's user can open (a hostPath volume: the "
                           "namespace must allow Pod Security level privileged, and expert functions run as "
                           "runtime pods, since Knative mounts hostPath volumes only read-only); about half the "
                           "per-call overhead of tcp, see the chart's README.",
                           default="tcp", crd_default=False, enum=SAME_NODE),
        "runAsUser": Integer("UID (and GID) every frontend and expert-function container runs as. Shared memory "
                             "only opens between processes of one user, and with hostShm any pod of this user on "
                             "the node can read the deployment's folder: give each MoEDeployment that uses hostShm "
                             "a user no other workload runs as.",
                             default=DEFAULT_POD_USER, crd_default=False, minimum=1, maximum=2147483647,
                             why=": kubemoe's pods never run as root"),
    }, default={}, crd_default=False)

COST = Object("Prices for status.cost.", {
    "gpuHourPrice": Number("Price of one GPU for one hour. Unit: USD.", default=0.0, cel="self >= 0.0",
                           within=lambda v: v >= 0, message="must not be negative"),
}, default={})

SPEC = Object("The model to serve and how.", {
    "model": MODEL,
    "mode": String("distributed: expert functions on GPU nodes; offload: one frontend per single-GPU node holds "
                   "every expert (CPU memory + GPU cache); auto: distributed when a multi-GPU node is eligible or "
                   "the single-GPU nodes hold one replica of every bundle, else offload with a GPU budget of 3/4 "
                   "of the GPU unless spec.offload.gpuMemoryBudget says otherwise (status.mode and "
                   "status.modeReason say what it chose and why).", default="distributed", enum=MODES),
    "frontend": FRONTEND,
    "experts": EXPERTS,
    "offload": OFFLOAD,
    "dataPath": DATA_PATH,
    "cost": COST,
}, required=("model",), rules=(
    Rule("self.mode != 'offload' || (has(self.offload) && has(self.offload.gpuMemoryBudget))",
         OFFLOAD_NEEDS_BUDGET_MESSAGE, lambda s: s["mode"] != "offload" or _has(s, "offload", "gpuMemoryBudget")),
    Rule("self.mode == 'distributed' || !has(self.experts.knative)",
         "spec.experts.knative does nothing when the frontend may hold the experts (mode offload or auto): "
         "remove it or set mode: distributed",
         lambda s: s["mode"] == "distributed" or "knative" not in s["experts"]),
    Rule("self.mode != 'offload' || !has(self.dataPath) || !has(self.dataPath.sameNode) || "
         "self.dataPath.sameNode == 'tcp'", SHARED_MEMORY_NEEDS_EXPERTS_MESSAGE,
         lambda s: s["mode"] != "offload" or s.get("dataPath", {}).get("sameNode", "tcp") == "tcp"),
    Rule("self.experts.runtime != 'knative' || !has(self.dataPath) || !has(self.dataPath.sameNode) || "
         "self.dataPath.sameNode == 'tcp'", SHARED_MEMORY_NEEDS_PODS_MESSAGE,
         lambda s: s["experts"]["runtime"] != "knative" or s.get("dataPath", {}).get("sameNode", "tcp") == "tcp"),
    Rule("self.mode != 'distributed' || !has(self.offload)",
         "spec.offload is only used in mode offload or auto: remove it or change spec.mode",
         lambda s: s["mode"] != "distributed" or "offload" not in s),
    Rule("!has(self.experts.scaling.layerMemoryCap) || "
         "quantity(string(self.experts.scaling.layerMemoryCap)).asApproximateFloat() >= "
         "double(self.model.layout.expertsPerLayer) * "
         "quantity(string(self.model.layout.expertBytes)).asApproximateFloat()",
         "spec.experts.scaling.layerMemoryCap must hold one replica of every expert of a layer "
         "(expertsPerLayer * expertBytes): raise it or remove it",
         lambda s: not _has(s, "experts", "scaling", "layerMemoryCap") or s["experts"]["scaling"]["layerMemoryCap"]
         >= s["model"]["layout"]["expertsPerLayer"] * s["model"]["layout"]["expertBytes"]),
    # One layer's working set (kubemoe/offload_budget.py): without expertsPerToken, a token's one expert.
    Rule("!has(self.offload) || !has(self.offload.gpuMemoryBudget) || "
         "quantity(string(self.offload.gpuMemoryBudget)).asApproximateFloat() >= "
         f"double({ON_DEMAND_BUFFERS} + {PREFETCH_GROUPS} * (has(self.model.layout.expertsPerToken) ? "
         "self.model.layout.expertsPerToken : 1)) * "
         "quantity(string(self.model.layout.expertBytes)).asApproximateFloat()",
         WORKING_SET_MESSAGE,
         lambda s: not _has(s, "offload", "gpuMemoryBudget") or s["offload"]["gpuMemoryBudget"] >= working_set_bytes(
             s["model"]["layout"]["expertBytes"], s["model"]["layout"].get("expertsPerToken", 1))),
))
