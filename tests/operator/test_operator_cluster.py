"""The operator end to end on a real control plane: chart installed with helm, the operator running
as a process under the chart's ServiceAccount (its RBAC is what is tested), kwok fake GPU nodes.
"""

from __future__ import annotations

import signal
import time

import pytest
from kubernetes import client


pytestmark = pytest.mark.cluster

MOED = dict(group="kubemoe.io", version="v1alpha1", plural="moedeployments")
KSVC = dict(group="serving.knative.dev", version="v1", plural="services")


def children(api, namespace: str, name: str) -> dict[str, list[dict]]:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/managed-by=kubemoe-operator"
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    ksvcs = client.CustomObjectsApi(api).list_namespaced_custom_object(namespace=namespace, label_selector=selector,
                                                                        **KSVC)["items"]
    return {
        "Deployment": [d.to_dict() for d in apps.list_namespaced_deployment(namespace, label_selector=selector).items],
        "Service": [s.to_dict() for s in core.list_namespaced_service(namespace, label_selector=selector).items],
        "ConfigMap": [c.to_dict() for c in core.list_namespaced_config_map(namespace, label_selector=selector).items],
        "KnativeService": ksvcs,
        "Pod": [p.to_dict() for p in core.list_namespaced_pod(  # the expert functions' (runtime pods)
            namespace, label_selector=f"{selector},app.kubernetes.io/component=expert").items],
    }


def hostpath_body(f, name: str, namespace: str) -> dict:
    # A host path, not a PVC: the scheduler would hold pods of a claim that does not exist.
    body = f.moed_body(name=name, namespace=namespace, model={"uri": "hostpath:///models/tiny"})
    del body["metadata"]["uid"], body["metadata"]["generation"]
    return body


