"""benchmarks/offload_sim.py: the ratios it reports, on hand-made rows."""

import pytest


def test_ratios_report_the_ceiling_no_policy_can_pass(benchmark_module):
    sim = benchmark_module("offload_sim")
    steps = {"kubemoe": 1.2, "on-demand": 4.0, "gpu-prefetch": 3.0, "fiddler-like": 2.0, "hybrimoe-like": 1.5,
             "static-split": 2.4, "oracle": 1.25, "lower-bound": 1.0}
    rows = [{"model": "m", "pcie": "pcie4", "batch": 4, "policy": p, "step_s": s, "tokens_per_s": 4 / s,
             "hit_rate": 0.5, "cpu_share": 0.2, "pcie_busy": 0.9} for p, s in steps.items()]
    (line,) = sim.ratios(rows)
    # HybriMoE-like takes 1.5 a step and no policy less than the bound's 1.0: at most 1.5x it.
    assert line["bound_vs_hybrimoe"] == pytest.approx(1.5)
    assert line["vs_hybrimoe"] == pytest.approx(1.25) and line["step_vs_bound"] == pytest.approx(1.2)
