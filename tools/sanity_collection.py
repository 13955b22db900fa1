#!/usr/bin/env python3
"""Run ansible-test's validate-modules on the project's modules as a collection.

ansible-test only runs inside ansible_collections/<ns>/<name>/, so the modules
(library/*.py, roles/*/library/*.py) and module_utils/*.py are copied into a
scratch collection, their `ansible.module_utils.<ours>` imports rewritten to
the collection's plugins.module_utils. ansible-test's venv bootstrap downloads
a get-pip script, which cannot be reached here: a stand-in that runs ensurepip
and then pip is written to ansible-test's cache when none is there.

    python tools/sanity_collection.py              # the working tree
    python tools/sanity_collection.py --ref HEAD   # the files as committed
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE, NAME = "vllm_fleet", "fleet"
MODULE_GLOBS = ("library/*.py", "roles/*/library/*.py")
PIP_VERSION = "24.2"  # ansible-core 2.19's infrastructure pip
GET_PIP = Path.home() / ".ansible/test/cache" / f"get_pip_{PIP_VERSION.replace('.', '_')}.py"
# ansible-test runs it with a clean environment, so the CA bundle is written in.
GET_PIP_STAND_IN = '''"""Offline stand-in for get-pip: ensurepip, then pip install of the rest."""
import ensurepip
import os
import subprocess
import sys

CERT = {cert!r}
ensurepip.bootstrap(upgrade=True)
env = dict(os.environ)
if CERT:
    env.update(PIP_CERT=CERT, SSL_CERT_FILE=CERT)
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
if args:
    sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", *args], env=env))
'''


def tracked(pattern: str, ref: str | None) -> list[str]:
    """Paths matching pattern, from the working tree or from git ref."""
    if ref is None:
        return sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))
    out = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", ref],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return sorted(p for p in out if Path(p).match(pattern) and p.count("/") == pattern.count("/"))


def read(path: str, ref: str | None) -> str:
    if ref is None:
        return (ROOT / path).read_text()
    return subprocess.run(
        ["git", "show", f"{ref}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def rewrite(text: str, ours: list[str]) -> str:
    """Point imports of our module_utils at the collection's copy."""
    prefix = f"ansible_collections.{NAMESPACE}.{NAME}.plugins.module_utils"
    names = "|".join(re.escape(n) for n in ours)
    return re.sub(rf"\bansible\.module_utils\.({names})\b", rf"{prefix}.\1", text)


def assemble(dest: Path, ref: str | None) -> Path:
    coll = dest / "ansible_collections" / NAMESPACE / NAME
    if dest.exists():
        shutil.rmtree(dest)
    (coll / "plugins/modules").mkdir(parents=True)
    (coll / "plugins/module_utils").mkdir(parents=True)
    utils = tracked("module_utils/*.py", ref)
    ours = [Path(p).stem for p in utils]
    for path in utils:
        (coll / "plugins/module_utils" / Path(path).name).write_text(rewrite(read(path, ref), ours))
    for pattern in MODULE_GLOBS:
        for path in tracked(pattern, ref):
            (coll / "plugins/modules" / Path(path).name).write_text(rewrite(read(path, ref), ours))
    (coll / "galaxy.yml").write_text(
        f"namespace: {NAMESPACE}\nname: {NAME}\nversion: 0.0.1\nreadme: README.md\n"
        "authors: [vllm-fleet]\n"
    )
    (coll / "README.md").write_text("vllm-fleet modules, assembled for ansible-test.\n")
    (coll / "meta").mkdir()
    (coll / "meta/runtime.yml").write_text("requires_ansible: '>=2.16'\n")
    git = ["git", "-c", "user.name=sanity", "-c", "user.email=sanity@localhost"]
    subprocess.run([*git, "init", "-q"], cwd=coll, check=True)
    subprocess.run([*git, "add", "-A"], cwd=coll, check=True)
    subprocess.run([*git, "commit", "-qm", "assembled"], cwd=coll, check=True)
    return coll


def pip_cert() -> str | None:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    match = re.search(r"\.cert='([^']+)'", out)
    return match.group(1) if match else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", help="git ref to read the files from (default: working tree)")
    parser.add_argument("--dest", default="/tmp/coll", type=Path)
    parser.add_argument("--python", default="3.11")
    args = parser.parse_args()
    coll = assemble(args.dest, args.ref)
    cert = pip_cert()
    GET_PIP.parent.mkdir(parents=True, exist_ok=True)
    GET_PIP.write_text(GET_PIP_STAND_IN.format(cert=cert))
    env = dict(os.environ)
    if cert:
        env.update(PIP_CERT=cert, SSL_CERT_FILE=cert)
    ansible_test = Path(sys.executable).parent / "ansible-test"
    cmd = [str(ansible_test), "sanity", "--test", "validate-modules"]
    cmd += ["--python", args.python, "--venv", "--color", "no"]
    proc = subprocess.run(cmd, cwd=coll, env=env, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    findings = [ln for ln in proc.stdout.splitlines() if re.match(r"ERROR: plugins/", ln)]
    print(f"validate-modules findings: {len(findings)}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
