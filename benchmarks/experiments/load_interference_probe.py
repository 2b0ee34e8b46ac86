"""Experiment (issue 14, GPU): what a Load does to the rounds an expert function serves meanwhile.

One process serves rounds as an expert function does (run_round, a call from pinned shared memory,
CUDA graphs) back to back with a short gap, while experts load in the background, and reports each
round's wall time, and that of a small pageable copy (what a frontend's step starts with) after each. Variants, each over the same loads:
- alone: no load (the baseline);
- pageable: ExpertStore.load on a thread, as the function runs it (pageable host -> GPU copies on a
  stream of their own), the round's clock synchronising the whole device (ComputeClock as it is);
- stream sync: the same, the clock synchronising only the serving stream;
- pinned: loads copied through two pinned staging buffers in chunks (`--chunk-mib`), stream sync;
- other process: the loads in a second process (another CUDA context, as the other expert
  functions on the GPU), pageable, then pinned, then only their allocations (fresh device memory);
- capture: CUDA graph captures of a newly loaded expert (what Load does on the event loop after
  reading), one per turn, timed.

    python benchmarks/experiments/load_interference_probe.py            # on the GPU host, ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import mixtral_layout_checkpoint  # noqa: E402

from kubemoe.adapters import MoEAdapter  # noqa: E402
from kubemoe.checkpoint import Checkpoint  # noqa: E402
from kubemoe.expert import ExpertWeights  # noqa: E402
from kubemoe.expert_fn import batcher  # noqa: E402
from kubemoe.expert_fn.batcher import Job, run_round  # noqa: E402
from kubemoe.expert_fn.graphs import ExpertGraphs  # noqa: E402
from kubemoe.expert_fn.shm import HEADER_BYTES, Segment  # noqa: E402
from kubemoe.expert_fn.store import ExpertStore  # noqa: E402


def pinned_copy(src: torch.Tensor, dst: torch.Tensor, staging: list[torch.Tensor], events: list[torch.cuda.Event],
                stream: torch.cuda.Stream) -> None:
    """src (CPU) -> dst (GPU) through the pinned staging buffers, chunk by chunk, on `stream`."""
    source, target = src.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
    chunk = staging[0].numel()
    for n, start in enumerate(range(0, source.numel(), chunk)):
        size = min(chunk, source.numel() - start)
        buffer, event = staging[n % 2], events[n % 2]
        event.synchronize()  # its last chunk has left it
        buffer[:size].copy_(source[start:start + size])
        with torch.cuda.stream(stream):
            target[start:start + size].copy_(buffer[:size], non_blocking=True)
            event.record(stream)
    stream.synchronize()


def load_pinned(adapter: MoEAdapter, checkpoint: Checkpoint, keys, dtype, device, chunk_bytes: int) -> list:
    stream = torch.cuda.Stream(device)
    staging = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    events = [torch.cuda.Event() for _ in range(2)]
    for e in events:
        e.record(stream)
    held = []
    for key in keys:
        names = adapter.expert_tensors(*key)
        gate, up, down = (checkpoint.read(n, None, dtype, "cpu") for n in (names.gate, names.up, names.down))
        gate_up = torch.empty((2 * gate.shape[0], gate.shape[1]), dtype=dtype, device=device)
        out_down = torch.empty(down.shape, dtype=dtype, device=device)
        pinned_copy(gate, gate_up[:gate.shape[0]], staging, events, stream)
        pinned_copy(up, gate_up[gate.shape[0]:], staging, events, stream)
        pinned_copy(down, out_down, staging, events, stream)
        held.append(ExpertWeights(gate_up, out_down))
    return held


def other_process(ckpt: str, keys, mode: str, chunk_bytes: int, start: multiprocessing.Event,
                  done: multiprocessing.Event) -> None:
    checkpoint = Checkpoint(ckpt)
    adapter = MoEAdapter(checkpoint.config)
    device = torch.device("cuda")
    torch.zeros(1, device=device)
    start.wait()
    if mode == "pageable":
        ExpertStore(checkpoint, adapter, (), torch.bfloat16, device).load(keys)
    elif mode == "pinned":
        load_pinned(adapter, checkpoint, keys, torch.bfloat16, device, chunk_bytes)
    else:  # only the allocations a Load makes: fresh device memory (cudaMalloc) for each of its tensors
        size = adapter.expert_bytes(torch.bfloat16) // 3
        held = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(3 * len(keys))]
        torch.cuda.synchronize()
        del held
    torch.cuda.synchronize()
    done.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--experts", type=int, default=10)
    parser.add_argument("--loads", type=int, default=4, help="experts loaded in each variant")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--gap-ms", type=float, default=0.5, help="between rounds")
    parser.add_argument("--chunk-mib", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    H, T = args.hidden, args.tokens
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        ckpt = mixtral_layout_checkpoint(Path(tmp) / "ckpt", H, args.intermediate, "bfloat16", 1, args.experts, 2)
        checkpoint = Checkpoint(ckpt)
        adapter = MoEAdapter(checkpoint.config)
        layer = adapter.moe_layers[0]
        served = (layer, 0)
        store = ExpertStore(checkpoint, adapter, (served,), dtype, device)
        store.load([served])
        graphs = ExpertGraphs(H, adapter.act, device, dtype)
        asyncio.run(graphs.prepare(store.held_weights([served])))
        segment = Segment.private(HEADER_BYTES + 2 * T * H * 2)
        assert segment.pin(), "could not pin the segment"
        x = segment.view(HEADER_BYTES, dtype, [T, H])
        out = segment.view(HEADER_BYTES + T * H * 2, dtype, [T, H])
        x.copy_(torch.randn(T, H) * 0.1)

        small = torch.zeros(T, 2, dtype=torch.int64)  # a frontend's top-k indices, from pageable memory

        def serve_round() -> float:
            started = time.perf_counter()
            job = Job(x, [(served, T)], out_buffer=out, pinned=True)
            run_round([job], lambda key: store.get(*key), adapter.act, device, dtype, graphs)
            return time.perf_counter() - started

        def small_copy() -> float:
            """What a frontend's step starts with: a small pageable copy to the GPU, then reading a value back."""
            started = time.perf_counter()
            small.to(device).sum().item()
            return time.perf_counter() - started

        def rounds_while(background) -> tuple[list[float], float]:
            """Rounds until `background()` (run on a thread) returns -> (round seconds, its seconds)."""
            finished = threading.Event()
            took = [0.0]

            def work():
                started = time.perf_counter()
                background()
                took[0] = time.perf_counter() - started
                finished.set()
            thread = threading.Thread(target=work)
            times, copies = [], []
            thread.start()
            while not finished.is_set():
                times.append(serve_round())
                copies.append(small_copy())
                time.sleep(args.gap_ms / 1e3)
            thread.join()
            ms = np.array(copies) * 1e3
            print(f"{'':>28}  a small pageable copy meanwhile: p50 {np.median(ms):.3f} ms, max {ms.max():.3f} ms", flush=True)
            return times, took[0]

        for _ in range(50):
            serve_round()
        keys = iter([(layer, e) for e in range(1, args.experts)] * 100)

        def next_keys():
            return [next(keys) for _ in range(args.loads)]

        def record(name: str, times: list[float], seconds: float) -> None:
            ms = np.array(times) * 1e3
            results[name] = {"rounds": len(ms), "p50_ms": float(np.percentile(ms, 50)),
                             "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max()),
                             "background_s": seconds}
            print(f"{name:>28}: {len(ms):5d} rounds, p50 {np.percentile(ms, 50):7.3f} ms, p99 {np.percentile(ms, 99):7.3f}"
                  f" ms, max {ms.max():7.3f} ms; background {seconds * 1e3:7.1f} ms", flush=True)

        record("alone", *rounds_while(lambda: time.sleep(1.0)))
        for attempt in range(2):
            k = next_keys()
            record(f"pageable, device sync #{attempt}", *rounds_while(lambda k=k: store.load(k)))
            store.unload(k)
        device_sync = torch.cuda.synchronize
        batcher.torch.cuda.synchronize = lambda *a: torch.cuda.current_stream().synchronize()
        try:
            for attempt in range(2):
                k = next_keys()
                record(f"pageable, stream sync #{attempt}", *rounds_while(lambda k=k: store.load(k)))
                store.unload(k)
            for attempt in range(2):
                k = next_keys()
                record(f"pinned, stream sync #{attempt}", *rounds_while(
                    lambda k=k: load_pinned(adapter, checkpoint, k, dtype, device, args.chunk_mib << 20)))
        finally:
            batcher.torch.cuda.synchronize = device_sync
        context = multiprocessing.get_context("spawn")
        for mode in ("pageable", "pinned", "malloc"):
            start, done = context.Event(), context.Event()
            proc = context.Process(target=other_process, args=(str(ckpt), next_keys(), mode, args.chunk_mib << 20,
                                                               start, done))
            proc.start()
            time.sleep(8)  # its CUDA context and imports, before the measurement
            began = time.perf_counter()
            start.set()
            record(f"other process, {mode}", *rounds_while(lambda done=done: done.wait(600)))
            proc.join()
            results[f"other process, {mode}"]["background_s"] = time.perf_counter() - began
        # Captures, as Load runs them on the loop after reading: one per turn.
        k = next_keys()
        store.load(k)
        captures = []
        round_after = []
        for key, weights in store.held_weights(k):
            for size in graphs.sizes:
                started = time.perf_counter()
                graphs._entry(key, weights, size)
                captures.append(time.perf_counter() - started)
                round_after.append(serve_round())
        ms = np.array(captures) * 1e3
        results["capture"] = {"captures": len(ms), "p50_ms": float(np.median(ms)), "max_ms": float(ms.max()),
                              "sum_ms_per_expert": float(ms.sum() / len(k)),
                              "round_after_p50_ms": float(np.median(round_after) * 1e3)}
        print(f"{'capture':>28}: {len(ms)} graphs, p50 {np.median(ms):.3f} ms, max {ms.max():.3f} ms, "
              f"{ms.sum() / len(k):.1f} ms per expert; a round after one: p50 {np.median(round_after) * 1e3:.3f} ms")
        segment.unpin()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
