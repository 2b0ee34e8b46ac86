"""Factories for the offload tests: round cost figures that make schedules easy to work out by hand."""

import pytest

from kubemoe.frontend.offload.costs import CostLine, ExpertCosts
from kubemoe.frontend.offload.policy import LayerDemand


def _costs(t_io=2.0, t_g=0.5, beta=1.0, c=1.0) -> ExpertCosts:
    """Default: t_io = 2, t_g(n) = 0.5, t_c(n) = n + 1 (seconds; the units do not matter)."""
    return ExpertCosts(100, t_io, CostLine(0.0, t_g), CostLine(beta, c))


def _demand(pending, resident=(), ahead=(), resident_ahead=None, t_attn=1.0, slots=4, layer=0) -> LayerDemand:
    if resident_ahead is None:
        resident_ahead = [()] * len(ahead)
    return LayerDemand(layer, dict(pending), frozenset(resident), [dict(a) for a in ahead],
                       [frozenset(r) for r in resident_ahead], t_attn, slots)


@pytest.fixture
def make_costs():
    return _costs


@pytest.fixture
def make_demand():
    return _demand


@pytest.fixture
def costs():
    return _costs()
