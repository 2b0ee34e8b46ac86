"""The CRDs kubemoe installs, defined once here and written out as YAML for the chart and manifests/.

    python -m kubemoe.operator.crd          # rewrite the YAML copies
    python -m kubemoe.operator.crd --check  # exit 1 if a copy is stale (tests/operator checks it too)

Every field carries a description with its unit and default; constraints that need a message
telling the user what to write are CEL rules (`x-kubernetes-validations`), so the API server's
rejection says what to fix. Defaults come from `spec.DEFAULTS`, which the parser reads as well.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from kubemoe.operator.conditions import READY
from kubemoe.operator.spec import (API_VERSION, DEFAULTS, DRA_NEEDS_DEPLOYMENT_MESSAGE, DRA_STRATEGIES, DTYPES,
                                   DURATION_PATTERN, GROUP, KIND, KNATIVE_KEEP_ALIVE_MESSAGE, KNATIVE_MAX_KEEP_ALIVE,
                                   MODES, PLURAL, PREDICTORS, RESOURCE_NAME_PATTERN, RUNTIMES, SHARED_GPUS_MESSAGE,
                                   SHARING_MODES, VERSION)

REPO = Path(__file__).resolve().parents[1]
# The same bytes in both places: the chart reads its copy with .Files.Get (templates/crds.yaml).
OUTPUTS = {
    "moedeployments": [REPO / "manifests" / "crd.yaml", REPO / "charts/kubemoe/files/crds/moedeployments.yaml"],
    "peerings": [REPO / "manifests" / "kopf-peering-crds.yaml", REPO / "charts/kubemoe/files/crds/kopf-peerings.yaml"],
}
SHORT_NAME = "moed"

Schema = dict[str, Any]


# -- schema helpers: each appends the default to the description so no field forgets it -------------

def _describe(text: str, default: Any = None) -> str:
    return text if default is None else f"{text} Default: {default}."


def _rule(rule: str, message: str) -> dict[str, str]:
    return {"rule": rule, "message": message}


def integer(text: str, *, default_key: str | None = None, minimum: int | None = None, maximum: int | None = None,
            why: str = "") -> Schema:
    default = DEFAULTS[default_key] if default_key else None
    schema: Schema = {"type": "integer", "description": _describe(text, default)}
    if default is not None:
        schema["default"] = default
    bounds = [(f"self >= {minimum}", f"at least {minimum}") if minimum is not None else None,
              (f"self <= {maximum}", f"at most {maximum}") if maximum is not None else None]
    limits = " and ".join(text for _, text in filter(None, bounds))
    rules = [rule for rule, _ in filter(None, bounds)]
    if rules:
        schema["x-kubernetes-validations"] = [_rule(" && ".join(rules), f"must be {limits}{why}")]
    return schema


def string(text: str, *, default_key: str | None = None, enum: tuple[str, ...] | None = None,
           max_length: int = 253) -> Schema:
    default = DEFAULTS[default_key] if default_key else None
    schema: Schema = {"type": "string", "description": _describe(text, default), "maxLength": max_length}
    if default is not None:
        schema["default"] = default
    if enum:
        schema["enum"] = list(enum)
    return schema


def quantity(text: str, *, default_key: str | None = None, field: str) -> Schema:
    """Bytes as a Kubernetes quantity (an integer or a string such as 256Mi), validated by CEL."""
    default = DEFAULTS[default_key] if default_key else None
    schema: Schema = {
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "description": _describe(f"{text} Unit: bytes, as a quantity (e.g. 268435456, 256Mi, 1Gi).", default),
        "x-kubernetes-validations": [
            _rule("isQuantity(string(self)) && quantity(string(self)).isGreaterThan(quantity('0'))",
                  f"{field} must be a positive quantity of bytes such as 268435456, 256Mi or 1Gi"),
        ],
    }
    if default is not None:
        schema["default"] = default
    return schema


def duration(text: str, *, default_key: str, field: str) -> Schema:
    default = DEFAULTS[default_key]
    return {
        "type": "string", "maxLength": 64, "default": default,
        "description": _describe(f"{text} Unit: a Go duration (e.g. 90s, 10m, 1h30m).", default),
        "x-kubernetes-validations": [_rule(f"self.matches('{DURATION_PATTERN}')",
                                           f"{field} must be a duration such as 90s, 10m or 1h30m")],
    }


def obj(text: str, properties: dict[str, Schema], *, required: tuple[str, ...] = (), default: Any = None,
        rules: tuple[dict[str, str], ...] = ()) -> Schema:
    schema: Schema = {"type": "object", "description": text, "properties": properties}
    if required:
        schema["required"] = list(required)
    if default is not None:
        schema["default"] = default
    if rules:
        schema["x-kubernetes-validations"] = list(rules)
    return schema


def _quantity_map(text: str) -> Schema:
    return {"type": "object", "description": text,
            "additionalProperties": {"x-kubernetes-int-or-string": True,
                                     "anyOf": [{"type": "integer"}, {"type": "string"}]}}


def resources(what: str) -> Schema:
    return obj(f"Compute resources of each {what} container (core/v1 ResourceRequirements: requests and limits "
               "of cpu, memory, ...). GPUs are set by the `gpus` field beside it, not here. Default: none.", {
                   "requests": _quantity_map("Minimum resources, e.g. {cpu: 4, memory: 32Gi}."),
                   "limits": _quantity_map("Maximum resources, e.g. {memory: 64Gi}."),
               })


def placement(what: str) -> Schema:
    return obj(f"Which nodes {what} may run on. Default: any node with a GPU.", {
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"},
                         "description": "Node labels that must all match, e.g. {nvidia.com/gpu.product: "
                                        "NVIDIA-H100-80GB-HBM3}. Default: none."},
        "tolerations": {"type": "array", "description": "core/v1 Tolerations for tainted (e.g. GPU) nodes. Default: none.",
                        "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    }, default={})


# -- MoEDeployment ------------------------------------------------------------------------------------

def _spec_schema() -> Schema:
    layout = obj(
        "Shape of the checkpoint's routed experts: the operator plans bundles and replicas from it without "
        "reading the checkpoint.", {
            "moeLayers": {
                "type": "array", "maxItems": 512, "minItems": 1, "x-kubernetes-list-type": "set",
                "description": "Indices of the decoder layers that have routed experts (e.g. 0..31 for Mixtral, "
                               "1..26 for DeepSeek-V2-Lite, whose layer 0 is dense).",
                "items": {"type": "integer", "minimum": 0, "maximum": 4095},
            },
            "expertsPerLayer": integer("Routed experts in every MoE layer (shared experts excluded).",
                                       minimum=1, maximum=4096, why=": a MoE layer has at least one routed expert"),
            "expertBytes": quantity("Weights of one routed expert (gate, up and down projections) in the serving "
                                    "dtype, e.g. 3*4096*14336*2 = 352321536 for Mixtral-8x7B in bfloat16.",
                                    field="spec.model.layout.expertBytes"),
        }, required=("moeLayers", "expertsPerLayer", "expertBytes"))
    model = obj("The checkpoint to serve.", {
        "uri": {
            "type": "string", "maxLength": 1024,
            "description": "The safetensors checkpoint folder (config.json, tokenizer, *.safetensors): "
                           "pvc://CLAIM/path/in/claim, hostpath:///path/on/every/node, or s3://bucket/path and "
                           "gs://bucket/path, copied by an init container. Nothing is downloaded from a model hub.",
            "x-kubernetes-validations": [_rule(
                "self.matches('^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|hostpath:///.+|s3://[^/]+/?.*|gs://[^/]+/?.*)$')",
                "spec.model.uri must be pvc://CLAIM/path, hostpath:///path, s3://bucket/path or gs://bucket/path")],
        },
        "dtype": string("Weight dtype the model is served in.", default_key="model.dtype", enum=DTYPES),
        "layout": layout,
    }, required=("uri", "layout"))

    frontend = obj("The data-parallel frontend pods (attention, gates, batching, HTTP and gRPC APIs).", {
        "replicas": integer("Frontend pods.", default_key="frontend.replicas", minimum=0,
                            why=": 0 stops serving but keeps the experts"),
        "gpus": integer("GPUs (nvidia.com/gpu) per frontend pod.", default_key="frontend.gpus", minimum=0),
        "image": string("Container image of the frontend. Default: the operator's --frontend-image "
                        "(Helm value images.frontend)."),
        "resources": resources("frontend"),
        "placement": placement("frontend pods"),
    }, default={})

    scaling = obj("How expert replicas follow the predicted load (MoEless Expert Scaler).", {
        "cvThreshold": {
            "type": "number", "default": DEFAULTS["experts.scaling.cvThreshold"],
            "description": _describe("Replicas are added until the coefficient of variation of per-replica "
                                     "loads in a layer is at most this value. Unit: a ratio in (0, 1].",
                                     DEFAULTS["experts.scaling.cvThreshold"]),
            "x-kubernetes-validations": [_rule("self > 0.0 && self <= 1.0",
                                               "cvThreshold must be in (0, 1], e.g. 0.2")],
        },
        "layerMemoryCap": quantity("Upper bound of the GPU memory the replicas of one layer may take. "
                                   "Default: no cap.", field="spec.experts.scaling.layerMemoryCap"),
        "predictionDistance": integer("Layers ahead the load predictor looks (gate of layer l+d on the "
                                      "hidden state of layer l).", default_key="experts.scaling.predictionDistance",
                                      minimum=1, maximum=8),
        "keepAlive": duration("How long a replica that left the plan stays warm (pods kept, Knative "
                              "scale-down-delay) before it is deleted; a plan that brings it back reuses it. At most "
                              f"{KNATIVE_MAX_KEEP_ALIVE} with runtime knative (Knative's cap on scale-down-delay).",
                              default_key="experts.scaling.keepAlive", field="spec.experts.scaling.keepAlive"),
        "maxReplicasPerExpert": integer("Upper bound of replicas of one expert bundle (also Knative max-scale).",
                                        default_key="experts.scaling.maxReplicasPerExpert", minimum=1, maximum=1024,
                                        why=": every expert needs a replica"),
    }, default={})

    knative = obj("Knative-only settings (runtime knative).", {
        "progressDeadline": duration("How long a new revision may take to become ready (expert weights load "
                                     "before the pod is ready).", default_key="experts.knative.progressDeadline",
                                     field="spec.experts.knative.progressDeadline"),
        "containerConcurrency": integer("Requests one expert pod handles at once; 0 = unlimited (the expert "
                                        "function batches them).",
                                        default_key="experts.knative.containerConcurrency", minimum=0, maximum=1000),
    })

    # Mode-specific fields carry no schema default (the parser fills it): a default would make has() true
    # and the rules below could no longer tell a field the user wrote for another mode.
    sharing = obj(
        "How expert functions share GPUs. Choose what the cluster's GPU nodes are configured for (see the chart's "
        "README): exclusive gives each replica spec.experts.gpus whole GPUs; timeSlicing and mps pack many "
        "functions into each GPU's memory, each requesting one share of the NVIDIA device plugin's replicated "
        "resource; dra gives the functions the plan puts on one GPU one shared ResourceClaim.", {
            "mode": string("exclusive | timeSlicing | mps | dra.", default_key="experts.gpuSharing.mode",
                           enum=SHARING_MODES),
            "resourceName": {
                "type": "string", "maxLength": 253,
                "description": "timeSlicing and mps: the extended resource one share is advertised as: nvidia.com/gpu "
                               "(device plugin sharing with renameByDefault false) or nvidia.com/gpu.shared "
                               f"(renameByDefault true). Default: {DEFAULTS['experts.gpuSharing.resourceName']}.",
                "x-kubernetes-validations": [_rule(f"self.matches('{RESOURCE_NAME_PATTERN}')",
                                                   "spec.experts.gpuSharing.resourceName must be an extended resource "
                                                   "such as nvidia.com/gpu or nvidia.com/gpu.shared")],
            },
            "functionOverhead": quantity("GPU memory a function takes beside its experts' weights (CUDA context, "
                                         "activation buffers); the planner packs bundle bytes plus this into each "
                                         "GPU's memory.", default_key="experts.gpuSharing.functionOverhead",
                                         field="spec.experts.gpuSharing.functionOverhead"),
            "deviceClassName": {
                "type": "string", "maxLength": 253,
                "description": "dra: DeviceClass of the GPU claims (the NVIDIA DRA driver installs gpu.nvidia.com). "
                               f"Default: {DEFAULTS['experts.gpuSharing.deviceClassName']}.",
            },
            "draStrategy": {
                "type": "string", "enum": list(DRA_STRATEGIES),
                "description": "dra: how the pods sharing one claim share its GPU (the NVIDIA DRA driver's GpuConfig "
                               "sharing strategy); MPS also limits each function's memory to its planned size. "
                               f"Default: {DEFAULTS['experts.gpuSharing.draStrategy']}.",
            },
        }, default={}, rules=(
            _rule("!has(self.resourceName) || self.mode == 'timeSlicing' || self.mode == 'mps'",
                  "spec.experts.gpuSharing.resourceName is used with mode timeSlicing or mps: remove it or change mode"),
            _rule("(!has(self.deviceClassName) && !has(self.draStrategy)) || self.mode == 'dra'",
                  "spec.experts.gpuSharing.deviceClassName and draStrategy are used with mode dra: remove them or "
                  "set mode: dra"),
        ))

    experts = obj("The expert functions: bundles of routed experts, one service per (bundle, node).", {
        "runtime": string("What runs expert functions: knative (Knative Services, scale per bundle) or "
                          "deployment (Deployments + ClusterIP Services, for clusters without Knative).",
                          default_key="experts.runtime", enum=RUNTIMES),
        "image": string("Container image of the expert functions. Default: the operator's --expert-image "
                        "(Helm value images.expertFn)."),
        "bundleBytes": quantity("Experts of one layer are grouped into bundles of at most this size (at least "
                                "one expert each).", default_key="experts.bundleBytes",
                                field="spec.experts.bundleBytes"),
        "gpus": integer("GPUs (nvidia.com/gpu) per expert-function replica with gpuSharing.mode exclusive "
                        "(0: CPU only); with sharing it stays 1.", default_key="experts.gpus", minimum=0, maximum=8),
        "gpuSharing": sharing,
        "resources": resources("expert-function"),
        "scaling": scaling,
        "placement": placement("expert functions"),
        "knative": knative,
    }, default={}, rules=(
        _rule("self.runtime == 'knative' || !has(self.knative)",
              "spec.experts.knative is only used with runtime knative: remove it or set runtime: knative"),
        # A keepAlive that is no duration fails its own rule (with its own message); CEL's duration() is Go's.
        _rule(f"self.runtime != 'knative' || !has(self.scaling) || !has(self.scaling.keepAlive) || "
              f"!self.scaling.keepAlive.matches('{DURATION_PATTERN}') || "
              f"duration(self.scaling.keepAlive) <= duration('{KNATIVE_MAX_KEEP_ALIVE}')", KNATIVE_KEEP_ALIVE_MESSAGE),
        _rule("!has(self.gpuSharing) || self.gpuSharing.mode == 'exclusive' || !has(self.gpus) || self.gpus == 1",
              SHARED_GPUS_MESSAGE),
        _rule("!has(self.gpuSharing) || self.gpuSharing.mode != 'dra' || self.runtime == 'deployment'",
              DRA_NEEDS_DEPLOYMENT_MESSAGE),
    ))

    offload = obj("The offload path (LayerScope) for single-GPU nodes: the frontend holds every expert.", {
        "gpuMemoryBudget": quantity("GPU memory for the hot-expert cache.", field="spec.offload.gpuMemoryBudget"),
        "predictor": string("Expert-load predictor of the offload scheduler.", default_key="offload.predictor",
                            enum=PREDICTORS),
    }, required=("gpuMemoryBudget",))

    cost = obj("Prices for status.cost.", {
        "gpuHourPrice": {
            "type": "number", "default": DEFAULTS["cost.gpuHourPrice"],
            "description": _describe("Price of one GPU for one hour. Unit: USD.", DEFAULTS["cost.gpuHourPrice"]),
            "x-kubernetes-validations": [_rule("self >= 0.0", "gpuHourPrice must not be negative")],
        },
    }, default={})

    return obj("The model to serve and how.", {
        "model": model,
        "mode": string("distributed: expert functions on GPU nodes; offload: one frontend per single-GPU node "
                       "holds every expert (CPU memory + GPU cache); auto: distributed when a multi-GPU node is "
                       "eligible, else offload.", default_key="mode", enum=MODES),
        "frontend": frontend,
        "experts": experts,
        "offload": offload,
        "cost": cost,
    }, required=("model",), rules=(
        _rule("self.mode != 'offload' || has(self.offload)",
              "mode offload needs spec.offload.gpuMemoryBudget (GPU memory for hot experts, e.g. 20Gi)"),
        _rule("self.mode == 'distributed' || !has(self.experts.knative)",
              "spec.experts.knative does nothing when the frontend may hold the experts (mode offload or auto): "
              "remove it or set mode: distributed"),
        _rule("self.mode != 'distributed' || !has(self.offload)",
              "spec.offload is only used in mode offload or auto: remove it or change spec.mode"),
        _rule("!has(self.experts.scaling.layerMemoryCap) || "
              "quantity(string(self.experts.scaling.layerMemoryCap)).asApproximateFloat() >= "
              "double(self.model.layout.expertsPerLayer) * "
              "quantity(string(self.model.layout.expertBytes)).asApproximateFloat()",
              "spec.experts.scaling.layerMemoryCap must hold one replica of every expert of a layer "
              "(expertsPerLayer * expertBytes): raise it or remove it"),
        _rule("!has(self.offload) || quantity(string(self.offload.gpuMemoryBudget)).asApproximateFloat() >= "
              "quantity(string(self.model.layout.expertBytes)).asApproximateFloat()",
              "spec.offload.gpuMemoryBudget must hold at least one expert (expertBytes)"),
    ))


def _status_schema() -> Schema:
    number = lambda text: {"type": "number", "description": text}  # noqa: E731
    count = lambda text: {"type": "integer", "description": text}  # noqa: E731
    condition = obj("A condition in the Kubernetes convention (see kubemoe.operator.conditions).", {
        "type": {"type": "string", "description": "Ready, FrontendReady, ExpertsReady or PlanApplied."},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"], "description": "True, False or Unknown."},
        "reason": {"type": "string", "description": "CamelCase cause, for machines."},
        "message": {"type": "string", "description": "What happened and what to do, for people."},
        "lastTransitionTime": {"type": "string", "format": "date-time",
                               "description": "When status last changed."},
        "observedGeneration": {"type": "integer", "description": "metadata.generation the condition is about."},
    }, required=("type", "status"))
    return obj("What the operator observed and did.", {
        "observedGeneration": count("metadata.generation of the last spec the operator acted on."),
        "mode": {"type": "string", "description": "The mode in effect (auto resolved): distributed or offload."},
        "conditions": {"type": "array", "description": "Ready <- FrontendReady, ExpertsReady, PlanApplied.",
                       "items": condition, "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        "plan": obj("Summary of the plan in effect.", {
            "replicas": count("Expert-function replicas planned (pods)."),
            "hostedInPlace": count("Scaled-out replicas loaded in place into running functions: no service of their own."),
            "functions": count("Expert services planned: one per (bundle, node)."),
            "bundles": count("Expert bundles of the model."),
            "nodes": count("Nodes the expert replicas are placed on."),
            "retired": count("Services out of the plan but kept warm until their keep-alive ends."),
            "unplaced": count("Scaled-out replicas no node had room for (PlanApplied says which)."),
            "cv": number("Largest coefficient of variation of per-replica loads in a layer, as placed."),
            "cvBefore": number("The same with one replica per bundle: what scaling out improved on."),
            "version": count("Routing-table version; grows with every change of placement."),
            "layers": {"type": "array", "description": "One entry per MoE layer, in layer order.",
                       "items": obj("Replicas of one MoE layer and how even their loads are.", {
                           "layer": count("Index of the layer in the model."),
                           "replicas": count("Expert-function replicas of the layer's bundles."),
                           "cvBefore": number("CV of the bundles' loads with one replica each."),
                           "cvAfter": number("CV of the per-replica loads as placed."),
                       })},
        }),
        "loads": obj("The last expert loads pulled from the frontends.", {
            "frontends": count("Frontends that answered /loads."),
            "tokensPerSecond": number("Tokens per second through the model, all frontends together."),
        }),
        "cost": obj("What the plan costs at spec.cost.gpuHourPrice.", {
            "gpuHoursPerHour": number("GPUs held (frontends, expert replicas, warm retired replicas). Unit: GPU-hours per hour."),
            "usdPerHour": number("gpuHoursPerHour * gpuHourPrice. Unit: USD per hour."),
            "usdPerMillionTokens": number("usdPerHour over the observed token rate. Unit: USD per 10^6 tokens."),
        }),
    })


def moedeployment_crd() -> dict[str, Any]:
    columns = [
        ("Mode", "string", ".status.mode", "Mode in effect."),
        ("Ready", "string", f'.status.conditions[?(@.type=="{READY}")].status', "Ready condition."),
        ("Replicas", "integer", ".status.plan.replicas", "Expert-function replicas planned."),
        ("Functions", "integer", ".status.plan.functions", "Expert services planned."),
        ("CV", "number", ".status.plan.cv", "Largest per-layer CV of per-replica loads (spec cvThreshold)."),
        ("Unplaced", "integer", ".status.plan.unplaced", "Scaled-out replicas that fit on no node."),
        ("Cost", "number", ".status.cost.usdPerHour", "USD per hour at spec.cost.gpuHourPrice."),
        ("Age", "date", ".metadata.creationTimestamp", ""),
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "kubemoe"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": KIND.lower(),
                      "shortNames": [SHORT_NAME], "categories": ["kubemoe"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": n, "type": t, "jsonPath": p, **({"description": d} if d else {})}
                    for n, t, p, d in columns],
                "schema": {"openAPIV3Schema": obj(
                    f"A Mixture-of-Experts model served by kubemoe ({API_VERSION}).", {
                        "apiVersion": {"type": "string", "description": "kubemoe.io/v1alpha1."},
                        "kind": {"type": "string", "description": "MoEDeployment."},
                        "metadata": {"type": "object"},
                        "spec": _spec_schema(),
                        "status": _status_schema(),
                    }, required=("spec",))},
            }],
        },
    }


def kopf_peering_crds() -> list[dict[str, Any]]:
    """Kopf's peering resources: operator replicas see each other here, so only one acts at a time."""
    def crd(kind: str, scope: str) -> dict[str, Any]:
        plural = kind.lower() + "s"
        return {
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.kopf.dev"},
            "spec": {
                "group": "kopf.dev", "scope": scope,
                "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                    "type": "object", "properties": {
                        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}],
            },
        }
    return [crd("ClusterKopfPeering", "Cluster"), crd("KopfPeering", "Namespaced")]


HEADER = "# Generated by `python -m kubemoe.operator.crd` from operator/crd.py: edit that file, not this one.\n"


def render_yaml() -> dict[str, str]:
    docs = {"moedeployments": [moedeployment_crd()], "peerings": kopf_peering_crds()}
    return {key: HEADER + "---\n".join(yaml.safe_dump(d, sort_keys=False, width=120) for d in items)
            for key, items in docs.items()}


def stale_outputs() -> list[Path]:
    texts = render_yaml()
    return [path for key, paths in OUTPUTS.items() for path in paths
            if not path.exists() or path.read_text() != texts[key]]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stale = stale_outputs()
        for path in stale:
            print(f"stale: {path.relative_to(REPO)} (run python -m kubemoe.operator.crd)", file=sys.stderr)
        return 1 if stale else 0
    for key, text in render_yaml().items():
        for path in OUTPUTS[key]:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
