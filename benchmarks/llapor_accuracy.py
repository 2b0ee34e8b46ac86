#!/usr/bin/env python3
"""LLaPor's next-layer prediction accuracy on kubemoe's own trained MoE, per layer group, against the
gate-reuse baseline and MoEless's fine-tuned predictor. MEASURED on real (learned) routing.

1. The model: `--checkpoint DIR`, or the `--size` recipe of `kubemoe checkpoint train`, trained here
   from seed 0 (small: about a minute on a 2-core CPU; base: a few minutes on one H200).
2. Records: the standard library's held-out files (the model never trained on them), joined in corpus
   order, are cut at a line break into a train part (the first `--train-share` of the text) and a test
   part (the rest), and `kubemoe predictor collect` records the routing of each. The train part's last fifth of requests
   judges epochs (early stopping); every number below is on the test part.
3. Predictors, all predicting MoE layer l+1 at layer l:
   - reuse:   layer l+1's router applied to the hidden state entering layer l, unchanged
              (`LoadPredictor.from_routers`, distance 1; the gate-based prefetch of Fate / Klotski);
   - moeless: those router copies after MoEless's layer-aware fine-tuning (`predictor_train.finetune`);
   - llapor:  LayerScope's LLaPor (`frontend/offload/llapor_train.py`), groups found from the records.
4. Metrics per source layer and per layer group (LLaPor's groups): top-k set accuracy, and the candidate
   hit: the share of the true next-layer experts within the predictor's top-(K + 2) (LayerScope's "top-4
   hit within true top-6" for top-2 models; see llapor_train.py for why the spare slots sit on the
   prediction's side). Goal `llapor_top4_hit`: LLaPor's candidate hit over all layers >= 0.94.
   `llapor_online` also reports LLaPor with online fine-tuning over the test part in order, scored
   prequentially (each chunk is predicted before the tuner may learn from it).

    python benchmarks/llapor_accuracy.py                             # small model, CPU (a few minutes)
    python benchmarks/llapor_accuracy.py --checkpoint /tmp/moe-small # a trained checkpoint
    python benchmarks/llapor_accuracy.py --size base --device cuda   # on the H200
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, Goal, print_table, write_results  # noqa: E402

from kubemoe.adapters import MoEAdapter  # noqa: E402
from kubemoe.checkpoint import Checkpoint  # noqa: E402
from kubemoe.corpus import stdlib_corpus  # noqa: E402
from kubemoe.frontend.collect import collect_records  # noqa: E402
from kubemoe.frontend.offload.layer_groups import GROUPS  # noqa: E402
from kubemoe.frontend.offload.llapor import LLaPor  # noqa: E402
from kubemoe.frontend.offload.llapor_train import (  # noqa: E402
    SPARE_CANDIDATES, LLaPorConfig, OnlineConfig, OnlineTuner, layer_rows, score_rows, train_llapor,
)
from kubemoe.frontend.predictor import LoadPredictor  # noqa: E402
from kubemoe.frontend.predictor_train import TrainConfig, candidate_hit, finetune, topk_accuracy  # noqa: E402
from kubemoe.frontend.model_shape import ModelShape  # noqa: E402
from kubemoe.frontend.records import RoutingRecords  # noqa: E402
from kubemoe.train import TRAINING_FILE, get_recipe, train_moe  # noqa: E402

GOAL_HIT = ">= 0.94"
ONLINE_CHUNK = 64  # tokens per online observation: about one decode step of a batch


def held_out_parts(checkpoint: Path, size: str, train_share: float) -> tuple[str, str, str]:
    """(train text, test text, corpus fingerprint) from the held-out files of the corpus the model trained on."""
    training = checkpoint / TRAINING_FILE
    recipe = json.loads(training.read_text()).get("recipe", size) if training.is_file() else size
    # training.json's "recipe" is the recipe's name (the report's field overwrites the recipe written beside it)
    corpus = stdlib_corpus(recipe["corpus_chars"] if isinstance(recipe, dict) else get_recipe(recipe).corpus_chars)
    text = "\n".join(corpus.held_out)
    # at a line break, not a document boundary: one file can be most of the held-out text (the small
    # recipe's holds a 147k-character file among 225k), and whole files would leave a sliver to test on
    cut = text.find("\n", int(train_share * len(text)))
    if cut < 0 or not text[cut:].strip():
        raise SystemExit("the held-out text is too short to cut: lower --train-share")
    return text[:cut], text[cut + 1:], corpus.fingerprint


def records_of(checkpoint: Path, text: str, work: Path, name: str, args, shape: ModelShape) -> RoutingRecords:
    (work / f"{name}.txt").write_text(text)
    report = collect_records(checkpoint, work / f"{name}.txt", work / name, args.max_tokens, args.seq_len,
                             args.batch, args.device, None, args.max_mb)
    print(f"recorded {report.rows} tokens of {report.requests} requests ({name}) in {report.seconds:.1f}s")
    return RoutingRecords.load(work / name, shape)


@torch.no_grad()
def router_scores(predictor: LoadPredictor, records: RoutingRecords, source: int, device: str) -> tuple[float, float]:
    """(top-k accuracy, candidate hit) of a router-copy predictor at `source` (top-(K + 2) of its scores)."""
    target = predictor.pairs[source]
    hidden = records.hidden[:, records.layer_index(source)].to(device, torch.float32)
    true = records.experts[:, records.layer_index(target)].to(device)
    bias = predictor.biases.get(target)
    count = min(predictor.shape.top_k + SPARE_CANDIDATES, predictor.shape.num_experts)
    candidates = torch.cat([(predictor.logits(target, hidden[i:i + 8192]) + (0 if bias is None else bias))
                            .topk(count, -1).indices for i in range(0, len(hidden), 8192)])
    return topk_accuracy(candidates[:, :predictor.shape.top_k], true), candidate_hit(candidates, true)


def online_scores(llapor: LLaPor, records: RoutingRecords, source: int, device: str) -> tuple[float, float, int]:
    """(top-k accuracy, candidate hit, fine-tunings) of a copy of LLaPor tuned online over `records` in order."""
    tuner = OnlineTuner(copy.deepcopy(llapor).to(device), OnlineConfig())
    rows = layer_rows(records, source, device)
    k, count = llapor.shape.top_k, min(llapor.shape.top_k + SPARE_CANDIDATES, llapor.shape.num_experts)
    predicted = []
    for i in range(0, len(rows), ONLINE_CHUNK):
        chunk = rows.take(slice(i, i + ONLINE_CHUNK))
        predicted.append(tuner.predictor.predict(source, chunk.hidden, chunk.experts, chunk.weights, count)[1])
        tuner.observe(source, chunk.hidden, chunk.experts, chunk.weights, chunk.true_next)
    candidates = torch.cat(predicted)
    return (topk_accuracy(candidates[:, :k], rows.true_next), candidate_hit(candidates, rows.true_next),
            tuner.tunes.get(source, 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="a trained checkpoint (default: train --size here)")
    parser.add_argument("--size", default="small", choices=["small", "base"], help="the recipe to train")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--max-tokens", type=int, default=200_000, help="tokens recorded per part at most")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per recorded request")
    parser.add_argument("--batch", type=int, default=8, help="requests per forward pass while recording")
    parser.add_argument("--max-mb", type=int, default=4096, help="MiB of records per part at most")
    parser.add_argument("--train-share", type=float, default=0.7, help="of the held-out text, for training")
    parser.add_argument("--work", type=Path, help="folder for the model and records (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="llapor-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        run(args, device, work)


def run(args, device: torch.device, work: Path) -> None:
    timings = {}
    start = time.perf_counter()
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = work / f"moe-{args.size}"
        report = train_moe(get_recipe(args.size), checkpoint, seed=0, device=device, progress=False)
        print(f"trained the {args.size} MoE in {report.seconds:.0f}s (held-out loss {report.held_out_loss:.3f})")
    timings["model_s"] = time.perf_counter() - start
    ckpt = Checkpoint(checkpoint)
    adapter = MoEAdapter(ckpt.config)
    shape = ModelShape.of(adapter)

    start = time.perf_counter()
    train_text, test_text, fingerprint = held_out_parts(checkpoint, args.size, args.train_share)
    train_records = records_of(checkpoint, train_text, work, "records-train", args, shape)
    test = records_of(checkpoint, test_text, work, "records-test", args, shape)
    fit, held = train_records.split(0.8)
    timings["records_s"] = time.perf_counter() - start

    dev = str(device)
    start = time.perf_counter()
    reuse = LoadPredictor.from_routers(adapter, ckpt, 1, device=dev)
    moeless = finetune(reuse, fit, held, TrainConfig(device=dev)).to(dev)
    timings["moeless_train_s"] = time.perf_counter() - start
    start = time.perf_counter()
    llapor = train_llapor(fit, held, LLaPorConfig(device=dev)).to(dev)
    timings["llapor_train_s"] = time.perf_counter() - start

    raw, per_layer = [], []
    for source, target in llapor.pairs.items():
        start = time.perf_counter()
        *online, tunes = online_scores(llapor, test, source, dev)
        timings["llapor_online_s"] = timings.get("llapor_online_s", 0.0) + time.perf_counter() - start
        results = {"reuse": router_scores(reuse, test, source, dev), "moeless": router_scores(moeless, test, source, dev),
                   "llapor": score_rows(llapor, source, layer_rows(test, source, dev)), "llapor_online": online}
        row = {"layer": f"{source}->{target}", "group": llapor.group(source)}
        for name, (accuracy, hit) in results.items():
            raw.append({"predictor": name, "source": source, "target": target, "group": row["group"],
                        "topk_accuracy": round(accuracy, 4), "candidate_hit": round(hit, 4),
                        **({"online_finetunings": tunes} if name == "llapor_online" else {})})
            row |= {f"{name}_topk_accuracy": accuracy, f"{name}_candidate_hit": hit}
        per_layer.append(row)

    k = shape.top_k
    names = list(results)
    per_group = []
    for group in [g for g in GROUPS if any(r["group"] == g for r in per_layer)] + ["all"]:
        members = [r for r in per_layer if group in ("all", r["group"])]
        per_group.append({"layer": f"{len(members)} layers", "group": group,
                          **{key: round(sum(r[key] for r in members) / len(members), 4)
                             for key in members[0] if key not in ("layer", "group")}})
    columns = [("group", "group", ""), ("layer", "layers", "")]
    columns += [(f"{n}_topk_accuracy", f"{n} top-{k}", ".3f") for n in names]
    columns += [(f"{n}_candidate_hit", f"{n} in top-{k + SPARE_CANDIDATES}", ".3f") for n in names]
    print(f"\nper layer (test part, {len(test)} tokens): top-{k} accuracy and share of true experts "
          f"within the top-{k + SPARE_CANDIDATES} candidates")
    print_table(per_layer, columns)
    print("\nper layer group (means over its layers)")
    print_table(per_group, columns)

    overall = next(r for r in per_group if r["group"] == "all")
    goals = {"llapor_top4_hit": Goal(overall["llapor_candidate_hit"], GOAL_HIT)}
    write_results(
        "llapor", device, raw, goals, out=args.out,
        measured="MEASURED on the routing of kubemoe's own trained MoE over held-out standard-library text",
        model={"checkpoint": str(checkpoint) if args.checkpoint else f"trained here: {args.size} recipe, seed 0",
               "shape": shape.to_metadata(), "corpus_fingerprint": fingerprint},
        metric=f"candidate_hit: share of the true next-layer top-{k} experts within the predictor's top-"
               f"{k + SPARE_CANDIDATES} (LayerScope's top-4 within true top-6, spare slots on the prediction's side)",
        rows={"fit": len(fit), "held": len(held), "test": len(test)},
        layer_groups={"rule": "three contiguous groups by the least-squares piecewise-constant fit of the "
                       "consecutive-layer routing correlation (frontend/offload/layer_groups.py)",
                      "groups": {str(s): llapor.group(s) for s in llapor.pairs},
                      "correlation": llapor.info["correlation"]},
        llapor={"parameters": llapor.parameters_count(), "archs": {str(s): vars(a) for s, a in llapor.archs.items()},
                "training": llapor.info["layers"]},
        per_group=per_group, timings={k: round(v, 1) for k, v in timings.items()},
    )


if __name__ == "__main__":
    main()
