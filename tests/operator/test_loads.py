import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from kubemoe.operator.loads import FrontendLoads, aggregate
from kubemoe.operator.spec import MoEDeployment
from kubemoe.proto import kubemoe_pb2 as pb


def report(frontend: str, model: str = "tiny", **loads) -> pb.LoadReport:
    return pb.LoadReport(model=model, frontend=frontend, window_seconds=10, tokens=100, passes=30, loads=[
        pb.ExpertLoad(layer=int(k[1]), expert=int(k[3]), tokens_per_second=v) for k, v in loads.items()])


def test_aggregate_sums_frontends_and_ignores_other_models():
    loads = aggregate([report("a", l0e1=5.0), report("b", l0e1=3.0, l1e2=1.0), report("c", model="other", l0e1=99.0)],
                      "tiny")
    assert loads.per_expert == {(0, 1): 8.0, (1, 2): 1.0} and loads.frontends == 2 and loads.tokens_per_second == 20.0
    assert loads.passes_per_second == 6.0  # each frontend's passes call the experts on their own
    assert aggregate([], "tiny") is None


class FakeKube:
    def __init__(self, pods):
        self.pods = pods

    def list(self, api_version, kind, namespace, label_selector):
        assert (kind, namespace) == ("Pod", "default") and "app.kubernetes.io/component=frontend" in label_selector
        return self.pods


def test_frontend_loads_pulls_every_running_frontend_and_skips_silent_ones(f, caplog):
    body = json.dumps({"model": "tiny", "frontend": "a", "windowSeconds": 10, "tokens": "50",
                       "loads": [{"layer": 0, "expert": 2, "tokensPerSecond": 4.0}]}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pods = [{"status": {"phase": "Running", "podIP": "127.0.0.1"}},
                {"status": {"phase": "Pending", "podIP": "127.0.0.2"}}]
        source = FrontendLoads(FakeKube(pods), server.server_port, timeout_s=1.0)
        loads = source.fetch(MoEDeployment.from_body(f.moed_body()))
        assert loads.per_expert == {(0, 2): 4.0} and loads.frontends == 1
        silent = FrontendLoads(FakeKube([{"status": {"phase": "Running", "podIP": "127.0.0.1"}}]), 1, timeout_s=0.5)
        with caplog.at_level(logging.INFO, logger="kubemoe.operator.loads"):
            assert silent.fetch(MoEDeployment.from_body(f.moed_body())) is None
            assert silent.fetch(MoEDeployment.from_body(f.moed_body())) is None  # said once, not at every look
            silent.port = server.server_port
            assert silent.fetch(MoEDeployment.from_body(f.moed_body())).frontends == 1
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2 and said[0].startswith("no loads from frontend 127.0.0.1") and "again" in said[1], said
    finally:
        server.shutdown()
        server.server_close()


def test_frontends_are_found_in_the_watched_pods_when_there_are_some(f):
    """The operator looks every second: from its pod watch (once listed), not by a LIST of the API each time."""
    deployment = MoEDeployment.from_body(f.moed_body())
    frontend = {"app.kubernetes.io/instance": "tiny", "app.kubernetes.io/managed-by": "kubemoe-operator",
                "app.kubernetes.io/component": "frontend"}

    def pod(ip, namespace="default", **labels):
        return {"metadata": {"namespace": namespace, "labels": {**frontend, **labels}},
                "status": {"phase": "Running", "podIP": ip}}

    watched = [pod("127.0.0.1"), pod("127.0.0.2", namespace="other"),
               pod("127.0.0.3", **{"app.kubernetes.io/component": "expert"}),
               pod("127.0.0.4", **{"app.kubernetes.io/instance": "another"})]
    asked: list[str] = []

    class Recorded(FrontendLoads):
        def _report(self, ip):
            asked.append(ip)
            return report("a", l0e1=1.0), None

    unlistable = FakeKube(None)
    unlistable.list = None  # a LIST would fail
    assert Recorded(unlistable, 1, 1.0, pods=lambda: watched).fetch(deployment).frontends == 1
    assert asked == ["127.0.0.1"]
    listed = Recorded(FakeKube([pod("127.0.0.5")]), 1, 1.0, pods=lambda: None)  # not listed yet: the API
    assert listed.fetch(deployment).frontends == 1 and asked[-1] == "127.0.0.5"


def test_frontend_loads_asks_for_the_binary_report_a_frontend_serves(f):
    from kubemoe.load_report import PROTOBUF
    sent = report("a", l0e1=2.5, l1e3=7.0)
    asked = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # as frontend/http_api.py answers /loads
            asked.append(self.headers.get("Accept", ""))
            self.send_response(200)
            self.send_header("Content-Type", PROTOBUF)
            self.end_headers()
            self.wfile.write(sent.SerializeToString())

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pods = [{"status": {"phase": "Running", "podIP": "127.0.0.1"}}]
        loads = FrontendLoads(FakeKube(pods), server.server_port, timeout_s=1.0).fetch(
            MoEDeployment.from_body(f.moed_body()))
        assert asked == [PROTOBUF] and loads.per_expert == {(0, 1): 2.5, (1, 3): 7.0}
    finally:
        server.shutdown()
        server.server_close()
