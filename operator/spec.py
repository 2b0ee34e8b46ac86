"""The MoEDeployment resource as one typed config, built once from the custom resource.

The API server has already validated and defaulted the object against the CRD (`crd.py`), which
takes its defaults from `DEFAULTS` below, so the two can never disagree. Parsing here still fills
defaults itself: unit tests and `kubemoe operator plan` read specs that never went through a server.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from kubernetes.utils import parse_quantity

from kubemoe.bundles import Bundle, bundles_by_bytes

GROUP, VERSION, PLURAL, KIND = "kubemoe.io", "v1alpha1", "moedeployments", "MoEDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

MODES = ("distributed", "offload", "auto")
RUNTIMES = ("knative", "deployment")
DTYPES = ("bfloat16", "float16", "float32")
PREDICTORS = ("llapor", "frequency")
URI_SCHEMES = ("pvc", "hostpath", "s3", "gs")
# How expert functions share a GPU (spec.experts.gpuSharing.mode), as clusters configure it:
# exclusive: whole GPUs per replica (spec.experts.gpus); timeSlicing / mps: one share of the NVIDIA device
# plugin's replicated resource per function; dra: a ResourceClaim per GPU, shared by the functions on it.
SHARING_MODES = ("exclusive", "timeSlicing", "mps", "dra")
DRA_STRATEGIES = ("TimeSlicing", "MPS")  # the NVIDIA DRA driver's GpuConfig sharing strategies
# An extended resource name (domain/name), what a device plugin advertises.
RESOURCE_NAME_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?[.])*[a-z0-9]([-a-z0-9]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
DRA_NEEDS_DEPLOYMENT_MESSAGE = ("spec.experts.gpuSharing.mode dra needs spec.experts.runtime: deployment (Knative "
                                "Serving rejects pods with resourceClaims, knative/serving#15332): set runtime: "
                                "deployment, or share GPUs with mode timeSlicing or mps")
SHARED_GPUS_MESSAGE = ("spec.experts.gpus counts whole GPUs per replica and applies to gpuSharing.mode exclusive; "
                       "with timeSlicing, mps or dra every function takes one share of one GPU: set gpus to 1 "
                       "(or remove it), or set gpuSharing.mode: exclusive")

# The defaults of every optional field: the CRD schema (`crd.py`) and the parser below both read them.
DEFAULTS: dict[str, Any] = {
    "model.dtype": "bfloat16",
    "mode": "distributed",
    "frontend.replicas": 1,
    "frontend.gpus": 1,
    "experts.runtime": "knative",
    "experts.bundleBytes": "256Mi",
    "experts.gpus": 1,
    "experts.gpuSharing.mode": "exclusive",
    "experts.gpuSharing.resourceName": "nvidia.com/gpu",
    "experts.gpuSharing.functionOverhead": "1Gi",
    "experts.gpuSharing.deviceClassName": "gpu.nvidia.com",
    "experts.gpuSharing.draStrategy": "TimeSlicing",
    "experts.scaling.cvThreshold": 0.2,
    "experts.scaling.predictionDistance": 1,
    "experts.scaling.keepAlive": "10m",
    "experts.scaling.maxReplicasPerExpert": 8,
    "experts.knative.progressDeadline": "15m",
    "experts.knative.containerConcurrency": 0,
    "offload.predictor": "llapor",
    "cost.gpuHourPrice": 0.0,
}

# Go's time.ParseDuration syntax (what Knative's scale-down-delay takes): "10m", "1h30m", "90s".
DURATION_PATTERN = r"^([0-9]+([.][0-9]+)?(ns|us|ms|s|m|h))+$"
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

# Knative rejects a scale-down-delay above 1h, and keepAlive is rendered as that annotation: with runtime
# knative a longer keepAlive is refused (by the CRD's CEL rule and by the parser, with this message).
KNATIVE_MAX_KEEP_ALIVE = "1h"
KNATIVE_KEEP_ALIVE_MESSAGE = (f"spec.experts.scaling.keepAlive is at most {KNATIVE_MAX_KEEP_ALIVE} with runtime knative "
                              "(Knative caps the scale-down-delay it is rendered as at 1h): write 1h or less, or set "
                              "spec.experts.runtime: deployment, which keeps replicas warm for any keepAlive")


class SpecError(ValueError):
    """A spec the operator cannot serve; the message names the field and what to write instead."""


def parse_duration(text: str, field_name: str) -> float:
    """Go duration -> seconds."""
    if not isinstance(text, str) or not re.fullmatch(DURATION_PATTERN, text):
        raise SpecError(f"{field_name}: {text!r} is not a duration; write e.g. 90s, 10m or 1h30m")
    return sum(float(n) * _DURATION_UNITS[unit] for n, _, unit in re.findall(r"([0-9]+([.][0-9]+)?)(ns|us|ms|s|m|h)", text))


def parse_bytes(value: Any, field_name: str) -> int:
    try:
        quantity = parse_quantity(value)
    except (ValueError, TypeError):
        raise SpecError(f"{field_name}: {value!r} is not a quantity; write bytes like 268435456, 256Mi or 1Gi") from None
    if quantity <= 0:
        raise SpecError(f"{field_name} must be positive, got {value!r}")
    return int(quantity)


@dataclass(frozen=True)
class ModelSource:
    """Where the checkpoint folder is: a PVC, a host path, or an object store an init container copies from."""

    scheme: str      # pvc | hostpath | s3 | gs
    location: str    # claim name, host path, or the whole s3:// / gs:// URI
    sub_path: str    # inside the claim ("" for the claim's root)

    @classmethod
    def parse(cls, uri: str) -> "ModelSource":
        scheme, sep, rest = uri.partition("://")
        if not sep or scheme not in URI_SCHEMES or not rest.strip("/"):
            raise SpecError(f"spec.model.uri {uri!r}: write pvc://CLAIM/path, hostpath:///path, s3://bucket/path "
                            "or gs://bucket/path")
        if scheme == "pvc":
            claim, _, sub = rest.partition("/")
            return cls("pvc", claim, sub.strip("/"))
        if scheme == "hostpath":
            if not rest.startswith("/"):
                raise SpecError(f"spec.model.uri {uri!r}: a host path is absolute: hostpath:///path/to/checkpoint")
            return cls("hostpath", rest.rstrip("/") or "/", "")
        return cls(scheme, uri, "")


@dataclass(frozen=True)
class Layout:
    moe_layers: tuple[int, ...]
    experts_per_layer: int
    expert_bytes: int  # one expert's weights in the serving dtype


@dataclass(frozen=True)
class Placement:
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Frontend:
    replicas: int
    gpus: int
    image: str | None
    resources: Mapping[str, Any]
    placement: Placement


@dataclass(frozen=True)
class Scaling:
    cv_threshold: float
    layer_memory_cap: int | None  # bytes; None = no cap
    prediction_distance: int
    keep_alive_s: float
    keep_alive: str               # as written (Knative's scale-down-delay takes the same syntax)
    max_replicas_per_expert: int


@dataclass(frozen=True)
class Knative:
    progress_deadline: str
    container_concurrency: int


@dataclass(frozen=True)
class GpuSharing:
    """How expert functions share GPUs: what each function requests and what the planner packs into a GPU."""

    mode: str                # exclusive | timeSlicing | mps | dra
    resource_name: str       # timeSlicing/mps: the device plugin's shared resource, one per function
    function_overhead: int   # bytes of GPU memory a function takes beside its experts (CUDA context, buffers)
    device_class: str        # dra: DeviceClass of the claims
    strategy: str            # dra: how the pods of one claim share its GPU (TimeSlicing | MPS)

    @property
    def shared(self) -> bool:
        return self.mode != "exclusive"


@dataclass(frozen=True)
class Experts:
    runtime: str
    image: str | None
    bundle_bytes: int
    gpus: int                      # nvidia.com/gpu per replica (gpuSharing.mode exclusive)
    sharing: GpuSharing
    resources: Mapping[str, Any]
    scaling: Scaling
    placement: Placement
    knative: Knative


@dataclass(frozen=True)
class Offload:
    gpu_memory_budget: int
    predictor: str


@dataclass(frozen=True)
class MoESpec:
    """spec of a MoEDeployment, typed, with defaults filled and units converted (bytes, seconds)."""

    model_uri: str
    source: ModelSource
    dtype: str
    layout: Layout
    mode: str
    frontend: Frontend
    experts: Experts
    offload: Offload | None
    gpu_hour_price: float

    def bundles(self) -> tuple[Bundle, ...]:
        return _bundles(self.layout, self.experts.bundle_bytes)

    @classmethod
    def parse(cls, spec: Mapping[str, Any]) -> "MoESpec":
        """Raise SpecError for what the CRD schema cannot express (or a spec that skipped the server)."""
        model = _section(spec, "model")
        if "uri" not in model:
            raise SpecError("spec.model.uri is required: pvc://CLAIM/path, hostpath:///path, s3://... or gs://...")
        raw_layout = model.get("layout")
        if not raw_layout:
            raise SpecError("spec.model.layout is required: moeLayers, expertsPerLayer and expertBytes of the checkpoint")
        layout = Layout(tuple(int(x) for x in raw_layout["moeLayers"]), int(raw_layout["expertsPerLayer"]),
                        parse_bytes(raw_layout["expertBytes"], "spec.model.layout.expertBytes"))
        if not layout.moe_layers or layout.experts_per_layer < 1:
            raise SpecError("spec.model.layout needs at least one MoE layer and one expert per layer")
        mode = _get(spec, "mode")
        if mode not in MODES:
            raise SpecError(f"spec.mode {mode!r}: choose one of {', '.join(MODES)}")

        experts, frontend = _section(spec, "experts"), _section(spec, "frontend")
        scaling, knative = _section(experts, "scaling"), _section(experts, "knative")
        cap = scaling.get("layerMemoryCap")
        keep_alive = _get(scaling, "keepAlive", "experts.scaling")
        parsed_experts = Experts(
            runtime=_get(experts, "runtime", "experts"),
            image=experts.get("image"),
            bundle_bytes=parse_bytes(_get(experts, "bundleBytes", "experts"), "spec.experts.bundleBytes"),
            gpus=int(_get(experts, "gpus", "experts")),
            sharing=_sharing(_section(experts, "gpuSharing")),
            resources=experts.get("resources", {}),
            scaling=Scaling(
                cv_threshold=float(_get(scaling, "cvThreshold", "experts.scaling")),
                layer_memory_cap=parse_bytes(cap, "spec.experts.scaling.layerMemoryCap") if cap is not None else None,
                prediction_distance=int(_get(scaling, "predictionDistance", "experts.scaling")),
                keep_alive_s=parse_duration(keep_alive, "spec.experts.scaling.keepAlive"),
                keep_alive=keep_alive,
                max_replicas_per_expert=int(_get(scaling, "maxReplicasPerExpert", "experts.scaling")),
            ),
            placement=_placement(experts),
            knative=Knative(_get(knative, "progressDeadline", "experts.knative"),
                            int(_get(knative, "containerConcurrency", "experts.knative"))),
        )
        if parsed_experts.runtime not in RUNTIMES:
            raise SpecError(f"spec.experts.runtime {parsed_experts.runtime!r}: choose knative or deployment")
        sharing = parsed_experts.sharing
        if sharing.shared and parsed_experts.gpus != 1:
            raise SpecError(SHARED_GPUS_MESSAGE)
        if sharing.mode == "dra" and parsed_experts.runtime != "deployment":
            raise SpecError(DRA_NEEDS_DEPLOYMENT_MESSAGE)
        if parsed_experts.runtime == "knative" and parsed_experts.scaling.keep_alive_s > parse_duration(
                KNATIVE_MAX_KEEP_ALIVE, "KNATIVE_MAX_KEEP_ALIVE"):
            raise SpecError(KNATIVE_KEEP_ALIVE_MESSAGE)
        offload = None
        if spec.get("offload"):
            raw = spec["offload"]
            offload = Offload(parse_bytes(raw.get("gpuMemoryBudget"), "spec.offload.gpuMemoryBudget"),
                              _get(raw, "predictor", "offload"))
        if mode == "offload" and offload is None:
            raise SpecError("mode offload needs spec.offload.gpuMemoryBudget (GPU memory for hot experts, e.g. 20Gi)")
        return cls(
            model_uri=model["uri"], source=ModelSource.parse(model["uri"]), dtype=_get(model, "dtype", "model"),
            layout=layout, mode=mode,
            frontend=Frontend(int(_get(frontend, "replicas", "frontend")), int(_get(frontend, "gpus", "frontend")),
                              frontend.get("image"), frontend.get("resources", {}), _placement(frontend)),
            experts=parsed_experts, offload=offload,
            gpu_hour_price=float(_get(_section(spec, "cost"), "gpuHourPrice", "cost")),
        )


@dataclass(frozen=True)
class MoEDeployment:
    """One custom resource: who it is (for names, owner references, events) and its parsed spec."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: MoESpec

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> "MoEDeployment":
        meta = body["metadata"]
        return cls(meta["name"], meta["namespace"], meta.get("uid", ""), int(meta.get("generation", 0)),
                   MoESpec.parse(body.get("spec", {})))


