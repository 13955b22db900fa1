"""roles/vllm_service/tasks/smoke.yml, run by ansible-playbook against a stub of vLLM's
OpenAI API (named as such: the tiny CPU model has no reasoning or tool-call tokens).

The stub answers like vLLM with a reasoning parser (content empty, reasoning_content
set) and with --enable-auto-tool-choice (tool_calls parsed from the output).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


class _StubVllm(BaseHTTPRequestHandler):
    def _send(self, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send({"data": [{"id": "tiny"}]})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(request)
        if request.get("tools"):
            call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
            tool_call = {"id": "c1", "type": "function", "function": call}
            message = {"role": "assistant", "content": None, "tool_calls": [tool_call]}
            finish = "tool_calls"
        else:
            message = {"role": "assistant", "content": "", "reasoning_content": "Greet back."}
            finish = "length"
        self._send({"choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": {"completion_tokens": 8}})  # fmt: skip

    def log_message(self, *_args: object) -> None:
        return


@pytest.fixture
def stub() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubVllm)
    server.requests = []
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def run_smoke(tmp_path: Path, port: int, engine_args: dict) -> dict:
    out = tmp_path / "result.json"
    play = [{
        "hosts": "localhost", "gather_facts": False,
        "tasks": [
            {"ansible.builtin.include_role": {"name": "vllm_service", "tasks_from": "smoke.yml"},
             "vars": {"vllm_fleet_served_name": "tiny", "vllm_fleet_port": port,
                      "vllm_fleet_node_address": "127.0.0.1",
                      "vllm_fleet_engine_args": engine_args}},
            {"ansible.builtin.copy": {"content": "{{ vllm_service_smoke_result | to_json }}",
                                      "dest": str(out), "mode": "0600"}},
        ],
    }]  # fmt: skip
    (tmp_path / "play.yml").write_text(json.dumps(play))
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(ROOT / "roles"),
           "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}  # fmt: skip
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c",
         "local", "-e", f"ansible_python_interpreter={sys.executable}", str(tmp_path / "play.yml")],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    return json.loads(out.read_text())


def test_reasoning_shown_and_tools_request_parsed(
    tmp_path: Path, stub: ThreadingHTTPServer
) -> None:
    result = run_smoke(tmp_path, stub.server_port, {"enable-auto-tool-choice": True})
    assert (result["text"], result["reasoning"], result["tool_calls"]) == ("Greet back.", True, 1)
    tool_request = stub.requests[-1]
    assert tool_request["tools"][0]["function"]["name"] == "get_weather"
    assert tool_request["tool_choice"] == "auto"


def test_no_tool_request_without_auto_tool_choice(
    tmp_path: Path, stub: ThreadingHTTPServer
) -> None:
    result = run_smoke(tmp_path, stub.server_port, {})
    assert result["tool_calls"] is None
    assert len(stub.requests) == 1 and "tools" not in stub.requests[0]
