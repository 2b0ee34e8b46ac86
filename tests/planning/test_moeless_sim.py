"""The simulator's own pieces (benchmarks/moeless_sim.py): traces conserve tokens, dispatch is lossless
and is the dispatcher's split, the trained model's routing replays (and maps onto DeepSeek-V3's layout)
without losing a token, recorded traces load from both formats, and a small run plans without losing a token."""

import json
from dataclasses import replace

import numpy as np
import pytest


@pytest.fixture(scope="module")
def sim(benchmark_module):
    return benchmark_module("moeless_sim")


def test_generated_trace_routes_top_k_tokens_per_token(sim):
    layout = replace(sim.MIXTRAL_8, layers=3)
    trace = sim.generate_trace(layout, "decode", 20, sim.TraceShape(), seed=1)
    assert trace.shape == (20, 3, 8) and (trace >= 0).all()
    per_layer = trace.sum(axis=2)
    assert (per_layer == per_layer[:, :1]).all() and (per_layer % layout.top_k == 0).all()


def test_dispatch_is_lossless_and_is_the_dispatchers_split(sim):
    from kubemoe.planning.split import split_layer

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2000, (5, 4))
    predicted = tokens * rng.uniform(0.5, 1.5, tokens.shape)
    predicted[:, 3] = np.nan  # no prediction: the step's own counts
    experts = np.array([0, 0, 0, 1, 2, 3, 3])
    gpus = np.array([0, 1, 2, 0, 1, 2, 0])  # the queues: one expert function a GPU
    mine = sim.split_tokens(tokens, predicted, experts, gpus, knee=200)
    for out in (mine, sim.even_tokens(tokens, experts, 4)):
        assert (np.stack([out[:, experts == e].sum(axis=1) for e in range(4)], axis=1) == tokens).all()
    for t in range(5):
        replicas = [np.flatnonzero(experts == e) for e in range(4)]
        guesses = [None if np.isnan(predicted[t, e]) else predicted[t, e] for e in range(4)]
        parts = split_layer(tokens[t].tolist(), [gpus[r].tolist() for r in replicas], {}, guesses, 200)
        expected = np.zeros(len(experts), dtype=np.int64)
        for e, expert_parts in enumerate(parts):
            for _, part in expert_parts:
                expected[replicas[e][part.replica]] = part.count
        assert (mine[t] == expected).all()


def test_the_trained_models_routing_replays_and_maps_onto_deepseek_v3(sim):
    trace = sim.read_routing_trace(sim.ROUTING_TRACE)
    layout = replace(sim.TRAINED_8, decode_tokens=100, prefill_tokens=1024)
    rows = sim.replay_rows(trace, layout, "decode", 3, sim.TraceShape(), seed=0)
    assert len(rows[1]) == len(set(rows[1].tolist())) or len(rows[1]) > trace.requests * trace.positions
    # Continuous decode: a slot's request is the same next iteration, one position further.
    assert rows[1][0] == rows[0][0] + 1 and rows[1][0] // trace.positions == rows[0][0] // trace.positions
    loads, predicted = sim.recorded_trace(trace, layout, "prefill", 4, sim.TraceShape(), seed=0)
    assert loads.shape == (4, 8, 16) and (loads.sum(axis=2) == loads.sum(axis=2)[:, :1]).all()
    assert (loads.sum(axis=2)[:, 0] % (trace.positions * 2) == 0).all()  # whole prompts, top-2
    assert np.isnan(predicted[:, 0]).all() and (predicted[:, 1:].sum(axis=2) == loads[:, 1:].sum(axis=2)).all()
    deepseek = replace(sim.DEEPSEEK_V3_1000, decode_tokens=300)
    loads, predicted = sim.recorded_trace(trace, deepseek, "decode", 2, sim.TraceShape(), seed=0)
    assert loads.shape == (2, 58, 256)
    tokens = loads.sum(axis=2)
    assert (tokens == tokens[:, :1]).all() and (tokens % 8 == 0).all()
    # Layer 8 is trained layer 0 again: the same load per group of 16 experts.
    groups = loads.reshape(2, 58, 16, 16).sum(axis=3)
    assert (groups[:, 8] == groups[:, 0]).all() and np.isnan(predicted[:, 16]).all()
    assert np.allclose(np.nansum(predicted[:, 1:], axis=2), tokens[:, 1:] * (~np.isnan(predicted[:, 1:, 0])))


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
    config = sim.SimConfig(window=10, history=10, eplb_every=20)
    row, results = sim.run_regime(layout, "prefill", trace, config, seed=0)
    assert results["kubemoe"]["latency"].shape == (20, 2) and row["kubemoe_lost_tokens"] == 0
    assert row["oracle_mean_ms"] <= min(row[f"{p}_mean_ms"] for p in ("kubemoe", "static", "eplb", "eplb_window"))
    assert (row["eplb_rebalances"], row["eplb_window_rebalances"]) == (1, 2)  # every 20 iterations, every window
    assert row["kubemoe_unplaced"] == 0 and row["kubemoe_replicas_per_layer"] > layout.experts
    assert sum(b["iterations"] for b in row["by_tokens"]) == 20


def test_kubemoe_places_with_the_latency_models_knee_and_wire(sim, monkeypatch):
    from kubemoe.planning.latency import ExpertCurve, LatencyModel
    from kubemoe.planning.placer import place

    layout = replace(sim.MIXTRAL_8, layers=2)
    model = LatencyModel(ExpertCurve(layout.expert_bytes, layout.flops_per_token), layout.token_bytes)
    seen = []
    monkeypatch.setattr(sim, "place", lambda *args, **kwargs: seen.append(kwargs) or place(*args, **kwargs))
    trace = sim.generate_trace(layout, "decode", 20, sim.TraceShape(), seed=2)
    sim.simulate(layout, trace, sim.SimConfig(window=10, history=10, eplb_every=20), seed=0)
    assert seen and all(k["min_replica_load"] == model.curve.knee_tokens and k["wire_cost"] == model.wire_cost
                        for k in seen)
