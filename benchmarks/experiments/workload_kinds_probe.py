"""Issue 16 (converge_s_1000_nodes): does the kind of object an expert function's pod comes from decide how fast
~640 of them start on the 2-core control plane (and for bare pods: server-side apply or create)? The operator's step writes ~8700 times today, most of them
kube-controller-manager's (ReplicaSets, Deployment and ReplicaSet status, events) for one-replica Deployments.
This probe creates N one-pod workloads pinned to N of 1000 kwok nodes, as Deployments and as bare Pods (applied; PodCreate: created), 8 at a
time as the operator applies, and prints for each: seconds until every pod is Ready, API writes, CPU per process.

    python benchmarks/experiments/workload_kinds_probe.py --workloads 640
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from operator_plan import api_writes, cpu_seconds, until  # noqa: E402

from kubemoe.devcluster import Cluster, ClusterConfig  # noqa: E402
from kubemoe.operator.capacity import NodeInfo  # noqa: E402
from kubemoe.operator.kube import Kube  # noqa: E402

NS = "default"


def pod_spec(i: int, node: str) -> dict:
    return {"hostname": f"fn-{i}", "subdomain": "experts", "containers": [{
        "name": "expert-fn", "image": "kubemoe/expert-fn:probe", "args": ["expert-fn", "--bundle", f"0:{i}"],
        "ports": [{"name": "h2c", "containerPort": 8080}],
        "readinessProbe": {"grpc": {"port": 8080}, "periodSeconds": 5},
        "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}}}}


def workload(kind: str, i: int, node: str) -> dict:
    labels = {"probe": kind, "fn": str(i)}
    meta = {"name": f"fn-{i}", "namespace": NS, "labels": labels}
    if kind in ("Pod", "PodCreate"):
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec(i, node)}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {
        "replicas": 1, "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels}, "spec": pod_spec(i, node)}}}


def ready_pods(kube: Kube, kind: str) -> int:
    return sum(1 for p in kube.list("v1", "Pod", NS, f"probe={kind}") if not p["metadata"].get("deletionTimestamp")
               and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", [])))


def trial(kube: Kube, kind: str, nodes: list[str], pids: dict[str, int]) -> dict:
    cpu0, writes0 = cpu_seconds(pids), api_writes(kube)
    t0 = time.monotonic()
    write = kube.create if kind == "PodCreate" else kube.apply
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda a: write(workload(kind, *a)), enumerate(nodes)))
    applied = time.monotonic() - t0
    until(lambda: ready_pods(kube, kind) >= len(nodes), 300, f"{len(nodes)} pods Ready", interval_s=0.5)
    ready = time.monotonic() - t0
    cpu, writes = cpu_seconds(pids), api_writes(kube)
    row = {"kind": kind, "workloads": len(nodes), "applied_s": round(applied, 2), "ready_s": round(ready, 2),
           "cpu_s": {k: round(v - cpu0.get(k, 0), 1) for k, v in cpu.items()},
           "writes": sum(writes.values()) - sum(writes0.values()),
           "by_write": {k: v - writes0.get(k, 0) for k, v in writes.most_common() if v - writes0.get(k, 0) > 20}}
    print(json.dumps(row), flush=True)
    group, api_kind = ("apps/v1", "Deployment") if kind == "Deployment" else ("v1", "Pod")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: kube.delete(group, api_kind, NS, f"fn-{i}"), range(len(nodes))))
    until(lambda: not kube.list("v1", "Pod", NS, f"probe={kind}"), 300, "pods gone", interval_s=1.0)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--workloads", type=int, default=640)
    parser.add_argument("--kinds", default="Pod,Deployment,Pod")
    args = parser.parse_args()
    with Cluster(ClusterConfig(nodes=0, timeout_s=600, knative_crds=False)) as cluster:
        for batch in range(0, args.nodes, 100):
            cluster.add_gpu_nodes(min(100, args.nodes - batch), 8, wait=False)
        kube = Kube(cluster.api_client(), "probe")
        until(lambda: sum(NodeInfo.from_node(n).schedulable for n in kube.list("v1", "Node")) >= args.nodes, 600,
              "nodes Ready", interval_s=2.0)
        names = sorted(n["metadata"]["name"] for n in kube.list("v1", "Node"))[:args.workloads]
        pids = {**cluster.pids}
        time.sleep(10)  # the nodes' first heartbeats settle
        for kind in args.kinds.split(","):
            trial(kube, kind, names, pids)


if __name__ == "__main__":
    main()
