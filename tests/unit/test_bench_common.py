"""benchmarks/common.py: what a results file says about the machine it came from."""

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


def test_a_goal_that_was_not_measured_is_written_as_null_and_unmet(benchmark_module):
    import json

    goal = benchmark_module("common").Goal
    assert goal(1.23456, ">= 1.2").as_dict() == {"value": 1.2346, "goal": ">= 1.2", "met": True}
    for missing in (float("nan"), float("inf")):
        for wanted in ("<= 1.15", ">= 2.4"):
            written = json.dumps(goal(missing, wanted).as_dict(), allow_nan=False)  # strict JSON, or it raises
            assert json.loads(written) == {"value": None, "goal": wanted, "met": False}
