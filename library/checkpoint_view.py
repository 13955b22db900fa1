#!/usr/bin/python
# Copyright: vllm-fleet contributors
# Apache-2.0
"""Ansible module: a view of a checkpoint (symlinks plus real config files), and view GC."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: checkpoint_view
short_description: Build a view of a Hugging Face checkpoint, or collect unreferenced views
description:
  - "O(state=present): ensures the directory C(<root>/<sha>/<variant>/) mirrors the
    checkpoint O(checkpoint): one relative symlink per checkpoint file, except the
    files named in O(materialize), which are real files (copies of the checkpoint's,
    or of O(sources)) that C(hf_quant_config) may then patch. The checkpoint itself is
    never written."
  - Entries of the view that the checkpoint no longer has are removed, links that
    point elsewhere are replaced. A real file already in the view is kept as it is
    (it carries the variant's patch); with O(sources) it must equal its source.
  - A new view is built in a temporary directory and renamed into place, so a node
    never sees half a view. Every change happens under an exclusive lock
    (C(<root>/.lock)), so the nodes of a storage domain build a view once.
  - >-
    With O(manifest) (the download's C(manifest.json)), the checkpoint's copies of
    the O(materialize) files are checked against the hub's digests first: a view is
    never built on a checkpoint that was edited in place.
  - "O(state=collected): records which views the kept releases of O(host) reference
    (C(<root>/.refs/<host>.json)), then removes every view that no host's record and
    no entry of O(keep) references."
version_added: "0.2.0"
author:
  - vllm-fleet contributors
options:
  state:
    description: V(present) builds or repairs one view; V(collected) removes unreferenced views.
    type: str
    choices: [present, collected]
    default: present
  root:
    description: The views directory, C(<state dir>/views), beside the checkpoint.
    type: path
    required: true
  checkpoint:
    description: The downloaded checkpoint directory the view mirrors (O(state=present)).
    type: path
  sha:
    description:
      - The checkpoint's commit sha (the view's first path level). Empty takes it from
        O(manifest), or V(local) without one.
    type: str
    default: ""
  variant:
    description: The config variant (the view's second path level), e.g. V(absent).
    type: str
  materialize:
    description: Checkpoint files that are real files in the view (the ones a variant changes).
    type: list
    elements: str
    default: [config.json, hf_quant_config.json]
  sources:
    description:
      - Per materialized file name, a file whose bytes the view's copy must have
        (a release's copy, to rebuild a collected view). A view file that exists with
        other bytes is an error, never overwritten (other nodes may serve it).
    type: dict
    default: {}
  manifest:
    description: The download manifest (C(manifest.json)) to check the checkpoint against.
    type: path
  lock_timeout:
    description: Seconds to wait for another run's lock on O(root).
    type: int
    default: 600
  host:
    description: The node whose references are recorded (O(state=collected)).
    type: str
  releases_dir:
    description:
      - The node's release directory; each C(<id>/release.json) with a C(view.path)
        references that view (O(state=collected)).
    type: path
  keep:
    description: View paths kept whatever the records say (views the running play selected).
    type: list
    elements: path
    default: []
notes:
  - Supports check mode and diff mode (the entries added, replaced and removed).
"""

EXAMPLES = r"""
- name: The view without the FP8 KV-cache declarations
  checkpoint_view:
    root: /shared/models/.vllm-fleet/kimi/views
    checkpoint: /shared/models/kimi
    variant: absent
    manifest: /shared/models/.vllm-fleet/kimi/manifest.json
  register: view

- name: Remove the declarations from the view's own copies
  hf_quant_config:
    model_dir: "{{ view.path }}"
    kv_cache_quant: absent

- name: Collect views no kept release references
  checkpoint_view:
    state: collected
    root: /shared/models/.vllm-fleet/kimi/views
    host: "{{ inventory_hostname }}"
    releases_dir: /var/lib/vllm-fleet/releases/kimi
    keep: ["{{ view.path }}"]
"""

