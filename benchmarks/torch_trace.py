"""A torch.profiler window as a chrome trace (CPU ops, CUDA runtime calls, GPU kernels and copies), for
looking at where a round's microseconds go on a GPU host: which call the CPU spends them in, and
when the GPU is idle waiting for the CPU. Open the file in chrome://tracing or Perfetto, or let
`gaps` summarise it.

    with torch_trace.window(path): ...            # writes path (chrome trace JSON)
    python benchmarks/torch_trace.py TRACE.json   # median microseconds per CUDA call, GPU op and gap
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


@contextlib.contextmanager
def window(path: Path):
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        yield
    if cuda:
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))


def _events(path: Path) -> tuple[list[dict], list[dict]]:
    """A trace's complete events, and those of them that ran on the GPU in start order."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    return events, gpu


def gaps(path: Path) -> dict:
    """Median durations (us) of each CUDA runtime call and each GPU op, and of the GPU's idle gaps
    between consecutive GPU ops (a gap over 1 ms is taken as the time between rounds)."""
    events, gpu = _events(path)
    durations: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver", "kernel", "gpu_memcpy", "cpu_op"):
            durations[f"{e['cat']}: {e['name'][:60]}"].append(e["dur"])
    idle = defaultdict(list)
    for a, b in zip(gpu, gpu[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap < 1000:
            idle[f"{a['name'][:30]} -> {b['name'][:30]}"].append(gap)
    return {"calls": {k: (len(v), round(statistics.median(v), 1)) for k, v in sorted(durations.items())},
            "gpu_idle_between": {k: (len(v), round(statistics.median(v), 1)) for k, v in idle.items()}}


def idle(path: Path, min_us: float = 50.0, top: int = 12) -> dict:
    """The GPU's busy time against the window's span, its idle gaps of `min_us` or more (longest first)
    with the host op that was running when each began (innermost CPU op; what the GPU waited for), and
    the kernels taking the most device time."""
    events, gpu = _events(path)
    ops = sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime")),
                 key=lambda e: e["ts"])
    if not gpu:
        return {"gpu_ops": 0}

    def running(at: float) -> str:  # the innermost host op spanning `at`
        inner = [e for e in ops if e["ts"] <= at <= e["ts"] + e["dur"]]
        return min(inner, key=lambda e: e["dur"])["name"][:80] if inner else "-"

    busy, end, gaps = 0.0, gpu[0]["ts"], []
    for e in gpu:
        if e["ts"] - end >= min_us:
            gaps.append({"us": round(e["ts"] - end, 1), "before": e["name"][:60], "host": running(end)})
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in gpu:
        kernels[e["name"][:80]].append(e["dur"])
    return {"gpu_ops": len(gpu), "span_us": round(end - gpu[0]["ts"], 1), "busy_us": round(busy, 1),
            "idle_gaps": sorted(gaps, key=lambda g: -g["us"])[:top],
            "kernels": [{"kernel": k, "calls": len(v), "us": round(sum(v), 1)}
                        for k, v in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]]}


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(name)
        for section, rows in gaps(Path(name)).items():
            print(f"  {section}: (count, median us)")
            for key, (count, median) in rows.items():
                print(f"    {median:8.1f}  x{count:<5d} {key}")
