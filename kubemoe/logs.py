"""How kubemoe's long-running commands log: INFO and above to stderr, which is what a pod's log shows (the
frontend's choices of predictor and hot experts are logged at INFO)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=FORMAT)
