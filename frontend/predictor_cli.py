"""`kubemoe predictor collect | train | evaluate`: routing records and expert-load predictors."""

from __future__ import annotations

from pathlib import Path

import click

_checkpoint = click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
                           help="Checkpoint folder.")
_distance = click.option("--distance", type=click.IntRange(1), default=1, show_default=True,
                         help="Predict MoE layer l+d at layer l.")
_device = click.option("--device", default="cpu", show_default=True, help="Where to train and evaluate (cpu, cuda).")


@click.group("predictor")
def command() -> None:
    """Routing records and the expert-load predictor (MoEless)."""


@command.command("collect")
@_checkpoint
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="A text file to drive the model over.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Records folder to write.")
@click.option("--max-tokens", type=click.IntRange(1), default=200_000, show_default=True)
@click.option("--seq-len", type=click.IntRange(1), default=256, show_default=True, help="Tokens per request.")
@click.option("--batch", type=click.IntRange(1), default=8, show_default=True, help="Requests per forward pass.")
@click.option("--max-mb", type=click.IntRange(1), default=1024, show_default=True, help="Stop after this many MiB.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's).")
def collect(checkpoint, text_file, out, max_tokens, seq_len, batch, max_mb, device, dtype):
    """Record the hidden states entering each MoE layer and the experts chosen, over a text file."""
    from kubemoe.frontend.collect import collect_records

    r = collect_records(checkpoint, text_file, out, max_tokens, seq_len, batch, device, dtype, max_mb)
    click.echo(f"recorded {r.rows} tokens of {r.requests} requests into {out} ({r.shards} shards, "
               f"{r.megabytes:.1f} MiB) in {r.seconds:.1f}s")


def _records(path: Path, adapter):
    from kubemoe.frontend.model_shape import ModelShape
    from kubemoe.frontend.records import RoutingRecords

    return RoutingRecords.load(path, ModelShape.of(adapter))


@command.command("train")
@_checkpoint
@click.option("--records", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="Routing records of this checkpoint (their last fifth of requests judges each epoch).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Predictor file to write.")
@click.option("--kind", type=click.Choice(["finetuned", "mlp", "llapor"]), default="finetuned", show_default=True,
              help="finetuned: router copies fine-tuned where they fall short (MoEless); mlp: a from-scratch "
                   "MLP per layer (the ProMoE baseline); llapor: LayerScope's next-layer predictor for the "
                   "offload path (distance 1).")
@_distance
@click.option("--threshold", type=click.FloatRange(0, 1), default=0.8, show_default=True,
              help="Layers whose top-k accuracy is below this are fine-tuned, until they pass it or stop improving.")
@click.option("--width", type=click.IntRange(1), default=256, show_default=True, help="MLP hidden width (--kind mlp).")
@_device
def train(checkpoint, records, out, kind, distance, threshold, width, device):
    """Train an expert-load predictor on routing records."""
    from kubemoe.adapters import MoEAdapter
    from kubemoe.checkpoint import Checkpoint
    from kubemoe.errors import KubemoeError
    from kubemoe.frontend.predictor import LoadPredictor, prediction_pairs
    from kubemoe.frontend.predictor_train import TrainConfig, evaluate, finetune, train_mlp

    ckpt = Checkpoint(checkpoint)
    adapter = MoEAdapter(ckpt.config)
    prediction_pairs(adapter.moe_layers, distance)  # a distance past the last layer fails before any work
    if kind == "llapor" and distance != 1:
        raise KubemoeError(f"LLaPor predicts the next MoE layer only: use --distance 1, not {distance}")
    fit, held = _records(records, adapter).split(0.8)
    if kind == "llapor":
        return _train_llapor(fit, held, out, device)
    config = TrainConfig(threshold=threshold, device=device)
    if kind == "finetuned":
        predictor = finetune(LoadPredictor.from_routers(adapter, ckpt, distance), fit, held, config)
    else:
        predictor = train_mlp(adapter, distance, fit, held, width, config)
    predictor.save(out)
    for score in evaluate(predictor, held):
        click.echo(f"  layer {score.target:>2} from {score.source:>2}: top-{adapter.top_k} accuracy {score.accuracy:.3f}, "
                   f"load error {score.load_error:.3f}")
    click.echo(f"wrote {kind} predictor ({predictor.parameters_count():,} parameters, distance {distance}) to {out}")


def _train_llapor(fit, held, out: Path, device: str) -> None:
    from kubemoe.frontend.offload.llapor_train import SPARE_CANDIDATES, LLaPorConfig, evaluate_llapor, train_llapor

    predictor = train_llapor(fit, held, LLaPorConfig(device=device))
    predictor.save(out)
    k = predictor.shape.top_k
    for score in evaluate_llapor(predictor, held):
        click.echo(f"  layer {score.target:>2} from {score.source:>2} ({score.group:<6}): top-{k} accuracy "
                   f"{score.accuracy:.3f}, true experts within top-{k + SPARE_CANDIDATES} {score.candidate_hit:.3f}")
    click.echo(f"wrote llapor predictor ({predictor.parameters_count():,} parameters) to {out}")


@command.command("evaluate")
@_checkpoint
@click.option("--records", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--predictor", "predictor_choice", default="router", show_default=True, metavar="router|FILE")
@_distance
@_device
def evaluate_command(checkpoint, records, predictor_choice, distance, device):
    """Top-k accuracy and load error of a predictor, per layer, on routing records."""
    from kubemoe.adapters import MoEAdapter
    from kubemoe.checkpoint import Checkpoint
    from kubemoe.frontend.predictor import LoadPredictor
    from kubemoe.frontend.predictor_train import evaluate

    ckpt = Checkpoint(checkpoint)
    adapter = MoEAdapter(ckpt.config)
    predictor = LoadPredictor.from_routers(adapter, ckpt, distance) if predictor_choice == "router" \
        else LoadPredictor.load(predictor_choice, adapter, distance)
    scores = evaluate(predictor.to(device), _records(records, adapter), device=device)
    for score in scores:
        click.echo(f"  layer {score.target:>2} from {score.source:>2}: top-{adapter.top_k} accuracy {score.accuracy:.3f}, "
                   f"load error {score.load_error:.3f}")
    click.echo(f"mean: accuracy {sum(s.accuracy for s in scores) / len(scores):.3f}, "
               f"load error {sum(s.load_error for s in scores) / len(scores):.3f} ({predictor.kind}, distance {distance})")
