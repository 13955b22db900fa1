"""Ansible's default screen output, plus one line per poll of a long wait."""

from __future__ import annotations

from typing import Any

from ansible import constants as C
from ansible.plugins.callback.default import CallbackModule as DefaultCallback

DOCUMENTATION = """
    name: vllm_fleet
    type: stdout
    short_description: default output, with a progress line per poll of a long wait
    description:
      - Ansible's C(default) callback, unchanged except for retries of a polling task.
      - A retried task whose result carries C(vllm_fleet_poll) (the download follower and
        the health probe) prints that line instead of C(FAILED - RETRYING), so a 45-minute
        load shows its progress at every round; at C(-vvv) Ansible's own retry line and
        the full result.
    extends_documentation_fragment:
      - default_callback
      - result_format_callback
    requirements:
      - set as stdout_callback in ansible.cfg
"""

POLL_KEY = "vllm_fleet_poll"


class CallbackModule(DefaultCallback):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "vllm_fleet"

    def v2_runner_retry(self, result: Any) -> None:
        line = result.result.get(POLL_KEY)
        if not isinstance(line, str) or self._run_is_verbose(result, verbosity=2):
            super().v2_runner_retry(result)
            return
        task = result.task_name or result.task
        left = result.result["retries"] - result.result["attempts"]
        self._display.display(
            f"POLLING [{self.host_label(result)}]: {task}: {line} ({left} rounds left)",
            color=C.COLOR_DEBUG,
        )
