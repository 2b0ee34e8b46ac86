"""Events of one reconcile: what the warm pool decided and what went wrong, as (type, reason, message).

Pure: `events` turns an `Outcome` (and the status the object had before) into Kubernetes events;
the handler only posts them. One event per kind of decision and reconcile, naming at most a few
services, so a 58-layer model re-planned every window does not flood the event stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from kubemoe.operator import conditions as c
from kubemoe.operator.plan import ServiceKey

SHOWN = 5  # services or bundles named in one event's message

# Reasons (CamelCase, for `kubectl get events --field-selector reason=...`).
APPLIED = "Applied"            # objects applied or deleted
SCALED_OUT = "ScaledOut"       # bundles got more replicas (their predicted load rose)
SCALED_IN = "ScaledIn"         # bundles got fewer replicas
RETIRED = "Retired"            # services left the plan, kept warm for spec.experts.scaling.keepAlive
WARM_REUSED = "WarmReused"     # retired services came back into the plan before their keepAlive ended
EXPIRED = "Expired"            # retired services whose keepAlive ended: deleted
HOSTED = "HostedInPlace"       # scale-out replicas loaded into running functions (no new service)
MODE_CHOSEN = "ModeChosen"     # the mode in effect (what auto picked, and the offload GPU budget) is new


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def events(outcome, status_before: Mapping[str, Any] | None) -> list[Event]:
    """Events for one reconcile's `Outcome` (see reconcile.py)."""
    found: list[Event] = []
    changes, plan = outcome.changes, outcome.plan
    if changes.applied or changes.deleted:
        found.append(Event("Normal", APPLIED, f"plan version {plan.version if plan else '-'}: applied "
                                              f"{len(changes.applied)}, deleted {len(changes.deleted)}, "
                                              f"unchanged {changes.unchanged}"))
    before_mode = ((status_before or {}).get("mode"), (status_before or {}).get("modeReason"))
    if plan is not None and plan.mode_reason and before_mode != (plan.mode, plan.mode_reason):
        found.append(Event("Normal", MODE_CHOSEN, f"mode {plan.mode}: {plan.mode_reason}"))
    d = changes.decisions
    if d is not None:
        if d.scaled_out:
            found.append(Event("Normal", SCALED_OUT, "more replicas for their predicted load: " + _first(
                f"{b} {n}->{m}" for b, (n, m) in d.scaled_out.items())))
        if d.scaled_in:
            found.append(Event("Normal", SCALED_IN, "fewer replicas: " + _first(
                f"{b} {n}->{m}" for b, (n, m) in d.scaled_in.items())))
        if d.hosted:
            found.append(Event("Normal", HOSTED, "scale-out replicas loaded in place into running functions: " + _first(
                f"{b} in {host} on {node}" for b, hosts in d.hosted.items() for host, node in hosts)))
        if d.retired:
            found.append(Event("Normal", RETIRED, f"out of the plan, kept warm for keepAlive: {_services(d.retired)}"))
        if d.reused:
            found.append(Event("Normal", WARM_REUSED, f"warm services back in the plan: {_services(d.reused)}"))
        if d.expired:
            found.append(Event("Normal", EXPIRED, f"keepAlive over, deleted: {_services(d.expired)}"))
    before: Mapping[str, Any] = next((x for x in (status_before or {}).get("conditions", []) if x.get("type") == c.PLAN_APPLIED), {})
    applied = outcome.applied
    # Failures and replicas that fit nowhere as warnings, once when they change, not every timer tick.
    if applied is not None and applied.reason != c.APPLIED and (
            before.get("status"), before.get("reason"), before.get("message")) != (
            applied.status_text, applied.reason, applied.message):
        found.append(Event("Warning", applied.reason, applied.message))
    return found


def _services(keys: Iterable[ServiceKey]) -> str:
    return _first(f"{bundle} on {node}" for bundle, node in keys)


def _first(items: Iterable[str]) -> str:
    items = list(items)
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more
