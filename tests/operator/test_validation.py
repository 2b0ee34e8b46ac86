"""Malformed MoEDeployments are refused by the real API server with a message that says what to fix:
OpenAPI types and enums by the server's own words, everything else by the CRD's CEL rules. The parser,
made from the same field declarations (operator/fields.py), refuses each of them too, with the CEL
rule's message where there is one."""

from __future__ import annotations

import copy

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubemoe.operator.spec import MoESpec, SpecError

MOED = dict(group="kubemoe.io", version="v1alpha1", plural="moedeployments")


def _set(body: dict, path: str, value) -> dict:
    body = copy.deepcopy(body)
    *parents, last = path.split(".")
    target = body
    for key in parents:
        target = target.setdefault(key, {})
    if value is DELETE:
        target.pop(last, None)
    else:
        target[last] = value
    return body


DELETE = object()
# A spec of mode offload (the valid body is distributed): for its rules, set as a whole at path "spec".
LAYOUT = {"moeLayers": [0, 1], "expertsPerLayer": 4, "expertBytes": "128Mi"}


def offload_spec(budget="1Gi", layout=LAYOUT, **offload):
    return {"model": {"uri": "pvc://models/tiny", "layout": layout}, "mode": "offload",
            "experts": {"runtime": "pods"}, "offload": {"gpuMemoryBudget": budget, **offload}}


