import ipaddress

import pytest
from kubernetes import client

from kubemoe.devcluster import wait_for
from kubemoe.devcluster.cluster import KWOK_POD_IPS, frontends_on_loopback, node_pod_cidr

PAUSE = "registry.k8s.io/pause:3.10"  # never pulled: kwok only pretends to run containers


def test_each_node_gets_its_own_slash_24_of_the_pool():
    assert node_pod_cidr("100.64.0.0/10", 0) == "100.64.0.0/24"
    assert node_pod_cidr("100.64.0.0/10", 1) == "100.64.1.0/24"
    assert node_pod_cidr("100.64.0.0/10", 256) == "100.65.0.0/24"
    with pytest.raises(ValueError, match="larger pool"):
        node_pod_cidr("100.64.0.0/23", 2)


def test_a_kwok_stage_that_picks_addresses_another_way_is_refused_not_silently_kept():
    assert "PodIP }}" in frontends_on_loopback(f"status: {KWOK_POD_IPS}")
    with pytest.raises(RuntimeError, match="update frontends_on_loopback"):
        frontends_on_loopback("status: {{ $podIPs := PodIPs }}")


@pytest.mark.cluster
def test_pods_get_addresses_services_accept_and_frontends_loopback_ones(api, namespace):
    """Pods get addresses from their node's podCIDR, which the endpoints controllers accept (a Service's
    EndpointSlices list them); frontend pods get loopback addresses that tests serve /loads on."""
    apps, core, discovery = client.AppsV1Api(api), client.CoreV1Api(api), client.DiscoveryV1Api(api)
    for name, component, replicas in (("experts", "expert", 3), ("front", "frontend", 1)):
        labels = {"app": name, "app.kubernetes.io/component": component}
        apps.create_namespaced_deployment(namespace, {
            "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels}, "spec": {"containers": [{"name": "main", "image": PAUSE}]}}}})
    core.create_namespaced_service(namespace, {"metadata": {"name": "experts"}, "spec": {
        "clusterIP": "None", "selector": {"app": "experts"}, "ports": [{"name": "h2c", "port": 8080}]}})

    def running(app: str, count: int):
        pods = core.list_namespaced_pod(namespace, label_selector=f"app={app}").items
        return len(pods) == count and all(p.status.pod_ip for p in pods) and pods

    experts = wait_for(lambda: running("experts", 3), 60, "3 expert pods with addresses")
    for pod in experts:
        node_cidr = ipaddress.ip_network(core.read_node(pod.spec.node_name).spec.pod_cidr)
        assert ipaddress.ip_address(pod.status.pod_ip) in node_cidr
        assert not ipaddress.ip_address(pod.status.pod_ip).is_loopback
    (front,) = wait_for(lambda: running("front", 1), 60, "the frontend pod's address")
    assert ipaddress.ip_address(front.status.pod_ip).is_loopback

    def endpoints():
        slices = discovery.list_namespaced_endpoint_slice(
            namespace, label_selector="kubernetes.io/service-name=experts").items
        return sorted(a for s in slices for e in s.endpoints or [] for a in e.addresses)

    assert wait_for(lambda: len(endpoints()) == 3 and endpoints(), 60, "the experts Service's 3 endpoints") == \
        sorted(p.status.pod_ip for p in experts)
