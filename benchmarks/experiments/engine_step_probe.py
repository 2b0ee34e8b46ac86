#!/usr/bin/env python3
"""Where an engine decode step's time goes beyond the model's forward pass (issue 17).

On the H200 at 561a154, batch 32: the forward pass alone in a loop took 4.2 ms a step, the engine as served
9.0 ms. This splits the difference, per batch size, in-process experts:
- `forward`: frontend_decode's `model` column (the forward pass alone, synchronised each step);
- `forward_engine_inputs`: the same forward fed what the engine feeds it (a batch joined row by row into
  its cache rows, the positions and the mask made from them each step), launched op by op;
- `engine`: served as frontend_decode serves it; the engine thread's step split into the decode pass
  (`_decode`), the output handling (`_advance_all`: the tokens read back, detokenised, streamed) and
  the rest, each a median over the measured steps;
- `engine_device_busy_ms_per_step`: torch.profiler's device time over engine decode steps, per step.

  python benchmarks/experiments/engine_step_probe.py --device cuda --preset mixtral-4l --layers 2  # $OUT/engine_step_probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from frontend_decode import add_model_arguments, cut_preset, decode_rate, engine_decode, sync  # noqa: E402

from kubemoe.bundles import bundles_by_count  # noqa: E402
from kubemoe.frontend.app import Frontend, FrontendConfig  # noqa: E402
from kubemoe.frontend.batch import BatchState, split_rows  # noqa: E402
from kubemoe.routing_table import LOCAL, table_for_bundles  # noqa: E402
from kubemoe.synth import make_checkpoint  # noqa: E402


@torch.inference_mode()
def forward_engine_inputs(fe: Frontend, batch: int, prompt: int, steps: int, device, vocab: int) -> float:
    """Median ms of a decode step fed as Engine._decode feeds it (rows joined into a BatchState)."""
    from transformers import DynamicCache

    model = fe.model
    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    cache = DynamicCache()
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
    state = BatchState(fe.engine.masks)
    for row in split_rows(cache, batch):
        state.join(row, prompt)
    times = []
    for step in range(steps + 3):
        sync(device)
        start = time.perf_counter()
        tokens = logits.argmax(-1).tolist()
        logits = model(**state.decode_inputs(tokens), use_cache=True).logits[:, -1]
        sync(device)
        if step >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@contextlib.contextmanager
def timed_calls(obj, names) -> Iterator[dict[str, list[float]]]:
    """While the block runs, each call of obj's methods `names` is timed: yields {name: [ms per call]}."""
    spans: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        method = getattr(obj, name)

        @functools.wraps(method)
        def timed(*args, _method=method, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spans[_name].append((time.perf_counter() - start) * 1e3)

        setattr(obj, name, timed)
    try:
        yield spans
    finally:
        for name in names:
            delattr(obj, name)  # the class's methods again


def engine_split(fe: Frontend, batch: int, prompt: int, steps: int, warmup: int, vocab: int) -> dict:
    """engine_decode with the engine thread's step, decode pass and output handling timed."""
    with timed_calls(fe.engine, ("step", "_decode", "_advance_all")) as spans:
        row = engine_decode(fe, batch, prompt, steps, warmup, vocab)
    # The last `steps` steps are decode-only (every request decodes through the window).
    last = {name: values[-steps:] for name, values in spans.items()}
    row.update({f"in_thread_{name.strip('_')}_ms": statistics.median(values) for name, values in last.items()})
    row["in_thread_other_ms"] = row["in_thread_step_ms"] - row["in_thread_decode_ms"] - row["in_thread_advance_all_ms"]
    return row


def engine_device_busy(fe: Frontend, batch: int, prompt: int, steps: int, vocab: int, device) -> float | None:
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    decode_steps = []
    step = fe.engine.step

    def counted(plan):
        decode_steps.append(not plan.chunks)
        return step(plan)

    fe.engine.step = counted
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine_decode(fe, batch, prompt, steps, 0, vocab)
    finally:
        del fe.engine.step
    busy_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages())
    return busy_us / 1e3 / max(len(decode_steps), 1)  # prefill included: an upper bound per step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--switch-interval-ms", type=float, default=0.0,
                        help="sys.setswitchinterval for the run (0: Python's default, 5 ms): how long a thread that "
                             "wants the GIL waits before the holder must drop it")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    device = torch.device(args.device)
    preset = cut_preset(args.arch, args.preset, args.layers)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(preset, Path(tmp) / preset.name, progress=False)
        batches = [int(b) for b in args.batches.split(",")]
        fe = Frontend(FrontendConfig(checkpoint=ckpt, device=args.device, predictor="router", max_batch=max(batches)))
        bundles = bundles_by_count(fe.adapter.moe_layers, fe.adapter.num_experts, 2)
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, {b.name: [LOCAL] for b in bundles}))
        fe.dispatcher.apply_pending()
        vocab = fe.model.get_input_embeddings().num_embeddings
        try:
            for b in batches:
                row = {"batch": b, "forward_ms": decode_rate(fe.model, b, args.prompt, args.steps, 5, device, vocab)["step_ms"],
                       "forward_engine_inputs_ms": forward_engine_inputs(fe, b, args.prompt, args.steps, device, vocab),
                       "engine": engine_split(fe, b, args.prompt, args.steps, 5, vocab),
                       "engine_device_busy_ms_per_step": engine_device_busy(fe, b, args.prompt, 5, vocab, device)}
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            fe.close()
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"engine_step_probe{'_switch' + str(args.switch_interval_ms) if args.switch_interval_ms else ''}.json"
    (args.out / name).write_text(json.dumps({"device": str(device), "preset": preset.name, "prompt": args.prompt,
                                             "switch_interval_s": sys.getswitchinterval(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
