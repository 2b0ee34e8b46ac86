"""benchmarks/common.py: what a results file says about the machine it came from."""

import json

import torch


def test_cpu_lists_count_ranges_and_single_cpus(benchmark_module):
    common = benchmark_module("common")
    assert common.cpu_list_size("0\n") == 1
    assert common.cpu_list_size("0,64") == 2
    assert common.cpu_list_size("0-3,8,10-11") == 7


def test_the_machine_is_described_with_its_cores_and_their_threads(benchmark_module):
    info = benchmark_module("common").describe_machine(torch.device("cpu"))
    assert info["cores"] >= 1 and info["cores"] % (info["threads_per_core"] or 1) == 0
    assert info["cpu_mhz"] is None or info["cpu_mhz"] > 0


def test_a_figure_that_was_not_measured_is_written_as_null_and_its_goal_unmet(benchmark_module, tmp_path):
    common = benchmark_module("common")
    nan, inf = float("nan"), float("inf")
    goals = {"measured": common.Goal(1.23456, ">= 1.2"), "no_baseline": common.Goal(nan, "<= 1.15"),
             "divided_by_zero": common.Goal(inf, ">= 2.4")}
    path = common.write_results("probe", torch.device("cpu"), [{"rate": nan, "rates": [1.5, inf]}], goals,
                                out=tmp_path, extra={"nested": (nan, 2)})

    def refuse(constant):
        raise AssertionError(f"{path.name} is not strict JSON: it holds {constant}")

    doc = json.loads(path.read_text(), parse_constant=refuse)
    assert doc["goals"] == {"measured": {"value": 1.2346, "goal": ">= 1.2", "met": True},
                            "no_baseline": {"value": None, "goal": "<= 1.15", "met": False},
                            "divided_by_zero": {"value": None, "goal": ">= 2.4", "met": False}}
    assert doc["raw"] == [{"rate": None, "rates": [1.5, None]}] and doc["extra"] == {"nested": [None, 2]}
