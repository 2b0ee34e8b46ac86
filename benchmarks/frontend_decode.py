#!/usr/bin/env python3
"""Decode and time to first token against the hardware's bound: transformers, kubemoe in process,
kubemoe with its experts in expert functions (same GPU, tensors through shared memory).

Every configuration runs the same loop on the same generated checkpoint: a batched prefill of a
`--prompt`-token prompt per sequence, then one token per sequence per step on the warm cache; batch
1, 8, 32 and 64. kubemoe's configurations run twice: the forward pass alone in that loop ("model"),
and as served, through the engine ("engine": scheduler, sampling, detokenising and streaming
included), which is what the goals read. Each row states its roofline: the bytes a decode step must read (dense weights, the
expected distinct experts of each MoE layer under uniform routing E(1-(1-K/E)^B) x expert bytes,
the embedding rows and the KV cache) over the HBM bandwidth measured here by a plain read, and for
prefill the FLOPs over the bf16 matmul rate measured here. Time to first token is also measured
through the engine (`batch` requests of `--prompt` tokens at once, as clients would send them).
torch.profiler summaries of a few batch-32 decode steps say where a step's time goes.

  python benchmarks/frontend_decode.py                       # this CPU, tiny Mixtral, short prompt
  python benchmarks/frontend_decode.py --device cuda --preset mixtral-4l --layers 2   # on the H200

The layer count is cut to fit the lent machine and one run of a few minutes: the figures per step
scale with layers, and the ratios (to the roofline, between configurations) are what the goals read.
A full-depth model (`run_h200.sh frontend-full`: Qwen3-30B-A3B at 48 layers) fits one call in process
alone (`--modes ""`, frontend_full_<machine>.json); transformers and the expert functions take a call each
(`--modes transformers` or `--modes disaggregated --lean`, another `--name`), on the checkpoint the first
call kept (`--checkpoint-dir`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import cProfile
import gc
import multiprocessing
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Goal, write_results  # noqa: E402

from kubemoe.bundles import bundles_by_count  # noqa: E402
from kubemoe.adapters import MoEAdapter  # noqa: E402
from kubemoe.checkpoint import Checkpoint, default_model_id  # noqa: E402
from kubemoe.frontend.app import Frontend, FrontendConfig  # noqa: E402
from kubemoe.frontend.compiled import CompiledDecode  # noqa: E402
from kubemoe.frontend.embedded import expert_processes  # noqa: E402
from kubemoe.frontend.graphs import DecodeGraphs  # noqa: E402
from kubemoe.frontend.sampling import SamplingParams  # noqa: E402
from kubemoe.routing_table import LOCAL, table_for_bundles  # noqa: E402
from kubemoe.presets import Preset, get_preset  # noqa: E402
from kubemoe.synth import make_checkpoint  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


START = time.monotonic()


def progress(what: str) -> None:
    """A timestamped line on stderr as each part ends: a run cut short by its time limit still says where it got."""
    print(f"[{time.monotonic() - START:6.0f} s] {what}", file=sys.stderr, flush=True)


def freed(device) -> None:
    """The memory of the configurations dropped so far handed back, so the next one starts on an empty
    device (a full-depth model does not fit twice)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated(device)
        progress(f"{held / 2**30:.1f} GiB still allocated on {device}")
        if held > 2**30:  # at Qwen3's 48 layers 54 GiB of a dropped frontend stayed: say who holds them
            for holder, (count, nbytes) in tensor_holders(device)[:8]:
                progress(f"  {nbytes / 2**30:.1f} GiB in {count} tensors held by {holder}")


