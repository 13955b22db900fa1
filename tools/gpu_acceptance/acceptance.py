#!/usr/bin/env python3
"""GPU acceptance: capture nvidia-smi into a fixture directory, then run gpu_facts and
the plan (the modules preflight runs) against that capture, and say what was used.

    tools/gpu-acceptance [--nvidia-smi PATH] [--out DIR] [--profile kimi-k2.5-nvfp4]
                         [--vllm-version 0.16.0] [--model DIR [--venv VENV]]

With --model (a checkpoint on this machine), the patch runs as role quant_config
runs it: a view beside the checkpoint when the plan drops a KV declaration, its
configs patched, the checkpoint untouched. With --venv too (vLLM of the planned
version installed there), a real server starts on the served directory through
``vllm serve`` (tools/wheelhouse/probe_serve.py) and the attention backend it logs
is compared with the plan's expectation: a difference, or no healthy server, fails.

The capture has the shape of tests/fixtures/nvidia-smi/<name>/ (query.csv, topo.txt,
nvidia-smi.txt, plus nvidia-smi.xml from `nvidia-smi -q -x` when it answers), so it
can be committed as a new fixture. The note (acceptance.md) says whether a real GPU
answered: the named fake (tests/support/fake_nvidia_smi.py) is reported as a fake.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests/support/fake_nvidia_smi.py"
QUERY = (
    "--query-gpu=index,name,uuid,memory.total,compute_cap,driver_version,"
    "mig.mode.current,pci.bus_id"
)
# The invocations gpu_facts makes (library/gpu_facts.py), then the XML for reference.
CAPTURES = {
    "query.csv": [QUERY, "--format=csv,noheader,nounits"],
    "topo.txt": ["topo", "-m"],
    "nvidia-smi.txt": [],
    "nvidia-smi.xml": ["-q", "-x"],
}
REQUIRED = ("query.csv", "topo.txt", "nvidia-smi.txt")


def is_fake(nvidia_smi: str) -> bool:
    path = shutil.which(nvidia_smi) or nvidia_smi
    try:
        return "FAKE nvidia-smi" in Path(path).read_text(errors="replace")[:2000]
    except OSError:
        return False


def capture(nvidia_smi: str, out: Path) -> dict[str, str]:
    """Run each invocation; keep stdout as the fixture file; return what failed."""
    out.mkdir(parents=True, exist_ok=True)
    failed: dict[str, str] = {}
    env = {**os.environ, "LC_ALL": "C"}
    for name, args in CAPTURES.items():
        try:
            proc = subprocess.run(
                [nvidia_smi, *args], capture_output=True, text=True, timeout=60, env=env
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            failed[name] = str(exc)
            continue
        if proc.returncode != 0:
            failed[name] = f"rc={proc.returncode}: {(proc.stderr or proc.stdout).strip()[:200]}"
            continue
        (out / name).write_text(proc.stdout)
    return failed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_plan(out: Path, profile: Path, vllm_version: str, model: Path | None = None) -> dict:
    result = out / "plan-result.json"
    with tempfile.TemporaryDirectory(prefix="gpu-acceptance-") as storage:
        extra = {
            "acceptance_model": str(model or ""),
            "acceptance_views": str(out / "views"),
            "acceptance_profile": str(profile),
            "acceptance_replay": str(FAKE),
            "acceptance_fixture": str(out),
            "acceptance_infiniband_sysfs": "/sys/class/infiniband",
            "acceptance_matrix": str(ROOT / "roles/preflight/files/compat_matrix.yml"),
            "acceptance_vllm_version": vllm_version,
            "acceptance_storage": storage,
            "acceptance_port": free_port(),
            "acceptance_result": str(result),
            "ansible_python_interpreter": sys.executable,
        }
        env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
        playbook = Path(sys.executable).parent / "ansible-playbook"
        proc = subprocess.run(
            [str(playbook), "-i", "localhost,", "-c", "local", "-e", json.dumps(extra),
             str(ROOT / "tools/gpu_acceptance/plan.yml")],
            capture_output=True, text=True, env=env, cwd=ROOT, check=False,
        )  # fmt: skip
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-2000:])
        raise SystemExit(f"gpu-acceptance: the plan run failed (rc={proc.returncode})")
    doc = json.loads(result.read_text())
    # The stand-in storage is this tool's, not the fleet's: its disk findings do not count.
    doc["problems"] = [p for p in doc["problems"] if storage not in p]
    return doc


def _filters(name: str) -> Any:
    """One of role vllm_service's filter plugins, loaded from its file."""
    path = ROOT / "roles/vllm_service/filter_plugins" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def engine_argv(profile: Path, plan: dict) -> list[str]:
    """The plan's parallelism and the profile's engine arguments, as the unit passes them."""
    doc = yaml.safe_load(profile.read_text()) or {}
    managed = {
        "tensor-parallel-size": plan["tensor_parallel_size"],
        "pipeline-parallel-size": plan["pipeline_parallel_size"],
    }
    return _filters("vllm_args").vllm_argv(managed, doc.get("vllm_fleet_engine_args") or {})


