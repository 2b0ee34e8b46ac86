import pytest
from kubernetes import client

pytestmark = pytest.mark.cluster


def test_fake_gpu_nodes_are_ready_with_gpu_capacity_and_gfd_labels(api, gpu_nodes):
    nodes = {n.metadata.name: n for n in client.CoreV1Api(api).list_node(label_selector="type=kwok").items}

    assert sorted(nodes) == sorted(gpu_nodes)
    for name, spec in gpu_nodes.items():
        node = nodes[name]
        ready = [c for c in node.status.conditions if c.type == "Ready"]
        assert ready and ready[0].status == "True", f"{name} is not Ready: {node.status.conditions}"
        gpus = str(spec["gpus_per_node"])
        assert node.status.capacity["nvidia.com/gpu"] == gpus
        assert node.status.allocatable["nvidia.com/gpu"] == gpus
        labels = node.metadata.labels
        assert labels["nvidia.com/gpu.product"] == spec["product"]
        assert labels["nvidia.com/gpu.memory"] == str(spec["memory_mib"])
        assert labels["nvidia.com/gpu.count"] == gpus
        assert node.metadata.annotations["kwok.x-k8s.io/node"] == "fake"



def test_nodes_hold_leases_of_the_configured_length_and_stay_ready_between_renewals(cluster, api, gpu_nodes):
    # kwok renews each node's Lease as a kubelet does; the node lifecycle controller's grace period follows
    # the lease's length, so a node whose lease lasts longer than the default 50 s grace is not marked NotReady.
    coordination = client.CoordinationV1Api(api)
    for name in gpu_nodes:
        lease = coordination.read_namespaced_lease(name, "kube-node-lease")
        assert lease.spec.lease_duration_seconds == cluster.config.node_lease_s
    flapped = [e.involved_object.name for e in client.CoreV1Api(api).list_event_for_all_namespaces(
        field_selector="reason=NodeNotReady").items]
    assert not flapped, f"nodes marked NotReady between lease renewals: {flapped}"

def test_control_plane_runs_with_rbac(cluster, api):
    # The admin kubeconfig authenticates as a member of system:masters ...
    review = client.AuthorizationV1Api(api).create_self_subject_access_review(
        {"spec": {"resourceAttributes": {"verb": "*", "resource": "*", "group": "*"}}})
    assert review.status.allowed
    # ... while a plain user is denied by RBAC, so RBAC is really on.
    denied = client.AuthorizationV1Api(api).create_subject_access_review(
        {"spec": {"user": "nobody", "resourceAttributes": {"verb": "list", "resource": "secrets"}}})
    assert not denied.status.allowed
    version = cluster.kubectl("version", "--output=json").stdout
    assert f'"gitVersion": "{cluster.testbin.versions["KUBERNETES_VERSION"]}"' in version
