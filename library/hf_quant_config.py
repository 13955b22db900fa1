#!/usr/bin/python
# Copyright: vllm-fleet contributors
# Apache-2.0
"""Ansible module: remove or restore a checkpoint's KV-cache quantization declarations."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: hf_quant_config
short_description: Remove or restore the KV-cache quantization a Hugging Face checkpoint declares
description:
  - Ensures that no config file of a Hugging Face checkpoint directory declares
    KV-cache quantization (O(kv_cache_quant=absent)), or restores the checkpoint's
    own declarations exactly as they were before the first change
    (O(kv_cache_quant=original)).
  - Needed when the checkpoint declares an FP8 KV cache that the serving
    hardware cannot run, for example ModelOpt NVFP4 checkpoints with MLA
    attention on vLLM releases whose only MLA backend on the GPU has no FP8 KV
    support. C(--kv-cache-dtype auto) takes the dtype from these declarations,
    so they have to go from the files themselves.
  - "Locations handled, from vLLM's readers
    (C(vllm/transformers_utils/config.py), C(vllm/config/model.py),
    C(get_kv_cache_quant_algo_string) in C(vllm/utils/torch_utils.py),
    C(ModelOptQuantConfigBase.from_config) in
    C(model_executor/layers/quantization/modelopt.py), compressed-tensors):"
  - "C(hf_quant_config.json): C(/quantization/kv_cache_quant_algo),
    C(/quantization/kv_cache_scheme), C(/kv_cache_quant_algo),
    C(/kv_cache_scheme)."
  - "C(config.json): the same four under each of C(/quantization_config),
    C(/compression_config), C(/text_config/quantization_config) and
    C(/text_config/compression_config) (multimodal wrappers such as
    C(KimiK25ForConditionalGeneration) nest the text model's config)."
  - A key whose value is null or empty declares nothing (vLLM reads these keys
    with C(or)) and is left alone.
  - Quark checkpoints declare a quantized KV cache through
    C(export.kv_cache_group); the module reports that with a warning and does
    not change it.
  - Only the declaring members are cut out of the file text; every other byte
    (key order, indentation, number formatting, escapes, trailing newline)
    stays as it was. All files are read and validated before any is written;
    each write is a temporary file plus an atomic rename.
  - >-
    On a view (a directory built by C(checkpoint_view), marked by its
    C(.vllm-fleet-view.json)), the checkpoint the view mirrors is the pristine
    copy: nothing is backed up and O(kv_cache_quant=original) copies the
    checkpoint's bytes back. A config file that is still a symlink (into the
    shared checkpoint) is never written through: the module fails instead.
  - On a plain directory (a checkpoint patched in place by an earlier version
    of this toolkit), before a file is first changed, a pristine copy goes to
    O(backup_dir). Copies are named by content hash and never overwritten, so a
    later run (or a re-downloaded, newer revision) cannot replace the copy that
    O(kv_cache_quant=original) restores from.
version_added: "0.1.0"
author:
  - vllm-fleet contributors
options:
  model_dir:
    description:
      - >-
        The directory vLLM loads (holding C(config.json)): a view of the
        checkpoint, or a plain checkpoint directory.
    type: path
    required: true
  kv_cache_quant:
    description:
      - V(absent) removes every KV-cache quantization declaration.
      - V(original) restores the files changed by this module, byte for byte,
        from their pristine copies. A file that changed since it was patched
        is not overwritten (the module fails instead); a file that again
        carries its own declaration (for example a fresh download) is left
        as it is.
      - On a checkpoint this module never patched (no record in the manifest)
        V(original) changes nothing; if no file declares KV-cache quantization
        it warns that a hand edit cannot be undone from here.
    type: str
    choices: [absent, original]
    default: absent
  backup:
    description:
      - Keep a pristine copy of each file before its first modification.
      - Without it, V(original) cannot restore the declarations later and
        fails for the files patched this way. The patch is recorded in the
        manifest either way, so that this failure is loud, not silent.
    type: bool
    default: true
  backup_dir:
    description:
      - Where pristine copies and their manifest (C(manifest.json)) live.
      - Defaults to C(<parent of model_dir>/.vllm-fleet/<name of model_dir>/pristine),
        beside the checkpoint rather than inside it, because vLLM, the hub
        client and checksum verification read the checkpoint directory and
        must see only the checkpoint's own files. On shared storage this is
        shared too, so every node sees the same pristine copy.
    type: path
notes:
  - Supports check mode (nothing is written, the result says what would
    change) and diff mode (before and after text per changed file).
  - The module changes the files of O(model_dir); restart the server that
    reads them for the change to take effect.
seealso:
  - name: vLLM get_kv_cache_quant_algo_string
    description: How vLLM resolves C(--kv-cache-dtype auto) from the checkpoint.
    link: https://github.com/vllm-project/vllm/blob/main/vllm/utils/torch_utils.py
"""

