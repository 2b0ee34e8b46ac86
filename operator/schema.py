"""Kinds of spec fields: each declared field makes its OpenAPI schema (for the CRD), checks and reads a
value (for the parser) and documents itself (for the field reference), from one declaration.

`read` does what the API server does with the CRD: fill schema defaults, check types, bounds, enums and
patterns, evaluate the objects' rules, refuse with the same message as the CRD's CEL rule. Fields that
only the parser defaults (`crd_default=False`: a schema default would make CEL's has() true and hide what
the user wrote) are filled afterwards, as the operator does after the server. Values come back converted:
quantities as bytes (int), numbers as float; durations keep their text (Knative takes it as written).
"""

from __future__ import annotations

import copy
import re
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Callable, Iterator, Mapping

from kubernetes.utils import parse_quantity

Schema = dict[str, Any]

# Whole hours, minutes and seconds in Go's time.ParseDuration syntax: "10m", "1h30m", "90s". Knative takes
# its scale-down-delay and progress-deadline annotations only at second precision (its webhook refuses
# "1500ms"), and nothing in the spec needs finer.
DURATION_PATTERN = r"^([0-9]+(s|m|h))+$"
DURATION_EXAMPLES = "whole seconds, minutes or hours such as 90s, 10m or 1h30m"
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600}


class SpecError(ValueError):
    """A spec the operator cannot serve; the message names the field and what to write instead."""


def parse_duration(text: str, field_name: str) -> float:
    """Go duration -> seconds."""
    if not isinstance(text, str) or not re.fullmatch(DURATION_PATTERN, text):
        raise SpecError(f"{field_name} must be a duration in {DURATION_EXAMPLES}, got {text!r}")
    return float(sum(int(n) * _DURATION_UNITS[unit] for n, unit in re.findall(r"([0-9]+)(s|m|h)", text)))


def parse_bytes(value: Any, field_name: str) -> int:
    try:
        quantity = parse_quantity(value) if not isinstance(value, bool) else None
    except (ValueError, TypeError):
        quantity = None
    if quantity is None or quantity <= 0 or quantity != int(quantity):
        raise SpecError(f"{field_name} {BYTES_MESSAGE}, got {value!r}")
    return int(quantity)


# A fraction of a byte ("500m") is a valid quantity: refused, not rounded down to nothing.
BYTES_MESSAGE = "must be a positive whole number of bytes such as 268435456, 256Mi or 1Gi"


@dataclass(frozen=True)
class Rule:
    """A constraint across fields of one object: CEL for the API server, `holds` for the parser (over the
    object as read, quantities in bytes; a field is "has()" when its key is there), one message for both."""

    cel: str
    message: str
    holds: Callable[[Mapping[str, Any]], bool]

    def schema(self) -> dict[str, str]:
        return {"rule": self.cel, "message": self.message}


@dataclass(frozen=True)
class Field:
    doc: str
    _: KW_ONLY
    default: Any = None       # None: no default
    crd_default: bool = True  # False: only the parser fills the default in

    type_name = ""            # in the field reference (a property where it depends on the field's settings)
    unit = ""                 # said after the description in the CRD

    def schema(self, path: str) -> Schema:
        """The OpenAPI schema of the field at `path` (messages name it)."""
        raise NotImplementedError

    def check(self, value: Any, path: str) -> Any:
        """What the API server checks of a value written here -> the value as the parser reads it."""
        raise NotImplementedError

    def complete(self, value: Any) -> Any:
        """The parser's own defaults, filled in after the server's (objects only)."""
        return value

    def read(self, value: Any, path: str) -> Any:
        return self.complete(self.check(value, path))

    def description(self) -> str:
        text = f"{self.doc} {self.unit}" if self.unit else self.doc
        return text if self.default is None else f"{text} Default: {self.default}."

    def rows(self, path: str) -> Iterator[tuple[str, str, str, str]]:
        """(path, type, default, description) for the field reference."""
        yield path, self.type_name, "" if self.default is None else f"`{self.default}`", self.doc

    def _with_default(self, schema: Schema) -> Schema:
        if self.default is not None and self.crd_default:
            schema["default"] = self.default
        return schema


def _bounds(minimum, maximum, why: str) -> tuple[str, str] | None:
    parts = [(f"self >= {minimum}", f"at least {minimum}")] if minimum is not None else []
    parts += [(f"self <= {maximum}", f"at most {maximum}")] if maximum is not None else []
    if not parts:
        return None
    return " && ".join(rule for rule, _ in parts), f"must be {' and '.join(text for _, text in parts)}{why}"


