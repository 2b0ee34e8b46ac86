"""LLaPor: layer groups from routing correlation, learning planted next-layer routing, the hybrid loss,
online fine-tuning past 10% windowed error, and its file (round trip, another model's file refused)."""

from __future__ import annotations

import pytest
import torch

from kubemoe.errors import KubemoeError
from kubemoe.frontend.offload.layer_groups import find_layer_groups, routing_correlation, three_segments
from kubemoe.frontend.offload.llapor import PCA, LLaPor
from kubemoe.frontend.offload.llapor_train import (
    GroupConfig, LLaPorConfig, LossConfig, OnlineConfig, OnlineTuner, evaluate_llapor, hybrid_loss,
    inverse_frequency, layer_rows, train_llapor,
)
from kubemoe.frontend.model_shape import ModelShape
from kubemoe.frontend.records import RoutingRecords

E, K, H = 16, 2, 32
SHAPE = ModelShape("mixtral", (0, 1, 2, 3), E, K, H)  # three source layers: input, middle, output
FAST = GroupConfig(components=0.25, width=64, blocks=0, lr=1e-2, epochs=5)
FAST_CONFIG = LLaPorConfig(input=FAST, middle=GroupConfig(components=0.5, width=64, blocks=1, lr=1e-2, epochs=5),
                           output=FAST, batch=256)


def distinct_experts(n: int, gen: torch.Generator) -> torch.Tensor:  # [n, K], ascending, distinct per row
    return torch.rand(n, E, generator=gen).topk(K, -1).indices.sort(-1).values


def planted_records(n: int, seed: int, shift=lambda layer: layer + 1, shape: ModelShape = SHAPE) -> RoutingRecords:
    """Layer l+1 routes every token to its layer-l experts shifted by shift(l): a known answer."""
    gen = torch.Generator().manual_seed(seed)
    layers = [distinct_experts(n, gen)]
    for layer in range(len(shape.moe_layers) - 1):
        layers.append(((layers[-1] + shift(layer)) % E).sort(-1).values)
    experts = torch.stack(layers, 1)
    weights = torch.rand(experts.shape, generator=gen).softmax(-1)
    hidden = torch.randn(n, len(shape.moe_layers), H, generator=gen)
    request = torch.arange(n) // 32
    return RoutingRecords(shape, "planted", hidden, experts, weights, request, (torch.arange(n) % 32).int())


def test_routing_correlation_is_high_for_a_determined_next_layer_and_near_zero_for_an_independent_one():
    gen = torch.Generator().manual_seed(0)
    a = distinct_experts(20000, gen)
    determined = torch.stack([a, (a + 3) % E], 1)
    independent = torch.stack([a, distinct_experts(20000, gen)], 1)
    assert routing_correlation(determined, E)[0] > 0.2  # the crossed (k, k') pairs keep it well below 1
    assert routing_correlation(independent, E)[0] < 0.01
    assert routing_correlation(torch.stack([a, a], 1), E)[0] == pytest.approx(routing_correlation(determined, E)[0])


def test_three_segments_cut_where_the_level_changes():
    assert three_segments([0.9, 0.9, 0.2, 0.2, 0.2, 0.8, 0.8]) == (2, 5)
    assert three_segments([0.5, 0.1, 0.7]) == (1, 2)
    with pytest.raises(ValueError, match="at least three"):
        three_segments([0.1, 0.2])


def test_layer_groups_come_from_the_data_not_from_layer_indices():
    gen = torch.Generator().manual_seed(1)
    n = 8000
    layers = [distinct_experts(n, gen)]
    for predictable in (True, False, False, False, True, True):  # pairs 0..5: 1, then 3 independent, then 2
        layers.append((layers[-1] + 1) % E if predictable else distinct_experts(n, gen))
    groups = find_layer_groups(torch.stack(layers, 1), tuple(range(7)), E)
    assert groups.groups == ("input", "middle", "middle", "middle", "output", "output")
    assert groups.members("middle") == (1, 2, 3) and groups.of(5) == "output"
    few = find_layer_groups(torch.stack(layers[:3], 1), (0, 1, 2), E)
    assert few.groups == ("middle", "middle")  # too few pairs to cut: all get the deeper net


def test_pca_whitens_the_principal_axes():
    gen = torch.Generator().manual_seed(2)
    scale = torch.tensor([10.0, 3.0] + [0.01] * (H - 2))
    hidden = torch.randn(4000, H, generator=gen) * scale + 5.0
    rotation = torch.linalg.qr(torch.randn(H, H, generator=gen))[0]
    pca = PCA(H, 2).fit(hidden @ rotation)
    projected = pca(hidden @ rotation)  # [N, 2]
    assert projected.mean(0).abs().max() < 1e-3
    assert torch.allclose(projected.std(0), torch.ones(2), atol=0.02)
    first_axis = pca.basis[0] / pca.basis[0].norm()
    assert abs(float(first_axis @ rotation[0])) == pytest.approx(1.0, abs=1e-3)  # the widest axis, either sign


