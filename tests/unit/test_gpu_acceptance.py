"""tools/gpu-acceptance against a fixture replayed by the named FAKE nvidia-smi."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.kimi_checkpoint import write_kimi_checkpoint

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests/support/fake_nvidia_smi.py"


@pytest.mark.parametrize(
    ("pin", "row"),
    [
        # The default pin: TRITON_MLA lists FP8 KV (0.18.0 on), the checkpoint stays as it is.
        (None, "[sm11-sm12-mla], backend TRITON_MLA"),
        # The seeds' release: the FP8 KV declaration is dropped in a view.
        ("0.16.0", "[sm11-sm12-mla-fp8-before-pr34597], backend TRITON_MLA"),
    ],
)
def test_capture_replays_and_plans_with_the_fake(tmp_path: Path, pin: str | None, row: str) -> None:
    out = tmp_path / "capture"
    env = {**os.environ, "FAKE_NVIDIA_SMI_FIXTURE": "rtx-pro-6000-x8", "PYTHON": sys.executable}
    proc = subprocess.run(
        [str(ROOT / "tools/gpu-acceptance"), "--nvidia-smi", str(FAKE), "--out", str(out),
         *(["--vllm-version", pin] if pin else [])],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    fixture = ROOT / "tests/fixtures/nvidia-smi/rtx-pro-6000-x8"
    for name in ("query.csv", "topo.txt", "nvidia-smi.txt"):
        assert (out / name).read_text() == (fixture / name).read_text()
    note = (out / "acceptance.md").read_text()
    assert "no real GPU was used" in note
    assert "8 x NVIDIA RTX PRO 6000 Blackwell Server Edition (SM12.0, 97887 MiB)" in note
    assert f"- plan: vLLM {pin or '0.34.0'}," in note and row in note, note
    assert '"NCCL_P2P_LEVEL": "SYS"' in note
    assert "- problems: none" in note


def test_no_driver_fails_with_the_reason(tmp_path: Path) -> None:
    env = {**os.environ, "FAKE_NVIDIA_SMI_FIXTURE": "no-driver", "PYTHON": sys.executable}
    proc = subprocess.run(
        [str(ROOT / "tools/gpu-acceptance"), "--nvidia-smi", str(FAKE), "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "nvidia-smi did not answer query.csv" in proc.stderr


# STANDS IN for vLLM's `vllm serve` (no GPU and no CUDA vLLM here): records its
# argv, logs the attention backend $STAND_IN_BACKEND names in vLLM's words, and
# answers /health and one chat completion on its --port, as the real server does.
STAND_IN_VLLM = """#!{python}
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
open(os.environ["STAND_IN_ARGV"], "w").write(json.dumps(sys.argv[1:]))
backend = os.environ["STAND_IN_BACKEND"]
print(f"INFO Using {{backend}} attention backend out of potential backends: [{{backend!r}}]",
      flush=True)

class Handler(BaseHTTPRequestHandler):
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send({{}})
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send({{"choices": [{{"message": {{"content": "hi"}}}}]}})

port = int(sys.argv[sys.argv.index("--port") + 1])
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.mark.parametrize("backend", ["TRITON_MLA", "FLASHMLA"])
def test_the_patch_and_a_server_checked_against_the_plan(tmp_path: Path, backend: str) -> None:
    """0.16.0 on SM120 drops the FP8 KV declaration: the view is patched, the checkpoint
    is not, the server gets the view and the plan's TP; the backend it logs is checked
    with the fleet's own runtime check (a wrong one fails the acceptance)."""
    model = tmp_path / "model"
    write_kimi_checkpoint(model)
    original = (model / "config.json").read_text()
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/vllm").write_text(STAND_IN_VLLM.format(python=sys.executable))
    (venv / "bin/vllm").chmod(0o755)
    out, argv_file = tmp_path / "capture", tmp_path / "argv.json"
    env = {**os.environ, "FAKE_NVIDIA_SMI_FIXTURE": "rtx-pro-6000-x8", "PYTHON": sys.executable,
           "STAND_IN_ARGV": str(argv_file), "STAND_IN_BACKEND": backend}  # fmt: skip
    proc = subprocess.run(
        [str(ROOT / "tools/gpu-acceptance"), "--nvidia-smi", str(FAKE), "--out", str(out),
         "--vllm-version", "0.16.0", "--model", str(model), "--venv", str(venv)],
        capture_output=True, text=True, env=env, check=False, timeout=300,
    )  # fmt: skip
    note = (out / "acceptance.md").read_text()
    view = next((out / "views").glob("*/absent"))
    assert f"- patch: serves {view} (a view, its KV declaration dropped)" in note
    assert "kv_cache_scheme" not in (view / "config.json").read_text()
    assert (model / "config.json").read_text() == original
    argv = json.loads(argv_file.read_text())
    assert argv[:2] == ["serve", str(view)] and "--tensor-parallel-size" in argv
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8"
    assert "- server: healthy in" in note and "chat [200, 'hi']" in note
    if backend == "TRITON_MLA":
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "- backend: as planned: logged TRITON_MLA" in note
    else:
        assert proc.returncode == 1
        assert "- backend: NOT as planned: logged FLASHMLA" in note
        assert "vLLM logged FLASHMLA, the plan expects TRITON_MLA" in note
