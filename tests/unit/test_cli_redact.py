"""Secrets never reach the CLI's output, whatever the event carries."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit import cli_events as ev
from vllm_fleet import cli
from vllm_fleet.redact import MASK, Redactor, is_secret_name, secret_values
from vllm_fleet.runner import RunRequest, RunResult, secrets_in

PROJECT = Path(__file__).resolve().parents[2]
LOCAL = PROJECT / "inventory" / "local" / "hosts.yml"
TOKEN = "hf_s3cretTOKENvalue"
API_KEY = "sk-fleet-abcdef"


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("vllm_fleet_hf_token", True),
        ("vllm_fleet_api_key", True),
        ("PASSWORD", True),
        ("Authorization", True),
        ("aws_secret", True),
        ("vllm_fleet_model", False),
        ("kv_cache_quant", False),
    ],
)
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_secret_values_collects_nested_and_skips_trivial() -> None:
    found = secret_values(
        {
            "vllm_fleet_hf_token": TOKEN,
            "auth": {"password": "hunter22", "user": "bob"},
            "api_key": "",
            "use_key": True,
            "keys": ["aaaa-list-value"],
        }
    )
    assert found == {TOKEN, "hunter22", "aaaa-list-value"}


def test_redactor_masks_names_and_values_without_touching_input() -> None:
    event = ev.ok(
        "node1",
        "Write the environment file",
        {
            "changed": True,
            "msg": f"wrote HF_TOKEN={TOKEN}",
            "invocation": {
                "module_args": {
                    "headers": {"Authorization": f"Bearer {API_KEY}"},
                    "hf_token": "unrelated-other-secret",
                    "content_keys": ["a", "b"],
                }
            },
        },
    )
    redacted = Redactor([TOKEN, API_KEY]).data(event)
    res = redacted["event_data"]["res"]
    assert res["msg"] == f"wrote HF_TOKEN={MASK}"
    args = res["invocation"]["module_args"]
    assert args["headers"]["Authorization"] == MASK
    assert args["hf_token"] == MASK
    # Lists under a secret-looking name are walked, not blanked.
    assert args["content_keys"] == ["a", "b"]
    assert event["event_data"]["res"]["msg"] == f"wrote HF_TOKEN={TOKEN}"


def test_secrets_in_reads_plain_extravar_files(tmp_path: Path) -> None:
    plain = tmp_path / "secrets.yml"
    plain.write_text(f"vllm_fleet_api_key: {API_KEY}\nother: visible\n")
    vaulted = tmp_path / "vault.yml"
    vaulted.write_text("$ANSIBLE_VAULT;1.1;AES256\n6162636465\n")
    assert secrets_in([{"vllm_fleet_hf_token": TOKEN}, plain, vaulted]) == {TOKEN, API_KEY}


@pytest.mark.parametrize("mode", ["--json", "--plain"])
def test_cli_output_never_shows_extravar_secrets(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "list_hosts", lambda req: ["node1"])

    def run(req: RunRequest, handler) -> RunResult:
        handler(ev.play("Download the checkpoint"))
        handler(ev.ok("node1", "Resolve the revision", {"msg": f"using token {TOKEN}"}))
        handler(
            ev.failed(
                "node1",
                "Download",
                {"msg": f"401 for https://hub/api?token={TOKEN}", "hf_token": TOKEN},
            )
        )
        handler({"event": "verbose", "stdout": f"ansible -e vllm_fleet_hf_token={TOKEN}"})
        handler(ev.stats(failures={"node1": 1}))
        return RunResult("failed", 2)

    out = io.StringIO()
    args = cli.build_parser().parse_args(
        [
            "deploy",
            "-i",
            str(LOCAL),
            "-vvv",
            mode,
            "--no-status",
            "-e",
            f"vllm_fleet_hf_token={TOKEN}",
        ]
    )
    assert cli.run_command(args, out, run=run) == 1
    text = out.getvalue()
    assert TOKEN not in text
    assert MASK in text


VAULT_PASSWORD = "unit-vault-password"


def _vault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real ansible-vault password file, found the way Ansible finds it."""
    password = tmp_path / "vault-password"
    password.write_text(VAULT_PASSWORD + "\n")
    monkeypatch.setenv("ANSIBLE_VAULT_PASSWORD_FILE", str(password))
    from ansible import constants

    monkeypatch.setattr(constants, "DEFAULT_VAULT_PASSWORD_FILE", str(password))
    return password


def _encrypt(password: Path, *argv: str) -> str:
    """ansible-vault itself; the password file comes from ANSIBLE_VAULT_PASSWORD_FILE."""
    vault = Path(sys.executable).parent / "ansible-vault"
    done = subprocess.run(
        [str(vault), *argv],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def test_secrets_in_finds_vault_values_under_innocent_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    password = _vault(tmp_path, monkeypatch)
    inline = _encrypt(password, "encrypt_string", "nested-vault-secret-1", "--name", "endpoint")
    nested = tmp_path / "nested.yml"
    nested.write_text("config:\n" + "".join(f"  {line}\n" for line in inline.splitlines()))
    nested.write_text(nested.read_text() + "  region: visible-region\n")
    whole = tmp_path / "whole.yml"
    whole.write_text("deep:\n  item: whole-file-secret-2\n")
    _encrypt(password, "encrypt", str(whole))
    assert whole.read_text().startswith("$ANSIBLE_VAULT")
    inventory = tmp_path / "inv"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "hosts.yml").write_text("gpu-nodes:\n  hosts:\n    n1:\n")
    (inventory / "group_vars" / "gpu-nodes.yml").write_text(
        "site:\n"
        + "".join(f"  {line}\n" for line in inline.replace("endpoint", "url").splitlines())
    )

    found = secrets_in([nested, whole])
    assert found == {"nested-vault-secret-1", "whole-file-secret-2"}
    # Plain values beside them, and the inventory's plain names, stay visible.
    assert secrets_in([], inventory / "hosts.yml") == {"nested-vault-secret-1"}
    redactor = Redactor(secrets_in([nested, whole], inventory / "hosts.yml"))
    line = "endpoint nested-vault-secret-1 item whole-file-secret-2 region visible-region"
    assert redactor.text(line) == f"endpoint {MASK} item {MASK} region visible-region"


def test_secrets_in_skips_a_vault_it_cannot_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    password = _vault(tmp_path, monkeypatch)
    whole = tmp_path / "whole.yml"
    whole.write_text("x: whole-file-secret-3\n")
    _encrypt(password, "encrypt", str(whole))
    password.write_text("another-password\n")
    assert secrets_in([whole]) == set()