def test_the_hybrid_loss_weights_rare_experts_up_and_easy_answers_down():
    routed = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 1]])  # tokens per expert: 4, 3, 1, 0; mean 2
    assert inverse_frequency(routed, 4, cap=10.0).tolist() == pytest.approx([0.5, 2 / 3, 2.0, 2.0])  # unseen as once
    assert inverse_frequency(routed, 4, cap=1.5).tolist() == pytest.approx([0.5, 2 / 3, 1.5, 1.5])
    target = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    flat = torch.ones(4)
    confident_right = hybrid_loss(torch.tensor([[6.0, -6.0, -6.0, -6.0]]), target, flat, LossConfig())
    confident_wrong = hybrid_loss(torch.tensor([[-6.0, 6.0, -6.0, -6.0]]), target, flat, LossConfig())
    assert confident_right < 0.01 < 1.0 < confident_wrong
    missed_rare = hybrid_loss(torch.zeros(1, 4), target, torch.tensor([5.0, 1.0, 1.0, 1.0]), LossConfig())
    assert missed_rare > hybrid_loss(torch.zeros(1, 4), target, flat, LossConfig())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Nets this small gain nothing from threads, and on a shared 2-core machine they lose a lot."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained() -> LLaPor:
    return train_llapor(planted_records(3072, 0), planted_records(512, 1), FAST_CONFIG)


def test_llapor_learns_planted_next_layer_routing_with_the_net_of_each_group(trained):
    scores = evaluate_llapor(trained, planted_records(1024, 2))
    assert [s.group for s in scores] == ["input", "middle", "output"]  # correlation is flat: positional cuts
    for s in scores:
        assert s.accuracy > 0.95 and s.candidate_hit >= s.accuracy
    assert trained.archs[0].blocks == 0 and trained.archs[1].blocks == 1
    assert trained.archs[0].components == H // 4 < trained.archs[1].components == H // 2
    target, predicted = trained.predict(1, *_inputs_of(planted_records(4, 3), 1))
    assert target == 2 and predicted.shape == (4, K)


def _inputs_of(records: RoutingRecords, source: int):
    rows = layer_rows(records, source)
    return rows.hidden, rows.experts, rows.weights


def test_online_tuning_starts_past_ten_percent_windowed_error_and_recovers(trained):
    tuner = OnlineTuner(trained, OnlineConfig(window=256, max_steps=30, lr=1e-2))
    same = layer_rows(planted_records(256, 4), 0)
    assert not tuner.observe(0, same.hidden, same.experts, same.weights, same.true_next)
    assert tuner.error(0) < 0.10 and tuner.tunes == {}

    moved = planted_records(4096, 5, shift=lambda layer: layer + 5)  # the routing changed under the predictor
    rows, tuned_at = layer_rows(moved, 0), []
    for i in range(0, 4096, 128):
        chunk = rows.take(slice(i, i + 128))
        if tuner.observe(0, chunk.hidden, chunk.experts, chunk.weights, chunk.true_next):
            tuned_at.append(i)
    assert tuned_at and tuned_at[0] == 0  # as soon as the window (half old rows, half new) shows the error
    assert tuner.error(0) < 0.10  # the last window after tuning predicts the new routing
    assert tuner.tunes[0] == len(tuned_at) <= 8  # bounded: it stops once the error is back under 10%


def test_a_llapor_file_round_trips_and_another_models_file_is_refused(trained, tmp_path):
    path = trained.save(tmp_path / "llapor.safetensors")
    loaded = LLaPor.load(path, SHAPE)
    assert loaded.archs == trained.archs and loaded.info == trained.info
    inputs = _inputs_of(planted_records(64, 6), 2)
    assert torch.equal(loaded.logits(2, *inputs), trained.logits(2, *inputs))
    assert torch.equal(loaded.heads[0].pca.basis, trained.heads[0].pca.basis)

    other = ModelShape("mixtral", (0, 1, 2, 3), 8, K, H)
    with pytest.raises(KubemoeError, match=r"belongs to another model.*kubemoe predictor train --kind llapor") as e:
        LLaPor.load(path, other)
    assert "\n" not in str(e.value)
    with pytest.raises(KubemoeError, match="no LLaPor file"):
        LLaPor.load(tmp_path / "missing.safetensors", SHAPE)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(KubemoeError, match="is not a LLaPor file"):
        LLaPor.load(tmp_path / "junk.safetensors", SHAPE)


def test_predictor_train_kind_llapor_writes_a_file_and_prints_each_layers_accuracy(tiny_checkpoint, tmp_path):
    from click.testing import CliRunner

    from kubemoe.adapters import MoEAdapter
    from kubemoe.checkpoint import Checkpoint
    from kubemoe.frontend.collect import collect_records
    from kubemoe.frontend.predictor_cli import command

    checkpoint = tiny_checkpoint("mixtral")  # 2 MoE layers: one source layer, in the middle group
    (tmp_path / "t.txt").write_text("import os\nprint(os.getcwd())\n" * 40)
    collect_records(checkpoint, tmp_path / "t.txt", tmp_path / "rec", max_tokens=320, seq_len=32, device="cpu")
    args = ["train", "--checkpoint", str(checkpoint), "--records", str(tmp_path / "rec"), "--kind", "llapor",
            "--out", str(tmp_path / "llapor.safetensors")]
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 0, result.output
    assert "layer  1 from  0 (middle): top-2 accuracy" in result.output and "within top-4" in result.output
    assert LLaPor.load(tmp_path / "llapor.safetensors", ModelShape.of(MoEAdapter(Checkpoint(checkpoint).config)))
