"""On kubemoe's own trained MoE (the `small` recipe, trained once per session): its routing is skewed
where random weights are not, and the predictor commands learn it, end to end from the command line."""

from __future__ import annotations

import statistics

import pytest
from click.testing import CliRunner

from kubemoe.cli import cli
from kubemoe.corpus import stdlib_corpus
from kubemoe.frontend.collect import collect_records
from kubemoe.frontend.records import RoutingRecords
from kubemoe.planning.scaler import cv
from kubemoe.train import get_recipe, train_moe


@pytest.fixture(scope="module")
def held_out_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "held_out.txt"
    path.write_text("\n".join(stdlib_corpus(get_recipe("small").corpus_chars).held_out))
    return path


def _skew(records: RoutingRecords) -> tuple[list[float], list[float]]:
    counts = records.expert_counts().tolist()  # [L, E]
    return [cv(layer) for layer in counts], [max(layer) / sum(layer) for layer in counts]


def test_the_trained_model_routes_held_out_text_skewed_and_random_weights_do_not(trained_checkpoint, held_out_text,
                                                                                  tmp_path):
    random = tmp_path / "random"
    train_moe(get_recipe("small"), random, steps=0, progress=False)  # the same model, untrained
    skews = {}
    for name, checkpoint in (("trained", trained_checkpoint), ("random", random)):
        collect_records(checkpoint, held_out_text, tmp_path / name, max_tokens=8192, seq_len=128, batch=16, device="cpu")
        skews[name] = _skew(RoutingRecords.load(tmp_path / name))
    (trained_cv, trained_top), (random_cv, random_top) = skews["trained"], skews["random"]
    assert statistics.mean(trained_cv) > 2 * statistics.mean(random_cv)
    assert all(t > r for t, r in zip(trained_top, random_top))  # every layer has a clearly hot expert


def test_predictor_commands_collect_train_and_evaluate_on_real_routing(trained_checkpoint, held_out_text, tmp_path):
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(cli, list(args), catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    ckpt = str(trained_checkpoint)
    out = run("predictor", "collect", "--checkpoint", ckpt, "--text", str(held_out_text), "--out", str(tmp_path / "rec"),
              "--max-tokens", "12288", "--seq-len", "128", "--batch", "16", "--device", "cpu")
    assert "recorded 12288 tokens of 96 requests" in out
    trained = run("predictor", "train", "--checkpoint", ckpt, "--records", str(tmp_path / "rec"), "--out",
                  str(tmp_path / "p.safetensors"), "--distance", "2")
    assert "wrote finetuned predictor" in trained

    def mean_accuracy(predictor: str) -> float:
        out = run("predictor", "evaluate", "--checkpoint", ckpt, "--records", str(tmp_path / "rec"), "--predictor",
                  predictor, "--distance", "2")
        return float(out.split("mean: accuracy ")[1].split(",")[0])

    # the first predicted layer (from the embedding-side layer 0) is where the routers fall short
    assert mean_accuracy(str(tmp_path / "p.safetensors")) > mean_accuracy("router")
    bad = runner.invoke(cli, ["predictor", "train", "--checkpoint", ckpt, "--records", str(tmp_path / "rec"), "--out",
                              str(tmp_path / "q.safetensors"), "--distance", "8"])
    assert bad.exit_code != 0 and "at most 7" in str(bad.exception or bad.output)
