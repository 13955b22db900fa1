#!/usr/bin/python
# Copyright: vllm-fleet contributors
# Apache-2.0
"""Ansible module: record, select and look up the releases of a vLLM service on a node."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_release
short_description: Record, select and look up releases of a vLLM service on a node
description:
  - >-
    A release is a directory C(<path>/<id>/) holding C(release.json) (what the
    node ran: vLLM venv and version, model path and revision, the checkpoint's
    quant-config state, a digest) and copies of the files that define the
    service (the systemd unit, the secrets environment file).
  - >-
    No secret is stored: in the copies of the files named in O(redact)
    (environment files), the value of each variable named in O(secrets) is
    replaced by a placeholder naming it, C(NAME=@@vllm-fleet-secret:NAME@@).
    The digest covers that redacted form, so it does not change when only a
    secret does. Every other copy is byte-exact.
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
  - >-
    O(state=selected) points C(current) at O(release) (an id or C(previous))
    and C(previous) at the old C(current). It does not touch the service:
    restore the files first, then select.
  - >-
    O(state=restored) writes the files of O(release) named in O(restore) back
    to their places (atomically, with the recorded mode, owned by root),
    filling each placeholder with the current value from O(secrets) (quoted as
    role vllm_service quotes it, so an unchanged secret gives the live file
    byte for byte; an empty value leaves the variable out, as the template
    does). It does not move the pointers: select afterwards.
  - O(state=query) only reads; it resolves O(release) and returns it.
  - The release directory is root-only (0700).
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
      - V(restored) writes the files of O(release) back to the node.
      - V(query) changes nothing and returns O(release).
    type: str
    choices: [recorded, selected, restored, query]
    default: query
  release:
    description:
      - A release id, or V(current) or V(previous) (the pointers).
      - Used by O(state=selected), O(state=restored) and O(state=query).
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
        Copies keep the file's mode; the digest covers their bytes (redacted).
    type: dict
    default: {}
  redact:
    description:
      - With O(state=recorded), the role names in O(files) of environment
        files (C(NAME=value) lines) whose copies leave out the values of the
        variables named in O(secrets).
    type: list
    elements: str
    default: []
  secrets:
    description:
      - Variable name to its current secret value (for example C(VLLM_API_KEY),
        C(HF_TOKEN)). With O(state=recorded) the names say what to redact, and
        the record fails, writing nothing, if a non-empty value is still found
        in any copy. With O(state=restored) the values fill the placeholders.
      - Never logged.
    type: dict
    default: {}
  restore:
    description:
      - With O(state=restored), the role names of the release's files to write
        back (for example C(env)); empty means all of them.
    type: list
    elements: str
    default: []
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
      - >-
        With O(state=recorded), recorded in C(release.json) under C(info) but
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
    the metadata keys; a redacted file also has C(redacted), the variable
    names left out. Empty when nothing was found.
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
replica:
  description: >-
    The found release's place in a replica of several nodes (C(name), C(rank),
    C(nodes), C(leader_host), ...: C(info.deploy_vars.replica) as role
    vllm_release records it); empty for a node alone or a release recorded
    before replicas were.
  returned: when a release was found with state query, selected or restored
  type: dict
  sample: {name: r1, rank: 1, nodes: 2, leader_host: node-1, api_port: 8000}
current_replica:
  description: The same for the C(current) release (what the node runs now); empty when none.
  returned: when a release was found with state query, selected or restored
  type: dict
  sample: {}
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
restored:
  description: With O(state=restored), the role names of the files written (or that would be).
  returned: when state is restored
  type: list
  elements: str
  sample: [env]
"""

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

ID_RE = re.compile(r"^[0-9]{8}T[0-9]{9}Z-[0-9a-f]{8}$")
RELEASE_JSON = "release.json"
POINTERS = ("current", "previous")
# The one pointer record: {"current": id, "previous": id}, replaced atomically.
POINTER_RECORD = "pointers.json"
# Test hook: the module SIGKILLs itself after the step this names.
CRASH_HOOK = "VLLM_RELEASE_CRASH_AFTER"
RESERVED = frozenset({"id", "time", "digest", "files", "info", "previous"})
# What a stored environment file holds instead of a secret's value.
PLACEHOLDER = "@@vllm-fleet-secret:{name}@@"
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ReleaseError(Exception):
    """A problem that stops the run before anything is written."""


