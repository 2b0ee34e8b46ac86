"""The operator's own settings, read once from the environment (the Helm chart sets them; see
`kubemoe operator --help` for the same settings as flags)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping

from kubemoe import ports

FIELD_MANAGER = "kubemoe-operator"
PREFIX = "KUBEMOE_OPERATOR_"


@dataclass(frozen=True)
class OperatorConfig:
    frontend_image: str = "ghcr.io/kubemoe/frontend:0.1.0"
    expert_image: str = "ghcr.io/kubemoe/expert-fn:0.1.0"
    s3_fetch_image: str = "docker.io/amazon/aws-cli:2.17.0"             # runs `aws s3 sync`
    gs_fetch_image: str = "gcr.io/google.com/cloudsdktool/google-cloud-cli:stable"  # runs `gcloud storage rsync`
    loads_interval_s: float = 30.0     # how often the timer pulls /loads and re-plans
    # How often /loads is read between those re-plans, to re-plan at once when a hot expert is short of
    # replicas (scaling out; scaling in waits for the timer). 0: only at each loadsInterval.
    scale_out_check_s: float = 1.0
    loads_port: int = ports.FRONTEND_HTTP  # the frontend's HTTP port, where /loads is served
    loads_timeout_s: float = 2.0       # per frontend; a frontend that does not answer is left out
    field_manager: str = FIELD_MANAGER
    # Objects applied at once. Each waits for the API server; at 1000 nodes on 2 cores 16 applied a load change's
    # ~400 pods in 4.5-4.9 s where 8 took 6.4-8.4 s (operator_plan.py). Far below a real API server's capacity.
    apply_concurrency: int = 16
    watch_namespaces: str = ""         # comma-separated, as `kubemoe operator --namespace` gives them; "": all

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "OperatorConfig":
        """KUBEMOE_OPERATOR_<FIELD> overrides each field, e.g. KUBEMOE_OPERATOR_LOADS_INTERVAL_S=5."""
        values = {}
        for f in fields(cls):
            raw = environ.get(PREFIX + f.name.upper())
            if raw is not None:
                kind: type = type(f.default)  # every field has a default of its own type
                try:
                    values[f.name] = kind(raw)
                except ValueError:
                    raise ValueError(f"{PREFIX}{f.name.upper()}={raw!r}: expected a {kind.__name__}") from None
        return cls(**values)
