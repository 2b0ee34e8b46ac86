#!/usr/bin/env python3
"""What one grouped FFN over the offload store's slot stack costs, against the same experts one FFN each.

At 9d3d9cc the offload profiler measured the grouped line at Qwen3-30B-A3B size on the H200 as 0.10 ms per
expert, flat in tokens (16 experts of 1-256 tokens each), above an expert's FFN alone (0.082 ms), while at
a27dcc6 grouping those experts made every policy up to 2x faster end to end. This probe times, per expert
count and tokens per expert: `sorted_ffn` over the store's strided slot views (`ExpertStore.stacked()`: what
the executor and the profiler run), over a contiguous stack of the same experts, and `expert_ffn` per
expert, each between device synchronisations (as the profiler) and as a queue of back-to-back calls (as
serving launches them). Rows above moe_kernels.GROUPED_SMALL_ROWS leave kubemoe's kernel for torch's
grouped GEMM, which may copy a strided operand: the slot stack is every slot, not only the grouped ones.

  python benchmarks/experiments/grouped_slots_probe.py --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import write_results  # noqa: E402

from kubemoe.expert import ExpertWeights, expert_ffn  # noqa: E402
from kubemoe.frontend.offload.profiler import median_seconds  # noqa: E402
from kubemoe.frontend.offload.store import ExpertStore, HostExperts  # noqa: E402
from kubemoe.moe import StackedExperts, sorted_ffn, upload_ends  # noqa: E402

# hidden, intermediate, slots (the offload benchmark's budgets: 256 + 18 Qwen3-size, 8 + 6 Mixtral-size); tiny: a CPU check
SIZES = {"qwen3-30b-a3b": (2048, 768, 274), "mixtral": (4096, 14336, 14), "tiny": (64, 32, 20)}
HOST_EXPERTS = 48  # distinct experts in host memory; the slots cycle over them


def host_experts(hidden: int, intermediate: int, experts: int) -> HostExperts:
    g = torch.Generator().manual_seed(0)

    def load(layer: int, expert: int) -> ExpertWeights:
        return ExpertWeights((torch.randn(2 * intermediate, hidden, generator=g) * 0.02).bfloat16(),
                             (torch.randn(hidden, intermediate, generator=g) * 0.02).bfloat16())

    return HostExperts((0,), experts, hidden, intermediate, torch.bfloat16, load)


def timed(run, device: torch.device, repeats: int, queued: int) -> tuple[float, float]:
    """(median ms of one call between syncs, as the profiler times it; ms per call of `queued` back to back)."""
    alone = median_seconds(run, device, repeats)
    start = time.perf_counter()
    for _ in range(queued):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return alone * 1e3, (time.perf_counter() - start) / queued * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--experts", default="8,16,40")
    parser.add_argument("--tokens", default="1,4,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--queued", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for size in args.sizes.split(","):
        hidden, intermediate, slots = SIZES[size]
        host = host_experts(hidden, intermediate, min(HOST_EXPERTS, slots))  # Mixtral's: 14 of 352 MB, not 48
        store = ExpertStore(host, device, slots)
        for slot, e in zip(range(slots), itertools.cycle(range(host.num_experts))):
            store.copy((0, e), slot)
            store.wait_ready(slot)
        strided = store.stacked()
        for count, tokens in itertools.product((int(c) for c in args.experts.split(",")),
                                               (int(t) for t in args.tokens.split(","))):
            if count > slots:
                continue
            contiguous = StackedExperts(strided.gate_up[:count].contiguous(), strided.down[:count].contiguous())
            x = torch.randn(count * tokens, hidden, device=device, dtype=torch.bfloat16)
            ends_all = upload_ends([tokens * min(e + 1, count) for e in range(slots)], device)
            ends_own = upload_ends([tokens * (e + 1) for e in range(count)], device)
            parts = x.split(tokens)
            one_each = [store.slot_weights(s) for s in range(count)]
            row = {"size": size, "experts": count, "tokens_per_expert": tokens, "rows": count * tokens}
            for name, run in {
                "slot_stack": lambda: sorted_ffn(x, ends_all, strided, F.silu),  # noqa: B023 - called here
                "contiguous_stack": lambda: sorted_ffn(x, ends_own, contiguous, F.silu),  # noqa: B023
                "one_ffn_each": lambda: [expert_ffn(p, w, F.silu) for p, w in zip(parts, one_each)],  # noqa: B023
            }.items():
                alone, queued = timed(run, device, args.repeats, args.queued)
                row[f"{name}_ms"], row[f"{name}_queued_ms"] = alone, queued
            rows.append(row)
            print(json.dumps(row), flush=True)
        store.close()
        host.close()
    write_results("grouped_slots_probe", device, rows, {}, args.out)  # a probe: figures, no goals


if __name__ == "__main__":
    main()
