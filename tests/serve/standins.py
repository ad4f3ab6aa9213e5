"""Tiny stand-in servers (stdlib only) for the failure cases a real model cannot produce on demand.

    python tests/serve/standins.py --port P --mode empty|slow|busy|ignore-term|child

- ``empty``: answers /health, /v1/completions and the NeMo shape like the real server, with an empty text;
- ``busy``: /health is fine, every request gets 503 + Retry-After (a server that stays overloaded);
- ``slow``: /health is fine, a completion takes 30 s;
- ``ignore-term``: a healthy server that ignores SIGTERM (stop must fall back to SIGKILL);
- ``child``: a healthy server that started a grandchild ``sleep`` (stop must kill the group).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=["empty", "slow", "busy", "ignore-term", "child"], required=True)
    args = parser.parse_args()
    if args.mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.mode == "child":
        child = subprocess.Popen(["sleep", "300"])
        print(f"child pid {child.pid}", flush=True)

    class Handler(BaseHTTPRequestHandler):
        def _json(self, status: int, body: dict, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._json(200, {"status": "ok"})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if args.mode == "slow":
                time.sleep(30)
            if args.mode == "busy":
                error = {"message": "busy", "type": "rate_limit_error", "param": None, "code": "server_busy"}
                return self._json(503, {"error": error}, {"Retry-After": "1"})
            text = "" if args.mode == "empty" else " and the earth"
            if self.path.endswith("/"):  # NeMo's REST shape
                return self._json(200, {"output": text})
            choice = {
                "index": 0,
                "text": text,
                "finish_reason": "stop",
                "logprobs": None,
            }
            usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
            self._json(
                200,
                {
                    "id": "cmpl-x",
                    "object": "text_completion",
                    "created": 0,
                    "model": "standin",
                    "choices": [choice],
                    "usage": usage,
                },
            )

    print(f"standin {args.mode} on {args.port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
