"""benchmarks/offload_bench.py: the routing replay's expert mapping, and (slow) a tiny run on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def bench(benchmark_module):
    return benchmark_module("offload_bench")


@pytest.mark.parametrize("experts, top_k", [(8, 2), (128, 8), (16, 4)])
def test_mapped_routing_picks_distinct_experts_and_keeps_the_skew(bench, experts, top_k):
    g = torch.Generator().manual_seed(0)
    hot = torch.tensor([[3, 11]] * 300)  # one pair of trace experts takes most tokens
    rest = torch.stack([torch.randperm(16, generator=g)[:2] for _ in range(100)])
    choices = torch.cat([hot, rest, torch.tensor([[-1, -1]])])
    mapped = bench.map_experts(choices, 16, experts, top_k)
    assert mapped.shape == (401, top_k) and (mapped[-1] == -1).all()
    valid = mapped[:-1]
    assert ((valid >= 0) & (valid < experts)).all()
    assert all(len(set(row)) == top_k for row in valid.tolist())
    counts = torch.bincount(valid.reshape(-1), minlength=experts)
    assert counts.topk(top_k).values.sum() >= 300 * top_k  # the hot pair's experts stay the hottest
    assert torch.equal(bench.map_experts(hot[:1], 16, experts, top_k), mapped[:1])  # a token maps the same every time


def test_steps_against_the_bound_are_each_policys_geometric_mean_over_presets_and_batches(bench):
    bounds = [{"preset": "a", "batch": 4, "any_policy_lower_bound_s_per_step": 0.01},
              {"preset": "b", "batch": 4, "any_policy_lower_bound_s_per_step": 0.02}]
    raw = [{"preset": "a", "batch": 4, "policy": "on-demand", "decode_step_s": 0.04},
           {"preset": "b", "batch": 4, "policy": "on-demand", "decode_step_s": 0.02},
           {"preset": "a", "batch": 4, "policy": "kubemoe", "decode_step_s": 0.01},
           {"preset": "a", "batch": 16, "policy": "kubemoe", "decode_step_s": 0.5}]  # no bound for it: left out
    assert bench.steps_vs_bound(raw, bounds) == pytest.approx({"on-demand": 2.0, "kubemoe": 1.0})


@pytest.mark.slow
def test_a_tiny_run_on_the_cpu_writes_every_policy_and_the_goals(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "offload_bench.py"), "--device", "cpu", "--tiny",
                           "--presets", "qwen3", "--batches", "2", "--prompt", "8", "--output", "3",
                           "--ablation-batch", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(next(tmp_path.glob("offload_*.json")).read_text())
    assert {r["policy"] for r in doc["raw"]} == {"kubemoe", "on-demand", "gpu-prefetch", "fiddler-like", "hybrimoe-like",
                                                  "static-split", "oracle"}
    assert {r["policy"] for r in doc["ablations"]} == {"no-hot-table", "no-prediction", "no-asyncio"}
    assert {"throughput_vs_ondemand", "throughput_vs_hybrimoe", "throughput_vs_fiddler", "step_vs_oracle"} <= set(doc["goals"])
    assert "REPLAYED" in doc["measured"] and doc["modelled_links"]
    assert set(doc["decode_step_vs_bound"]) == {r["policy"] for r in doc["raw"]}
    assert all(v > 0 for v in doc["decode_step_vs_bound"].values())
    # three rounds, each in another order; a configuration's row is its round of median throughput
    order = [[r["policy"] for r in doc["rounds_raw"] if r["round"] == k] for k in (0, 1, 2)]
    assert sorted(order[0]) == sorted(order[1]) == sorted(order[2]) and len({o[0] for o in order}) == 3
    assert order[0][0] == "kubemoe"
    for row in doc["raw"]:
        rounds = sorted(r["tokens_per_s"] for r in doc["rounds_raw"]
                        if (r["policy"], r["batch"]) == (row["policy"], row["batch"]))
        assert len(rounds) == 3 and row["tokens_per_s"] == rounds[1] and row["output"] == 3
