#!/usr/bin/env python3
"""Decode throughput: transformers monolithic vs kubemoe (in-process experts) vs kubemoe over gRPC.

All run the same decode loop (one token per sequence per step, a warm KV cache) on the same
checkpoint, batch 1, 8 and 32, and report tokens/s, time per output token, the ratio to the
monolithic model, and for kubemoe the share of the step spent in expert dispatch. Over gRPC three
ways: tensors inline, inline with two micro-batches (TBO), and through shared memory (the expert
functions on the frontend's node, as `kubemoe serve` runs them).

  python benchmarks/frontend_decode.py                       # this CPU, tiny Mixtral
  python benchmarks/frontend_decode.py --device cuda --preset mixtral-4l --layers 2   # on the H200
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Goal, write_results  # noqa: E402

from kubemoe.bundles import bundles_by_count  # noqa: E402
from kubemoe.frontend.app import Frontend, FrontendConfig  # noqa: E402
from kubemoe.frontend.embedded import expert_processes  # noqa: E402
from kubemoe.routing_table import LOCAL, table_for_bundles  # noqa: E402
from kubemoe.presets import Preset, get_preset  # noqa: E402
from kubemoe.synth import make_checkpoint  # noqa: E402

PROMPT_LEN = 32


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_rate(model, batch: int, steps: int, warmup: int, device, vocab: int, micro: int = 1) -> dict:
    """Seconds per decode step for `batch` sequences after a PROMPT_LEN-token prefill.

    With micro=2 the batch is split in two halves with caches of their own, decoded by two threads at
    once, as the engine's two-batch overlap does (frontend/engine.py).
    """
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    sizes = [batch // micro + (i < batch % micro) for i in range(micro)]
    sizes = [n for n in sizes if n]
    caches = [DynamicCache() for _ in sizes]
    with torch.inference_mode():
        logits = [model(input_ids=torch.randint(0, vocab, (n, PROMPT_LEN), generator=gen).to(device), cache=c,
                        use_cache=True).logits[:, -1] for n, c in zip(sizes, caches)]

    def one(i):
        with torch.inference_mode():
            return model(input_ids=logits[i].argmax(-1, keepdim=True), cache=caches[i], use_cache=True).logits[:, -1]

    pool = ThreadPoolExecutor(len(sizes))
    times = []
    for step in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        logits = list(pool.map(one, range(len(sizes)))) if len(sizes) > 1 else [one(0)]
        sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    pool.shutdown()
    times.sort()
    step_s = times[len(times) // 2]  # median: robust to the odd hiccup
    return {"batch": batch, "micro_batches": len(sizes), "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
            "tpot_ms": step_s * 1e3}


class DispatchTimer:
    """Wall time spent inside the dispatcher's layer calls (expert dispatch, including waiting)."""

    def __init__(self, dispatcher):
        self.total = 0.0
        inner = dispatcher.run_layer

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        dispatcher.run_layer = timed