def tensor_holders(device) -> list[tuple[str, tuple[int, int]]]:
    """Tensors on `device` that Python still reaches, by what refers to them (the referrers' types, and
    a module's or dict's owner where there is one), most bytes first."""
    def names(referrers, depth: int = 3) -> set[str]:
        # a module's parameters and an object's attributes sit in dicts (two deep for a Module): name their owner
        found = set()
        for r in referrers:
            if isinstance(r, dict) and depth:
                found |= names(gc.get_referrers(r), depth - 1)
            elif not isinstance(r, (list, types.FrameType)):
                found.add(type(r).__qualname__)
        return found

    found: dict[str, list[int]] = {}
    with warnings.catch_warnings():  # isinstance on every object touches deprecated module proxies
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.device == device]
    for tensor in tensors:
        entry = found.setdefault(", ".join(sorted(names(gc.get_referrers(tensor)))) or "nothing Python tracks", [0, 0])
        entry[0] += 1
        entry[1] += tensor.untyped_storage().nbytes()
    return sorted(((k, (n, b)) for k, (n, b) in found.items()), key=lambda kv: -kv[1][1])


def kept_checkpoint(preset: Preset, folder: Path) -> Path:
    """The preset's checkpoint in `folder`: reused when an earlier run finished writing it, else written."""
    done = folder / ".complete"
    if done.exists() and done.read_text() == preset.name:
        return folder
    if folder.exists():
        shutil.rmtree(folder)  # another preset's, or cut short while being written
    make_checkpoint(preset, folder, progress=False)
    done.write_text(preset.name)
    return folder


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--device, --arch, --preset and --layers: the model a run generates (cut_preset)."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--arch", default="mixtral")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")


def cut_preset(arch: str, name: str, layers: int) -> Preset:
    """A preset with its layer count cut to `layers` (0: as it is), to fit the lent machine and one run."""
    preset = get_preset(arch, name)
    if not layers:
        return preset
    return Preset(preset.arch, f"{preset.name}-{layers}l", {**preset.config, "num_hidden_layers": layers},
                  preset.dtype, preset.shard_bytes)


def hardware(device) -> dict:
    """The bounds measured here: HBM read bandwidth (a plain sum over 4 GiB) and the bf16 matmul rate."""
    if device.type != "cuda":
        return {"hbm_bytes_per_s": None, "matmul_flops_per_s": None}
    x = torch.empty(2 << 30, dtype=torch.bfloat16, device=device).fill_(1)  # 4 GiB
    read = timed(x.sum, device, 10)
    del x
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm = timed(lambda: a @ a, device, 10)
    return {"hbm_bytes_per_s": (4 << 30) / read, "matmul_flops_per_s": 2 * 8192**3 / mm}


