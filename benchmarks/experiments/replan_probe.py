"""Experiment (issue 14): where a step stalls while the table is re-planned in place.

One dispatcher (frontend/dispatch.py) serves a steady stream of equal steps over P expert-function
processes (`kubemoe expert-fn`, shared-memory lanes, as moeless_live.py starts them) and, every
`--every` steps, re-plans with frontend/replan.py (one `Replanner`), switching at a step boundary as
moeless_live.py does: `--moves` experts per layer change process each time (Load there, switch,
Unload where they were). Tokens go to experts uniformly at random, so every process gets a call
each layer. Each step is labelled by the re-plan phase it overlaps (steady, load, switch, unload)
and split into its calls: per call the frontend's wall time and the expert function's own timing
(queue, compute, total: ServerTiming), the gap between them being the path between the two.

    python benchmarks/experiments/replan_probe.py                       # this CPU (~1 min)
    python benchmarks/experiments/replan_probe.py --device cuda --hidden 4096 --intermediate 14336 --processes 8
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import gpu_sharing, mixtral_layout_checkpoint  # noqa: E402

from kubemoe.adapters import MoEAdapter  # noqa: E402
from kubemoe.bundles import Bundle  # noqa: E402
from kubemoe.checkpoint import Checkpoint  # noqa: E402
from kubemoe.expert_fn.client import ExpertClient  # noqa: E402
from kubemoe.frontend.dispatch import DispatchConfig, Dispatcher  # noqa: E402
from kubemoe.frontend.embedded import expert_processes  # noqa: E402
from kubemoe.frontend.loads import LoadRecorder  # noqa: E402
from kubemoe.frontend.loop_thread import LoopThread  # noqa: E402
try:
    from kubemoe.frontend.replan import Replanner  # noqa: E402
except ImportError:  # a commit before it (to measure before and after): a re-plan over channels of its own
    from kubemoe.frontend.replan import repoint  # noqa: E402

    class Replanner:  # type: ignore[no-redef]
        def __init__(self, model):
            self.model = model

        def repoint(self, before, after, switch):
            return repoint(self.model, before, after, switch)

        async def close(self):
            pass
from kubemoe.routing_table import build_route_map, table_for_bundles  # noqa: E402

try:
    from kubemoe.gc_freeze import settle  # noqa: E402
except ImportError:  # a commit before it
    def settle() -> None:
        pass

CALLS: list[dict] = []  # every expert call of the run, as the frontend saw it
FULL_GC: list[tuple[float, float]] = []  # this process's full garbage collections: (start, seconds)


def _on_collection(phase: str, info: dict, started: list = [0.0]) -> None:  # noqa: B006 - the start, kept between calls
    if info["generation"] == 2:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            FULL_GC.append((started[0], time.perf_counter() - started[0]))


def _timed_call(original):
    """ExpertClient.call, recording each call's wall time and the server's timing of it."""
    async def call(self, layer, experts, counts, hidden, **kwargs):
        started = time.perf_counter()
        out, timing = await original(self, layer, experts, counts, hidden, **kwargs)
        CALLS.append({"address": self.address, "layer": layer, "start": started, "wall": time.perf_counter() - started,
                      "queue": timing.queue_seconds, "compute": timing.compute_seconds, "total": timing.total_seconds})
        return out, timing
    return call


def table(model: str, layers: list[int], experts: int, where: dict[tuple[int, int], str], version: int):
    bundles = [Bundle(f"l{l}-e{e}", ((l, e),)) for l in layers for e in range(experts)]
    return table_for_bundles(model, bundles, {b.name: [where[b.experts[0]]] for b in bundles}, version)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1792)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16, help="tokens a step")
    parser.add_argument("--moves", type=int, default=2, help="experts per layer that change process at a re-plan")
    parser.add_argument("--every", type=int, default=40, help="steps between re-plans")
    parser.add_argument("--replans", type=int, default=8)
    parser.add_argument("--slowest", type=int, default=5, help="re-plan steps to split into their calls")
    parser.add_argument("--json", type=Path, help="write the steps and calls here")
    parser.add_argument("--loads-at-once", type=int, default=1,
                        help="processes that Load at the same time (Replanner's loads_at_once; 0: all)")
    parser.add_argument("--working-memory-mib", type=int, default=0,
                        help="each process's allocator cap beside the experts it holds (kubemoe expert-fn's flag, as "
                             "moeless_live.py gives it: 2048); 0: uncapped")
    parser.add_argument("--cuda-graph-tokens", type=int, default=None,
                        help="the functions' --cuda-graph-tokens (0: no graphs, so a Load captures none); default theirs")
    parser.add_argument("--no-settle", dest="settle", action="store_false",
                        help="leave the start-up objects to the garbage collector (as before kubemoe/gc_freeze.py)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    E, P = args.experts, args.processes
    ExpertClient.call = _timed_call(ExpertClient.call)
    gc.callbacks.append(_on_collection)

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        ckpt = mixtral_layout_checkpoint(Path(tmp) / "ckpt", args.hidden, args.intermediate,
                                         str(dtype).removeprefix("torch."), args.layers, E, args.top_k)
        checkpoint = Checkpoint(ckpt)
        adapter = MoEAdapter(checkpoint.config)
        layers = list(adapter.moe_layers)
        expert_mib = 3 * args.hidden * args.intermediate * dtype.itemsize / 2**20
        print(f"{len(layers)} layers x {E} experts of {args.hidden}x{args.intermediate} ({expert_mib:.1f} MiB each), "
              f"{P} processes, {args.tokens} tokens a step, {args.moves} experts a layer moved a re-plan", flush=True)
        home = {(l, e): e % P for l in layers for e in range(E)}
        bundles = [Bundle(f"p{p}", tuple(k for k, q in home.items() if q == p)) for p in range(P)]
        model = "probe"
        graphs = [] if args.cuda_graph_tokens is None else ["--cuda-graph-tokens", str(args.cuda_graph_tokens)]
        with expert_processes(ckpt, bundles, model, ready_timeout=600, shm_dir=Path(shm),
                              working_memory=args.working_memory_mib << 20, extra_args=graphs) as procs:
            addresses = [procs.addresses[f"p{p}"][0] for p in range(P)]
            dispatcher = Dispatcher(adapter, checkpoint, DispatchConfig(model=model, shm_dir=Path(shm)),
                                    LoadRecorder(model, "probe"), dtype, device)
            mover = LoopThread("kubemoe-replan")
            try:
                replanner = Replanner(model, args.loads_at_once or None)
            except TypeError:  # a commit before loads_at_once, whose re-plans Load on every function at once
                if args.loads_at_once:
                    raise SystemExit("this commit's re-plans Load on every function at once: pass --loads-at-once 0")
                replanner = Replanner(model)
            serving = {"version": -1}
            applied = threading.Condition()

            def at_step_boundary() -> None:
                dispatcher.apply_pending()
                with applied:
                    serving["version"] = dispatcher.routes_version
                    applied.notify_all()

            def wait_serving(version: int) -> None:
                with applied:
                    applied.wait_for(lambda: serving["version"] >= version, timeout=600)

            def switch_at_step(new):
                async def switch():  # as moeless_live.py: returns once a step has begun with the new table
                    dispatcher.set_routes(build_route_map(new, model, layers, E))
                    await asyncio.to_thread(wait_serving, new.version)
                return switch

            def plan(k: int):
                """Re-plan k: the moved experts of every layer sit one process further along."""
                moved = {(l, (k * args.moves + i) % E) for l in layers for i in range(args.moves)}
                where = {key: addresses[(p + 1) % P if key in moved else p] for key, p in home.items()}
                return table(model, layers, E, where, k + 2)

            current = table(model, layers, E, {k: addresses[p] for k, p in home.items()}, 1)
            dispatcher.set_routes(build_route_map(current, model, layers, E))
            dispatcher.apply_pending()
            generator = torch.Generator().manual_seed(0)
            hidden = (torch.randn(args.tokens, args.hidden, generator=generator) * 0.1).to(device, dtype)
            weights = torch.full((args.tokens, args.top_k), 1.0 / args.top_k, dtype=dtype, device=device)
            steps, replans, moving = [], [], None
            total = args.every * (args.replans + 1)
            try:
                for t in range(-20, total):  # 20 warm-up steps, not recorded
                    if t == 0 and args.settle:
                        settle()  # as a frontend process does once ready (kubemoe/gc_freeze.py)
                    if t > 0 and t % args.every == 0 and moving is None:
                        new = plan(t // args.every)
                        moving = (mover.submit(replanner.repoint(current, new, switch_at_step(new))), new,
                                  time.perf_counter())
                    boundary = time.perf_counter()
                    at_step_boundary()
                    chosen = [torch.stack([torch.randperm(E, generator=generator)[:args.top_k]
                                           for _ in range(args.tokens)]) for _ in layers]
                    started = time.perf_counter()
                    chosen = [c.to(device) for c in chosen]  # as a driver replaying routing does (moeless_live.py)
                    prepared = time.perf_counter()
                    for layer, top_k in zip(layers, chosen):
                        dispatcher.run_layer(layer, hidden, top_k, weights)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    ended = time.perf_counter()
                    if t >= 0:
                        steps.append({"t": t, "start": started, "end": ended, "step": ended - started,
                                      "boundary": started - boundary, "top_k_copy": prepared - started})
                    if moving is not None and moving[0].done():
                        done = moving[0].result()
                        begun = moving[2]
                        replans.append({"begun": begun, "load_end": begun + done.load_s,
                                        "switch_end": begun + done.load_s + done.switch_s,
                                        "end": begun + done.load_s + done.switch_s + done.unload_s,
                                        "loaded": sum(map(len, done.moves.load.values())),
                                        "loading": [[begun + a, begun + b] for a, b in done.load_spans.values()],
                                        "load_s": done.load_s, "switch_s": done.switch_s, "unload_s": done.unload_s})
                        current, moving = moving[1], None
                while moving is not None and not moving[0].done():
                    time.sleep(0.01)
            finally:
                mover.run(replanner.close(), timeout=30)
                mover.stop()
                dispatcher.close()
    report(steps, replans, args)


def phase_of(step: dict, replans: list[dict]) -> str:
    """The re-plan phase a step overlaps most (steady: none)."""
    best, label = 0.0, "steady"
    for r in replans:
        for name, a, b in (("load", r["begun"], r["load_end"]), ("switch", r["load_end"], r["switch_end"]),
                           ("unload", r["switch_end"], r["end"])):
            overlap = min(b, step["end"]) - max(a, step["start"])
            if overlap > best:
                best, label = overlap, name
    return label


def report(steps: list[dict], replans: list[dict], args) -> None:
    sharing = gpu_sharing(torch.device(args.device))
    print(f"processes share the GPU by {sharing}; {args.loads_at_once or 'all'} of them Load at once")
    for s in steps:
        s["phase"] = phase_of(s, replans)
    print(f"{'phase':>8} {'steps':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'boundary max ms':>16}")
    for phase in ("steady", "load", "switch", "unload"):
        ms = np.array([s["step"] for s in steps if s["phase"] == phase]) * 1e3
        bound = np.array([s["boundary"] for s in steps if s["phase"] == phase]) * 1e3
        if ms.size:
            print(f"{phase:>8} {ms.size:>6} {np.percentile(ms, 50):8.2f} {np.percentile(ms, 99):8.2f} {ms.max():8.2f} "
                  f"{bound.max():16.3f}")
    steady = np.array([s["step"] for s in steps if s["phase"] == "steady"])
    during = np.array([s["step"] for s in steps if s["phase"] != "steady"])
    if steady.size and during.size:
        print(f"re-plan steps' p99 / steady p99: {np.percentile(during, 99) / np.percentile(steady, 99):.2f}  "
              f"(max {during.max() / np.percentile(steady, 99):.2f})")
        print(f"re-plan steps' p50 / steady p50: {np.median(during) / np.median(steady):.2f}")
    loaders: dict[int, list[float]] = {}  # step times by the processes Loading at the step's middle
    for s in steps:
        if s["phase"] == "load":
            middle = (s["start"] + s["end"]) / 2
            n = sum(a <= middle <= b for r in replans for a, b in r["loading"])
            loaders.setdefault(n, []).append(s["step"] * 1e3)
    for n, ms in sorted(loaders.items()):
        print(f"load steps with {n} processes Loading: {len(ms)}, p50 {np.median(ms):.2f} ms, "
              f"p99 {np.percentile(ms, 99):.2f} ms")
    for r in replans:
        print(f"re-plan: loaded {r['loaded']}, load {r['load_s'] * 1e3:.1f} ms, switch {r['switch_s'] * 1e3:.1f} ms, "
              f"unload {r['unload_s'] * 1e3:.1f} ms")
    typical = {k: float(np.median([c[k] for c in CALLS])) * 1e3 for k in ("wall", "queue", "compute", "total")}
    print("a call, median ms: " + ", ".join(f"{k} {v:.2f}" for k, v in typical.items()))
    print(f"the {args.slowest} slowest re-plan steps, their slowest calls (ms: wall = frontend's, total = server's):")
    for s in sorted((s for s in steps if s["phase"] != "steady"), key=lambda s: -s["step"])[:args.slowest]:
        calls = [c for c in CALLS if s["start"] <= c["start"] <= s["end"]]
        slow = sorted(calls, key=lambda c: -c["wall"])[:2]
        first = (min(c["start"] for c in calls) - s["start"]) * 1e3 if calls else float("nan")
        print(f"  step {s['t']} ({s['phase']}) {s['step'] * 1e3:.1f} ms, {len(calls)} calls, boundary "
              f"{s['boundary'] * 1e3:.2f} ms, top-k copy {s['top_k_copy'] * 1e3:.2f} ms, first call at {first:.1f} ms: "
              + "; ".join(
                  f"{c['address'].rsplit(':', 1)[1]} L{c['layer']} wall {c['wall'] * 1e3:.1f} total {c['total'] * 1e3:.1f} "
                  f"queue {c['queue'] * 1e3:.1f} compute {c['compute'] * 1e3:.1f}" for c in slow))
    served = [seconds for began, seconds in FULL_GC if began >= steps[0]["start"]]  # not settle()'s own
    print(f"full garbage collections while serving: {len(served)}, the longest {max(served, default=0) * 1e3:.1f} ms")
    if args.json:
        args.json.write_text(json.dumps({"gpu_sharing": sharing, "loads_at_once": args.loads_at_once, "steps": steps,
                                         "replans": replans, "calls": CALLS, "full_gc": FULL_GC}))


if __name__ == "__main__":
    main()