def canonical_json(data: Any) -> str:
    """JSON with sorted keys and no whitespace: equal data, equal text."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def envfile_quote(value: str) -> str:
    """A value as role vllm_service's systemd_envfile_quote writes it (double quotes)."""
    if "\n" in value or "\r" in value:
        raise ReleaseError("a secret value cannot span lines in an environment file")
    escaped = re.sub(r'([\\"$`])', r"\\\1", value)
    return f'"{escaped}"'


def redact_env(content: bytes, names: list[str]) -> tuple[bytes, list[str]]:
    """The environment file with each named variable's value replaced by its placeholder."""
    lines = content.decode("utf-8", errors="surrogateescape").split("\n")
    redacted: list[str] = []
    for index, line in enumerate(lines):
        name, sep, _ = line.partition("=")
        if sep and name in names:
            lines[index] = f"{name}={PLACEHOLDER.format(name=name)}"
            redacted.append(name)
    return "\n".join(lines).encode("utf-8", errors="surrogateescape"), sorted(set(redacted))


def fill_env(content: bytes, secrets: dict[str, str], where: str) -> bytes:
    """A stored environment file with its placeholders filled from the current secrets.

    A variable whose current value is empty is left out, as role
    vllm_service's template leaves it out.
    """
    out: list[str] = []
    for line in content.decode("utf-8", errors="surrogateescape").split("\n"):
        name, sep, value = line.partition("=")
        if not (sep and value == PLACEHOLDER.format(name=name)):
            out.append(line)
            continue
        if name not in secrets:
            raise ReleaseError(
                f"{where} needs the secret {name}, which was not passed in secrets: "
                "pass its current value (vault). Nothing was changed."
            )
        if secrets[name]:
            out.append(f"{name}={envfile_quote(secrets[name])}")
    return "\n".join(out).encode("utf-8", errors="surrogateescape")


def check_no_secret(contents: dict[str, bytes], secrets: dict[str, str]) -> None:
    """Fail, naming only variables and files, if a secret value is still in a copy."""
    for role, content in sorted(contents.items()):
        for name, value in sorted(secrets.items()):
            if value and value.encode() in content:
                raise ReleaseError(
                    f"files.{role} holds the value of {name} where it cannot be redacted "
                    f"(only a {name}=... line of an environment file in redact can be): "
                    "a release would store a secret. Nothing was recorded."
                )


def file_records(
    files: dict[str, str], redact: list[str], secrets: dict[str, str]
) -> tuple[dict[str, dict[str, Any]], dict[str, bytes]]:
    """Per role name: path, stored name, sha256 and mode of each file to keep, and
    the bytes to store (redacted for the roles in redact)."""
    unknown = sorted(set(redact) - set(files))
    if unknown:
        raise ReleaseError(f"redact names {unknown}, which are not in files {sorted(files)}")
    bad = sorted(name for name in secrets if not ENV_NAME_RE.match(str(name)))
    if bad:
        raise ReleaseError(f"secrets: {bad} are not environment variable names")
    records: dict[str, dict[str, Any]] = {}
    contents: dict[str, bytes] = {}
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
        with open(path, "rb") as handle:
            content = handle.read()
        records[name] = {"path": path, "stored": stored}
        if name in redact:
            content, records[name]["redacted"] = redact_env(content, sorted(secrets))
        contents[name] = content
        records[name]["sha256"] = hashlib.sha256(content).hexdigest()
        records[name]["mode"] = f"{stat.S_IMODE(os.stat(path).st_mode):04o}"
    check_no_secret(contents, secrets)
    return records, contents


def state_digest(records: dict[str, dict[str, Any]], metadata: dict[str, Any]) -> str:
    """Digest of what the node runs: each file's (redacted) bytes, mode and place, and
    the metadata."""
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
        _fsync_dir(root)
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


