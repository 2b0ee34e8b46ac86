"""Rendered Knative Services against Knative's documented rules, checked statically (no Knative needed):
reserved queue-proxy ports, one serving container with one h2c/http1 port, probes, annotation formats,
the scale-down-delay cap, and the podspec feature flags the chart's README tells users to enable."""

from __future__ import annotations

import json
import re

import pytest

from kubemoe import ports
from kubemoe.operator.config import OperatorConfig
from kubemoe.operator.plan import Loads, plan
from kubemoe.operator.render import RETIRED_KEY, observe, render, service_of
from kubemoe.operator.spec import MoEDeployment, SpecError, parse_duration
from kubemoe.operator import crd

NOW = 1_000_000.0
KNATIVE_MAX_SCALE_DOWN_DELAY_S = 3600.0  # Knative: scale-down-delay "must be between 0s and 1h"
SCALE_ANNOTATIONS = ("min-scale", "max-scale", "initial-scale")
PROBES = ("readinessProbe", "livenessProbe", "startupProbe")
# Pod-spec fields Knative refuses unless a feature flag in config-features is on.
FEATURE_FLAGS = {"affinity": "kubernetes.podspec-affinity", "nodeSelector": "kubernetes.podspec-nodeselector",
                 "tolerations": "kubernetes.podspec-tolerations",
                 "initContainers": "kubernetes.podspec-init-containers",
                 "persistentVolumeClaim": "kubernetes.podspec-persistent-volume-claim",
                 "hostPath": "kubernetes.podspec-volumes-hostpath"}

