"""Sizes on the command line read as Kubernetes reads quantities, without the kubernetes client."""

from __future__ import annotations

import click
import pytest
from kubernetes.utils import parse_quantity

from kubemoe.sizes import ByteSize, parse_size


@pytest.mark.parametrize("text", ["20Gi", "512Mi", "1G", "4096", "1.5Gi", "0.5k", "7Ki", "2Ti", "1e3", "3E"])
def test_a_size_is_what_kubernetes_reads(text):
    assert parse_size(text) == int(parse_quantity(text))


@pytest.mark.parametrize("text", ["lots", "Gi", "1.2.3", "", "nan", "inf", "-0x10"])
def test_a_non_size_is_refused(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


def test_the_option_wants_a_positive_size():
    assert ByteSize().convert("8Gi", None, None) == 8 * 2**30
    with pytest.raises(click.BadParameter, match="must be positive"):
        ByteSize().convert("0", None, None)
