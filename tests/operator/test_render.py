import json

from kubemoe.operator.config import OperatorConfig
from kubemoe.operator.plan import Loads, plan
from kubemoe.operator.render import (FINGERPRINT_ANNOTATION, child_name, function_of, observe, render,
                                     service_of)
from kubemoe.operator.spec import MoEDeployment
from kubemoe.routing_table import build_route_map, parse_table

NOW = 1_000_000.0
CONFIG = OperatorConfig()


def rendered(f, nodes=2, loads=Loads(), previous=None, gpus=8, **overrides):
    deployment = MoEDeployment.from_body(f.moed_body(**overrides))
    p = plan(deployment.spec, loads, f.gpu_nodes(nodes, gpus=gpus), previous, NOW)
    return deployment, p, render(deployment, p, CONFIG)


def by_kind(objects, kind, api_version=None):
    return [o for o in objects if o["kind"] == kind and (api_version is None or o["apiVersion"] == api_version)]


def test_every_child_has_owner_labels_and_fingerprint(f):
    deployment, _, objects = rendered(f)
    for obj in objects:
        meta = obj["metadata"]
        assert meta["namespace"] == "default"
        assert meta["ownerReferences"] == [{"apiVersion": "kubemoe.io/v1alpha1", "kind": "MoEDeployment",
                                            "name": "tiny", "uid": "uid-1", "controller": True,
                                            "blockOwnerDeletion": True}]
        assert {meta["labels"][k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/part-of")} == {"kubemoe"}
        assert meta["labels"]["app.kubernetes.io/instance"] == "tiny"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kubemoe-operator"
        assert FINGERPRINT_ANNOTATION in meta["annotations"]
        assert len(meta["name"]) <= 63


def test_render_is_deterministic(f):
    assert json.dumps(rendered(f)[2], sort_keys=True) == json.dumps(rendered(f)[2], sort_keys=True)


def test_frontend_deployment_service_and_rbac(f):
    _, _, objects = rendered(f, frontend={"replicas": 2, "gpus": 1})
    deployment = next(o for o in by_kind(objects, "Deployment") if o["metadata"]["name"] == "tiny-frontend")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert deployment["spec"]["replicas"] == 2
    assert container["args"][:9] == ["frontend", "--checkpoint", "/models/tiny", "--routing-configmap",
                                     "default/tiny-routing", "--host", "0.0.0.0", "--port", "8000"]
    assert container["args"][9:11] == ["--grpc-port", "50051"]
    assert container["args"][-4:-2] == ["--prediction-distance", "1"]  # spec.experts.scaling.predictionDistance
    assert container["args"][-2:] == ["--shm-dir", ""]  # spec.dataPath.sameNode tcp: no shared folder
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["securityContext"]["readOnlyRootFilesystem"] and container["securityContext"]["runAsNonRoot"]
    assert pod["volumes"][0] == {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    service = next(o for o in by_kind(objects, "Service") if o["metadata"]["name"] == "tiny-frontend")
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("http", 8000), ("grpc", 50051)]
    role = by_kind(objects, "Role")[0]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["tiny-routing"],
                              "verbs": ["get", "list", "watch"]}]


def expert_pods(objects):
    return [o for o in by_kind(objects, "Pod") if o["metadata"]["labels"]["app.kubernetes.io/component"] == "expert"]


