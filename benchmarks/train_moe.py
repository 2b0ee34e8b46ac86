"""Train kubemoe's own MoE and show its routing is skewed, against the same model at initialisation.

    python benchmarks/train_moe.py --size small                      # this CPU: about a minute
    python benchmarks/train_moe.py --size base --device cuda --out $OUT --keep /tmp/moe-base   # one H200

It trains the recipe from seed 0 (`kubemoe.train`), saves the untrained model of the same recipe
(`steps=0`: random weights, the same tokenizer) beside it, drives both over held-out standard-library
text with `kubemoe predictor collect`'s code, and reports per MoE layer the coefficient of variation
of expert loads (over all held-out tokens, and the mean over windows of 256 tokens, about one batch)
and the top expert's share of the layer's routed tokens. Writes benchmarks/results/train_moe_<machine>.json
with the loss curve; its goal is the recipe's training-time budget (small: 120 s on this CPU, base:
180 s on an H200).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import Goal, RESULTS, print_table, write_results  # noqa: E402
from kubemoe.corpus import stdlib_corpus  # noqa: E402
from kubemoe.frontend.collect import collect_records  # noqa: E402
from kubemoe.frontend.records import RoutingRecords  # noqa: E402
from kubemoe.planning.scaler import cv  # noqa: E402
from kubemoe.train import get_recipe, train_moe  # noqa: E402

TIME_BUDGET_S = {"small": 120.0, "base": 180.0}
WINDOW = 256


def skew(records: RoutingRecords) -> list[dict]:
    """Per MoE layer: CV of expert loads over all tokens and per window, and the top expert's share."""
    rows = []
    for i, layer in enumerate(records.shape.moe_layers):
        experts = records.experts[:, i]
        counts = torch.bincount(experts.reshape(-1), minlength=records.shape.num_experts).tolist()
        windows = [torch.bincount(experts[s:s + WINDOW].reshape(-1), minlength=records.shape.num_experts).tolist()
                   for s in range(0, len(experts) - WINDOW + 1, WINDOW)]
        rows.append({"layer": layer, "cv": cv(counts), "window_cv": sum(map(cv, windows)) / max(1, len(windows)),
                     "top_share": max(counts) / sum(counts)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["small", "base"], default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out-tokens", type=int, default=None, help="default: 40k (small), 200k (base)")
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's steps (smoke runs)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the trained checkpoint here")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    device = torch.device(args.device)
    recipe = get_recipe(args.size)
    held_tokens = args.held_out_tokens or (40_000 if args.size == "small" else 200_000)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = stdlib_corpus(recipe.corpus_chars)
        (tmp / "held.txt").write_text("\n".join(corpus.held_out))
        trained = args.keep or tmp / "trained"
        if trained.exists():
            shutil.rmtree(trained)
        start = time.perf_counter()
        report = train_moe(recipe, trained, seed=args.seed, device=device, steps=args.steps, corpus=corpus)
        wall = time.perf_counter() - start
        train_moe(recipe, tmp / "random", seed=args.seed, device=device, steps=0, progress=False, corpus=corpus)
        skews = {}
        for name, path in (("trained", trained), ("random", tmp / "random")):
            collect_records(path, tmp / "held.txt", tmp / f"rec-{name}", max_tokens=held_tokens, seq_len=recipe.seq_len,
                            batch=16, device=str(device), max_mb=8192)
            skews[name] = skew(RoutingRecords.load(tmp / f"rec-{name}"))

    raw = [{"layer": t["layer"], **{f"trained_{k}": t[k] for k in ("cv", "window_cv", "top_share")},
            **{f"random_{k}": r[k] for k in ("cv", "window_cv", "top_share")}}
           for t, r in zip(skews["trained"], skews["random"])]
    print_table(raw, [("layer", "layer", "d"), ("trained_cv", "cv", ".3f"), ("random_cv", "cv rnd", ".3f"),
                      ("trained_window_cv", "win cv", ".3f"), ("random_window_cv", "win rnd", ".3f"),
                      ("trained_top_share", "top", ".3f"), ("random_top_share", "top rnd", ".3f")])
    mean = {k: sum(r[k] for r in raw) / len(raw) for k in raw[0] if k != "layer"}
    print(f"mean cv {mean['trained_cv']:.3f} vs random {mean['random_cv']:.3f}; top share "
          f"{mean['trained_top_share']:.3f} vs {mean['random_top_share']:.3f} (uniform {1 / 16:.3f})")
    print(f"training: {report.seconds:.1f}s of optimiser steps, {wall:.1f}s with tokenizer and data; "
          f"loss {report.losses[-1][1]:.3f}, held-out {report.held_out_loss:.3f}")
    goal = f"train_seconds_{args.size}"
    write_results(f"train_moe_{args.size}", device, raw,
                  {goal: Goal(wall, f"<= {TIME_BUDGET_S[args.size]}")}, out=args.out,
                  recipe=args.size, seed=args.seed, training=report.as_dict(), held_out_tokens=held_tokens,
                  mean=mean, notes="random = the same recipe saved at initialisation (steps=0); cv = population "
                                   "std / mean of tokens per expert; window_cv over windows of 256 tokens")


if __name__ == "__main__":
    main()
