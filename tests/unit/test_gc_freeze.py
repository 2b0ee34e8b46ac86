"""A serving process settles once ready: a full garbage collection no longer walks its start-up objects."""

import json
import subprocess
import sys
import textwrap


def test_after_settle_a_full_collection_walks_only_what_came_after_and_exit_stays_quiet():
    # In a process of its own: freezing this test run's objects would outlive the test.
    script = textwrap.dedent("""
        import gc, json, time
        import torch, transformers, grpc  # what a frontend or an expert function holds
        import kubemoe.frontend.dispatch  # and with it triton, whose nanobind counts leaks at exit
        from kubemoe.gc_freeze import settle
        before = len(gc.get_objects())
        settle()
        later = [object() for _ in range(10)] + [[n] for n in range(1000)]  # objects made after
        print(json.dumps({"before": before, "after": len(gc.get_objects()), "frozen": gc.get_freeze_count()}))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    seen = json.loads(run.stdout)
    assert seen["before"] > 100_000 and seen["frozen"] >= seen["before"] * 0.9
    assert seen["after"] < 5_000  # what a collection walks now: the objects made after settle()
    assert "leaked" not in run.stderr  # unfrozen at exit: nanobind's leak check finds nothing
