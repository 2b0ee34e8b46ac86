"""Where the planner's expert loads come from: the frontends' `/loads` (JSON kubemoe.v1.LoadReport).

`FrontendLoads` asks every running frontend pod of a MoEDeployment (GET http://<pod IP>:8000/loads;
the pods from the operator's pod watch where it has one, else listed) and sums what answered; pod
IPs rather than the Service, because each frontend reports only its own traffic. `aggregate` is the
pure part. Anything with a `fetch(deployment) -> Loads | None` can stand in (tests, benchmarks, a
future Prometheus source).
"""

from __future__ import annotations

import logging
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping, Protocol

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from kubemoe.load_report import PROTOBUF, passes_per_second, rates
from kubemoe.operator.kube import Kube
from kubemoe.operator.plan import Loads
from kubemoe.operator.render import FRONTEND, selected, selector
from kubemoe.operator.spec import MoEDeployment
from kubemoe.proto import kubemoe_pb2 as pb

log = logging.getLogger(__name__)


class LoadSource(Protocol):
    def fetch(self, deployment: MoEDeployment) -> Loads | None:
        """Current loads, or None when no frontend answered (the caller keeps what it had)."""


def aggregate(reports: Iterable[pb.LoadReport], model: str) -> Loads | None:
    """Sum tokens/s per (layer, expert) over the frontends' reports of `model` (predicted where sent)."""
    mine = []
    for report in reports:
        if report.model and report.model != model:
            log.warning("frontend %s reports loads of model %r, expected %r: ignored", report.frontend, report.model, model)
            continue
        mine.append(report)
    if not mine:
        return None
    tokens = sum(r.tokens / r.window_seconds for r in mine if r.window_seconds > 0)
    return Loads(rates(mine), tokens, len(mine), passes_per_second(mine))


class FrontendLoads:
    def __init__(self, kube: Kube, port: int, timeout_s: float,
                 pods: Callable[[], Iterable[Mapping[str, Any]] | None] | None = None):
        self.kube, self.port, self.timeout_s = kube, port, timeout_s
        # The cluster's pods as a watch of the operator holds them (None until it has listed them): the
        # frontends are found there, not by a LIST of the API at every look (every second).
        self.pods = pods
        # Pod IPs are cluster-internal: never send them through an HTTP proxy from the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        # Frontends that did not answer last time: said once, not at every look (the operator looks every second)
        self._silent: set[str] = set()

    def fetch(self, deployment: MoEDeployment) -> Loads | None:
        ips = [p["status"]["podIP"] for p in self._frontends(deployment)
               if p.get("status", {}).get("phase") == "Running" and p["status"].get("podIP")]
        if not ips:
            return None
        with ThreadPoolExecutor(max_workers=min(8, len(ips))) as pool:
            answers = list(pool.map(self._report, ips))
        for ip, (_, error) in zip(ips, answers):
            if error is not None and ip not in self._silent:
                log.info("no loads from frontend %s (said once until it answers): %s", ip, error)
            elif error is None and ip in self._silent:
                log.info("loads from frontend %s again", ip)
        self._silent = {ip for ip, (_, error) in zip(ips, answers) if error is not None}
        return aggregate([report for report, _ in answers if report is not None], deployment.name)

    def _frontends(self, deployment: MoEDeployment) -> Iterable[Mapping[str, Any]]:
        watched = self.pods() if self.pods is not None else None
        if watched is None:
            return self.kube.list("v1", "Pod", deployment.namespace, selector(deployment, FRONTEND))
        wanted = selected(deployment, FRONTEND).items()
        return [p for p in watched if p["metadata"].get("namespace") == deployment.namespace
                and wanted <= (p["metadata"].get("labels") or {}).items()]

    def _report(self, ip: str) -> tuple[pb.LoadReport | None, str | None]:
        """(its report, None), or (None, why not): one silent frontend must not stop planning."""
        url = f"http://{ip}:{self.port}/loads"
        try:
            with self._opener.open(urllib.request.Request(url, headers={"Accept": PROTOBUF}),
                                   timeout=self.timeout_s) as response:
                body = response.read()
                if response.headers.get_content_type() == PROTOBUF:
                    return pb.LoadReport.FromString(body), None
                # an older frontend
                return json_format.Parse(body, pb.LoadReport(), ignore_unknown_fields=True), None
        except (OSError, json_format.ParseError, DecodeError) as e:
            return None, f"{url}: {e}"
