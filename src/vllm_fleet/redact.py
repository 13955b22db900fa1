"""Keep secrets out of everything the CLI prints.

Two layers: a value under a key whose name looks secret (token, key, password,
secret) is replaced wherever it appears in an event, and every secret value the
CLI knows (from the extra vars it was given, and every vault-encrypted value of
those files and of the inventory's variable files, whatever its key) is
scrubbed from free text, since a task can echo it in ``msg`` or ``stdout``
under an innocent key.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

MASK = "********"
SECRET_NAME = re.compile(r"token|key|password|passwd|secret|authorization", re.IGNORECASE)
# Short values ("", "1", "yes") would mask unrelated text; such values are no
# secret worth the noise.
MIN_SECRET_LEN = 4


def is_secret_name(name: str) -> bool:
    """True when a variable or result key name suggests a secret value."""
    return bool(SECRET_NAME.search(name))


def secret_values(variables: dict[str, Any]) -> set[str]:
    """Collect the string values of secret-named variables, at any depth."""
    found: set[str] = set()

    def walk(node: Any, secret: bool) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, secret or is_secret_name(str(key)))
        elif isinstance(node, list):
            for value in node:
                walk(value, secret)
        elif secret and isinstance(node, str | int | float) and not isinstance(node, bool):
            text = str(node)
            if len(text) >= MIN_SECRET_LEN:
                found.add(text)

    walk(variables, False)
    return found


def all_values(variables: Any) -> set[str]:
    """Every scalar value at any depth (the content of a vault-encrypted file)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str | int | float) and not isinstance(node, bool):
            text = str(node)
            if len(text) >= MIN_SECRET_LEN:
                found.add(text)

    walk(variables)
    return found


def vaulted_values(variables: Any, is_vaulted: Any) -> set[str]:
    """Values that were vault-encrypted (is_vaulted(value)), under any key name."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif is_vaulted(node):
            text = str(node)
            if len(text) >= MIN_SECRET_LEN:
                found.add(text)

    walk(variables)
    return found


class Redactor:
    """Replaces secret values in strings and nested event data."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        # Longest first so a secret containing another is masked whole.
        self._secrets = sorted({s for s in secrets if len(s) >= MIN_SECRET_LEN}, key=len)[::-1]

    def add(self, secrets: Iterable[str]) -> None:
        self._secrets = sorted(
            set(self._secrets) | {s for s in secrets if len(s) >= MIN_SECRET_LEN}, key=len
        )[::-1]

    def text(self, value: str) -> str:
        for secret in self._secrets:
            if secret in value:
                value = value.replace(secret, MASK)
        return value

    def data(self, node: Any) -> Any:
        """A redacted copy of nested dicts/lists; the input is not modified."""
        if isinstance(node, dict):
            return {key: self._item(str(key), value) for key, value in node.items()}
        if isinstance(node, list):
            return [self.data(value) for value in node]
        if isinstance(node, str):
            return self.text(node)
        return node

    def _item(self, key: str, value: Any) -> Any:
        if is_secret_name(key) and _is_maskable(value):
            return MASK
        return self.data(value)


def _is_maskable(value: Any) -> bool:
    """Scalars under a secret name are masked; empty values and flags say nothing."""
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, str):
        return value != ""
    return isinstance(value, int | float)
