#!/usr/bin/env python3
"""CPU time of an expert call's Python on each path, and of the frontend's per-layer dispatch, before and after.

The per-call overhead left on the H200 host (0.39 ms through shared memory, 0.74 ms over the TCP lane
for a 64-token Mixtral call, expert_fn_h200.json) is Python on both sides, not bytes. Wall times on a
shared 2-core machine wait for the scheduler; CPU time does not. So this measures, with a tiny expert
(hidden 4096, intermediate 16: the FFN is a few microseconds, the tensors as large as Mixtral's):
- per call and path (shm: shared memory and its Unix lane; tcp: the TCP lane; inline: tensors in the
  gRPC stream): the client process's CPU time (every thread: the caller, gRPC's, the loop's) and the
  expert function's, per call, from /proc/<pid>/task/*/schedstat (nanoseconds on a CPU), minus nothing:
  the server's reported FFN time is given beside it;
- per MoE layer of the frontend's Dispatcher (64 experts, top-8, over 2 expert functions through
  shared memory): the calling thread's CPU time (routing -> group -> inputs -> submit -> wait ->
  combine: everything outside the calls) and `group_tokens` alone.
Both sides of every client run with busy polling off (spinning would count as CPU time).

With --baseline REF (default: the commit this work started from) the same measurements run for REF's
tree (extracted with `git archive`) and this one, alternately, --rounds times, each in fresh processes;
figures are medians over rounds. Goals compare this tree with the baseline (report-only on a machine
without the baseline): `python_us_per_call_<path>_vs_before` (< 1.0).

    python benchmarks/call_cpu.py                      # this CPU (~3 min); writes results/call_cpu_<machine>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = Path(__file__).resolve().parent
BASELINE = "33d804d"  # main before this work (issue 16 item 1 / issue 17's per-call and per-layer costs)
PATHS = ("shm", "tcp", "inline")


def cpu_ns(pid: int) -> int:
    """Nanoseconds on a CPU of every live thread of `pid` (schedstat: exact, unlike stat's ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):  # the thread ended meanwhile
            pass
    return total


# -- the worker: runs in the tree under test (PYTHONPATH), prints one JSON line ------------------------

async def _per_call(workdir: Path, calls: int, tokens: int, hidden: int) -> dict:
    import torch

    from expert_fn_overhead import bench_input, start_server
    from common import mixtral_layout_checkpoint
    from kubemoe.expert_fn.client import ExpertClient

    checkpoint = mixtral_layout_checkpoint(workdir / "ckpt", hidden, 16, "float32")
    shm_dir = workdir / "shm"
    shm_dir.mkdir()
    process, address = await start_server(checkpoint, "cpu", shm_dir, ["--busy-poll-us", "0"])
    x = bench_input(tokens, hidden, torch.float32)
    out = {}
    try:
        options = {"shm": dict(shm_dir=shm_dir, tcp=False), "tcp": dict(tcp=True), "inline": dict(tcp=False)}
        for path, kwargs in options.items():
            async with ExpertClient(address, model="bench", **kwargs) as client:
                for _ in range(50):  # warm: the stream, the lane, both sides' code paths
                    await client.call(0, [0], [tokens], x)
                if client.transport != path:
                    raise RuntimeError(f"the {path} calls travelled {client.transport}")
                me, server = cpu_ns(os.getpid()), cpu_ns(process.pid)
                walls, computes = [], []
                started = time.perf_counter()
                for _ in range(calls):
                    t0 = time.perf_counter()
                    y, timing = await client.call(0, [0], [tokens], x)
                    walls.append(time.perf_counter() - t0)
                    computes.append(timing.compute_seconds)
                    del y
                wall = time.perf_counter() - started
                out[path] = {"client_cpu_us": (cpu_ns(os.getpid()) - me) / calls / 1e3,
                             "server_cpu_us": (cpu_ns(process.pid) - server) / calls / 1e3,
                             "server_ffn_us": statistics.median(computes) * 1e6,
                             "wall_us": statistics.median(walls) * 1e6, "seconds": wall}
    finally:
        process.terminate()
        await process.wait()
    return out


def _per_layer(workdir: Path, layers_run: int, tokens: int, experts: int, top_k: int, functions: int) -> dict:
    import torch

    from common import mixtral_layout_checkpoint
    from kubemoe.adapters import MoEAdapter
    from kubemoe.bundles import Bundle
    from kubemoe.checkpoint import Checkpoint
    from kubemoe.frontend.dispatch import DispatchConfig, Dispatcher
    from kubemoe.frontend.embedded import expert_processes
    from kubemoe.frontend.loads import LoadRecorder
    from kubemoe.moe import group_tokens
    from kubemoe.routing_table import build_route_map, table_for_bundles

    from dispatch_calls import routing

    ckpt = mixtral_layout_checkpoint(workdir / "ckpt-layer", 128, 256, "float32", 1, experts, top_k)
    checkpoint = Checkpoint(ckpt)
    adapter = MoEAdapter(checkpoint.config)
    layer = adapter.moe_layers[0]
    held = [Bundle(f"f{f}", tuple((layer, e) for e in range(experts) if e % functions == f)) for f in range(functions)]
    index, weights = routing(tokens, experts, top_k, 0)
    hidden = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(1)) * 0.1

    def cpu_of(fn, n: int) -> float:  # microseconds of this thread's CPU per call
        fn()
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        return (time.thread_time() - t0) / n * 1e6

    group_us = cpu_of(lambda: group_tokens(index), 200)
    shm = workdir / "shm-layer"
    shm.mkdir()
    with expert_processes(ckpt, held, "bench", ready_timeout=600, shm_dir=shm, busy_poll_us=0) as procs:
        per_expert = [Bundle(f"e{e}", ((layer, e),)) for e in range(experts)]
        table = table_for_bundles("bench", per_expert, {b.name: [procs.addresses[f"f{b.experts[0][1] % functions}"][0]]
                                                        for b in per_expert})
        dispatcher = Dispatcher(adapter, checkpoint, DispatchConfig(model="bench", shm_dir=shm, busy_poll_us=0),
                                LoadRecorder("bench", "bench"), torch.float32, "cpu")
        dispatcher.set_routes(build_route_map(table, "bench", adapter.moe_layers, experts))
        dispatcher.apply_pending()
        try:
            run = lambda: dispatcher.run_layer(layer, hidden, index, weights)  # noqa: E731
            for _ in range(20):
                expected = run()
            pids = [p.pid for p in procs.procs.values()]
            me, fns = cpu_ns(os.getpid()), sum(cpu_ns(p) for p in pids)
            walls = []
            t0 = time.thread_time()
            for _ in range(layers_run):
                w0 = time.perf_counter()
                out = run()
                walls.append(time.perf_counter() - w0)
            caller_us = (time.thread_time() - t0) / layers_run * 1e6
            frontend_us = (cpu_ns(os.getpid()) - me) / layers_run / 1e3
            functions_us = (sum(cpu_ns(p) for p in pids) - fns) / layers_run / 1e3
            if not torch.equal(out, expected):
                raise RuntimeError("the layer's output changed between runs of the same input")
        finally:
            dispatcher.close()
    return {"group_tokens_us": group_us, "caller_cpu_us": caller_us, "frontend_cpu_us": frontend_us,
            "functions_cpu_us": functions_us, "wall_us": statistics.median(walls) * 1e6,
            "output_sum": float(out.double().sum())}


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))  # common, expert_fn_overhead, dispatch_calls: this tree's scripts
    from kubemoe import busy_poll

    with tempfile.TemporaryDirectory(prefix="kubemoe-callcpu-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        calls = busy_poll.run(_per_call(Path(d), args.calls, args.tokens, args.hidden), 0)
        layer = _per_layer(Path(d), args.layers_run, args.tokens, args.experts, args.top_k, args.functions)
    print(json.dumps({"per_call": calls, "per_layer": layer}))


# -- the orchestrator ------------------------------------------------------------------------------

def extract(ref: str, into: Path) -> Path | None:
    """REF's tree in `into` (git archive), or None where there is no repository or no such commit."""
    try:
        archive = subprocess.run(["git", "-C", str(HERE), "archive", ref], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_worker(tree: Path, args: argparse.Namespace) -> dict:
    flags = ["--calls", str(args.calls), "--tokens", str(args.tokens), "--hidden", str(args.hidden),
             "--layers-run", str(args.layers_run), "--experts", str(args.experts), "--top-k", str(args.top_k),
             "--functions", str(args.functions)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", *flags], env=env, cwd=tree,
                          capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"the worker for {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def flatten(result: dict) -> dict[str, float]:
    row = {f"{path}_{k}": v for path, figures in result["per_call"].items() for k, v in figures.items()}
    row.update({f"layer_{k}": v for k, v in result["per_layer"].items()})
    for path in PATHS:  # both processes' CPU per call: the Python of the call, the tiny FFN aside
        row[f"{path}_python_us"] = row[f"{path}_client_cpu_us"] + row[f"{path}_server_cpu_us"] - row[f"{path}_server_ffn_us"]
    return row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", default=BASELINE, help="the commit to compare with ('': none)")
    parser.add_argument("--rounds", type=int, default=3, help="alternate rounds of baseline and this tree")
    parser.add_argument("--calls", type=int, default=400, help="timed calls per path and round")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size of the per-call expert (Mixtral's)")
    parser.add_argument("--layers-run", type=int, default=200, help="timed layers per round")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--functions", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    return parser.parse_args()


def main(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    from common import Goal, print_table, write_results

    started = time.perf_counter()
    this_tree = HERE.parent
    with tempfile.TemporaryDirectory(prefix="kubemoe-baseline-") as tmp:
        base_tree = extract(args.baseline, Path(tmp) / "tree") if args.baseline else None
        trees = ({"before": base_tree} if base_tree else {}) | {"after": this_tree}
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for round_ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(flatten(run_worker(tree, args)))
                print(f"# round {round_ + 1} {name}: " + ", ".join(
                    f"{p} {runs[name][-1][f'{p}_python_us']:.0f} us" for p in PATHS) +
                      f", layer caller {runs[name][-1]['layer_caller_cpu_us']:.0f} us", file=sys.stderr, flush=True)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    rows = [{"tree": name, **figures} for name, figures in medians.items()]
    print_table([{"tree": r["tree"], "path": p, "client": r[f"{p}_client_cpu_us"], "server": r[f"{p}_server_cpu_us"],
                  "ffn": r[f"{p}_server_ffn_us"], "python": r[f"{p}_python_us"], "wall": r[f"{p}_wall_us"]}
                 for r in rows for p in PATHS],
                [("tree", "tree", ""), ("path", "path", ""), ("client", "client CPU us", ".0f"),
                 ("server", "server CPU us", ".0f"), ("ffn", "FFN us", ".0f"), ("python", "python us", ".0f"),
                 ("wall", "wall us", ".0f")])
    print_table(rows, [("tree", "tree", ""), ("layer_group_tokens_us", "group_tokens us", ".0f"),
                       ("layer_caller_cpu_us", "caller CPU us/layer", ".0f"),
                       ("layer_frontend_cpu_us", "frontend CPU us/layer", ".0f"),
                       ("layer_functions_cpu_us", "functions CPU us/layer", ".0f"), ("layer_wall_us", "wall us", ".0f")])
    goals = {}
    if "before" in medians:
        before, after = medians["before"], medians["after"]
        if before["layer_output_sum"] != after["layer_output_sum"]:
            raise SystemExit("the layer's output differs between the trees: the dispatch is no longer bit-equal")
        for path in PATHS:
            goals[f"python_us_per_call_{path}_vs_before"] = Goal(after[f"{path}_python_us"] / before[f"{path}_python_us"],
                                                                 "< 1.0")
        goals["layer_caller_cpu_vs_before"] = Goal(after["layer_caller_cpu_us"] / before["layer_caller_cpu_us"], "< 1.0")
        goals["group_tokens_vs_before"] = Goal(after["layer_group_tokens_us"] / before["layer_group_tokens_us"], "< 1.0")
    for name, goal in goals.items():
        print(f"goal {name}: {goal.value:.3f} {goal.goal} ({'met' if goal.met else 'NOT met'})")
    path = write_results("call_cpu", torch.device("cpu"), rows, goals, args.out, baseline=args.baseline if "before" in medians else None,
                         rounds=[{"tree": n, **r} for n, rs in runs.items() for r in rs],
                         settings={k: v for k, v in vars(args).items() if k not in ("worker", "out")},
                         bound="CPU time of both processes per call (every thread), the tiny FFN's reported time "
                               "subtracted: the Python and copies of a call; on a 2-core machine shared with other work",
                         seconds=round(time.perf_counter() - started, 1))
    print(f"wrote {path}")


if __name__ == "__main__":
    arguments = parse_args()
    worker(arguments) if arguments.worker else main(arguments)
