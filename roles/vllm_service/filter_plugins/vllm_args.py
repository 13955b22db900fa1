"""Filters that turn structured vLLM arguments into a systemd unit, safely.

The source deployment lost an hour to nested ssh+zsh quoting; here the argv is
a list rendered with systemd's own quoting rules, with no shell in between.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

DOCUMENTATION = """
name: vllm_args
short_description: Render vLLM engine arguments and systemd unit lines
description:
  - C(vllm_argv) turns a mapping of flag to value into an argv list.
  - C(systemd_exec_quote) quotes an argv list for C(ExecStart=).
  - C(systemd_env_quote) quotes C(KEY=value) assignments for C(Environment=).
  - C(systemd_envfile_quote) quotes a value for an C(EnvironmentFile=) line.
  - C(systemd_path_quote) quotes one absolute path for C(RequiresMountsFor=).
  - C(vllm_diagnose) matches journal lines against diagnosis patterns.
"""

# Characters that never need quoting in an ExecStart= word.
_SAFE_WORD = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")
_C_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _flag(name: str) -> str:
    name = str(name).strip()
    if not name or (name.startswith("-") and not name.startswith("--")):
        raise ValueError(
            f"invalid vLLM argument name {name!r}: use the long form, e.g. 'max-model-len'"
        )
    return name if name.startswith("--") else f"--{name}"


def _value(value: Any) -> str:
    if isinstance(value, Mapping | list | tuple):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def vllm_argv(*arg_maps: Mapping[str, Any] | None) -> list[str]:
    """Flatten flag->value mappings into argv; later mappings cannot repeat a flag.

    True is a bare flag, False/None omit the flag, dicts and lists become
    compact JSON, everything else its string form.
    """
    argv: list[str] = []
    seen: set[str] = set()
    for mapping in arg_maps:
        for name, value in (mapping or {}).items():
            flag = _flag(name)
            if flag in seen:
                raise ValueError(f"vLLM argument {flag} is given twice")
            seen.add(flag)
            if value is None or value is False:
                continue
            if value is True:
                argv.append(flag)
            else:
                argv.extend([flag, _value(value)])
    return argv


def _c_escape(text: str) -> str:
    return "".join(_C_ESCAPES.get(char, char) for char in text)


def _systemd_word(word: str, dollar: bool) -> str:
    word = str(word).replace("%", "%%")
    if dollar:
        # ExecStart= expands $VAR and ${VAR}; $$ is a literal dollar.
        word = word.replace("$", "$$")
    if _SAFE_WORD.match(word) and word != ";":
        return word
    return f'"{_c_escape(word)}"'


def systemd_exec_quote(argv: Iterable[Any]) -> str:
    """Quote an argv list for ExecStart= (specifiers, $ expansion, C escapes)."""
    words = [str(word) for word in argv]
    if not words or not words[0].startswith("/"):
        raise ValueError("ExecStart needs an absolute executable path first")
    return " ".join(_systemd_word(word, dollar=True) for word in words)


def systemd_env_quote(env: Mapping[str, Any]) -> list[str]:
    """Quote KEY=value pairs for Environment= lines (no $ expansion there)."""
    lines = []
    for key, value in (env or {}).items():
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", str(key)):
            raise ValueError(f"invalid environment variable name {key!r}")
        lines.append(_systemd_word(f"{key}={_env_value(value)}", dollar=False))
    return lines


def systemd_path_quote(path: Any) -> str:
    """Quote one absolute path for a path-list setting such as RequiresMountsFor=."""
    text = str(path)
    if not text.startswith("/"):
        raise ValueError(f"{text!r} is not an absolute path")
    return _systemd_word(text, dollar=False)


def _env_value(value: Any) -> str:
    if value is True or value is False:
        return "1" if value else "0"
    return _value(value)


def systemd_envfile_quote(value: Any) -> str:
    """Quote a value for an EnvironmentFile= line (shell-like double quotes)."""
    text = _env_value(value)
    if "\n" in text or "\r" in text:
        raise ValueError("EnvironmentFile values cannot span lines")
    escaped = re.sub(r'([\\"$`])', r"\\\1", text)
    return f'"{escaped}"'


def vllm_diagnose(lines: Iterable[str], diagnoses: Iterable[Mapping[str, Any]]) -> list[dict]:
    """Return each diagnosis whose patterns match a journal line, with those lines."""
    # Progress bars redraw with carriage returns: keep what a terminal shows.
    lines = [str(line).split("\r")[-1] for line in lines or []]
    found = []
    for diagnosis in diagnoses or []:
        patterns = [re.compile(pattern) for pattern in diagnosis.get("patterns", [])]
        # Crash loops repeat the same error: each line once, in order.
        matched = list(
            dict.fromkeys(line for line in lines if any(p.search(line) for p in patterns))
        )
        if matched:
            found.append(
                {
                    "name": diagnosis["name"],
                    "advice": diagnosis.get("advice", ""),
                    "lines": matched[-int(diagnosis.get("max_lines", 5)) :],
                }
            )
    return found


class FilterModule:
    """vllm_service filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "vllm_argv": vllm_argv,
            "systemd_exec_quote": systemd_exec_quote,
            "systemd_env_quote": systemd_env_quote,
            "systemd_envfile_quote": systemd_envfile_quote,
            "systemd_path_quote": systemd_path_quote,
            "vllm_diagnose": vllm_diagnose,
        }