# (id, dotted path under the body, value, what the API server's message must contain)
BAD_SPECS = [
    ("replicas-not-int", "spec.frontend.replicas", "two", "spec.frontend.replicas: Invalid value: \"string\""),
    ("replicas-negative", "spec.frontend.replicas", -1, "must be at least 0"),
    ("unknown-mode", "spec.mode", "hybrid", 'supported values: "distributed", "offload", "auto"'),
    ("unknown-runtime", "spec.experts.runtime", "lambda", 'supported values: "knative", "pods"'),
    ("unknown-dtype", "spec.model.dtype", "int3", 'supported values: "bfloat16", "float16", "float32"'),
    ("missing-uri", "spec.model.uri", DELETE, "spec.model.uri: Required value"),
    ("hub-uri", "spec.model.uri", "hf://mistralai/Mixtral-8x7B", "spec.model.uri must be pvc://CLAIM/path"),
    ("missing-layout", "spec.model.layout", DELETE, "spec.model.layout: Required value"),
    ("experts-per-layer-zero", "spec.model.layout.expertsPerLayer", 0, "must be at least 1"),
    ("no-moe-layers", "spec.model.layout.moeLayers", [], "should have at least 1 items"),
    ("duplicate-layer", "spec.model.layout.moeLayers", [0, 0], "Duplicate value"),
    ("expert-bytes-negative", "spec.model.layout.expertBytes", -5, "expertBytes must be a positive whole number of bytes"),
    ("expert-bytes-not-quantity", "spec.model.layout.expertBytes", "big", "expertBytes must be a positive whole number"),
    # 0.5 bytes is a quantity, which int() would make 0 bytes: the reconcile then failed with no condition.
    ("expert-bytes-fraction", "spec.model.layout.expertBytes", "500m", "expertBytes must be a positive whole number"),
    ("bundle-bytes-not-quantity", "spec.experts.bundleBytes", "256 megs", "bundleBytes must be a positive whole number"),
    ("cv-zero", "spec.experts.scaling.cvThreshold", 0, "cvThreshold must be in (0, 1]"),
    ("cv-above-one", "spec.experts.scaling.cvThreshold", 1.5, "cvThreshold must be in (0, 1]"),
    ("cv-not-number", "spec.experts.scaling.cvThreshold", "low", "must be of type number"),
    ("keepalive-not-duration", "spec.experts.scaling.keepAlive", "10 minutes",
     "keepAlive must be a duration in whole seconds, minutes or hours such as 90s, 10m or 1h30m"),
    # Knative refuses a scale-down-delay or progress-deadline finer than a second, and a deadline of 0s.
    ("keepalive-below-a-second", "spec.experts.scaling.keepAlive", "1500ms", "keepAlive must be a duration in whole"),
    ("progress-deadline-zero", "spec.experts", {"runtime": "knative", "knative": {"progressDeadline": "0s"}},
     "progressDeadline must be longer than 0s"),
    ("max-replicas-zero", "spec.experts.scaling.maxReplicasPerExpert", 0, "must be at least 1 and at most 1024"),
    ("prediction-distance-zero", "spec.experts.scaling.predictionDistance", 0, "must be at least 1 and at most 8"),
    ("gpus-negative", "spec.experts.gpus", -1, "must be at least 0"),
    ("gpu-price-negative", "spec.cost.gpuHourPrice", -0.5, "gpuHourPrice must not be negative"),
    ("offload-without-section", "spec.mode", "offload", "mode offload needs spec.offload.gpuMemoryBudget"),
    ("knative-fields-with-pods-runtime", "spec.experts",
     {"runtime": "pods", "knative": {"progressDeadline": "5m"}},
     "spec.experts.knative is only used with runtime knative"),
    ("offload-section-in-distributed", "spec.offload", {"gpuMemoryBudget": "20Gi"},
     "spec.offload is only used in mode offload or auto"),
    ("layer-cap-too-small", "spec.experts.scaling.layerMemoryCap", "1Mi",
     "layerMemoryCap must hold one replica of every expert of a layer"),
    ("progress-deadline-not-duration", "spec.experts.knative.progressDeadline", "soon",
     "progressDeadline must be a duration"),
    ("tolerations-not-list", "spec.experts.placement.tolerations", {"key": "x"}, "must be of type array"),
    ("knative-keepalive-over-1h", "spec.experts", {"runtime": "knative", "scaling": {"keepAlive": "1h30m"}},
     "spec.experts.scaling.keepAlive is at most 1h with runtime knative"),
    ("unknown-gpu-sharing", "spec.experts.gpuSharing", {"mode": "mig"},
     'supported values: "exclusive", "timeSlicing", "mps", "dra"'),
    ("shared-gpus-above-one", "spec.experts", {"runtime": "pods", "gpus": 2, "gpuSharing": {"mode": "mps"}},
     "spec.experts.gpus counts whole GPUs per replica and applies to gpuSharing.mode exclusive"),
    ("dra-with-knative", "spec.experts", {"runtime": "knative", "gpuSharing": {"mode": "dra"}},
     "gpuSharing.mode dra needs spec.experts.runtime: pods"),
    ("resource-name-with-dra", "spec.experts", {"runtime": "pods", "gpuSharing": {
        "mode": "dra", "resourceName": "nvidia.com/gpu.shared"}},
     "resourceName is used with mode timeSlicing or mps"),
    ("resource-name-not-extended", "spec.experts.gpuSharing", {"mode": "timeSlicing", "resourceName": "gpu"},
     "resourceName must be an extended resource such as nvidia.com/gpu"),
    ("dra-strategy-with-time-slicing", "spec.experts.gpuSharing", {"mode": "timeSlicing", "draStrategy": "MPS"},
     "deviceClassName and draStrategy are used with mode dra"),
    ("unknown-dra-strategy", "spec.experts", {"runtime": "pods", "gpuSharing": {
        "mode": "dra", "draStrategy": "MIG"}}, 'supported values: "TimeSlicing", "MPS"'),
    ("unknown-same-node", "spec.dataPath.sameNode", "rdma", 'supported values: "tcp", "hostShm"'),
    ("run-as-root", "spec.dataPath.runAsUser", 0, "spec.dataPath.runAsUser must be at least 1"),
    ("host-shm-in-offload", "spec", {"mode": "offload", "offload": {"gpuMemoryBudget": "20Gi"},
                                     "dataPath": {"sameNode": "hostShm"}, "model": {
        "uri": "pvc://models/tiny", "layout": {"moeLayers": [0, 1], "expertsPerLayer": 4, "expertBytes": "128Mi"}}},
     "spec.dataPath.sameNode hostShm shares memory between frontends and expert functions, and mode offload"),
    # Knative's webhook refuses a hostPath volume mounted writable, and shared memory writes in it.
    ("host-shm-with-knative", "spec", {"experts": {"runtime": "knative"}, "dataPath": {"sameNode": "hostShm"},
                                       "model": {"uri": "pvc://models/tiny", "layout": LAYOUT}},
     "spec.dataPath.sameNode hostShm needs spec.experts.runtime: pods"),
    ("function-overhead-not-quantity", "spec.experts.gpuSharing", {"mode": "mps", "functionOverhead": "a lot"},
     "functionOverhead must be a positive whole number of bytes"),
    ("offload-without-budget", "spec", {**offload_spec(), "offload": {"predictor": "frequency"}},
     "mode offload needs spec.offload.gpuMemoryBudget"),
    # One layer's working set: 2 on-demand buffers + 2 prefetch groups of expertsPerToken (else 1) experts.
    ("offload-budget-below-working-set", "spec", offload_spec("511Mi"), "must hold one layer's working set"),
    ("offload-budget-below-top-k-working-set", "spec", offload_spec("767Mi", {**LAYOUT, "expertsPerToken": 2}),
     "must hold one layer's working set"),
    ("experts-per-token-above-experts", "spec.model.layout", {**LAYOUT, "expertsPerToken": 5},
     "expertsPerToken is at most expertsPerLayer"),
    ("predictor-file-outside-checkpoint", "spec", offload_spec(predictorFile="../other/llapor.safetensors"),
     "predictorFile must be a path inside the checkpoint folder"),
    ("predictor-file-absolute", "spec", offload_spec(predictorFile="/models/llapor.safetensors"),
     "predictorFile must be a path inside the checkpoint folder"),
    ("predictor-file-without-llapor", "spec", offload_spec(predictor="frequency", predictorFile="p.safetensors"),
     "predictorFile is read by predictor llapor"),
]


