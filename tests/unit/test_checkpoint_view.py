"""Unit tests of library/checkpoint_view.py with hf_quant_config on the view.

Real files: a Kimi-K2.5-NVFP4-shaped checkpoint, a download manifest with the
hub's digests of its config files, the view built beside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support.ansible_module import (  # noqa: F401 (patch_ansible_module: autouse fixture)
    fail_module,
    load_module,
    patch_ansible_module,
    run_module,
)
from tests.support.kimi_checkpoint import write_kimi_checkpoint

checkpoint_view = load_module("checkpoint_view")
hf_quant_config = load_module("hf_quant_config")

CONFIGS = ("config.json", "hf_quant_config.json")
SHA = "0123456789abcdef0123456789abcdef01234567"


def blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def tree(directory: Path) -> dict[str, str]:
    """Every file under *directory*, not following links: 'link -> target' or its sha256."""
    found = {}
    for path in sorted(directory.rglob("*")):
        rel = str(path.relative_to(directory))
        if path.is_symlink():
            found[rel] = "link -> " + os.readlink(path)
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture
def storage(tmp_path: Path) -> dict[str, Path]:
    checkpoint = tmp_path / "models" / "kimi"
    write_kimi_checkpoint(checkpoint)
    state = tmp_path / "models" / ".vllm-fleet" / "kimi"
    state.mkdir(parents=True)
    files = {
        str(p.relative_to(checkpoint)): {"oid": blob_oid(p.read_bytes()), "size": p.stat().st_size}
        for p in checkpoint.rglob("*")
        if p.is_file()
    }
    (state / "manifest.json").write_text(json.dumps({"sha": SHA, "files": files}))
    return {"checkpoint": checkpoint, "state": state, "views": state / "views"}


def view_args(storage: dict[str, Path], **extra: Any) -> dict[str, Any]:
    """The module's arguments for the absent view of this storage's checkpoint."""
    return {
        "root": storage["views"],
        "checkpoint": storage["checkpoint"],
        "variant": "absent",
        "manifest": storage["state"] / "manifest.json",
        **extra,
    }


def build(storage: dict[str, Path], check: bool = False, **extra: Any) -> dict[str, Any]:
    return run_module(checkpoint_view, view_args(storage, **extra), check=check, diff=True)


def test_view_links_every_file_and_copies_the_configs(storage: dict[str, Path]) -> None:
    before = tree(storage["checkpoint"])
    result = build(storage)
    view = Path(result["path"])
    assert view == storage["views"] / SHA / "absent"
    assert result["changed"] and result["created"]
    for rel in before:
        entry = view / rel
        if rel in CONFIGS:
            assert entry.is_file() and not entry.is_symlink()
            assert entry.read_bytes() == (storage["checkpoint"] / rel).read_bytes()
        else:
            assert entry.is_symlink() and not os.path.isabs(os.readlink(entry))
            assert entry.resolve() == (storage["checkpoint"] / rel).resolve()
    assert result["links"] == len(before) - len(CONFIGS)
    assert tree(storage["checkpoint"]) == before


def test_patching_the_view_leaves_the_checkpoint_and_reruns_change_nothing(
    storage: dict[str, Path],
) -> None:
    before = tree(storage["checkpoint"])
    view = Path(build(storage)["path"])
    patched = run_module(hf_quant_config, {"model_dir": view, "kv_cache_quant": "absent"})
    assert patched["changed"] and patched["view_of"] == str(storage["checkpoint"])
    assert patched["removed"]["config.json"] == ["/quantization_config/kv_cache_scheme"]
    assert patched["backup_files_created"] == [] and patched["backup_dir"] == ""
    assert (
        "kv_cache_scheme"
        not in json.loads((view / "config.json").read_text())["quantization_config"]
    )
    assert tree(storage["checkpoint"]) == before
    # Idempotent: the view keeps its patched real files, the patch finds nothing to do.
    again = build(storage)
    assert not again["changed"] and not again["created"]
    assert not run_module(hf_quant_config, {"model_dir": view, "kv_cache_quant": "absent"})[
        "changed"
    ]
    assert not (storage["state"] / "pristine").exists()


def test_check_and_diff_on_a_view_write_nothing(storage: dict[str, Path]) -> None:
    assert build(storage, check=True)["changed"]
    assert not (storage["views"] / SHA).exists()
    view = Path(build(storage)["path"])
    built = tree(view)
    result = run_module(
        hf_quant_config, {"model_dir": view, "kv_cache_quant": "absent"}, check=True, diff=True
    )
    assert result["changed"]
    diffs = {d["before_header"]: d for d in result["diff"]}
    assert '"kv_cache_scheme"' in diffs[str(view / "config.json")]["before"]
    assert '"kv_cache_scheme"' not in diffs[str(view / "config.json")]["after"]
    assert tree(view) == built


def test_a_symlinked_config_is_refused_not_patched_through(storage: dict[str, Path]) -> None:
    view = Path(build(storage)["path"])
    shared = storage["checkpoint"] / "config.json"
    before = shared.read_bytes()
    (view / "config.json").unlink()
    (view / "config.json").symlink_to(os.path.relpath(shared, view))
    for check in (False, True):
        msg = fail_module(hf_quant_config, {"model_dir": view}, check=check)
        assert f"{view / 'config.json'}: is a symlink" in msg and "refusing to write" in msg
    assert shared.read_bytes() == before
    # The view builder repairs it: a real copy again, which the patch may change.
    repaired = build(storage)
    assert repaired["replaced"] == ["config.json"] and not (view / "config.json").is_symlink()


def test_original_on_a_view_copies_the_checkpoint_bytes_back(storage: dict[str, Path]) -> None:
    view = Path(build(storage)["path"])
    run_module(hf_quant_config, {"model_dir": view, "kv_cache_quant": "absent"})
    result = run_module(hf_quant_config, {"model_dir": view, "kv_cache_quant": "original"})
    assert sorted(result["restored"]) == sorted(CONFIGS)
    for name in CONFIGS:
        assert (view / name).read_bytes() == (storage["checkpoint"] / name).read_bytes()


def test_a_checkpoint_edited_in_place_gets_no_view(storage: dict[str, Path]) -> None:
    config = storage["checkpoint"] / "config.json"
    config.write_bytes(config.read_bytes().replace(b'"kv_cache_scheme"', b'"kv_cache_schemX"'))
    msg = fail_module(checkpoint_view, view_args(storage))
    assert "differs from the hub's revision" in msg and "config.json (git blob sha1" in msg
    assert not storage["views"].joinpath(SHA).exists()


def test_stale_entries_are_removed_and_sources_must_match(storage: dict[str, Path]) -> None:
    view = Path(build(storage)["path"])
    (view / "gone.safetensors").symlink_to("../nowhere")
    result = build(storage)
    assert result["removed"] == ["gone.safetensors"] and not (view / "gone.safetensors").exists()
    other = storage["state"] / "other.json"
    other.write_text("{}\n")
    msg = fail_module(checkpoint_view, view_args(storage, sources={"config.json": str(other)}))
    assert "is not overwritten" in msg


def test_a_collected_view_is_rebuilt_from_release_copies(storage: dict[str, Path]) -> None:
    view = Path(build(storage)["path"])
    run_module(hf_quant_config, {"model_dir": view, "kv_cache_quant": "absent"})
    saved = storage["state"].parent / "release"
    saved.mkdir()
    for name in CONFIGS:
        (saved / name).write_bytes((view / name).read_bytes())
    built = tree(view)
    shutil.rmtree(view)
    result = build(storage, sources={n: str(saved / n) for n in CONFIGS})
    assert result["created"] and tree(view) == built


def release(releases: Path, release_id: str, view: str | None) -> None:
    (releases / release_id).mkdir(parents=True)
    doc = {"id": release_id, **({"view": {"path": view}} if view else {})}
    (releases / release_id / "release.json").write_text(json.dumps(doc))


def test_collection_keeps_views_any_host_references(
    storage: dict[str, Path], tmp_path: Path
) -> None:
    views = storage["views"]
    kept_a = build(storage, variant="absent")["path"]
    kept_b = build(storage, variant="other")["path"]
    doomed = build(storage, variant="old")["path"]
    wanted = build(storage, variant="new")["path"]
    release(tmp_path / "a", "r1", kept_a)
    release(tmp_path / "b", "r1", kept_b)
    release(tmp_path / "b", "r0", None)

    def collect(host: str, check: bool = False) -> dict[str, Any]:
        args = {
            "state": "collected",
            "root": views,
            "host": host,
            "releases_dir": tmp_path / host,
            "keep": [wanted],
        }
        return run_module(checkpoint_view, args, check=check)

    assert collect("b")["collected"] == sorted([kept_a, doomed])  # a has not recorded yet
    # Check mode says so and removes nothing.
    build(storage, variant="absent")
    dry = collect("a", check=True)
    assert dry["changed"] and dry["collected"] == [] and not (views / ".refs" / "a.json").exists()
    result = collect("a")
    assert result["collected"] == [] and (views / ".refs" / "a.json").exists()
    for path in (kept_a, kept_b, wanted):
        assert Path(path).is_dir()
    assert not Path(doomed).exists()
    assert not collect("a")["changed"]


# --- links planted under the views tree are never followed -------------------------------


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory (with a view-shaped subdirectory) and a file a planted link points at."""
    (tmp_path / "outside" / "victim").mkdir(parents=True)
    (tmp_path / "outside" / "victim" / "precious").write_text("keep me\n")
    (tmp_path / "outside" / "file").write_text("keep me\n")
    return tmp_path / "outside"


