"""The health probes (httpx) against a real local HTTP server: statuses, redirects, nothing listening."""

from __future__ import annotations

import http.server
import socket
import threading

import pytest


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/health")
        elif self.path == "/health":
            self.send_response(200)
        elif self.path == "/broken":
            self.send_response(503)
        else:
            self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_service_probe_reports_the_status_after_redirects_and_none_without_a_server(server):
    from infra.services import probe

    assert probe(server + "/health") == 200
    assert probe(server + "/moved") == 200
    assert probe(server + "/missing") == 404
    assert probe(server + "/broken") == 503
    assert probe(f"http://127.0.0.1:{_closed_port()}/health", timeout=1) is None
    assert probe("not a url") is None


def test_slurm_service_health_is_a_2xx_answer(server):
    from infra.backends.slurm import _healthy

    assert _healthy(server + "/health") is True
    assert _healthy(server + "/moved") is True
    assert _healthy(server + "/missing") is False
    assert _healthy(server + "/broken") is False
    assert _healthy(f"http://127.0.0.1:{_closed_port()}/health") is False
