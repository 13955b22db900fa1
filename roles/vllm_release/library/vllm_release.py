#!/usr/bin/python
# Copyright: vllm-fleet contributors
# Apache-2.0
"""Ansible module: record, select and look up the releases of a vLLM service on a node."""

from __future__ import annotations

import calendar
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import tempfile
import time
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: vllm_release
short_description: Record, select and look up releases of a vLLM service on a node
description:
  - A release is a directory C(<path>/<id>/) holding C(release.json) (what the
    node ran: vLLM venv and version, model path and revision, the checkpoint's
    quant-config state, a digest) and byte-exact copies of the files that
    define the service (the systemd unit, the secrets environment file).
  - One pointer record, C(pointers.json), names two releases, C(current) (what
    the node runs now) and C(previous) (what it ran before); a rollback selects
    C(previous), which makes the two trade places, so a second rollback returns.
  - The record changes in one step (a new file fsynced, then renamed over the
    old one), so a crash at any point leaves the old pair or the new one. The
    C(current) and C(previous) symlinks beside it are a view of the record,
    refreshed after each switch. Release directories of the older two-symlink
    layout (no record yet) are read from those symlinks and upgraded on the
    next switch.
  - O(state=recorded) records the node's state as a new release and points
    C(current) at it, unless C(current) already has the same digest (a rerun
    that changed nothing records nothing). Then prunes to the newest
    O(keep) releases, never removing C(current) or C(previous).
  - O(state=selected) points C(current) at O(release) (an id or C(previous))
    and C(previous) at the old C(current). It does not touch the service:
    restore the files first, then select.
  - O(state=query) only reads; it resolves O(release) and returns it.
  - The release directory is root-only (0700): the environment file holds secrets.
version_added: "0.1.0"
author:
  - vllm-fleet contributors
options:
  path:
    description:
      - The releases directory of one served model, for example
        C(/var/lib/vllm-fleet/releases/<served name>).
    type: path
    required: true
  state:
    description:
      - V(recorded) records the node's state when it differs from C(current).
      - V(selected) points C(current) at O(release).
      - V(query) changes nothing and returns O(release).
    type: str
    choices: [recorded, selected, query]
    default: query
  release:
    description:
      - A release id, or V(current) or V(previous) (the pointers).
      - Used by O(state=selected) and O(state=query).
    type: str
    default: current
  required:
    description:
      - With O(state=query), fail when O(release) does not resolve to a
        recorded release. When false, return RV(found=false) instead.
    type: bool
    default: true
  files:
    description:
      - With O(state=recorded), role name to absolute path of each file to keep
        a copy of (for example C(unit) and C(env)). Every file must exist.
        Copies keep the file's mode; the digest covers their bytes.
    type: dict
    default: {}
  metadata:
    description:
      - With O(state=recorded), what the node runs besides the files (vLLM
        venv and version, model path and revision, quant-config state). Part
        of the digest. Keys C(id), C(time), C(digest), C(files), C(info) and
        C(previous) are reserved.
    type: dict
    default: {}
  info:
    description:
      - With O(state=recorded), recorded in C(release.json) under C(info) but
        not part of the digest (for example the deploy variables and their
        digest: a variable change that changes nothing on the node is no new
        release).
    type: dict
    default: {}
  keep:
    description:
      - With O(state=recorded), how many releases to keep (newest first);
        C(current) and C(previous) are always kept.
    type: int
    default: 5
notes:
  - Supports check mode (nothing is written; the result says what would be
    recorded or selected) and diff mode (the pointers before and after).
  - Release ids are C(<UTC time to the millisecond>Z-<first 8 hex of the
    digest>), each later than every existing one, so they sort in recording order.
