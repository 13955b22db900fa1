#!/usr/bin/env python3
"""A stand-in for a vLLM server, for the vllm_router Molecule scenario only.

It answers what vllm-router and its clients ask a vLLM server, with vLLM's
API-key rule (only /v1/* needs `Authorization: Bearer $VLLM_API_KEY`):

    GET  /health           200
    GET  /v1/models        the one served model
    POST /v1/completions   an OpenAI-style completion (usage.completion_tokens)

Each request is appended to --log as one JSON line (method, path, status),
which verify reads to tell which stand-in served what.

    VLLM_API_KEY=KEY vllm_standin.py --name a --port 8061 --served-name tiny-kimi --log FILE
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def make_handler(args: argparse.Namespace) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = f"vllm-standin-{args.name}"

        def log_message(self, format: str, *fmt_args: object) -> None:
            """The JSON log below replaces http.server's stderr line."""

        def _record(self, status: int) -> None:
            line = {"t": time.time(), "method": self.command, "path": self.path, "status": status}
            with lock, open(args.log, "a", encoding="utf-8") as log:
                log.write(json.dumps(line) + "\n")

        def _send(self, status: int, body: object | None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("X-Vllm-Standin", args.name)
            self.end_headers()
            self.wfile.write(data)
            self._record(status)

        def _authorized(self) -> bool:
            return self.headers.get("Authorization") == f"Bearer {args.api_key}"

        def _read_json(self) -> dict:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                return {}
            return body if isinstance(body, dict) else {}

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                self._send(200, None)
            elif path.startswith("/v1/") and not self._authorized():
                self._send(401, {"error": "Unauthorized"})
            elif path == "/v1/models":
                model = {"id": args.served_name, "object": "model", "owned_by": "vllm-standin"}
                self._send(200, {"object": "list", "data": [model]})
            else:
                self._send(404, {"error": f"no {path} on a stand-in"})

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            body = self._read_json()
            if path.startswith("/v1/") and not self._authorized():
                self._send(401, {"error": "Unauthorized"})
            elif path == "/v1/completions":
                tokens = int(body.get("max_tokens") or 16)
                prompt = str(body.get("prompt", ""))
                self._send(
                    200,
                    {
                        "id": f"cmpl-standin-{args.name}-{time.monotonic_ns()}",
                        "object": "text_completion",
                        "created": int(time.time()),
                        "model": body.get("model", args.served_name),
                        "choices": [
                            {
                                "index": 0,
                                "text": f" stand-in {args.name}",
                                "logprobs": None,
                                "finish_reason": "length",
                            }
                        ],
                        "usage": {
                            "prompt_tokens": len(prompt.split()),
                            "completion_tokens": tokens,
                            "total_tokens": len(prompt.split()) + tokens,
                        },
                    },
                )
            else:
                self._send(404, {"error": f"no {path} on a stand-in"})

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-name", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    args.api_key = os.environ["VLLM_API_KEY"]
    ThreadingHTTPServer((args.host, args.port), make_handler(args)).serve_forever()


if __name__ == "__main__":
    main()