# The API server's own words (OpenAPI types, enums, required fields, list bounds): the parser words them its way.
SERVER_WORDING = ("Invalid value: \"string\"", "supported values", "Required value", "should have at least",
                  "Duplicate value", "must be of type")


@pytest.fixture(scope="module")
def valid_body(f):
    body = f.moed_body(name="bad")
    body["metadata"] = {"name": "bad"}  # the request's namespace applies
    return body


def test_the_corpus_is_large_enough():
    assert len(BAD_SPECS) >= 20 and len({case[0] for case in BAD_SPECS}) == len(BAD_SPECS)


@pytest.mark.parametrize("case, path, value, message", BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_the_parser_refuses_every_bad_spec_with_the_crds_message(valid_body, case, path, value, message):
    MoESpec.parse(valid_body["spec"])
    with pytest.raises(SpecError) as refused:
        MoESpec.parse(_set(valid_body, path, value)["spec"])
    if not any(words in message for words in SERVER_WORDING):
        assert message in str(refused.value)


@pytest.mark.cluster
def test_the_valid_body_is_accepted(api, chart, namespace, valid_body):
    objects = client.CustomObjectsApi(api)
    created = objects.create_namespaced_custom_object(namespace=namespace, body=valid_body, **MOED)
    assert created["spec"]["experts"]["scaling"]["keepAlive"] == "10m"  # defaults applied by the server


def test_a_budget_of_exactly_the_working_set_and_a_predictor_file_inside_the_checkpoint_are_accepted():
    spec = MoESpec.parse(offload_spec("768Mi", {**LAYOUT, "expertsPerToken": 2},
                                      predictorFile="predictors/llapor.safetensors"))
    assert spec.offload.gpu_memory_budget == 768 * 2**20 and spec.layout.experts_per_token == 2


@pytest.mark.cluster
def test_an_offload_spec_at_the_working_set_is_accepted_by_the_server(api, chart, namespace):
    body = {"apiVersion": "kubemoe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": "at-the-minimum"},
            "spec": offload_spec("768Mi", {**LAYOUT, "expertsPerToken": 2}, predictorFile="p/llapor.safetensors")}
    stored = client.CustomObjectsApi(api).create_namespaced_custom_object(namespace=namespace, body=body, **MOED)
    assert stored["spec"]["offload"]["predictor"] == "llapor"  # defaulted by the server


@pytest.mark.cluster
@pytest.mark.parametrize("keep_alive, runtime", [("1h", "knative"), ("3600s", "knative"), ("24h", "pods")])
def test_keepalive_up_to_knatives_cap_or_any_with_deployments_is_accepted(api, chart, namespace, valid_body,
                                                                           keep_alive, runtime):
    body = _set(valid_body, "spec.experts", {"runtime": runtime, "scaling": {"keepAlive": keep_alive}})
    body["metadata"] = {"name": f"keep-{runtime}-{keep_alive}".lower()}
    client.CustomObjectsApi(api).create_namespaced_custom_object(namespace=namespace, body=body, **MOED)


@pytest.mark.cluster
@pytest.mark.parametrize("case, path, value, message", BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_is_rejected_with_a_message_that_says_what_to_fix(api, chart, namespace, valid_body, case, path,
                                                                   value, message):
    body = _set(valid_body, path, value)
    with pytest.raises(ApiException) as rejected:
        client.CustomObjectsApi(api).create_namespaced_custom_object(namespace=namespace, body=body, **MOED)
    assert rejected.value.status == 422, rejected.value.body
    assert message in rejected.value.body.replace('\\"', '"'), rejected.value.body


@pytest.mark.cluster
@pytest.mark.parametrize("name", ["mixtral-8x7b", "phi-3.5-moe", "llama-4-scout", "deepseek-v2-lite", "qwen3-30b-a3b",
                                  "moonlight-16b-a3b"])
def test_every_sample_is_accepted_and_defaulted_as_the_parser_defaults_it(api, chart, namespace, f, name):
    body = f.sample(name)
    stored = client.CustomObjectsApi(api).create_namespaced_custom_object(namespace=namespace, body=body, **MOED)
    assert stored["spec"] != body["spec"]  # the server filled defaults in
    assert MoESpec.parse(stored["spec"]) == MoESpec.parse(body["spec"])
