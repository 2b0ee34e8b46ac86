"""Status conditions of a MoEDeployment: their types, reasons and how Ready follows from the others.

Conditions follow the Kubernetes convention (type, status True/False/Unknown, CamelCase reason,
message for people, lastTransitionTime, observedGeneration). lastTransitionTime changes only when
status does, so a condition that stays False for an hour says since when.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Iterable

# Condition types.
READY = "Ready"                    # the model serves: every condition below is True
FRONTEND_READY = "FrontendReady"   # the frontend Deployment has all its replicas ready
EXPERTS_READY = "ExpertsReady"     # every planned expert service has its planned replicas ready
PLAN_APPLIED = "PlanApplied"       # the current plan and routing table are written to the cluster
TYPES = (READY, FRONTEND_READY, EXPERTS_READY, PLAN_APPLIED)

# Reasons.
AS_EXPECTED = "AsExpected"                  # the condition holds
APPLIED = "Applied"                         # PlanApplied: every object applied
REPLICAS_UNPLACED = "ReplicasUnplaced"      # True, but scaled-out replicas fit on no GPU (PlanApplied, ExpertsReady, Ready)
PROGRESSING = "Progressing"                 # pods are starting or loading weights
SCALED_TO_ZERO = "ScaledToZero"             # FrontendReady: spec.frontend.replicas is 0, nothing serves
NOT_NEEDED = "NotNeeded"                    # ExpertsReady in offload mode: the frontend holds the experts
INVALID_SPEC = "InvalidSpec"                # the spec passed the schema but cannot be served; fix the spec
INSUFFICIENT_CAPACITY = "InsufficientCapacity"  # not enough eligible GPU nodes for the plan; add nodes or relax placement
GPU_BUDGET_TOO_LARGE = "GpuBudgetTooLarge"  # spec.offload.gpuMemoryBudget exceeds the GPU of a node the frontend may run on
RUNTIME_MISSING = "RuntimeMissing"          # runtime knative without Knative Serving installed
POD_SECURITY_FORBIDDEN = "PodSecurityForbidden"  # the namespace's Pod Security level forbids the pods' hostPath volumes
APPLY_FAILED = "ApplyFailed"                # the API server refused an object; the message names it
DEPENDENCY_NOT_READY = "DependencyNotReady"  # Ready: names the first condition that is not True
# A refused plan (InvalidSpec, InsufficientCapacity, GpuBudgetTooLarge, RuntimeMissing, PodSecurityForbidden,
# ApplyFailed) is the reason of PlanApplied, of Ready, and of FrontendReady/ExpertsReady while what they wait
# for was never applied.


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool | None  # None = Unknown
    reason: str
    message: str

    @property
    def status_text(self) -> str:
        return {True: "True", False: "False", None: "Unknown"}[self.status]


def ready_from(parts: Iterable[Condition]) -> Condition:
    """Ready is True when every part is; otherwise it carries the first part that is not: its reason when
    that says what to fix (a refused plan), DependencyNotReady while it is only progressing."""
    for part in parts:
        if part.status is not True:
            reason = DEPENDENCY_NOT_READY if part.reason == PROGRESSING else part.reason
            return Condition(READY, False if part.status is False else None, reason,
                             f"{part.type} is {part.status_text} ({part.reason}): {part.message}")
    return Condition(READY, True, AS_EXPECTED, "frontends and expert functions serve the current plan")


def to_status(conditions: Iterable[Condition], previous: list[dict[str, Any]] | None, generation: int,
              now: dt.datetime) -> list[dict[str, Any]]:
    """Conditions as status entries, keeping lastTransitionTime where status did not change."""
    before = {c.get("type"): c for c in previous or []}
    stamp = now.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    entries = []
    for c in conditions:
        old = before.get(c.type)
        since = old["lastTransitionTime"] if old and old.get("status") == c.status_text and old.get(
            "lastTransitionTime") else stamp
        entries.append({"type": c.type, "status": c.status_text, "reason": c.reason, "message": c.message,
                        "lastTransitionTime": since, "observedGeneration": generation})
    return entries
