#!/usr/bin/env python3
"""Extract collections from the `ansible` wheel on PyPI.

Galaxy is unreachable on our build machines, but the `ansible` community
package on PyPI ships every collection it bundles. Download that wheel once
into a cache (keyed by version) and copy out only the collections we use.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


def wheel_path(version: str, cache: Path) -> Path:
    """Return the cached wheel, downloading it with pip on a miss."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"ansible-{version}-*.whl"))
    if found:
        return found[0]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "-d",
            str(cache),
            f"ansible=={version}",
        ],
        check=True,
    )
    return sorted(cache.glob(f"ansible-{version}-*.whl"))[0]


def extract(wheel: Path, collection: str, dest: Path) -> None:
    """Copy one collection (namespace.name) out of the wheel into dest."""
    namespace, name = collection.split(".")
    prefix = f"ansible_collections/{namespace}/{name}/"
    target = dest / namespace / name
    staging = target.with_name(f".{name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.startswith(prefix)]
        if not members:
            raise SystemExit(f"{collection} is not in {wheel.name}")
        for member in members:
            out = staging / member[len(prefix) :]
            if member.endswith("/"):
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(archive.read(member))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ansible-version", required=True)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--dest", type=Path, required=True)
    parser.add_argument("collections", nargs="+")
    args = parser.parse_args()
    wheel = wheel_path(args.ansible_version, args.cache)
    for collection in args.collections:
        extract(wheel, collection, args.dest)
        print(f"extracted {collection} from {wheel.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
