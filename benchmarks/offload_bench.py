#!/usr/bin/env python3
"""The offload path MEASURED: kubemoe (PreSched) and every baseline policy in the same engine, side by side.

What runs: the `transformers` model of a bench preset (Mixtral-8x7B-size and Qwen3-30B-A3B-size layers,
only a few of them: `kubemoe/presets.py`), its non-expert weights on the GPU, every expert's weights in
pinned host memory (random, generated on the machine, nothing read from disk), each MoE layer's routed
experts run by the offload executor (`frontend/offload/executor.py`) under each policy: kubemoe
(PreSched), on-demand (accelerate-style), gpu-prefetch (Fate / Klotski), fiddler-like, hybrimoe-like,
static-split (kTransformers / `--n-cpu-moe`) and the oracle (clairvoyant: told the next layer's actual
routing). Batches of 4..64 sequences, 512-token prompts, then decoding; throughput (generated tokens per
second, prefill included) and the mean decode step per policy.

Routing is REPLAYED, never the random weights' own (they route almost uniformly, which would make the hot
table and every predictor look useless): each MoE layer's experts come from the routing trace of kubemoe's
trained base model (`benchmarks/results/routing_trace_base_h200.safetensors`, written by
predictor_accuracy.py: `experts` [N, 8, 2] of 16 experts, and `predicted_d1`, the fine-tuned router
predictor's guesses for each layer from the one before), and the lookahead gets the recorded prediction
(the oracle: the actual next routing). Sequence b of a batch reads trace tokens (b * N / batch + position)
mod N, so consecutive steps follow consecutive text. The trace's 16 experts map onto the preset's:
`map_experts` (Mixtral's 8: experts paired; Qwen's 128: each trace expert owns a block of 8, a token
takes 4 of each of its two blocks, spread by the other choice). The hot table is ranked by the trace's counts.

The GPU budget is capped so most experts do not fit (`--resident-share` of the experts beside the working
set). Also measured: the pinned host-to-GPU peak (one 1 GiB copy) and the bandwidth the store's chunked
copies reach while streaming (kubemoe and on-demand runs, CUDA events per copy); ablations at one batch
(no hot table, no prediction, no AsyncIO streams; "no PreSched" is the gpu-prefetch row); what
`frontend/offload/pipeline.py` predicts from the measured costs for PCIe 3.0 / 4.0 (MODELLED); and, when
`accelerate` is installed, `transformers` with accelerate's `device_map` offload as the external peer.
Goals: throughput_vs_ondemand >= 2.4, throughput_vs_hybrimoe >= 1.7, throughput_vs_fiddler >= 1.3
(geometric means over presets and batches), step_vs_oracle <= 1.15, pcie_util >= 0.85, llapor_top4_hit >= 0.94
(LLaPor's candidate hit as llapor_accuracy.py measured it on the same base model: benchmarks/results/llapor_h200.json).

    python benchmarks/offload_bench.py --device cuda --out $OUT         # the H200 run (benchmarks/run_h200.sh offload)
    python benchmarks/offload_bench.py --device cpu --tiny              # smoke test: tiny presets on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kubemoe.frontend.embedded import shared_cores_env

os.environ.update(shared_cores_env())  # as an offload frontend runs (frontend/cli.py), set before torch loads OpenMP

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_trace  # noqa: E402
from common import RESULTS, Goal, print_table, write_results  # noqa: E402

from kubemoe.adapters import MoEAdapter, install_routed_experts  # noqa: E402
from kubemoe.devices import serving_attention  # noqa: E402
from kubemoe.expert import ExpertWeights  # noqa: E402
from kubemoe.frontend.offload.config import OffloadConfig  # noqa: E402
from kubemoe.frontend.offload.baselines import FiddlerLike, GatePrefetch, HybriMoELike, OnDemand, Oracle  # noqa: E402
from kubemoe.frontend.offload.executor import OffloadExecutor  # noqa: E402
from kubemoe.frontend.offload.hot_table import TokenCounter, working_set_bytes  # noqa: E402
from kubemoe.frontend.offload.lookahead import NoLookahead, Replayed  # noqa: E402
from kubemoe.frontend.offload.cpu_experts import default_threads  # noqa: E402
from kubemoe.frontend.offload.pipeline import (  # noqa: E402
    PCIE_BANDWIDTH, LayerRouting, StepTrace, simulate, step_lower_bound)
from kubemoe.frontend.offload.presched import PreSched  # noqa: E402
from kubemoe.frontend.offload.runtime import build_executor  # noqa: E402
from kubemoe.frontend.offload.stats import OffloadSeconds, OffloadStats  # noqa: E402
from kubemoe.frontend.offload.store import HostExperts  # noqa: E402
from kubemoe.gc_freeze import settle  # noqa: E402
from kubemoe.presets import get_preset  # noqa: E402
from kubemoe.synth import build_config  # noqa: E402

TRACE = RESULTS / "routing_trace_base_h200.safetensors"
LLAPOR = RESULTS / "llapor_h200.json"
PRESETS = {"mixtral": ("mixtral", "mixtral-4l"), "qwen3": ("qwen3_moe", "qwen3-30b-a3b-8l")}
TINY = {"mixtral": ("mixtral", "tiny"), "qwen3": ("qwen3_moe", "tiny")}
POLICIES = ("kubemoe", "on-demand", "gpu-prefetch", "fiddler-like", "hybrimoe-like", "static-split", "oracle")
TRACED_STEP = 3  # the decode step --torch-trace records: one from the middle of a run
ABLATIONS = {"no-hot-table": {"hot_table": False}, "no-prediction": {"lookahead": "none"},
             "no-asyncio": {"async_io": False}}
WEIGHT_STD = 0.02


# -- routing replay ----------------------------------------------------------------------------------

def map_experts(choices: torch.Tensor, source_experts: int, experts: int, top_k: int) -> torch.Tensor:
    """Per-token expert choices [N, Ks] of a `source_experts` model -> [N, top_k] distinct experts of `experts`.

    Source expert s owns the block starting at floor(s * experts / source_experts) of ceil(experts /
    source_experts) experts; a token takes top_k / Ks experts of each of its choices' blocks, rotated by
    its other choices (so co-occurrence spreads over the block); collisions move to the next free expert.
    Popularity skew and co-occurrence of the trace carry over; -1 rows (no prediction) stay -1.
    """
    n, ks = choices.shape
    block = experts / source_experts
    width = max(1, math.ceil(block))
    out = torch.full((n, top_k), -1, dtype=torch.long)
    for row, picks in enumerate(choices.tolist()):
        if picks[0] < 0:
            continue
        chosen: list[int] = []
        total = sum(picks)
        for j in range(top_k):
            s, r = picks[j % ks], j // ks
            e = (int(s * block) + (r + total - s) % width) % experts
            while e in chosen:
                e = (e + 1) % experts
            chosen.append(e)
        out[row] = torch.tensor(chosen)
    return out


@dataclass
class Trace:
    actual: torch.Tensor  # [N, L, K] the preset's experts per trace token and MoE layer
    predicted: torch.Tensor  # [N, L, K] the recorded prediction of each layer, made one layer earlier (-1: none)
    source: dict

    @classmethod
    def load(cls, path: Path, layers: int, experts: int, top_k: int) -> "Trace":
        with safe_open(path, "pt") as f:
            meta = f.metadata()
            actual, predicted = f.get_tensor("experts").long(), f.get_tensor("predicted_d1").long()
        if actual.shape[1] < layers:
            raise SystemExit(f"the trace has {actual.shape[1]} MoE layers; the preset needs {layers}")
        source_experts = int(meta["num_experts"])
        mapped = [torch.stack([map_experts(t[:, l], source_experts, experts, top_k) for l in range(layers)], 1)
                  for t in (actual, predicted)]
        return cls(mapped[0], mapped[1], dict(meta))

    def rows(self, batch: int, start: int, length: int) -> torch.Tensor:  # [batch * length] trace rows
        n = len(self.actual)
        stride = n // batch
        return torch.tensor([(b * stride + start + p) % n for b in range(batch) for p in range(length)])

    def counter(self, layers: tuple[int, ...]) -> TokenCounter:
        counts = TokenCounter()
        for position in range(self.actual.shape[1]):
            experts, tokens = self.actual[:, position].reshape(-1).unique(return_counts=True)
            counts.add(layers[position], dict(zip(experts.tolist(), tokens.tolist())))
        return counts

    def predicted_accuracy(self) -> float:
        """Top-k set accuracy of the recorded prediction (layers 1..L-1)."""
        hits = (self.predicted[:, 1:].unsqueeze(-1) == self.actual[:, 1:].unsqueeze(-2)).any(-1)
        return hits.float().mean().item()


class Replay:
    """Feeds the replayed routing to each MoE layer and the recorded (or actual) next routing to the lookahead."""

    def __init__(self, trace: Trace, layers: tuple[int, ...], num_experts: int, device: torch.device):
        self.layers, self.device = layers, device
        self.actual, self.predicted = trace.actual.to(device), trace.predicted.to(device)
        self.lookahead = Replayed(num_experts)
        self.rows: torch.Tensor | None = None  # trace rows of this forward pass's tokens, in the model's order
        self.clairvoyant = False
        self.predict = True

    def routing(self, position: int, tokens: int):  # -> (experts [T, K], weights [T, K])
        index = self.actual[self.rows, position]
        self.lookahead.next.clear()
        if self.predict and position + 1 < len(self.layers):
            ahead = self.actual if self.clairvoyant else self.predicted
            self.lookahead.next[self.layers[position]] = ahead[self.rows, position + 1]
        return index, torch.full(index.shape, 1.0 / index.shape[1], device=self.device)


class ReplayedExperts(torch.nn.Module):
    def __init__(self, bench: "Bench", position: int):
        super().__init__()
        self.bench, self.position = bench, position

    def forward(self, hidden_states, top_k_index, top_k_weights):
        index, weights = self.bench.replay.routing(self.position, hidden_states.shape[0])
        return self.bench.executor.run_layer(self.bench.layers[self.position], hidden_states, index, weights)


# -- the model --------------------------------------------------------------------------------------------

@dataclass
class Run:
    preset: str
    policy: str
    batch: int
    prompt: int
    output: int
    prefill_s: float
    decode_steps_s: list
    stats: OffloadStats
    decode: OffloadStats  # the decode steps' share of `stats` (prefill excluded)
    copied_bytes: int = 0
    copy_s: float = 0.0
    decode_seconds: OffloadSeconds = field(default_factory=OffloadSeconds)  # the decode steps' host-side split
    decode_end_waits_s: list = field(default_factory=list)  # per step: the host waiting for the GPU at its end

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.output / (self.prefill_s + sum(self.decode_steps_s))

    @property
    def decode_step_s(self) -> float:
        return statistics.mean(self.decode_steps_s)

    def summary(self) -> str:
        """One line: throughput, the mean decode step and its host-side split per step, hit rate, and the CPU
        experts per decode step with their share of the decode steps' routed tokens (a few tokens each)."""
        row = self.row()
        return (f"{self.tokens_per_s:9.1f} tok/s, step {self.decode_step_s * 1e3:8.2f} ms (MoE layers "
                f"{row['decode_layers_s_per_step'] * 1e3:.2f}, decisions {row['decode_decide_s_per_step'] * 1e3:.2f}, "
                f"CPU wait {row['decode_cpu_wait_s_per_step'] * 1e3:.2f}, GPU at the end "
                f"{row['decode_end_wait_s_per_step'] * 1e3:.2f}), hit {self.stats.hit_rate:.2f}, "
                f"CPU experts {row['decode_cpu_experts_per_step']:.1f} a step ({self.decode.cpu_share:.3f} of tokens)")

    def row(self) -> dict:
        s, steps = self.stats, max(len(self.decode_steps_s), 1)
        return {"preset": self.preset, "policy": self.policy, "batch": self.batch, "prompt": self.prompt,
                "output": self.output, "tokens_per_s": self.tokens_per_s, "decode_step_s": self.decode_step_s,
                "prefill_s": self.prefill_s, "hit_rate": s.hit_rate, "prefetch_accuracy": s.prefetch_accuracy,
                "cpu_share": s.cpu_share, "bytes_copied": s.bytes_copied, "loaded": s.loaded,
                "prefetched": s.prefetched, "cpu_experts": s.cpu_experts,
                "stream_bytes_per_s": self.copied_bytes / self.copy_s if self.copy_s else None,
                # Per decode step: what the decisions moved, and the steps' spread (a slow first step is
                # a kernel compiled or loaded mid-run, which the warm-up is there to prevent).
                "decode_bytes_per_step": self.decode.bytes_copied / steps,
                "decode_loaded_per_step": self.decode.loaded / steps,
                "decode_prefetched_per_step": self.decode.prefetched / steps,
                "decode_cpu_experts_per_step": self.decode.cpu_experts / steps,
                # Host wall time per decode step in the MoE layers, in the decisions, and blocked on CPU experts.
                **{f"decode_{name}_s_per_step": value / steps for name, value in vars(self.decode_seconds).items()},
                "decode_end_wait_s_per_step": sum(self.decode_end_waits_s) / steps,
                "decode_step_median_s": statistics.median(self.decode_steps_s),
                "decode_step_max_s": max(self.decode_steps_s), "decode_steps_s": self.decode_steps_s}


