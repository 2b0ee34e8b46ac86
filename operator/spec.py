"""The MoEDeployment resource as one typed config, built once per reconcile from the custom resource.

The fields, their defaults and their validation are declared in `fields.py`, from which the CRD is
made too: the API server has already checked and defaulted what the operator reads, and parsing checks
and defaults the same way again for specs that never went through a server (unit tests, benchmarks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Mapping

from kubemoe.bundles import Bundle, bundles_by_bytes
from kubemoe.devices import CUDA_CONTEXT_BYTES
from kubemoe.operator.fields import OFFLOAD, SPEC
from kubemoe.operator.schema import SpecError, parse_bytes, parse_duration

__all__ = ["MoEDeployment", "MoESpec", "SpecError", "parse_bytes", "parse_duration"]

GROUP, VERSION, PLURAL, KIND = "kubemoe.io", "v1alpha1", "moedeployments", "MoEDeployment"
API_VERSION = f"{GROUP}/{VERSION}"
URI_SCHEMES = ("pvc", "hostpath", "s3", "gs")


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
    experts_per_token: int | None = None  # the router's top-k; None: not given

    @property
    def total_expert_bytes(self) -> int:
        """Every routed expert of the model: what an offload frontend holds in host memory."""
        return len(self.moe_layers) * self.experts_per_layer * self.expert_bytes


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

    @property
    def capped(self) -> bool:
        """MPS: the driver caps each function's memory at its planned bytes (render.py), so a running
        function can take no more experts in place."""
        return self.mode == "mps" or (self.mode == "dra" and self.strategy == "MPS")

    @property
    def working_memory(self) -> int:
        """What a function's allocator may hold beside its experts (`kubemoe expert-fn --working-memory-mib`),
        where nothing else caps it: functions time-slicing a GPU each keep an allocator cache, and what
        one keeps cached another's plan cannot have. functionOverhead less the CUDA context, which the
        allocator does not hold (at least 1 MiB, still a cap: a function raises one too small for its rounds
        to what they need, and says so). 0 (no cap) under MPS, which the driver caps, and with GPUs of
        their own."""
        if not self.shared or self.capped:
            return 0
        return max(self.function_overhead - CUDA_CONTEXT_BYTES, 1 << 20)


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
    gpu_memory_budget: int | None  # bytes; None: mode auto derives it from the GPUs (operator/mode.py)
    predictor: str                 # llapor | frequency
    predictor_file: str | None     # llapor: a path inside the checkpoint folder; None: the default file


@dataclass(frozen=True)
class DataPath:
    """How tensors travel between frontends and expert functions (fields.DATA_PATH)."""

    same_node: str      # tcp | hostShm
    run_as_user: int    # UID and GID of every container: shared memory opens only between one user's processes

    @property
    def host_shm(self) -> bool:
        return self.same_node == "hostShm"


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
    offload: Offload | None  # None in mode distributed; the section's defaults where auto omits it
    data_path: DataPath
    gpu_hour_price: float

    def bundles(self) -> tuple[Bundle, ...]:
        return _bundles(self.layout, self.experts.bundle_bytes)

    @classmethod
    def parse(cls, spec: Mapping[str, Any]) -> "MoESpec":
        """Raise SpecError, with the CRD's message where the CRD has the rule, for a spec the operator cannot serve."""
        s = SPEC.read(spec, "spec")
        model, frontend, experts = s["model"], s["frontend"], s["experts"]
        scaling, sharing, knative = experts["scaling"], experts["gpuSharing"], experts["knative"]
        layout = model["layout"]
        return cls(
            model_uri=model["uri"], source=ModelSource.parse(model["uri"]), dtype=model["dtype"],
            layout=Layout(tuple(layout["moeLayers"]), layout["expertsPerLayer"], layout["expertBytes"],
                          layout.get("expertsPerToken")),
            mode=s["mode"],
            frontend=Frontend(frontend["replicas"], frontend["gpus"], frontend.get("image"), frontend["resources"],
                              _placement(frontend["placement"])),
            experts=Experts(
                runtime=experts["runtime"], image=experts.get("image"), bundle_bytes=experts["bundleBytes"],
                gpus=experts["gpus"],
                sharing=GpuSharing(sharing["mode"], sharing["resourceName"], sharing["functionOverhead"],
                                   sharing["deviceClassName"], sharing["draStrategy"]),
                resources=experts["resources"],
                scaling=Scaling(scaling["cvThreshold"], scaling.get("layerMemoryCap"), scaling["predictionDistance"],
                                parse_duration(scaling["keepAlive"], "spec.experts.scaling.keepAlive"),
                                scaling["keepAlive"], scaling["maxReplicasPerExpert"]),
                placement=_placement(experts["placement"]),
                knative=Knative(knative["progressDeadline"], knative["containerConcurrency"])),
            offload=_offload(s),
            data_path=DataPath(s["dataPath"]["sameNode"], s["dataPath"]["runAsUser"]),
            gpu_hour_price=s["cost"]["gpuHourPrice"],
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


def _offload(s: Mapping[str, Any]) -> Offload | None:
    if s["mode"] == "distributed":
        return None
    section = s["offload"] if "offload" in s else OFFLOAD.read({}, "spec.offload")  # auto may leave it out
    return Offload(section.get("gpuMemoryBudget"), section["predictor"], section.get("predictorFile"))


def _placement(raw: Mapping[str, Any]) -> Placement:
    return Placement(dict(raw.get("nodeSelector", {})), tuple(raw.get("tolerations", ())))
