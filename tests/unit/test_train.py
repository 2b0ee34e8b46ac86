"""The corpus on the machine and kubemoe's own trained MoE: reproducible, loadable, skewed routing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kubemoe.adapters import MoEAdapter
from kubemoe.checkpoint import Checkpoint
from kubemoe.corpus import Corpus, stdlib_corpus
from kubemoe.errors import KubemoeError
from kubemoe.train import TRAINING_FILE, get_recipe, train_moe


def test_corpus_is_the_standard_library_split_by_file_and_the_same_every_time():
    a, b = stdlib_corpus(300_000), stdlib_corpus(300_000)
    assert a == b and a.fingerprint == b.fingerprint
    assert a.chars <= 300_000 and a.train and a.held_out
    assert not set(a.train) & set(a.held_out)  # whole files on each side
    assert any("def " in text for text in a.train)  # Python source, read from this interpreter's library
    assert stdlib_corpus(200_000).fingerprint != a.fingerprint


def _tiny_corpus() -> Corpus:
    c = stdlib_corpus(120_000)
    return Corpus(c.train, c.held_out, c.fingerprint)


def test_a_few_steps_write_a_checkpoint_every_command_loads_and_the_same_seed_gives_the_same_weights(tmp_path):
    recipe, corpus = get_recipe("small"), _tiny_corpus()
    first = train_moe(recipe, tmp_path / "a", seed=3, steps=3, progress=False, corpus=corpus)
    train_moe(recipe, tmp_path / "b", seed=3, steps=3, progress=False, corpus=corpus)
    train_moe(recipe, tmp_path / "c", seed=4, steps=3, progress=False, corpus=corpus)

    ckpt = Checkpoint(tmp_path / "a")
    adapter = MoEAdapter(ckpt.config)
    assert (adapter.arch.name, len(adapter.moe_layers), adapter.num_experts, adapter.top_k) == ("mixtral", 8, 16, 2)
    adapter.load_expert(ckpt, 7, 15)  # the adapters read it like any downloaded model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert tokenizer.decode(tokenizer("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"

    weights = [load_file(tmp_path / d / "model.safetensors") for d in "abc"]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert any(not torch.equal(weights[0][k], weights[2][k]) for k in weights[0])

    meta = json.loads((tmp_path / "a" / TRAINING_FILE).read_text())
    assert meta["seed"] == 3 and meta["corpus"]["fingerprint"] == corpus.fingerprint
    assert [step for step, _ in meta["losses"]] == [0, 2] and first.held_out_loss > 0


def test_training_refuses_to_overwrite_and_unknown_sizes_say_which_exist(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(KubemoeError, match="already holds a checkpoint"):
        train_moe(get_recipe("small"), tmp_path, steps=0, progress=False, corpus=_tiny_corpus())
    with pytest.raises(KubemoeError, match="choose one of: small, base"):
        get_recipe("huge")
