"""Sizes on the command line: Kubernetes quantities, positive, and a non-size refused with what to write."""

from __future__ import annotations

import click
import pytest

from kubemoe.sizes import ByteSize


@pytest.mark.parametrize(("text", "size"), [("20Gi", 20 * 2**30), ("512Mi", 512 * 2**20), ("1G", 10**9),
                                             ("4096", 4096), ("1.5Gi", 3 * 2**29), ("7Ki", 7 * 2**10)])
def test_a_size_reads_as_kubernetes_writes_it(text, size):
    assert ByteSize().convert(text, None, None) == size


@pytest.mark.parametrize(("text", "size"), [("20GiB", 20 * 2**30), ("81559MiB", 81559 * 2**20), ("1GB", 10**9),
                                             ("64KB", 64 * 10**3), ("64kB", 64 * 10**3), (" 2TiB ", 2 * 2**40)])
def test_a_unit_with_a_b_reads_as_its_quantity(text, size):  # as nvidia-smi, free and most tools print sizes
    assert ByteSize().convert(text, None, None) == size


@pytest.mark.parametrize("text", ["lots", "Gi", "1.2.3", "", "nan", "inf", "-0x10", "GiB", "1.2.3GB", "5B", "5iB"])
def test_a_non_size_is_refused(text):
    with pytest.raises(click.BadParameter, match="is not a size: write e.g. 20Gi"):
        ByteSize().convert(text, None, None)


def test_the_option_wants_a_positive_size():
    assert ByteSize().convert("8Gi", None, None) == 8 * 2**30
    with pytest.raises(click.BadParameter, match="must be positive"):
        ByteSize().convert("0", None, None)