def run_kubemoe(fe: Frontend, table, batches, steps, warmup, device, vocab, micro=1) -> list[dict]:
    fe.set_routing_table(table)
    fe.dispatcher.apply_pending()
    timer = DispatchTimer(fe.dispatcher)
    rows = []
    for b in batches:
        timer.total = 0.0
        row = decode_rate(fe.model, b, steps, warmup, device, vocab, micro)
        # share of a step's wall time spent inside expert dispatch (summed over micro-batches)
        timer.total = 0.0
        start = time.perf_counter()
        decode_rate(fe.model, b, steps, 0, device, vocab, micro)
        row["dispatch_share"] = timer.total / (time.perf_counter() - start)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--arch", default="mixtral")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--experts", type=int, default=2, help="expert-function processes for the gRPC mode")
    parser.add_argument("--predictor", default="router", help="the frontends' --predictor (router, none, a file)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]

    preset = get_preset(args.arch, args.preset)
    if args.layers:
        preset = Preset(preset.arch, f"{preset.name}-{args.layers}l", {**preset.config, "num_hidden_layers": args.layers},
                        preset.dtype, preset.shard_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(preset, Path(tmp) / preset.name, progress=False)
        checkpoint = {"arch": preset.arch, "preset": preset.name, "dtype": preset.dtype, "config": dict(preset.config)}
        rows = []
        from transformers import AutoModelForCausalLM

        mono = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, preset.dtype)).to(device).eval()
        vocab = mono.config.vocab_size
        mono_rows = [decode_rate(mono, b, args.steps, args.warmup, device, vocab) for b in batches]
        del mono
        if device.type == "cuda":
            torch.cuda.empty_cache()

        fe = Frontend(FrontendConfig(checkpoint=ckpt, device=args.device, predictor=args.predictor))
        bundles = bundles_by_count(fe.adapter.moe_layers, fe.adapter.num_experts, args.experts)
        local_rows = run_kubemoe(fe, table_for_bundles(fe.model_id, bundles, {b.name: [LOCAL] for b in bundles}),
                                 batches, args.steps, args.warmup, device, vocab)
        # The folder frontend and expert functions share: tmpfs where there is one, as /dev/shm is in
        # production (a GPU expert function can pin only tmpfs segments; others take staged copies).
        with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else tmp) as shm_folder, \
                expert_processes(ckpt, bundles, fe.model_id, ready_timeout=600, shm_dir=Path(shm_folder)) as experts:
            shm_dir = Path(shm_folder)
            remote_table = table_for_bundles(fe.model_id, bundles, experts.addresses, version=2)
            grpc_rows = run_kubemoe(fe, remote_table, batches, args.steps, args.warmup, device, vocab)
            tbo_rows = run_kubemoe(fe, remote_table, batches, args.steps, args.warmup, device, vocab, micro=2)
            fe.close()
            fe = Frontend(FrontendConfig(checkpoint=ckpt, device=args.device, shm_dir=shm_dir, predictor=args.predictor))
            shm_rows = run_kubemoe(fe, remote_table, batches, args.steps, args.warmup, device, vocab)
            if not all(client.shared_memory for client in fe.dispatcher._clients.values()):
                raise RuntimeError(f"the expert functions did not attach segments in {shm_dir}")
            fe.close()  # ends its streams, so the expert functions stop at once

    print(f"{'batch':>5} {'monolithic':>10} {'in-process':>10} {'gRPC':>8} {'gRPC+TBO':>8} {'gRPC+shm':>8} "
          f"{'in-proc/mono':>12} {'gRPC/mono':>9} {'TBO/mono':>8} {'shm/mono':>8} {'gRPC dispatch':>13}   (tokens/s)")
    for m, l, g, t, h in zip(mono_rows, local_rows, grpc_rows, tbo_rows, shm_rows):
        row = {"batch": m["batch"], "monolithic": m, "inprocess": l, "grpc": g, "grpc_tbo": t, "grpc_shm": h,
               "inprocess_vs_monolithic": l["tokens_per_s"] / m["tokens_per_s"],
               "grpc_plain_vs_monolithic": g["tokens_per_s"] / m["tokens_per_s"],
               "grpc_tbo_vs_monolithic": t["tokens_per_s"] / m["tokens_per_s"],
               "grpc_shm_vs_monolithic": h["tokens_per_s"] / m["tokens_per_s"]}
        # kubemoe over gRPC runs as the engine would be configured, or finds itself placed: the best one
        row["grpc_vs_monolithic"] = max(row["grpc_plain_vs_monolithic"], row["grpc_tbo_vs_monolithic"],
                                        row["grpc_shm_vs_monolithic"])
        rows.append(row)
        print(f"{m['batch']:>5} {m['tokens_per_s']:>10.1f} {l['tokens_per_s']:>10.1f} {g['tokens_per_s']:>8.1f} "
              f"{t['tokens_per_s']:>8.1f} {h['tokens_per_s']:>8.1f} {row['inprocess_vs_monolithic']:>12.2f} "
              f"{row['grpc_plain_vs_monolithic']:>9.2f} {row['grpc_tbo_vs_monolithic']:>8.2f} "
              f"{row['grpc_shm_vs_monolithic']:>8.2f} {g['dispatch_share']:>13.0%}")
    b32 = next((r for r in rows if r["batch"] == 32), None)
    goals = {}
    if b32 and device.type == "cuda":
        goals["grpc_vs_monolithic_b32_h200"] = Goal(b32["grpc_vs_monolithic"], ">= 0.8")
    path = write_results("frontend", device, rows, goals, out=Path(args.out), checkpoint=checkpoint,
                         predictor=args.predictor,
                         method=f"median decode step of {args.steps} after {args.warmup} warm-up steps, "
                                f"prompt {PROMPT_LEN} tokens, greedy, {args.experts} expert-function processes")
    print(f"wrote {path}")
    print(json.dumps({k: g.as_dict() for k, g in goals.items()}, indent=2))


if __name__ == "__main__":
    main()
