"""Whether the namespace's Pod Security admission lets the rendered pods run: decided before applying.

PodSecurity admission checks Pods, not the Deployments and Knative Services that make them: a template
it forbids is stored, and then its ReplicaSet (or revision) fails to create every pod, where the user
does not look. So the operator reads the namespace's enforce level and refuses the plan with a condition
that says what to change. Of what kubemoe renders, only hostPath volumes need more than the restricted
level (the model's hostpath:// and spec.dataPath.sameNode hostShm); baseline and restricted both forbid
them. Not seen from here: a cluster-wide default level (the API server's AdmissionConfiguration;
Kubernetes' own default is privileged) and exemptions.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from kubemoe.operator.render import pod_spec_of

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
PRIVILEGED = "privileged"  # the one level that allows hostPath (an unknown value counts as restricted, as in the API server)

# What renders each hostPath volume (by the volume's name in operator/render.py), and what else to write.
_SOURCES = {"node-shm": "spec.dataPath.sameNode hostShm (or set sameNode: tcp)",
            "model": "spec.model.uri hostpath:// (or use a pvc://, s3:// or gs:// checkpoint)"}


def host_path_volumes(objects: Iterable[Mapping[str, Any]]) -> list[str]:
    """Names of the hostPath volumes in the objects' pods (Pods, Deployments' and Knative Services' templates),
    once each."""
    names: list[str] = []
    for obj in objects:
        pod = pod_spec_of(obj) or {}
        for volume in pod.get("volumes", []):
            if "hostPath" in volume and volume["name"] not in names:
                names.append(volume["name"])
    return names


def refusal(namespace: str, labels: Mapping[str, str], volumes: list[str]) -> str | None:
    """Why pods with these hostPath volumes cannot run in the namespace (with what to do), or None."""
    level = labels.get(ENFORCE_LABEL)
    if not volumes or level is None or level == PRIVILEGED:
        return None
    sources = "; ".join(_SOURCES.get(v, f"volume {v}") for v in volumes)
    return (f"namespace {namespace} enforces Pod Security level {level!r} ({ENFORCE_LABEL}), which forbids the "
            f"hostPath volumes these pods need: {sources}. Label the namespace privileged (kubectl label namespace "
            f"{namespace} {ENFORCE_LABEL}={PRIVILEGED} --overwrite) or change the spec as said; nothing was applied")
