"""`Kube` turns every refusal into an ApiError, also the plain-text ones: an API server answers a group it
does not serve (Knative not installed) with `404 page not found`, not a JSON Status."""

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from kubernetes import client

from kubemoe.operator.kube import ApiError, Kube
from kubemoe.operator.render import KNATIVE


@pytest.fixture
def server():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # as kube-apiserver answers a path of an API group it does not serve
            self.send_response(404)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.end_headers()
            self.wfile.write(b"404 page not found\n")

        def log_message(self, *args):
            pass

    running = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=running.serve_forever, daemon=True).start()
    yield running
    running.shutdown()
    running.server_close()


def test_a_plain_text_404_is_an_api_error_with_its_text(server):
    config = client.Configuration(host=f"http://127.0.0.1:{server.server_port}")
    kube = Kube(client.ApiClient(config), "test")
    with pytest.raises(ApiError) as refused:
        kube.list(*KNATIVE, "default", "app.kubernetes.io/instance=x")
    assert (refused.value.status, refused.value.message) == (404, "404 page not found")
