#!/usr/bin/env python3
"""CPU time of an expert call's Python on each path, and of the frontend's per-layer dispatch, before and after.

The per-call overhead left on the H200 host (0.39 ms through shared memory, 0.74 ms over the TCP lane
for a 64-token Mixtral call, expert_fn_h200.json) is Python on both sides, not bytes. Wall times on a
shared 2-core machine wait for the scheduler; CPU time does not. So this measures, with a tiny expert
(hidden 4096, intermediate 16: tensors as large as Mixtral's, an FFN that hardly more than reads them):
- per call and path (shm: shared memory and its Unix lane; tcp: the TCP lane; inline: tensors in the
  gRPC stream): the client process's CPU time (every thread: the caller, gRPC's, the loop's) and the
  expert function's, per call, from /proc/<pid>/task/*/schedstat (nanoseconds on a CPU), minus nothing:
  the server's reported FFN time is given beside it;
- per MoE layer of the frontend's Dispatcher (64 experts, top-8, over 2 expert functions through
  shared memory): the calling thread's CPU time (routing -> group -> inputs -> submit -> wait ->
  combine: everything outside the calls) and its grouping alone, as the tree's dispatcher groups: the
  pairs sorted by expert with their inputs gathered and the group ends read (`moe.sort_pairs`), or in
  a tree before it `group_tokens` (whose inputs were gathered later, per call: the harder comparison).
Both sides of every client run with busy polling off (spinning would count as CPU time).

With --baseline REF (default: the commit this work started from; --baseline-tree where there is no
git) the same measurements run for REF's tree (extracted with `git archive`) and this one: a worker
process per tree, each with its own expert functions, the two taking turns block by block (--rounds
blocks of each measurement), so both see the same minutes of a machine other work shares. Figures are
medians over blocks; `python_us` subtracts the server's reported FFN time (a wall clock: noisy). Goals
compare this tree with the baseline (none without one): `cpu_us_per_call_<path>_vs_before` (both
processes' CPU per call), `layer_caller_cpu_vs_before`, `grouping_vs_before` (< 1.0).

    python benchmarks/call_cpu.py                      # this CPU (~4 min); writes results/call_cpu_<machine>.json
    bash benchmarks/run_h200.sh call-cpu BASE_TREE      # the GPU host's CPU, against a baseline tree carried along
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kubemoe.frontend.embedded import shared_cores_env

os.environ.update(shared_cores_env())

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


# -- the worker: runs in the tree under test (PYTHONPATH), answers the orchestrator's commands ----------

async def _serve_commands(workdir: Path, args: argparse.Namespace) -> None:
    """Set up both measurements, print "ready", then per line on stdin run a block and print its JSON:
    `call PATH N` (N calls), `layer N` (N layers), `group N` (N groupings); `quit` ends."""
    import torch

    from common import mixtral_layout_checkpoint
    from dispatch_calls import routing
    from expert_fn_overhead import bench_input, start_server
    from kubemoe.adapters import MoEAdapter
    from kubemoe.bundles import Bundle
    from kubemoe.checkpoint import Checkpoint
    from kubemoe.expert_fn.client import ExpertClient
    from kubemoe.frontend.dispatch import DispatchConfig, Dispatcher
    from kubemoe.frontend.embedded import expert_processes
    from kubemoe.frontend.loads import LoadRecorder
    from kubemoe.routing_table import build_route_map, table_for_bundles

    tokens, experts, functions = args.tokens, args.experts, args.functions
    shm_dir = workdir / "shm"
    shm_dir.mkdir()
    process, address = await start_server(mixtral_layout_checkpoint(workdir / "ckpt", args.hidden, 16, "float32"),
                                          "cpu", shm_dir, ["--busy-poll-us", "0"])
    x = bench_input(tokens, args.hidden, torch.float32)
    options = {"shm": dict(shm_dir=shm_dir, tcp=False), "tcp": dict(tcp=True), "inline": dict(tcp=False)}
    clients = {path: ExpertClient(address, model="bench", **kwargs) for path, kwargs in options.items()}
    for path, client in clients.items():
        for _ in range(50):  # warm: the stream, the lane, both sides' code paths
            await client.call(0, [0], [tokens], x)
        if client.transport != path:
            raise RuntimeError(f"the {path} calls travelled {client.transport}")

    ckpt = mixtral_layout_checkpoint(workdir / "ckpt-layer", 128, 256, "float32", 1, experts, args.top_k)
    checkpoint = Checkpoint(ckpt)
    adapter = MoEAdapter(checkpoint.config)
    layer = adapter.moe_layers[0]
    held = [Bundle(f"f{f}", tuple((layer, e) for e in range(experts) if e % functions == f)) for f in range(functions)]
    index, weights = routing(tokens, experts, args.top_k, 0)
    hidden = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(1)) * 0.1
    (workdir / "shm-layer").mkdir()
    with expert_processes(ckpt, held, "bench", ready_timeout=600, shm_dir=workdir / "shm-layer", busy_poll_us=0) as procs:
        per_expert = [Bundle(f"e{e}", ((layer, e),)) for e in range(experts)]
        table = table_for_bundles("bench", per_expert, {b.name: [procs.addresses[f"f{b.experts[0][1] % functions}"][0]]
                                                        for b in per_expert})
        dispatcher = Dispatcher(adapter, checkpoint, DispatchConfig(model="bench", shm_dir=workdir / "shm-layer",
                                                                    busy_poll_us=0),
                                LoadRecorder("bench", "bench"), torch.float32, "cpu")
        dispatcher.set_routes(build_route_map(table, "bench", adapter.moe_layers, experts))
        dispatcher.apply_pending()
        try:  # the layer's grouping as this tree's dispatcher does it
            from kubemoe.moe import sort_pairs

            def grouping() -> None:
                sort_pairs(hidden, index, weights, experts, False).ends.tolist()
        except ImportError:  # a tree before sort_pairs
            from kubemoe.moe import group_tokens

            def grouping() -> None:
                group_tokens(index)
        pids = [p.pid for p in procs.procs.values()]
        expected = None
        for _ in range(20):
            expected = dispatcher.run_layer(layer, hidden, index, weights)
        print("ready", flush=True)
        try:
            while (line := await asyncio.to_thread(sys.stdin.readline)).strip() not in ("quit", ""):
                what, *rest = line.split()
                n = int(rest[-1])
                me, t0, w0 = cpu_ns(os.getpid()), time.thread_time(), time.perf_counter()
                if what == "call":
                    server, ffn = cpu_ns(process.pid), 0.0
                    for _ in range(n):
                        y, timing = await clients[rest[0]].call(0, [0], [tokens], x)
                        ffn += timing.compute_seconds
                        del y
                    out = {"client_cpu_us": (cpu_ns(os.getpid()) - me) / n / 1e3,
                           "server_cpu_us": (cpu_ns(process.pid) - server) / n / 1e3, "server_ffn_us": ffn / n * 1e6}
                elif what == "layer":
                    fns = sum(cpu_ns(p) for p in pids)
                    for _ in range(n):
                        got = dispatcher.run_layer(layer, hidden, index, weights)
                    if not torch.equal(got, expected):
                        raise RuntimeError("the layer's output changed between runs of the same input")
                    out = {"caller_cpu_us": (time.thread_time() - t0) / n * 1e6,
                           "frontend_cpu_us": (cpu_ns(os.getpid()) - me) / n / 1e3,
                           "functions_cpu_us": (sum(cpu_ns(p) for p in pids) - fns) / n / 1e3,
                           "output_sum": float(got.double().sum())}
                else:
                    for _ in range(n):
                        grouping()
                    out = {"grouping_us": (time.thread_time() - t0) / n * 1e6}
                if what != "group":
                    out["wall_us"] = (time.perf_counter() - w0) / n * 1e6
                print(json.dumps(out), flush=True)
        finally:
            dispatcher.close()
            for client in clients.values():
                await client.close()
            process.terminate()
            await process.wait()


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))  # common, expert_fn_overhead, dispatch_calls: this tree's scripts
    from kubemoe import busy_poll

    with tempfile.TemporaryDirectory(prefix="kubemoe-callcpu-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        busy_poll.run(_serve_commands(Path(d), args), 0)


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


class Worker:
    """A worker process for one tree, set up once; blocks of measurement on demand."""

    def __init__(self, tree: Path, args: argparse.Namespace):
        flags = ["--tokens", str(args.tokens), "--hidden", str(args.hidden), "--experts", str(args.experts),
                 "--top-k", str(args.top_k), "--functions", str(args.functions)]
        # The tree first: its kubemoe wins over any other on the path (which keeps, e.g., the GPU host's wheels).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))}
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", *flags], env=env,
                                     cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self._expect("ready")

    def _expect(self, prefix: str) -> str:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the worker for {self.tree} ended (exit {self.proc.wait()})")
            if line.startswith(prefix):
                return line

    def block(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("{"))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        self.proc.wait(60)


def measure(trees: dict[str, Path], args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Blocks of each measurement, the trees taking turns block by block (who goes first alternates):
    both see the same minute of the shared machine. -> tree -> figure -> one value per block."""
    workers = {name: Worker(tree, args) for name, tree in trees.items()}
    figures: dict[str, dict[str, list[float]]] = {name: collections.defaultdict(list) for name in trees}
    try:
        commands = [f"call {path} {args.calls}" for path in PATHS] + [f"layer {args.layers_run}", "group 200"]
        for block in range(args.rounds):
            for command in commands:
                order = list(workers.items())[::1 if block % 2 == 0 else -1]
                for name, worker in order:
                    result = worker.block(command)
                    kind = command.split()[0]
                    prefix = command.split()[1] + "_" if kind == "call" else "layer_" if kind == "layer" else ""
                    for key, value in result.items():
                        figures[name][prefix + key].append(value)
            print(f"# block {block + 1}/{args.rounds}: " + "; ".join(
                f"{name} " + ", ".join(f"{p} {statistics.median(figures[name][f'{p}_client_cpu_us']) + statistics.median(figures[name][f'{p}_server_cpu_us']):.0f}"
                                       for p in PATHS) for name in trees), file=sys.stderr, flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return figures


def summarize(figures: dict[str, list[float]]) -> dict[str, float]:
    row = {k: statistics.median(v) for k, v in figures.items()}
    for path in PATHS:  # both processes' CPU per call: the Python of the call, the tiny FFN aside
        python = [c + s - f for c, s, f in zip(figures[f"{path}_client_cpu_us"], figures[f"{path}_server_cpu_us"],
                                                figures[f"{path}_server_ffn_us"])]
        row[f"{path}_python_us"] = statistics.median(python)
    return row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", default=BASELINE, help="the commit to compare with ('': none)")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="the baseline's source tree, where there is no git (the lent GPU host); wins over --baseline")
    parser.add_argument("--rounds", type=int, default=8, help="blocks of each measurement per tree, taken in turns")
    parser.add_argument("--calls", type=int, default=100, help="timed calls per path and block")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size of the per-call expert (Mixtral's)")
    parser.add_argument("--layers-run", type=int, default=50, help="timed layers per block")
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
        base_tree = args.baseline_tree.resolve() if args.baseline_tree else \
            extract(args.baseline, Path(tmp) / "tree") if args.baseline else None
        trees = ({"before": base_tree} if base_tree else {}) | {"after": this_tree}
        blocks = measure(trees, args)
    medians = {name: summarize(figures) for name, figures in blocks.items()}
    rows = [{"tree": name, **figures} for name, figures in medians.items()]
    print_table([{"tree": r["tree"], "path": p, "client": r[f"{p}_client_cpu_us"], "server": r[f"{p}_server_cpu_us"],
                  "ffn": r[f"{p}_server_ffn_us"], "python": r[f"{p}_python_us"], "wall": r[f"{p}_wall_us"]}
                 for r in rows for p in PATHS],
                [("tree", "tree", ""), ("path", "path", ""), ("client", "client CPU us", ".0f"),
                 ("server", "server CPU us", ".0f"), ("ffn", "FFN us", ".0f"), ("python", "python us", ".0f"),
                 ("wall", "wall us", ".0f")])
    print_table(rows, [("tree", "tree", ""), ("grouping_us", "grouping us", ".0f"),
                       ("layer_caller_cpu_us", "caller CPU us/layer", ".0f"),
                       ("layer_frontend_cpu_us", "frontend CPU us/layer", ".0f"),
                       ("layer_functions_cpu_us", "functions CPU us/layer", ".0f"), ("layer_wall_us", "wall us", ".0f")])
    goals = {}
    if "before" in medians:
        before, after = medians["before"], medians["after"]
        if before["layer_output_sum"] != after["layer_output_sum"]:
            raise SystemExit("the layer's output differs between the trees: the dispatch is no longer bit-equal")
        for path in PATHS:  # both processes' CPU, the FFN in it (the same code in both trees; its clock is noisy)
            total = {name: figures[f"{path}_client_cpu_us"] + figures[f"{path}_server_cpu_us"]
                     for name, figures in medians.items()}
            goals[f"cpu_us_per_call_{path}_vs_before"] = Goal(total["after"] / total["before"], "< 1.0")
        goals["layer_caller_cpu_vs_before"] = Goal(after["layer_caller_cpu_us"] / before["layer_caller_cpu_us"], "< 1.0")
        goals["grouping_vs_before"] = Goal(after["grouping_us"] / before["grouping_us"], "< 1.0")
    baseline = (str(args.baseline_tree) if args.baseline_tree else args.baseline) if "before" in medians else None
    write_results("call_cpu", torch.device("cpu"), rows, goals, args.out, baseline=baseline,
                  blocks={name: dict(figures) for name, figures in blocks.items()},
                  settings={k: str(v) for k, v in vars(args).items() if k not in ("worker", "out")},
                  bound="CPU time of both processes per call (every thread), the tiny FFN's reported time "
                        "subtracted: the Python and copies of a call; on a 2-core machine shared with other work",
                  seconds=round(time.perf_counter() - started, 1))


if __name__ == "__main__":
    arguments = parse_args()
    worker(arguments) if arguments.worker else main(arguments)