RETURN = r"""
path:
  description: The view directory (O(state=present)).
  returned: success
  type: str
  sample: /shared/models/.vllm-fleet/kimi/views/0123abcd/absent
sha:
  description: The commit sha the view belongs to.
  returned: success
  type: str
  sample: 0123abcd
checkpoint:
  description: The checkpoint the view mirrors.
  returned: success
  type: str
  sample: /shared/models/kimi
created:
  description: Whether the view did not exist before this run.
  returned: success
  type: bool
  sample: true
links:
  description: Number of symlinks in the view.
  returned: success
  type: int
  sample: 140
added:
  description: View entries created (or that would be).
  returned: success
  type: list
  elements: str
  sample: [config.json, model-00001-of-00119.safetensors]
replaced:
  description: View entries replaced (a link pointing elsewhere, or a link for a real file).
  returned: success
  type: list
  elements: str
  sample: [config.json]
removed:
  description: View entries removed because the checkpoint lacks them.
  returned: success
  type: list
  elements: str
  sample: [old-shard.safetensors]
files:
  description: Per real file of the view, its SHA-256 (after this run).
  returned: success
  type: dict
  sample: {config.json: 9c1e..., hf_quant_config.json: 77ab...}
collected:
  description: View directories removed (or that would be) by O(state=collected).
  returned: success
  type: list
  elements: str
  sample: [/shared/models/.vllm-fleet/kimi/views/0123abcd/absent]
skipped:
  description:
    - >-
      Symlinks found where a view or sha directory belongs (O(state=collected)), left
      alone and never followed: the toolkit makes none there.
  returned: success
  type: list
  elements: str
  sample: [/shared/models/.vllm-fleet/kimi/views/0123abcd/planted]
referenced:
  description: View paths some host's kept releases or O(keep) reference (O(state=collected)).
  returned: success
  type: list
  elements: str
  sample: [/shared/models/.vllm-fleet/kimi/views/0123abcd/absent]
"""

import errno
import fcntl
import glob
import json
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.hf_manifest import DownloadError
from ansible.module_utils.hf_manifest import own_dir as manifest_own_dir
from ansible.module_utils.hf_quant import VIEW_MARKER, git_blob_sha1, sha256_bytes

REFS_DIR = ".refs"


class ViewError(Exception):
    """A problem that stops the run; nothing was written after it was found."""


# The views tree is on shared storage every node can write, and this runs as root: an
# entry where the toolkit keeps a directory or file of its own is never followed.


def own_dir(path: str, make: bool = True) -> str:
    """``path`` as a real directory (hf_manifest's rule: made when absent, if ``make``;
    a symlink or file there refused, naming it), its refusal as a ViewError."""
    try:
        return manifest_own_dir(path, make)
    except DownloadError as err:
        raise ViewError(str(err)) from None


# --- lock ---------------------------------------------------------------------


class RootLock:
    """flock on <root>/.lock: the kernel drops it when the holder dies."""

    def __init__(self, root: str, timeout: int, check_mode: bool) -> None:
        self.path = os.path.join(root, ".lock")
        self.timeout = timeout
        self.fd: int | None = None
        self.enabled = not check_mode

    def __enter__(self) -> RootLock:
        if not self.enabled:
            return self
        own_dir(os.path.dirname(self.path))
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise ViewError(
                f"{self.path}: a symlink where the views lock belongs (the toolkit did not "
                "make it, and it was not followed); remove it and rerun"
            ) from None
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            self.fd = None
            raise ViewError(f"{self.path}: not a regular file; remove it and rerun")
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ViewError(
                        f"{self.path}: another run has held the views lock for "
                        f"{self.timeout} s; wait for it or raise lock_timeout"
                    ) from None
                time.sleep(0.5)
            except OSError as exc:
                raise ViewError(
                    f"{self.path}: this filesystem refuses file locks ({exc.strerror})"
                ) from None

    def __exit__(self, *_exc: object) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


# --- the desired view -----------------------------------------------------------