def test_pods_runtime_renders_pinned_pods_per_bundle_and_node_under_one_headless_service(f):
    hot = Loads({(0, 0): 300.0, (0, 1): 300.0, (0, 2): 100.0})  # a bundle scaled out: a function of 2 replicas
    _, p, objects = rendered(f, loads=hot, experts={"runtime": "pods", "bundleBytes": "256Mi",
                                                    "scaling": {"maxReplicasPerExpert": 4}})
    experts = expert_pods(objects)
    assert len({function_of(o) for o in experts}) == len(p.services()) and len(experts) == sum(p.services().values())
    assert max(p.services().values()) > 1 and not by_kind(objects, "Deployment")[1:]  # only the frontend's
    for d in experts:  # a function's replicas: its name, the spec's hash, an index
        assert d["metadata"]["name"].startswith(function_of(d) + "-")
        assert sum(function_of(o) == function_of(d) for o in experts) == p.services()[service_of(d)]
    headless = [o for o in by_kind(objects, "Service") if o["metadata"]["labels"]["app.kubernetes.io/component"] == "expert"]
    assert [(s["metadata"]["name"], s["spec"]["clusterIP"]) for s in headless] == [("tiny-experts", "None")]
    assert headless[0]["spec"]["selector"] == {"app.kubernetes.io/instance": "tiny", "app.kubernetes.io/component": "expert"}
    for d in experts:
        node = d["metadata"]["annotations"]["kubemoe.io/node"]
        pod = d["spec"]
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
        args = pod["containers"][0]["args"]
        assert args[0] == "expert-fn" and args[args.index("--port") + 1] == "8080"
        assert pod["containers"][0]["ports"] == [{"name": "h2c", "containerPort": 8080}]
        assert pod["containers"][0]["readinessProbe"]["grpc"] == {"port": 8080}  # Ready when it serves
        assert (pod["hostname"], pod["subdomain"]) == (function_of(d), "tiny-experts")  # its DNS name
    routing = by_kind(objects, "ConfigMap")[0]
    table = parse_table(routing["data"]["routing.json"])
    routes = build_route_map(table, "tiny", [0, 1], 4)  # the frontend accepts it: every expert once
    assert routes.addresses() == {f"{function_of(d)}.tiny-experts.default.svc.cluster.local:8080" for d in experts}


def test_a_changed_pod_spec_renders_pods_of_new_names_and_a_changed_annotation_the_same_pods(f):
    """Pods are immutable: a new image must be new pods (the old ones go once these are Ready), while a
    retired function's pods must stay the ones running (kept warm)."""
    before = {o["metadata"]["name"] for o in expert_pods(rendered(f)[2])}
    image = {o["metadata"]["name"] for o in expert_pods(rendered(f, experts={"image": "kubemoe/expert-fn:new"})[2])}
    assert len(image) == len(before) and not image & before


