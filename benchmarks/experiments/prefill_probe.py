#!/usr/bin/env python3
"""Where a prefill pass's time goes (issue 17 item 3): chunked prefill stalled the running batch for
much longer than its tokens' work (chunked_prefill_h200.json at 4abb7db: a 512-token chunk 7 ms, a
2048-token one 12 ms, the whole 4000-token prompt 16.5 ms: about 5.6 ms a pass whatever its size).

For prompts of several lengths, one pass as the engine runs a chunk (a fresh cache; and a second
chunk on the cache the first left): host wall time and the device time between CUDA events; then a
torch.profiler window over a short pass: the host's top ops by their own CPU time, the device's top
kernels, and the device's busy time against the pass's wall time.

At 528b36b on the H200 (Mixtral sizes, 2 layers): 4.8 / 5.5 / 9.2 / 14.8 ms for 64 / 512 / 2048 / 4000
tokens (a second 2048-token chunk on the first's cache 10.9 ms), wall time equal to device time: the
host launching the pass op by op (~110 kernels; 4.5 ms whatever the length) is the floor, not the
tokens' work (a 512-token pass's kernels 3.5 ms, 2.6 of them torch's grouped GEMM at about half the
HBM bandwidth its weights need). A 2048-token chunk therefore costs 0.62x the whole prompt, and two
of them 1.36x: chunking pays the floor once per chunk.

  python benchmarks/experiments/prefill_probe.py --device cuda --preset mixtral-4l --layers 2   # $OUT/prefill_probe.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from frontend_decode import add_model_arguments, cut_preset  # noqa: E402

from kubemoe.bundles import bundles_by_count  # noqa: E402
from kubemoe.frontend.app import Frontend, FrontendConfig  # noqa: E402
from kubemoe.routing_table import LOCAL, table_for_bundles  # noqa: E402
from kubemoe.synth import make_checkpoint  # noqa: E402


def timed(fn, repeats: int = 5) -> dict:
    """Median host wall ms and device ms (CUDA events) of fn(), after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    wall, device = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        end.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
        device.append(start.elapsed_time(end))
    return {"wall_ms": statistics.median(wall), "device_ms": statistics.median(device)}


@torch.inference_mode()
def main() -> None:
    from transformers import DynamicCache

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--lengths", default="64,512,2048,4000")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    preset = cut_preset(args.arch, args.preset, args.layers)
    result: dict = {"preset": preset.name, "passes": []}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(preset, Path(tmp) / preset.name, progress=False)
        fe = Frontend(FrontendConfig(checkpoint=ckpt, device="cuda", predictor="none"))
        bundles = bundles_by_count(fe.adapter.moe_layers, fe.adapter.num_experts, 2)
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, {b.name: [LOCAL] for b in bundles}))
        fe.dispatcher.apply_pending()
        vocab = fe.model.get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (1, 4096), generator=torch.Generator().manual_seed(0)).cuda()

        def first(n: int):
            return fe.model(input_ids=ids[:, :n], cache=DynamicCache(), use_cache=True, logits_to_keep=1).logits

        for n in [int(x) for x in args.lengths.split(",")]:
            row = {"tokens": n, "fresh": timed(functools.partial(first, n))}
            if 2 * n <= ids.shape[1]:  # a second chunk of n on the cache of the first
                def second(n: int = n) -> float:
                    cache = DynamicCache()
                    fe.model(input_ids=ids[:, :n], cache=cache, use_cache=True, logits_to_keep=1)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fe.model(input_ids=ids[:, n:2 * n], cache=cache, use_cache=True, logits_to_keep=1)
                    torch.cuda.synchronize()
                    return (time.perf_counter() - t0) * 1e3
                second()
                row["second_chunk_wall_ms"] = statistics.median(second() for _ in range(5))
            print(f"{n:>5} tokens: fresh pass wall {row['fresh']['wall_ms']:.2f} ms, device {row['fresh']['device_ms']:.2f} ms"
                  + (f"; a second chunk {row['second_chunk_wall_ms']:.2f} ms" if "second_chunk_wall_ms" in row else ""))
            result["passes"].append(row)

        from torch.profiler import ProfilerActivity, profile
        n = 512
        first(n)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            first(n)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        averages = prof.key_averages()
        kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
        own_device = lambda e: getattr(e, "self_device_time_total", 0.0)  # noqa: E731
        host = sorted((e for e in averages if e.device_type == torch.autograd.DeviceType.CPU),
                      key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
        result["profile_512"] = {
            "wall_ms_profiled": wall,
            "kernel_ms": sum(own_device(e) for e in kernels) / 1e3,
            "kernels": sum(e.count for e in kernels),
            "host_top": [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in host],
            "kernel_top": [{"kernel": e.key[:100], "calls": e.count, "device_ms": own_device(e) / 1e3}
                           for e in sorted(kernels, key=own_device, reverse=True)[:15]]}
        p = result["profile_512"]
        print(f"512-token pass profiled: wall {wall:.2f} ms, kernels {p['kernels']} taking {p['kernel_ms']:.2f} ms")
        for e in p["host_top"]:
            print(f"   host {e['op'][:70]:<70} {e['calls']:>5} {e['self_cpu_ms']:8.3f} ms")
        for e in p["kernel_top"]:
            print(f"   gpu  {e['kernel'][:70]:<70} {e['calls']:>5} {e['device_ms']:8.3f} ms")
        fe.close()
    Path(args.out, "prefill_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
