#!/usr/bin/env python3
"""The offload executor's host work per decode step, at Qwen3-30B-A3B's expert layout and toy widths.

At Qwen3-30B-A3B size on the H200 the offload step is host-bound (offload_h200.json: the GPU waits
~0.07 ms at a step's end), so what the executor does in Python per MoE layer (the policy's decisions,
handing CPU experts to their worker, refreshing the profile) is step time. Here every width is tiny
(hidden 64, expert 32) and the model runs on this CPU with a CPU-resident "GPU budget", so the FFNs
cost little and the host work shows; the expert layout (128 experts, top-8, 8 layers), the hot table's
share and the replayed routing are those of `offload_bench.py`. Prints, per policy, the median over
`--repeats` runs of the decode step, the MoE layers' host time and the decisions' share, per step.
Compare trees by running it in each (figures move with the machine's load: alternate them).
On a GPU host, `--device cuda` runs the bench's own Qwen3-30B-A3B-size preset instead, where the copies
and kernels are asynchronous and the step is the host's Python; `--cprofile N` prints the N functions
with the most own time over the measured runs, per policy, and kubemoe's N with the most time
including their callees (where that Python goes).

  python benchmarks/experiments/offload_host_probe.py --policies kubemoe,gpu-prefetch --batch 64
  python benchmarks/experiments/offload_host_probe.py --device cuda --batch 16 --repeats 1 --cprofile 30
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import offload_bench  # noqa: E402 - first: it sets OpenMP's idle policy before torch loads
import torch  # noqa: E402

from kubemoe import presets  # noqa: E402

LAYOUT = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 8,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 128,
          "num_experts_per_tok": 8, "norm_topk_prob": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="kubemoe,gpu-prefetch,on-demand")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--output", type=int, default=21)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cuda: the bench's Qwen3-30B-A3B-size preset on the GPU")
    parser.add_argument("--cprofile", type=int, default=0, help="print this many functions by own time per policy")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # the launching thread's; the CPU expert pool gets one of its own
        tiny = presets.get_preset("qwen3_moe", "tiny")
        presets.PRESETS[("qwen3_moe", "host-probe")] = presets.Preset("qwen3_moe", "host-probe", {**tiny.config, **LAYOUT})
        bench = offload_bench.Bench("qwen3_moe", "host-probe", torch.device("cpu"), offload_bench.TRACE, 0.25, cpu_threads=1)
    else:
        arch, name = offload_bench.PRESETS["qwen3"]
        offload_bench.serving_attention(torch.device(args.device))
        bench = offload_bench.Bench(arch, name, torch.device(args.device), offload_bench.TRACE, 0.25)
    for policy in args.policies.split(","):
        bench.start(policy)
        bench.generate("warm-up", args.batch, args.prompt, 4)
        rows = []
        profiler = cProfile.Profile() if args.cprofile else None
        for _ in range(args.repeats):
            with profiler or contextlib.nullcontext():
                run = bench.generate(policy, args.batch, args.prompt, args.output)
            steps = len(run.decode_steps_s)
            rows.append((statistics.median(run.decode_steps_s), run.decode_seconds.layers / steps,
                         run.decode_seconds.decide / steps))
        bench.stop()
        step, layers, decide = (statistics.median(r[i] for r in rows) * 1e3 for i in range(3))
        print(f"{policy}: decode step {step:.2f} ms, MoE layers {layers:.2f} ms, decisions {decide:.2f} ms "
              f"(medians of {args.repeats} runs, batch {args.batch})", flush=True)
        if profiler:
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(args.cprofile)
            stats.sort_stats("cumulative").print_stats(r"offload/|moe\.py|expert\.py", args.cprofile)  # the engine's calls


if __name__ == "__main__":
    main()
