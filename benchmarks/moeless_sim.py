"""MoEless in simulation: kubemoe's scaler + placer + per-iteration split against static EP, EPLB and the oracle.

    python benchmarks/moeless_sim.py                       # recorded and generated loads, 8 and 1000 GPUs
    python benchmarks/moeless_sim.py --scales 8            # MoEless's scale only
    python benchmarks/moeless_sim.py --sources recorded    # the trained model's routing only
    python benchmarks/moeless_sim.py --traces loads.json   # per-iteration loads from elsewhere

Two sources of per-iteration expert loads, each as decode-sized iterations (a batch of sequences,
one token each) and prefill-sized ones (the prompts that arrived), reported separately:
- recorded: the trained model's routing (benchmarks/results/routing_trace_base_h200.safetensors,
  written by predictor_accuracy.py on the H200: 64 held-out requests of 256 tokens, 8 MoE layers x
  16 experts, top-2, with the fine-tuned d=1 predictor's guesses). At 8 GPUs it replays on the
  trained layout itself (8 x 16, top-2) with Mixtral-sized experts and hidden states (no mapping);
  at 1000 GPUs it is mapped onto DeepSeek-V3's layout (`recorded_trace` says how). Iterations are
  made of recorded rows (`replay_rows`), with the generated traces' bursty arrivals. kubemoe plans
  and splits on the real predictor's counts (layer 0, which it does not predict: the previous
  window's observed loads, the step's own counts).
- generated, seeded and made here: per layer a Zipf-like expert popularity (a random permutation
  of ranks), drifting (a random walk of the log-popularities, and every `shift_every` iterations two
  experts trade places), and bursty Azure-like arrivals (a log-normal AR(1) rate, so quiet stretches
  and bursts alternate); prompt lengths log-normal; each token picks top-k experts from the layer's
  popularity (multinomial, the top-k overlap ignored). A prediction at distance d is the truth times
  exp(N(0, (error_per_distance * d)^2)), per expert, per window and per iteration.
Layouts: Mixtral's (32 MoE layers x 8 experts of 336 MiB, bf16, top-2) on 8 GPUs for generated loads,
the trained one above on 8 GPUs for recorded ones, and DeepSeek-V3's (58 x 256 experts of 42 MiB,
fp8 as it ships, top-8, 8 expert groups; EPLB runs its global policy, as 125 nodes do not divide 8
groups) on 1000 GPUs for both.

`--traces FILE` replays loads from elsewhere instead: either JSON
    {"layout": "mixtral-8gpu" | "deepseek-v3-1000gpu",          # which layout's sizes to use
     "decode":  [[[tokens of expert e] for e in E] for l in L] for each iteration],   # [T][L][E]
     "prefill": [...same...]}                                    # either key may be missing
or safetensors with integer tensors `decode` and/or `prefill` of shape [T, L, E] (metadata
{"layout": ...}). L and E must match the layout.

Policies, re-planned every `window` iterations (the first window is history only):
- kubemoe, as the operator and the dispatcher run it: the scaler on the loads predicted for the
  coming window, the placer (warm replicas from the previous window first, within the operator's
  WARM_SLACK), both knowing the expert curve's knee (no replica for less than a knee of tokens, and
  a replica queues at least a weight read, plus its tokens' copies); per iteration `split_layer`
  with the predicted tokens, as the dispatcher does it: the least flexible experts first, each
  one's parts levelling the queues (one a GPU) of the shortest of its replicas.
- static EP: one replica per expert, round-robin, never changes.
- EPLB: `rebalance_experts` on observed loads, with as many redundant slots per layer as kubemoe
  used on average; tokens split evenly over an expert's replicas. As production systems run it
  (`eplb`, the goal's): every `eplb_every` iterations from the last `history` (SGLang's 1000 and
  1000; the first `history` iterations of a trace are history only, and the measured span starts at
  a rebalance). The stricter comparison beside it (`eplb_window`): re-planned every window from the
  window before, as often as kubemoe's warm pool.
- oracle: every layer perfectly balanced over all GPUs (a bound only: lossy, no memory, and it
  uses every GPU in every layer where a plan uses one per replica).
Nothing here charges a cold start (the operator starts new replicas before the routing table points
at them); what moving replicas costs shows as weights loaded per re-plan, for kubemoe and EPLB.
maxReplicasPerExpert is G (at most one replica of an expert a GPU); the layer memory cap is off.
So nothing caps a layer's replicas at G: at 1000 GPUs the mapped recorded loads give 700-3000
replicas a layer (`kubemoe_replicas_per_layer_range`). The scaler does what it is told: decode-sized
loads there are ~1600 tokens per expert, 14x the knee (110 tokens), the hot groups ~8x that, so CV
<= 0.2 takes ~7 replicas per expert (at 5c4e6df, in one decode window 36 of 58 layers reached it and the
knee stopped the rest; the scaler now goes on past an expert at the knee, so the other experts of
those layers are split down to it too; maxReplicasPerExpert = G never binds). Above the
knee two replicas of a layer on one GPU cost what one holding both parts costs, so this spends memory
(and EPLB gets the same budget of slots), not latency; a layer cap of G replicas leaves CV up to 0.42.
Sensitivity sweeps (V 0.2..1.0, d 1..5 where predictions are modelled, warm slack inf and 0) run
at the smaller scale only.

Latency: `kubemoe.planning.latency` (the H200's measured expert curve, per-call overhead, beta per
token). Cost, as MoEless bills it: kubemoe pays for each replica's memory while its call runs
(`busy_byte_seconds`); static EP and EPLB hold every replica's memory for the layer's whole time
(`held_byte_seconds`). kubemoe's warm pool held the same way is reported too (`cost_held`).
Where the gains appear: per regime, and within each by quartiles of tokens per iteration (`by_tokens`).
Goals are taken at MoEless's scale (8 GPUs) on the recorded routing, over decode and prefill
iterations together (ratio of mean MoE-layer latencies); every source, scale and regime is in `raw`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import Goal, print_table, write_results  # noqa: E402

from kubemoe.planning.baselines import eplb, oracle_layer_seconds, static_ep  # noqa: E402
from kubemoe.planning.latency import (MIXTRAL_EXPERT_BYTES, MIXTRAL_FLOPS_PER_TOKEN, ExpertCurve,  # noqa: E402
                                      LatencyModel, held_byte_seconds)
from kubemoe.planning.placer import GPU, WARM_SLACK, Placement, place  # noqa: E402
from kubemoe.planning.scaler import scale  # noqa: E402
from kubemoe.planning.split import split_layer  # noqa: E402

H200_MEMORY = 141 * 10**9
PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9)


@dataclass(frozen=True)
class Layout:
    name: str
    layers: int              # L
    experts: int             # E
    top_k: int
    expert_bytes: int
    flops_per_token: float
    token_bytes: int         # one token's hidden state on the wire (bf16)
    groups: int              # expert groups (EPLB's hierarchical policy)
    gpus: int                # G
    gpus_per_node: int
    max_per_expert: int      # the spec's maxReplicasPerExpert: G here, at most one replica of an expert a GPU
    decode_tokens: float     # mean tokens an iteration (sequences in the batch)
    prefill_tokens: float    # mean prompt tokens an iteration
    iterations: int          # measured iterations per regime (after the history window)


MIXTRAL_8 = Layout("mixtral-8gpu", 32, 8, 2, MIXTRAL_EXPERT_BYTES, MIXTRAL_FLOPS_PER_TOKEN, 4096 * 2, 1, 8, 8, 8,
                   decode_tokens=256, prefill_tokens=8192, iterations=400)
DEEPSEEK_V3_1000 = Layout("deepseek-v3-1000gpu", 58, 256, 8, 3 * 7168 * 2048, 2 * 3 * 7168 * 2048, 7168 * 2, 8, 1000, 8,
                          1000, decode_tokens=32 * 1000, prefill_tokens=512 * 1000, iterations=100)
# The trained model's own layout (8 MoE layers x 16 experts, top-2) with Mixtral-sized experts and
# hidden states: the recorded routing replayed without any mapping, at MoEless's scale.
TRAINED_8 = replace(MIXTRAL_8, name="trained-8gpu", layers=8, experts=16)
LAYOUTS = {8: MIXTRAL_8, 1000: DEEPSEEK_V3_1000}
RECORDED_LAYOUTS = {8: TRAINED_8, 1000: DEEPSEEK_V3_1000}
ROUTING_TRACE = Path(__file__).resolve().parent / "results" / "routing_trace_base_h200.safetensors"


@dataclass(frozen=True)
class TraceShape:
    zipf: float = 1.0              # popularity of the rank-r expert ~ 1 / r^zipf
    drift_sigma: float = 0.02      # random walk of log-popularity per iteration
    shift_every: int = 150         # iterations between two experts trading places
    burst_sigma: float = 0.5       # log-normal spread of the arrival rate
    burst_memory: float = 0.95     # AR(1) coefficient: bursts last ~20 iterations
    prompt_sigma: float = 0.8      # log-normal spread of prompt lengths around the mean


@dataclass(frozen=True)
class SimConfig:
    cv: float = 0.2
    distance: int = 1
    error_per_distance: float = 0.1
    window: int = 50
    warm_slack: float = WARM_SLACK  # the placer's, as the operator runs it
    # EPLB as production systems run it: rebalanced every `eplb_every` iterations from the statistics of
    # the last `history` (SGLang's defaults: every 1000 from 1000; vLLM's: every 3000 from 1000). The
    # measured span starts at a rebalance, so its plan is 0 to `iterations` old, younger on average than
    # over a production cadence. `eplb_window` is the stricter comparison: EPLB re-planned every window
    # from the window before, as often as kubemoe's warm pool.
    history: int = 1000  # iterations before the measured span
    eplb_every: int = 1000


def arrival_rate(iterations: int, shape: TraceShape, rng: np.random.Generator) -> np.ndarray:
    """[T] relative arrival rate, mean 1: a log-normal AR(1), bursts and lulls with spread burst_sigma."""
    rate = np.zeros(iterations)
    level = 0.0
    for t in range(iterations):
        level = shape.burst_memory * level + np.sqrt(1 - shape.burst_memory ** 2) * rng.normal(0, shape.burst_sigma)
        rate[t] = np.exp(level - shape.burst_sigma ** 2 / 2)
    return rate


def generate_trace(layout: Layout, regime: str, iterations: int, shape: TraceShape, seed: int) -> np.ndarray:
    """Per-iteration tokens per (layer, expert): [T, L, E] int."""
    rng = np.random.default_rng(seed)
    L, E = layout.layers, layout.experts
    ranks = np.argsort(rng.random((L, E)), axis=1) + 1
    log_pop = -shape.zipf * np.log(ranks.astype(np.float64))
    rate = arrival_rate(iterations, shape, rng)
    trace = np.zeros((iterations, L, E), dtype=np.int64)
    for t in range(iterations):
        log_pop += rng.normal(0, shape.drift_sigma, (L, E))
        if t and t % shape.shift_every == 0:
            a, b = rng.choice(E, 2, replace=False)
            log_pop[:, [a, b]] = log_pop[:, [b, a]]
        if regime == "decode":
            tokens = max(1, rng.poisson(layout.decode_tokens * rate[t]))
        else:
            prompts = max(1, rng.poisson(8 * rate[t]))
            tokens = int(rng.lognormal(np.log(layout.prefill_tokens / 8) - shape.prompt_sigma ** 2 / 2,
                                       shape.prompt_sigma, prompts).sum())
        p = np.exp(log_pop - log_pop.max(axis=1, keepdims=True))
        trace[t] = rng.multinomial(tokens * layout.top_k, p / p.sum(axis=1, keepdims=True))
    return trace


def load_traces(path: Path) -> tuple[Layout, dict[str, np.ndarray]]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        from safetensors.numpy import load_file

        with safe_open(str(path), "np") as f:
            layout_name = (f.metadata() or {}).get("layout", MIXTRAL_8.name)
        tensors = load_file(str(path))
    else:
        doc = json.loads(path.read_text())
        layout_name = doc.get("layout", MIXTRAL_8.name)
        tensors = {k: np.asarray(doc[k], dtype=np.int64) for k in ("decode", "prefill") if k in doc}
    layouts = {l.name: l for l in LAYOUTS.values()}
    if layout_name not in layouts:
        raise SystemExit(f"{path}: layout {layout_name!r} is not one of {sorted(layouts)}")
    layout = layouts[layout_name]
    traces = {k: np.asarray(v, dtype=np.int64) for k, v in tensors.items() if k in ("decode", "prefill")}
    if not traces:
        raise SystemExit(f"{path}: no `decode` or `prefill` [T, L, E] loads in it (see this script's docstring)")
    for regime, trace in traces.items():
        if trace.ndim != 3 or trace.shape[1:] != (layout.layers, layout.experts):
            raise SystemExit(f"{path}: {regime} has shape {trace.shape}, expected [T, {layout.layers}, {layout.experts}]")
    return layout, traces


# -- the trained model's routing, replayed ------------------------------------------------------------

@dataclass(frozen=True)
class RoutingTrace:
    """predictor_accuracy.py's routing trace: R requests of P token rows each, in request order.
    Shapes: L0 = the trained model's MoE layers, E0 its experts, K0 experts per token."""

    experts: np.ndarray    # [R * P, L0, K0] the router's choices
    predicted: np.ndarray  # [R * P, L0, K0] the fine-tuned d=1 predictor's guesses, -1 where it has none
    requests: int          # R
    positions: int         # P
    num_experts: int       # E0