def decode_rate(model, batch: int, prompt: int, steps: int, warmup: int, device, vocab: int) -> dict:
    """Median seconds per decode step for `batch` sequences after a batched `prompt`-token prefill."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, prompt), generator=gen).to(device)
    cache = DynamicCache()
    with torch.inference_mode():
        sync(device)
        start = time.perf_counter()
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        sync(device)
        prefill_s = time.perf_counter() - start
        times = []
        for step in range(warmup + steps):
            sync(device)
            start = time.perf_counter()
            logits = model(input_ids=logits.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
            sync(device)
            if step >= warmup:
                times.append(time.perf_counter() - start)
    kv = sum(l.keys.nbytes + l.values.nbytes for l in cache.layers)
    step_s = statistics.median(times)
    return {"batch": batch, "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s, "prefill_ms": prefill_s * 1e3,
            "kv_bytes_per_token": kv // (batch * (prompt + warmup + steps))}


def step_bytes(fe: Frontend, batch: int, context: int, kv_per_token: int) -> dict:
    """Bytes one decode step of `batch` sequences at `context` tokens must read."""
    a = fe.adapter
    embed = fe.model.get_input_embeddings().weight
    dense = sum(p.nbytes for p in fe.model.parameters()) - embed.nbytes + batch * embed[0].nbytes
    distinct = a.num_experts * (1 - (1 - a.top_k / a.num_experts) ** batch)
    experts = len(a.moe_layers) * distinct * a.expert_bytes(fe.dtype)
    kv = batch * context * kv_per_token
    return {"dense": dense, "experts": int(experts), "kv": kv, "total": int(dense + experts + kv),
            "distinct_experts_per_layer": distinct}


def prefill_flops(fe: Frontend, batch: int, prompt: int) -> float:
    """Matmul FLOPs of a batched prefill: 2 x active weights per token, plus causal attention."""
    a, c = fe.adapter, fe.checkpoint.config
    embed = fe.model.get_input_embeddings().weight
    dense = sum(p.numel() for p in fe.model.parameters()) - embed.numel()
    active = dense + len(a.moe_layers) * a.top_k * 3 * a.hidden_size * a.expert_intermediate_size
    head_dim = getattr(c, "head_dim", None) or a.hidden_size // c.num_attention_heads
    attention = 2 * c.num_hidden_layers * prompt * prompt * c.num_attention_heads * head_dim  # QK^T and PV, causal
    return batch * (2 * active * prompt + attention)


def engine_ttft(fe: Frontend, batch: int, prompt: int, vocab: int) -> dict:
    """`batch` requests of `prompt` tokens sent at once: time to each one's first token through the engine."""
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (batch, prompt), generator=gen).tolist()

    async def one(i):
        start = time.perf_counter()
        async for _ in fe.engine.generate(f"ttft-{i}", prompts[i], SamplingParams(temperature=0, max_tokens=1)):
            return time.perf_counter() - start

    async def run():
        return await asyncio.gather(*(one(i) for i in range(batch)))

    asyncio.run(run())  # warm-up
    times = sorted(asyncio.run(run()))
    return {"median_ms": statistics.median(times) * 1e3, "max_ms": times[-1] * 1e3}