def serve(out: Path, venv: Path, served_dir: str, argv: list[str], timeout: float) -> dict:
    """A real server on the served directory (probe_serve.py: vllm serve, /health, one chat)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/wheelhouse/probe_serve.py"), "--venv", str(venv),
         "--model", served_dir, "--served", "acceptance", "--port", str(free_port()),
         "--timeout", str(timeout), "--log", str(out / "serve.log"), "--", *argv],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0 or not proc.stdout.strip():
        raise SystemExit(f"gpu-acceptance: probe_serve failed (rc={proc.returncode}): "
                         f"{proc.stderr.strip()[-2000:]}")  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def runtime_verdict(out: Path, plan: dict, probe: dict) -> tuple[bool, str]:
    """The fleet's own runtime check (role vllm_service) on the server's log."""
    if not probe.get("healthy_s"):
        return False, "the server never became healthy (see serve.log)"
    runtime = _filters("vllm_runtime")
    lines = (out / "serve.log").read_text(errors="replace").splitlines()
    check = runtime.vllm_runtime_check(
        lines, plan["expected_attention_backend"], runtime.vllm_expected_kv(plan)
    )
    said = (f"logged {', '.join(check['attention_backends']) or 'no backend'}, KV cache "
            f"{check['kv_cache_dtype'] or 'not logged'}")  # fmt: skip
    problems = check["mismatches"] or check["notes"]
    return not check["mismatches"], said + ("; " + "; ".join(problems) if problems else "")


def note(nvidia_smi: str, fake: bool, failed: dict[str, str], result: dict) -> str:
    facts, plan = result["gpu_facts"], result["plan"]
    gpus = facts.get("gpus", [])
    names = sorted({f"{g['name']} (SM{g['compute_capability']}, {g['memory_mib']} MiB)"
                    for g in gpus})  # fmt: skip
    kv = result["checks"].get("kv_memory")
    lines = [
        "# GPU acceptance",
        "",
        f"- nvidia-smi: `{nvidia_smi}` -> "
        + (
            "**the named FAKE (tests/support/fake_nvidia_smi.py): no real GPU was used**"
            if fake
            else "a real nvidia-smi (a real GPU answered)"
        ),
        f"- GPUs: {len(gpus)} x {', '.join(names) or 'none'}; driver {facts.get('driver_version')};"
        f" interconnect {facts.get('summary', {}).get('interconnect')}, widest PCIe path"
        f" {facts.get('summary', {}).get('widest_pcie_path')}",
        f"- not captured: {json.dumps(failed) if failed else 'nothing'}",
        f"- plan: vLLM {plan['vllm_version']}, {plan['attention_family']} attention, checkpoint KV"
        f" {plan['checkpoint_kv_cache_quant']} -> {plan['kv_cache_quant']}"
        f" [{plan['compat_rule']}], backend {plan['expected_attention_backend']}",
        f"- NCCL: {json.dumps(plan['nccl_env'])} [{plan['nccl_profile']}],"
        f" disable_custom_all_reduce {plan['disable_custom_all_reduce']}",
        f"- KV memory: {json.dumps(kv) if kv else 'not sized'}",
        f"- problems: {json.dumps(result['problems']) if result['problems'] else 'none'}",
    ]
    if result.get("served_dir"):
        lines.append(
            f"- patch: serves {result['served_dir']}"
            + (" (a view, its KV declaration dropped)" if result.get("patched") else "")
        )
    if "serve" in result:
        probe, (ok, why) = result["serve"], result["backend"]
        lines += [
            f"- server: healthy in {probe.get('healthy_s')} s, chat {probe.get('chat')},"
            f" alive after {probe.get('alive_after')}, peak RSS {probe.get('peak_rss_mb')} MB",
            f"- backend: {'as planned' if ok else 'NOT as planned'}: {why}",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvidia-smi", default="nvidia-smi")
    parser.add_argument("--out", type=Path, default=None, help="fixture directory to write")
    parser.add_argument("--profile", default="kimi-k2.5-nvfp4", help="playbooks/models/<name>")
    parser.add_argument("--vllm-version", default=None, help="default: role vllm_fleet's pin")
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint to patch (a view)")
    parser.add_argument("--venv", type=Path, default=None, help="vLLM to serve it with")
    parser.add_argument("--serve-timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    if args.venv and not args.model:
        raise SystemExit("gpu-acceptance: --venv serves the checkpoint of --model: give both")
    if args.model and not (args.model / "config.json").is_file():
        raise SystemExit(f"gpu-acceptance: {args.model} has no config.json (not a checkpoint)")
    profile = ROOT / "playbooks/models" / f"{args.profile}.yml"
    if not profile.is_file():
        raise SystemExit(f"gpu-acceptance: no profile {profile}")
    if args.vllm_version is None:
        args.vllm_version = str(
            yaml.safe_load((ROOT / "roles/vllm_fleet/defaults/main.yml").read_text())[
                "vllm_fleet_vllm_version"
            ]
        )
    out = args.out or Path(tempfile.gettempdir()) / f"gpu-acceptance-{socket.gethostname()}"
    fake = is_fake(args.nvidia_smi)
    failed = capture(args.nvidia_smi, out)
    missing = [name for name in REQUIRED if name in failed]
    if missing:
        raise SystemExit(
            f"gpu-acceptance: nvidia-smi did not answer {', '.join(missing)}: "
            + "; ".join(f"{n}: {failed[n]}" for n in missing)
        )
    result = run_plan(out, profile, args.vllm_version, args.model)
    if args.venv:
        argv = engine_argv(profile, result["plan"])
        result["serve"] = serve(out, args.venv, result["served_dir"], argv, args.serve_timeout)
        result["backend"] = runtime_verdict(out, result["plan"], result["serve"])
    text = note(args.nvidia_smi, fake, failed, result)
    (out / "acceptance.md").write_text(text)
    print(text + f"\nfixture and note: {out}")
    return 0 if result.get("backend", (True, ""))[0] else 1


if __name__ == "__main__":
    sys.exit(main())
