"""The baselines kubemoe's scaler and placer are measured against, in the same terms (a Placement).

- Static expert parallelism (Megatron-style): one replica per expert, dealt round-robin over GPUs.
- DeepSeek's EPLB (`rebalance_experts`, after github.com/deepseek-ai/EPLB, written anew here):
  hierarchical when the nodes divide the expert groups (groups packed onto nodes, experts replicated
  within each node, replicas packed onto the node's GPUs), else global (one node, one group). The
  heaviest expert by load per replica gets each redundant replica; balanced packing puts the
  heaviest item on the lightest pack that still has room. EPLB needs the physical slots to divide
  evenly over GPUs; here a pack holds at most ceil(items / packs), which is EPLB when they divide
  and lets 300 slots of a layer spread over 1000 GPUs when they do not.
- The oracle: every layer's tokens spread perfectly over all GPUs (a bound: it ignores memory and
  routing; a GPU still reads at least one expert's weights).
Shapes: L = MoE layers, E = logical experts, P = physical slots per layer, G = GPUs.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kubemoe.planning.latency import LatencyModel
from kubemoe.planning.placer import GPU, Placement, ReplicaKey


def static_ep(loads: Sequence[Sequence[float]], gpus: Sequence[GPU], expert_bytes: int) -> Placement:
    """One replica per expert; expert e of layer l goes to GPU (l * E + e) mod G."""
    assignment = [[(e, gpus[(layer * len(row) + e) % len(gpus)].id) for e in range(len(row))]
                  for layer, row in enumerate(loads)]
    return placement_of(assignment, loads, gpus, expert_bytes)


@dataclass(frozen=True)
class EplbPlan:
    phy2log: list[list[int]]    # [L][P] logical expert of each physical slot
    gpu_of: list[list[int]]     # [L][P] GPU index of each physical slot
    logcnt: list[list[int]]     # [L][E] replicas of each logical expert


def rebalance_experts(weight: Sequence[Sequence[float]], num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> EplbPlan:
    """EPLB: weight [L][E] loads, num_replicas = P physical slots per layer (E + redundant)."""
    num_experts = len(weight[0]) if weight else 0
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas ({num_replicas}) must be at least the {num_experts} logical experts")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not split into {num_groups} groups: pass a divisor")
    if num_nodes < 1 or num_gpus % num_nodes:
        raise ValueError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")
    hierarchical = num_groups % num_nodes == 0 and num_replicas % num_nodes == 0
    groups, nodes = (num_groups, num_nodes) if hierarchical else (1, 1)
    plan = EplbPlan([], [], [])
    for row in weight:
        phy2log, gpu_of, logcnt = _rebalance_layer([float(w) for w in row], num_replicas, groups, nodes, num_gpus)
        plan.phy2log.append(phy2log)
        plan.gpu_of.append(gpu_of)
        plan.logcnt.append(logcnt)
    return plan


def _rebalance_layer(weight: list[float], slots: int, groups: int, nodes: int, gpus: int):
    group_size = len(weight) // groups
    group_load = [sum(weight[g * group_size:(g + 1) * group_size]) for g in range(groups)]
    node_of_group = balanced_packing(group_load, nodes)
    phy2log, gpu_of, logcnt = [], [], [0] * len(weight)
    gpus_per_node = gpus // nodes
    for node in range(nodes):
        experts = [g * group_size + i for g in range(groups) if node_of_group[g] == node for i in range(group_size)]
        local = replicate_experts([weight[e] for e in experts], slots // nodes)
        counts = [local.count(i) for i in range(len(experts))]
        per_slot = [weight[experts[i]] / counts[i] for i in local]
        gpu_in_node = balanced_packing(per_slot, gpus_per_node)
        for slot in sorted(range(len(local)), key=lambda s: (gpu_in_node[s], s)):
            phy2log.append(experts[local[slot]])
            gpu_of.append(node * gpus_per_node + gpu_in_node[slot])
        for i, e in enumerate(experts):
            logcnt[e] = counts[i]
    return phy2log, gpu_of, logcnt


def replicate_experts(weight: Sequence[float], num_physical: int) -> list[int]:
    """[n] loads -> the logical index of each of num_physical slots: slot i < n is expert i, each
    further slot replicates the expert with the highest load per replica (lowest index on ties)."""
    phy2log = list(range(len(weight)))
    counts = [1] * len(weight)
    heap = [(-w, i) for i, w in enumerate(weight)]
    heapq.heapify(heap)
    for _ in range(num_physical - len(weight)):
        _, i = heap[0]
        phy2log.append(i)
        counts[i] += 1
        heapq.heapreplace(heap, (-weight[i] / counts[i], i))
    return phy2log


def balanced_packing(weight: Sequence[float], num_packs: int) -> list[int]:
    """[n] loads -> the pack of each item: heaviest first onto the lightest pack with room
    (at most ceil(n / num_packs) items a pack; lowest pack index on ties)."""
    room = math.ceil(len(weight) / num_packs) if weight else 0
    pack_of = [0] * len(weight)
    heap = [(0.0, p) for p in range(num_packs)]  # packs with room, by load
    filled = [0] * num_packs
    for item in sorted(range(len(weight)), key=lambda i: (-weight[i], i)):
        load, pack = heapq.heappop(heap)
        pack_of[item] = pack
        filled[pack] += 1
        if filled[pack] < room:
            heapq.heappush(heap, (load + weight[item], pack))
    return pack_of


def eplb(loads: Sequence[Sequence[float]], gpus: Sequence[GPU], expert_bytes: int, redundant: int,
         num_groups: int = 1, gpus_per_node: int = 8) -> Placement:
    """EPLB with `redundant` extra slots per layer over `gpus` (nodes of gpus_per_node), as a Placement.

    Each layer's slots start at a different GPU (by layer), so a layout with fewer slots than GPUs
    does not put every layer on the same first GPUs; within the layer EPLB's packing is kept.
    """
    num_gpus = len(gpus)
    nodes = max(1, num_gpus // gpus_per_node) if num_gpus % gpus_per_node == 0 else 1
    plan = rebalance_experts(loads, len(loads[0]) + redundant, num_groups, nodes, num_gpus)
    assignment = []
    for layer, (phy2log, gpu_of) in enumerate(zip(plan.phy2log, plan.gpu_of)):
        shift = (layer * len(phy2log)) % num_gpus if len(phy2log) < num_gpus else 0
        assignment.append([(e, gpus[(g + shift) % num_gpus].id) for e, g in zip(phy2log, gpu_of)])
    return placement_of(assignment, loads, gpus, expert_bytes)


def placement_of(assignment: Sequence[Sequence[tuple[int, str]]], loads: Sequence[Sequence[float]],
                 gpus: Sequence[GPU], expert_bytes: int) -> Placement:
    """[L] lists of (expert, GPU id) -> a Placement, each expert's load split evenly over its replicas.
    Baselines do not plan memory: a GPU may end up over its memory, which `gpu_memory` shows."""
    counts = [np.bincount([e for e, _ in row], minlength=len(loads[layer])) for layer, row in enumerate(assignment)]
    gpu_of: dict[ReplicaKey, str] = {}
    replica_load: dict[ReplicaKey, float] = {}
    total = {g.id: 0.0 for g in gpus}
    memory = {g.id: 0 for g in gpus}
    for layer, row in enumerate(assignment):
        seen: dict[int, int] = {}
        for expert, gpu in row:
            key = (layer, expert, seen.get(expert, 0))
            seen[expert] = key[2] + 1
            gpu_of[key], replica_load[key] = gpu, loads[layer][expert] / counts[layer][expert]
            total[gpu] += replica_load[key]
            memory[gpu] += expert_bytes
    return Placement(gpu_of, replica_load, total, memory)


def oracle_layer_seconds(model: LatencyModel, tokens, num_gpus: int):
    """tokens [T, E] of one layer -> [T] seconds if every GPU got 1/G of the tokens and of the
    active experts (at least one weight read a GPU), with no straggler."""
    tokens = np.asarray(tokens, dtype=np.float64)
    total = tokens.sum(axis=1)
    share = total / num_gpus
    reads = np.ceil((tokens > 0).sum(axis=1) / num_gpus)
    compute = np.maximum(reads * model.curve.weight_read_s, share * model.curve.flops_per_token / model.curve.flops_per_s)
    return np.where(total > 0, model.call_overhead_s + compute + model.beta_s_per_token * share, 0.0)