"""

EXAMPLES = r"""
- name: Record the node's release after it became healthy
  vllm_release:
    path: /var/lib/vllm-fleet/releases/tiny-kimi
    state: recorded
    files:
      unit: /etc/systemd/system/vllm-tiny-kimi.service
      env: /etc/vllm-fleet/tiny-kimi.env
    metadata:
      vllm: {package: vllm, version: 0.16.0, venv: /opt/vllm-fleet/venvs/vllm-0.16.0}
      model: {path: /srv/vllm-fleet/models/tiny-kimi, sha: 0123abcd...}
    keep: 5

- name: Look up the release to roll back to (fails clearly when there is none)
  vllm_release:
    path: /var/lib/vllm-fleet/releases/tiny-kimi
    release: previous
  register: target

- name: Make the restored release the current one
  vllm_release:
    path: /var/lib/vllm-fleet/releases/tiny-kimi
    state: selected
    release: "{{ target.id }}"
"""

RETURN = r"""
changed:
  description: Whether a release was (or, in check mode, would be) recorded or selected.
  returned: always
  type: bool
  sample: true
found:
  description: >-
    Whether O(release) resolved to a recorded release (always true unless
    O(required=false)).
  returned: always
  type: bool
  sample: true
id:
  description: >-
    The release recorded, selected or looked up; for O(state=recorded) without
    a change, the current release. Empty when nothing was found.
  returned: always
  type: str
  sample: 20261129T141502123Z-1a2b3c4d
release_dir:
  description: The directory of that release (in check mode, where it would be).
  returned: always
  type: str
  sample: /var/lib/vllm-fleet/releases/tiny-kimi/20261129T141502123Z-1a2b3c4d
release:
  description: >-
    Its C(release.json): C(id), C(time), C(digest), C(previous), C(files)
    (role name to C(path), C(stored) name, C(sha256), C(mode)), C(info) and
    the metadata keys. Empty when nothing was found.
  returned: always
  type: dict
  sample:
    id: 20261129T141502123Z-1a2b3c4d
    time: "2026-11-29T14:15:02Z"
    digest: 1a2b3c4d...
    files:
      unit:
        path: /etc/systemd/system/vllm-tiny-kimi.service
        stored: vllm-tiny-kimi.service
        sha256: 5e6f...
        mode: "0644"
digest:
  description: With O(state=recorded), the digest of the node's state (files and metadata).
  returned: when state is recorded
  type: str
  sample: 1a2b3c4d5e6f...
current:
  description: The C(current) pointer after the run (empty when none).
  returned: always
  type: str
  sample: 20261129T141502123Z-1a2b3c4d
previous:
  description: The C(previous) pointer after the run (empty when none).
  returned: always
  type: str
  sample: 20261129T120001456Z-9f8e7d6c
releases:
  description: Recorded release ids after the run, oldest first.
  returned: always
  type: list
  elements: str
  sample: [20261129T120001456Z-9f8e7d6c, 20261129T141502123Z-1a2b3c4d]
pruned:
  description: Release ids removed (or that would be removed) to keep O(keep).
  returned: always
  type: list
  elements: str
  sample: []
"""

ID_RE = re.compile(r"^[0-9]{8}T[0-9]{9}Z-[0-9a-f]{8}$")
RELEASE_JSON = "release.json"
POINTERS = ("current", "previous")
# The one pointer record: {"current": id, "previous": id}, replaced atomically.
POINTER_RECORD = "pointers.json"
# Test hook: the module SIGKILLs itself after the step this names.
CRASH_HOOK = "VLLM_RELEASE_CRASH_AFTER"
RESERVED = frozenset({"id", "time", "digest", "files", "info", "previous"})


class ReleaseError(Exception):
    """A problem that stops the run before anything is written."""


def canonical_json(data: Any) -> str:
    """JSON with sorted keys and no whitespace: equal data, equal text."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_records(files: dict[str, str]) -> dict[str, dict[str, str]]:
    """Per role name: path, stored name, sha256 and mode of each file to keep."""
    records: dict[str, dict[str, str]] = {}
    stored_names: set[str] = set()
    for name, path in sorted(files.items()):
        if not os.path.isabs(path):
            raise ReleaseError(f"files.{name}: {path!r} is not an absolute path")
        if not os.path.isfile(path):
            raise ReleaseError(f"files.{name}: {path} does not exist: deploy the service first")
        stored = os.path.basename(path)
        if stored in stored_names or stored == RELEASE_JSON:
            raise ReleaseError(f"files.{name}: another file is already stored as {stored}")
        stored_names.add(stored)
        records[name] = {
            "path": path,
            "stored": stored,
            "sha256": sha256_file(path),
            "mode": f"{stat.S_IMODE(os.stat(path).st_mode):04o}",
        }
    return records