def checkpoint_files(checkpoint: str) -> list[str]:
    """Relative paths of the checkpoint's files, hidden entries (hub client cache) left out."""
    found = []
    for dirpath, dirnames, filenames in os.walk(checkpoint):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel_dir = os.path.relpath(dirpath, checkpoint)
        for name in sorted(filenames):
            if not name.startswith("."):
                found.append(os.path.normpath(os.path.join(rel_dir, name)))
    return found


def read_bytes(path: str, label: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise ViewError(f"{label} {path}: cannot read: {exc.strerror}") from None


def manifest_doc(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ViewError(f"{path}: unreadable download manifest: {exc}") from None
    return doc if isinstance(doc, dict) else {}


def digest_problem(name: str, data: bytes, entry: dict[str, Any]) -> str | None:
    """Why *data* is not the hub's file *name*, or None when it is (or nothing is recorded)."""
    if entry.get("sha256"):
        expected, actual, kind = entry["sha256"], sha256_bytes(data), "sha256"
    elif entry.get("oid"):
        expected, actual, kind = entry["oid"], git_blob_sha1(data), "git blob sha1"
    else:
        return None
    if expected == actual:
        return None
    return f"{name} ({kind} {actual[:12]}, the hub's is {expected[:12]})"


@dataclass
class Wanted:
    """The view as it should be: link targets and real files' bytes, per relative path."""

    links: dict[str, str] = field(default_factory=dict)
    real: dict[str, bytes] = field(default_factory=dict)


def wanted_view(params: dict[str, Any], view: str, manifest: dict[str, Any]) -> Wanted:
    checkpoint = params["checkpoint"]
    files = checkpoint_files(checkpoint)
    if not files:
        raise ViewError(f"checkpoint {checkpoint}: no files (is the download complete?)")
    wanted = Wanted()
    bad = []
    recorded = manifest.get("files") or {}
    for rel in files:
        if rel in params["materialize"]:
            data = read_bytes(os.path.join(checkpoint, rel), "checkpoint file")
            problem = digest_problem(rel, data, recorded.get(rel) or {})
            if problem:
                bad.append(problem)
            source = params["sources"].get(rel)
            wanted.real[rel] = read_bytes(source, "source") if source else data
        else:
            target = os.path.join(checkpoint, rel)
            wanted.links[rel] = os.path.relpath(target, os.path.dirname(os.path.join(view, rel)))
    if bad:
        raise ViewError(
            f"checkpoint {checkpoint} differs from the hub's revision {manifest.get('sha')}: "
            + "; ".join(bad)
            + ". The checkpoint must stay as downloaded: rerun the download (--tags download)"
        )
    return wanted


# --- comparing and applying -----------------------------------------------------


@dataclass
class Changes:
    added: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def any(self) -> bool:
        return bool(self.added or self.replaced or self.removed)


def existing_entries(view: str) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(view):
        rel_dir = os.path.relpath(dirpath, view)
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if rel != VIEW_MARKER:
                found.append(rel)
    return sorted(found)


def compare(view: str, wanted: Wanted, strict_real: bool) -> Changes:
    changes = Changes()
    for rel, target in wanted.links.items():
        path = os.path.join(view, rel)
        if not os.path.lexists(path):
            changes.added.append(rel)
        elif not os.path.islink(path) or os.readlink(path) != target:
            changes.replaced.append(rel)
    for rel, data in wanted.real.items():
        path = os.path.join(view, rel)
        if not os.path.lexists(path):
            changes.added.append(rel)
        elif os.path.islink(path) or not os.path.isfile(path):
            changes.replaced.append(rel)
        elif strict_real and read_bytes(path, "view file") != data:
            raise ViewError(
                f"{path}: differs from the release's copy; the view is shared by other "
                "nodes and is not overwritten. Remove the view to rebuild it"
            )
    known = set(wanted.links) | set(wanted.real)
    changes.removed = [rel for rel in existing_entries(view) if rel not in known]
    return changes


def write_file(path: str, data: bytes) -> None:
    own_dir(os.path.dirname(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def put_entry(view: str, rel: str, wanted: Wanted) -> None:
    path = os.path.join(view, rel)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    if rel in wanted.real:
        write_file(path, wanted.real[rel])
    else:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        os.symlink(wanted.links[rel], path)


def marker_bytes(params: dict[str, Any], sha: str) -> bytes:
    marker = {
        "checkpoint": params["checkpoint"],
        "sha": sha,
        "variant": params["variant"],
        "materialize": sorted(params["materialize"]),
    }
    return (json.dumps(marker, indent=2, sort_keys=True) + "\n").encode()


def apply(params: dict[str, Any], view: str, sha: str, wanted: Wanted, changes: Changes) -> None:
    if not os.path.isdir(view):
        # Whole view in a temporary sibling, then one rename: never half a view.
        parent = os.path.dirname(view)
        os.makedirs(parent, mode=0o755, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".tmp-{params['variant']}-", dir=parent)
        try:
            for rel in sorted(set(wanted.links) | set(wanted.real)):
                put_entry(tmp, rel, wanted)
            write_file(os.path.join(tmp, VIEW_MARKER), marker_bytes(params, sha))
            os.chmod(tmp, 0o755)
            os.rename(tmp, view)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return
    for rel in changes.removed:
        os.unlink(os.path.join(view, rel))
    for rel in changes.added + changes.replaced:
        put_entry(view, rel, wanted)
    write_file(os.path.join(view, VIEW_MARKER), marker_bytes(params, sha))


def real_digests(view: str, wanted: Wanted) -> dict[str, str]:
    digests = {}
    for rel, data in wanted.real.items():
        path = os.path.join(view, rel)
        if os.path.isfile(path) and not os.path.islink(path):
            data = read_bytes(path, "view file")
        digests[rel] = sha256_bytes(data)
    return digests


def present(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    for name in ("checkpoint", "variant"):
        if not params[name]:
            raise ViewError(f"state=present needs {name}")
    checkpoint = params["checkpoint"]
    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        raise ViewError(
            f"checkpoint {checkpoint}: no config.json, so not a Hugging Face checkpoint "
            "(is the download complete?)"
        )
    for name in [params["variant"], params["sha"]]:
        if name and (os.sep in name or name.startswith(".")):
            raise ViewError(f"{name!r}: not a plain directory name (no '/', no leading '.')")
    manifest = manifest_doc(params["manifest"])
    sha = params["sha"] or str(manifest.get("sha") or "local")
    view = os.path.join(params["root"], sha, params["variant"])
    with RootLock(params["root"], params["lock_timeout"], check_mode):
        for path in (params["root"], os.path.dirname(view), view):
            own_dir(path, make=False)
        wanted = wanted_view(params, view, manifest)
        created = not os.path.isdir(view)
        if created:
            changes = Changes(added=sorted(set(wanted.links) | set(wanted.real)))
        else:
            changes = compare(view, wanted, strict_real=bool(params["sources"]))
        if changes.any() and not check_mode:
            apply(params, view, sha, wanted, changes)
    return {
        "changed": changes.any(),
        "path": view,
        "sha": sha,
        "checkpoint": checkpoint,
        "created": created,
        "links": len(wanted.links),
        "added": changes.added,
        "replaced": changes.replaced,
        "removed": changes.removed,
        "files": real_digests(view, wanted),
        "diff": {
            "before_header": view,
            "after_header": view,
            "before": "".join(f"{r}\n" for r in changes.removed + changes.replaced),
            "after": "".join(f"{r}\n" for r in changes.added + changes.replaced),
        },
    }


# --- collection ---------------------------------------------------------------------


def release_views(releases_dir: str) -> list[str]:
    views = set()
    for path in glob.glob(os.path.join(releases_dir, "*", "release.json")):
        try:
            with open(path, encoding="utf-8") as handle:
                view = (json.load(handle).get("view") or {}).get("path")
        except (OSError, ValueError, AttributeError) as exc:
            raise ViewError(f"{path}: unreadable release record: {exc}") from None
        if view:
            views.add(os.path.normpath(view))
    return sorted(views)


def all_references(root: str, own_host: str, own: list[str]) -> set[str]:
    refs = set(own)
    for path in glob.glob(os.path.join(root, REFS_DIR, "*.json")):
        if os.path.basename(path) == f"{own_host}.json":
            continue
        try:
            with open(path, encoding="utf-8") as handle:
                refs.update(os.path.normpath(p) for p in json.load(handle).get("views", []))
        except (OSError, ValueError, AttributeError) as exc:
            raise ViewError(
                f"{path}: unreadable view references: {exc}; nothing was collected"
            ) from None
    return refs


def view_dirs(root: str) -> tuple[list[str], list[str]]:
    """The real view directories under ``root``, and the symlinks found where a sha or
    view directory belongs (never followed: the toolkit makes none there)."""
    found: list[str] = []
    links: list[str] = []
    for sha_dir in sorted(glob.glob(os.path.join(root, "*"))):
        if os.path.islink(sha_dir):
            links.append(os.path.normpath(sha_dir))
        elif os.path.isdir(sha_dir) and not os.path.basename(sha_dir).startswith("."):
            for view in sorted(glob.glob(os.path.join(sha_dir, "*"))):
                if os.path.islink(view) and os.path.isdir(view):
                    links.append(os.path.normpath(view))
                elif os.path.isdir(view) and not os.path.islink(view):
                    found.append(os.path.normpath(view))
    return found, links


def remove_view(view: str) -> None:
    """Remove a real view directory: its links are unlinked, never followed (rmtree
    works through directory file descriptors and refuses a symlink given to it)."""
    if stat.S_ISLNK(os.lstat(view).st_mode):
        raise ViewError(f"{view}: became a symlink during collection; not followed")
    shutil.rmtree(view)


def collected(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    for name in ("host", "releases_dir"):
        if not params[name]:
            raise ViewError(f"state=collected needs {name}")
    root = params["root"]
    own = release_views(params["releases_dir"])
    ref_path = os.path.join(root, REFS_DIR, f"{params['host']}.json")
    ref_bytes = (json.dumps({"views": own}, indent=2) + "\n").encode()
    with RootLock(root, params["lock_timeout"], check_mode):
        refs = all_references(root, params["host"], own)
        refs.update(os.path.normpath(p) for p in params["keep"])
        views, skipped = view_dirs(root)
        doomed = [v for v in views if v not in refs]
        try:
            old_refs = read_bytes(ref_path, "references") if os.path.exists(ref_path) else b""
        except ViewError:
            old_refs = b""
        changed = bool(doomed) or old_refs != ref_bytes
        if changed and not check_mode:
            write_file(ref_path, ref_bytes)
            for view in doomed:
                remove_view(view)
                if not os.listdir(os.path.dirname(view)):
                    os.rmdir(os.path.dirname(view))
    return {
        "changed": changed,
        "collected": doomed,
        "skipped": skipped,
        "referenced": sorted(refs),
    }


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "state": {"type": "str", "choices": ["present", "collected"], "default": "present"},
            "root": {"type": "path", "required": True},
            "checkpoint": {"type": "path"},
            "sha": {"type": "str", "default": ""},
            "variant": {"type": "str"},
            "materialize": {
                "type": "list",
                "elements": "str",
                "default": ["config.json", "hf_quant_config.json"],
            },
            "sources": {"type": "dict", "default": {}},
            "manifest": {"type": "path"},
            "lock_timeout": {"type": "int", "default": 600},
            "host": {"type": "str"},
            "releases_dir": {"type": "path"},
            "keep": {"type": "list", "elements": "path", "default": []},
        },
        supports_check_mode=True,
    )
    params = dict(module.params)
    params["root"] = os.path.abspath(params["root"])
    if params["checkpoint"]:
        params["checkpoint"] = os.path.abspath(params["checkpoint"])
    try:
        if params["state"] == "present":
            result = present(params, module.check_mode)
        else:
            result = collected(params, module.check_mode)
    except ViewError as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:
        module.fail_json(msg=f"{exc.filename or params['root']}: {exc.strerror}")
    if not module._diff:
        result.pop("diff", None)
    for link in result.get("skipped", []):
        module.warn(f"{link}: a symlink under the views tree, not made by the toolkit: skipped")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
