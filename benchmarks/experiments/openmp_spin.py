#!/usr/bin/env python3
"""What CPU experts on an OpenMP team cost the thread beside them that launches the GPU's work.

The offload path runs a layer's CPU experts on one worker whose OpenMP team has every core but one, while
the main thread keeps launching copies and kernels (frontend/offload/cpu_experts.py). By default OpenMP's
idle threads spin for the next parallel region (libgomp: milliseconds), so where the team and the
launching thread, with the runtime's other threads, outnumber the cores, spinning threads and that thread
take turns on the same cores. Here the main thread runs Python (as a launching thread does) while a
Qwen3-30B-A3B-size expert (8 tokens, bf16) is handed to the worker every third slice of it; printed: how
much slower the main thread's work ran than alone, and the expert's time from hand-over to result, per team
size and OMP_WAIT_POLICY (each a process of its own: OpenMP reads the policy once, when torch loads).
`--busy N` runs N other processes that only compute meanwhile, as other pods' work on a node does.

Measured on the 2-core CI machine, a team of 2 beside the main thread, two runs each (main thread's
slowdown, expert): idle machine, spinning 1.21-1.30x and 3.1-3.2 ms, asleep 1.44-1.49x and 3.5 ms; `--busy 2`,
spinning 3.1x and 8.8 ms, asleep 1.4x and 3.7 ms (with two stray busy processes, found after those runs:
spinning 4.0-5.3x and 24-32 ms, asleep 1.3-1.8x and 7-14 ms). Spinning is a little faster on free cores and
collapses when anything else wants them.

  python benchmarks/experiments/openmp_spin.py                  # teams of every core but one, and every core
  python benchmarks/experiments/openmp_spin.py --teams 2 --policies default,PASSIVE --busy 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def measure(team: int, slices: int = 200) -> str:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    pool = ThreadPoolExecutor(1, initializer=lambda: torch.set_num_threads(team))
    hidden, intermediate = 2048, 768
    gate_up = torch.randn(2 * intermediate, hidden, dtype=torch.bfloat16)
    down = torch.randn(hidden, intermediate, dtype=torch.bfloat16)
    x = torch.randn(8, hidden, dtype=torch.bfloat16)

    def expert() -> torch.Tensor:
        with torch.inference_mode():
            gate, up = (x @ gate_up.T).chunk(2, -1)
            return (torch.nn.functional.silu(gate) * up) @ down.T

    def python_slice() -> int:  # ~1 ms of the interpreter's work, as a launching thread's between torch calls
        return sum(k * k for k in range(20000))

    for _ in range(5):
        pool.submit(expert).result()
    start = time.perf_counter()
    for _ in range(slices):
        python_slice()
    alone = time.perf_counter() - start
    start, expert_s = time.perf_counter(), []
    for j in range(slices):
        if j % 3 == 0:
            handed, future = time.perf_counter(), pool.submit(expert)
        python_slice()
        if j % 3 == 2:
            future.result()
            expert_s.append(time.perf_counter() - handed)
    beside = time.perf_counter() - start
    pool.shutdown()
    return f"main thread {beside / alone:.2f}x slower than alone; expert from hand-over to result {statistics.median(expert_s) * 1e3:.2f} ms"


def main() -> None:
    cores = len(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teams", default=f"{max(1, cores - 1)},{cores}", help="OpenMP team sizes of the worker")
    parser.add_argument("--policies", default="default,PASSIVE", help="OMP_WAIT_POLICY values (default: unset)")
    parser.add_argument("--busy", type=int, default=0, help="other processes that only compute meanwhile")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: measure this team size
    args = parser.parse_args()
    if args.one is not None:
        print(measure(args.one))
        return
    print(f"{cores} cores, {args.busy} busy processes beside")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        run_all(args)
    finally:
        for process in busy:
            process.kill()


def run_all(args: argparse.Namespace) -> None:
    for team in (int(t) for t in args.teams.split(",")):
        for policy in args.policies.split(","):
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy != "default":
                env["OMP_WAIT_POLICY"] = policy
            out = subprocess.run([sys.executable, __file__, "--one", str(team)], env=env, capture_output=True,
                                 text=True, check=True).stdout.strip()
            print(f"team of {team:3d}, OMP_WAIT_POLICY {policy:8s}: {out}", flush=True)


if __name__ == "__main__":
    main()
