"""Fixtures shared by the unit tests."""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture(scope="session")
def promtool() -> str:
    """promtool: $VLLM_FLEET_PROMTOOL (make unit sets it) or PATH; none fails the test."""
    configured = os.environ.get("VLLM_FLEET_PROMTOOL")
    if configured:
        if not os.access(configured, os.X_OK):
            pytest.fail(
                f"VLLM_FLEET_PROMTOOL={configured} is not an executable: run `make promtool`"
            )
        return configured
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("no promtool: run `make promtool` (make unit does) or set VLLM_FLEET_PROMTOOL")
    return found