# Specs that exercise every branch of the expert renderer: checkpoint sources, placement, knative settings.
VARIANTS = {
    "defaults": {},
    "longest-keepalive": {"scaling": {"keepAlive": "1h", "maxReplicasPerExpert": 4}},
    "placed-on-tainted-nodes": {"placement": {"nodeSelector": {"gpu": "h200"},
                                              "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
                                "knative": {"containerConcurrency": 4, "progressDeadline": "30m"}},
    "s3-checkpoint": "s3://bucket/tiny",
    "hostpath-checkpoint": "hostpath:///data/tiny",
}


def knative_services(f, variant, loads=Loads(), previous=None):
    """(deployment, every object rendered, its Knative Services) for one of VARIANTS."""
    overrides = VARIANTS[variant]
    experts = {"runtime": "knative", "bundleBytes": "256Mi", **(overrides if isinstance(overrides, dict) else {})}
    body = f.moed_body(experts=experts)
    if isinstance(overrides, str):
        body["spec"]["model"]["uri"] = overrides
    deployment = MoEDeployment.from_body(body)
    p = plan(deployment.spec, loads, f.gpu_nodes(2, labels={"gpu": "h200"}), previous, NOW)
    objects = render(deployment, p, OperatorConfig())
    services = [o for o in objects if (o["apiVersion"], o["kind"]) == ("serving.knative.dev/v1", "Service")]
    assert services
    return deployment, objects, services


def named_ports(container) -> list[int]:
    """Every port a container's arguments and environment name: `--port N`, `--x-port N`, `--port=N`, *PORT=N."""
    args, found = container.get("args", []) + container.get("command", []), []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if re.fullmatch(r"--([\w-]+-)?port", flag):
            found.append(int(value if eq else args[i + 1]))
    found += [int(e["value"]) for e in container.get("env", []) if re.search(r"PORT$", e["name"]) and "value" in e]
    return [p for p in found if p >= 0]  # -1: none bound


def check_service(service) -> None:
    template = service["spec"]["template"]
    pod = template["spec"]
    containers = pod["containers"]
    with_ports = [c for c in containers if c.get("ports")]
    assert len(with_ports) == 1, "Knative routes to exactly one container: the only one with ports"
    serving = with_ports[0]
    assert len(serving["ports"]) == 1, "Knative allows one container port"
    port = serving["ports"][0]
    assert port["name"] in ("h2c", "http1"), "gRPC needs the port named h2c (http1 otherwise)"
    assert port["name"] == "h2c"  # expert functions speak gRPC

    for container in containers + pod.get("initContainers", []):
        declared = [p["containerPort"] for p in container.get("ports", [])]
        for number in declared + named_ports(container):
            assert number not in ports.KNATIVE_RESERVED, f"{container['name']} binds {number}, reserved by Knative"
        for probe in filter(None, (container.get(p) for p in PROBES)):
            for action in ("httpGet", "tcpSocket", "grpc"):
                probe_port = probe.get(action, {}).get("port")
                if probe_port is not None:  # Knative: unset, or the serving port
                    assert probe_port in (port["containerPort"], port["name"]), probe
    assert named_ports(serving)[:2] == [ports.EXPERT_GRPC, ports.EXPERT_METRICS]  # --port, --metrics-port
    assert port["containerPort"] == ports.EXPERT_GRPC

    annotations = template["metadata"]["annotations"]
    scale = {k: annotations[f"autoscaling.knative.dev/{k}"] for k in SCALE_ANNOTATIONS}
    assert all(isinstance(v, str) and re.fullmatch(r"[0-9]+", v) for v in scale.values()), scale
    assert int(scale["initial-scale"]) >= 1  # 0 needs allow-zero-initial-scale in config-autoscaler
    assert int(scale["min-scale"]) <= int(scale["max-scale"]) or scale["max-scale"] == "0"
    delay = annotations["autoscaling.knative.dev/scale-down-delay"]
    assert 0 <= parse_duration(delay, "scale-down-delay") <= KNATIVE_MAX_SCALE_DOWN_DELAY_S, delay
    parse_duration(annotations["serving.knative.dev/progress-deadline"], "progress-deadline")
    assert isinstance(pod["containerConcurrency"], int) and 0 <= pod["containerConcurrency"] <= 1000
    assert len(service["metadata"]["name"]) <= 57  # its revisions are named <ksvc>-00001, a 63-character label


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_knative_services_follow_knatives_rules(f, variant):
    for service in knative_services(f, variant)[2]:
        check_service(service)


def test_retired_knative_services_follow_knatives_rules_too(f):
    deployment, before, _ = knative_services(f, "defaults", Loads({(0, 0): 300.0, (0, 1): 300.0, (0, 2): 100.0}))
    previous = observe(deployment.spec, "distributed", before)
    _, after, services = knative_services(f, "defaults", previous=previous)
    [table] = [o for o in after if o["kind"] == "ConfigMap"]
    warm = {(bundle, site) for bundle, site, _, _ in json.loads(table["data"][RETIRED_KEY])}
    kept = [s for s in services if service_of(s) in warm]
    assert kept and all(s in before for s in kept)  # rendered as before: not written, its revision stays warm
    for service in services:
        check_service(service)


def test_the_frontend_binds_no_reserved_port_either(f):
    # The frontend is a Deployment, but a cluster may inject a sidecar on the same ports: keep it clean.
    _, objects, _ = knative_services(f, "defaults")
    frontend = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert named_ports(frontend) == [ports.FRONTEND_HTTP, ports.FRONTEND_GRPC]
    assert not {p["containerPort"] for p in frontend["ports"]} & ports.KNATIVE_RESERVED


def test_the_processes_default_to_the_same_ports_as_the_operator_renders():
    from kubemoe.expert_fn.cli import command as expert_fn
    from kubemoe.frontend.cli import frontend_command as frontend

    defaults = {p.name: p.default for p in expert_fn.params}
    assert (defaults["port"], defaults["metrics_port"]) == (ports.EXPERT_GRPC, ports.EXPERT_METRICS)
    defaults = {p.name: p.default for p in frontend.params}
    assert (defaults["port"], defaults["grpc_port"]) == (ports.FRONTEND_HTTP, ports.FRONTEND_GRPC)
    assert not {ports.EXPERT_GRPC, ports.EXPERT_METRICS, ports.FRONTEND_HTTP, ports.FRONTEND_GRPC} & ports.KNATIVE_RESERVED


def test_every_feature_gated_podspec_field_is_in_the_charts_knative_instructions(f):
    readme = (f.chart / "README.md").read_text()
    used = set()
    for variant in VARIANTS:
        for service in knative_services(f, variant)[2]:
            pod = service["spec"]["template"]["spec"]
            used |= {k for k in FEATURE_FLAGS if k in pod}
            used |= {k for volume in pod.get("volumes", []) for k in FEATURE_FLAGS if k in volume}
    assert used >= {"affinity", "tolerations", "initContainers", "persistentVolumeClaim", "hostPath"}
    for field in used:
        assert f"{FEATURE_FLAGS[field]}: enabled" in readme, f"{field} needs {FEATURE_FLAGS[field]}"


# -- keepAlive above Knative's 1h cap: refused (runtime pods keeps services warm for any keepAlive) ----

@pytest.mark.parametrize("keep_alive", ["61m", "1h0m1s", "2h", "24h"])
def test_a_keepalive_over_an_hour_is_refused_with_runtime_knative(f, keep_alive):
    body = f.moed_body(experts={"runtime": "knative", "scaling": {"keepAlive": keep_alive}})
    with pytest.raises(SpecError, match="keepAlive is at most 1h with runtime knative.*runtime: pods"):
        MoEDeployment.from_body(body)


def test_a_long_keepalive_is_kept_with_runtime_pods(f):
    deployment = MoEDeployment.from_body(f.moed_body(experts={"runtime": "pods", "scaling": {"keepAlive": "24h"}}))
    assert deployment.spec.experts.scaling.keep_alive_s == 24 * 3600


def test_the_crd_refuses_it_too_with_the_same_message():
    experts = crd.moedeployment_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["experts"]
    rules = {r["message"]: r["rule"] for r in experts["x-kubernetes-validations"]}
    rule = next(rule for message, rule in rules.items() if "keepAlive is at most 1h" in message)
    assert "self.runtime != 'knative'" in rule and "duration(self.scaling.keepAlive) <= duration('1h')" in rule
