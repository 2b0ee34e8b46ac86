"""spec.dataPath: what tcp and hostShm render into the frontend and expert pods, and which namespaces'
Pod Security levels the operator refuses hostShm in (operator/pod_security.py)."""

import pytest

from kubemoe.operator.config import OperatorConfig
from kubemoe.operator.plan import Loads, plan
from kubemoe.operator.pod_security import ENFORCE_LABEL, host_path_volumes, refusal
from kubemoe.operator.render import pod_spec_of, render
from kubemoe.operator.spec import MoEDeployment, MoESpec, SpecError
from kubemoe.pod_args import NODE_SHM_MOUNT

KNATIVE = {"runtime": "knative", "bundleBytes": "256Mi"}
SHM_DIR = f"{NODE_SHM_MOUNT}/kubemoe-uid-1"  # the MoEDeployment's uid names its folder


def pods(f, nodes=None, **overrides) -> dict[str, dict]:
    """Pod specs of the rendered frontend and expert functions (their pods, or their Knative Services'
    templates), by object name."""
    deployment = MoEDeployment.from_body(f.moed_body(**overrides))
    p = plan(deployment.spec, Loads(), nodes or f.gpu_nodes(2), None, 0.0)
    return {o["metadata"]["name"]: pod for o in render(deployment, p, OperatorConfig())
            if (pod := pod_spec_of(o)) is not None}


def arg(container: dict, flag: str) -> str:
    args = container["args"]
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("experts", [{"runtime": "pods"}, KNATIVE])
def test_tcp_renders_no_node_folder_and_the_restricted_security_context(f, experts):
    rendered = pods(f, experts=experts)
    assert len(rendered) == 5  # the frontend and four expert functions
    for pod in rendered.values():
        (container,) = pod["containers"]
        assert arg(container, "--shm-dir") == ""  # no segment offered in a pod's own /dev/shm
        assert not any("hostPath" in v for v in pod["volumes"])
        assert container["securityContext"] == {
            "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def test_host_shm_mounts_the_nodes_dev_shm_into_every_pod_with_one_folder_and_one_user(f):
    # Runtime pods only: Knative takes a hostPath volume mounted read-only (the CRD refuses hostShm with knative)
    rendered = pods(f, experts={"runtime": "pods"}, dataPath={"sameNode": "hostShm", "runAsUser": 4242})
    assert len(rendered) == 5
    for name, pod in rendered.items():
        (container,) = pod["containers"]
        assert arg(container, "--shm-dir") == SHM_DIR, name
        assert {"name": "node-shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}} in pod["volumes"]
        assert {"name": "node-shm", "mountPath": NODE_SHM_MOUNT} in container["volumeMounts"]
        context = container["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"], context["runAsNonRoot"]) == (4242, 4242, True)
        assert context["readOnlyRootFilesystem"] and context["capabilities"] == {"drop": ["ALL"]}


def test_host_shm_renders_no_folder_when_auto_serves_from_one_frontend(f):
    # mode auto on single-GPU nodes becomes offload: no expert function to share memory with.
    one_gpu = f.gpu_nodes(2, gpus=1, memory_gib=24)
    rendered = pods(f, nodes=one_gpu, mode="auto", offload={"gpuMemoryBudget": "20Gi"}, dataPath={"sameNode": "hostShm"})
    (pod,) = rendered.values()
    assert arg(pod["containers"][0], "--shm-dir") == "" and not host_path_volumes(
        [{"spec": {"template": {"spec": pod}}}])


def test_the_parser_refuses_host_shm_in_offload_mode_with_the_crds_message(f):
    body = f.moed_body(mode="offload", offload={"gpuMemoryBudget": "20Gi"}, dataPath={"sameNode": "hostShm"})
    with pytest.raises(SpecError, match="mode offload runs no expert functions"):
        MoESpec.parse(body["spec"])
    body["spec"]["dataPath"] = {"sameNode": "tcp", "runAsUser": 1000}  # the user still applies to the frontend
    assert MoESpec.parse(body["spec"]).data_path.run_as_user == 1000


@pytest.mark.parametrize("labels, refused", [
    ({}, False),                                      # Kubernetes' default level is privileged
    ({ENFORCE_LABEL: "privileged"}, False),
    ({ENFORCE_LABEL: "baseline"}, True),
    ({ENFORCE_LABEL: "restricted"}, True),
    ({ENFORCE_LABEL: "Restricted"}, True),            # the API server reads an unknown level as restricted
    ({"pod-security.kubernetes.io/warn": "restricted"}, False),  # only enforce refuses pods
])
def test_host_paths_are_refused_below_the_privileged_level(labels, refused):
    message = refusal("team-a", labels, ["node-shm"])
    assert (message is not None) == refused
    if refused:
        assert f"kubectl label namespace team-a {ENFORCE_LABEL}=privileged --overwrite" in message
        assert "spec.dataPath.sameNode hostShm (or set sameNode: tcp)" in message
    assert refusal("team-a", labels, []) is None  # pods without hostPath pass every level


def test_the_refusal_names_every_field_that_rendered_a_host_path(f):
    rendered = pods(f, model={"uri": "hostpath:///models/tiny"}, dataPath={"sameNode": "hostShm"})
    volumes = host_path_volumes([{"spec": {"template": {"spec": pod}}} for pod in rendered.values()])
    assert volumes == ["model", "node-shm"]
    message = refusal("default", {ENFORCE_LABEL: "baseline"}, volumes)
    assert "spec.model.uri hostpath://" in message and "spec.dataPath.sameNode hostShm" in message
