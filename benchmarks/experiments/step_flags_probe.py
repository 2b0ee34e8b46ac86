"""Experiment (H200): can a frontend and an expert function hand a layer to each other on the GPU alone?

Device links (expert_fn/device_link.py) still cost the host a round trip per layer: the frontend tells
the function a layer is staged and waits for its answer before its stream may wait for the function's
done event (a CUDA stream waits for the last record made *before* the wait is queued). Flags in shared
device memory need no such order: the frontend's stream writes go[l] = 1 and waits for done[l] >= 1;
the function's stream waits for go[l] >= 1, clears it, runs the layer and writes done[l] = 1. Both
sides' steps can then be one CUDA graph each, launched once a step.

Two ways to wait on the GPU are measured (gpu_flags.Flags, which took them from here; at 486e2e6 the
probe held its own copy), each in one process (two streams) and across two processes
(the flags and data in the frontend's memory, opened by CUDA IPC in the other):
- `memops`: the driver's stream memory operations (cuStreamWaitValue32 / cuStreamWriteValue32), which
  wait in the GPU's front end and hold no SM;
- `spin`: a one-program Triton kernel spinning on a volatile load (holds one SM while it waits).
For L layers of a small kernel per side, a step's time against the same kernels in one graph without
hand-offs gives the cost of one hand-off; each mode also checks that the data made the round trip.

Measured on the H200 at 486e2e6 (`run_h200.sh step-flags`, 48 layers, us per layer handed over and back
beyond a 0.14-0.16 ms step without hand-offs; the data checked correct in every mode):
                         one process   two processes, MPS   two processes, time-sliced
    memory operations        10.3             21.1                  285
    spinning kernel           3.5              5.0                 4446

    python benchmarks/experiments/step_flags_probe.py --out DIR      # ~20 s; run under MPS and without
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from kubemoe.expert_fn.gpu_flags import Flags

LAYERS, STEPS = 48, 200
MODULUS = 1_000_003  # x stays an exact small integer in float64 over any number of steps
WAYS = {"memops": lambda: Flags(torch.device("cuda"), spin=False),
        "spin": lambda: Flags(torch.device("cuda"), spin=True)}


def frontend_side(way, x, go, done, layers):  # per layer: its own kernel, hand the layer over, wait
    for layer in range(layers):
        x.add_(1)
        way.signal(go[layer])
        way.wait(done[layer])


def function_side(way, x, go, done, layers):  # per layer: wait for it, double it (mod P), hand it back
    for layer in range(layers):
        way.wait(go[layer])
        x.mul_(2).remainder_(MODULUS)
        way.signal(done[layer])


def _capture(fn, *args) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        fn(*args)
        graph.capture_end()
    torch.cuda.synchronize()
    return graph


def _expected(steps: int, layers: int) -> float:
    v = 0.0
    for _ in range(steps * layers):
        v = (v + 1) * 2 % MODULUS
    return v


def _child(way_name, x, go, done, layers, conn):
    torch.cuda.set_device(0)
    way = WAYS[way_name]()
    graph = _capture(function_side, way, x, go, done, layers)
    stream = torch.cuda.Stream()
    conn.send("ready")
    while conn.recv() != "stop":
        with torch.cuda.stream(stream):
            graph.replay()
    torch.cuda.synchronize()
    conn.send("stopped")


def bare(steps: int) -> float:
    """Both sides' kernels in one graph, no hand-offs: what a step costs without them (ms)."""
    x = torch.zeros(1, device="cuda", dtype=torch.float64)

    def both():
        for _ in range(LAYERS):
            x.add_(1)
            x.mul_(2).remainder_(MODULUS)

    graph = _capture(both)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e3


def one_process(way_name: str, steps: int) -> dict:
    way = WAYS[way_name]()
    x = torch.zeros(1, device="cuda", dtype=torch.float64)
    go = torch.zeros(LAYERS, dtype=torch.int32, device="cuda")
    done = torch.zeros(LAYERS, dtype=torch.int32, device="cuda")
    fe = _capture(frontend_side, way, x, go, done, LAYERS)
    fn = _capture(function_side, way, x, go, done, LAYERS)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    x.zero_()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        with torch.cuda.stream(s2):
            fn.replay()
        with torch.cuda.stream(s1):
            fe.replay()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / steps * 1e3
    return {"step_ms": ms, "correct": x.item() == _expected(steps, LAYERS) or f"{x.item()}"}


def two_processes(way_name: str, steps: int) -> dict:
    way = WAYS[way_name]()
    x = torch.zeros(1, device="cuda", dtype=torch.float64)
    go = torch.zeros(LAYERS, dtype=torch.int32, device="cuda")
    done = torch.zeros(LAYERS, dtype=torch.int32, device="cuda")
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_child, args=(way_name, x, go, done, LAYERS, child_end), daemon=True)
    child.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the other process did not capture its side in 120 s")
        parent.recv()
        fe = _capture(frontend_side, way, x, go, done, LAYERS)
        x.zero_()
        torch.cuda.synchronize()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            parent.send("go")
            fe.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        parent.send("stop")
        parent.recv()
        return {"step_ms": statistics.median(times), "step_ms_p90": sorted(times)[int(0.9 * len(times))],
                "correct": x.item() == _expected(steps, LAYERS) or f"{x.item()}"}
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--name", default="step_flags_probe")
    args = p.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
              "layers": LAYERS, "steps": args.steps, "bare_step_ms": bare(args.steps)}
    for way in WAYS:
        for name, fn, steps in (("one_process", one_process, args.steps), ("two_processes", two_processes, 50)):
            try:
                r = fn(way, steps)
                r["per_handoff_us"] = (r["step_ms"] - result["bare_step_ms"]) / LAYERS * 1e3
            except Exception as e:  # noqa: BLE001 - an experiment: say what failed, go on with the others
                r = {"error": f"{type(e).__name__}: {e}"}
            result[f"{way}_{name}"] = r
            print(way, name, r, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
