"""The expert-load predictor: accuracy on hand-made routing, layer-aware fine-tuning on planted routing,
its file, and the errors a user can act on."""

from __future__ import annotations

import pytest
import torch

from kubemoe.adapters import MoEAdapter
from kubemoe.checkpoint import Checkpoint
from kubemoe.errors import KubemoeError
from kubemoe.frontend.predictor import LoadPredictor, prediction_pairs
from kubemoe.frontend.predictor_train import TrainConfig, evaluate, finetune, load_error, topk_accuracy, train_mlp
from kubemoe.frontend.model_shape import ModelShape
from kubemoe.frontend.records import RoutingRecords
from kubemoe.routing import route


def test_topk_accuracy_counts_the_true_experts_a_prediction_names():
    true = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    assert topk_accuracy(true.clone(), true) == 1.0
    assert topk_accuracy(torch.tensor([[1, 0], [3, 2], [5, 4], [7, 6]]), true) == 1.0  # order within a token is free
    assert topk_accuracy(torch.tensor([[0, 9], [9, 3], [8, 9], [6, 7]]), true) == pytest.approx((1 + 1 + 0 + 2) / 8)
    with pytest.raises(ValueError, match="differ in shape"):
        topk_accuracy(true[:, :1], true)


def test_load_error_is_the_total_variation_distance_of_the_loads_per_window():
    true = torch.tensor([[0], [0], [1], [1]])
    assert load_error(torch.tensor([[1], [1], [0], [0]]), true, 4, window=4) == 0.0  # same loads, other tokens
    assert load_error(torch.tensor([[2], [2], [3], [3]]), true, 4, window=4) == 1.0  # disjoint experts
    assert load_error(torch.tensor([[0], [0], [0], [1]]), true, 4, window=4) == pytest.approx(0.25)
    # two windows of two tokens: [0,0]->[0,0] (0) and [1,1]->[0,1] (0.5)
    assert load_error(torch.tensor([[0], [0], [0], [1]]), true, 4, window=2) == pytest.approx(0.25)


def test_distance_must_stay_inside_the_moe_layers():
    assert prediction_pairs((0, 1, 2, 3), 2) == {0: 2, 1: 3}
    assert prediction_pairs((1, 3, 5), 1) == {1: 3, 3: 5}  # in MoE-layer order, not decoder-layer order
    with pytest.raises(KubemoeError, match="at most 3"):
        prediction_pairs((0, 1, 2, 3), 4)
    with pytest.raises(KubemoeError, match="at least 1"):
        prediction_pairs((0, 1), 0)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    ckpt = Checkpoint(tiny_checkpoint("qwen3_moe"))  # 2 MoE layers, 16 experts, top-4
    return ckpt, MoEAdapter(ckpt.config)


def test_the_router_predictor_is_the_next_layers_router_applied_to_this_layers_hidden_state(tiny):
    ckpt, adapter = tiny
    predictor = LoadPredictor.from_routers(adapter, ckpt, 1)
    hidden = torch.randn(32, adapter.hidden_size)
    target, predicted = predictor.predict(0, hidden)
    weight = ckpt.read(adapter.router_tensors(1).weight, dtype=torch.float32)
    assert target == 1
    assert torch.equal(predicted.sort(-1).values, adapter.route(hidden, weight)[1])
    assert predictor.parameters_count() == adapter.num_experts * adapter.hidden_size


def _planted_records(adapter, n: int, seed: int, planted: torch.Tensor) -> RoutingRecords:
    """Records where layer 1 routes by `planted` applied to layer 0's hidden state: a known answer."""
    gen = torch.Generator().manual_seed(seed)
    shape = ModelShape.of(adapter)
    hidden = torch.randn(n, len(shape.moe_layers), shape.hidden_size, generator=gen)
    experts = torch.stack([route(hidden[:, 0] @ planted.T, adapter.routing)[1],
                           route(hidden[:, 0] @ planted.T, adapter.routing)[1]], 1)
    weights = torch.full(experts.shape, 1.0 / shape.top_k)
    request = torch.arange(n) // 16
    return RoutingRecords(shape, "planted", hidden, experts, weights, request, torch.arange(n) % 16)


def test_fine_tuning_learns_planted_routing_only_where_the_routers_fall_short(tiny):
    ckpt, adapter = tiny
    planted = torch.randn(adapter.num_experts, adapter.hidden_size, generator=torch.Generator().manual_seed(7))
    train, held = _planted_records(adapter, 4096, 1, planted), _planted_records(adapter, 1024, 2, planted)
    reuse = LoadPredictor.from_routers(adapter, ckpt, 1)
    (before,) = evaluate(reuse, held)
    assert before.accuracy < 0.5  # the real router knows nothing of the planted one

    tuned = finetune(reuse, train, held, TrainConfig(threshold=0.8, max_epochs=60))
    (after,) = evaluate(tuned, held)
    assert after.accuracy >= 0.8 and after.load_error < before.load_error
    assert tuned.info["layers"][1]["before"] == pytest.approx(before.accuracy, abs=1e-3)
    assert torch.equal(reuse.heads[1].weight, LoadPredictor.from_routers(adapter, ckpt, 1).heads[1].weight)  # a copy

    # a threshold the router already passes leaves its copy untouched
    lenient = finetune(reuse, train, held, TrainConfig(threshold=0.0))
    assert lenient.info["layers"][1]["epochs"] == 0
    assert torch.equal(lenient.heads[1].weight, reuse.heads[1].weight)

    mlp = train_mlp(adapter, 1, train, held, width=64, config=TrainConfig(max_epochs=30))
    assert evaluate(mlp, held)[0].accuracy > before.accuracy
    assert mlp.parameters_count() == adapter.hidden_size * 64 + 64 + 64 * adapter.num_experts + adapter.num_experts


def test_a_predictor_file_round_trips_and_refuses_another_model_or_distance(tiny, tiny_checkpoint, tmp_path):
    ckpt, adapter = tiny
    predictor = LoadPredictor.from_routers(adapter, ckpt, 1)
    predictor.heads[1].weight.data.add_(0.5)
    path = predictor.save(tmp_path / "p.safetensors")
    loaded = LoadPredictor.load(path, adapter)
    assert loaded.kind == "router" and loaded.distance == 1
    assert torch.equal(loaded.heads[1].weight, predictor.heads[1].weight)

    other = MoEAdapter(Checkpoint(tiny_checkpoint("mixtral")).config)
    with pytest.raises(KubemoeError, match="belongs to another model.*kubemoe predictor train"):
        LoadPredictor.load(path, other)
    with pytest.raises(KubemoeError, match="predicts 1 MoE layers ahead, not 2"):
        LoadPredictor.load(path, adapter, distance=2)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(KubemoeError, match="is not a predictor file"):
        LoadPredictor.load(tmp_path / "junk.safetensors", adapter)
    with pytest.raises(KubemoeError, match="no predictor file"):
        LoadPredictor.load(tmp_path / "missing", adapter)
