#!/usr/bin/env python3
"""Where a disaggregated decode step's time goes (issue 17): the engine with its experts in expert-function
processes through shared memory, as frontend_decode.py's `disaggregated_shm` column runs it.

On the H200 at 3241e6f a 2-layer Mixtral step took 13.2 ms at batch 32 and 7.6 ms at batch 1 against 2.85
and 1.3 ms in process, while expert_fn_overhead.py measures about 0.3 ms per call beyond the expert's
compute. This splits a step's remote layers (each a cut in the decode program):
- `engine`: the engine's step, decode pass and output handling (engine_step_probe.engine_split), plus,
  per remote layer, the dispatcher's pieces: `run_sorted` (the layer's host work, the cut: it first
  waits for the router and the sort on the device), within it `_submit` (the calls planned and handed to
  the I/O loop), `wait` (until every call is back), `gather` (replies not already in place put there),
  and inside the I/O loop `forward` (one call, start to reply) and `hop` (from the hand-over to the
  call's start);
- `direct_call_ms`: the same call shapes made from this thread through the dispatcher's client, one
  at a time: the call alone, no engine, no graph;
- each again with the frontend's mapping of the segments left pageable (`unpinned`), with a 0.2 ms GIL
  switch interval, and without CUDA graphs;
- `profile`: torch.profiler's top host and device ops over a few engine steps at the largest batch.

  python benchmarks/experiments/disagg_step_probe.py --device cuda --preset mixtral-4l --layers 2  # $OUT/disagg_step_probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_step_probe import engine_split  # noqa: E402
from frontend_decode import add_model_arguments, cut_preset, engine_decode  # noqa: E402

from kubemoe.bundles import bundles_by_count  # noqa: E402
from kubemoe.expert_fn.client import ExpertClient  # noqa: E402
from kubemoe.expert_fn.shm import Segment  # noqa: E402
from kubemoe.frontend.app import Frontend, FrontendConfig  # noqa: E402
from kubemoe.frontend.embedded import expert_processes  # noqa: E402
from kubemoe.routing_table import table_for_bundles  # noqa: E402
from kubemoe.synth import make_checkpoint  # noqa: E402


@contextlib.contextmanager
def dispatcher_spans(fe: Frontend):
    """Per remote layer: the dispatcher's pieces and, in the I/O loop, each call's hop and span (ms)."""
    d, spans = fe.dispatcher, {"_run_sorted": [], "_submit": [], "wait": [], "gather": [], "forward": [], "hop": []}
    handed: list[float] = []
    run_sorted, call, gather, submit = d._run_sorted, ExpertClient.call, d._gather, d._submit

    def timed_run_sorted(*args, **kwargs):
        start = time.perf_counter()
        try:
            return run_sorted(*args, **kwargs)
        finally:
            spans["_run_sorted"].append((time.perf_counter() - start) * 1e3)

    def timed_submit(*args, **kwargs):
        start = time.perf_counter()
        try:
            return submit(*args, **kwargs)
        finally:
            handed.append(time.perf_counter())
            spans["_submit"].append((handed[-1] - start) * 1e3)

    def timed_gather(calls, *args, **kwargs):
        start = time.perf_counter()
        calls.exception()  # waits for the calls, raises nothing
        mid = time.perf_counter()
        try:
            return gather(calls, *args, **kwargs)
        finally:
            spans["wait"].append((mid - start) * 1e3)
            spans["gather"].append((time.perf_counter() - mid) * 1e3)

    async def timed_call(self, *args, **kwargs):
        start = time.perf_counter()
        if handed:
            spans["hop"].append((start - handed[-1]) * 1e3)
        try:
            return await call(self, *args, **kwargs)
        finally:
            spans["forward"].append((time.perf_counter() - start) * 1e3)

    ExpertClient.call = timed_call
    d._gather, d._submit, d._run_sorted = timed_gather, timed_submit, timed_run_sorted
    try:
        yield spans
    finally:
        ExpertClient.call = call
        del d._gather, d._submit, d._run_sorted


def engine_row(fe: Frontend, batch: int, args, vocab: int) -> dict:
    with dispatcher_spans(fe) as spans:
        row = engine_split(fe, batch, args.prompt, args.steps, 5, vocab)
    # The last steps are decode only: each has a span per remote layer, and a call per function in it.
    layers = len(fe.adapter.moe_layers) * args.steps
    for name, values in spans.items():
        tail = values[-layers * (args.functions if name in ("forward", "hop") else 1):]
        row[f"layer_{name.strip('_')}_ms"] = statistics.median(tail) if tail else None
    return row


def direct_calls(fe: Frontend, batch: int, top_k: int, repeats: int = 50) -> dict:
    """Each function's share of a layer's tokens (batch * top_k / functions rows), called from this
    thread through the dispatcher's own client and I/O loop, one call at a time -> median ms."""
    d = fe.dispatcher
    layer = fe.adapter.moe_layers[0]
    table = d._routes
    by_address: dict[str, list[int]] = {}
    for (lay, expert), route in table.routes.items():
        if lay == layer:
            by_address.setdefault(route.addresses[0], []).append(expert)
    rows = max(1, batch * top_k // len(by_address))
    out = {}
    for address, experts in sorted(by_address.items()):
        client = d._client(address)
        counts = [rows // len(experts) + (i < rows % len(experts)) for i in range(len(experts))]
        keep = [(e, c) for e, c in zip(experts, counts) if c]
        x = torch.randn(rows, fe.model.config.hidden_size, dtype=fe.model.dtype, device=fe.engine.device)
        times = []
        for i in range(repeats + 5):
            start = time.perf_counter()
            d.io.run(client.forward(layer, [e for e, _ in keep], [c for _, c in keep], x, request_id=f"direct-{i}",
                                    timeout=30))
            if i >= 5:
                times.append((time.perf_counter() - start) * 1e3)
        out[address] = {"rows": rows, "experts": len(keep), "median_ms": statistics.median(times)}
    return out


def profile_top(fe: Frontend, batch: int, prompt: int, vocab: int, top: int = 15) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine_decode(fe, batch, prompt, 5, 0, vocab)
    events = prof.key_averages()

    def rows(key):
        return [{"name": e.key[:120], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                 "self_device_ms": getattr(e, "self_device_time_total", 0.0) / 1e3}
                for e in sorted(events, key=key)[:top]]
    return {"by_host": rows(lambda e: -e.self_cpu_time_total),
            "by_device": rows(lambda e: -getattr(e, "self_device_time_total", 0.0))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--functions", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    preset = cut_preset(args.arch, args.preset, args.layers)
    batches = [int(b) for b in args.batches.split(",")]
    pin_segment = Segment.pin
    result: dict = {"device": args.device, "preset": preset.name, "prompt": args.prompt, "functions": args.functions}
    with tempfile.TemporaryDirectory() as tmp, \
            tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as shm:
        ckpt = make_checkpoint(preset, Path(tmp) / preset.name, progress=False)
        fe = Frontend(FrontendConfig(checkpoint=ckpt, device=args.device, max_batch=max(batches)))
        bundles = bundles_by_count(fe.adapter.moe_layers, fe.adapter.num_experts, args.functions)
        model_id = fe.model_id
        fe.close()
        with expert_processes(ckpt, bundles, model_id, ready_timeout=600, shm_dir=Path(shm)) as experts:
            table = table_for_bundles(model_id, bundles, experts.addresses, version=2)
            for variant, graphs, switch, pin in (("default", True, None, True), ("unpinned", True, None, False),
                                                 ("switch_0.2ms", True, 2e-4, True), ("no_graphs", False, None, True)):
                if not pin:  # this process's mapping of the segments stays pageable (the functions pin theirs)
                    Segment.pin = lambda self: bool(setattr(self, "_pinned", False))
                fe = Frontend(FrontendConfig(checkpoint=ckpt, device=args.device, shm_dir=Path(shm),
                                             max_batch=max(batches), cuda_graphs=graphs, device_links=False))
                fe.set_routing_table(table)
                fe.dispatcher.apply_pending()
                vocab = fe.model.get_input_embeddings().num_embeddings
                before = sys.getswitchinterval()
                if switch:
                    sys.setswitchinterval(switch)
                try:
                    rows = []
                    for b in batches:
                        row = engine_row(fe, b, args, vocab)
                        row["direct_call_ms"] = direct_calls(fe, b, fe.adapter.top_k)
                        print(variant, json.dumps(row), flush=True)
                        rows.append(row)
                    result[variant] = rows
                    if variant == "default" and args.device == "cuda":
                        result["profile"] = profile_top(fe, batches[-1], args.prompt, vocab)
                        print(json.dumps(result["profile"], indent=1), flush=True)
                finally:
                    sys.setswitchinterval(before)
                    fe.close()
                    Segment.pin = pin_segment
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "disagg_step_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