@functools.lru_cache(maxsize=16)
def _bundles(layout: Layout, bundle_bytes: int) -> tuple[Bundle, ...]:
    # Cached: DeepSeek-V3-sized models have thousands of bundles and every reconcile needs them.
    return tuple(bundles_by_bytes(layout.moe_layers, layout.experts_per_layer, layout.expert_bytes, bundle_bytes))


def _section(parent: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    return parent.get(key) or {}


def _get(section: Mapping[str, Any], key: str, path: str = "") -> Any:
    return section[key] if key in section else DEFAULTS[f"{path}.{key}" if path else key]


def _sharing(raw: Mapping[str, Any]) -> GpuSharing:
    path = "experts.gpuSharing"
    sharing = GpuSharing(
        mode=_get(raw, "mode", path), resource_name=_get(raw, "resourceName", path),
        function_overhead=parse_bytes(_get(raw, "functionOverhead", path), "spec.experts.gpuSharing.functionOverhead"),
        device_class=_get(raw, "deviceClassName", path), strategy=_get(raw, "draStrategy", path))
    if sharing.mode not in SHARING_MODES:
        raise SpecError(f"spec.experts.gpuSharing.mode {sharing.mode!r}: choose one of {', '.join(SHARING_MODES)}")
    if sharing.strategy not in DRA_STRATEGIES:
        raise SpecError(f"spec.experts.gpuSharing.draStrategy {sharing.strategy!r}: choose TimeSlicing or MPS")
    if not re.fullmatch(RESOURCE_NAME_PATTERN, sharing.resource_name):
        raise SpecError(f"spec.experts.gpuSharing.resourceName {sharing.resource_name!r}: write the extended resource "
                        "the device plugin advertises, e.g. nvidia.com/gpu or nvidia.com/gpu.shared")
    return sharing


def _placement(section: Mapping[str, Any]) -> Placement:
    raw = _section(section, "placement")
    return Placement(dict(raw.get("nodeSelector", {})), tuple(raw.get("tolerations", ())))