@dataclass(frozen=True)
class Integer(Field):
    minimum: int | None = None
    maximum: int | None = None
    why: str = ""             # appended to the bounds message: why the bound is there

    @property
    def type_name(self) -> str:  # type: ignore[override]  # read only: a class attribute in Field
        low, high = self.minimum, self.maximum
        return "integer" + (f", {low if low is not None else ''}..{high if high is not None else ''}"
                            if (low, high) != (None, None) else "")

    def schema(self, path: str) -> Schema:
        schema = self._with_default({"type": "integer", "description": self.description()})
        bounds = _bounds(self.minimum, self.maximum, self.why)
        if bounds:
            schema["x-kubernetes-validations"] = [{"rule": bounds[0], "message": f"{path} {bounds[1]}"}]
        return schema

    def check(self, value: Any, path: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise SpecError(f"{path} must be an integer, got {value!r}")
        bounds = _bounds(self.minimum, self.maximum, self.why)
        if bounds and ((self.minimum is not None and value < self.minimum)
                       or (self.maximum is not None and value > self.maximum)):
            raise SpecError(f"{path} {bounds[1]}, got {value}")
        return value


@dataclass(frozen=True)
class Number(Field):
    """A float with a range: `cel` is the range as CEL, `within` the same in Python, `message` what the CRD
    and the parser say after the field's path when it is outside."""

    cel: str = ""
    within: Callable[[float], bool] = lambda v: True
    message: str = ""

    @property
    def type_name(self) -> str:  # type: ignore[override]  # read only: a class attribute in Field
        return f"number ({self.message})" if self.message else "number"

    def schema(self, path: str) -> Schema:
        schema = self._with_default({"type": "number", "description": self.description()})
        if self.cel:
            schema["x-kubernetes-validations"] = [{"rule": self.cel, "message": f"{path} {self.message}"}]
        return schema

    def check(self, value: Any, path: str) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SpecError(f"{path} must be a number, got {value!r}")
        if not self.within(value):
            raise SpecError(f"{path} {self.message}, got {value}")
        return float(value)


@dataclass(frozen=True)
class String(Field):
    enum: tuple[str, ...] = ()
    pattern: str = ""         # a regular expression the value matches (CEL's matches(), RE2: anchor it)
    message: str = ""         # what the CRD and the parser say after the field's path when it does not
    max_length: int = 253

    @property
    def type_name(self) -> str:  # type: ignore[override]  # read only: a class attribute in Field
        return "string: " + " \\| ".join(f"`{e}`" for e in self.enum) if self.enum else "string"

    def schema(self, path: str) -> Schema:
        schema = self._with_default({"type": "string", "description": self.description(),
                                     "maxLength": self.max_length})
        if self.enum:
            schema["enum"] = list(self.enum)
        if self.pattern:
            schema["x-kubernetes-validations"] = [{"rule": f"self.matches('{self.pattern}')",
                                                   "message": f"{path} {self.message}"}]
        return schema

    def check(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise SpecError(f"{path} must be a string, got {value!r}")
        if len(value) > self.max_length:
            raise SpecError(f"{path} is longer than {self.max_length} characters")
        if self.enum and value not in self.enum:
            raise SpecError(f"{path} {value!r}: choose one of {', '.join(self.enum)}")
        if self.pattern and not re.search(self.pattern, value):
            raise SpecError(f"{path} {self.message}, got {value!r}")
        return value


@dataclass(frozen=True)
class Quantity(Field):
    """Bytes as a Kubernetes quantity (an integer or a string such as 256Mi), read as an int."""

    type_name = "quantity (bytes)"
    unit = "Unit: bytes, as a quantity (e.g. 268435456, 256Mi, 1Gi)."

    def schema(self, path: str) -> Schema:
        schema = {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
                  "description": self.description(),
                  "x-kubernetes-validations": [{
                      "rule": "isQuantity(string(self)) && quantity(string(self)).isGreaterThan(quantity('0')) && "
                              "quantity(string(self)).isInteger()",
                      "message": f"{path} {BYTES_MESSAGE}"}]}
        return self._with_default(schema)

    def check(self, value: Any, path: str) -> int:
        return parse_bytes(value, path)


@dataclass(frozen=True)
class Duration(Field):
    """A Go duration in whole seconds (DURATION_PATTERN), kept as written (Knative's annotations take the
    same syntax); `positive`: longer than 0s."""

    positive: bool = False
    type_name = "duration"
    unit = "Unit: a Go duration in whole seconds, minutes or hours (e.g. 90s, 10m, 1h30m)."

    def schema(self, path: str) -> Schema:
        rules = [{"rule": f"self.matches('{DURATION_PATTERN}')", "message": f"{path} must be a duration in {DURATION_EXAMPLES}"}]
        if self.positive:  # a value that is no duration fails the rule above, with its own message
            rules.append({"rule": f"!self.matches('{DURATION_PATTERN}') || duration(self) > duration('0s')",
                          "message": f"{path} must be longer than 0s"})
        return self._with_default({"type": "string", "maxLength": 64, "description": self.description(),
                                   "x-kubernetes-validations": rules})

    def check(self, value: Any, path: str) -> str:
        if parse_duration(value, path) <= 0 and self.positive:
            raise SpecError(f"{path} must be longer than 0s")
        return value


@dataclass(frozen=True)
class List(Field):
    """A list of unique integers (the only list the spec types: moeLayers)."""

    min_items: int = 0
    max_items: int = 0
    minimum: int = 0
    maximum: int = 0

    @property
    def type_name(self) -> str:  # type: ignore[override]  # read only: a class attribute in Field
        return f"list of {self.min_items}..{self.max_items} unique integers in {self.minimum}..{self.maximum}"

    def schema(self, path: str) -> Schema:
        return {"type": "array", "maxItems": self.max_items, "minItems": self.min_items,
                "x-kubernetes-list-type": "set", "description": self.description(),
                "items": {"type": "integer", "minimum": self.minimum, "maximum": self.maximum}}

    def check(self, value: Any, path: str) -> list[int]:
        if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise SpecError(f"{path} must be a list of integers, got {value!r}")
        if not self.min_items <= len(value) <= self.max_items:
            raise SpecError(f"{path} must have {self.min_items} to {self.max_items} items, got {len(value)}")
        if len(set(value)) != len(value):
            raise SpecError(f"{path} lists an index twice: {value}")
        if not all(self.minimum <= x <= self.maximum for x in value):
            raise SpecError(f"{path} items must be in {self.minimum}..{self.maximum}, got {value}")
        return list(value)


@dataclass(frozen=True)
class Opaque(Field):
    """A Kubernetes type the operator passes on as written (resources, tolerations, node selectors): the
    schema says what the API server accepts, the parser checks only that it is a mapping or a list."""

    openapi: Schema = field(default_factory=dict)

    def schema(self, path: str) -> Schema:
        return {**copy.deepcopy(self.openapi), "description": self.description()}  # no YAML anchors

    def check(self, value: Any, path: str) -> Any:
        kind = list if self.openapi.get("type") == "array" else dict
        if not isinstance(value, kind):
            raise SpecError(f"{path} must be {'a list' if kind is list else 'a mapping'}, got {value!r}")
        return value

    @property
    def type_name(self) -> str:  # type: ignore[override]
        return "list" if self.openapi.get("type") == "array" else "object"


@dataclass(frozen=True)
class Object(Field):
    fields: Mapping[str, Field] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    rules: tuple[Rule, ...] = ()
    type_name = "object"

    def description(self) -> str:
        return self.doc  # an object's default is {}: its fields' defaults say what that means

    def schema(self, path: str) -> Schema:
        properties = {name: child.schema(f"{path}.{name}") for name, child in self.fields.items()}
        schema: Schema = {"type": "object", "description": self.description(), "properties": properties}
        if self.required:
            schema["required"] = list(self.required)
        self._with_default(schema)
        if self.rules:
            schema["x-kubernetes-validations"] = [r.schema() for r in self.rules]
        return schema

    def check(self, value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise SpecError(f"{path} must be a mapping, got {value!r}")
        unknown = sorted(set(value) - set(self.fields))
        if unknown:  # the API server prunes them; a spec that skipped it is told
            raise SpecError(f"{path} has no field {unknown[0]!r}: choose from {', '.join(self.fields)}")
        out: dict[str, Any] = {}
        for name, child in self.fields.items():
            if name in value:
                out[name] = child.check(value[name], f"{path}.{name}")
            elif child.default is not None and child.crd_default:
                out[name] = child.check(child.default, f"{path}.{name}")
            elif name in self.required:
                raise SpecError(f"{path}.{name} is required: {child.doc}")
        for rule in self.rules:
            if not rule.holds(out):
                raise SpecError(rule.message)
        return out

    def complete(self, value: dict[str, Any]) -> dict[str, Any]:
        out = dict(value)
        for name, child in self.fields.items():
            if name in out:
                out[name] = child.complete(out[name])
            elif child.default is not None:  # crd_default False
                out[name] = child.read(child.default, f"(default of {name})")
        return out

    def rows(self, path: str) -> Iterator[tuple[str, str, str, str]]:
        yield path, "object", "", self.doc
        for name, child in self.fields.items():
            rows = child.rows(f"{path}.{name}")
            if name in self.required:
                first_path, kind, _, doc = next(rows)
                yield first_path, kind, "required", doc
            yield from rows

