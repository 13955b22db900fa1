# Copyright: vllm-fleet contributors
# Apache-2.0
"""Where a Hugging Face checkpoint declares KV-cache quantization, and how to
remove those declarations from a JSON file without touching anything else.

Shared by the ``hf_quant_config`` module (and any preflight code that needs to
know what a checkpoint declares). Pure functions on text: no I/O here.

The locations come from vLLM's own readers (checked against its source):

* ``vllm/transformers_utils/config.py``: ``config.json``'s
  ``quantization_config`` is the quant config; only when it is missing does
  vLLM load ``hf_quant_config.json`` (ModelOpt <= 0.29) in its place.
  ``vllm/config/model.py`` falls back to ``compression_config``
  (compressed-tensors) when there is no ``quantization_config``.
* ``vllm/utils/torch_utils.py`` ``get_kv_cache_quant_algo_string`` (what
  ``--kv-cache-dtype auto`` resolves to): ``quantization.kv_cache_scheme``,
  ``kv_cache_scheme``, ``quantization.kv_cache_quant_algo``,
  ``kv_cache_quant_algo`` of that quant config.
* ``model_executor/layers/quantization/modelopt.py`` ``from_config``:
  ``quantization.kv_cache_quant_algo`` (hf_quant_config.json shape) or
  ``kv_cache_scheme`` (config.json shape).
* compressed-tensors: ``kv_cache_scheme`` of the quantization config.
* Multimodal wrappers (``KimiK25ForConditionalGeneration``) nest the language
  model's config under ``text_config``, which may carry its own copy.

Quark checkpoints declare a quantized KV cache differently
(``export.kv_cache_group`` plus ``layer_quant_config`` entries); that is
reported by :func:`quark_kv_cache_groups` but not patched here.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

# Quant-config sections of config.json, as JSON paths (tuples of keys).
CONFIG_QUANT_SECTIONS: tuple[tuple[str, ...], ...] = (
    ("quantization_config",),
    ("compression_config",),
    ("text_config", "quantization_config"),
    ("text_config", "compression_config"),
)
# Inside a quant config (or hf_quant_config.json as a whole): the keys that
# declare KV-cache quantization, top level or under "quantization".
DECLARATION_SUFFIXES: tuple[tuple[str, ...], ...] = (
    ("kv_cache_scheme",),
    ("kv_cache_quant_algo",),
    ("quantization", "kv_cache_scheme"),
    ("quantization", "kv_cache_quant_algo"),
)
CONFIG_FILE = "config.json"
HF_QUANT_FILE = "hf_quant_config.json"
# The files this module knows, in the order they are read and written.
KNOWN_FILES: tuple[str, ...] = (CONFIG_FILE, HF_QUANT_FILE)


def declaration_paths(filename: str) -> list[tuple[str, ...]]:
    """Every JSON path in *filename* that can declare KV-cache quantization."""
    if filename == HF_QUANT_FILE:
        return list(DECLARATION_SUFFIXES)
    if filename == CONFIG_FILE:
        return [sec + suf for sec in CONFIG_QUANT_SECTIONS for suf in DECLARATION_SUFFIXES]
    return []


def quant_section_paths(filename: str) -> list[tuple[str, ...]]:
    """The quant-config sections of *filename* (the whole file for the sidecar)."""
    if filename == HF_QUANT_FILE:
        return [()]
    if filename == CONFIG_FILE:
        return list(CONFIG_QUANT_SECTIONS)
    return []


def json_pointer(path: tuple[str, ...]) -> str:
    """RFC 6901 pointer for a path of object keys."""
    return "".join("/" + k.replace("~", "~0").replace("/", "~1") for k in path)


def get_path(doc: Any, path: tuple[str, ...]) -> tuple[bool, Any]:
    """(found, value) of *path* in *doc*, following objects only."""
    node = doc
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def find_declarations(filename: str, doc: Any) -> dict[tuple[str, ...], Any]:
    """JSON path -> value of each KV-cache declaration in *doc*.

    A key whose value is null (or empty) declares nothing (vLLM reads these
    keys with ``or``) and is not reported, so it is never removed either.
    """
    found: dict[tuple[str, ...], Any] = {}
    for path in declaration_paths(filename):
        present, value = get_path(doc, path)
        if present and value not in (None, "", {}, []):
            found[path] = value
    return found


def has_quant_section(filename: str, doc: Any) -> bool:
    """Whether *doc* carries any quantization config at all."""
    for path in quant_section_paths(filename):
        present, value = get_path(doc, path)
        if present and isinstance(value, dict):
            return True
    return False


def quark_kv_cache_groups(doc: Any) -> list[str]:
    """Quark's KV-cache groups of a config.json (declared but not patched here)."""
    groups: list[str] = []
    for section in CONFIG_QUANT_SECTIONS:
        present, value = get_path(doc, (*section, "export", "kv_cache_group"))
        if present and isinstance(value, list):
            groups.extend(str(v) for v in value)
    return groups


def without_paths(doc: Any, paths: list[tuple[str, ...]]) -> Any:
    """A deep copy of *doc* with the members at *paths* removed."""
    result = json.loads(json.dumps(doc))
    for path in paths:
        parent_found, parent = get_path(result, path[:-1])
        if parent_found and isinstance(parent, dict):
            parent.pop(path[-1], None)
    return result


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# Pristine copies and their manifest live beside the checkpoint, never in it.
MANIFEST = "manifest.json"


def default_backup_dir(model_dir: str) -> str:
    parent, name = os.path.split(model_dir.rstrip(os.sep))
    return os.path.join(parent, ".vllm-fleet", name, "pristine")


