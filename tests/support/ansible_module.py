"""Run a library/ module in-process (ansible-core's unit-test style).

exit_json/fail_json raise instead of exiting; warn() is collected into the
result. Import `patch_ansible_module` into a test module to activate it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from ansible.module_utils import basic

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


def load_module(name: str) -> ModuleType:
    """Import library/<name>.py as a Python module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "library" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