EXAMPLES = r"""
- name: Remove the FP8 KV-cache declarations from a view's own config copies
  hf_quant_config:
    model_dir: /shared/models/.vllm-fleet/kimi-k2.5-nvfp4/views/0123abcd/absent
    kv_cache_quant: absent

- name: Remove the FP8 KV-cache declarations of the deployed checkpoint
  hf_quant_config:
    model_dir: /shared/models/kimi-k2.5-nvfp4
    kv_cache_quant: absent
  register: quant_patch

- name: Restore the checkpoint's own declarations (GPU now supports FP8 KV)
  hf_quant_config:
    model_dir: /shared/models/kimi-k2.5-nvfp4
    kv_cache_quant: original

- name: Report what the checkpoint declares, changing nothing
  hf_quant_config:
    model_dir: /shared/models/kimi-k2.5-nvfp4
  check_mode: true
  register: quant_declared

- name: Keep the pristine copies somewhere else
  hf_quant_config:
    model_dir: /shared/models/kimi-k2.5-nvfp4
    backup_dir: /var/lib/vllm-fleet/pristine/kimi-k2.5-nvfp4
"""

RETURN = r"""
changed:
  description: Whether any file was (or, in check mode, would be) changed.
  returned: always
  type: bool
  sample: true
model_dir:
  description: The checkpoint directory, absolute.
  returned: always
  type: str
  sample: /shared/models/kimi-k2.5-nvfp4
kv_cache_quant:
  description: The requested state.
  returned: always
  type: str
  sample: absent
declared:
  description: Whether any file declared KV-cache quantization before this run.
  returned: always
  type: bool
  sample: true
declarations:
  description: >-
    The KV-cache declarations found before the change, per file name, as JSON
    pointer to value.
  returned: always
  type: dict
  sample:
    config.json:
      /quantization_config/kv_cache_scheme: {num_bits: 8, type: float, dynamic: false}
    hf_quant_config.json:
      /quantization/kv_cache_quant_algo: FP8
removed:
  description: Per file name, the JSON pointers removed (or that would be removed).
  returned: always
  type: dict
  sample:
    config.json: [/quantization_config/kv_cache_scheme]
    hf_quant_config.json: [/quantization/kv_cache_quant_algo]
restored:
  description: File names restored (or that would be restored) from their pristine copies.
  returned: always
  type: list
  elements: str
  sample: [config.json, hf_quant_config.json]
files:
  description: Per file name, its path and SHA-256 before and after.
  returned: always
  type: dict
  sample:
    config.json:
      path: /shared/models/kimi-k2.5-nvfp4/config.json
      sha256_before: 3f7a...
      sha256_after: 9c1e...
      changed: true
view_of:
  description: The checkpoint O(model_dir) is a view of; empty when it is a plain directory.
  returned: always
  type: str
  sample: /shared/models/kimi-k2.5-nvfp4
backup_dir:
  description: Where pristine copies and the manifest live (empty on a view).
  returned: always
  type: str
  sample: /shared/models/.vllm-fleet/kimi-k2.5-nvfp4/pristine
backup_files:
  description: >-
    Per file name, the path of its pristine copy (existing or created by
    this run). Empty when O(backup=false) and nothing was backed up before.
  returned: always
  type: dict
  sample:
    config.json: /shared/models/.vllm-fleet/kimi-k2.5-nvfp4/pristine/config.json.3f7a0c2d9e1b4a55
backup_files_created:
  description: Pristine copies written by this run.
  returned: always
  type: list
  elements: str
  sample: [/shared/models/.vllm-fleet/kimi-k2.5-nvfp4/pristine/config.json.3f7a0c2d9e1b4a55]
"""

import json
import os
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.hf_quant import (
    CONFIG_FILE,
    KNOWN_FILES,
    MANIFEST,
    JsonFileError,
    default_backup_dir,
    find_declarations,
    has_quant_section,
    json_pointer,
    parse_json_text,
    quark_kv_cache_groups,
    read_view_marker,
    remove_paths_text,
    sha256_bytes,
    without_paths,
)


class PatchError(Exception):
    """A problem that stops the run before anything is written."""


