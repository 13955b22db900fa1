#!/usr/bin/env python3
"""Prove that every vLLM pin the toolkit ships installs on the nodes.

A pin is a (package, version, index) named in role vllm_fleet's defaults, an
inventory's group_vars or a model profile (playbooks/models/*.yml). For each,
the package index's own simple API (PEP 691 JSON, PEP 503 HTML as fallback)
must list a non-yanked wheel of exactly that version whose tags install on the
nodes' interpreter and platform (Debian bookworm: CPython 3.11, glibc 2.36,
x86_64) and whose Requires-Python admits 3.11. Only the file listing is read,
never a wheel.

    python tools/check_pins.py                 # the repository's pins
    python tools/check_pins.py --pin vllm==0.16.0rc2.dev313+g662205d34 \
        --index https://wheels.vllm.ai/nightly  # one pin, another index
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
PYPI_SIMPLE = "https://pypi.org/simple"
# The nodes: Debian bookworm ships CPython 3.11.2 and glibc 2.36.
NODE_PYTHON = (3, 11)
NODE_PYTHON_FULL = "3.11.2"
NODE_GLIBC = (2, 36)
NODE_ARCH = "x86_64"
PIN_FILES = (
    "roles/vllm_fleet/defaults/main.yml",
    "inventory/*/group_vars/*.yml",
    "playbooks/models/*.yml",
)
ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
DEFAULTS_FILE = "roles/vllm_fleet/defaults/main.yml"
# vLLM ships a minor release about every two weeks: three behind is about six
# weeks, when a default starts to miss fixes the model recipes assume.
STALE_MINORS = 3


@dataclass(frozen=True)
class Pin:
    package: str
    version: str
    index: str
    source: str


@dataclass(frozen=True)
class Listing:
    filename: str
    requires_python: str
    yanked: bool
    url: str = field(default="", compare=False)  # as listed: may be relative to the page


def node_tags() -> set[Tag]:
    """Every wheel tag pip on a node accepts (manylinux_2_5 .. 2_36, linux)."""
    platforms = [
        f"manylinux_{NODE_GLIBC[0]}_{minor}_{NODE_ARCH}" for minor in range(NODE_GLIBC[1], 4, -1)
    ]
    platforms += [f"manylinux2014_{NODE_ARCH}", f"manylinux2010_{NODE_ARCH}"]
    platforms += [f"manylinux1_{NODE_ARCH}", f"linux_{NODE_ARCH}"]
    tags = set(cpython_tags(NODE_PYTHON, abis=["cp311", "abi3", "none"], platforms=platforms))
    tags |= set(compatible_tags(NODE_PYTHON, interpreter="cp311", platforms=platforms))
    return tags


def _load(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    return doc if isinstance(doc, dict) else {}


def repo_pins(root: Path = ROOT) -> list[Pin]:
    """The pins a deploy can resolve to: the fleet default, each inventory's, each profile's."""
    base = _load(root / "roles/vllm_fleet/defaults/main.yml")
    default_pkg = str(base.get("vllm_fleet_vllm_package", "vllm"))
    pins: list[Pin] = []
    for pattern in PIN_FILES:
        for path in sorted(root.glob(pattern)):
            doc = _load(path)
            if "vllm_fleet_vllm_version" not in doc:
                continue
            pins.append(
                Pin(
                    package=str(doc.get("vllm_fleet_vllm_package", default_pkg)),
                    version=str(doc["vllm_fleet_vllm_version"]),
                    index=str(doc.get("vllm_install_index_url") or PYPI_SIMPLE),
                    source=str(path.relative_to(root)),
                )
            )
    return pins


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.files: list[Listing] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag != "a":
            return
        attr = dict(attrs)
        href = attr.get("href") or ""
        name = urllib.parse.unquote(href.split("#", 1)[0].rsplit("/", 1)[-1])
        self.files.append(
            Listing(
                name,
                attr.get("data-requires-python") or "",
                "data-yanked" in attr,
                href.split("#")[0],
            )
        )


def fetch_listing(index: str, package: str, timeout: float = 60) -> list[Listing]:
    """The files the index lists for *package* (PEP 691 JSON or PEP 503 HTML)."""
    url = f"{index.rstrip('/')}/{canonicalize_name(package)}/"
    request = urllib.request.Request(url, headers={"Accept": ACCEPT})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        kind = response.headers.get("Content-Type", "")
        body = response.read()
    if "json" in kind:
        doc = json.loads(body)
        return [
            Listing(
                f["filename"],
                f.get("requires-python") or "",
                bool(f.get("yanked")),
                f.get("url", ""),
            )
            for f in doc.get("files", [])
        ]
    parser = _Anchors()
    parser.feed(body.decode("utf-8", errors="replace"))
    return parser.files


def _python_ok(requires: str) -> bool:
    try:
        return not requires or SpecifierSet(requires).contains(NODE_PYTHON_FULL)
    except InvalidSpecifier:
        return False


def check_pin(pin: Pin, files: list[Listing], tags: set[Tag]) -> tuple[bool, str]:
    """(ok, what was found): an installable wheel of exactly pin.version, or why not."""
    try:
        want = Version(pin.version)
    except InvalidVersion:
        return False, f"{pin.version!r} is not a PEP 440 version"
    same: list[Listing] = []
    versions: set[Version] = set()
    for item in files:
        if not item.filename.endswith(".whl"):
            continue
        try:
            name, version, _build, _tags = parse_wheel_filename(item.filename)
        except ValueError:
            continue
        if name != canonicalize_name(pin.package):
            continue
        versions.add(version)
        if version == want:
            same.append(item)
    if not same:
        near = ", ".join(str(v) for v in sorted(versions)[-5:]) or "none"
        return False, f"no wheel of {pin.package} {pin.version} (latest listed: {near})"
    live = [f for f in same if not f.yanked]
    if not live:
        return False, f"every wheel of {pin.package} {pin.version} is yanked"
    fits = [f for f in live if tags & parse_wheel_filename(f.filename)[3]]
    if not fits:
        seen = ", ".join(f.filename for f in live)
        return False, f"no wheel for cp311 manylinux {NODE_ARCH} (listed: {seen})"
    good = [f for f in fits if _python_ok(f.requires_python)]
    if not good:
        return False, f"Requires-Python {fits[0].requires_python} excludes {NODE_PYTHON_FULL}"
    return True, f"{good[0].filename} (Requires-Python {good[0].requires_python or 'any'})"


def newest_release(package: str, files: list[Listing]) -> Version | None:
    """The newest final, non-yanked release with a wheel on the index."""
    found = []
    for item in files:
        if item.yanked or not item.filename.endswith(".whl"):
            continue
        try:
            name, version, _build, _tags = parse_wheel_filename(item.filename)
        except ValueError:
            continue
        if name == canonicalize_name(package) and not (version.is_prerelease or version.local):
            found.append(version)
    return max(found, default=None)


def staleness(pin: Pin, files: list[Listing]) -> str | None:
    """A warning when the fleet's default pin is more than STALE_MINORS minors behind."""
    newest = newest_release(pin.package, files)
    try:
        have = Version(pin.version)
    except InvalidVersion:
        return None
    if newest is None or newest.release[:1] != have.release[:1]:
        return None
    behind = newest.minor - have.minor
    if behind <= STALE_MINORS:
        return None
    return (
        f"the default {pin.package}=={pin.version} [{pin.source}] is {behind} minor releases "
        f"behind {newest} on the index (more than {STALE_MINORS}): check the compat matrix "
        "against the newer wheels (tests/integration/test_matrix_source.py) and move the default"
    )