def collect_args(storage: dict[str, Path], tmp_path: Path) -> dict[str, Any]:
    return {
        "state": "collected",
        "root": storage["views"],
        "host": "a",
        "releases_dir": tmp_path / "a",
    }


def test_collection_skips_planted_links_naming_them_and_unlinks_its_own(
    storage: dict[str, Path], tmp_path: Path, outside: Path
) -> None:
    views = storage["views"]
    view = Path(build(storage)["path"])  # unreferenced: collected, its own links unlinked
    (views / "planted-sha").symlink_to(outside)
    (views / SHA / "planted-view").symlink_to(outside / "victim")
    (views / SHA / "planted-file").symlink_to(outside / "file")
    before = tree(storage["checkpoint"])
    result = run_module(checkpoint_view, collect_args(storage, tmp_path))
    assert result["collected"] == [str(view)] and not view.exists()
    assert sorted(result["skipped"]) == sorted(
        str(p) for p in (views / "planted-sha", views / SHA / "planted-view")
    )
    assert (outside / "victim" / "precious").read_text() == "keep me\n"
    assert (outside / "file").read_text() == "keep me\n"
    assert tree(storage["checkpoint"]) == before  # the view's links were unlinked, not followed


def test_a_view_path_that_is_a_planted_link_is_refused(
    storage: dict[str, Path], outside: Path
) -> None:
    (storage["views"] / SHA).mkdir(parents=True)
    (storage["views"] / SHA / "absent").symlink_to(outside / "victim")
    msg = fail_module(checkpoint_view, view_args(storage))
    assert f"{storage['views']}/{SHA}/absent: a symlink" in msg
    assert sorted(p.name for p in (outside / "victim").iterdir()) == ["precious"]


@pytest.mark.parametrize("state", ["present", "collected"])
def test_a_symlink_at_the_lock_path_is_refused_naming_it(
    storage: dict[str, Path], tmp_path: Path, outside: Path, state: str
) -> None:
    storage["views"].mkdir()
    (storage["views"] / ".lock").symlink_to(outside / "file")
    args = view_args(storage) if state == "present" else collect_args(storage, tmp_path)
    msg = fail_module(checkpoint_view, args)
    assert f"{storage['views']}/.lock: a symlink" in msg
    assert (outside / "file").read_text() == "keep me\n"


def test_a_symlinked_refs_directory_is_refused(
    storage: dict[str, Path], tmp_path: Path, outside: Path
) -> None:
    storage["views"].mkdir()
    (storage["views"] / ".refs").symlink_to(outside / "victim")
    msg = fail_module(checkpoint_view, collect_args(storage, tmp_path))
    assert f"{storage['views']}/.refs: a symlink" in msg
    assert sorted(p.name for p in (outside / "victim").iterdir()) == ["precious"]