def read_routing_trace(path: Path) -> RoutingTrace:
    from safetensors import safe_open
    from safetensors.numpy import load_file

    with safe_open(str(path), "np") as f:
        meta = f.metadata() or {}
    tensors = load_file(str(path))
    if not {"experts", "predicted_d1", "request"} <= tensors.keys() or "num_experts" not in meta:
        raise SystemExit(f"{path}: not a routing trace (benchmarks/predictor_accuracy.py writes them: "
                         "experts, predicted_d1, request and the model shape in the metadata)")
    per_request = np.bincount(tensors["request"])
    if (np.diff(tensors["request"]) < 0).any() or len(set(per_request.tolist())) != 1:
        raise SystemExit(f"{path}: expected requests of equal length, their rows in order")
    return RoutingTrace(tensors["experts"].astype(np.int64), tensors["predicted_d1"].astype(np.int64),
                        len(per_request), int(per_request[0]), int(meta["num_experts"]))


def load_report(trace: RoutingTrace, first: int, last: int, window_s: float, model: str, frontend: str) -> dict:
    """What a frontend serving recorded requests first..last (inclusive) within `window_s` seconds answers on
    /loads (a kubemoe.v1.LoadReport as JSON): per (layer, expert) the router's tokens/s and, for the layers
    the predictor predicts, its tokens/s (what the operator plans with)."""
    rows = slice(first * trace.positions, (last + 1) * trace.positions)
    _, layers, top_k = trace.experts.shape

    def per_layer(choices: np.ndarray) -> list[np.ndarray]:  # [L0] of [E0] tokens
        return [np.bincount(choices[:, l][choices[:, l] >= 0].ravel(), minlength=trace.num_experts)
                for l in range(layers)]

    observed, predicted = per_layer(trace.experts[rows]), per_layer(trace.predicted[rows])
    loads = []
    for layer in range(layers):
        for expert in range(trace.num_experts):
            load = {"layer": layer, "expert": expert, "tokensPerSecond": float(observed[layer][expert]) / window_s}
            if predicted[layer].any():
                load["predictedTokensPerSecond"] = float(predicted[layer][expert]) / window_s
            loads.append(load)
    tokens = (last + 1 - first) * trace.positions
    return {"model": model, "frontend": frontend, "windowSeconds": window_s, "tokens": str(tokens), "loads": loads}


