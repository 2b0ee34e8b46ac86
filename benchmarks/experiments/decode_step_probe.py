#!/usr/bin/env python3
"""Where a graphed decode pass's device time goes (issue 17), in-process experts, per batch size.

With CUDA graphs (frontend/graphs.py) the engine's step at batch 32 stayed near the forward pass's
device time, far above the roofline: this measures that time and splits it.
- `graph_ms`: one replayed decode pass (the program of its row bucket), device events around it;
- `eager_ms`: the same pass launched op by op (host-bound where the graph is not);
- `ops`: torch.profiler's device time per op over eager passes (what the graph replays), top by time;
- `kernels`: kubemoe's small grouped GEMM (kubemoe/moe_kernels.py) at several block shapes against
  torch's grouped GEMM, per number of rows, on a layer's gate_up and down weights, beside the bound
  (the active experts' weight bytes at the measured HBM bandwidth);
- `moe_ms`: one MoE layer's routed experts at this batch's tokens: the grouped GEMM (`grouped_ffn`)
  against every expert computed densely for every token (`torch.bmm` over the stacked weights,
  weighted by a dense [T, E] routing matrix), beside the bytes the layer's active experts must read
  at the measured HBM bandwidth.
- `compiled` (--compile): graph_ms, eager_ms and the device's kernels of the same passes compiled
  (frontend/compiled.py), beside the uncompiled ones (`kernels_per_pass`, `kernels`).

  python benchmarks/experiments/decode_step_probe.py --device cuda --preset mixtral-4l --layers 2  # $OUT/decode_step_probe.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from frontend_decode import add_model_arguments, cut_preset, hardware  # noqa: E402

from kubemoe.bundles import bundles_by_count  # noqa: E402
from kubemoe.frontend.app import Frontend, FrontendConfig  # noqa: E402
from kubemoe.frontend.batch import BatchState, split_rows  # noqa: E402
from kubemoe.frontend.compiled import CompiledDecode  # noqa: E402
from kubemoe.frontend.graphs import DecodeGraphs, padded_rows  # noqa: E402
from kubemoe.moe import grouped_ffn  # noqa: E402
from kubemoe.moe_kernels import grouped_mm_small  # noqa: E402
from kubemoe.routing_table import LOCAL, table_for_bundles  # noqa: E402
from kubemoe.synth import make_checkpoint  # noqa: E402


def device_ms(fn, repeats: int = 20) -> float:
    """Median ms between CUDA events around `fn` (after two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.inference_mode()
def joined(fe: Frontend, batch: int, prompt: int, vocab: int) -> BatchState:
    from transformers import DynamicCache

    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(0)).to("cuda")
    cache = DynamicCache()
    fe.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    state = BatchState(fe.engine.masks)
    for row in split_rows(cache, batch):
        state.join(row, prompt)
    return state


@torch.inference_mode()
def moe_times(fe: Frontend, tokens: int, hbm: float) -> dict:
    a, d = fe.adapter, fe.dispatcher
    stack = d._stacked[a.moe_layers[0]]
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, a.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
    weights, index = torch.randn(tokens, a.num_experts, device="cuda", generator=g).softmax(-1).topk(a.top_k, dim=-1)
    dense_w = torch.zeros(tokens, a.num_experts, device="cuda").scatter_(1, index, weights)  # [T, E]
    gate_up_t, down_t = stack.gate_up.transpose(1, 2), stack.down.transpose(1, 2)  # [E, H, 2I], [E, I, H]

    def dense():
        x = hidden.expand(a.num_experts, -1, -1)  # [E, T, H]
        gate, up = torch.bmm(x, gate_up_t).chunk(2, dim=-1)
        y = torch.bmm(a.act(gate) * up, down_t)  # [E, T, H]
        return torch.einsum("eth,te->th", y.float(), dense_w).to(hidden.dtype)

    grouped = grouped_ffn(hidden, index, weights, stack, a.act, a.routing.weight_on_input)
    err = ((dense().float() - grouped.float()).norm() / grouped.float().norm()).item()
    active = torch.unique(index).numel()
    bound = active * a.expert_bytes(fe.dtype) / hbm * 1e3
    return {"tokens": tokens, "active_experts": active, "bound_ms": bound,
            "grouped_ms": device_ms(lambda: grouped_ffn(hidden, index, weights, stack, a.act, a.routing.weight_on_input)),
            "dense_ms": device_ms(dense), "dense_vs_grouped_rel_err": err}


