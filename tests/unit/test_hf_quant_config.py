"""Unit tests of library/hf_quant_config.py, in ansible-core's style.

The module runs in-process (``patch_module_args``; exit_json/fail_json raise)
on real files shaped like nvidia/Kimi-K2.5-NVFP4's, generated per test.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.ansible_module import (  # noqa: F401 (patch_ansible_module: autouse fixture)
    AnsibleFailJson,
    fail_module,
    load_module,
    patch_ansible_module,
    run_module,
)
from tests.support.kimi_checkpoint import (
    KV_CACHE_SCHEME,
    dump,
    kimi_config,
    write_kimi_checkpoint,
    write_kimi_configs,
)

ROOT = Path(__file__).resolve().parents[2]
hf_quant_config = load_module("hf_quant_config")

CONFIG = "config.json"
SIDECAR = "hf_quant_config.json"


def run(args: dict[str, Any], check: bool = False, diff: bool = False) -> dict[str, Any]:
    """Run the module; return its result (raises AnsibleFailJson on failure)."""
    return run_module(hf_quant_config, args, check=check, diff=diff)


def fail(args: dict[str, Any], check: bool = False) -> str:
    """Run the module expecting failure; return its message."""
    return fail_module(hf_quant_config, args, check=check)


def snapshot(*dirs: Path) -> dict[str, str]:
    """SHA-256 of every file under *dirs* (absent dirs contribute nothing)."""
    hashes = {}
    for top in dirs:
        for path in sorted(top.rglob("*")) if top.exists() else []:
            if path.is_file():
                hashes[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hashes


def load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def drop(doc: dict[str, Any], *paths: tuple[str, ...]) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    for path in paths:
        node = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return doc


@pytest.fixture
def kimi(tmp_path: Path) -> Path:
    """A Kimi-K2.5-NVFP4-shaped checkpoint directory (configs and small shards)."""
    model_dir = tmp_path / "models" / "kimi"
    write_kimi_checkpoint(model_dir)
    return model_dir


def backup_dir_of(model_dir: Path) -> Path:
    return model_dir.parent / ".vllm-fleet" / model_dir.name / "pristine"


# --- absent: the Kimi shapes and text styles ---------------------------------

KV_SCHEME_PATH = ("quantization_config", "kv_cache_scheme")
SIDECAR_KV_PATH = ("quantization", "kv_cache_quant_algo")

STYLES = [
    pytest.param({"indent": 2}, id="indent2"),
    pytest.param({"indent": 4}, id="indent4"),
    pytest.param({"indent": "\t"}, id="tabs"),
    pytest.param({"indent": None}, id="compact"),
    pytest.param({"indent": 2, "trailing_newline": False}, id="no-final-newline"),
    pytest.param({"indent": 2, "ensure_ascii": False}, id="raw-utf8"),
]


@pytest.mark.parametrize("style", STYLES)
def test_absent_keeps_the_text_style_exactly(tmp_path: Path, style: dict[str, Any]) -> None:
    model_dir = tmp_path / "kimi"
    override = {"name_or_path": "Kimi-K2.5 — NVFP4 ü"}  # non-ASCII to exercise escapes
    write_kimi_configs(model_dir, text_config_overrides=override, **style)
    before = {n: load(model_dir / n) for n in (CONFIG, SIDECAR)}

    result = run({"model_dir": model_dir})

    assert result["changed"] is True
    assert result["removed"] == {
        CONFIG: ["/quantization_config/kv_cache_scheme"],
        SIDECAR: ["/quantization/kv_cache_quant_algo"],
    }
    expected = {
        CONFIG: drop(before[CONFIG], KV_SCHEME_PATH),
        SIDECAR: drop(before[SIDECAR], SIDECAR_KV_PATH),
    }
    dump_style = {k: v for k, v in style.items()}
    for name, doc in expected.items():
        # Same text as the checkpoint's own writer would have produced
        # without the declaration: indentation, escapes, final newline.
        assert (model_dir / name).read_text(encoding="utf-8") == dump(doc, **dump_style)


SHAPES = [
    pytest.param(
        {"nested_quant": True},
        {
            CONFIG: [
                "/quantization_config/kv_cache_scheme",
                "/text_config/quantization_config/kv_cache_scheme",
            ],
            SIDECAR: ["/quantization/kv_cache_quant_algo"],
        },
        id="nested-text_config",
    ),
    pytest.param(
        {"top_level_kv": True},
        {CONFIG: ["/quantization_config/kv_cache_scheme"], SIDECAR: ["/kv_cache_quant_algo"]},
        id="sidecar-top-level",
    ),
    pytest.param(
        {"wrapper": False},
        {
            CONFIG: ["/quantization_config/kv_cache_scheme"],
            SIDECAR: ["/quantization/kv_cache_quant_algo"],
        },
        id="flat-deepseek",
    ),
    pytest.param(
        {"sidecar": False},
        {CONFIG: ["/quantization_config/kv_cache_scheme"]},
        id="no-sidecar",
    ),
]


@pytest.mark.parametrize(("shape", "removed"), SHAPES)
def test_absent_finds_every_declaration(
    tmp_path: Path, shape: dict[str, Any], removed: dict[str, list[str]]
) -> None:
    model_dir = tmp_path / "kimi"
    write_kimi_configs(model_dir, **shape)
    before = {p.name: load(p) for p in model_dir.glob("*.json")}

    result = run({"model_dir": model_dir})

    assert result["changed"] is True
    assert result["removed"] == removed
    assert set(result["declarations"]) == set(removed)
    for name, pointers in removed.items():
        paths = [tuple(p.split("/")[1:]) for p in pointers]
        assert load(model_dir / name) == drop(before[name], *paths)


DECLARING_SNIPPETS = [
    # (file, JSON text, pointers removed, JSON text expected)
    pytest.param(
        CONFIG,
        '{"quantization_config": {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}}',
        ["/quantization_config/kv_cache_scheme"],
        '{"quantization_config": {}}',
        id="only-member-becomes-empty-object",
    ),
    pytest.param(
        CONFIG,
        '{\r\n  "a": 1E-6,\r\n  "quantization_config": {\r\n    "quant_method": "modelopt",\r\n'
        '    "kv_cache_quant_algo"  :  "FP8"\r\n  },\r\n  "b": "\\u00e9\u00e9"\r\n}',
        ["/quantization_config/kv_cache_quant_algo"],
        '{\r\n  "a": 1E-6,\r\n  "quantization_config": {\r\n    "quant_method": "modelopt"\r\n'
        '  },\r\n  "b": "\\u00e9\u00e9"\r\n}',
        id="crlf-odd-spacing-last-member",
    ),
    pytest.param(
        CONFIG,
        '{"compression_config": {"kv_cache_scheme": {"num_bits": 8}, "format": "x"},'
        ' "text_config": {"compression_config": {"quantization": '
        '{"kv_cache_scheme": "fp8", "kv_cache_quant_algo": "FP8", "quant_algo": "FP8"}}}}',
        [
            "/compression_config/kv_cache_scheme",
            "/text_config/compression_config/quantization/kv_cache_scheme",
            "/text_config/compression_config/quantization/kv_cache_quant_algo",
        ],
        '{"compression_config": {"format": "x"}, "text_config": {"compression_config": '
        '{"quantization": {"quant_algo": "FP8"}}}}',
        id="compressed-tensors-and-nested-quantization",
    ),
    pytest.param(
        SIDECAR,
        '{"kv_cache_scheme": {"num_bits": 8, "type": "float"},\n "quantization": '
        '{"kv_cache_scheme": {"num_bits": 8}, "quant_algo": "FP8"}, "kv_cache_quant_algo": "FP8"}',
        [
            "/kv_cache_scheme",
            "/kv_cache_quant_algo",
            "/quantization/kv_cache_scheme",
        ],
        '{"quantization": {"quant_algo": "FP8"}}',
        id="sidecar-all-four-places",
    ),
]


@pytest.mark.parametrize(("name", "text", "removed", "expected"), DECLARING_SNIPPETS)
def test_absent_cuts_only_the_declaring_members(
    tmp_path: Path, name: str, text: str, removed: list[str], expected: str
) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    if name != CONFIG:
        (model_dir / CONFIG).write_text('{"architectures": ["X"]}\n')
    (model_dir / name).write_bytes(text.encode("utf-8"))

    result = run({"model_dir": model_dir})

    assert result["changed"] is True
    assert sorted(result["removed"][name]) == sorted(removed)
    assert (model_dir / name).read_bytes() == expected.encode("utf-8")


def test_null_declarations_are_left_alone(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    text = '{"quantization_config": {"quant_method": "modelopt", "kv_cache_scheme": null}}\n'
    (model_dir / CONFIG).write_text(text)
    (model_dir / SIDECAR).write_text('{"quantization": {"kv_cache_quant_algo": null}}\n')

    result = run({"model_dir": model_dir})

    assert result["changed"] is False
    assert result["declared"] is False
    assert (model_dir / CONFIG).read_text() == text
    assert not backup_dir_of(model_dir).exists()


def test_quark_kv_cache_group_is_reported_not_changed(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    text = json.dumps(
        {
            "quantization_config": {
                "quant_method": "quark",
                "export": {"kv_cache_group": ["*k_proj"]},
            }
        }
    )
    (model_dir / CONFIG).write_text(text)

    result = run({"model_dir": model_dir})

    assert result["changed"] is False
    assert any("kv_cache_group" in w for w in result["warnings"])
    assert (model_dir / CONFIG).read_text() == text


# --- check, diff, idempotence, backups ----------------------------------------


def test_check_mode_reports_and_writes_nothing(kimi: Path) -> None:
    before = snapshot(kimi.parent)

    result = run({"model_dir": kimi}, check=True)

    assert result["changed"] is True
    assert result["removed"][CONFIG] == ["/quantization_config/kv_cache_scheme"]
    assert result["declarations"][SIDECAR] == {"/quantization/kv_cache_quant_algo": "FP8"}
    assert result["declarations"][CONFIG] == {
        "/quantization_config/kv_cache_scheme": KV_CACHE_SCHEME
    }
    assert result["backup_files_created"] == []
    assert snapshot(kimi.parent) == before
    assert not backup_dir_of(kimi).exists()


def test_diff_mode_returns_before_and_after_per_file(kimi: Path) -> None:
    originals = {n: (kimi / n).read_text() for n in (CONFIG, SIDECAR)}

    result = run({"model_dir": kimi}, diff=True)

    diffs = {d["before_header"]: d for d in result["diff"]}
    assert set(diffs) == {str(kimi / CONFIG), str(kimi / SIDECAR)}
    for name in (CONFIG, SIDECAR):
        entry = diffs[str(kimi / name)]
        assert entry["before"] == originals[name]
        assert entry["after"] == (kimi / name).read_text()
        assert entry["before"] != entry["after"]


def test_second_run_changes_nothing(kimi: Path) -> None:
    first = run({"model_dir": kimi})
    after_first = snapshot(kimi.parent)

    second = run({"model_dir": kimi}, diff=True)

    assert first["changed"] is True
    assert second["changed"] is False
    assert second["removed"] == {}
    assert second["declared"] is False
    assert "diff" not in second
    assert second["backup_files_created"] == []
    assert second["backup_files"] == first["backup_files"]
    assert snapshot(kimi.parent) == after_first


def test_backup_is_pristine_beside_the_checkpoint(kimi: Path) -> None:
    pristine = {n: (kimi / n).read_bytes() for n in (CONFIG, SIDECAR)}
    listing = sorted(p.name for p in kimi.iterdir())

    result = run({"model_dir": kimi})

    assert Path(result["backup_dir"]) == backup_dir_of(kimi)
    assert sorted(p.name for p in kimi.iterdir()) == listing  # nothing added inside
    for name in (CONFIG, SIDECAR):
        backup = Path(result["backup_files"][name])
        assert backup.parent == backup_dir_of(kimi)
        assert backup.read_bytes() == pristine[name]
    assert sorted(result["backup_files_created"]) == sorted(result["backup_files"].values())


def test_no_backup_when_disabled(kimi: Path) -> None:
    result = run({"model_dir": kimi, "backup": False})

    assert result["changed"] is True
    assert result["backup_files"] == {}
    assert result["backup_files_created"] == []
    # Only the record of the patch, so that `original` can refuse loudly.
    assert [p.name for p in backup_dir_of(kimi).iterdir()] == ["manifest.json"]


def test_backup_dir_option(kimi: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere" / "pristine"

    result = run({"model_dir": kimi, "backup_dir": elsewhere})

    assert Path(result["backup_files"][CONFIG]).parent == elsewhere
    assert not backup_dir_of(kimi).exists()
    restored = run({"model_dir": kimi, "kv_cache_quant": "original", "backup_dir": elsewhere})
    assert restored["restored"] == [CONFIG, SIDECAR]


# --- original ---------------------------------------------------------------


def test_original_restores_byte_identical_files(kimi: Path) -> None:
    pristine = {n: (kimi / n).read_bytes() for n in (CONFIG, SIDECAR)}
    run({"model_dir": kimi})

    check = run({"model_dir": kimi, "kv_cache_quant": "original"}, check=True)
    assert check["changed"] is True
    assert (kimi / CONFIG).read_bytes() != pristine[CONFIG]

    result = run({"model_dir": kimi, "kv_cache_quant": "original"}, diff=True)

    assert result["changed"] is True
    assert result["restored"] == [CONFIG, SIDECAR]
    assert len(result["diff"]) == 2
    for name, data in pristine.items():
        assert (kimi / name).read_bytes() == data
    again = run({"model_dir": kimi, "kv_cache_quant": "original"})
    assert again["changed"] is False
    assert again["declared"] is True


def test_patch_restore_patch_cycle_keeps_one_pristine_copy(kimi: Path) -> None:
    first = run({"model_dir": kimi})
    run({"model_dir": kimi, "kv_cache_quant": "original"})
    third = run({"model_dir": kimi})

    assert third["changed"] is True
    assert third["backup_files_created"] == []
    assert third["backup_files"] == first["backup_files"]
    assert len(list(backup_dir_of(kimi).iterdir())) == 3  # two copies + manifest


def test_original_on_an_unpatched_checkpoint_changes_nothing(kimi: Path) -> None:
    before = snapshot(kimi.parent)

    result = run({"model_dir": kimi, "kv_cache_quant": "original"})

    assert result["changed"] is False
    assert snapshot(kimi.parent) == before


def test_original_without_any_record_only_warns(tmp_path: Path) -> None:
    # A quantized checkpoint without a quantized KV cache, never patched:
    # `original` holds already (a fresh deploy must not fail).
    model_dir = tmp_path / "kimi"
    write_kimi_configs(model_dir)
    for name, path in ((CONFIG, KV_SCHEME_PATH), (SIDECAR, SIDECAR_KV_PATH)):
        (model_dir / name).write_text(dump(drop(load(model_dir / name), path)))
    before = snapshot(tmp_path)

    result = run({"model_dir": model_dir, "kv_cache_quant": "original"})

    assert result["changed"] is False
    assert any("no record of a patch" in w for w in result["warnings"])
    assert snapshot(tmp_path) == before


def test_new_revision_gets_its_own_pristine_copy(kimi: Path) -> None:
    first = run({"model_dir": kimi})
    # A newer revision of the checkpoint lands (download role): new bytes,
    # its own FP8 declaration again.
    newer = kimi_config(text_config_overrides={"rope_theta": 60000.0})
    (kimi / CONFIG).write_text(dump(newer, indent=2))
    newer_bytes = (kimi / CONFIG).read_bytes()

    second = run({"model_dir": kimi})

    assert second["changed"] is True
    assert second["removed"] == {CONFIG: ["/quantization_config/kv_cache_scheme"]}
    assert second["backup_files"][CONFIG] != first["backup_files"][CONFIG]
    assert Path(first["backup_files"][CONFIG]).exists()  # old copy never overwritten
    run({"model_dir": kimi, "kv_cache_quant": "original"})
    assert (kimi / CONFIG).read_bytes() == newer_bytes


def test_original_leaves_a_freshly_downloaded_file_alone(kimi: Path) -> None:
    run({"model_dir": kimi})
    fresh = dump(kimi_config(text_config_overrides={"rope_theta": 1.0}), indent=2)
    (kimi / CONFIG).write_text(fresh)

    result = run({"model_dir": kimi, "kv_cache_quant": "original"})

    assert result["restored"] == [SIDECAR]
    assert (kimi / CONFIG).read_text() == fresh
    assert any("newer download" in w for w in result["warnings"])


# --- bad input: clear message, every file byte-identical ----------------------


def _bad_missing_dir(kimi: Path) -> tuple[dict[str, Any], str]:
    return {"model_dir": kimi.parent / "nope"}, "does not exist"


def _bad_not_a_dir(kimi: Path) -> tuple[dict[str, Any], str]:
    return {"model_dir": kimi / CONFIG}, "is not a directory"


def _bad_no_config(kimi: Path) -> tuple[dict[str, Any], str]:
    (kimi / CONFIG).unlink()
    return {"model_dir": kimi}, "no config.json, so not a Hugging Face checkpoint"


def _bad_malformed_config(kimi: Path) -> tuple[dict[str, Any], str]:
    text = (kimi / CONFIG).read_text()
    (kimi / CONFIG).write_text(text.replace('"model_type": "kimi_k25",', '"model_type": kimi,'))
    line = next(
        i for i, t in enumerate((kimi / CONFIG).read_text().splitlines(), 1) if "kimi," in t
    )
    return {"model_dir": kimi}, f"config.json: malformed JSON at line {line} column 17"


def _bad_malformed_sidecar(kimi: Path) -> tuple[dict[str, Any], str]:
    # config.json is fine and declares FP8: it must stay untouched too.
    with (kimi / SIDECAR).open("a") as handle:
        handle.write("}\n")
    return {"model_dir": kimi}, "hf_quant_config.json: malformed JSON at line"


def _bad_top_level_list(kimi: Path) -> tuple[dict[str, Any], str]:
    (kimi / SIDECAR).write_text("[1, 2]\n")
    return {"model_dir": kimi}, "hf_quant_config.json: top-level JSON value is list"


def _bad_not_utf8(kimi: Path) -> tuple[dict[str, Any], str]:
    (kimi / SIDECAR).write_bytes(b'{"producer": "\xff"}')
    return {"model_dir": kimi}, "hf_quant_config.json: not UTF-8 at byte 14"


def _bad_original_without_backup(kimi: Path) -> tuple[dict[str, Any], str]:
    run({"model_dir": kimi, "backup": False})
    return {"model_dir": kimi, "kv_cache_quant": "original"}, "was patched with backup=false"


def _bad_original_after_hand_edit(kimi: Path) -> tuple[dict[str, Any], str]:
    run({"model_dir": kimi})
    doc = load(kimi / CONFIG)
    doc["torch_dtype"] = "float16"
    (kimi / CONFIG).write_text(json.dumps(doc, indent=2))
    return {"model_dir": kimi, "kv_cache_quant": "original"}, "changed since it was patched"


def _bad_corrupt_backup(kimi: Path) -> tuple[dict[str, Any], str]:
    result = run({"model_dir": kimi})
    Path(result["backup_files"][SIDECAR]).write_text("{}")
    return (
        {"model_dir": kimi, "kv_cache_quant": "original"},
        "does not match its recorded SHA-256",
    )


def _bad_unknown_state(kimi: Path) -> tuple[dict[str, Any], str]:
    return {"model_dir": kimi, "kv_cache_quant": "fp8"}, "value of kv_cache_quant must be one of"


BAD_INPUTS = [
    pytest.param(_bad_missing_dir, id="missing-dir"),
    pytest.param(_bad_not_a_dir, id="not-a-dir"),
    pytest.param(_bad_no_config, id="no-config.json"),
    pytest.param(_bad_malformed_config, id="malformed-config.json"),
    pytest.param(_bad_malformed_sidecar, id="malformed-hf_quant_config.json"),
    pytest.param(_bad_top_level_list, id="top-level-list"),
    pytest.param(_bad_not_utf8, id="not-utf8"),
    pytest.param(_bad_original_without_backup, id="original-without-backup"),
    pytest.param(_bad_original_after_hand_edit, id="original-after-hand-edit"),
    pytest.param(_bad_corrupt_backup, id="corrupt-backup"),
    pytest.param(_bad_unknown_state, id="unknown-state"),
]


@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
@pytest.mark.parametrize("make_bad", BAD_INPUTS)
def test_bad_input_fails_clearly_and_changes_nothing(
    kimi: Path, make_bad: Any, check: bool
) -> None:
    args, message = make_bad(kimi)
    before = snapshot(kimi.parent)

    msg = fail(args, check=check)

    assert message in msg
    assert snapshot(kimi.parent) == before


@pytest.fixture
def immutable() -> Any:
    """Mark paths immutable (unwritable even for root); undone afterwards."""
    if not shutil.which("chattr") and os.geteuid() == 0:
        pytest.skip("needs chattr to make a file unwritable for root")
    marked: list[Path] = []

    def mark(path: Path) -> None:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "+i", str(path)], check=True)
        else:
            path.chmod(0o555 if path.is_dir() else 0o444)
        marked.append(path)

    yield mark
    for path in marked:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        else:
            path.chmod(0o755 if path.is_dir() else 0o644)


def test_unwritable_file_fails_before_any_write(kimi: Path, immutable: Any) -> None:
    # config.json comes first and is writable: it must not be changed either.
    immutable(kimi / SIDECAR)
    before = snapshot(kimi.parent)

    msg = fail({"model_dir": kimi})

    assert f"{kimi / SIDECAR}: not writable" in msg
    assert snapshot(kimi.parent) == before


def test_unwritable_backup_dir_fails_before_any_write(
    kimi: Path, tmp_path: Path, immutable: Any
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    immutable(locked)
    before = snapshot(kimi.parent)

    msg = fail({"model_dir": kimi, "backup_dir": locked / "pristine"})

    assert f"backup_dir {locked / 'pristine'}: cannot be written" in msg
    assert snapshot(kimi.parent) == before


# --- views: never through a symlink ---------------------------------------------


def test_a_config_that_is_a_symlink_is_refused_and_its_target_untouched(
    kimi: Path, tmp_path: Path
) -> None:
    view = tmp_path / "view"
    view.mkdir()
    for entry in kimi.iterdir():
        (view / entry.name).symlink_to(os.path.relpath(entry, view))
    before = snapshot(kimi)
    for check in (False, True):
        msg = fail({"model_dir": view}, check=check)
        assert f"{view / CONFIG}: is a symlink (to {kimi / CONFIG})" in msg
    assert snapshot(kimi) == before
    assert not backup_dir_of(view).exists()
