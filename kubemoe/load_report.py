"""Reading a `kubemoe.v1.LoadReport` (what a frontend's /loads serves) as per-expert rates.

A report's rate for an expert is the predicted one (the load predictor's tokens/s for the window
ahead) when the frontend sends it, else the observed tokens/s: planning is for the load to come.
Shared by the operator's load source and `kubemoe plan`.
"""

from __future__ import annotations

import json
from typing import Iterable

from google.protobuf import json_format

from kubemoe.proto import kubemoe_pb2 as pb

ExpertKey = tuple[int, int]  # (layer, expert)
# What /loads answers in when asked for it (Accept): the binary LoadReport, ~50x faster to parse than its
# JSON, which for a DeepSeek-V3-sized model (58 x 256 experts) is 1.7 MB per frontend and window.
PROTOBUF = "application/x-protobuf"


class LoadReportError(ValueError):
    """Not a LoadReport in JSON; the message says what was expected."""


def expert_rate(load: pb.ExpertLoad) -> float:
    # getattr: frontends and wire versions without the predictor's field still report observed rates.
    predicted = getattr(load, "predicted_tokens_per_second", 0.0)
    return predicted if predicted > 0 else load.tokens_per_second


def parse_reports(text: str) -> list[pb.LoadReport]:
    """JSON of one LoadReport (as /loads serves it) or a list of them (one per frontend)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise LoadReportError(f"loads are not JSON ({e}); save a frontend's /loads, e.g. "
                              "curl http://FRONTEND:8000/loads > loads.json") from None
    docs = doc if isinstance(doc, list) else [doc]
    known = {n for f in pb.LoadReport.DESCRIPTOR.fields for n in (f.name, f.json_name)}
    strangers = [d for d in docs if not isinstance(d, dict) or (d and not known & d.keys())]
    if strangers:  # ignore_unknown_fields below would read any other JSON object as an empty report
        raise LoadReportError(f"loads are not kubemoe.v1.LoadReport JSON (as /loads serves it): found keys "
                              f"{sorted(strangers[0])[:5] if isinstance(strangers[0], dict) else strangers[0]!r}")
    try:
        return [json_format.ParseDict(d, pb.LoadReport(), ignore_unknown_fields=True) for d in docs]
    except (json_format.ParseError, AttributeError, TypeError) as e:
        raise LoadReportError(f"loads are not kubemoe.v1.LoadReport JSON (as /loads serves it): {e}") from None


def rates(reports: Iterable[pb.LoadReport]) -> dict[ExpertKey, float]:
    """tokens/s per (layer, expert), summed over the reports."""
    total: dict[ExpertKey, float] = {}
    for report in reports:
        for load in report.loads:
            key = (load.layer, load.expert)
            total[key] = total.get(key, 0.0) + expert_rate(load)
    return total


def passes_per_second(reports: Iterable[pb.LoadReport]) -> float:
    """Forward passes a second, summed over the reports (0 from frontends that do not report them)."""
    return sum(r.passes / r.window_seconds for r in reports if r.window_seconds > 0)
