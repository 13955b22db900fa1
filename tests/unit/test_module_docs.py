"""Every module's documentation, read as ansible-doc reads it, matches its argument spec.

The docs come from ansible's own loader (ansible.utils.plugin_docs.get_docstring,
what ansible-doc calls); the spec is the argument_spec main() hands to
AnsibleModule, captured in-process. Modules are found by glob, so a new module
is covered without editing this file.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.loader import fragment_loader
from ansible.utils.plugin_docs import get_docstring

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted([*ROOT.glob("library/*.py"), *ROOT.glob("roles/*/library/*.py")])
# Option names ansible-test's validate-modules treats as secrets.
SECRET = re.compile(r"(token|password|passwd|passphrase|secret|api_key|apikey)", re.I)
COMPARED = ("type", "default", "choices", "elements", "required", "aliases")


class _Captured(Exception):
    """AnsibleModule was constructed; args[0] is its keyword arguments."""


class _CaptureModule:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args:
            kwargs["argument_spec"] = args[0]
        raise _Captured(kwargs)


def _import(path: Path) -> ModuleType:
    name = f"_docs_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def argument_spec(path: Path) -> dict[str, Any]:
    """The argument_spec the module's main() passes to AnsibleModule."""
    module = _import(path)
    module.AnsibleModule = _CaptureModule
    with pytest.raises(_Captured) as captured:
        module.main()
    return captured.value.args[0]["argument_spec"]


def _typed(value: Any, kind: str) -> Any:
    """A doc value as the spec's type would read it (docs may write yes/no, '1')."""
    if value is None:
        return None
    if kind == "bool":
        return boolean(value)
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind in ("str", "path") and not isinstance(value, (list, dict)):
        return str(value)
    return value


def _normal(option: dict[str, Any]) -> dict[str, Any]:
    kind = option.get("type") or "str"
    elements = option.get("elements")
    default = option.get("default")
    if kind == "list" and elements and isinstance(default, list):
        default = [_typed(v, elements) for v in default]
    else:
        default = _typed(default, kind)
    choices = option.get("choices")
    if choices is not None:
        choices = [_typed(c, elements if kind == "list" and elements else kind) for c in choices]
    return {
        "type": kind,
        "default": default,
        "choices": choices,
        "elements": elements,
        "required": bool(option.get("required", False)),
        "aliases": sorted(option.get("aliases") or []),
    }


def compare(module: str, where: str, doc: dict[str, Any], spec: dict[str, Any]) -> None:
    """Assert doc options == spec options, recursively; the first difference fails."""
    assert sorted(doc) == sorted(spec), (
        f"{module}: options at {where or '<top>'}: documented {sorted(doc)} != spec {sorted(spec)}"
    )
    for name in sorted(spec):
        path = f"{where}.{name}" if where else name
        d_opt, s_opt = doc[name] or {}, spec[name] or {}
        d_norm, s_norm = _normal(d_opt), _normal(s_opt)
        for key in COMPARED:
            assert d_norm[key] == s_norm[key], (
                f"{module}: option {path}: {key} documented {d_norm[key]!r} != spec {s_norm[key]!r}"
            )
        if SECRET.search(name) and s_opt.get("no_log") is not False:
            assert s_opt.get("no_log") is True, f"{module}: option {path}: secret, no no_log=True"
        d_sub = d_opt.get("suboptions")
        s_sub = s_opt.get("options")
        if d_sub or s_sub:
            compare(module, path, d_sub or {}, s_sub or {})


def read_docs(path: Path) -> tuple[dict[str, Any], str, Any]:
    doc, examples, returns, _metadata = get_docstring(str(path), fragment_loader)
    return doc or {}, examples or "", returns


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_docs_parse(path: Path) -> None:
    doc, examples, returns = read_docs(path)
    assert doc.get("module") == path.stem, f"{path.stem}: DOCUMENTATION missing or unparsed"
    assert doc.get("short_description"), f"{path.stem}: no short_description"
    assert isinstance(yaml.safe_load(examples), list), f"{path.stem}: EXAMPLES not a task list"
    assert isinstance(returns, dict), f"{path.stem}: RETURN missing or unparsed"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_docs_match_argument_spec(path: Path) -> None:
    doc, _examples, _returns = read_docs(path)
    compare(path.stem, "", doc.get("options") or {}, argument_spec(path))


def test_every_module_found() -> None:
    assert len(MODULES) >= 9, [p.stem for p in MODULES]
