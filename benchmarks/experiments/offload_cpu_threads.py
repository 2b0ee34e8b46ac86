#!/usr/bin/env python3
"""Does the CPU expert pool's team size slow the thread that launches the GPU work? One process, variants interleaved.

At Qwen3-30B-A3B size the offload step is the host's Python (offload_h100.json: kubemoe's MoE layers took
21 ms a step at batch 4 where gpu-prefetch's took 11 with as many copies, and its attention 16 ms against
10), and a traced step showed the same torch calls running 5-60% slower in kubemoe's step. One suspect: the
CPU experts' OpenMP team of every core but one sharing cores with the launching thread (its idle threads
sleep since 3e6af38, as offload_bench.py runs it; OMP_WAIT_POLICY=ACTIVE in the environment makes them spin
again). Runs of the same code on that host differ up to 1.7x from one process to the next,
so the variants (kubemoe at several team sizes, and the policies without CPU experts) take turns in one
process, round after round, each team size with its own start-up profile. Prints tokens/s per variant
and round, and their medians.

  python benchmarks/experiments/offload_cpu_threads.py --device cuda --threads 15,8,4 --batches 4,16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import offload_bench  # noqa: E402 - first: it sets OpenMP's idle policy before torch loads
import torch  # noqa: E402

from kubemoe.frontend.offload.cpu_experts import default_threads  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="qwen3", choices=list(offload_bench.PRESETS))
    parser.add_argument("--threads", default=f"{default_threads()},8,4", help="kubemoe's CPU pool sizes to compare")
    parser.add_argument("--tiny", action="store_true", help="the tiny preset (a CPU smoke test)")
    parser.add_argument("--baselines", default="gpu-prefetch,on-demand", help="policies run beside (no CPU experts)")
    parser.add_argument("--batches", default="4,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=12)
    args = parser.parse_args()
    device = torch.device(args.device)
    arch, name = (offload_bench.TINY if args.tiny else offload_bench.PRESETS)[args.preset]
    if device.type == "cuda":
        offload_bench.serving_attention(device)
    bench = offload_bench.Bench(arch, name, device, offload_bench.TRACE, 0.25)
    variants = [("kubemoe", int(t)) for t in args.threads.split(",")] + \
        [(p, None) for p in args.baselines.split(",") if p]
    profiles: dict[int | None, tuple] = {}  # team size -> (profile, CPU dtype): t_c is the team's own
    results: dict[tuple[str, int | None, int], list[float]] = {}
    for round_ in range(args.rounds):
        for policy, threads in variants[round_ % len(variants):] + variants[:round_ % len(variants)]:
            bench.cpu_threads = threads
            bench.profile, bench.cpu_dtype = profiles.get(threads, (None, None))
            bench.start(policy)
            profiles[threads] = (bench.profile, bench.cpu_dtype)
            label = policy if threads is None else f"{policy}@{threads}"
            bench.generate("warm-up", 4, 32, 4)  # first calls of a shape: kernels load, oneDNN compiles
            for batch in (int(b) for b in args.batches.split(",")):
                run = bench.generate(label, batch, args.prompt, args.output)
                results.setdefault((policy, threads, batch), []).append(run.tokens_per_s)
                print(f"round {round_} {label:>16} b{batch:<3} {run.summary()}, CPU experts/step "
                      f"{run.row()['decode_cpu_experts_per_step']:.1f}", flush=True)
            bench.stop()
    for threads, (profile, _) in profiles.items():
        if threads is not None:
            cpu = profile.experts[0].cpu
            print(f"team of {threads}: t_c = {cpu.slope * 1e6:.2f} us/token + {cpu.intercept * 1e3:.3f} ms")
    print("medians, tokens/s:")
    for (policy, threads, batch), values in sorted(results.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1] or 0)):
        label = policy if threads is None else f"{policy}@{threads}"
        print(f"  b{batch:<3} {label:>16} {statistics.median(values):8.1f}  ({', '.join(f'{v:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