def parse_pin_arg(text: str, index: str) -> Pin:
    package, sep, version = text.partition("==")
    if not sep or not package or not version:
        raise SystemExit(f"--pin: expected PACKAGE==VERSION, got {text!r}")
    return Pin(package.strip(), version.strip(), index, "--pin")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pin", action="append", default=[], help="PACKAGE==VERSION")
    parser.add_argument("--index", default=PYPI_SIMPLE, help="simple index for --pin")
    args = parser.parse_args(argv)
    pins = [parse_pin_arg(p, args.index) for p in args.pin] or repo_pins()
    if not pins:
        print("check-pins: no vllm_fleet_vllm_version found", file=sys.stderr)
        return 2
    tags = node_tags()
    cache: dict[tuple[str, str], list[Listing]] = {}
    failed = 0
    for pin in pins:
        key = (pin.index, pin.package)
        try:
            if key not in cache:
                cache[key] = fetch_listing(pin.index, pin.package)
            ok, detail = check_pin(pin, cache[key], tags)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            ok, detail = False, f"cannot read {pin.index}: {exc}"
        failed += not ok
        mark = "ok  " if ok else "FAIL"
        print(f"{mark} {pin.package}=={pin.version}  [{pin.source}]  {detail}")
        stale = staleness(pin, cache[key]) if ok and pin.source == DEFAULTS_FILE else None
        if stale:
            # A warning only: the index moving must not turn an unrelated change red.
            print(f"warn {stale}")
    print(
        f"check-pins: {len(pins) - failed}/{len(pins)} pins install on cp311 manylinux {NODE_ARCH}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
