import json

import pytest
from click.testing import CliRunner
from google.protobuf import json_format

from kubemoe.cli import cli
from kubemoe.errors import KubemoeError
from kubemoe.load_report import LoadReportError, expert_rate, parse_reports, rates
from kubemoe.plan_cli import loads_matrix, summarize
from kubemoe.planning.placer import GPU
from kubemoe.proto import kubemoe_pb2 as pb

MIB = 2**20


def report(loads: dict) -> pb.LoadReport:
    return pb.LoadReport(model="m", window_seconds=10, loads=[
        pb.ExpertLoad(layer=l, expert=e, tokens=int(r * 10), tokens_per_second=r) for (l, e), r in loads.items()])


def test_summary_by_hand():
    gpus = [GPU(f"g{i}", "n0", 3 * MIB) for i in range(2)]
    s = summarize([[3.0, 1.0]], [5], MIB, gpus, cv=0.2, max_per_expert=8, layer_memory_cap=None)
    [row] = s.rows
    assert (row.layer, row.replicas, row.max_replicas, round(row.cv_before, 3), round(row.cv_after, 3)) == (5, 3, 2, 0.5, 0.177)
    assert s.placement.unplaced == () and s.placement.gpus_used() == 2


def test_reports_sum_and_prefer_predicted_rates():
    two = parse_reports(json.dumps([json_format.MessageToDict(report({(1, 0): 4.0})),
                                    json_format.MessageToDict(report({(1, 0): 2.0, (3, 1): 1.0}))]))
    assert rates(two) == {(1, 0): 6.0, (3, 1): 1.0}
    load = pb.ExpertLoad(layer=1, expert=0, tokens_per_second=2.0)
    if "predicted_tokens_per_second" in pb.ExpertLoad.DESCRIPTOR.fields_by_name:
        load.predicted_tokens_per_second = 5.0
        assert expert_rate(load) == 5.0
    else:
        assert expert_rate(load) == 2.0
    with pytest.raises(LoadReportError, match="/loads"):
        parse_reports("not json")
    with pytest.raises(LoadReportError, match="model_type"):
        parse_reports('{"model_type": "mixtral"}')
    with pytest.raises(KubemoeError, match="layer 2"):
        loads_matrix({(2, 0): 1.0}, [1, 3], 4)


def test_command_prints_a_plan(tiny_checkpoint, tmp_path):
    from kubemoe.adapters import MoEAdapter
    from kubemoe.checkpoint import Checkpoint

    path = tiny_checkpoint("mixtral")
    adapter = MoEAdapter(Checkpoint(path).config)
    hot = {(layer, e): (100.0 if e == 0 else 5.0) for layer in adapter.moe_layers for e in range(adapter.num_experts)}
    loads = tmp_path / "loads.json"
    loads.write_text(json_format.MessageToJson(report(hot)))
    result = CliRunner().invoke(cli, ["plan", "--checkpoint", str(path), "--loads", str(loads), "--nodes", "1",
                                      "--gpus-per-node", "2", "--gpu-memory", "1Gi"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "CV before" in lines[1] and len(lines) == 2 + len(adapter.moe_layers) + 2
    assert all(int(line.split()[3]) > 1 for line in lines[2:2 + len(adapter.moe_layers)])  # expert 0 scaled out
    assert lines[-1] == "unplaced: none"


def test_the_trained_layout_plans_its_recorded_loads_for_people(tmp_path, benchmark_module):
    """kubemoe's own MoE (8 MoE layers x 16 experts, top-2; the small recipe's sizes, the layout of the base
    model whose routing was recorded) under the recorded loads of 32 held-out requests."""
    from kubemoe.presets import Preset
    from kubemoe.synth import make_checkpoint
    from kubemoe.train import get_recipe

    recipe = get_recipe("small")
    path = make_checkpoint(Preset("mixtral", "trained-small", {**recipe.config, "vocab_size": recipe.vocab_size}),
                           tmp_path / "moe-small", progress=False)
    sim = benchmark_module("moeless_sim")
    trace = sim.read_routing_trace(sim.ROUTING_TRACE)
    report = sim.load_report(trace, 0, 31, 10.0, "moe-small", "frontend-0")
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps(report))
    result = CliRunner().invoke(cli, ["plan", "--checkpoint", str(path), "--loads", str(loads), "--nodes", "2",
                                      "--gpus-per-node", "4", "--max-per-expert", "4"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("mixtral: 8 MoE layers x 16 experts of 0.1 MiB; ") and "(from 1 report)" in lines[0]
    rows = [line.split() for line in lines[2:10]]
    assert [int(r[0]) for r in rows] == list(range(8)) and all(r[1] == "16" for r in rows)
    for layer, (_, _, replicas, most, before, after) in enumerate(rows):
        assert int(replicas) > 16 and int(most) == 4, lines  # the recorded skew scales every layer's hot experts
        assert float(after) < float(before)
    assert lines[10].startswith(f"{sum(int(r[2]) for r in rows)} replicas") and lines[-1] == "unplaced: none"
