"""Routing records: what a serving frontend and `kubemoe predictor collect` write, bounded, and checked on read."""

from __future__ import annotations

import logging

import pytest
import torch

from kubemoe.adapters import MoEAdapter
from kubemoe.checkpoint import Checkpoint
from kubemoe.errors import KubemoeError
from kubemoe.frontend.collect import collect_records
from kubemoe.frontend.model_shape import ModelShape
from kubemoe.frontend.records import ForwardRows, RoutingRecorder, RoutingRecords
from kubemoe.frontend.sampling import SamplingParams

SHAPE = ModelShape("mixtral", (0, 1), 8, 2, 4)


def _pass(recorder: RoutingRecorder, rows: ForwardRows | None, tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, tokens, 4, generator=gen)
    recorder.start_forward(rows)
    for i, layer in enumerate(SHAPE.moe_layers):
        experts = torch.stack([torch.arange(tokens) % 8, (torch.arange(tokens) + 1 + i) % 8], 1)
        recorder.on_layer(layer, hidden[i], experts, torch.full((tokens, 2), 0.5))
    return hidden


def test_rows_are_aligned_across_layers_and_tagged_with_request_and_position(tmp_path):
    recorder = RoutingRecorder(tmp_path / "rec", SHAPE, "m", max_bytes=1 << 20)
    h1 = _pass(recorder, ForwardRows(("a",), (0,), (3,)), 3, 1)  # a prefill of 3 tokens
    h2 = _pass(recorder, ForwardRows(("a", "b"), (3, 5), (1, 1)), 2, 2)  # a decode step of two requests
    recorder.close()
    records = RoutingRecords.load(tmp_path / "rec", SHAPE)
    assert records.model == "m" and len(records) == 5
    assert records.request.tolist() == [0, 0, 0, 0, 1] and records.position.tolist() == [0, 1, 2, 3, 5]
    assert torch.equal(records.hidden[:3], h1.transpose(0, 1)) and torch.equal(records.hidden[3:], h2.transpose(0, 1))
    assert records.experts[:, 1, 1].tolist() == [2, 3, 4, 2, 3]  # layer 1's second choice, row by row
    train, held = records.split(0.5)
    assert set(train.request.tolist()) == {0} and set(held.request.tolist()) == {1}


def test_recording_stops_at_its_limit_and_says_so(tmp_path, caplog):
    recorder = RoutingRecorder(tmp_path / "rec", SHAPE, "m", max_bytes=1500)
    with caplog.at_level(logging.WARNING):
        for seed in range(10):
            _pass(recorder, None, 4, seed)  # about 270 bytes a pass
    recorder.close()
    assert recorder.full and "reached their limit" in caplog.text
    assert 0 < recorder.written_bytes <= 1500
    assert len(RoutingRecords.load(tmp_path / "rec")) == recorder.rows_written < 40


def test_records_of_another_model_or_an_empty_folder_are_refused_with_what_to_do(tmp_path):
    recorder = RoutingRecorder(tmp_path / "rec", SHAPE, "m", max_bytes=1 << 20)
    _pass(recorder, None, 4, 0)
    recorder.close()
    other = ModelShape("qwen3_moe", (0, 1), 16, 4, 4)
    with pytest.raises(KubemoeError, match="belongs to another model.*kubemoe predictor collect"):
        RoutingRecords.load(tmp_path / "rec", other)
    with pytest.raises(KubemoeError, match="holds no routing records"):
        RoutingRecords.load(tmp_path)
    with pytest.raises(KubemoeError, match="already holds routing records"):
        RoutingRecorder(tmp_path / "rec", SHAPE, "m", max_bytes=1 << 20)


async def test_a_serving_frontend_records_each_requests_rows_as_its_routers_chose(make_frontend, tmp_path):
    frontend = make_frontend(record_routing=tmp_path / "rec", predictor="none")
    prompt = frontend.tokenizer("def add(a, b):")["input_ids"]
    async for _ in frontend.engine.generate("req-1", prompt, SamplingParams(max_tokens=3, temperature=0.0)):
        pass
    frontend.recorder.close()
    records = RoutingRecords.load(tmp_path / "rec", ModelShape.of(frontend.adapter))
    n = len(prompt)
    assert records.position.tolist()[:n + 2] == list(range(n + 2))  # the prefill, then one row per decode step
    assert set(records.request.tolist()) == {0}
    # each recorded choice is what the layer's router makes of the recorded hidden state
    ckpt, adapter = frontend.checkpoint, frontend.adapter
    for i, layer in enumerate(adapter.moe_layers):
        weight = ckpt.read(adapter.router_tensors(layer).weight, dtype=torch.float32)
        assert torch.equal(adapter.route(records.hidden[:, i].float(), weight)[1], records.experts[:, i])


def test_collect_drives_a_text_file_and_rejects_an_empty_one(tiny_checkpoint, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("import os\nprint(os.getcwd())\n" * 40)
    report = collect_records(tiny_checkpoint("mixtral"), text, tmp_path / "rec", max_tokens=200, seq_len=32,
                             batch=3, device="cpu")
    records = RoutingRecords.load(tmp_path / "rec", ModelShape.of(MoEAdapter(Checkpoint(tiny_checkpoint("mixtral")).config)))
    assert report.rows == len(records) == report.requests * 32 and report.requests == 6
    assert records.position.tolist()[:33] == list(range(32)) + [0]

    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(KubemoeError, match="holds no text"):
        collect_records(tiny_checkpoint("mixtral"), tmp_path / "empty.txt", tmp_path / "rec2", device="cpu")
