"""spec.dataPath on the test control plane: the API server's PodSecurity admission forbids the hostShm pods
at the restricted level and admits the tcp ones (so the operator's refusal matches the server), the operator
refuses hostShm in a restricted namespace with a condition and an event and creates nothing, and applies the
same spec once the namespace is privileged, with the volumes, users and arguments stored as rendered."""

from __future__ import annotations

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubemoe.operator.config import OperatorConfig
from kubemoe.operator.plan import Loads, plan
from kubemoe.operator.pod_security import ENFORCE_LABEL
from kubemoe.operator.render import render
from kubemoe.operator.spec import MoEDeployment
from kubemoe.pod_args import NODE_SHM_MOUNT

pytestmark = pytest.mark.cluster

MOED = dict(group="kubemoe.io", version="v1alpha1", plural="moedeployments")
SELECTOR = "app.kubernetes.io/instance=shm,app.kubernetes.io/managed-by=kubemoe-operator"


def label(api, namespace: str, level: str) -> None:
    client.CoreV1Api(api).patch_namespace(namespace, {"metadata": {"labels": {ENFORCE_LABEL: level}}})


def frontend_pod(f, namespace: str, same_node: str) -> dict:
    """The frontend's pod as the operator renders it (its ServiceAccount left out: the dry run needs none)."""
    deployment = MoEDeployment.from_body(f.moed_body(namespace=namespace, dataPath={"sameNode": same_node}))
    objects = render(deployment, plan(deployment.spec, Loads(), f.gpu_nodes(2), None, 0.0), OperatorConfig())
    pod = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "tiny-frontend")
    spec = dict(pod["spec"]["template"]["spec"])
    del spec["serviceAccountName"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"frontend-{same_node.lower()}"}, "spec": spec}


@pytest.mark.parametrize("level", ["baseline", "restricted"])
def test_pod_security_admission_forbids_host_shm_pods_and_admits_tcp_ones(api, namespace, f, level):
    label(api, namespace, level)
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, frontend_pod(f, namespace, "tcp"), dry_run="All")  # restricted holds
    with pytest.raises(ApiException) as refused:
        core.create_namespaced_pod(namespace, frontend_pod(f, namespace, "hostShm"), dry_run="All")
    assert refused.value.status == 403 and "violates PodSecurity" in refused.value.body, refused.value.body
    message = refused.value.body.replace('\\"', '"')
    assert 'volume "node-shm"' in message and "hostPath" in message, message


def conditions(api, namespace: str) -> dict[str, dict]:
    body = client.CustomObjectsApi(api).get_namespaced_custom_object(namespace=namespace, name="shm", **MOED)
    return {c["type"]: c for c in (body.get("status") or {}).get("conditions", [])}


def test_host_shm_is_refused_in_a_restricted_namespace_and_applied_once_it_is_privileged(cluster, api, operator,
                                                                                       namespace, f):
    label(api, namespace, "restricted")
    body = f.moed_body(name="shm", namespace=namespace, dataPath={"sameNode": "hostShm", "runAsUser": 4242})
    del body["metadata"]["uid"], body["metadata"]["generation"]
    f.apply(cluster, body)
    refused = f.wait(lambda: conditions(api, namespace).get("PlanApplied", {}).get("reason") == "PodSecurityForbidden"
                     and conditions(api, namespace), 60, "PlanApplied=False PodSecurityForbidden", operator)
    for kind in ("Ready", "PlanApplied", "ExpertsReady", "FrontendReady"):
        assert (refused[kind]["status"], refused[kind]["reason"]) == ("False", "PodSecurityForbidden"), refused[kind]
    assert f"kubectl label namespace {namespace} {ENFORCE_LABEL}=privileged --overwrite" in refused["Ready"]["message"]
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    warnings = f.wait(lambda: [e for e in core.list_namespaced_event(namespace, field_selector="involvedObject.name=shm")
                               .items if e.reason == "PodSecurityForbidden"], 30, "a PodSecurityForbidden event",
                      operator)
    assert warnings[0].type == "Warning" and "set sameNode: tcp" in warnings[0].message
    assert not apps.list_namespaced_deployment(namespace, label_selector=SELECTOR).items  # nothing created
    assert not core.list_namespaced_pod(namespace, label_selector=SELECTOR).items
    assert not core.list_namespaced_config_map(namespace, label_selector=SELECTOR).items
    assert not core.list_namespaced_service_account(namespace, label_selector=SELECTOR).items

    label(api, namespace, "privileged")
    f.wait(lambda: conditions(api, namespace).get("PlanApplied", {}).get("status") == "True", 60,
           "PlanApplied=True once the namespace is privileged", operator)
    uid = client.CustomObjectsApi(api).get_namespaced_custom_object(namespace=namespace, name="shm", **MOED)[
        "metadata"]["uid"]
    frontends = [api.sanitize_for_serialization(d)["spec"]["template"]["spec"] for d in
                 apps.list_namespaced_deployment(namespace, label_selector=SELECTOR).items]
    expert_pods = [api.sanitize_for_serialization(p)["spec"] for p in core.list_namespaced_pod(
        namespace, label_selector=f"{SELECTOR},app.kubernetes.io/component=expert").items]
    assert (len(frontends), len(expert_pods)) == (1, 4)  # the frontend and 4 expert functions, as the API server stores them
    for pod in frontends + expert_pods:
        (container,) = pod["containers"]
        assert {"name": "node-shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}} in pod["volumes"]
        assert {"name": "node-shm", "mountPath": NODE_SHM_MOUNT} in container["volumeMounts"]
        args = container["args"]
        assert args[args.index("--shm-dir") + 1] == f"{NODE_SHM_MOUNT}/kubemoe-{uid}"
        context = container["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"], context["runAsNonRoot"]) == (4242, 4242, True)
        assert context["capabilities"] == {"drop": ["ALL"]} and context["allowPrivilegeEscalation"] is False
