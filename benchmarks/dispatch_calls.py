#!/usr/bin/env python3
"""Calls per MoE layer and time per layer of the frontend's dispatcher: one call per expert function
and layer (kubemoe) against one call per bundle (the dispatcher before, kept as `calls_per_bundle`).

    python benchmarks/dispatch_calls.py                          # this CPU, tiny experts (< 2 min)
    python benchmarks/dispatch_calls.py --device cuda --layouts 8:2:mixtral,128:8:qwen3-30b-a3b --functions 4
                                                                 # on the H200 (run_h200.sh dispatch-calls)

The planner makes every (layer, expert) its own route (a bundle per expert replica, several packed
into one expert function by memory: benchmarks/moeless_live.py's `table_of`, the operator's plans).
Here F expert-function processes (`kubemoe expert-fn`, shared memory and its lane, as `kubemoe serve`
starts them) hold E experts per layer between them, round-robin, and the routing table names one
bundle per expert. The real Dispatcher (frontend/dispatch.py) runs MoE layers over random top-K
routing at several batch sizes, the two ways alternating, layer after layer:
- calls per layer: from the dispatcher's own counter (kubemoe_frontend_expert_calls_total);
- time per layer: `Dispatcher.run_layer`, the device synchronised, median and p90;
- CPU time per layer: of the frontend and every function process together (user + system, from
  /proc), which the other work on a shared machine does not inflate as it does wall times.
Both ways must compute the same output (checked once per batch size: the split is lossless).
Goals: `calls_per_layer_vs_functions` (kubemoe's calls per layer over the functions a layer's
tokens reach, <= 1.0: one call per function) and `layer_time_vs_per_bundle_<size>-<E>x<K>_<tokens>`
(kubemoe's median over the baseline's, < 1.0), `layer_cpu_vs_per_bundle_...` (the same for CPU
time, < 1.0). Bound: on this machine the frontend and the
functions share the cores (a 2-core CPU runs 1+F processes), so a call's fixed cost, not the FFN,
is what merging saves; on the H200 with Mixtral-size experts the FFN (0.13 ms a weight read)
weighs more and the saving is the per-call overhead only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The frontend shares the cores with the functions, as in `kubemoe serve`: idle OpenMP threads sleep
# rather than spin (read when torch loads; the functions get it from frontend/embedded.py).
from kubemoe.frontend.embedded import shared_cores_env

os.environ.update(shared_cores_env())

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, Goal, mixtral_layout_checkpoint, print_table, write_results  # noqa: E402

from kubemoe.adapters import MoEAdapter  # noqa: E402
from kubemoe.bundles import Bundle  # noqa: E402
from kubemoe.checkpoint import Checkpoint  # noqa: E402
from kubemoe.frontend.dispatch import DispatchConfig, Dispatcher  # noqa: E402
from kubemoe.frontend.embedded import expert_processes  # noqa: E402
from kubemoe.frontend.loads import LoadRecorder  # noqa: E402
from kubemoe.frontend.metrics import FrontendMetrics  # noqa: E402
from kubemoe.routing_table import build_route_map, table_for_bundles  # noqa: E402

SIZES = {"tiny": (128, 256), "qwen3-30b-a3b": (2048, 768), "mixtral": (4096, 14336)}  # hidden, intermediate
WAYS = ("per_bundle", "kubemoe")  # the baseline first in every round


def parse_layouts(text: str, size: str) -> list[tuple[int, int, str]]:
    """"16:2,128:8:qwen3-30b-a3b" -> [(experts, top_k, expert size), ...] (the size `size` where none is given)."""
    layouts = []
    for part in text.split(","):
        fields = part.split(":")
        try:
            experts, top_k = int(fields[0]), int(fields[1])
        except (ValueError, IndexError):
            raise SystemExit(f"--layouts {text!r}: write EXPERTS:TOP_K[:SIZE], comma-separated, e.g. 16:2,64:8") from None
        named = fields[2] if len(fields) > 2 else size
        if len(fields) > 3 or named not in SIZES or not 1 <= top_k <= experts:
            raise SystemExit(f"--layouts {text!r}: each is EXPERTS:TOP_K[:SIZE] with 1 <= TOP_K <= EXPERTS and SIZE "
                             f"one of {', '.join(SIZES)}")
        layouts.append((experts, top_k, named))
    return layouts


def routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing: [T, K] expert ids (distinct per token) and their weights."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=generator)
    weights, index = logits.softmax(-1).topk(top_k, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True)


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) this process and the processes `pids` have used so far: what the work
    costs, whatever else the shared cores run meanwhile (wall times here wait for the scheduler)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (stat fields 14 and 15)
    return total


def bench_layout(args: argparse.Namespace, experts: int, top_k: int, size: str, device: torch.device,
                 dtype: torch.dtype, workdir: Path) -> list[dict]:
    hidden, intermediate = SIZES[size]
    layers, functions = args.layers, args.functions
    ckpt = mixtral_layout_checkpoint(workdir / f"ckpt-{size}-{experts}x{top_k}", hidden, intermediate,
                                     str(dtype).removeprefix("torch."), layers, experts, top_k)
    checkpoint = Checkpoint(ckpt)
    adapter = MoEAdapter(checkpoint.config)
    model = "dispatch-bench"
    home = {(layer, e): e % functions for layer in adapter.moe_layers for e in range(experts)}  # round-robin
    held = [Bundle(f"f{f}", tuple(k for k, where in home.items() if where == f)) for f in range(functions)]
    rows = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as shm_dir, \
            expert_processes(ckpt, held, model, ready_timeout=900, shm_dir=Path(shm_dir)) as procs:
        shm = Path(shm_dir)
        pids = [proc.pid for proc in procs.procs.values()]
        addresses = [procs.addresses[b.name][0] for b in held]
        per_expert = [Bundle(f"l{layer}-e{e}", ((layer, e),)) for layer, e in home]
        table = table_for_bundles(model, per_expert, {b.name: [addresses[home[b.experts[0]]]] for b in per_expert})
        metrics = FrontendMetrics(model)
        config = DispatchConfig(model=model, shm_dir=shm)
        dispatcher = Dispatcher(adapter, checkpoint, config, LoadRecorder(model, "bench"), dtype, device, metrics)
        dispatcher.set_routes(build_route_map(table, model, adapter.moe_layers, experts))
        dispatcher.apply_pending()
        configs = {"per_bundle": dataclasses.replace(config, calls_per_bundle=True), "kubemoe": config}
        calls = lambda: metrics.registry.get_sample_value("kubemoe_frontend_expert_calls_total") or 0.0  # noqa: E731
        try:
            for tokens in args.tokens:
                index, weights = routing(tokens, experts, top_k, args.seed + tokens)
                index, weights = index.to(device), weights.to(device, dtype)
                hidden_states = (torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)) * 0.1
                                 ).to(device, dtype)
                reached = len({home[(adapter.moe_layers[0], e)] for e in index.unique().tolist()})  # functions a layer's tokens reach
                seconds = {way: [] for way in WAYS}
                made, cpu = dict.fromkeys(WAYS, 0.0), dict.fromkeys(WAYS, 0.0)
                outputs = {}
                for round_ in range(args.warmup + args.iterations):
                    for way in WAYS:
                        dispatcher.config = configs[way]
                        before, cpu_before = calls(), cpu_seconds(pids)
                        for layer in adapter.moe_layers:
                            begin = time.perf_counter()
                            out = dispatcher.run_layer(layer, hidden_states, index, weights)
                            if device.type == "cuda":
                                torch.cuda.synchronize(device)
                            if round_ >= args.warmup:
                                seconds[way].append(time.perf_counter() - begin)
                        if round_ >= args.warmup:
                            made[way] += calls() - before
                            cpu[way] += cpu_seconds(pids) - cpu_before
                        outputs[way] = out
                atol = 1e-5 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(outputs["kubemoe"], outputs["per_bundle"], rtol=1e-5, atol=atol)
                for way in WAYS:
                    ms = sorted(s * 1e3 for s in seconds[way])
                    rows.append({"layout": f"{size}-{experts}x{top_k}", "tokens": tokens, "way": way, "functions_reached": reached,
                                 "calls_per_layer": made[way] / (args.iterations * layers),
                                 "cpu_ms_per_layer": cpu[way] * 1e3 / (args.iterations * layers),
                                 "median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))],
                                 "layers_timed": len(ms)})
        finally:
            dispatcher.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="hidden x intermediate of an expert")
    parser.add_argument("--layouts", default="16:2,64:8",
                        help="EXPERTS:TOP_K[:SIZE], comma-separated (16:2: the trained model's; SIZE: --size if not given)")
    parser.add_argument("--functions", type=int, default=2, help="expert-function processes holding the experts")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256], help="tokens a layer (batch sizes)")
    parser.add_argument("--iterations", type=int, default=10, help="measured rounds per batch size and way")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for experts, top_k, size in parse_layouts(args.layouts, args.size):
            print(f"layout: {experts} experts of {size} size, top-{top_k}, over {args.functions} functions", flush=True)
            rows += bench_layout(args, experts, top_k, size, device, dtype, Path(tmp))
    print_table(rows, [("layout", "layout", ""), ("tokens", "tokens", "d"), ("way", "way", ""),
                       ("functions_reached", "functions", "d"), ("calls_per_layer", "calls/layer", ".2f"),
                       ("median_ms", "median ms", ".3f"), ("p90_ms", "p90 ms", ".3f"),
                       ("cpu_ms_per_layer", "CPU ms/layer", ".3f")])
    ours = [r for r in rows if r["way"] == "kubemoe"]
    base = {(r["layout"], r["tokens"]): r for r in rows if r["way"] == "per_bundle"}
    goals = {"calls_per_layer_vs_functions": Goal(max(r["calls_per_layer"] / r["functions_reached"] for r in ours), "<= 1.0")}
    for r in ours:
        name = f"layer_time_vs_per_bundle_{r['layout']}_{r['tokens']}"
        goals[name] = Goal(r["median_ms"] / base[(r["layout"], r["tokens"])]["median_ms"], "< 1.0")
        goals[name.replace("layer_time", "layer_cpu")] = Goal(
            r["cpu_ms_per_layer"] / base[(r["layout"], r["tokens"])]["cpu_ms_per_layer"], "< 1.0")
    write_results("dispatch_calls", device, rows, goals, out=args.out,
                  settings={k: str(v) for k, v in vars(args).items()},
                  bound="the frontend and every expert-function process share this machine's cores; a call's "
                        "fixed cost (encode, lane round trip, a server round) is what one call per function saves",
                  seconds=round(time.perf_counter() - started, 1))


if __name__ == "__main__":
    main()