@dataclass
class ConfigFile:
    """One config file of the checkpoint, as read."""

    name: str
    path: str
    raw: bytes
    text: str
    doc: dict[str, Any]
    declarations: dict[tuple[str, ...], Any]
    new_raw: bytes | None = None
    removed: list[str] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        return sha256_bytes(self.raw)


# --- Reading -----------------------------------------------------------------


def read_config_file(model_dir: str, name: str) -> ConfigFile:
    path = os.path.join(model_dir, name)
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise PatchError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PatchError(f"{path}: not UTF-8 at byte {exc.start}") from None
    try:
        doc = parse_json_text(text, path)
    except JsonFileError as exc:
        raise PatchError(str(exc)) from None
    return ConfigFile(name, path, raw, text, doc, find_declarations(name, doc))


def read_checkpoint(model_dir: str) -> list[ConfigFile]:
    """Every known config file of *model_dir*, all parsed before any write."""
    if not os.path.exists(model_dir):
        raise PatchError(f"model_dir {model_dir}: does not exist")
    if not os.path.isdir(model_dir):
        raise PatchError(f"model_dir {model_dir}: is not a directory")
    if not os.path.isfile(os.path.join(model_dir, CONFIG_FILE)):
        raise PatchError(
            f"model_dir {model_dir}: no {CONFIG_FILE}, so not a Hugging Face checkpoint"
            " (is the download complete, and is this the snapshot directory?)"
        )
    names = [n for n in KNOWN_FILES if os.path.isfile(os.path.join(model_dir, n))]
    return [read_config_file(model_dir, n) for n in names]


def read_manifest(backup_dir: str) -> dict[str, Any]:
    path = os.path.join(backup_dir, MANIFEST)
    if not os.path.exists(path):
        return {"version": 1, "files": {}}
    try:
        with open(path, encoding="utf-8") as handle:
            manifest = parse_json_text(handle.read(), path)
    except (OSError, UnicodeDecodeError, JsonFileError) as exc:
        raise PatchError(f"{path}: unreadable backup manifest: {exc}") from None
    if not isinstance(manifest.get("files"), dict):
        raise PatchError(f"{path}: backup manifest has no 'files' object")
    return manifest


# --- Planning (no writes) ----------------------------------------------------


@dataclass
class Plan:
    """What a run will write."""

    files: list[ConfigFile]
    manifest: dict[str, Any]
    backup_dir: str
    view_of: str = ""
    backups: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # name -> (path, bytes)
    restored: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def writes(self) -> list[ConfigFile]:
        return [f for f in self.files if f.new_raw is not None and f.new_raw != f.raw]


def backup_name(cfg: ConfigFile) -> str:
    return f"{cfg.name}.{cfg.sha256[:16]}"


def plan_absent(plan: Plan, backup: bool) -> None:
    for cfg in plan.files:
        if not cfg.declarations:
            continue
        paths = list(cfg.declarations)
        new_text = remove_paths_text(cfg.text, paths)
        check = parse_json_text(new_text, f"{cfg.path} (patched)")
        if check != without_paths(cfg.doc, paths) or find_declarations(cfg.name, check):
            raise PatchError(f"{cfg.path}: internal error: patched text does not match")
        cfg.new_raw = new_text.encode("utf-8")
        cfg.removed = [json_pointer(p) for p in paths]
        if backup:
            entry = plan.manifest["files"].get(cfg.name) or {}
            target = os.path.join(plan.backup_dir, backup_name(cfg))
            if entry.get("pristine") != os.path.basename(target) or not os.path.isfile(target):
                plan.backups[cfg.name] = (target, cfg.raw)


def read_pristine(backup_dir: str, name: str, entry: dict[str, Any]) -> bytes:
    path = os.path.join(backup_dir, str(entry.get("pristine", "")))
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise PatchError(f"{name}: pristine copy {path}: cannot read: {exc.strerror}") from None
    if sha256_bytes(data) != entry.get("sha256"):
        raise PatchError(f"{name}: pristine copy {path} does not match its recorded SHA-256")
    return data


def plan_view_original(plan: Plan) -> None:
    """On a view, the checkpoint's own bytes are the original: copy them back."""
    for cfg in plan.files:
        source = os.path.join(plan.view_of, cfg.name)
        try:
            with open(source, "rb") as handle:
                data = handle.read()
        except OSError as exc:
            raise PatchError(
                f"{cfg.path}: the checkpoint's copy {source} cannot be read: {exc.strerror}"
            ) from None
        if data != cfg.raw:
            cfg.new_raw = data
            plan.restored.append(cfg.name)


