"""Run a custom module in-process (ansible-core's unit-test style).

exit_json/fail_json raise instead of exiting; warn() is collected into the
result. Import `patch_ansible_module` into a test module to activate it, load
the module with `load_module` and call it with `run_module` / `fail_module`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from ansible.module_utils import basic
from ansible.module_utils.testing import patch_module_args

ROOT = Path(__file__).resolve().parents[2]


class AnsibleExitJson(Exception):
    """exit_json was called; args[0] is the result."""


class AnsibleFailJson(Exception):
    """fail_json was called; args[0] is the result (msg included)."""


def _exit_json(self: basic.AnsibleModule, **kwargs: Any) -> None:
    kwargs.setdefault("changed", False)
    kwargs["warnings"] = list(getattr(self, "_test_warnings", []))
    raise AnsibleExitJson(kwargs)


def _fail_json(self: basic.AnsibleModule, msg: str, **kwargs: Any) -> None:
    kwargs["msg"] = msg
    raise AnsibleFailJson(kwargs)


def _warn(self: basic.AnsibleModule, warning: str) -> None:
    self._test_warnings = [*getattr(self, "_test_warnings", []), warning]


@pytest.fixture(autouse=True)
def patch_ansible_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)
    monkeypatch.setattr(basic.AnsibleModule, "warn", _warn)


def load_module(name: str, library: str = "library") -> ModuleType:
    """Import <library>/<name>.py (a path under the project root) as a Python module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / library / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _module_args(args: dict[str, Any], check: bool, diff: bool) -> dict[str, Any]:
    """The module's arguments as Ansible passes them: paths as strings, mode flags."""
    out = {key: str(value) if isinstance(value, Path) else value for key, value in args.items()}
    return {**out, "_ansible_check_mode": check, "_ansible_diff": diff}


def run_module(
    module: ModuleType, args: dict[str, Any], *, check: bool = False, diff: bool = False
) -> dict[str, Any]:
    """Run the module; return its result (AnsibleFailJson propagates on failure)."""
    with patch_module_args(_module_args(args, check, diff)), pytest.raises(AnsibleExitJson) as exc:
        module.main()
    return exc.value.args[0]


def fail_module(module: ModuleType, args: dict[str, Any], *, check: bool = False) -> str:
    """Run the module expecting it to fail; return its message."""
    with patch_module_args(_module_args(args, check, False)), pytest.raises(AnsibleFailJson) as exc:
        module.main()
    return exc.value.args[0]["msg"]
