"""What a reconcile writes: the objects rendered for a plan against the deployment's children in the cluster.

Pure. Most kinds are applied when their fingerprint differs and deleted when no longer rendered. The expert
functions' pods (runtime pods) follow the rules a Deployment's controllers kept for their pods:

- a pod that ended (failed or finished: evicted, its node lost) or is going is deleted, and made again by
  the next reconcile (its name is free only once it is gone);
- a pod this process created that the watch does not show yet is expected, not missing (client-go's
  expectations): sent again, each was a 409 the API server answered while ~1000 pods started;
- a running pod whose labels or annotations changed (a new operator's rendering: no plan changes them) is
  patched after the new plan's status, not before, as it changes nothing that runs;
- a function's pods of an older spec (another name: render.py) stay until all its new ones are Ready (a
  Deployment's surge); a later reconcile deletes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Any, Mapping, Sequence

from kubemoe.operator.render import FINGERPRINT_ANNOTATION, function_of

Object = dict[str, Any]
ObjectKey = tuple[str, str, str]  # (apiVersion, kind, name)


def key_of(obj: Mapping[str, Any]) -> ObjectKey:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


@dataclass(frozen=True)
class Diff:
    made: list[Object]       # created or applied before the status, in the order rendered
    annotate: list[Object]   # running pods whose labels or annotations changed: patched after the status
    gone: list[ObjectKey]    # deleted after the status
    unchanged: int


def diff(wanted: Sequence[Object], children: Mapping[ObjectKey, Object], expected: AbstractSet[ObjectKey]) -> Diff:
    """`wanted` as rendered (in apply order), `children` as the cluster has them, `expected` the pods this
    process created that `children` may not show yet."""
    ended = {key for key, o in children.items() if is_ended(o)}
    stale = [o for o in wanted if key_of(o) not in ended and key_of(o) not in expected
             and _fingerprint(children.get(key_of(o)) or {"metadata": {}}) != _fingerprint(o)]
    rendered = {key_of(o) for o in wanted} - ended
    starting = {function_of(o) for o in wanted if o["kind"] == "Pod" and not is_ready(children.get(key_of(o)) or o)}
    gone = [key for key, o in children.items() if key not in rendered and not o["metadata"].get("deletionTimestamp")
            and not (key[1] == "Pod" and not is_ended(o) and function_of(o) in starting)]
    return Diff(made=[o for o in stale if o["kind"] != "Pod" or key_of(o) not in children],
                annotate=[o for o in stale if o["kind"] == "Pod" and key_of(o) in children],
                gone=gone, unchanged=len(wanted) - len(stale))


def is_ended(obj: Mapping[str, Any]) -> bool:
    """A pod that will not serve again: it failed or finished (evicted, its node lost), or it is going."""
    return obj["kind"] == "Pod" and (bool(obj["metadata"].get("deletionTimestamp"))
                                     or (obj.get("status") or {}).get("phase") in ("Failed", "Succeeded"))


def is_ready(obj: Mapping[str, Any]) -> bool:
    """A pod Ready, or a Knative Service Ready for its latest spec."""
    status = obj.get("status") or {}
    if obj["kind"] == "Pod":
        return not is_ended(obj) and any(x.get("type") == "Ready" and x.get("status") == "True"
                                         for x in status.get("conditions", []))
    current = status.get("observedGeneration") == obj["metadata"].get("generation")
    return current and any(x.get("type") == "Ready" and x.get("status") == "True" for x in status.get("conditions", []))


def _fingerprint(obj: Mapping[str, Any]) -> str | None:
    return (obj["metadata"].get("annotations") or {}).get(FINGERPRINT_ANNOTATION)