def test_knative_runtime_annotations_affinity_and_address(f):
    _, _, objects = rendered(f, experts={"runtime": "knative", "bundleBytes": "256Mi",
                                         "scaling": {"keepAlive": "5m", "maxReplicasPerExpert": 4},
                                         "placement": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}})
    services = by_kind(objects, "Service", "serving.knative.dev/v1")
    assert len(services) == 4
    template = services[0]["spec"]["template"]
    assert template["metadata"]["annotations"] == {
        "autoscaling.knative.dev/min-scale": "1", "autoscaling.knative.dev/max-scale": "1",
        "autoscaling.knative.dev/initial-scale": "1", "autoscaling.knative.dev/scale-down-delay": "5m",
        "serving.knative.dev/progress-deadline": "15m", "kubemoe.io/node": "node-0"}  # where it was planned
    assert template["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert template["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert not by_kind(objects, "Deployment")[1:]  # only the frontend is a Deployment
    table = parse_table(by_kind(objects, "ConfigMap")[0]["data"]["routing.json"])
    assert {e.address for r in table.routes for e in r.endpoints} == {
        f"{s['metadata']['name']}.default.svc.cluster.local:80" for s in services}


def test_knative_runs_no_more_replicas_of_a_bundle_than_the_plan_over_all_its_services(f):
    deployment = MoEDeployment.from_body(f.moed_body(experts={"runtime": "knative", "bundleBytes": "256Mi",
                                                              "scaling": {"maxReplicasPerExpert": 4}}))
    hot = Loads({(0, 0): 1000.0, (0, 2): 1.0, (1, 0): 1.0, (1, 2): 1.0}, 100.0, 1)
    planned = plan(deployment.spec, hot, f.gpu_nodes(4), None, 1e6)
    services = [o for o in render(deployment, planned, OperatorConfig()) if o["apiVersion"] == "serving.knative.dev/v1"
                and o["metadata"]["labels"]["kubemoe.io/bundle"] == "l0-e0-1"]
    scale = [int(o["spec"]["template"]["metadata"]["annotations"]["autoscaling.knative.dev/max-scale"]) for o in services]
    assert len(services) > 1 and sum(scale) == planned.replicas_of("l0-e0-1") <= 4


def test_retired_service_renders_unchanged_template_and_leaves_the_routing_table(f):
    # A hot bundle scaled out over both nodes, then scaled in when its load is gone.
    deployment, first, objects = rendered(f, loads=Loads({(0, 0): 300.0, (0, 1): 300.0, (0, 2): 100.0}))
    assert set(first.nodes["l0-e0-1"]) == {"node-0", "node-1"}
    previous = observe(deployment.spec, "distributed", objects)
    assert previous.nodes == first.nodes and previous.version == first.version
    _, second, again = rendered(f, previous=previous)
    assert len(second.retired) == 1
    retired = [o for o in again if o["kind"] == "Pod" and service_of(o) in second.retired]
    assert len({function_of(o) for o in retired}) == len(second.retired)
    before = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    for obj in retired:  # the same pods, not even annotated: nothing to write, they stay warm
        assert obj == before[("Pod", obj["metadata"]["name"])]
    table = parse_table(by_kind(again, "ConfigMap")[0]["data"]["routing.json"])
    addresses = {e.address for r in table.routes for e in r.endpoints}
    assert not any(function_of(o) + "." in a for o in retired for a in addresses)
    assert table.version == first.version + 1
    assert set(observe(deployment.spec, "distributed", again).retired) == set(second.retired)


def test_replicas_hosted_in_place_are_endpoints_of_running_functions_and_read_back(f):
    # Four nodes, one expert a bundle; the load turns hot on expert 0 after a first, even plan.
    spec = {"experts": {"runtime": "pods", "bundleBytes": "128Mi", "scaling": {"maxReplicasPerExpert": 4,
                                                                                    "keepAlive": "2m"}}}
    deployment, even, objects = rendered(f, nodes=4, loads=Loads({(0, e): 100.0 for e in range(4)}), **spec)
    previous = observe(deployment.spec, "distributed", objects)
    _, hot, again = rendered(f, nodes=4, loads=Loads({(0, 0): 800.0, (0, 1): 100.0, (0, 2): 100.0, (0, 3): 100.0}),
                             previous=previous, **spec)
    assert len(hot.hosted["l0-e0-0"]) == 3 and hot.services().keys() == even.services().keys()  # no new service
    table = parse_table(by_kind(again, "ConfigMap")[0]["data"]["routing.json"])
    [route] = [r for r in table.routes if r.bundle == "l0-e0-0"]
    names = {function_of(o): (o["metadata"]["labels"]["kubemoe.io/bundle"], o["metadata"]["annotations"]["kubemoe.io/node"])
             for o in expert_pods(again)}
    hosts = sorted(names[e.address.split(".")[0]] for e in route.endpoints[1:])
    assert hosts == sorted(hot.hosted["l0-e0-0"]) and sum(e.weight for e in route.endpoints) == 1.0
    # Every function follows the table at its own address, as the frontend's account (reads that ConfigMap only).
    for d in expert_pods(again):
        pod = d["spec"]
        args = pod["containers"][0]["args"]
        assert args[args.index("--address") + 1].startswith(function_of(d) + ".")
        assert args[args.index("--routing-configmap") + 1] == "default/tiny-routing"
        assert args[args.index("--drop-after") + 1] == "120" and pod["serviceAccountName"] == "tiny-frontend"
    assert observe(deployment.spec, "distributed", again).hosted == hot.hosted


def test_offload_mode_frontend_on_single_gpu_nodes_and_local_experts(f):
    _, p, objects = rendered(f, gpus=1, mode="offload", offload={"gpuMemoryBudget": "20Gi"})
    assert p.mode == "offload" and by_kind(objects, "Deployment")[0]["metadata"]["name"] == "tiny-frontend"
    assert len(by_kind(objects, "Deployment")) == 1 and not by_kind(objects, "Service", "serving.knative.dev/v1")
    pod = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"] == [{"key": "nvidia.com/gpu.count", "operator": "In", "values": ["1"]}]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["KUBEMOE_MODE"] == "offload" and env["KUBEMOE_OFFLOAD_GPU_MEMORY_BUDGET"] == str(20 * 2**30)
    assert env["KUBEMOE_OFFLOAD_PREDICTOR"] == "llapor"  # the file beside the checkpoint, else the router
    table = parse_table(by_kind(objects, "ConfigMap")[0]["data"]["routing.json"])
    assert {e.address for r in table.routes for e in r.endpoints} == {"local"}


def frontend_as_rendered(objects, monkeypatch, checkpoint):
    """The FrontendConfig `kubemoe frontend` builds from the rendered container's args and env (the checkpoint
    path swapped for a local folder: the pod mounts the model there)."""
    from kubemoe.frontend.cli import frontend_command, frontend_config

    container = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    for entry in container["env"]:
        if "value" in entry:
            monkeypatch.setenv(entry["name"], entry["value"])
    args = container["args"]
    assert args[0] == "frontend"
    args = [str(checkpoint) if previous == "--checkpoint" else a for previous, a in zip([None] + args, args)]
    params = frontend_command.make_context("frontend", args[1:]).params
    return frontend_config(**{k: v for k, v in params.items() if k not in ("host", "port", "grpc_port")})


def test_the_frontend_accepts_the_offload_mode_it_is_rendered_with(f, monkeypatch, tmp_path):
    from kubemoe.frontend.offload.config import OffloadConfig

    _, _, objects = rendered(f, gpus=1, mode="offload", offload={"gpuMemoryBudget": "20Gi", "predictor": "frequency"})
    config = frontend_as_rendered(objects, monkeypatch, tmp_path)
    assert config.offload == OffloadConfig(20 * 2**30, predictor="frequency")
    assert config.routing_configmap.endswith("/tiny-routing")


def test_auto_renders_the_budget_it_derived_and_the_predictor_file_the_spec_names(f, monkeypatch, tmp_path):
    from kubemoe.frontend.offload.config import OffloadConfig

    # 4 bundles of a whole GPU each, 2 single-GPU nodes of 80 GiB: offload, 3/4 of the GPU for experts.
    _, p, objects = rendered(f, gpus=1, mode="auto", offload={"predictorFile": "predictors/llapor.safetensors"})
    assert p.mode == "offload" and p.gpu_budget == 60 * 2**30
    config = frontend_as_rendered(objects, monkeypatch, tmp_path)
    # The pod's path of the file (/models/tiny/...), here the local checkpoint folder the test maps it to.
    assert config.offload == OffloadConfig(60 * 2**30, predictor="/models/tiny/predictors/llapor.safetensors")


def test_a_distributed_frontend_as_rendered_has_no_offload(f, monkeypatch, tmp_path):
    _, _, objects = rendered(f)
    assert frontend_as_rendered(objects, monkeypatch, tmp_path).offload is None


def test_object_store_checkpoint_is_copied_by_an_init_container(f):
    _, _, objects = rendered(f, model={"uri": "s3://bucket/tiny", "layout": f.moed_body()["spec"]["model"]["layout"]})
    pod = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["command"][:3] == ["aws", "s3", "sync"]
    assert pod["volumes"][0] == {"name": "model", "emptyDir": {}}
    _, _, objects = rendered(f, model={"uri": "hostpath:///data/tiny", "layout": f.moed_body()["spec"]["model"]["layout"]})
    assert by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["volumes"][0]["hostPath"]["path"] == "/data/tiny"


def test_long_names_are_cut_with_a_hash_and_stay_unique():
    a, b = child_name("x" * 60, "bundle-a"), child_name("x" * 60, "bundle-b")
    assert len(a) == 63 and len(b) == 63 and a != b
    # A MoEDeployment name may hold dots (a DNS subdomain); a Service name may not (a DNS-1035 label).
    dotted, dashed = child_name("phi-3.5-moe", "l0-e0-7"), child_name("phi-3-5-moe", "l0-e0-7")
    assert "." not in dotted and dotted != dashed and dotted.startswith("phi-3-5-moe-l0-e0-7-")


def test_the_operator_never_imports_the_data_plane():
    # The routing table is a contract (kubemoe.routing_table), not a frontend module the operator reaches into.
    import subprocess
    import sys
    code = ("import sys, kubemoe.operator.reconcile, kubemoe.operator.loads, kubemoe.operator.render; "
            "print(sorted(m for m in sys.modules if m.startswith('kubemoe.frontend')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
