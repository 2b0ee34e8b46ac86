"""Sizes on the command line, written as Kubernetes writes quantities (20Gi, 512Mi, 1G) or in bytes."""

from __future__ import annotations

import click


class ByteSize(click.ParamType):
    """A positive size in bytes, from a quantity such as 20Gi, 512Mi or 1G, or a number of bytes."""

    name = "SIZE"

    def convert(self, value, param, ctx) -> int:
        from kubernetes.utils import parse_quantity  # here, not at the top: command-line help must not wait for it

        if isinstance(value, int):
            return value
        try:
            size = int(parse_quantity(value))
        except (ValueError, TypeError, OverflowError):  # OverflowError: "inf" reads as Decimal('Infinity')
            self.fail(f"{value!r} is not a size: write e.g. 20Gi, 512Mi or a number of bytes", param, ctx)
        if size <= 0:
            self.fail(f"{value!r}: the size must be positive", param, ctx)
        return size
