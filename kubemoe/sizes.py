"""Sizes on the command line, written as Kubernetes writes quantities (20Gi, 512Mi, 1G) or in bytes.

People also write units with a B (20GiB, 512MB, 64KB), as most tools print them: those read as the
quantity without it (64KB as 64k), so a size copied from nvidia-smi or free is not refused.
"""

from __future__ import annotations

import re

import click

# a unit with a B -> the quantity's suffix (Kubernetes writes kilo as k; people write KB and kB)
_WITH_B = {f"{unit}iB": f"{unit}i" for unit in "KMGTPE"} | {f"{unit}B": unit for unit in "kMGTPE"} | {"KB": "k"}
_UNIT_WITH_B = re.compile(rf"(.*?)({'|'.join(_WITH_B)})")


class ByteSize(click.ParamType):
    """A positive size in bytes, from a quantity such as 20Gi, 512Mi or 1G, or a number of bytes."""

    name = "SIZE"

    def convert(self, value, param, ctx) -> int:
        from kubernetes.utils import parse_quantity  # here, not at the top: command-line help must not wait for it

        if isinstance(value, int):
            return value
        with_b = _UNIT_WITH_B.fullmatch(value.strip())
        quantity = value if with_b is None else with_b[1] + _WITH_B[with_b[2]]
        try:
            size = int(parse_quantity(quantity))
        except (ValueError, TypeError, OverflowError):  # OverflowError: "inf" reads as Decimal('Infinity')
            self.fail(f"{value!r} is not a size: write e.g. 20Gi, 512Mi or a number of bytes", param, ctx)
        if size <= 0:
            self.fail(f"{value!r}: the size must be positive", param, ctx)
        return size
