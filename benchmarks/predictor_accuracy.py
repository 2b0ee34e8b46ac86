"""Expert-load predictors side by side on the trained model's real routing, d = 1..4.

    python benchmarks/predictor_accuracy.py --checkpoint DIR                 # a trained checkpoint
    python benchmarks/predictor_accuracy.py --train small                    # train one first (CPU: a minute)
    python benchmarks/predictor_accuracy.py --train base --device cuda --out $OUT    # the H200 run

Held-out standard-library text (never trained on) is split in two: routing records of the first
part train the predictors, records of the second judge them. Three predictors, the same data:
  router     layer l+d's router applied to layer l's input, unchanged (Mixtral-offloading's reuse)
  finetuned  MoEless: router copies fine-tuned only where below the threshold (80%)
  mlp        ProMoE-style: an MLP per layer trained from scratch until it stops improving
and, for information, finetuned_all: every layer's router copy fine-tuned until it stops improving
(threshold 1.0), the most a router copy learns from these records.
For each, per layer: top-k set accuracy and the load error (total variation distance of predicted
and true tokens per expert over windows of 64 tokens); parameters and bytes; and the time one
prediction takes at a source layer while serving (head, routing function, per-expert counts back
on the host) at batch 1 and 32, timed with CUDA events on a GPU.

It also writes a compact routing trace of the judged text (benchmarks/results/routing_trace_<machine>.safetensors:
`experts` [N, L, K] int8, the router's choices, and `predicted_d1` [N, L, K] int8, the fine-tuned
d=1 predictor's guesses for each layer from the layer before, -1 where there is none; `request` [N]
int32; metadata: the model shape), so simulators can replay real routing without the weights.

Goals: predict_ms_per_layer (< 0.2: the slower of batch 1 and 32 for the fine-tuned predictor),
finetuned_minus_reuse_acc_d2 (>= 10 percentage points of mean accuracy at d = 2),
finetuned_minus_mlp_acc_d2 (>= 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from common import Goal, RESULTS, machine_slug, print_table, write_results  # noqa: E402
from kubemoe.adapters import MoEAdapter  # noqa: E402
from kubemoe.checkpoint import Checkpoint  # noqa: E402
from kubemoe.corpus import stdlib_corpus  # noqa: E402
from kubemoe.frontend.collect import collect_records  # noqa: E402
from kubemoe.frontend.predictor import LoadPredictor  # noqa: E402
from kubemoe.frontend.predictor_train import TrainConfig, evaluate, finetune, train_mlp  # noqa: E402
from kubemoe.frontend.model_shape import ModelShape  # noqa: E402
from kubemoe.frontend.records import RoutingRecords  # noqa: E402
from kubemoe.train import TRAINING_FILE, get_recipe, train_moe  # noqa: E402

DISTANCES = (1, 2, 3, 4)
KINDS = ("router", "finetuned", "finetuned_all", "mlp")
TRACE_TOKENS = 16_384


def predict_seconds(predictor: LoadPredictor, source: int, batch: int, device: torch.device, repeats: int = 200) -> float:
    """Median seconds of what the frontend does at a source layer: predict, count per expert, read the counts."""
    hidden = torch.randn(batch, predictor.shape.hidden_size, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)

    def once():
        _, experts = predictor.predict(source, hidden)
        return torch.bincount(experts.reshape(-1), minlength=predictor.shape.num_experts).tolist()

    for _ in range(20):
        once()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        once()  # .tolist() waits for the GPU: the host sees the counts, as the frontend does
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--train", choices=["small", "base"], help="train this recipe (seed 0) first")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fit-tokens", type=int, default=None, help="default: 40k (small), 200k (base)")
    parser.add_argument("--judge-tokens", type=int, default=None, help="default: 20k (small), 100k (base)")
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--batch", type=int, default=None, help="rows per training step (default: 512 CPU, 2048 GPU)")
    parser.add_argument("--max-epochs", type=int, default=TrainConfig.max_epochs)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if bool(args.checkpoint) == bool(args.train):
        parser.error("give exactly one of --checkpoint and --train")

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint = args.checkpoint
        if args.train:
            checkpoint = tmp / "trained"
            train_moe(get_recipe(args.train), checkpoint, seed=0, device=device)
        recipe = get_recipe(json.loads((checkpoint / TRAINING_FILE).read_text())["recipe"])
        base = recipe.name == "base"
        fit_tokens = args.fit_tokens or (200_000 if base else 40_000)
        judge_tokens = args.judge_tokens or (100_000 if base else 20_000)
        held = "\n".join(stdlib_corpus(recipe.corpus_chars).held_out)
        cut = len(held) * 2 // 3
        (tmp / "fit.txt").write_text(held[:cut])
        (tmp / "judge.txt").write_text(held[cut:])
        ckpt = Checkpoint(checkpoint)
        adapter = MoEAdapter(ckpt.config)
        shape = ModelShape.of(adapter)
        seq_len = min(256, ckpt.config.max_position_embeddings)
        for name, tokens in (("fit", fit_tokens), ("judge", judge_tokens)):
            collect_records(checkpoint, tmp / f"{name}.txt", tmp / f"rec-{name}", max_tokens=tokens, seq_len=seq_len,
                            batch=16, device=str(device), max_mb=8192)
        fit, stop = RoutingRecords.load(tmp / "rec-fit", shape).split(0.8)
        judge = RoutingRecords.load(tmp / "rec-judge", shape)
        print(f"records: {len(fit)} rows to fit, {len(stop)} to stop on, {len(judge)} to judge", flush=True)

        config = TrainConfig(threshold=args.threshold, device=str(device),
                             batch=args.batch or (2048 if device.type == "cuda" else 512), max_epochs=args.max_epochs)
        raw, summary, finetuned_d1 = [], {}, None
        for d in DISTANCES:
            router = LoadPredictor.from_routers(adapter, ckpt, d)
            started = time.perf_counter()
            tuned = finetune(router, fit, stop, config)
            tuned_s = time.perf_counter() - started
            started = time.perf_counter()
            tuned_all = finetune(router, fit, stop, dataclasses.replace(config, threshold=1.0))
            tuned_all_s = time.perf_counter() - started
            started = time.perf_counter()
            mlp = train_mlp(adapter, d, fit, stop, config=config)
            mlp_s = time.perf_counter() - started
            finetuned_d1 = finetuned_d1 or tuned
            for kind, predictor, seconds in (("router", router, 0.0), ("finetuned", tuned, tuned_s),
                                             ("finetuned_all", tuned_all, tuned_all_s), ("mlp", mlp, mlp_s)):
                predictor.to(device)
                scores = evaluate(predictor, judge, device=str(device))
                source = next(iter(predictor.pairs))
                timing = {f"predict_ms_b{b}": 1e3 * predict_seconds(predictor, source, b, device) for b in (1, 32)}
                row = {"distance": d, "kind": kind, "mean_accuracy": statistics.mean(s.accuracy for s in scores),
                       "mean_load_error": statistics.mean(s.load_error for s in scores),
                       "parameters": predictor.parameters_count(), "bytes": predictor.nbytes(),
                       "train_seconds": round(seconds, 2), **timing,
                       "layers": [{"layer": s.target, "source": s.source, "accuracy": round(s.accuracy, 4),
                                   "load_error": round(s.load_error, 4)} for s in scores],
                       "finetuned_layers": predictor.info.get("layers") if kind.startswith("finetuned") else None}
                raw.append(row)
                summary[(d, kind)] = row
                predictor.to("cpu")
        trace = _trace(judge, finetuned_d1)

    model_params = sum(math.prod(ckpt.shape(n)) for n in ckpt.weight_map)
    print_table(raw, [("distance", "d", "d"), ("kind", "predictor", "s"), ("mean_accuracy", "accuracy", ".3f"),
                      ("mean_load_error", "load err", ".3f"), ("parameters", "params", "d"),
                      ("predict_ms_b1", "ms b1", ".3f"), ("predict_ms_b32", "ms b32", ".3f")])
    for d in DISTANCES:
        layers = zip(*(summary[(d, k)]["layers"] for k in KINDS))
        print(f"d={d}: " + "  ".join(f"L{row[0]['layer']} " + "/".join(f"{r['accuracy']:.2f}" for r in row)
                                     for row in layers) + f"   ({'/'.join(KINDS)})")
    tuned2, reuse2, mlp2 = (summary[(2, k)]["mean_accuracy"] for k in ("finetuned", "router", "mlp"))
    goals = {
        "predict_ms_per_layer": Goal(max(summary[(1, "finetuned")][f"predict_ms_b{b}"] for b in (1, 32)), "< 0.2"),
        "finetuned_minus_reuse_acc_d2": Goal(100 * (tuned2 - reuse2), ">= 10"),
        "finetuned_minus_mlp_acc_d2": Goal(100 * (tuned2 - mlp2), ">= 0"),
    }
    tag = "base" if base else "small"
    write_results(f"predictor_{tag}", device, raw, goals, out=args.out, checkpoint_recipe=tag,
                  model_parameters=model_params, threshold=args.threshold,
                  records={"fit": len(fit), "stop": len(stop), "judge": len(judge)},
                  notes="judged on held-out standard-library text the model and the predictors never saw; "
                        "accuracy = top-k set accuracy, load_error = total variation distance per 64 tokens")
    trace_path = args.out / f"routing_trace_{tag}_{machine_slug(device)}.safetensors"
    save_file(trace, trace_path, metadata={"source": "predictor_accuracy.py judge records", **shape.to_metadata()})
    print(f"wrote {trace_path}")


def _trace(judge: RoutingRecords, predictor: LoadPredictor) -> dict[str, torch.Tensor]:
    rows = slice(0, min(len(judge), TRACE_TOKENS))
    experts = judge.experts[rows]
    predicted = torch.full_like(experts, -1)
    predictor.to("cpu")
    for source, target in predictor.pairs.items():
        hidden = judge.hidden[rows, judge.layer_index(source)].float()
        predicted[:, judge.layer_index(target)] = predictor.predict(source, hidden)[1]
    return {"experts": experts.to(torch.int8).contiguous(), "predicted_d1": predicted.to(torch.int8).contiguous(),
            "request": judge.request[rows].to(torch.int32).contiguous()}


if __name__ == "__main__":
    main()
