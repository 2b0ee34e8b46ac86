"""The Knative Service fields kubemoe renders must pass the real API server's CRD schema.

Only the schema is checked here: Knative's admission webhook is not running. With it, `affinity`
and `tolerations` also need the `kubernetes.podspec-affinity` / `-tolerations` feature flags.
"""

import copy

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

pytestmark = pytest.mark.cluster

KSVC = dict(group="serving.knative.dev", version="v1", plural="services")

EXPERT_SERVICE = {
    "apiVersion": "serving.knative.dev/v1",
    "kind": "Service",
    "metadata": {"name": "expert-l0-b0", "labels": {"app.kubernetes.io/part-of": "kubemoe"}},
    "spec": {"template": {
        "metadata": {"annotations": {
            "autoscaling.knative.dev/min-scale": "2",
            "autoscaling.knative.dev/max-scale": "4",
            "autoscaling.knative.dev/initial-scale": "2",
            "autoscaling.knative.dev/scale-down-delay": "10m",
            # Knative's serving.ProgressDeadlineAnnotationKey (pkg/apis/serving/register.go).
            "serving.knative.dev/progress-deadline": "15m",
        }},
        "spec": {
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                       "values": ["kwok-gpu-0"]}]}]}}},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{
                "image": "ghcr.io/kubemoe/expert-fn:test",
                "ports": [{"name": "h2c", "containerPort": 50051}],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            }],
        },
    }},
}


def test_knative_service_with_kubemoe_fields_is_accepted(api, namespace):
    objects = client.CustomObjectsApi(api)
    objects.create_namespaced_custom_object(namespace=namespace, body=EXPERT_SERVICE, **KSVC)

    stored = objects.get_namespaced_custom_object(namespace=namespace, name="expert-l0-b0", **KSVC)
    template = stored["spec"]["template"]
    # Nothing was pruned: every field kubemoe relies on comes back as written.
    assert template["metadata"]["annotations"] == EXPERT_SERVICE["spec"]["template"]["metadata"]["annotations"]
    assert template["spec"]["affinity"] == EXPERT_SERVICE["spec"]["template"]["spec"]["affinity"]
    assert template["spec"]["tolerations"] == EXPERT_SERVICE["spec"]["template"]["spec"]["tolerations"]
    container = template["spec"]["containers"][0]
    assert container["ports"] == [{"name": "h2c", "containerPort": 50051, "protocol": "TCP"}]  # schema default
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}


@pytest.mark.parametrize("path, value, complaint", [
    (("containers", 0, "ports", 0, "containerPort"), "h2c", "containerPort"),
    (("containerConcurrency",), "many", "containerConcurrency"),
    (("containers", 0, "resources"), ["nvidia.com/gpu"], "resources"),
])
def test_knative_service_with_a_wrong_type_is_rejected(api, namespace, path, value, complaint):
    body = copy.deepcopy(EXPERT_SERVICE)
    target = body["spec"]["template"]["spec"]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value

    with pytest.raises(ApiException) as rejected:
        client.CustomObjectsApi(api).create_namespaced_custom_object(namespace=namespace, body=body, **KSVC)

    assert rejected.value.status == 422, rejected.value.body
    assert complaint in rejected.value.body