def state_digest(records: dict[str, dict[str, str]], metadata: dict[str, Any]) -> str:
    """Digest of what the node runs: each file's bytes, mode and place, and the metadata."""
    return hashlib.sha256(
        canonical_json({"files": records, "metadata": metadata}).encode()
    ).hexdigest()


def id_time_ms(release_id: str) -> int:
    """The UTC time in an id, in milliseconds since the epoch."""
    stamp = release_id.split("Z-", 1)[0]
    seconds = calendar.timegm(time.strptime(stamp[:15], "%Y%m%dT%H%M%S"))
    return seconds * 1000 + int(stamp[15:18])


def new_id(digest: str, now: float, existing: set[str]) -> str:
    """A unique id that sorts after every existing one: UTC time (ms) plus the digest's head.

    Two records in the same millisecond, or a clock that went back, still get
    a later id, so sorting ids always gives the recording order.
    """
    when = int(now * 1000)
    if existing:
        when = max(when, max(id_time_ms(rid) for rid in existing) + 1)
    seconds, millis = divmod(when, 1000)
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(seconds)) + f"{millis:03d}Z-{digest[:8]}"


def list_releases(root: str) -> list[str]:
    """Ids of complete releases (a release.json present), oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(
        entry
        for entry in os.listdir(root)
        if ID_RE.match(entry) and os.path.isfile(os.path.join(root, entry, RELEASE_JSON))
    )


def _release_id(root: str, target: str) -> str:
    """target as a recorded release id, or '' when it names no complete release."""
    target = os.path.basename(str(target).rstrip("/"))
    if not ID_RE.match(target) or not os.path.isfile(os.path.join(root, target, RELEASE_JSON)):
        return ""
    return target


def _legacy_pointer(root: str, name: str) -> str:
    """A pointer of the two-symlink layout (releases recorded before the pointer record)."""
    path = os.path.join(root, name)
    if os.path.islink(path):
        return _release_id(root, os.readlink(path))
    if os.path.isfile(path):
        with open(path) as handle:
            return _release_id(root, handle.read().strip())
    return ""


def read_pointers(root: str) -> dict[str, str]:
    """current and previous: from the pointer record, else the legacy symlinks."""
    path = os.path.join(root, POINTER_RECORD)
    if not os.path.isfile(path):
        return {name: _legacy_pointer(root, name) for name in POINTERS}
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ReleaseError(f"{path}: unreadable pointer record: {exc}") from None
    if not isinstance(data, dict):
        raise ReleaseError(f"{path}: not a pointer record (expected current and previous)")
    return {name: _release_id(root, data.get(name) or "") for name in POINTERS}


def read_pointer(root: str, name: str) -> str:
    """The id a pointer names, or '' when it is missing or names no release."""
    return read_pointers(root)[name]


def _crash_point(step: str) -> None:
    """Die here, as a crash or power loss would, when the test hook names this step."""
    if os.environ.get(CRASH_HOOK) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_pointers(root: str, current: str, previous: str) -> None:
    """Switch current and previous together: one record, replaced by one rename.

    A crash before the rename leaves the old pair, after it the new pair. The
    current/previous symlinks are only a view of the record (for people and
    the status play), refreshed after it and again on the next switch.
    """
    _remove_stale_temporaries(root)
    tmp = os.path.join(root, f".{POINTER_RECORD}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        json.dump({"current": current, "previous": previous}, handle, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(tmp, 0o644)
    _crash_point("pointer-staged")
    os.replace(tmp, os.path.join(root, POINTER_RECORD))
    _fsync_dir(root)
    _crash_point("pointer-switched")
    sync_links(root, {"current": current, "previous": previous})


def _remove_stale_temporaries(root: str) -> None:
    """Half-written pointer files a killed run left (never read by anyone)."""
    prefixes = tuple(f".{name}.tmp-" for name in (POINTER_RECORD, *POINTERS))
    for entry in os.listdir(root):
        if entry.startswith(prefixes):
            os.unlink(os.path.join(root, entry))


def sync_links(root: str, pointers: dict[str, str]) -> None:
    """The current/previous symlinks as the record says (removed when it names none)."""
    for name in POINTERS:
        path = os.path.join(root, name)
        target = pointers[name]
        if os.path.islink(path) and os.readlink(path) == target:
            continue
        if not target:
            if os.path.lexists(path):
                os.unlink(path)
            continue
        tmp = os.path.join(root, f".{name}.tmp-{os.getpid()}")
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, path)
        _crash_point(f"link-{name}")


def load_release(root: str, release_id: str) -> dict[str, Any]:
    path = os.path.join(root, release_id, RELEASE_JSON)
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ReleaseError(f"{path}: unreadable release record: {exc}") from None
    if not isinstance(data, dict) or data.get("id") != release_id:
        raise ReleaseError(f"{path}: not a release record for {release_id}")
    return data


def resolve(root: str, ref: str) -> str:
    """A pointer name or an id -> a recorded release id, or '' when there is none."""
    if ref in POINTERS:
        return read_pointer(root, ref)
    if not ID_RE.match(ref):
        raise ReleaseError(
            f"release {ref!r} is neither an id (like 20261129T141502123Z-1a2b3c4d) "
            "nor 'current' or 'previous'"
        )
    return ref if ref in list_releases(root) else ""


def prune_candidates(releases: list[str], keep: int, protect: set[str]) -> list[str]:
    """The releases beyond the newest `keep`, except protected ones (oldest first)."""
    surplus = len(releases) - keep
    if surplus <= 0:
        return []
    old = [rid for rid in releases if rid not in protect]
    return old[:surplus]


def pointers_text(current: str, previous: str) -> str:
    return f"current: {current or '(none)'}\nprevious: {previous or '(none)'}\n"


def write_release(
    root: str, release_id: str, release: dict[str, Any], records: dict[str, dict[str, str]]
) -> str:
    """Copy the files and write release.json in a temporary directory, then rename it."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    os.chmod(root, 0o700)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    try:
        for record in records.values():
            dest = os.path.join(tmp, record["stored"])
            shutil.copyfile(record["path"], dest)
            os.chmod(dest, int(record["mode"], 8))
            if sha256_file(dest) != record["sha256"]:
                raise ReleaseError(f"{record['path']} changed while it was being recorded")
        json_path = os.path.join(tmp, RELEASE_JSON)
        with open(json_path, "w") as handle:
            json.dump(release, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.chmod(json_path, 0o600)
        final = os.path.join(root, release_id)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def remove_releases(root: str, ids: list[str]) -> None:
    for release_id in ids:
        shutil.rmtree(os.path.join(root, release_id))


def base_result(root: str) -> dict[str, Any]:
    pointers = read_pointers(root)
    return {
        "changed": False,
        "found": False,
        "id": "",
        "release_dir": "",
        "release": {},
        "current": pointers["current"],
        "previous": pointers["previous"],
        "releases": list_releases(root),
        "pruned": [],
    }


def record(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    root = params["path"]
    metadata = params["metadata"] or {}
    clash = RESERVED & set(metadata)
    if clash:
        raise ReleaseError(f"metadata may not set the reserved keys {sorted(clash)}")
    if params["keep"] < 1:
        raise ReleaseError(f"keep must be at least 1, not {params['keep']}")
    records = file_records(params["files"] or {})
    digest = state_digest(records, metadata)
    result = base_result(root)
    result["digest"] = digest
    current, previous = result["current"], result["previous"]
    if current and load_release(root, current).get("digest") == digest:
        release_id = current
        result.update(found=True, id=release_id, release=load_release(root, release_id))
        result["release_dir"] = os.path.join(root, release_id)
        return result
    release_id = new_id(digest, time.time(), set(result["releases"]))
    release = {
        **metadata,
        "id": release_id,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "digest": digest,
        "previous": current,
        "files": records,
        "info": params["info"] or {},
    }
    releases = [*result["releases"], release_id]
    pruned = prune_candidates(releases, params["keep"], {release_id, current})
    result.update(
        changed=True,
        found=True,
        id=release_id,
        release=release,
        release_dir=os.path.join(root, release_id),
        current=release_id,
        previous=current or previous,
        releases=[rid for rid in releases if rid not in pruned],
        pruned=pruned,
        diff={"before": pointers_text(current, previous), "after": ""},
    )
    result["diff"]["after"] = pointers_text(result["current"], result["previous"])
    if check_mode:
        return result
    write_release(root, release_id, release, records)
    _crash_point("release-written")
    write_pointers(root, result["current"], result["previous"])
    remove_releases(root, pruned)
    _crash_point("pruned")
    return result


def not_found_message(root: str, ref: str, result: dict[str, Any]) -> str:
    known = ", ".join(result["releases"]) or "none"
    if ref == "previous":
        return (
            f"No earlier release is recorded in {root} (current: "
            f"{result['current'] or 'none'}; releases: {known}): there is nothing to roll back "
            "to. Nothing was changed."
        )
    return f"Release {ref!r} is not recorded in {root} (releases: {known}). Nothing was changed."


def lookup(params: dict[str, Any]) -> dict[str, Any]:
    root = params["path"]
    result = base_result(root)
    release_id = resolve(root, params["release"])
    if not release_id:
        if params["required"]:
            raise ReleaseError(not_found_message(root, params["release"], result))
        return result
    result.update(
        found=True,
        id=release_id,
        release=load_release(root, release_id),
        release_dir=os.path.join(root, release_id),
    )
    return result


def select(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    root = params["path"]
    result = lookup({**params, "required": True})
    current, previous = result["current"], result["previous"]
    if result["id"] == current:
        return result
    result.update(
        changed=True,
        current=result["id"],
        previous=current,
        diff={"before": pointers_text(current, previous), "after": ""},
    )
    result["diff"]["after"] = pointers_text(result["current"], result["previous"])
    if not check_mode:
        write_pointers(root, result["current"], result["previous"])
    return result


def run(module: AnsibleModule) -> dict[str, Any]:
    params = module.params
    root = params["path"]
    writes = params["state"] != "query" and not module.check_mode
    if writes and os.path.isfile(os.path.join(root, POINTER_RECORD)):
        # Heal the symlink view after a crash between the switch and its refresh.
        sync_links(root, read_pointers(root))
    if params["state"] == "recorded":
        return record(params, module.check_mode)
    if params["state"] == "selected":
        return select(params, module.check_mode)
    return lookup(params)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "state": {
                "type": "str",
                "choices": ["recorded", "selected", "query"],
                "default": "query",
            },
            "release": {"type": "str", "default": "current"},
            "required": {"type": "bool", "default": True},
            "files": {"type": "dict", "default": {}},
            "metadata": {"type": "dict", "default": {}},
            "info": {"type": "dict", "default": {}},
            "keep": {"type": "int", "default": 5},
        },
        supports_check_mode=True,
    )
    try:
        result = run(module)
    except (ReleaseError, OSError) as exc:
        module.fail_json(msg=str(exc))
    if not module._diff:
        result.pop("diff", None)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
