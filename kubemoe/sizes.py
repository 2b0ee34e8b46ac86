"""Sizes on the command line, written as Kubernetes writes quantities (20Gi, 512Mi, 1G) or in bytes.

Parsed here rather than with the kubernetes client: an expert function's image has no business with it."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

import click

_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "": 1}


def parse_size(text: str) -> int:
    """Bytes in a quantity such as 20Gi, 1.5G or 4096 (rounded up to a whole byte); ValueError otherwise."""
    text = text.strip()
    number, unit = text, ""
    for suffix in _SUFFIXES:
        if suffix and text.endswith(suffix):
            number, unit = text[: -len(suffix)], suffix
            break
    try:
        value = Decimal(number) * _SUFFIXES[unit]
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a size") from None
    if not value.is_finite():
        raise ValueError(f"{text!r} is not a size")
    return int(value.to_integral_value(rounding="ROUND_CEILING"))


class ByteSize(click.ParamType):
    """A positive size in bytes, from a quantity such as 20Gi, 512Mi or 1G, or a number of bytes."""

    name = "SIZE"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        try:
            size = parse_size(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a size: write e.g. 20Gi, 512Mi or a number of bytes", param, ctx)
        if size <= 0:
            self.fail(f"{value!r}: the size must be positive", param, ctx)
        return size