@contextlib.contextmanager
def engine_thread_profile(engine, top: int = 15) -> Iterator[list[dict]]:
    """Where the engine thread's time goes while the block runs: a cProfile of Engine.step. Yields a list
    that holds, once the block is done, the `top` functions by own time."""
    stats, step, summary = cProfile.Profile(), engine.step, []

    def profiled(plan):
        stats.enable()
        try:
            return step(plan)
        finally:
            stats.disable()

    engine.step = profiled
    try:
        yield summary
    finally:
        del engine.step  # the class's method again
    ranked = sorted(pstats.Stats(stats).stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    summary.extend({"function": f"{Path(f).name}:{line}({name})", "calls": nc, "tottime_ms": tt * 1e3,
                    "cumtime_ms": ct * 1e3} for (f, line, name), (_, nc, tt, ct, _) in ranked)


def engine_decode(fe: Frontend, batch: int, prompt: int, steps: int, warmup: int, vocab: int,
                  profile: bool = False) -> dict:
    """Decode as served: `batch` requests of `prompt` tokens sent to the engine at once, greedy; the step
    is the median gap between a request's tokens once every request is decoding (after `warmup` more
    steps). `profile`: where the engine thread's time goes over those steps (engine_thread_profile)."""
    admission = -(-batch * prompt // fe.engine.scheduler.config.max_step_tokens)  # steps until all have prefilled
    params = SamplingParams(temperature=0, max_tokens=admission + warmup + steps + 2)
    prompt = min(prompt, fe.engine.max_context - params.max_tokens)  # every request generates all of them
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, vocab, (batch, prompt), generator=gen).tolist()
    times: list[list[float]] = [[] for _ in range(batch)]

    async def one(i):
        async for _ in fe.engine.generate(f"decode-{i}", prompts[i], params):
            times[i].append(time.perf_counter())

    async def run():
        await asyncio.gather(*(one(i) for i in range(batch)))

    fe.engine.eos_ids = set()  # every request decodes through the window
    asyncio.run(run())  # warm-up: shapes, cache growth
    times = [[] for _ in range(batch)]
    with engine_thread_profile(fe.engine) if profile else contextlib.nullcontext([]) as top:
        asyncio.run(run())
    all_decoding = max(ts[0] for ts in times)
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:]) if a > all_decoding][warmup * batch:]
    step_s = statistics.median(gaps)
    row = {"batch": batch, "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s, "gaps": len(gaps)}
    if profile:
        row["engine_thread_top"] = top
    return row


def profile_summary(model, batch: int, prompt: int, device, vocab: int, steps: int = 5, top: int = 12) -> dict:
    """Where a decode step's time goes: the ops with the most device time (self), and device busy time per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    decode_rate(model, batch, prompt, 1, 0, device, vocab)  # warm
    with profile(activities=activities) as prof:
        row = decode_rate(model, batch, prompt, steps, 0, device, vocab)
    events = prof.key_averages()

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    ops = sorted(events, key=lambda e: (device_us(e), e.self_cpu_time_total), reverse=True)[:top]
    busy = sum(device_us(e) for e in events)  # includes the prefill: read per step below as an upper bound
    return {"step_ms": row["step_ms"], "device_busy_ms_per_step_incl_prefill": busy / 1e3 / steps,
            "ops": [{"name": e.key, "calls": e.count, "self_device_ms": device_us(e) / 1e3,
                     "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in ops]}


@contextlib.contextmanager
def swapped(engine, parts: dict) -> Iterator[None]:
    """The engine with some of its attributes replaced while the block runs."""
    held = {part: getattr(engine, part) for part in parts}
    for part, value in parts.items():
        setattr(engine, part, value)
    try:
        yield
    finally:
        for part, value in held.items():
            setattr(engine, part, value)


def run_frontend(fe: Frontend, table, args, device, vocab, hw, profile: bool, compile: bool = False) -> list[dict]:
    fe.set_routing_table(table)
    fe.dispatcher.apply_pending()
    # The same engine without one of its parts: launching every kernel itself (what the graphs save),
    # reading each step's tokens before the next pass starts (what the look-ahead saves); with --compile,
    # `compile`: with its decode passes compiled (frontend/compiled.py), replayed as graphs and launched op by op.
    variants: dict[str, dict] = {} if args.lean else {"engine_eager": {"graphs": None},
                                                      "engine_no_lookahead": {"lookahead": None}}
    if compile:
        compiled = CompiledDecode(fe.model)
        variants["engine_compiled"] = {"decode_model": compiled}
        if fe.engine.graphs is not None:
            variants["engine_compiled"]["graphs"] = DecodeGraphs(compiled, lambda: fe.dispatcher.generation)
        variants["engine_compiled_eager"] = {"decode_model": compiled, "graphs": None}
    rows = []
    for b in args.batch_list:
        row = decode_rate(fe.model, b, args.prompt, args.steps, args.warmup, device, vocab)
        context = args.prompt + args.warmup + args.steps // 2
        need = step_bytes(fe, b, context, row["kv_bytes_per_token"])
        row["bytes_per_step"] = need
        if hw["hbm_bytes_per_s"]:
            row["roofline_step_ms"] = need["total"] / hw["hbm_bytes_per_s"] * 1e3
            row["roofline_tokens_per_s"] = b / (row["roofline_step_ms"] / 1e3)
            row["vs_roofline"] = row["tokens_per_s"] / row["roofline_tokens_per_s"]
            row["prefill_roofline_ms"] = prefill_flops(fe, b, args.prompt) / hw["matmul_flops_per_s"] * 1e3
        rows.append(row)
        progress(f"{fe.model_id} batch {b}, forward pass alone: {row['tokens_per_s']:.1f} tokens/s")
    profiled = ttft_batch(args)
    for row in rows:
        b = row["batch"]
        linked = fe.dispatcher.linked_layers
        fe.dispatcher.link_waits.clear()
        row["engine"] = engine_decode(fe, b, args.prompt, args.steps, args.warmup, vocab)
        row["engine"]["linked_layers"] = fe.dispatcher.linked_layers - linked  # through device links (device_link.py)
        waits = list(fe.dispatcher.link_waits)[-args.steps:]  # the measured steps' (the warm-up's captures aside)
        if waits:  # the engine thread's waits per linked step, medians: for the functions' answers, then the end
            row["engine"]["link_wait_ms"] = {name: statistics.median(w[i] for w in waits) * 1e3
                                             for i, name in enumerate(("answers", "end"))}
        progress(f"batch {b}, engine: {row['engine']['tokens_per_s']:.1f} tokens/s")
        if row["engine"]["linked_layers"] and not args.lean:  # the same engine with every remote layer as calls through shared memory
            fe.dispatcher.use_device_links(False)
            try:
                row["engine_calls"] = engine_decode(fe, b, args.prompt, args.steps, args.warmup, vocab)
            finally:
                fe.dispatcher.use_device_links(True)
        if profile and b == profiled:  # cProfile slows the thread it watches: a run of its own, not the goal's
            row["engine_profiled"] = engine_decode(fe, b, args.prompt, args.steps, args.warmup, vocab, profile=True)
        graphs = fe.engine.graphs
        if graphs is not None:
            row["engine"]["graphs"] = {"enabled": graphs.enabled, "captures": graphs.captures}
        for mode, parts in variants.items():
            if any(getattr(fe.engine, part) is None for part in parts):
                continue  # e.g. no graphs on a CPU: nothing to take away
            with swapped(fe.engine, parts):
                row[mode] = engine_decode(fe, b, args.prompt, args.steps, args.warmup, vocab)
            if mode.startswith("engine_compiled"):
                row[mode]["compiled"] = compiled.enabled  # False: a compile failed and it ran uncompiled
        for mode in ("engine", "engine_calls", *variants):
            if hw["hbm_bytes_per_s"] and mode in row:
                row[mode]["vs_roofline"] = row[mode]["tokens_per_s"] / row["roofline_tokens_per_s"]
    if profile:
        rows[args.batch_list.index(profiled)]["profile"] = profile_summary(fe.model, profiled, args.prompt, device, vocab)
    return rows


def run_disaggregated(ckpt: Path, bundles, model_id: str, tmp: str, args, device, vocab, hw) -> tuple[list[dict], dict]:
    """The frontend with its experts in expert-function processes on the same device, through shared memory."""
    # The folder frontend and expert functions share: tmpfs where there is one, as /dev/shm is in production.
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else tmp) as shm_folder, \
            expert_processes(ckpt, bundles, model_id, ready_timeout=600, shm_dir=Path(shm_folder)) as experts:
        progress(f"{len(bundles)} expert functions ready")
        fe = Frontend(FrontendConfig(checkpoint=ckpt, device=args.device, shm_dir=Path(shm_folder), device_links=True,
                                     predictor=args.predictor, max_batch=max(args.batch_list)))
        try:
            remote_table = table_for_bundles(model_id, bundles, experts.addresses, version=2)
            rows = run_frontend(fe, remote_table, args, device, vocab, hw, profile=not args.lean)
            ttft = engine_ttft(fe, ttft_batch(args), args.prompt, vocab)
            progress(f"time to first token, expert functions: {ttft['median_ms']:.1f} ms")
            if not all(client.shared_memory for client in fe.dispatcher._clients.values()):
                raise RuntimeError(f"the expert functions did not attach segments in {shm_folder}")
        finally:
            fe.close()  # ends its streams, so the expert functions stop at once
    return rows, ttft


def disaggregated_apart(mps_pipe: str | None, *call) -> tuple[list[dict], dict]:
    """run_disaggregated in a process of its own, the only one here that is a client of the MPS daemon (with
    its expert functions): kubemoe in process and transformers stay the GPU's sole users, as they would be
    serving alone (at 48 layers the in-process engine ran 110 tok/s at batch 1 as an MPS client, 143 alone),
    and the memory the configuration held ends with its process."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=join_mps, initargs=(mps_pipe, START)) as pool:
        return pool.submit(run_disaggregated, *call).result()


def join_mps(pipe: str | None, start: float) -> None:
    global START
    START = start  # progress() counts from the run's start (the monotonic clock is the machine's)
    if pipe:  # before CUDA starts in this process: it reads the variable once, when it starts
        os.environ["CUDA_MPS_PIPE_DIRECTORY"] = pipe


def ttft_batch(args) -> int:
    """The batch whose time to first token is measured: 32, the goals' (the largest there is in a shorter run)."""
    return 32 if 32 in args.batch_list else args.batch_list[-1]


MODES = ("transformers", "no_predictor", "disaggregated")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence (cut to the context)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--experts", type=int, default=2, help="expert-function processes for the disaggregated mode")
    parser.add_argument("--predictor", default="router", help="the frontends' --predictor (router, none, a file)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"which of {', '.join(MODES)} run besides kubemoe in process (full-depth models: "
                             "fewer, to fit one run)")
    parser.add_argument("--compile", action="store_true",
                        help="also run kubemoe's engine with its decode passes compiled (torch.compile, "
                             "frontend/compiled.py), with and without CUDA graphs, beside the same engine uncompiled")
    parser.add_argument("--lean", action="store_true",
                        help="only what the goals read: no engine without graphs or look-ahead, no calls variant, "
                             "no profiles (full-depth models with expert functions, to fit one call)")
    parser.add_argument("--checkpoint-dir", type=Path,
                        help="generate the checkpoint here and keep it, or reuse it if an earlier run finished it "
                             "(a full-depth model split over several runs on one machine)")
    parser.add_argument("--name", default="frontend", help="the results file's name before the machine's")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    device = torch.device(args.device)
    args.batch_list = [int(b) for b in args.batches.split(",")]
    modes = set(args.modes.split(",")) - {""}
    if modes - set(MODES):
        parser.error(f"--modes: unknown {sorted(modes - set(MODES))}; choose from {', '.join(MODES)}")
    none = [None] * len(args.batch_list)
    # The MPS daemon run_h200.sh started (KUBEMOE_MPS=1) serves the disaggregated configuration's processes only;
    # this one leaves it before CUDA starts here (hardware() below), so it uses the GPU alone
    mps_pipe = os.environ.pop("CUDA_MPS_PIPE_DIRECTORY", None)

    preset = cut_preset(args.arch, args.preset, args.layers)
    args.prompt = min(args.prompt, preset.config.get("max_position_embeddings", 4096) - args.warmup - args.steps - 2)
    hw = hardware(device)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = kept_checkpoint(preset, args.checkpoint_dir) if args.checkpoint_dir else \
            make_checkpoint(preset, Path(tmp) / preset.name, progress=False)
        progress(f"checkpoint {ckpt}")
        checkpoint = {"arch": preset.arch, "preset": preset.name, "dtype": preset.dtype, "config": dict(preset.config)}
        from transformers import AutoConfig, AutoModelForCausalLM

        vocab = AutoConfig.from_pretrained(ckpt).vocab_size
        adapter = MoEAdapter(Checkpoint(ckpt).config)
        bundles = bundles_by_count(adapter.moe_layers, adapter.num_experts, args.experts)
        model_id = default_model_id(ckpt)
        shm_rows: list = none
        shm_ttft = None
        if "disaggregated" in modes:
            # First, while this process holds nothing on the device: on the H200, 54 of an in-process
            # Qwen3-48-layer frontend's 61 GB stayed allocated after it was closed and dropped (not so on a
            # CPU; not found yet), and the expert functions did not fit beside them.
            shm_rows, shm_ttft = disaggregated_apart(mps_pipe, ckpt, bundles, model_id, tmp, args, device, vocab, hw)
        mono_rows: list = none
        if "transformers" in modes:
            # On a GPU straight onto it (accelerate's device_map; its wheel is in .whl): a full-depth model
            # loaded into host memory first would not fit there beside its files in /dev/shm.
            placement = {"device_map": str(device)} if device.type != "cpu" else {}
            mono = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, preset.dtype), **placement).eval()
            progress("transformers loaded")
            mono_rows = []
            for b in args.batch_list:
                mono_rows.append(decode_rate(mono, b, args.prompt, args.steps, args.warmup, device, vocab))
                progress(f"transformers batch {b}: {mono_rows[-1]['tokens_per_s']:.1f} tokens/s")
            del mono
            freed(device)

        fe = Frontend(FrontendConfig(checkpoint=ckpt, device=args.device, predictor=args.predictor,
                                     max_batch=max(args.batch_list)))
        progress("kubemoe in process loaded")
        local_table = table_for_bundles(model_id, bundles, {b.name: [LOCAL] for b in bundles})
        local_rows = run_frontend(fe, local_table, args, device, vocab, hw, profile=not args.lean,
                                  compile=args.compile)
        ttft = engine_ttft(fe, ttft_batch(args), args.prompt, vocab)
        progress(f"time to first token {ttft['median_ms']:.1f} ms")
        fe.close()
        del fe  # its experts' memory, before the next configuration loads its own
        freed(device)
        bare_rows: list = none
        if "no_predictor" in modes:
            bare = Frontend(FrontendConfig(checkpoint=ckpt, device=args.device, predictor="none",
                                           max_batch=max(args.batch_list)))
            bare_rows = run_frontend(bare, local_table, args, device, vocab, hw, profile=False)  # the predictor's cost
            bare.close()
            del bare
            freed(device)

    rows = []
    print("decode tokens/s; model = the forward pass alone in a loop, engine = served (scheduler, sampling, streaming)")
    print(f"{'batch':>5} {'transformers':>12} {'model':>8} {'no-predictor':>12} {'engine':>8} {'no-graphs':>9} "
          f"{'no-lookahead':>12} {'engine-disagg':>13} {'roofline':>9} {'engine/roof':>11} {'disagg/in-proc':>14}")
    nan = {"tokens_per_s": float("nan")}
    for m, l, n, h in zip(mono_rows, local_rows, bare_rows, shm_rows):
        row = {"batch": l["batch"], "prompt": args.prompt, "inprocess": l,
               "engine_vs_model": l["engine"]["tokens_per_s"] / l["tokens_per_s"]}
        if m:
            row.update(transformers=m, inprocess_vs_transformers=l["engine"]["tokens_per_s"] / m["tokens_per_s"])
        if n:
            row.update(inprocess_no_predictor=n, predictor_cost=1 - l["tokens_per_s"] / n["tokens_per_s"])
        if h:
            row.update(disaggregated_shm=h,
                       disaggregated_vs_inprocess=h["engine"]["tokens_per_s"] / l["engine"]["tokens_per_s"])
        rows.append(row)
        roof = l.get("roofline_tokens_per_s", float("nan"))
        print(f"{l['batch']:>5} {(m or nan)['tokens_per_s']:>12.1f} {l['tokens_per_s']:>8.1f} "
              f"{(n or nan)['tokens_per_s']:>12.1f} "
              f"{l['engine']['tokens_per_s']:>8.1f} {l.get('engine_eager', nan)['tokens_per_s']:>9.1f} "
              f"{l.get('engine_no_lookahead', nan)['tokens_per_s']:>12.1f} "
              f"{(h['engine'] if h else nan)['tokens_per_s']:>13.1f} {roof:>9.1f} "
              f"{l['engine'].get('vs_roofline', float('nan')):>11.2f} "
              f"{row.get('disaggregated_vs_inprocess', float('nan')):>14.2f}")
    if args.compile:
        print("kubemoe in process, decode passes compiled (--compile) beside uncompiled, tokens/s")
        print(f"{'batch':>5} {'engine':>8} {'compiled':>9} {'ratio':>6} {'no-graphs':>9} {'compiled-no-graphs':>18} "
              f"{'compiled/roof':>13}")
        for l in local_rows:
            compiled = l.get("engine_compiled", nan)
            print(f"{l['batch']:>5} {l['engine']['tokens_per_s']:>8.1f} {compiled['tokens_per_s']:>9.1f} "
                  f"{compiled['tokens_per_s'] / l['engine']['tokens_per_s']:>6.2f} "
                  f"{l.get('engine_eager', nan)['tokens_per_s']:>9.1f} "
                  f"{l.get('engine_compiled_eager', nan)['tokens_per_s']:>18.1f} "
                  f"{compiled.get('vs_roofline', float('nan')):>13.2f}")
    by_batch = {r["batch"]: r for r in rows}
    goals = {}
    if device.type == "cuda":
        if 32 in by_batch:
            b32 = by_batch[32]
            goals["decode_vs_roofline_b32_h200"] = Goal(b32["inprocess"]["engine"]["vs_roofline"], ">= 0.6")
            if "disaggregated_vs_inprocess" in b32:
                goals["grpc_vs_inprocess_b32_h200"] = Goal(b32["disaggregated_vs_inprocess"], ">= 0.85")
            goals["ttft_ms_512_b32_h200"] = Goal(ttft["median_ms"], "> 0")  # reported beside its roofline
        if "disaggregated_vs_inprocess" in by_batch.get(1, {}):
            goals["grpc_vs_inprocess_b1_h200"] = Goal(by_batch[1]["disaggregated_vs_inprocess"], ">= 0.6")
    print(f"engine time to first token, {ttft_batch(args)} x {args.prompt}-token prompts: "
          f"median {ttft['median_ms']:.1f} ms, max {ttft['max_ms']:.1f} ms" +
          (f"; with expert functions median {shm_ttft['median_ms']:.1f} ms" if shm_ttft else ""))
    write_results(args.name, device, rows, goals, out=Path(args.out), checkpoint=checkpoint, modes=sorted(modes),
                  predictor=args.predictor, compile=args.compile, lean=args.lean, hardware=hw, ttft={"batch": ttft_batch(args), **ttft},
                  ttft_disaggregated=shm_ttft and {"batch": ttft_batch(args), **shm_ttft},
                  expert_functions=args.experts,
                  # how the processes share the GPU: MPS where run_h200.sh started its daemon (KUBEMOE_MPS=1)
                  # (the disaggregated configuration's processes; the others run alone on the GPU)
                  gpu_sharing="mps" if mps_pipe else "time-slicing",
                  method=f"model: median decode step of {args.steps} after {args.warmup} warm-up steps after a "
                         f"batched {args.prompt}-token prefill, greedy, the forward pass alone; engine: the same "
                         "through the engine as served (requests sent at once, median gap between a request's tokens "
                         "once all decode; decode passes replayed as CUDA graphs on a GPU; the goals read these); "
                         "engine_eager: the same engine launching every kernel (no graphs); engine_no_lookahead: "
                         "the same engine reading each step's tokens before launching the next pass; "
                         "engine_compiled (--compile): the same engine with its decode passes compiled "
                         "(torch.compile, frontend/compiled.py; the first passes compile in the warm-up run), "
                         "engine_compiled_eager the same without graphs; "
                         f"{args.experts} expert-function processes on the "
                         "same device through shared memory, a decode graph's remote layers through device links "
                         "(expert_fn/device_link.py; engine.linked_layers counts them) and engine_calls the same "
                         "engine with those layers as calls; roofline = bytes per step / measured HBM read "
                         "bandwidth (uniform routing); prefill roofline = FLOPs / measured bf16 matmul rate")


if __name__ == "__main__":
    main()