def release_replica(release: dict[str, Any]) -> dict[str, Any]:
    """The release's place in a replica of several nodes (role vllm_release records
    it in info.deploy_vars.replica); {} for a node alone or a release from before."""
    deploy_vars = (release.get("info") or {}).get("deploy_vars") or {}
    return deploy_vars.get("replica") or {}


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
    root: str,
    release_id: str,
    release: dict[str, Any],
    records: dict[str, dict[str, Any]],
    contents: dict[str, bytes],
) -> str:
    """Write the copies and release.json in a temporary directory, then rename it.

    Every file, the directory and its parent reach the disk before the rename and the
    rename before the pointer switch: after a power loss the switch never names a
    release of empty files.
    """
    os.makedirs(root, mode=0o700, exist_ok=True)
    os.chmod(root, 0o700)
    _fsync_dir(os.path.dirname(root))  # a new releases directory's own entry
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    try:
        for role, record in records.items():
            dest = os.path.join(tmp, record["stored"])
            # Created with the final mode: a 0600 file is never readable by others.
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, int(record["mode"], 8))
            with os.fdopen(fd, "wb") as handle:
                handle.write(contents[role])
                handle.flush()
                os.fchmod(handle.fileno(), int(record["mode"], 8))
                os.fsync(handle.fileno())
        json_path = os.path.join(tmp, RELEASE_JSON)
        with open(json_path, "w") as handle:
            json.dump(release, handle, indent=2, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fchmod(handle.fileno(), 0o600)
            os.fsync(handle.fileno())
        _fsync_dir(tmp)
        final = os.path.join(root, release_id)
        os.rename(tmp, final)
        _fsync_dir(root)
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
    records, contents = file_records(
        params["files"] or {}, params["redact"] or [], params["secrets"] or {}
    )
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
    write_release(root, release_id, release, records, contents)
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
    release = load_release(root, release_id)
    current = result["current"]
    result.update(
        found=True,
        id=release_id,
        release=release,
        release_dir=os.path.join(root, release_id),
        replica=release_replica(release),
        current_replica=release_replica(load_release(root, current)) if current else {},
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


def _live_matches(path: str, content: bytes, mode: int) -> bool:
    """Whether the file at path already has these bytes and mode, owned by root."""
    try:
        info = os.stat(path)
        with open(path, "rb") as handle:
            same = handle.read() == content
    except FileNotFoundError:
        return False
    owned = info.st_uid == 0 and info.st_gid == 0 if os.geteuid() == 0 else True
    return same and stat.S_IMODE(info.st_mode) == mode and owned


def write_atomically(path: str, content: bytes, mode: int) -> None:
    """Replace path by a file with these bytes and mode (root-owned when run as root)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp-", dir=os.path.dirname(path))
    try:
        os.fchmod(fd, mode)
        if os.geteuid() == 0:
            os.fchown(fd, 0, 0)
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def restore_files(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    """Write a release's files back, placeholders filled from the current secrets."""
    result = lookup({**params, "required": True})
    files = result["release"].get("files") or {}
    wanted = params["restore"] or sorted(files)
    unknown = sorted(set(wanted) - set(files))
    if unknown:
        raise ReleaseError(
            f"release {result['id']} stores no {unknown} (it stores {sorted(files)}). "
            "Nothing was changed."
        )
    planned: list[tuple[str, str, bytes, int]] = []
    for role in wanted:
        record = files[role]
        with open(os.path.join(result["release_dir"], record["stored"]), "rb") as handle:
            content = handle.read()
        if record.get("redacted"):
            content = fill_env(content, params["secrets"] or {}, f"files.{role} of {result['id']}")
        mode = int(record["mode"], 8)
        if not _live_matches(record["path"], content, mode):
            planned.append((role, record["path"], content, mode))
    result.update(changed=bool(planned), restored=[role for role, *_ in planned])
    if not check_mode:
        for _, path, content, mode in planned:
            write_atomically(path, content, mode)
    return result


def run(module: AnsibleModule) -> dict[str, Any]:
    params = dict(module.params)
    # Values as the environment file holds them: text (an empty one: unset).
    params["secrets"] = {
        str(name): "" if value is None else str(value)
        for name, value in (params["secrets"] or {}).items()
    }
    root = params["path"]
    writes = params["state"] != "query" and not module.check_mode
    if writes and os.path.isfile(os.path.join(root, POINTER_RECORD)):
        # Heal the symlink view after a crash between the switch and its refresh.
        sync_links(root, read_pointers(root))
    if params["state"] == "recorded":
        return record(params, module.check_mode)
    if params["state"] == "selected":
        return select(params, module.check_mode)
    if params["state"] == "restored":
        return restore_files(params, module.check_mode)
    return lookup(params)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "state": {
                "type": "str",
                "choices": ["recorded", "selected", "restored", "query"],
                "default": "query",
            },
            "release": {"type": "str", "default": "current"},
            "required": {"type": "bool", "default": True},
            "files": {"type": "dict", "default": {}},
            "metadata": {"type": "dict", "default": {}},
            "info": {"type": "dict", "default": {}},
            "keep": {"type": "int", "default": 5},
            "redact": {"type": "list", "elements": "str", "default": []},
            "secrets": {"type": "dict", "default": {}, "no_log": True},
            "restore": {"type": "list", "elements": "str", "default": []},
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
