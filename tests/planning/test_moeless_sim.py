"""The simulator's own pieces (benchmarks/moeless_sim.py): traces conserve tokens, dispatch is lossless,
recorded traces load from both formats, and a small run plans without losing a token."""

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def sim():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("moeless_sim", BENCHMARKS / "moeless_sim.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["moeless_sim"] = module  # dataclasses look their module up while it loads
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("moeless_sim", None)
        sys.path.remove(str(BENCHMARKS))


def test_generated_trace_routes_top_k_tokens_per_token(sim):
    layout = replace(sim.MIXTRAL_8, layers=3)
    trace = sim.generate_trace(layout, "decode", 20, sim.TraceShape(), seed=1)
    assert trace.shape == (20, 3, 8) and (trace >= 0).all()
    per_layer = trace.sum(axis=2)
    assert (per_layer == per_layer[:, :1]).all() and (per_layer % layout.top_k == 0).all()


def test_dispatch_is_lossless(sim):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2000, (5, 4))
    experts, gpus = np.array([0, 0, 0, 1, 2, 3, 3]), np.array([0, 1, 2, 3, 0, 1, 2])
    for out in (sim.split_tokens(tokens, tokens * 1.1, experts, gpus, knee=200),
                sim.even_tokens(tokens, experts, 4)):
        assert (np.stack([out[:, experts == e].sum(axis=1) for e in range(4)], axis=1) == tokens).all()


def test_recorded_traces_load_from_json_and_safetensors(sim, tmp_path):
    from safetensors.numpy import save_file

    trace = np.arange(2 * 32 * 8).reshape(2, 32, 8)
    (tmp_path / "t.json").write_text(json.dumps({"layout": "mixtral-8gpu", "decode": trace.tolist()}))
    save_file({"prefill": trace}, str(tmp_path / "t.safetensors"), metadata={"layout": "mixtral-8gpu"})
    for name, regime in (("t.json", "decode"), ("t.safetensors", "prefill")):
        layout, traces = sim.load_traces(tmp_path / name)
        assert layout is sim.MIXTRAL_8 and (traces[regime] == trace).all()
    (tmp_path / "bad.json").write_text(json.dumps({"decode": [[[1, 2]]]}))
    with pytest.raises(SystemExit, match="expected"):
        sim.load_traces(tmp_path / "bad.json")


def test_a_small_run_plans_every_window_without_losing_tokens(sim):
    layout = replace(sim.MIXTRAL_8, layers=2)
    trace = sim.generate_trace(layout, "prefill", 30, sim.TraceShape(), seed=2)
    row, results = sim.run_regime(layout, "prefill", trace, sim.SimConfig(window=10), seed=0)
    assert results["kubemoe"]["latency"].shape == (20, 2) and row["kubemoe_lost_tokens"] == 0
    assert row["oracle_mean_ms"] <= min(row["kubemoe_mean_ms"], row["static_mean_ms"], row["eplb_mean_ms"])
    assert row["kubemoe_unplaced"] == 0 and row["kubemoe_replicas_per_layer"] > layout.experts
