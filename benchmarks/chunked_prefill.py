#!/usr/bin/env python3
"""How long a long prompt stalls the running batch: chunked prefill against one-shot prefill.

`--batch` requests decode; once each has its first token, one `--long`-token prompt arrives. The
figure is the longest gap between two tokens of a running request while the long prompt is
prefilled (the stall every user sees), and the long prompt's own time to first token (what chunking
costs it). One-shot is the engine with a step budget that holds the whole prompt (what it did before
chunked prefill); chunked runs the default budget (2048 on a GPU) and a smaller one. Same engine,
same generated checkpoint (in-process experts), in one run; each mode runs `--repeats` times and
its figures are the medians (runs on the lent GPU's host vary by 10-15%).

  python benchmarks/chunked_prefill.py                          # this CPU, tiny Mixtral
  python benchmarks/chunked_prefill.py --device cuda --preset mixtral-4l --layers 2   # on the H200
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_trace  # noqa: E402
from common import Goal, write_results  # noqa: E402
from frontend_decode import add_model_arguments, cut_preset, engine_thread_profile  # noqa: E402

from kubemoe.bundles import bundles_by_count  # noqa: E402
from kubemoe.frontend.app import Frontend, FrontendConfig  # noqa: E402
from kubemoe.frontend.sampling import SamplingParams  # noqa: E402
from kubemoe.frontend.scheduler import DEFAULT_STEP_TOKENS  # noqa: E402
from kubemoe.routing_table import LOCAL, table_for_bundles  # noqa: E402
from kubemoe.synth import make_checkpoint  # noqa: E402


def stall(fe: Frontend, batch: int, long: int, decode_tokens: int, vocab: int,
          trace: Path | None = None) -> tuple[Callable[[], dict], Callable[[], dict]]:
    """The running requests' longest inter-token gap while the long prompt is prefilled, and its TTFT:
    after a warm-up run, (measure, profiled). Each call of `measure` is one run -> its figures and the
    engine's steps around the stall; `profiled` is one run with the engine thread under cProfile
    (`engine_thread_top`) and, with `trace`, a torch.profiler window over each prompt-chunk step, written
    there as chrome traces and summarised (torch_trace.idle) under `chunk_step_traces`."""
    gen = torch.Generator().manual_seed(2)
    short = torch.randint(0, vocab, (batch, 16), generator=gen).tolist()
    prompt = torch.randint(0, vocab, (long,), generator=gen).tolist()
    times: list[list[float]] = [[] for _ in range(batch)]
    steps: list[tuple[float, float, int, list[int], dict]] = []  # (start, end, decode rows, chunk tokens, phases)
    engine_step, prefill_logits = fe.engine.step, fe.engine._prefill_logits
    cuda = fe.engine.device.type == "cuda"
    launched: list = []  # the step's prompt pass: (host start, host end, device events) of _prefill_logits

    def timed_pass(*args, **kwargs):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
        start = time.perf_counter()
        if events:
            events[0].record()
        try:
            return prefill_logits(*args, **kwargs)
        finally:
            if events:
                events[1].record()
            launched.append((start, time.perf_counter(), events))

    def phases(start: float, end: float) -> dict:
        """Where a prompt step's wall time went: before its pass was launched, launching it (host), the
        pass on the device (CUDA events around the launch), and after the launch returned (waiting for
        the pass, sampling, joining the batch)."""
        if not launched:
            return {}
        a, b, events = launched[-1]
        row = {"before_ms": (a - start) * 1e3, "launch_ms": (b - a) * 1e3, "after_ms": (end - b) * 1e3}
        if events:
            events[1].synchronize()
            row["pass_device_ms"] = events[0].elapsed_time(events[1])
        return {k: round(v, 3) for k, v in row.items()}

    traced: list[dict] = []
    tracing = False

    def timed(plan):
        start = time.perf_counter()
        launched.clear()
        try:
            if tracing and plan.chunks:
                path = trace / f"chunk-step-{len(traced)}.json"  # type: ignore[operator]
                with torch_trace.window(path):
                    engine_step(plan)
                traced.append({"chunk_tokens": [c.tokens for c in plan.chunks], **torch_trace.idle(path)})
            else:
                engine_step(plan)
        finally:
            end = time.perf_counter()
            steps.append((start, end, len(plan.decode), [c.tokens for c in plan.chunks], phases(start, end)))

    fe.engine.step, fe.engine._prefill_logits = timed, timed_pass
    async def running(i, first: asyncio.Event):
        async for delta in fe.engine.generate(f"run-{i}", short[i], SamplingParams(temperature=0, max_tokens=decode_tokens)):
            times[i].append(time.perf_counter())
            first.set()

    async def run():
        steps.clear()
        firsts = [asyncio.Event() for _ in range(batch)]
        tasks = [asyncio.ensure_future(running(i, firsts[i])) for i in range(batch)]
        for first in firsts:
            await first.wait()
        sent = time.perf_counter()
        async for _ in fe.engine.generate("long", prompt, SamplingParams(temperature=0, max_tokens=1)):
            first_token = time.perf_counter()
        await asyncio.gather(*tasks)
        gaps = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b > sent and a < first_token]
        steady = [b - a for ts in times for a, b in zip(ts, ts[1:]) if a > first_token]
        # the engine's steps from the last before the prompt came to the first after its first token: what
        # the stall is made of (ms from its arrival; a step launched ahead returns before its pass ends)
        window = [s for s in steps if s[1] > sent - 0.005 and s[0] < first_token + 0.005]
        return {"max_gap_ms": max(gaps) * 1e3, "steady_gap_ms": statistics.median(steady) * 1e3,
                "long_ttft_ms": (first_token - sent) * 1e3,
                "steps": [{"start_ms": round((a - sent) * 1e3, 3), "wall_ms": round((b - a) * 1e3, 3),
                           "decode_rows": rows, "chunk_tokens": chunks, **parts}
                          for a, b, rows, chunks, parts in window]}

    def measure() -> dict:  # unprofiled: cProfile would slow every Python call of the engine's steps
        return asyncio.run(run())

    def profiled() -> dict:
        nonlocal tracing
        tracing = trace is not None
        if trace is not None:
            trace.mkdir(parents=True, exist_ok=True)
        with engine_thread_profile(fe.engine) as top:
            asyncio.run(run())
        tracing = False
        return {"engine_thread_top": top, **({"chunk_step_traces": traced} if trace is not None else {})}

    asyncio.run(run())  # warm-up
    return measure, profiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--batch", type=int, default=8, help="requests decoding when the long prompt arrives")
    parser.add_argument("--long", type=int, default=4000, help="the long prompt's tokens (cut to the context)")
    parser.add_argument("--small-budget", type=int, default=512, help="the smaller chunked budget compared")
    parser.add_argument("--repeats", type=int, default=5, help="measured runs of each mode; the figures are their medians")
    parser.add_argument("--switch-interval", type=float,
                        help="sys.setswitchinterval for the run (seconds; Python's default 0.005): how long the engine "
                             "thread may wait for the GIL while the output and asyncio threads hold it")
    parser.add_argument("--trace", type=Path, help="a folder for torch.profiler traces of the profiled run's chunk steps")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    preset = cut_preset(args.arch, args.preset, args.layers)
    context = preset.config.get("max_position_embeddings", 4096)
    args.long = min(args.long, context - 2)
    default_budget = DEFAULT_STEP_TOKENS.get(device.type, DEFAULT_STEP_TOKENS["cpu"])
    budgets = {"oneshot": args.long + args.batch, "chunked": default_budget, "chunked_small": args.small_budget}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(preset, Path(tmp) / preset.name, progress=False)
        for name, budget in budgets.items():
            fe = Frontend(FrontendConfig(checkpoint=ckpt, device=args.device, predictor="none", max_step_tokens=budget))
            fe.engine.eos_ids = set()  # every running request decodes through the whole window
            bundles = bundles_by_count(fe.adapter.moe_layers, fe.adapter.num_experts, 2)
            fe.set_routing_table(table_for_bundles(fe.model_id, bundles, {b.name: [LOCAL] for b in bundles}))
            vocab = fe.model.get_input_embeddings().num_embeddings
            # enough decode tokens to outlast the one-shot prefill several times over
            decode_tokens = min(context - 20, 64 if device.type == "cuda" else 24)
            measure, profiled = stall(fe, args.batch, args.long, decode_tokens, vocab,
                                      args.trace / name if args.trace else None)
            runs = [measure() for _ in range(args.repeats)]
            middle = sorted(runs, key=lambda r: r["max_gap_ms"])[len(runs) // 2]
            rows.append({"mode": name, "max_step_tokens": budget, "batch": args.batch, "long_prompt": args.long,
                         **{k: statistics.median(r[k] for r in runs) for k in ("max_gap_ms", "steady_gap_ms", "long_ttft_ms")},
                         "steps": middle["steps"], "runs": runs, **profiled()})
            # One frontend at a time: another's threads, idle or not, would contend for the GIL with this
            # engine's host-bound prompt steps (with all three alive, 2040-token chunk steps took 6.5-6.8 ms to
            # launch on the H200 host, 4.5-5.3 with one)
            fe.close()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    by = {r["mode"]: r for r in rows}
    for r in rows:
        print(f"{r['mode']:>14} budget {r['max_step_tokens']:>5}: longest gap {r['max_gap_ms']:8.1f} ms "
              f"(steady {r['steady_gap_ms']:6.1f} ms), long prompt TTFT {r['long_ttft_ms']:8.1f} ms")
        for step in r["steps"]:
            print(f"{'':>16}step at {step['start_ms']:8.2f} ms: {step['wall_ms']:7.2f} ms, "
                  f"{step['decode_rows']} decode rows, chunks {step['chunk_tokens']}"
                  + (f" (before the pass {step['before_ms']:.2f}, launching it {step['launch_ms']:.2f}, on the device "
                     f"{step.get('pass_device_ms', float('nan')):.2f}, after {step['after_ms']:.2f} ms)"
                     if "launch_ms" in step else ""))
        for t in r.get("chunk_step_traces", []):
            print(f"{'':>16}traced step, chunks {t['chunk_tokens']}: GPU busy {t.get('busy_us', 0) / 1e3:.2f} of "
                  f"{t.get('span_us', 0) / 1e3:.2f} ms; longest idle gaps (us, host op): "
                  + ", ".join(f"{g['us']:.0f} {g['host']}" for g in t.get("idle_gaps", [])[:6]))
    goals = {}
    if device.type == "cuda":
        goals["prefill_stall_chunked_vs_oneshot_h200"] = Goal(by["chunked"]["max_gap_ms"] / by["oneshot"]["max_gap_ms"],
                                                              "<= 0.6")
        goals["long_ttft_chunked_vs_oneshot_h200"] = Goal(by["chunked"]["long_ttft_ms"] / by["oneshot"]["long_ttft_ms"],
                                                          "<= 1.2")
    write_results("chunked_prefill", device, rows, goals, out=Path(args.out),
                  checkpoint={"arch": preset.arch, "preset": preset.name, "dtype": preset.dtype},
                  switch_interval_s=sys.getswitchinterval(),
                  repeats=args.repeats,
                  method=f"{args.batch} requests decoding, one {args.long}-token prompt arriving; the longest gap "
                         "between two tokens of a running request while it is prefilled, and its TTFT; after a warm-up "
                         f"run, the median of {args.repeats} runs per mode (each in `runs`; `steps` from the run of the "
                         "median gap), then one with the engine thread profiled "
                         "(engine_thread_top); in-process experts; one-shot = a step budget holding the whole prompt")


if __name__ == "__main__":
    main()
