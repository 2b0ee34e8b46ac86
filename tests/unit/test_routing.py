import pytest
import torch

from kubemoe.routing import RoutingSpec, route, select_experts


def test_softmax_topk_normalised_weights_sum_to_one():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 1.0]])
    weights, experts = route(logits, RoutingSpec(2, "softmax", normalize=True))
    assert experts.tolist() == [[2, 3], [0, 3]]
    assert torch.allclose(weights.sum(-1), torch.ones(2))
    assert weights[0, 1] > weights[0, 0]


def test_scaling_applies_after_normalisation():
    logits = torch.randn(5, 8)
    w1, e1 = route(logits, RoutingSpec(3, "sigmoid", normalize=True))
    w2, e2 = route(logits, RoutingSpec(3, "sigmoid", normalize=True, scaling=2.5))
    assert torch.equal(e1, e2) and torch.allclose(w2, 2.5 * w1)


def test_group_limited_selection_never_leaves_the_best_groups():
    # 4 groups of 2 experts; only the 1 best group may be used even if another group holds the 2nd best expert.
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0, 4.95, -9.0, 0.0, 0.0]])
    _, experts = route(logits, RoutingSpec(2, "sigmoid", n_group=4, topk_group=1, group_score="top2_sum"))
    assert experts.tolist() == [[0, 1]]
    _, free = route(logits, RoutingSpec(2, "sigmoid"))
    assert free.tolist() == [[0, 4]]


def test_bias_changes_selection_but_not_weights():
    logits = torch.tensor([[1.0, 0.9, -1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0])
    weights, experts = route(logits, RoutingSpec(1, "sigmoid", has_bias=True), bias)
    assert experts.tolist() == [[2]]
    assert weights.item() == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item())


@pytest.mark.parametrize(
    "kwargs, message",
    [({"top_k": 0, "scoring": "softmax"}, "top_k"), ({"top_k": 1, "scoring": "softmax", "n_group": 2, "topk_group": 3}, "topk_group")],
)
def test_invalid_specs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RoutingSpec(**kwargs)


def test_bias_must_match_spec():
    with pytest.raises(ValueError, match="bias"):
        route(torch.zeros(1, 4), RoutingSpec(1, "sigmoid"), torch.zeros(4))


@pytest.mark.parametrize("spec, bias", [
    (RoutingSpec(2, "softmax", normalize=True), None),
    (RoutingSpec(4, "sigmoid", normalize=True, n_group=4, topk_group=2, group_score="top2_sum", has_bias=True),
     torch.linspace(-0.1, 0.1, 16)),
    (RoutingSpec(1, "sigmoid", weight_on_input=True), None),
    (RoutingSpec(2, "sparsemixer", jitter_eps=0.01), None),
])
def test_select_experts_picks_the_experts_route_picks(spec, bias):
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(5))
    assert torch.equal(select_experts(logits, spec, bias).sort(-1).values, route(logits, spec, bias)[1])