def plan_original(plan: Plan) -> None:
    entries = plan.manifest["files"]
    for cfg in plan.files:
        entry = entries.get(cfg.name)
        if entry is None or cfg.sha256 == entry.get("sha256"):
            continue
        if cfg.sha256 == entry.get("patched_sha256"):
            if not entry.get("pristine"):
                raise PatchError(
                    f"{cfg.path}: was patched with backup=false, so there is no pristine copy "
                    f"in {plan.backup_dir} to restore from; re-download the file"
                )
            cfg.new_raw = read_pristine(plan.backup_dir, cfg.name, entry)
            plan.restored.append(cfg.name)
        elif cfg.declarations:
            plan.warnings.append(
                f"{cfg.path}: differs from both its pristine copy and the patched version but "
                "declares its own KV-cache quantization (a newer download?); left as it is"
            )
        else:
            raise PatchError(
                f"{cfg.path}: changed since it was patched (SHA-256 {cfg.sha256[:16]}); "
                "not overwriting it with the pristine copy. Re-download the file or restore "
                f"it by hand from {plan.backup_dir}"
            )
    # No record: this module never patched the checkpoint (it records every
    # patch, even without a backup), so it is as shipped. Only a hand edit
    # could have removed declarations; say so rather than fail a fresh deploy
    # of a checkpoint that simply has no quantized KV cache.
    quantized = any(has_quant_section(c.name, c.doc) for c in plan.files)
    if not entries and quantized and not any(c.declarations for c in plan.files):
        plan.warnings.append(
            f"no record of a patch in {plan.backup_dir}: the checkpoint declares no KV-cache "
            "quantization; if its files were edited by hand, restore them by re-downloading"
        )


# --- Writing -----------------------------------------------------------------


def check_writable(plan: Plan) -> None:
    """Fail before writing anything if a write would fail."""
    for cfg in plan.writes:
        if os.path.islink(cfg.path):
            # A view links every file to the shared checkpoint: writing here
            # would patch the checkpoint under every node that serves it.
            raise PatchError(
                f"{cfg.path}: is a symlink (to {os.path.realpath(cfg.path)}); refusing to "
                "write through it. Build the view with a real copy of this file "
                "(checkpoint_view materialize) and patch that"
            )
        if not os.access(cfg.path, os.W_OK):
            raise PatchError(f"{cfg.path}: not writable by this user (uid {os.getuid()})")
        if not os.access(os.path.dirname(cfg.path), os.W_OK | os.X_OK):
            raise PatchError(
                f"{cfg.path}: its directory is not writable (needed for the atomic rename)"
            )
    if not plan.view_of and any(c.removed for c in plan.writes):  # the manifest is written too
        existing = plan.backup_dir
        while not os.path.isdir(existing):
            existing = os.path.dirname(existing)
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PatchError(
                f"backup_dir {plan.backup_dir}: cannot be written ({existing} is not writable); "
                "set backup_dir to a writable place or run with more privileges"
            )