class Bench:
    def __init__(self, arch: str, preset_name: str, device: torch.device, trace_path: Path, resident_share: float,
                 cpu_threads: int | None = None):
        from transformers import AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        self.preset = get_preset(arch, preset_name)
        self.name = f"{arch}/{preset_name}"
        self.device, self.cpu_threads = device, cpu_threads
        self.trace_dir: Path | None = None  # while set, each run's decode step TRACED_STEP is traced into it
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        config = build_config(self.preset)
        self.adapter = MoEAdapter(config)
        self.layers = self.adapter.moe_layers
        e, k = self.adapter.num_experts, self.adapter.top_k
        self.trace = Trace.load(trace_path, len(self.layers), e, k)
        self.replay = Replay(self.trace, self.layers, e, device)
        self.executor: OffloadExecutor | None = None
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        for position, layer in enumerate(self.layers):
            install_routed_experts(self.adapter, model, layer, ReplayedExperts(self, position))
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * WEIGHT_STD)
        self.model = model.to(device).eval()
        start = time.perf_counter()
        self.host = HostExperts(self.layers, e, self.adapter.hidden_size, self.adapter.expert_intermediate_size,
                                self.dtype, self._random_expert, pin_memory=device.type == "cuda")
        self.setup_s = time.perf_counter() - start
        self.expert_bytes = self.host.expert_bytes
        working = working_set_bytes(self.expert_bytes, k)
        self.resident = int(resident_share * len(self.layers) * e)
        self.budget = working + self.resident * self.expert_bytes
        self.counter = self.trace.counter(self.layers)
        self.profile = None  # measured by the first executor, then shared by every policy
        self.cpu_dtype = None  # likewise

    def _random_expert(self, layer: int, expert: int) -> ExpertWeights:
        i, h = self.adapter.expert_intermediate_size, self.adapter.hidden_size
        gen = self.device if self.device.type == "cuda" else "cpu"  # generated where it is fast
        gate_up = (torch.randn(2 * i, h, device=gen, dtype=self.dtype) * WEIGHT_STD).cpu()
        down = (torch.randn(h, i, device=gen, dtype=self.dtype) * WEIGHT_STD).cpu()
        return ExpertWeights(gate_up, down)

    def start(self, policy: str, **ablation) -> None:
        lookahead = NoLookahead() if ablation.pop("lookahead", None) == "none" else self.replay.lookahead
        engine_policy = "kubemoe" if policy == "oracle" else policy
        config = OffloadConfig(self.budget, policy=engine_policy, cpu_threads=self.cpu_threads, **ablation)
        self.executor = build_executor(config, self.host, self.adapter.top_k, self.device, self.adapter.act,
                                       self.adapter.routing.weight_on_input, lookahead, counter=self.counter,
                                       profile=self.profile, timing=self.device.type == "cuda",
                                       cpu_dtype=self.cpu_dtype)
        if policy == "oracle":
            self.executor.policy = Oracle()
        self.replay.clairvoyant = policy == "oracle"
        self.replay.predict = not isinstance(lookahead, NoLookahead)
        if self.profile is None:  # measured once per preset, shared by every policy (t_attn refreshes per run)
            self.profile, self.cpu_dtype = self.executor.profile, self.executor.cpu.dtype
        settle()  # what exists now out of the collector's sight, as a frontend does once ready (kubemoe/gc_freeze.py)

    def stop(self) -> None:
        self.executor.close()
        self.executor = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def generate(self, label: str, batch: int, prompt: int, output: int, trace_start: int = 0) -> Run:
        from transformers import DynamicCache

        before = OffloadStats()
        before.add(self.executor.stats)
        store = self.executor.store
        store.copy_seconds()  # drop the timings of the start-up copies
        ids = torch.randint(0, self.model.config.vocab_size, (batch, prompt), device=self.device)
        cache = DynamicCache()
        self.sync()
        start = time.perf_counter()
        self.replay.rows = self.trace.rows(batch, trace_start, prompt).to(self.device)
        logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        self.sync()
        prefill = time.perf_counter() - start
        after_prefill = _since(before, self.executor.stats)
        seconds_at_decode = _since(OffloadSeconds(), self.executor.seconds)
        steps, waits = [], []
        traced = self.trace_dir / f"{label}-b{batch}.json" if self.trace_dir else None
        for step in range(output - 1):
            with torch_trace.window(traced) if traced and step == TRACED_STEP else contextlib.nullcontext():
                start = time.perf_counter()
                self.replay.rows = self.trace.rows(batch, trace_start + prompt + step, 1).to(self.device)
                logits = self.model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                token = logits[:, -1].argmax(-1, keepdim=True)
                launched = time.perf_counter()
                self.sync()
                steps.append(time.perf_counter() - start)
                waits.append(steps[-1] - (launched - start))
        stats = _since(before, self.executor.stats)
        copied, seconds = store.copy_seconds() if store.timing else (0, 0.0)
        return Run(self.name, label, batch, prompt, output, prefill, steps, stats, _since(after_prefill, stats),
                   copied, seconds, _since(seconds_at_decode, self.executor.seconds), waits)

    def decode_traces(self, batch: int, prompt: int, output: int) -> list[StepTrace]:
        """The decode steps `generate` replays, as pipeline.py's step traces (layers as MoE positions)."""
        steps = []
        for step in range(output - 1):
            rows = self.trace.rows(batch, prompt + step, 1)
            layers = []
            for p in range(len(self.layers)):
                layers.append(LayerRouting(p, _counts(self.trace.actual[rows, p]), _counts(self.trace.predicted[rows, p])))
            steps.append(StepTrace(batch, tuple(layers)))
        return steps


