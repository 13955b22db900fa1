"""No secret in any output: argument errors, refused engine arguments, the CLI.

Real ansible-playbook and the real vllm-fleet CLI on this machine as a
one-node fleet (inventory/local), with the secrets given both vault-encrypted
(a real ansible-vault password file) and as plain -e values. Each run fails in
the validate play, before any play changes the node; every output is grepped
for the secret values. The deployed fleet's journals and release directory
are checked in test_deploy_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LOCAL = ROOT / "inventory" / "local" / "hosts.yml"
VAULT_KEY = "sk-vaulted-key-7f3a91"
VAULT_TOKEN = "hf_vaultedTOKEN4b2c77"
PLAIN_KEY = "sk-plain-key-0c9d52"
PLAIN_TOKEN = "hf_plainTOKEN5e8a13"
SECRETS = (VAULT_KEY, VAULT_TOKEN, PLAIN_KEY, PLAIN_TOKEN)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A vault password file, a vaulted vars file and a plain one, and local storage."""
    base = tmp_path_factory.mktemp("secrets")
    password = base / "vault-password"
    password.write_text("test-vault-password\n")
    vaulted = base / "vault.yml"
    lines = []
    for name, value in (("vllm_fleet_api_key", VAULT_KEY), ("vllm_fleet_hf_token", VAULT_TOKEN)):
        done = subprocess.run(
            [str(BIN / "ansible-vault"), "encrypt_string", value, "--name", name,
             "--vault-password-file", str(password)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        lines.append(done.stdout)
    vaulted.write_text("".join(lines))
    assert VAULT_KEY not in vaulted.read_text()
    plain = base / "plain.json"
    plain.write_text(
        json.dumps({"vllm_fleet_api_key": PLAIN_KEY, "vllm_fleet_hf_token": PLAIN_TOKEN})
    )
    storage = base / "models"
    storage.mkdir()
    local = base / "local.json"
    # Preflight passes on this machine: CPU device, storage that is no mount.
    local.write_text(
        json.dumps(
            {
                "vllm_fleet_device": "cpu",
                "vllm_fleet_storage_root": str(storage),
                "preflight_storage_must_be_mount": False,
            }
        )
    )
    return {"password": password, "vaulted": vaulted, "plain": plain, "local": local}


def _env(setup: dict[str, Path]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "VLLM_FLEET"))}
    env.update(
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_VAULT_PASSWORD_FILE=str(setup["password"]),
        ANSIBLE_NOCOLOR="1",
        PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
    )
    return env


def playbook(
    setup: dict[str, Path], secrets: str, *args: str, entry: str = "deploy.yml"
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(LOCAL), str(ROOT / entry),
         "-e", f"@{setup['local']}", "-e", f"@{setup[secrets]}", *args],
        cwd=ROOT, env=_env(setup), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def no_secret(output: str) -> None:
    leaked = [s for s in SECRETS if s in output]
    assert leaked == [], f"secrets in the output: {leaked}"


@pytest.mark.parametrize("entry", ["deploy.yml", "playbooks/serve_alone.yml"])
@pytest.mark.parametrize("secrets", ["vaulted", "plain"])
@pytest.mark.parametrize("verbosity", [[], ["-vvv"]])
def test_bad_role_variable_fails_in_validate_without_secrets(
    setup: dict[str, Path], secrets: str, verbosity: list[str], entry: str
) -> None:
    done = playbook(
        setup,
        secrets,
        "--tags",
        "service",
        "-e",
        "vllm_service_restart_sec=ten",
        *verbosity,
        entry=entry,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert "Invalid variables, nothing was changed" in output
    assert "vllm_service_restart_sec" in output and "convert to int" in output
    # Stopped in validate: no later play ran, so no rescue rolled anything back.
    assert "PLAY [Preflight]" not in output and "PLAY [Serve" not in output
    assert "last good release" not in output
    no_secret(output)


@pytest.mark.parametrize(
    ("variables", "names"),
    [
        ({"vllm_fleet_engine_args": {"api-key": PLAIN_KEY, "max-model-len": 512}},
         ["api-key -> put it in vault as vllm_fleet_api_key"]),
        ({"vllm_fleet_engine_args": {"--hf-token": PLAIN_TOKEN}},
         ["hf-token -> put it in vault as vllm_fleet_hf_token"]),
        ({"vllm_fleet_engine_env": {"HF_TOKEN": PLAIN_TOKEN, "VLLM_API_KEY": PLAIN_KEY,
                                    "VLLM_CPU_KVCACHE_SPACE": "1"}},
         ["HF_TOKEN -> put it in vault as vllm_fleet_hf_token",
          "VLLM_API_KEY -> put it in vault as vllm_fleet_api_key"]),
        ({"vllm_service_env": {"HUGGING_FACE_HUB_TOKEN": PLAIN_TOKEN}},
         ["HUGGING_FACE_HUB_TOKEN -> put it in vault as vllm_fleet_hf_token"]),
        ({"vllm_fleet_engine_env": {"RAY_AUTH_TOKEN": PLAIN_TOKEN}},
         ["RAY_AUTH_TOKEN -> put it in vault as vllm_fleet_ray_token"]),
    ],
)  # fmt: skip
def test_secrets_in_engine_arguments_are_refused_naming_the_vault_variable(
    setup: dict[str, Path], variables: dict, names: list[str]
) -> None:
    done = playbook(setup, "vaulted", "--tags", "service", "-e", json.dumps(variables))
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    flat = " ".join(output.split())
    for name in names:
        assert name in flat, flat[-2000:]
    assert "PLAY [Preflight]" not in output
    # Harmless names next to them are not reported.
    assert "max-model-len ->" not in flat and "VLLM_CPU_KVCACHE_SPACE ->" not in flat
    no_secret(output)


def test_cli_json_output_of_a_failed_deploy_has_no_secret(setup: dict[str, Path]) -> None:
    done = subprocess.run(
        [str(BIN / "vllm-fleet"), "deploy", "-i", str(LOCAL), "--json", "--tags", "service",
         "-e", f"@{setup['local']}", "-e", f"@{setup['vaulted']}",
         "-e", f"@{setup['plain']}", "-e", "vllm_service_restart_sec=ten"],
        cwd=ROOT, env=_env(setup), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert records and "vllm_service_restart_sec" in json.dumps(records)
    no_secret(output)
