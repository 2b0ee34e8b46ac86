"""mode auto and the offload path's GPU budget, decided from the layout and the nodes (operator/mode.py)."""

import pytest

from kubemoe.operator.mode import ModeChoice, Refused, choose_mode
from kubemoe.operator.plan import Loads, PlanError, eligible_nodes, offload_nodes, plan
from kubemoe.operator.spec import MoESpec

GiB = 2**30
NOW = 1_000_000.0
# 2 MoE layers x 8 experts of 1 GiB (16 GiB of experts), a layer a bundle: 2 bundles of 8 GiB.
LAYOUT = {"moeLayers": [0, 1], "expertsPerLayer": 8, "expertBytes": "1Gi", "expertsPerToken": 1}


def spec_of(f, **overrides) -> MoESpec:
    body = f.moed_body(model={"uri": "pvc://models/m", "layout": LAYOUT}, experts={"runtime": "pods",
                                                                                  "bundleBytes": "8Gi"}, **overrides)
    return MoESpec.parse(body["spec"])


def decide(spec, nodes):
    return choose_mode(spec, eligible_nodes(spec, nodes), offload_nodes(spec, nodes))


def test_a_multi_gpu_node_makes_auto_distributed(f):
    choice = decide(spec_of(f, mode="auto"), f.gpu_nodes(2, gpus=8))
    assert choice.mode == "distributed" and choice.gpu_budget is None
    assert "node-1 has 8 GPUs" in choice.reason or "node-0 has 8 GPUs" in choice.reason


def test_single_gpu_nodes_that_hold_every_bundle_stay_distributed(f):
    # 2 bundles of 8 GiB, a GPU each: 2 nodes of one 16 GiB GPU hold them with 12 GiB each for experts.
    spec = spec_of(f, mode="auto")
    choice = decide(spec, f.gpu_nodes(2, gpus=1, memory_gib=16))
    assert choice.mode == "distributed" and "they hold the experts" in choice.reason
    assert plan(spec, Loads(), f.gpu_nodes(2, gpus=1, memory_gib=16), None, NOW).replicas == 2


def test_single_gpu_nodes_too_few_or_too_small_offload_with_a_budget_from_the_gpu(f):
    spec = spec_of(f, mode="auto")
    too_few = decide(spec, f.gpu_nodes(1, gpus=1, memory_gib=16))   # 2 bundles, 1 GPU
    too_small = decide(spec, f.gpu_nodes(4, gpus=1, memory_gib=8))  # 6 GiB of 8 for experts: a bundle does not fit
    assert too_few == ModeChoice("offload", too_few.reason, 12 * GiB) and "too few or too small" in too_few.reason
    # A quarter of the GPU stays free for attention weights and the KV cache.
    assert too_small == ModeChoice("offload", too_small.reason, 6 * GiB)
    assert "6.00 GiB derived: 75% of the smallest GPU (node-0, 8.00 GiB)" in too_small.reason
    p = plan(spec, Loads(), f.gpu_nodes(1, gpus=1, memory_gib=16), None, NOW)
    assert (p.mode, p.gpu_budget, p.replicas) == ("offload", 12 * GiB, 0) and p.mode_reason == too_few.reason


def test_the_spec_budget_wins_over_the_derived_one(f):
    choice = decide(spec_of(f, mode="auto", offload={"gpuMemoryBudget": "10Gi"}), f.gpu_nodes(1, gpus=1, memory_gib=16))
    assert choice.gpu_budget == 10 * GiB and "from spec.offload.gpuMemoryBudget" in choice.reason


def test_a_budget_larger_than_the_gpu_is_refused_with_what_to_write(f):
    spec = spec_of(f, mode="offload", offload={"gpuMemoryBudget": "20Gi"})
    refused = decide(spec, f.gpu_nodes(2, gpus=1, memory_gib=16))
    assert isinstance(refused, Refused) and refused.reason == "GpuBudgetTooLarge"
    assert "is more than the GPU of node-0 (16.00 GiB)" in refused.message and "lower it to 12.00 GiB" in refused.message
    with pytest.raises(PlanError, match="gpuMemoryBudget .* is more than the GPU"):
        plan(spec, Loads(), f.gpu_nodes(2, gpus=1, memory_gib=16), None, NOW)


def test_nothing_fits_even_offloaded_says_what_to_change(f):
    spec = spec_of(f, mode="auto")
    # One layer's working set (2 on-demand buffers + 2 prefetch groups of 1 expert) is 4 GiB; 3 GiB of a 4 GiB GPU.
    small_gpu = decide(spec, f.gpu_nodes(2, gpus=1, memory_gib=4))
    assert isinstance(small_gpu, Refused) and small_gpu.reason == "InsufficientCapacity"
    assert "less than one layer's working set (4.00 GiB" in small_gpu.message and "larger GPUs" in small_gpu.message
    small_host = decide(spec, f.gpu_nodes(1, gpus=1, memory_gib=16, memory_bytes=8 * GiB))
    assert isinstance(small_host, Refused) and "host memory for every expert (16.00 GiB pinned" in small_host.message
    limited = decide(spec_of(f, mode="auto", frontend={"resources": {"limits": {"memory": "8Gi"}}}),
                     f.gpu_nodes(1, gpus=1, memory_gib=16))
    assert isinstance(limited, Refused) and "limits.memory (8.00 GiB) cannot hold every expert" in limited.message
    tainted = decide(spec_of(f, mode="offload", offload={"gpuMemoryBudget": "8Gi"}),
                     f.gpu_nodes(1, gpus=1, memory_gib=16, taints=({"key": "gpu", "effect": "NoSchedule"},)))
    assert isinstance(tainted, Refused) and "no schedulable node with one GPU" in tainted.message


def test_unlabelled_gpu_memory_needs_a_budget_in_the_spec(f):
    unlabelled = [n.__class__(n.name, 1, None) for n in f.gpu_nodes(2, gpus=1)]
    refused = decide(spec_of(f, mode="auto"), unlabelled)
    assert isinstance(refused, Refused) and "nvidia.com/gpu.memory" in refused.message
    assert decide(spec_of(f, mode="auto", offload={"gpuMemoryBudget": "8Gi"}), unlabelled).gpu_budget == 8 * GiB


def test_distributed_is_never_second_guessed(f):
    assert decide(spec_of(f), f.gpu_nodes(2, gpus=1, memory_gib=4)) == ModeChoice("distributed",
                                                                                   "spec.mode is distributed")