def median_run(runs: list[Run]) -> Run:
    """The round of median throughput of the same (preset, policy, batch), the slower middle one of an even
    count: the H200 host moved a configuration's figures by up to 2x between rounds (at 561a154 kubemoe's
    Mixtral rows ran 0.75-0.87x on-demand in the round it ran first, 1.37-1.40x in the other), so a
    mean of rounds is a mean with an outlier in it."""
    ranked = sorted(runs, key=lambda run: run.tokens_per_s)
    return ranked[(len(ranked) - 1) // 2]


def _since(before, now):  # an OffloadStats or OffloadSeconds: now - before, field by field
    return type(now)(**{k: getattr(now, k) - getattr(before, k) for k in vars(before)})


def _counts(experts: torch.Tensor) -> dict[int, int]:
    values, counts = experts.reshape(-1).unique(return_counts=True)
    return {e: n for e, n in zip(values.tolist(), counts.tolist()) if e >= 0}


def pinned_peak(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of one large pinned host-to-GPU copy (the link's practical peak)."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    samples = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return nbytes / statistics.median(samples[1:])


# -- the external peer: transformers + accelerate device_map offload -----------------------------------

def accelerate_peer(bench: Bench, batch: int, prompt: int, output: int) -> dict:
    """transformers' own model, accelerate offloading what does not fit in the same GPU budget (whole decoder
    layers, as `device_map="auto"` places them), on the model's own routing (accelerate copies every offloaded
    layer whole, whatever the routing)."""
    try:
        import accelerate
        from accelerate import dispatch_model, infer_auto_device_map
    except ImportError:
        return {"policy": "accelerate", "skipped": "accelerate is not installed (add its wheel to .whl/)"}
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.initialization import no_init_weights

    config = bench.model.config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=bench.dtype)
    state = {k: v for k, v in bench.model.state_dict().items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in state:
                p.copy_(state[name])
        for position, layer in enumerate(bench.layers):
            experts = bench.adapter.experts_module(model, layer)
            for e in range(bench.adapter.num_experts):
                w = bench.host.weights((layer, e))
                experts.gate_up_proj[e].copy_(w.gate_up)
                experts.down_proj[e].copy_(w.down)
    non_experts = sum(v.numel() * v.element_size() for v in state.values())
    layer_class = type(model.model.layers[0]).__name__
    device_map = infer_auto_device_map(model, max_memory={bench.device.index or 0: non_experts + bench.budget,
                                                          "cpu": 10 * bench.host.nbytes},
                                       no_split_module_classes=[layer_class])
    model = dispatch_model(model.eval(), device_map=device_map)
    on_gpu = sum(1 for d in device_map.values() if d not in ("cpu", "disk"))
    ids = torch.randint(0, config.vocab_size, (batch, prompt), device=bench.device)
    with torch.inference_mode():
        cache = DynamicCache()
        bench.sync()
        start = time.perf_counter()
        token = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        bench.sync()
        prefill = time.perf_counter() - start
        steps = []
        for _ in range(output - 1):
            start = time.perf_counter()
            token = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            bench.sync()
            steps.append(time.perf_counter() - start)
    del model
    return {"preset": bench.name, "policy": "accelerate", "batch": batch, "prompt": prompt, "output": output,
            "tokens_per_s": batch * output / (prefill + sum(steps)), "decode_step_s": statistics.mean(steps),
            "prefill_s": prefill, "accelerate": accelerate.__version__,
            "device_map": f"{on_gpu} of {len(device_map)} modules on the GPU, the rest offloaded to the CPU",
            "routing": "the random weights' own (accelerate copies each offloaded layer whole)"}


# -- the run --------------------------------------------------------------------------------------------

def geomean(values) -> float:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def steps_vs_bound(raw: list[dict], bounds: list[dict]) -> dict[str, float]:
    """Per policy, the geometric mean over presets and batches of its decode step over the lower bound for any
    policy (hardware_bounds): how far each is from the limit, and so the most a schedule could gain over it
    on this host (a throughput goal above a baseline's figure here cannot be met by scheduling)."""
    bound = {(b["preset"], b["batch"]): b["any_policy_lower_bound_s_per_step"] for b in bounds}
    policies = dict.fromkeys(r["policy"] for r in raw)
    return {policy: geomean(r["decode_step_s"] / bound[(r["preset"], r["batch"])] for r in raw
                            if r["policy"] == policy and (r["preset"], r["batch"]) in bound) for policy in policies}


def modelled(bench: Bench, resident: frozenset, batches, prompt: int, output: int) -> list[dict]:
    """pipeline.py's step times with the measured costs, t_io rescaled to PCIe 3.0 / 4.0: MODELLED."""
    rows = []
    for link in ("pcie3", "pcie4"):
        profile = bench.profile.at_bandwidth(PCIE_BANDWIDTH[link], link)
        for batch in batches:
            steps = bench.decode_traces(batch, prompt, output)
            for policy in (PreSched(), OnDemand(), GatePrefetch(), FiddlerLike(), HybriMoELike(), Oracle()):
                result = simulate(steps, policy, profile, bench.expert_bytes, resident, bench.adapter.top_k)
                rows.append({"preset": bench.name, "link": link, "batch": batch, **result.summary()})
    return rows


def hardware_bounds(bench: Bench, resident: frozenset, batches, prompt: int, output: int, peak: float | None) -> list[dict]:
    """Per decode step, from the replayed routing and the measured figures: the bytes that must cross PCIe
    when every missing expert runs on the GPU (the hot table resident, nothing predicted) and their time at
    the pinned peak; the experts' GPU compute; and pipeline.py's lower bound for any policy (CPU allowed)."""
    costs = bench.profile.costs(bench.expert_bytes)
    rows = []
    for batch in batches:
        steps = bench.decode_traces(batch, prompt, output)
        missing = [sum(1 for l in step.layers for e in l.actual if (l.layer, e) not in resident) for step in steps]
        nbytes = statistics.mean(missing) * bench.expert_bytes
        compute = statistics.mean(sum(costs.t_g(n) for l in step.layers for n in l.actual.values()) for step in steps)
        bound = statistics.mean(step_lower_bound(step, bench.profile, bench.expert_bytes, resident) for step in steps)
        rows.append({"preset": bench.name, "batch": batch, "missing_experts_per_step": statistics.mean(missing),
                     "missing_bytes_per_step": nbytes,
                     # without a GPU (the CPU smoke test) the profile's t_io stands in for the peak
                     "pcie_s_per_step": nbytes / peak if peak else statistics.mean(missing) * costs.t_io,
                     "gpu_expert_compute_s_per_step": compute, "any_policy_lower_bound_s_per_step": bound})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--presets", default="mixtral,qwen3", help="comma-separated: mixtral, qwen3")
    parser.add_argument("--tiny", action="store_true", help="the tiny presets (a CPU smoke test)")
    parser.add_argument("--batches", default="4,16,64")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=12, help="generated tokens per sequence and round (issue: 64; "
                                                                   "3 rounds of 12 keep the H200 run within 8 minutes)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over the configurations, round r starting r / rounds of the way along the list: a "
                             "configuration's place in the run moved its figures by up to 1.8x on the H200 host")
    parser.add_argument("--ablation-batch", type=int, default=16)
    parser.add_argument("--resident-share", type=float, default=0.25,
                        help="experts the budget holds beside the working set, as a share of all experts")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--no-ablations", action="store_true")
    parser.add_argument("--cpu-threads", type=int, help="the CPU expert pool's threads (default: the engine's)")
    parser.add_argument("--torch-trace", type=Path,
                        help="folder for a torch.profiler trace of one decode step of each configuration's last-round run")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    # As the frontend serves: without it, whichever configuration met a decode key length first paid cuDNN's
    # plan for it (50 ms in a step of kubemoe's, run first in round 0, on the H200 at 46cbd49).
    serving_attention(device)
    if args.torch_trace:
        args.torch_trace.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    policies = args.policies.split(",")
    presets = TINY if args.tiny else PRESETS
    started = time.perf_counter()
    peak = pinned_peak(device) if device.type == "cuda" else None
    raw, ablations, peers, models, setups, bounds = [], [], [], [], {}, []
    rounds: list[dict] = []  # every round's row; raw and ablations take each configuration's median round
    for key in args.presets.split(","):
        arch, name = presets[key]
        bench = Bench(arch, name, device, args.trace, args.resident_share, args.cpu_threads)
        setups[name] = {"expert_bytes": bench.expert_bytes, "moe_layers": len(bench.layers),
                        "experts": bench.adapter.num_experts, "top_k": bench.adapter.top_k,
                        "budget_bytes": bench.budget, "resident_experts": bench.resident,
                        "host_bytes": bench.host.nbytes, "pinned": bench.host.pinned, "weights_s": bench.setup_s,
                        "replayed_prediction_topk_accuracy": bench.trace.predicted_accuracy()}
        print(f"--- {name}: {bench.host.nbytes / 2**30:.1f} GiB of experts in host memory, budget "
              f"{bench.budget / 2**30:.2f} GiB ({bench.resident} resident), weights in {bench.setup_s:.0f}s", flush=True)
        # The profile (measured by the first executor) and a warm-up of every batch's prompt and first decode
        # steps: the first call of each shape compiles or loads its kernels (oneDNN on the CPU, CUDA's lazy
        # module loading on the GPU, which also synchronises the device); measured cold, whichever policy ran
        # first paid for every later one (at e5599a0 kubemoe ran first and its own configuration, measured
        # again as the last ablations, ran 1.8x faster). Every policy then starts from the warmed profile.
        bench.start("kubemoe")
        for batch in batches:
            bench.generate("warm-up", batch, args.prompt, 3)
        bench.profile = bench.executor.profile
        setups[name]["profile"] = bench.profile.to_dict()
        costs = bench.profile.costs(bench.expert_bytes)
        print(f"    profile: t_io {costs.t_io * 1e3:.3f} ms an expert ({bench.expert_bytes / costs.t_io / 1e9:.1f} GB/s), "
              f"t_g {costs.t_g(1) * 1e3:.3f} ms alone at 1 token, t_c {costs.cpu(1) * 1e3:.3f} ms at 1 token",
              flush=True)
        bench.stop()
        resident = frozenset()
        runs: dict[tuple[str, int], list[Run]] = {}  # (policy or ablation, batch) -> one run per round
        configurations = [(p, {}) for p in policies] + [(label, ablation) for label, ablation in ABLATIONS.items()
                                                        if not args.no_ablations]
        for round_ in range(args.rounds):
            # Round r starts r / rounds of the way along the list (round 2 of 2: the second half first), so
            # no configuration always runs early (cold host memory, caches) or late.
            shift = round_ * len(configurations) // args.rounds
            # The last round is traced: by then every configuration has run and met every shape once.
            bench.trace_dir = args.torch_trace if round_ == args.rounds - 1 else None
            for label, ablation in configurations[shift:] + configurations[:shift]:
                for batch in (batches if label in policies else [args.ablation_batch]):
                    bench.start(label if label in policies else "kubemoe", **ablation)
                    if label == "kubemoe":
                        resident = frozenset(bench.executor.resident_slot)
                    run = bench.generate(label, batch, args.prompt, args.output)
                    bench.stop()
                    runs.setdefault((label, batch), []).append(run)
                    row = run.row()
                    rounds.append({**row, "round": round_})
                    print(f"{name} round {round_} {label:>14} b{batch:<3} {run.summary()}", flush=True)
        for (label, batch), measured in runs.items():
            (raw if label in policies else ablations).append(median_run(measured).row())
        models += modelled(bench, resident, batches, args.prompt, args.output)
        bounds += hardware_bounds(bench, resident, batches, args.prompt, args.output, peak)
        if not args.no_accelerate and device.type == "cuda":
            try:
                peers.append(accelerate_peer(bench, args.ablation_batch, args.prompt, min(args.output, 8)))
            except Exception as e:  # noqa: BLE001 - the peer is extra: report why it did not run
                peers.append({"preset": name, "policy": "accelerate", "error": f"{type(e).__name__}: {e}"})
        bench.host.close()
        del bench

    def ratio(a: str, b: str, key="tokens_per_s"):  # geometric mean over presets and batches of a's / b's
        by = {(r["preset"], r["policy"], r["batch"]): r[key] for r in raw}
        return geomean(by[(p, a, n)] / by[(p, b, n)] for (p, pol, n) in by if pol == a and (p, b, n) in by)

    print_table(raw, [("preset", "preset", "s"), ("policy", "policy", "s"), ("batch", "batch", "d"),
                      ("tokens_per_s", "tok/s", ".1f"), ("decode_step_s", "step s", ".4f"), ("hit_rate", "hit", ".2f"),
                      ("prefetch_accuracy", "pref acc", ".2f"), ("cpu_share", "cpu", ".2f")])
    vs_bound = steps_vs_bound(raw, bounds)
    print("decode step / any policy's lower bound:", ", ".join(f"{p} {v:.2f}x" for p, v in vs_bound.items()))
    streamed = [r for r in raw if r["policy"] in ("kubemoe", "on-demand") and r["stream_bytes_per_s"]]
    stream_bw = geomean(r["stream_bytes_per_s"] for r in streamed) if streamed else float("nan")
    goals = {
        "throughput_vs_ondemand": Goal(ratio("kubemoe", "on-demand"), ">= 2.4"),
        "throughput_vs_hybrimoe": Goal(ratio("kubemoe", "hybrimoe-like"), ">= 1.7"),
        "throughput_vs_fiddler": Goal(ratio("kubemoe", "fiddler-like"), ">= 1.3"),
        "step_vs_oracle": Goal(ratio("kubemoe", "oracle", "decode_step_s"), "<= 1.15"),
    }
    if peak:
        goals["pcie_util"] = Goal(stream_bw / peak, ">= 0.85")
    llapor_note = "not found"
    if LLAPOR.is_file():
        measured = json.loads(LLAPOR.read_text())
        goals["llapor_top4_hit"] = Goal(measured["goals"]["llapor_top4_hit"]["value"], ">= 0.94")
        llapor_note = f"read from {LLAPOR.name} (llapor_accuracy.py at {measured['commit'][:10]} on {measured['machine']})"
    write_results(
        "offload", device, raw, goals, out=args.out,
        measured="MEASURED: the offload executor in the transformers model, random weights, ROUTING REPLAYED from "
                 f"kubemoe's trained base model ({args.trace.name}: {setups and next(iter(setups.values()))['moe_layers']}"
                 " layers used; the lookahead gets the recorded fine-tuned router predictor's d=1 guesses, the oracle "
                 "the actual next routing)",
        routing_source=bench_trace_meta(args.trace), presets=setups,
        settings={"batches": batches, "prompt": args.prompt, "output": args.output, "rounds": args.rounds,
                  "output_note": f"the issue asks 64 output tokens; {args.rounds} rounds of {args.output} keep the run "
                                 "within 8 minutes" if args.output * args.rounds < 64 else "",
                  "rounds_note": "raw and ablations rows are each configuration's round of median throughput (the "
                                 "slower middle one of an even count); each round ran the configurations in another "
                                 "order (rounds_raw: every round)",
                  "resident_share": args.resident_share,
                  "cpu_threads": args.cpu_threads or default_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
        pinned_peak_bytes_per_s=peak, streaming_bytes_per_s=stream_bw,
        hardware_bound="H2D copies bounded by the measured pinned peak (PCIe 5.0 x16 on the H100 and H200 hosts); CPU experts "
                       "by the host's cores and memory bandwidth; per decode step see hardware_bounds",
        hardware_bounds=bounds, decode_step_vs_bound=vs_bound,
        ablations=ablations, ablation_note="no PreSched = the gpu-prefetch row (same hot table and prediction)",
        modelled_links=models, modelled_note="MODELLED: pipeline.py with the costs measured here, t_io rescaled",
        external_peers=peers, llapor=llapor_note, rounds_raw=rounds, seconds=round(time.perf_counter() - started, 1),
    )


def bench_trace_meta(path: Path) -> dict:
    with safe_open(path, "pt") as f:
        return dict(f.metadata())


if __name__ == "__main__":
    main()