# (BLOCK_N, BLOCK_K, warps, stages[, BLOCK_M]): BLOCK_M left out is the kernel's own choice from the rows;
# 16 fits many experts of few rows each (Qwen3-30B-A3B: 128 experts, ~2 rows each at batch 32)
CONFIGS = [(64, 128, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (128, 128, 8, 3), (64, 256, 8, 3), (32, 256, 4, 3),
           (64, 64, 4, 4, 16), (32, 128, 4, 4, 16), (64, 128, 4, 4, 16), (128, 64, 4, 4, 16), (32, 64, 2, 4, 16),
           (16, 128, 2, 4, 16), (64, 256, 4, 3, 16)]


@torch.inference_mode()
def kernel_sweep(fe: Frontend, hbm: float) -> list[dict]:
    a = fe.adapter
    stack = fe.dispatcher._stacked[a.moe_layers[0]]
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for rows in (2, 16, 64, 128, 256):
        tokens = max(1, rows // a.top_k)
        index = torch.randn(tokens, a.num_experts, device="cuda", generator=g).topk(a.top_k, dim=-1).indices
        experts = index.reshape(-1).sort().values
        ends = torch.zeros(a.num_experts, dtype=torch.int64, device="cuda").index_add_(
            0, experts, torch.ones_like(experts)).cumsum(0, dtype=torch.int32)
        active = torch.unique(experts).numel()
        for name, w in (("gate_up", stack.gate_up), ("down", stack.down)):
            x = torch.randn(experts.numel(), w.shape[2], device="cuda", dtype=w.dtype, generator=g)
            ref = torch.nn.functional.grouped_mm(x, w.transpose(-2, -1), offs=ends)
            row = {"rows": experts.numel(), "weights": name, "active_experts": active,
                   "bound_ms": active * w[0].nbytes / hbm * 1e3,
                   "torch_ms": device_ms(functools.partial(torch.nn.functional.grouped_mm, x, w.transpose(-2, -1),
                                                            offs=ends))}
            for config in CONFIGS:
                bn, bk, warps, stages, *bm = config
                label = f"small_{bn}x{bk}_w{warps}s{stages}" + (f"_m{bm[0]}" if bm else "")
                got = grouped_mm_small(x, w, ends, config)
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                row[f"{label}_ms"] = device_ms(functools.partial(grouped_mm_small, x, w, ends, config))
                row[f"{label}_rel_err"] = err
            best = min((k for k in row if k.startswith("small_") and k.endswith("_ms")), key=row.__getitem__)
            print(f"  {name:>7} rows {row['rows']:>3} ({active} experts): torch {row['torch_ms']:.3f} ms, best small "
                  f"{best} {row[best]:.3f} ms (err {row[best.replace('_ms', '_rel_err')]:.1e}), "
                  f"bound {row['bound_ms']:.3f} ms")
            out.append(row)
    return out


@torch.inference_mode()
def probe(fe: Frontend, model, batch: int, prompt: int, vocab: int) -> dict:
    """`model`: what decode passes call (the model, or it compiled: frontend/compiled.py)."""
    graphs = DecodeGraphs(model, lambda: fe.dispatcher.generation)
    state = joined(fe, batch, prompt, vocab)
    padded = padded_rows(batch)
    tokens = [1] * batch

    def graphed():
        state.advance(tokens, padded)
        graphs.decode(state, padded, batch)

    graph_ms = device_ms(graphed)  # its first call compiles (if compiled) and captures the program
    eager_state = joined(fe, batch, prompt, vocab)
    eager_ms = device_ms(lambda: model(**eager_state.decode_inputs(tokens), use_cache=True).logits)
    from torch.profiler import ProfilerActivity, profile

    passes = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(passes):
            model(**eager_state.decode_inputs(tokens), use_cache=True)
        torch.cuda.synchronize()

    def own(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    averages = prof.key_averages()
    events = [e for e in averages if own(e) > 0 and e.key.startswith("aten::")]
    ops = sorted(events, key=own, reverse=True)[:14]
    # Device kernels, whoever launched them (aten ops, or a compiled pass's Triton kernels and extern calls).
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"batch": batch, "rows": padded, "graph_ms": graph_ms, "eager_ms": eager_ms,
            "graph_device_ms_by_ops": sum(own(e) for e in events) / 1e3 / passes,
            "kernels_per_pass": sum(e.count for e in kernels) / passes,
            "kernel_device_ms_per_pass": sum(own(e) for e in kernels) / 1e3 / passes,
            "ops": [{"op": e.key, "calls_per_pass": e.count / passes, "device_ms_per_pass": own(e) / 1e3 / passes}
                    for e in ops],
            "kernels": [{"kernel": e.key, "calls_per_pass": e.count / passes, "device_ms_per_pass": own(e) / 1e3 / passes}
                        for e in sorted(kernels, key=own, reverse=True)[:14]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--predictor", default="none", choices=("none", "router"),
                        help="the load predictor in the pass (router: its device work captured with the graph)")
    parser.add_argument("--compile", action="store_true",
                        help="also each pass compiled (torch.compile, frontend/compiled.py): `compiled` in each row")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    preset = cut_preset(args.arch, args.preset, args.layers)
    hw = hardware(torch.device("cuda"))
    result = {"preset": preset.name, "predictor": args.predictor, "hardware": hw, "rows": [], "moe": []}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(preset, Path(tmp) / preset.name, progress=False)
        fe = Frontend(FrontendConfig(checkpoint=ckpt, device="cuda", predictor=args.predictor, cuda_graphs=False))
        bundles = bundles_by_count(fe.adapter.moe_layers, fe.adapter.num_experts, 1)
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, {b.name: [LOCAL] for b in bundles}))
        fe.dispatcher.apply_pending()
        vocab = fe.model.config.vocab_size
        result["kernels"] = kernel_sweep(fe, hw["hbm_bytes_per_s"])
        compiled = CompiledDecode(fe.model) if args.compile else None
        for b in [int(x) for x in args.batches.split(",")]:
            row = probe(fe, fe.model, b, args.prompt, vocab)
            if compiled is not None:  # the same passes compiled, beside: graph_ms against graph_ms
                row["compiled"] = probe(fe, compiled, b, args.prompt, vocab)
                row["compiled"]["enabled"] = compiled.enabled  # False: a compile failed, it ran uncompiled
            moe = moe_times(fe, b, hw["hbm_bytes_per_s"])
            result["rows"].append(row)
            result["moe"].append(moe)
            print(f"batch {b:>3} (rows {row['rows']}): graph {row['graph_ms']:.2f} ms, eager {row['eager_ms']:.2f} ms, "
                  f"device by ops {row['graph_device_ms_by_ops']:.2f} ms | MoE layer at {b} tokens: grouped "
                  f"{moe['grouped_ms']:.3f} ms, dense {moe['dense_ms']:.3f} ms, bound {moe['bound_ms']:.3f} ms "
                  f"({moe['active_experts']} experts; rel err {moe['dense_vs_grouped_rel_err']:.1e})")
            for op in row["ops"][:8]:
                print(f"      {op['op']:<40} {op['calls_per_pass']:>5.0f} calls {op['device_ms_per_pass']:>7.3f} ms")
            if compiled is not None:
                c = row["compiled"]
                print(f"  compiled{'' if c['enabled'] else ' (FAILED: ran uncompiled)'}: graph {c['graph_ms']:.2f} ms "
                      f"(uncompiled {row['graph_ms']:.2f}), eager {c['eager_ms']:.2f} ms, kernels per pass "
                      f"{c['kernels_per_pass']:.0f} (uncompiled {row['kernels_per_pass']:.0f}), kernel time "
                      f"{c['kernel_device_ms_per_pass']:.2f} ms (uncompiled {row['kernel_device_ms_per_pass']:.2f})")
                for k in c["kernels"][:8]:
                    print(f"      {k['kernel'][:60]:<60} {k['calls_per_pass']:>5.0f} calls {k['device_ms_per_pass']:>7.3f} ms")
        fe.close()
    Path(args.out, "decode_step_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
