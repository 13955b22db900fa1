"""Shared test setup: import paths for the project's modules and helpers."""

from __future__ import annotations

import sys
from pathlib import Path

import ansible.module_utils

ROOT = Path(__file__).resolve().parent.parent

# `from tests.support.<helper> import ...` from any test directory.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Custom module_utils (ansible.cfg: module_utils = module_utils) import as
# `ansible.module_utils.<name>` inside modules; make that work in-process too.
if str(ROOT / "module_utils") not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(str(ROOT / "module_utils"))