def replay_rows(trace: RoutingTrace, layout: Layout, regime: str, iterations: int, shape: TraceShape,
                seed: int) -> list[np.ndarray]:
    """Which recorded rows make up each iteration ([T] arrays of row indices), arrivals bursty as generated.

    Decode: slot i of the batch decodes request i mod R, one position further each iteration (from
    an offset of 37 x (i div R) positions, wrapping around: a new request), so consecutive iterations
    see the same requests' next tokens, as a continuous batch does. A batch larger than R slots x P
    positions repeats rows. Prefill: whole recorded requests as prompts, in turn.
    """
    rng = np.random.default_rng(seed)
    R, P = trace.requests, trace.positions
    rate = arrival_rate(iterations, shape, rng)
    rows, prompted = [], 0
    for t in range(iterations):
        if regime == "decode":
            slots = np.arange(max(1, rng.poisson(layout.decode_tokens * rate[t])))
            request, position = slots % R, (t + 37 * (slots // R)) % P
        else:
            prompts = max(1, rng.poisson(layout.prefill_tokens / P * rate[t]))
            request = np.repeat((prompted + np.arange(prompts)) % R, P)
            position = np.tile(np.arange(P), prompts)
            prompted += prompts
        rows.append(request * P + position)
    return rows


def recorded_trace(trace: RoutingTrace, layout: Layout, regime: str, iterations: int, shape: TraceShape,
                   seed: int) -> tuple[np.ndarray, np.ndarray]:
    """-> loads [T, L, E] int and the predictor's counts [T, L, E] (NaN for layers it does not predict).

    The trained layout replays as recorded. A larger layout (DeepSeek-V3's 58 x 256, top-8) maps
    MoE layer l to trained layer l mod L0 and each trained expert to a group of E / E0 experts: a
    token's trained choice becomes K / K0 choices within that group, spread uniformly (multinomial;
    predicted counts get the group's expected share). The trained model's skew across groups stays;
    within a group there is none, which understates a real DeepSeek-V3's skew.
    """
    _, L0, K0 = trace.experts.shape
    E0, L, E = trace.num_experts, layout.layers, layout.experts
    same = (L, E, layout.top_k) == (L0, E0, K0)
    if not same and (E % E0 or layout.top_k % K0 or layout.top_k // K0 > E // E0):
        raise SystemExit(f"cannot map the trace's {L0} x {E0} top-{K0} routing onto {layout.name}")
    rng = np.random.default_rng(seed + 1)
    offsets = (np.arange(L0) * E0)[None, :, None]
    predicts = (trace.predicted >= 0).any(axis=(0, 2))  # [L0]

    def counts(choices: np.ndarray, rows: np.ndarray) -> np.ndarray:  # -> [L0, E0]
        picked = choices[rows]
        return np.bincount((picked + offsets)[picked >= 0], minlength=L0 * E0).reshape(L0, E0)

    loads = np.zeros((iterations, L, E), dtype=np.int64)
    predicted = np.full((iterations, L, E), np.nan)
    group, per = E // E0, layout.top_k // K0
    for t, rows in enumerate(replay_rows(trace, layout, regime, iterations, shape, seed)):
        actual, guess = counts(trace.experts, rows), counts(trace.predicted, rows).astype(np.float64)
        guess[~predicts] = np.nan
        if same:
            loads[t], predicted[t] = actual, guess
            continue
        source = np.arange(L) % L0
        loads[t] = rng.multinomial(actual[source] * per, np.full(group, 1 / group)).reshape(L, E)  # [L, E0, group]
        predicted[t] = np.repeat(guess[source] * per / group, group, axis=1)
    return loads, predicted


# -- policies ---------------------------------------------------------------------------------------

def gpus_of(layout: Layout) -> list[GPU]:
    return [GPU(f"g{i}", f"n{i // layout.gpus_per_node}", H200_MEMORY) for i in range(layout.gpus)]


def layer_replicas(placement: Placement, layers: int, gpu_index: dict[str, int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Placement -> per layer (expert [R], GPU index [R]) of its placed replicas."""
    per_layer: list[tuple[list[int], list[int]]] = [([], []) for _ in range(layers)]
    for (layer, expert, _), gpu in sorted(placement.gpu_of.items()):
        per_layer[layer][0].append(expert)
        per_layer[layer][1].append(gpu_index[gpu])
    return [(np.array(e, dtype=np.int64), np.array(g, dtype=np.int64)) for e, g in per_layer]


def even_tokens(tokens: np.ndarray, experts: np.ndarray, num_experts: int) -> np.ndarray:
    """tokens [T, E], replica experts [R] -> [T, R]: each expert's tokens split evenly over its replicas."""
    counts = np.bincount(experts, minlength=num_experts)
    nth = np.zeros(len(experts), dtype=np.int64)
    seen = np.zeros(num_experts, dtype=np.int64)
    for r, e in enumerate(experts):
        nth[r], seen[e] = seen[e], seen[e] + 1
    base = tokens[:, experts] // counts[experts]
    return base + (nth < tokens[:, experts] % counts[experts])


def split_tokens(tokens: np.ndarray, predicted: np.ndarray, experts: np.ndarray, gpus: np.ndarray,
                 knee: int) -> np.ndarray:
    """kubemoe's per-iteration dispatch as the frontend's dispatcher runs it (`split_layer`): tokens,
    predicted [T, E], each replica's expert and GPU [R] -> [T, R]. One frontend runs a layer's calls
    together and the layers one after another, so every queue is empty when a layer starts; within
    the layer an expert's parts (how many: ceil(predicted / knee), at least one, at most all its
    replicas; NaN: no prediction, the step's own count) go to the shortest queues and level them.
    One expert function per GPU serves that GPU's replicas (as the live benchmark runs them), so the
    dispatcher's queue per address is the GPU's."""
    tokens = np.asarray(tokens, dtype=np.int64)
    out = np.zeros((tokens.shape[0], len(experts)), dtype=np.int64)
    columns = [np.flatnonzero(experts == e) for e in range(tokens.shape[1])]
    placed = [e for e, c in enumerate(columns) if len(c)]
    where = [[int(gpus[r]) for r in columns[e]] for e in placed]
    for t in range(tokens.shape[0]):
        guesses = [None if np.isnan(predicted[t, e]) else float(predicted[t, e]) for e in placed]
        parts = split_layer([int(tokens[t, e]) for e in placed], where, {}, guesses, knee)
        for e, expert_parts in zip(placed, parts):
            for _, part in expert_parts:
                out[t, columns[e][part.replica]] = part.count
    return out


def lost_tokens(tokens: np.ndarray, experts: np.ndarray, num_experts: int) -> int:
    """Tokens of experts left without any placed replica (never expected; counted, not hidden)."""
    missing = np.setdiff1d(np.arange(num_experts), experts)
    return int(tokens[:, missing].sum())


EPLBS = ("eplb", "eplb_window")  # at production cadence (the goal's), and re-planned every window
BASELINES = ("static", *EPLBS, "oracle")
POLICIES = ("kubemoe", *BASELINES)


def simulate(layout: Layout, trace: np.ndarray, sim: SimConfig, seed: int, redundant: int | None = None,
             predicted: np.ndarray | None = None) -> dict:
    """Every policy over `trace` [T, L, E]; returns per-policy latency [T', L] and cost [T'] arrays.

    `predicted` [T, L, E]: a real predictor's counts (NaN for a layer it does not predict: the
    operator then plans on the previous window's observed loads, the dispatcher splits on the step's
    own counts); None: the truth with log-normal error (`SimConfig.error_per_distance`)."""
    rng = np.random.default_rng(seed)
    model = LatencyModel(ExpertCurve(layout.expert_bytes, layout.flops_per_token), layout.token_bytes)
    knee = model.curve.knee_tokens
    gpus = gpus_of(layout)
    gpu_index = {g.id: i for i, g in enumerate(gpus)}
    W, L, E = sim.window, layout.layers, layout.experts
    windows = trace.shape[0] // W
    sigma = sim.error_per_distance * sim.distance
    noisy = lambda x: x * np.exp(rng.normal(0, sigma, x.shape))  # noqa: E731

    static = layer_replicas(static_ep(np.ones((L, E)).tolist(), gpus, layout.expert_bytes), L, gpu_index)
    results = {p: {"latency": [], "cost": [], "replicas": []} for p in POLICIES}
    results["kubemoe"].update(cost_held=[], warm_reused=0, unplaced=0, lost_tokens=0, replicas_loaded=0)
    for p in EPLBS:
        results[p].update(replicas_loaded=0, rebalances=0)
    warm = None
    eplb_tables: dict[str, list] = {}
    eplb_before: dict[str, Counter] = {}
    plans = []
    start = max(1, sim.history // W)  # the windows before it are history only
    if windows <= start:
        raise ValueError(f"a trace of {trace.shape[0]} iterations has none to measure after {start * W} of history")
    for w in range(start, windows):
        now = trace[w * W:(w + 1) * W]                      # [W, L, E]
        history = trace[(w - 1) * W:w * W].mean(axis=0)     # [L, E] the window before
        if predicted is None:
            predicted_window, predicted_now = noisy(now.mean(axis=0)), noisy(now.astype(np.float64))
        else:
            told = predicted[w * W:(w + 1) * W]
            predicted_window = np.where(np.isnan(told[0]), history, told.mean(axis=0))
            predicted_now = np.where(np.isnan(told), now, told)
        replicas = scale(predicted_window.tolist(), layout.expert_bytes, sim.cv, None, layout.max_per_expert, knee)
        placement = place(replicas, predicted_window.tolist(), gpus, layout.expert_bytes, warm, sim.warm_slack,
                          min_replica_load=knee, wire_cost=model.wire_cost)
        warm = placement.locations()
        results["kubemoe"]["warm_reused"] += placement.warm_reused
        results["kubemoe"]["unplaced"] += len(placement.unplaced)
        if w > 1:  # replicas whose weights a window's plan loads anew (the first plan loads everything)
            results["kubemoe"]["replicas_loaded"] += len(placement.gpu_of) - placement.warm_reused
        plans.append(replicas)
        ours = layer_replicas(placement, L, gpu_index)
        slots = redundant if redundant is not None else 0
        due = {"eplb": ((w - start) * W) % sim.eplb_every < W, "eplb_window": True}
        seen = {"eplb": trace[max(0, w * W - sim.history):w * W].mean(axis=0), "eplb_window": history}
        for p in EPLBS:
            if not due[p]:
                continue
            rebalanced = eplb(seen[p].tolist(), gpus, layout.expert_bytes, slots, layout.groups, layout.gpus_per_node)
            eplb_tables[p] = layer_replicas(rebalanced, L, gpu_index)
            slots_now = Counter((layer, e, g) for (layer, e, _), g in rebalanced.gpu_of.items())
            if p in eplb_before:
                results[p]["replicas_loaded"] += sum((slots_now - eplb_before[p]).values())
            eplb_before[p] = slots_now
            results[p]["rebalances"] += 1
        lat = {p: np.zeros((W, L)) for p in results}
        cost = {p: np.zeros(W) for p in results}
        held = np.zeros(W)
        for layer in range(L):
            tokens = now[:, layer, :]
            experts, on = ours[layer]
            mine = split_tokens(tokens, predicted_now[:, layer, :], experts, on, knee)
            results["kubemoe"]["lost_tokens"] += lost_tokens(tokens, experts, E)
            lat["kubemoe"][:, layer] = model.layer_seconds(on, mine)
            cost["kubemoe"] += model.busy_byte_seconds(mine)
            # Serverful billing holds every layer's replicas while any layer runs.
            held += held_byte_seconds(len(placement.gpu_of) * layout.expert_bytes, lat["kubemoe"][:, layer])
            for name, table in (("static", static), *eplb_tables.items()):
                experts, on = table[layer]
                lat[name][:, layer] = model.layer_seconds(on, even_tokens(tokens, experts, E))
                total_replicas = sum(len(x[0]) for x in table)
                cost[name] += held_byte_seconds(total_replicas * layout.expert_bytes, lat[name][:, layer])
            lat["oracle"][:, layer] = oracle_layer_seconds(model, tokens, layout.gpus)
        for p in results:
            results[p]["latency"].append(lat[p])
            results[p]["cost"].append(cost[p])
        results["kubemoe"]["cost_held"].append(held)
        results["kubemoe"]["replicas"].append(sum(map(sum, replicas)) / L)
        for p in EPLBS:
            results[p]["replicas"].append(E + slots)
    for p in results:
        for key in ("latency", "cost", "cost_held"):
            if key in results[p]:
                results[p][key] = np.concatenate(results[p][key])
    results["kubemoe"]["plans"] = plans
    return results


def summarize(results: dict, layout: Layout, regime: str, sim: SimConfig) -> dict:
    row = {"layout": layout.name, "gpus": layout.gpus, "regime": regime, **asdict(sim),
           "mean_tokens_per_iteration": None}
    row["warm_slack"] = str(sim.warm_slack)  # JSON has no infinity
    for policy, r in results.items():
        lat_ms = r["latency"].ravel() * 1e3  # one value per (iteration, layer)
        row[f"{policy}_mean_ms"] = float(lat_ms.mean())
        row[f"{policy}_p99_ms"] = float(np.percentile(lat_ms, 99))
        row[f"{policy}_cdf_ms"] = {str(q): float(np.percentile(lat_ms, q)) for q in PERCENTILES}
        if policy != "oracle":
            row[f"{policy}_cost_gb_s_per_iteration"] = float(r["cost"].mean() / 1e9)
            row[f"{policy}_replicas_per_layer"] = float(np.mean(r["replicas"])) if r["replicas"] else float(layout.experts)
    row["kubemoe_cost_held_gb_s_per_iteration"] = float(results["kubemoe"]["cost_held"].mean() / 1e9)
    for key in ("warm_reused", "unplaced", "lost_tokens"):
        row[f"kubemoe_{key}"] = results["kubemoe"][key]
    replans = max(len(results["kubemoe"]["plans"]) - 1, 1)
    row["kubemoe_replicas_loaded_per_replan"] = results["kubemoe"]["replicas_loaded"] / replans
    for policy in EPLBS:  # weights loaded anew per re-plan: what moving replicas costs
        row[f"{policy}_replicas_loaded_per_replan"] = (results[policy]["replicas_loaded"] /
                                                       max(results[policy]["rebalances"] - 1, 1))
        row[f"{policy}_rebalances"] = results[policy]["rebalances"]
    plans = np.array(results["kubemoe"]["plans"])  # [windows, L, E]
    row["kubemoe_replicas_per_layer_range"] = [int(plans.sum(axis=2).min()), int(plans.sum(axis=2).max())]
    for base in BASELINES:
        row[f"latency_vs_{base}"] = row["kubemoe_mean_ms"] / row[f"{base}_mean_ms"]
        row[f"p99_vs_{base}"] = row["kubemoe_p99_ms"] / row[f"{base}_p99_ms"]
    row["cost_vs_static"] = row["kubemoe_cost_gb_s_per_iteration"] / row["static_cost_gb_s_per_iteration"]
    row["cost_held_vs_static"] = row["kubemoe_cost_held_gb_s_per_iteration"] / row["static_cost_gb_s_per_iteration"]
    return row


def run_regime(layout: Layout, regime: str, trace: np.ndarray, sim: SimConfig, seed: int,
               predicted: np.ndarray | None = None) -> tuple[dict, dict]:
    # kubemoe first: EPLB gets as many redundant slots per layer as kubemoe used on average.
    first = simulate(layout, trace, sim, seed, redundant=0, predicted=predicted)
    redundant = max(0, round(float(np.mean(first["kubemoe"]["replicas"]))) - layout.experts)
    results = simulate(layout, trace, sim, seed, redundant=redundant, predicted=predicted)
    row = summarize(results, layout, regime, sim)
    tokens = trace.sum(axis=2).mean(axis=1) / layout.top_k  # [T] tokens an iteration
    row["mean_tokens_per_iteration"] = float(tokens.mean())
    row["eplb_redundant_per_layer"] = redundant
    first = max(1, sim.history // sim.window) * sim.window  # the first measured iteration
    row["by_tokens"] = gains_by_tokens(results, tokens[first:first + results["kubemoe"]["latency"].shape[0]])
    return row, results


def gains_by_tokens(results: dict, tokens: np.ndarray) -> list[dict]:
    """Where the gains appear: the measured iterations in four bins by their tokens (quartiles), with
    each bin's mean MoE-layer latency ratios."""
    edges = np.percentile(tokens, [0, 25, 50, 75, 100])
    bins = []
    for i in range(4):
        pick = (tokens >= edges[i]) & ((tokens < edges[i + 1]) if i < 3 else (tokens <= edges[i + 1]))
        if not pick.any():
            continue
        mean = {p: float(r["latency"][pick].mean()) for p, r in results.items()}
        bins.append({"tokens_min": float(edges[i]), "tokens_max": float(edges[i + 1]), "iterations": int(pick.sum()),
                     "kubemoe_mean_ms": mean["kubemoe"] * 1e3,
                     **{f"latency_vs_{b}": mean["kubemoe"] / mean[b] for b in BASELINES}})
    return bins


# Why the two latency goals stay unmet, as the runs show it (raw, sweeps and by_tokens hold the figures).
WHY_UNMET = {
    "latency_vs_eplb": (
        "On the trained model's recorded routing the goal asks for more than a perfect balance: the oracle's mean "
        "latency is about 0.90x EPLB's (latency_vs_eplb / latency_vs_oracle), so 0.78 would take a policy ~13% "
        "faster than the bound. The recorded routing replays 64 held-out requests: its expert popularity does not "
        "drift, so EPLB's plan from the last 1000 iterations is as good at any age, rebalanced at production cadence "
        "or every window alike (eplb and eplb_window agree). Both get the same replica budget and replicate the "
        "heaviest expert per replica first, and their plans are about as balanced: what puts kubemoe ahead is its "
        "per-step split, which levels the GPUs' queues in each step where EPLB's tokens split evenly over an "
        "expert's replicas; planning on the truth instead of the d=1 predictor's window moves kubemoe's mean by "
        "under 0.5% (the sweep's 'truth' rows). Where popularity drifts and shifts (the generated traces), "
        "production-cadence EPLB's plan ages and kubemoe's re-plans win (overall, generated)."),
    "latency_vs_oracle": (
        "The oracle spreads every layer's tokens evenly over all GPUs with no expert granularity, in every iteration "
        "(lossy: a bound). A plan of whole replicas made for each iteration on its own loads reaches ~1.05x it on "
        "the recorded trace at 8 GPUs (measured on every 4th iteration while analysing at 70a5374); a plan kept for "
        "a window of 50 iterations meets iterations whose hot experts differ from the window's mean (prompts of 256 "
        "tokens from 64 requests, bursty arrivals) and the predictor's error, which make the rest. At 1000 GPUs a "
        "layer has fewer replicas than GPUs, so some GPUs idle in every layer."),
}


@dataclass(frozen=True)
class Workload:
    source: str                      # generated | recorded | file
    layout: Layout
    regime: str                      # decode | prefill
    trace: np.ndarray                # [T, L, E]
    predicted: np.ndarray | None     # [T, L, E] a real predictor's counts, or None (noise model)


def workloads(args: argparse.Namespace, sim: SimConfig, shape: TraceShape) -> list[Workload]:
    if args.traces:
        layout, traces = load_traces(args.traces)
        return [Workload("file", layout, regime, trace, None) for regime, trace in traces.items()]
    found = []
    routing = read_routing_trace(args.recorded) if "recorded" in args.sources else None
    for gpus in args.scales:
        for i, regime in enumerate(("decode", "prefill")):
            seed = args.seed * 10 + i
            if "generated" in args.sources:
                layout = LAYOUTS[gpus]
                T = layout.iterations + sim.history
                found.append(Workload("generated", layout, regime, generate_trace(layout, regime, T, shape, seed), None))
            if routing is not None:
                layout = RECORDED_LAYOUTS[gpus]
                T = layout.iterations + sim.history
                found.append(Workload("recorded", layout, regime, *recorded_trace(routing, layout, regime, T, shape, seed)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=int, nargs="*", default=[8, 1000], choices=sorted(LAYOUTS))
    parser.add_argument("--sources", nargs="*", default=["recorded", "generated"], choices=["recorded", "generated"])
    parser.add_argument("--recorded", type=Path, default=ROUTING_TRACE, help="the trained model's routing trace")
    parser.add_argument("--traces", type=Path, help="recorded per-iteration loads instead (format in the docstring)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-sweeps", action="store_true", help="skip the V, d and warm-slack sensitivity runs")
    args = parser.parse_args()
    started = time.perf_counter()
    base, shape = SimConfig(), TraceShape()
    rows, sweeps = [], []
    combined: dict[str, dict[str, list]] = {}
    found = workloads(args, base, shape)
    smallest = min(w.layout.gpus for w in found)
    for w in found:
        print(f"--- {w.source} {w.layout.name} {w.regime}: {w.trace.shape[0]} iterations", flush=True)
        row, results = run_regime(w.layout, w.regime, w.trace, base, args.seed, w.predicted)
        row["source"], row["prediction"] = w.source, "recorded d=1 predictor" if w.predicted is not None else "modelled"
        rows.append(row)
        bucket = combined.setdefault(f"{w.source}/{w.layout.name}", {p: [] for p in results})
        for p, r in results.items():
            bucket[p].append(r["latency"].ravel())
        if not args.no_sweeps and w.layout.gpus == smallest:
            sweeps.append(row)  # V = 0.2, d = 1, the operator's warm slack
            # d beyond 1 only where predictions are modelled: the recorded trace holds the real d = 1 predictor's.
            variants = ([replace(base, cv=cv) for cv in (0.4, 0.6, 0.8, 1.0)] +
                        ([replace(base, distance=d) for d in (2, 3, 4, 5)] if w.predicted is None else []) +
                        [replace(base, warm_slack=slack) for slack in (math.inf, 0.0)])
            for variant in variants:
                swept = run_regime(w.layout, w.regime, w.trace, variant, args.seed, w.predicted)[0]
                sweeps.append({**swept, "source": w.source, "prediction": row["prediction"]})
            if w.predicted is not None:  # what a perfect predictor would change: plan and split on the truth
                truth = run_regime(w.layout, w.regime, w.trace, replace(base, error_per_distance=0.0), args.seed)[0]
                sweeps.append({**truth, "source": w.source, "prediction": "truth"})

    columns = [("source", "source", ""), ("layout", "layout", ""), ("regime", "regime", ""),
               ("kubemoe_mean_ms", "kubemoe ms", ".3f"), ("static_mean_ms", "static ms", ".3f"),
               ("eplb_mean_ms", "eplb ms", ".3f"), ("oracle_mean_ms", "oracle ms", ".3f"),
               ("latency_vs_static", "vs static", ".3f"), ("latency_vs_eplb", "vs eplb", ".3f"),
               ("latency_vs_eplb_window", "vs eplb/window", ".3f"), ("latency_vs_oracle", "vs oracle", ".3f"), ("p99_vs_static", "p99/static", ".3f"),
               ("cost_vs_static", "cost/static", ".4f"), ("cost_held_vs_static", "held/static", ".3f"),
               ("kubemoe_replicas_per_layer", "repl/layer", ".1f"),
               ("kubemoe_replicas_loaded_per_replan", "loads/replan", ".1f"),
               ("eplb_replicas_loaded_per_replan", "eplb loads", ".1f")]
    print_table(rows, columns)
    overall = {}
    for name, bucket in combined.items():
        means = {p: float(np.concatenate(v).mean()) for p, v in bucket.items()}
        overall[name] = {f"latency_vs_{b}": means["kubemoe"] / means[b] for b in BASELINES}
        print(f"{name}, decode and prefill together: " + ", ".join(f"{k} {v:.3f}" for k, v in overall[name].items()))
    if sweeps:
        print_table(sweeps, [("source", "source", ""), ("prediction", "prediction", ""), ("regime", "regime", ""),
                             ("cv", "V", ".1f"),
                             ("distance", "d", "d"), ("warm_slack", "warm slack", ""),
                             ("kubemoe_mean_ms", "kubemoe ms", ".3f"), ("latency_vs_static", "vs static", ".3f"),
                             ("latency_vs_eplb", "vs eplb", ".3f"), ("kubemoe_replicas_per_layer", "repl/layer", ".1f"),
                             ("kubemoe_replicas_loaded_per_replan", "loads/replan", ".1f"),
                             ("cost_vs_static", "cost/static", ".4f")])

    # Goals at MoEless's scale (the fewest GPUs run), on the trained model's recorded routing where it ran.
    goal_source = "recorded" if any(w.source == "recorded" for w in found) else found[0].source
    at = next(f"{w.source}/{w.layout.name}" for w in found if w.source == goal_source and w.layout.gpus == smallest)
    goal_rows = [r for r in rows if f"{r['source']}/{r['layout']}" == at]
    cost = float(np.mean([r["kubemoe_cost_gb_s_per_iteration"] for r in goal_rows]) /
                 np.mean([r["static_cost_gb_s_per_iteration"] for r in goal_rows]))
    goals = {"latency_vs_static": Goal(overall[at]["latency_vs_static"], "<= 0.57"),
             "latency_vs_eplb": Goal(overall[at]["latency_vs_eplb"], "<= 0.78"),
             "latency_vs_oracle": Goal(overall[at]["latency_vs_oracle"], "<= 1.10"),
             "cost_vs_static": Goal(cost, "<= 0.2")}
    sources = sorted({w.source for w in found})
    write_results("moeless_sim", torch.device("cpu"), rows, goals,
                  traces={"generated": f"seed {args.seed}: {asdict(shape)}" if "generated" in sources else None,
                          "recorded": str(args.recorded.name) if "recorded" in sources else None,
                          "file": str(args.traces) if args.traces else None},
                  layout_mapping=recorded_trace.__doc__.split("\n\n", 1)[1].strip().replace("\n    ", " "),
                  replay=replay_rows.__doc__.split("\n\n", 1)[1].strip().replace("\n    ", " "),
                  goals_taken_at=f"{at}, decode and prefill iterations together (ratio of mean MoE-layer "
                                 "latency; cost: pay-per-use vs held, per iteration)",
                  overall=overall, sweeps=sweeps, sim=asdict(base),
                  why_unmet={name: why for name, why in WHY_UNMET.items() if not goals[name].met},
                  layouts={l.name: asdict(l) for l in {w.layout for w in found}},
                  latency_model="kubemoe.planning.latency defaults (H200 Mixtral curve, 0.25 ms a call, "
                                "23 GB/s copies); generated traces: prediction error exp(N(0, (0.1 d)^2)); "
                                "recorded: the fine-tuned d=1 predictor's own guesses",
                  seconds=round(time.perf_counter() - started, 1))


if __name__ == "__main__":
    main()