def read_own_bytes(model_dir: str, name: str, backup_dir: str | None = None) -> bytes | None:
    """The checkpoint's own bytes of one config file, as published.

    The checkpoint is never patched any more (views carry the patch), but a
    site upgraded from the in-place patch of earlier versions still has one
    on its first run, read by preflight before role quant_config restores it:
    where the file on disk is exactly what that patch wrote, answer with the
    pristine copy, so the plan sees the checkpoint's own declarations. On any
    other checkpoint this is the file's bytes. None when the file does not exist.
    """
    try:
        with open(os.path.join(model_dir, name), "rb") as handle:
            raw = handle.read()
    except FileNotFoundError:
        return None
    backup_dir = backup_dir or default_backup_dir(model_dir)
    try:
        with open(os.path.join(backup_dir, MANIFEST), encoding="utf-8") as handle:
            entry = (json.load(handle).get("files") or {}).get(name) or {}
        if entry.get("patched_sha256") != sha256_bytes(raw) or not entry.get("pristine"):
            return raw
        with open(os.path.join(backup_dir, entry["pristine"]), "rb") as handle:
            pristine = handle.read()
    except (OSError, ValueError, AttributeError):
        return raw
    return pristine if sha256_bytes(pristine) == entry.get("sha256") else raw


# A view marks itself with this file: which checkpoint it mirrors, so that
# hf_quant_config can restore a view's config from the checkpoint's bytes.
VIEW_MARKER = ".vllm-fleet-view.json"


def read_view_marker(model_dir: str) -> dict[str, Any] | None:
    """The marker of a view directory, or None when *model_dir* is not a view."""
    path = os.path.join(model_dir, VIEW_MARKER)
    try:
        with open(path, encoding="utf-8") as handle:
            marker = json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise JsonFileError(f"{path}: unreadable view marker: {exc}") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("checkpoint"), str):
        raise JsonFileError(f"{path}: view marker names no checkpoint")
    return marker


def git_blob_sha1(data: bytes) -> str:
    """The hub's digest (oid) of a file kept in git, not LFS."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


class JsonFileError(ValueError):
    """A config file that cannot be used; the message names the problem."""


def parse_json_text(text: str, label: str) -> dict[str, Any]:
    """Parse *text* as a JSON object, or raise JsonFileError naming *label*."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonFileError(
            f"{label}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    if not isinstance(doc, dict):
        raise JsonFileError(
            f"{label}: top-level JSON value is {type(doc).__name__}, expected an object"
        )
    return doc


# --- Text-preserving edits -------------------------------------------------
# Removing a member by re-serialising the document would re-flow numbers
# (1e-06 vs 1e-6), escapes and indentation. Instead, find the member's exact
# character span and cut it out: every other byte of the file stays as it was.

_WS = " \t\n\r"
_DECODER = json.JSONDecoder()


@dataclass
class Member:
    """One ``"key": value`` of an object, with character offsets."""

    key: str
    key_start: int
    value_start: int
    value_end: int
    obj: JsonObject | None = None


@dataclass
class JsonObject:
    """An object's span and members (values that are objects are parsed too)."""

    start: int
    end: int
    members: list[Member] = field(default_factory=list)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _parse_value(text: str, pos: int) -> tuple[int, JsonObject | None]:
    """End offset of the value at *pos*, and its structure if it is an object."""
    if text[pos] == "{":
        obj = _parse_object(text, pos)
        return obj.end, obj
    _, end = _DECODER.raw_decode(text, pos)
    return end, None


def _parse_object(text: str, pos: int) -> JsonObject:
    obj = JsonObject(start=pos, end=pos)
    pos = _skip_ws(text, pos + 1)
    if text[pos] == "}":
        obj.end = pos + 1
        return obj
    while True:
        key_start = pos
        key, pos = json.decoder.scanstring(text, pos + 1)
        pos = _skip_ws(text, pos)
        pos = _skip_ws(text, pos + 1)  # past ':'
        value_end, child = _parse_value(text, pos)
        obj.members.append(Member(key, key_start, pos, value_end, child))
        pos = _skip_ws(text, value_end)
        if text[pos] == "}":
            obj.end = pos + 1
            return obj
        pos = _skip_ws(text, pos + 1)  # past ','


def parse_spans(text: str) -> JsonObject:
    """Spans of a text already known to be a valid JSON object."""
    return _parse_object(text, _skip_ws(text, 0))


def _find_object(root: JsonObject, path: tuple[str, ...]) -> JsonObject | None:
    node: JsonObject | None = root
    for key in path:
        if node is None:
            return None
        match = [m for m in node.members if m.key == key and m.obj is not None]
        node = match[-1].obj if match else None
    return node


def _cut_member(text: str, obj: JsonObject, index: int) -> str:
    """Remove member *index* of *obj* and one separating comma."""
    members = obj.members
    member = members[index]
    if len(members) == 1:
        # Only member: the object becomes {} (as json.dumps writes it).
        return text[: obj.start + 1] + text[obj.end - 1 :]
    if index < len(members) - 1:
        # Cut from this key up to the next key: the whitespace before this
        # key now precedes the next one, so the layout is unchanged.
        return text[: member.key_start] + text[members[index + 1].key_start :]
    # Last member: cut from the end of the previous value through this one,
    # keeping the whitespace before the closing brace.
    return text[: members[index - 1].value_end] + text[member.value_end :]


def remove_paths_text(text: str, paths: list[tuple[str, ...]]) -> str:
    """*text* with the members at *paths* removed, all other bytes kept."""
    for path in paths:
        while True:
            obj = _find_object(parse_spans(text), path[:-1])
            if obj is None:
                break
            index = next((i for i, m in enumerate(obj.members) if m.key == path[-1]), None)
            if index is None:
                break
            text = _cut_member(text, obj, index)
    return text
