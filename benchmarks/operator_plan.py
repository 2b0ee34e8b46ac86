"""Operator at scale: a DeepSeek-V3-sized MoEDeployment on kwok clusters of 100 and 1000 fake GPU nodes.

    python benchmarks/operator_plan.py                 # 100 and 1000 nodes
    python benchmarks/operator_plan.py --nodes 100     # one size

Measures, per cluster size: planning alone (pure `plan()`), the time from creating the MoEDeployment
to every child applied with status written (PlanApplied=True), the time to converge after a load
change, and the API calls each took. The reconcile runs in-process (the code Kopf's handlers call,
without Kopf's watch latency). Runtime knative: no Knative controller runs here, so the services never
report Ready and "converged" means applied + status written; runtime deployment would also start one
fake pod per replica, which on this 2-core machine measures kube-controller-manager, not the operator.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import Goal, print_table, write_results  # noqa: E402

from kubemoe.devcluster import Cluster, ClusterConfig  # noqa: E402
from kubemoe.operator import crd  # noqa: E402
from kubemoe.operator.config import OperatorConfig  # noqa: E402
from kubemoe.operator.kube import Kube  # noqa: E402
from kubemoe.operator.plan import Loads, NodeInfo, plan  # noqa: E402
from kubemoe.operator.reconcile import Reconciler  # noqa: E402
from kubemoe.operator.spec import API_VERSION, KIND, MoESpec  # noqa: E402

# DeepSeek-V3: layers 3..60 are MoE (58 layers) x 256 routed experts of 3*7168*2048 weights, bf16.
DEEPSEEK_V3 = {
    "model": {"uri": "pvc://models/deepseek-v3", "layout": {
        "moeLayers": list(range(3, 61)), "expertsPerLayer": 256, "expertBytes": 3 * 7168 * 2048 * 2}},
    "experts": {"runtime": "knative", "bundleBytes": "2Gi",  # 24 experts per bundle: 11 bundles per layer
                "placement": {"tolerations": [{"operator": "Exists"}]}},
    "frontend": {"replicas": 4},
    "cost": {"gpuHourPrice": 2.5},
}


def skewed_loads(spec: MoESpec, seed: int) -> Loads:
    """Zipf-like expert popularity per layer, as routers produce."""
    rng = random.Random(seed)
    per_expert = {}
    for layer in spec.layout.moe_layers:
        order = list(range(spec.layout.experts_per_layer))
        rng.shuffle(order)
        for rank, expert in enumerate(order):
            per_expert[(layer, expert)] = 1000.0 / (rank + 1)
    return Loads(per_expert, tokens_per_second=5000.0, frontends=4)


def time_plan(spec: MoESpec, nodes: list[NodeInfo], repeats: int = 5) -> dict:
    loads = skewed_loads(spec, 0)
    first = plan(spec, Loads(), nodes, None, 0.0)
    times = []
    for i in range(repeats):
        started = time.perf_counter()
        plan(spec, loads, nodes, first, 1.0 + i)
        times.append((time.perf_counter() - started) * 1000)
    return {"plan_ms_median": statistics.median(times), "plan_ms_max": max(times), "bundles": len(first.bundles),
            "replicas": first.replicas}


def run(node_count: int) -> dict:
    print(f"--- {node_count} nodes: starting the control plane", flush=True)
    started = time.monotonic()
    with Cluster(ClusterConfig(nodes=0, scheduler=False, controller_manager=False, timeout_s=600)) as cluster:
        for batch in range(0, node_count, 100):
            cluster.add_gpu_nodes(min(100, node_count - batch), 8, wait=False)
        cluster.kubectl("apply", "--server-side", f"--filename={crd.OUTPUTS['moedeployments'][0]}")
        cluster.kubectl("wait", "--for=condition=Established", "crd/moedeployments.kubemoe.io", "--timeout=60s")
        kube = Kube(cluster.api_client(), "kubemoe-operator")
        ready = lambda: sum(NodeInfo.from_node(n).schedulable for n in kube.list("v1", "Node"))  # noqa: E731
        while ready() < node_count:
            time.sleep(1)
        setup_s = time.monotonic() - started
        nodes = [NodeInfo.from_node(n) for n in kube.list("v1", "Node")]
        spec = MoESpec.parse(DEEPSEEK_V3)
        row = {"nodes": node_count, "setup_s": setup_s, **time_plan(spec, nodes)}

        reconciler = Reconciler(kube, OperatorConfig())
        body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "deepseek-v3", "namespace": "default"},
                "spec": DEEPSEEK_V3}
        kube.calls.clear()
        t0 = time.monotonic()
        body = kube.create(body)
        outcome = reconciler.reconcile(body)
        row["converge_s"] = time.monotonic() - t0
        row["objects_applied"] = len(outcome.changes.applied)
        row["api_calls_create"] = dict(kube.calls)
        assert outcome.error is None, outcome.error

        # Steady state: a timer tick with nothing new applies nothing.
        kube.calls.clear()
        t0 = time.monotonic()
        body = kube.get(API_VERSION, KIND, "default", "deepseek-v3")
        idle = reconciler.reconcile(body, Loads())
        row["idle_tick_s"] = time.monotonic() - t0
        row["api_calls_idle_tick"] = dict(kube.calls)
        row["idle_tick_applied"] = len(idle.changes.applied)

        # A load change: hot bundles scale out, services that leave the plan are kept warm.
        kube.calls.clear()
        t0 = time.monotonic()
        body = kube.get(API_VERSION, KIND, "default", "deepseek-v3")
        changed = reconciler.reconcile(body, skewed_loads(spec, 1))
        row["load_change_converge_s"] = time.monotonic() - t0
        row["load_change_applied"] = len(changed.changes.applied)
        decided = changed.changes.decisions
        row["load_change_retired"] = len(decided.retired) if decided else 0
        row["load_change_scaled_out"] = len(decided.scaled_out) if decided else 0
        row["load_change_unplaced"] = sum(decided.unplaced.values()) if decided else 0
        row["api_calls_load_change"] = dict(kube.calls)
        row["status_plan"] = changed.status.get("plan")
    print(f"    plan {row['plan_ms_median']:.1f} ms, create->applied {row['converge_s']:.1f} s "
          f"({row['objects_applied']} objects), load change {row['load_change_converge_s']:.1f} s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="*", default=[100, 1000])
    args = parser.parse_args()
    rows = [run(n) for n in args.nodes]
    print_table(rows, [("nodes", "nodes", "d"), ("plan_ms_median", "plan ms", ".1f"),
                       ("converge_s", "create s", ".1f"), ("load_change_converge_s", "loads s", ".1f"),
                       ("objects_applied", "objects", "d")])
    big = next((r for r in rows if r["nodes"] == 1000), None)
    goals = {}
    if big:
        goals["plan_ms_1000_nodes"] = Goal(big["plan_ms_median"], "<= 100")
        goals["converge_s_1000_nodes"] = Goal(max(big["converge_s"], big["load_change_converge_s"]), "<= 10")
    path = write_results("operator", torch.device("cpu"), rows, goals, model="DeepSeek-V3 layout (58 x 256, bf16)",
                         runtime="knative (objects applied; no Knative controller, so no pods)",
                         converge_means="create (or load change) -> every child applied and status written")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