def write_atomic(module: AnsibleModule, path: str, data: bytes) -> None:
    """Write *data* to *path* through a temporary file in the same directory."""
    fd, tmp = tempfile.mkstemp(prefix=".hf_quant_config.", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        module.atomic_move(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_manifest(module: AnsibleModule, plan: Plan) -> None:
    text = json.dumps(plan.manifest, indent=2, sort_keys=True) + "\n"
    write_atomic(module, os.path.join(plan.backup_dir, MANIFEST), text.encode("utf-8"))


def record_patch(module: AnsibleModule, plan: Plan) -> list[str]:
    """Write pristine copies and the manifest before any checkpoint file.

    The manifest records every patch, with or without a copy, and the hash of
    the patched file, so that `original` can tell "our patch" from "edited
    since" and fails loudly when no copy was kept.
    """
    patched = [c for c in plan.writes if c.removed]
    if not patched:
        return []
    os.makedirs(plan.backup_dir, mode=0o755, exist_ok=True)
    entries = plan.manifest["files"]
    # timezone.utc, not datetime.UTC (3.11+): nodes may run Python 3.10 (Ubuntu 22.04).
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")  # noqa: UP017
    created = []
    for cfg in patched:
        if cfg.name in plan.backups:
            target, data = plan.backups[cfg.name]
            if not os.path.isfile(target):
                write_atomic(module, target, data)
                created.append(target)
            entries[cfg.name] = {"pristine": os.path.basename(target), "backed_up_at": now}
        elif (entries.get(cfg.name) or {}).get("sha256") != cfg.sha256:
            entries[cfg.name] = {"pristine": None, "backed_up_at": None}
        entries[cfg.name]["sha256"] = cfg.sha256
        entries[cfg.name]["patched_sha256"] = sha256_bytes(cfg.new_raw or b"")
    plan.manifest["model_dir"] = os.path.dirname(plan.files[0].path)
    save_manifest(module, plan)
    return created


def apply(module: AnsibleModule, plan: Plan) -> list[str]:
    """Record the patch, then write the files; undo earlier files if a later one fails."""
    created = [] if plan.view_of else record_patch(module, plan)
    done: list[ConfigFile] = []
    for cfg in plan.writes:
        try:
            write_atomic(module, cfg.path, cfg.new_raw or b"")
        except OSError as exc:
            for written in done:
                write_atomic(module, written.path, written.raw)
            raise PatchError(f"{cfg.path}: write failed, nothing changed: {exc}") from None
        done.append(cfg)
    return created


# --- Result ------------------------------------------------------------------


def build_result(plan: Plan, state: str, created: list[str]) -> dict[str, Any]:
    entries = plan.manifest["files"]
    backup_files = {
        name: os.path.join(plan.backup_dir, entry["pristine"])
        for name, entry in entries.items()
        if isinstance(entry, dict) and entry.get("pristine")
    }
    for name, (target, _) in plan.backups.items():
        backup_files[name] = target
    files = {}
    for cfg in plan.files:
        after = cfg.new_raw if cfg.new_raw is not None else cfg.raw
        files[cfg.name] = {
            "path": cfg.path,
            "sha256_before": cfg.sha256,
            "sha256_after": sha256_bytes(after),
            "changed": after != cfg.raw,
        }
    return {
        "changed": bool(plan.writes),
        "model_dir": os.path.dirname(plan.files[0].path),
        "kv_cache_quant": state,
        "declared": any(c.declarations for c in plan.files),
        "declarations": {
            c.name: {json_pointer(p): v for p, v in c.declarations.items()}
            for c in plan.files
            if c.declarations
        },
        "removed": {c.name: c.removed for c in plan.files if c.removed},
        "restored": plan.restored,
        "files": files,
        "view_of": plan.view_of,
        "backup_dir": plan.backup_dir,
        "backup_files": backup_files,
        "backup_files_created": created,
    }


def build_diff(plan: Plan) -> list[dict[str, str]]:
    return [
        {
            "before_header": cfg.path,
            "after_header": cfg.path,
            "before": cfg.text,
            "after": (cfg.new_raw or b"").decode("utf-8"),
        }
        for cfg in plan.writes
    ]


def run(module: AnsibleModule) -> dict[str, Any]:
    params = module.params
    model_dir = os.path.abspath(params["model_dir"])
    state = params["kv_cache_quant"]
    files = read_checkpoint(model_dir)
    try:
        marker = read_view_marker(model_dir)
    except JsonFileError as exc:
        raise PatchError(str(exc)) from None
    if marker:
        # The checkpoint is the pristine copy of a view: no backups, no record.
        plan = Plan(
            files=files, manifest={"files": {}}, backup_dir="", view_of=marker["checkpoint"]
        )
    else:
        backup_dir = os.path.abspath(params["backup_dir"] or default_backup_dir(model_dir))
        plan = Plan(files=files, manifest=read_manifest(backup_dir), backup_dir=backup_dir)
    for cfg in files:
        groups = quark_kv_cache_groups(cfg.doc) if cfg.name == CONFIG_FILE else []
        if groups:
            plan.warnings.append(
                f"{cfg.path}: Quark export.kv_cache_group {groups} declares a quantized KV "
                "cache; this module does not change Quark configs"
            )
    if state == "absent":
        plan_absent(plan, params["backup"] and not plan.view_of)
    elif plan.view_of:
        plan_view_original(plan)
    else:
        plan_original(plan)
    check_writable(plan)
    created: list[str] = []
    if plan.writes and not module.check_mode:
        created = apply(module, plan)
    for warning in plan.warnings:
        module.warn(warning)
    result = build_result(plan, state, created)
    if module._diff and plan.writes:
        result["diff"] = build_diff(plan)
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "model_dir": {"type": "path", "required": True},
            "kv_cache_quant": {
                "type": "str",
                "choices": ["absent", "original"],
                "default": "absent",
            },
            "backup": {"type": "bool", "default": True},
            "backup_dir": {"type": "path"},
        },
        supports_check_mode=True,
    )
    try:
        result = run(module)
    except PatchError as exc:
        module.fail_json(msg=str(exc))
    except OSError as exc:
        module.fail_json(msg=f"{exc.filename or module.params['model_dir']}: {exc.strerror}")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