def test_pods_runtime_end_to_end(cluster, api, operator, namespace, f):
    body = hostpath_body(f, "tiny", namespace)
    f.apply(cluster, body)

    # Children: frontend Deployment + Service, routing ConfigMap, 4 expert pods under one headless Service.
    def all_children():
        found = children(api, namespace, "tiny")
        return len(found["Deployment"]) == 1 and len(found["Pod"]) == 4 and len(found["Service"]) == 2 \
            and found["ConfigMap"] and found
    found = f.wait(all_children, 60, "the operator to create the frontend, routing table and 4 expert services", operator)
    owner_uid = f.moed(api, namespace, "tiny")["metadata"]["uid"]
    for obj in found["Deployment"] + found["Service"] + found["ConfigMap"] + found["Pod"]:
        assert [o["uid"] for o in obj["metadata"]["owner_references"]] == [owner_uid]
    service = next(s for s in found["Service"] if s["metadata"]["name"] == "tiny-frontend")
    assert {(p["name"], p["port"]) for p in service["spec"]["ports"]} == {("http", 8000), ("grpc", 50051)}

    # Expert pods run on exactly the planned fake GPU nodes; the MoEDeployment becomes Ready.
    core = client.CoreV1Api(api)
    planned = {d["metadata"]["labels"]["kubemoe.io/bundle"]: d["metadata"]["annotations"]["kubemoe.io/node"]
               for d in found["Pod"]}

    def expert_pods_running():
        pods = core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/component=expert").items
        running = {p.metadata.labels["kubemoe.io/bundle"]: p.spec.node_name for p in pods if p.status.phase == "Running"}
        return running == planned
    f.wait(expert_pods_running, 60, f"expert pods Running on {planned}", operator)
    ready = f.wait(lambda: f.condition(f.moed(api, namespace, "tiny"), "Ready").get("status") == "True"
                   and f.moed(api, namespace, "tiny"), 60, "status Ready=True", operator)
    status = ready["status"]
    assert status["observedGeneration"] == ready["metadata"]["generation"]
    assert status["plan"]["replicas"] == 4 and status["plan"]["functions"] == 4 and status["mode"] == "distributed"
    assert {c["type"] for c in status["conditions"]} == {"Ready", "FrontendReady", "ExpertsReady", "PlanApplied"}
    assert all(c["observedGeneration"] == ready["metadata"]["generation"] and c["reason"] and c["message"]
               for c in status["conditions"])
    table = cluster.kubectl("get", "moed", "tiny", f"--namespace={namespace}").stdout
    assert table.split()[:9] == ["NAME", "MODE", "READY", "REPLICAS", "FUNCTIONS", "CV", "UNPLACED", "COST", "AGE"]
    assert table.split()[9:16] == ["tiny", "distributed", "True", "4", "4", "0", "0"]
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=tiny").items
    assert any(e.reason == "Applied" for e in events), [(e.reason, e.involved_object.name, e.message) for e in core.list_namespaced_event(namespace).items][:20]

    # Skewed predicted loads from the frontend (a test server speaking /loads): the hot bundle scales out.
    frontend_pod = f.wait(lambda: [p for p in core.list_namespaced_pod(
        namespace, label_selector="app.kubernetes.io/component=frontend").items if p.status.pod_ip], 30,
        "the frontend pod's IP")[0]

    def report(hot: tuple[int, int]) -> dict:
        # Observed rates are even; the predicted ones (what the operator plans with) are skewed.
        return {"model": "tiny", "frontend": frontend_pod.metadata.name, "windowSeconds": 10, "tokens": "1000",
                "loads": [{"layer": 0, "expert": e, "tokensPerSecond": 100.0,
                           "predictedTokensPerSecond": 300.0 if e in hot else 100.0} for e in range(4)]}

    def replanned(version):
        return lambda: int(f.routing_table(api, namespace, "tiny")["version"]) > int(version)

    def reasons():
        return {e.reason: e.message for e in core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=tiny").items}

    def endpoints(bundle: str) -> list[str]:
        [route] = [r for r in f.routing_table(api, namespace, "tiny")["routes"] if r["bundle"] == bundle]
        return [e["address"] for e in route["endpoints"]]

    functions = {d["metadata"]["labels"]["kubemoe.io/function"]: d["metadata"]["labels"]["kubemoe.io/bundle"]
                 for d in found["Pod"]}
    version = f.routing_table(api, namespace, "tiny")["version"]
    server = f.LoadServer(frontend_pod.status.pod_ip, report((0, 1)))
    try:
        # The hot bundle scales out in place: a function already running on the chosen node (its GPU
        # has memory to spare) is named for it in the routing table and loads it; no new service.
        f.wait(replanned(version), 30, "a new plan after the load change", operator)
        status = f.wait(lambda: (s := f.moed(api, namespace, "tiny")["status"])["plan"].get("hostedInPlace") == 1 and s,
                        30, "status with the scaled-out plan", operator)
        assert status["plan"]["replicas"] == 4 and status["plan"]["functions"] == 4
        assert status["plan"]["layers"][0] == {"layer": 0, "replicas": 3, "cvBefore": 0.5, "cvAfter": 0.1768}
        assert status["plan"]["unplaced"] == 0 and status["loads"]["frontends"] == 1
        own, host = endpoints("l0-e0-1")
        assert functions[own.split(".")[0]] == "l0-e0-1" and functions[host.split(".")[0]] != "l0-e0-1"
        assert len(children(api, namespace, "tiny")["Pod"]) == 4
        f.wait(lambda: "l0-e0-1 1->2" in reasons().get("ScaledOut", "")
               and "l0-e0-1 in" in reasons().get("HostedInPlace", ""), 30, "ScaledOut and HostedInPlace events", operator)
        # The load moves to the other bundle: the in-place replica leaves the table (the function keeps
        # it warm for keepAlive), and the other bundle is hosted in place in turn.
        version = f.routing_table(api, namespace, "tiny")["version"]
        server.report = report((2, 3))
        f.wait(replanned(version), 30, "a new plan after the load moved", operator)
        assert endpoints("l0-e0-1") == [own] and len(endpoints("l0-e2-3")) == 2
        f.wait(lambda: "ScaledIn" in reasons(), 30, "a ScaledIn event", operator)
        # It comes back: the same running function hosts it again (a warm start: it may still hold it).
        version = f.routing_table(api, namespace, "tiny")["version"]
        server.report = report((0, 1))
        f.wait(replanned(version), 30, "a new plan after the load came back", operator)
        assert endpoints("l0-e0-1") == [own, host]
    finally:
        server.close()
    status = f.moed(api, namespace, "tiny")["status"]
    assert status["plan"]["retired"] == 0 and status["cost"]["usdPerMillionTokens"] > 0

    # Deleting the MoEDeployment deletes every child (owner references + garbage collector).
    client.CustomObjectsApi(api).delete_namespaced_custom_object(namespace=namespace, name="tiny", **MOED)
    f.wait(lambda: not any(children(api, namespace, "tiny").values()), 60, "garbage collection of every child")


def test_restart_mid_way_creates_no_duplicates(cluster, api, operator, namespace, f):
    body = hostpath_body(f, "again", namespace)
    operator.kill(signal.SIGKILL)
    operator.start()
    f.apply(cluster, body)
    # Kill it as soon as it has started applying, then start it again.
    f.wait(lambda: any(children(api, namespace, "again").values()), 60, "the first child", operator)
    operator.kill(signal.SIGKILL)
    operator.start()
    f.wait(lambda: f.condition(f.moed(api, namespace, "again"), "PlanApplied").get("status") == "True", 60,
           "PlanApplied after the restart", operator)
    found = children(api, namespace, "again")
    names = [(kind, o["metadata"]["name"]) for kind, objs in found.items() for o in objs]
    # The frontend's Deployment, 4 expert pods, Services (frontend, headless experts), ConfigMap
    assert len(names) == len(set(names)) == 1 + 4 + 2 + 1
    apps = client.AppsV1Api(api)
    replica_sets = apps.list_namespaced_replica_set(namespace).items
    assert len(replica_sets) == 1  # the frontend was not rolled: the restart re-applied nothing that changed


def test_knative_runtime_renders_pinned_services_with_the_plan(cluster, api, operator, namespace, f):
    body = f.moed_body(name="kn", namespace=namespace, experts={
        "runtime": "knative", "bundleBytes": "256Mi", "scaling": {"keepAlive": "7m", "maxReplicasPerExpert": 3},
        "placement": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}})
    del body["metadata"]["uid"], body["metadata"]["generation"]
    f.apply(cluster, body)
    ksvcs = f.wait(lambda: len(children(api, namespace, "kn")["KnativeService"]) == 4
                   and children(api, namespace, "kn")["KnativeService"], 60, "4 Knative Services", operator)
    nodes = {n.metadata.name for n in client.CoreV1Api(api).list_node().items}
    for ksvc in ksvcs:
        template = ksvc["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        assert annotations["autoscaling.knative.dev/min-scale"] == "1"
        assert annotations["autoscaling.knative.dev/max-scale"] == "1"  # what the plan gives it, no more
        assert annotations["autoscaling.knative.dev/scale-down-delay"] == "7m"
        assert annotations["serving.knative.dev/progress-deadline"] == "15m"
        term = template["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"][0]["matchFields"][0]
        assert term["key"] == "metadata.name" and term["values"][0] in nodes
        container = template["spec"]["containers"][0]
        assert container["ports"][0]["name"] == "h2c" and container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert template["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "models"  # not pruned
    table = f.wait(lambda: f.routing_table(api, namespace, "kn"), 30, "the routing table (applied last)", operator)
    addresses = {e["address"] for r in table["routes"] for e in r["endpoints"]}
    assert addresses == {f"{k['metadata']['name']}.{namespace}.svc.cluster.local:80" for k in ksvcs}
    # No Knative controller runs here, so the services never report Ready: ExpertsReady says so.
    experts = f.wait(lambda: f.condition(f.moed(api, namespace, "kn"), "ExpertsReady") or None, 30, "ExpertsReady", operator)
    assert experts["status"] == "False" and experts["reason"] == "Progressing"


def test_a_second_operator_replica_stands_by(cluster, api, operator, namespace, f, tmp_path):
    """Peering: a lower-priority replica pauses while the running one acts, and never touches objects."""
    standby = type(operator)(cluster, operator.kubeconfig, tmp_path / "standby.log")
    standby.starts = -1000  # priority 1000 + starts: below every start of the session's operator
    standby.start()
    try:
        # Kopf logs "Pausing operations in favour of ..." once it has read the peering object; on a
        # loaded machine that can take a while, so wait for its startup and then for it to hold back.
        f.wait(lambda: "Initial authentication has finished" in standby.tail(200), 60, "the standby to start", standby)
        f.apply(cluster, hostpath_body(f, "peered", namespace))
        f.wait(lambda: f.condition(f.moed(api, namespace, "peered"), "PlanApplied").get("status") == "True", 60,
               "PlanApplied by the active operator", operator)
        time.sleep(5)  # time for a standby that wrongly acts to show it
        assert "peered" not in standby.tail(500), standby.tail(40)
        assert standby.proc.poll() is None, "the standby must keep running, ready to take over"
    finally:
        standby.kill(signal.SIGTERM)
