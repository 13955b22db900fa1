"""Drive the project's playbooks through ansible-runner's Python API.

Everything the user gives is checked before Ansible starts (project, inventory,
limit, extra vars), so a typo costs a clear message and exit 2, not a
half-run. Extra vars travel in 0600 files inside a private temporary
directory, never on ansible-playbook's argv (ansible-runner would put a dict
of extravars there, visible in ``ps``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vllm_fleet.redact import all_values, secret_values, vaulted_values

PROJECT_ENV = "VLLM_FLEET_PROJECT"
FLEET_GROUP = "gpu-nodes"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class UsageError(Exception):
    """Bad input found before Ansible runs: the CLI prints it and exits 2."""


@dataclass
class RunRequest:
    """One ansible-playbook run, as the CLI resolved it."""

    project_dir: Path
    playbook: str
    inventory: Path
    limit: str | None = None
    tags: str | None = None
    skip_tags: str | None = None
    check: bool = False
    diff: bool = False
    verbosity: int = 0
    # Ordered like the command line: dicts (from key=value or inline JSON/YAML)
    # and Paths (from @file); later ones win, as with ansible-playbook -e.
    extravars: list[dict[str, Any] | Path] = field(default_factory=list)
    forks: int | None = None


@dataclass
class RunResult:
    """What ansible-runner reports once the run ends."""

    status: str
    rc: int


def is_project_dir(path: Path) -> bool:
    """A project root holds ansible.cfg, deploy.yml and playbooks/."""
    return (
        (path / "ansible.cfg").is_file()
        and (path / "deploy.yml").is_file()
        and (path / "playbooks").is_dir()
    )


def find_project_dir(explicit: str | None = None) -> Path:
    """--project-dir, then $VLLM_FLEET_PROJECT, then this package's checkout, then cwd upwards."""
    named = explicit or os.environ.get(PROJECT_ENV)
    if named:
        path = Path(named).expanduser().resolve()
        if not is_project_dir(path):
            source = "--project-dir" if explicit else f"${PROJECT_ENV}"
            raise UsageError(
                f"{source} {named!r} is not a vllm-fleet project "
                "(expected ansible.cfg, deploy.yml and playbooks/ there)"
            )
        return path
    # The package is installed editable from src/vllm_fleet/ of the checkout.
    candidates = [Path(__file__).resolve().parents[2], *[Path.cwd(), *Path.cwd().parents]]
    for path in candidates:
        if is_project_dir(path):
            return path
    raise UsageError(
        "cannot find the vllm-fleet project (ansible.cfg, deploy.yml, playbooks/): "
        f"pass --project-dir or set ${PROJECT_ENV}"
    )


def default_inventory(project_dir: Path) -> Path:
    """The inventory ansible.cfg names, relative to the project."""
    import configparser

    parser = configparser.ConfigParser(interpolation=None)
    parser.read(project_dir / "ansible.cfg")
    name = parser.get("defaults", "inventory", fallback="inventory/demo/hosts.yml")
    return (project_dir / name.split(",")[0].strip()).resolve()


def resolve_inventory(project_dir: Path, name: str | None) -> Path:
    """An existing inventory file or directory; relative names are tried from cwd, then project."""
    if name is None:
        path = default_inventory(project_dir)
        if not path.exists():
            raise UsageError(
                f"the default inventory {path} does not exist (bring the demo fleet up "
                "first, or pass -i INVENTORY, e.g. -i inventory/local/hosts.yml)"
            )
        return path
    given = Path(name).expanduser()
    bases = [Path.cwd()] if given.is_absolute() else list(dict.fromkeys([Path.cwd(), project_dir]))
    for base in bases:
        path = base / given
        if path.exists():
            return path.resolve()
    where = " or ".join(str(base) for base in bases)
    raise UsageError(f"inventory {name!r} not found (relative to {where})")


def parse_extravar(item: str, base: Path | None = None) -> dict[str, Any] | Path:
    """One -e value: @file, an inline JSON/YAML mapping, or key=value pairs."""
    item = item.strip()
    if not item:
        raise UsageError("-e needs a value: key=value, @file or a JSON/YAML mapping")
    if item.startswith("@"):
        return _extravars_file(item[1:], base)
    if item.startswith("{"):
        try:
            loaded = yaml.safe_load(item)
        except yaml.YAMLError as exc:
            raise UsageError(f"-e {item[:40]!r}...: not valid JSON/YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise UsageError(f"-e {item[:40]!r}: expected a mapping")
        return loaded
    pairs: dict[str, Any] = {}
    for token in shlex.split(item):
        key, sep, value = token.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(
                f"-e {token!r}: expected key=value (a valid variable name), "
                "@file or a JSON/YAML mapping"
            )
        pairs[key] = value
    return pairs


def _extravars_file(name: str, base: Path | None) -> Path:
    path = Path(name).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    if not path.is_file():
        raise UsageError(f"-e @{name}: file not found")
    return path.resolve()


def secrets_in(extravars: list[dict[str, Any] | Path], *var_bases: Path) -> set[str]:
    """Secret values from the extra vars and the variable files of var_bases.

    var_bases: the inventory (file or directory) and the project, whose
    group_vars/ and host_vars/ Ansible reads.

    Secret-named values of plain files and mappings, and every vault-encrypted
    value (inline !vault or a whole encrypted file), whatever its key; vaults
    open with Ansible's own configured password file or identities.
    """
    found: set[str] = set()
    for item in extravars:
        if isinstance(item, Path):
            found |= _file_secrets(item, named=True)
        else:
            found |= secret_values(item)
    for base in var_bases:
        for path in _var_files(base):
            found |= _file_secrets(path, named=False)
    return found


def _var_files(base: Path) -> list[Path]:
    """group_vars/ and host_vars/ files beside an inventory file, or in a directory."""
    folder = base if base.is_dir() else base.parent
    files: list[Path] = []
    for sub in ("group_vars", "host_vars"):
        if (folder / sub).is_dir():
            files += sorted(p for p in (folder / sub).rglob("*") if p.is_file())
    return files


def _file_secrets(path: Path, named: bool) -> set[str]:
    """Vaulted values of a vars file (all of a whole-file vault); secret-named ones when named."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return set()
    if "$ANSIBLE_VAULT" not in text:
        if not named:
            return set()
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError:
            return set()
        return secret_values(loaded) if isinstance(loaded, dict) else set()
    data = _ansible_load(path)
    if data is None:
        return set()
    if text.lstrip().startswith("$ANSIBLE_VAULT"):
        return all_values(data)
    return vaulted_values(data, _is_vaulted) | (secret_values(data) if named else set())


def _ansible_load(path: Path) -> Any:
    """A vars file decrypted with Ansible's configured vault secrets, or None.

    Inline !vault values come back as _Vaulted strings; a whole-file vault as
    its plain data.
    """
    from ansible.errors import AnsibleError

    try:
        vault = _vault_lib()
        text = path.read_text()
        if text.lstrip().startswith("$ANSIBLE_VAULT"):
            return yaml.safe_load(vault.decrypt(text.encode()))
        return yaml.load(text, Loader=_vault_loader(vault))
    except (AnsibleError, OSError, ValueError, yaml.YAMLError):
        # Ansible reports a vault it cannot open itself, before any task runs.
        return None


def _vault_lib() -> Any:
    """VaultLib over the password files/identities Ansible's config names."""
    from ansible import constants
    from ansible.parsing.dataloader import DataLoader
    from ansible.parsing.vault import VaultLib, get_file_vault_secret

    sources = (
        [("default", constants.DEFAULT_VAULT_PASSWORD_FILE)]
        if constants.DEFAULT_VAULT_PASSWORD_FILE
        else []
    )
    for identity in constants.DEFAULT_VAULT_IDENTITY_LIST or []:
        vault_id, _, source = identity.rpartition("@")
        if source != "prompt":
            sources.append((vault_id or "default", source))
    vault_secrets = []
    for vault_id, source in sources:
        secret = get_file_vault_secret(filename=source, vault_id=vault_id, loader=DataLoader())
        secret.load()
        vault_secrets.append((vault_id, secret))
    return VaultLib(vault_secrets)


def _vault_loader(vault: Any) -> type[yaml.SafeLoader]:
    """A SafeLoader that decrypts !vault scalars into _Vaulted strings."""

    class Loader(yaml.SafeLoader):
        pass

    def construct(loader: yaml.SafeLoader, node: yaml.Node) -> _Vaulted:
        ciphertext = loader.construct_scalar(node)  # type: ignore[arg-type]
        return _Vaulted(vault.decrypt(str(ciphertext).encode()).decode())

    Loader.add_constructor("!vault", construct)
    return Loader


class _Vaulted(str):
    """A decrypted vault value, still known as one."""


def _is_vaulted(value: Any) -> bool:
    return isinstance(value, _Vaulted)


def list_hosts(request: RunRequest, pattern: str = FLEET_GROUP) -> list[str]:
    """Hosts a run would target, as ansible itself resolves inventory + limit.

    Raises UsageError for an inventory Ansible cannot parse or a limit that
    matches no host of the fleet group.
    """
    hosts, error = _ansible_list_hosts(request, pattern, request.limit)
    if error is None and hosts:
        return hosts
    if request.limit is not None:
        known, base_error = _ansible_list_hosts(request, pattern, None)
        if base_error is None:
            available = ", ".join(known) if known else "none"
            raise UsageError(
                f"--limit {request.limit!r} matches no host of group {pattern} in "
                f"{request.inventory} (hosts there: {available})"
            )
        error = base_error
    if error is None:
        raise UsageError(f"inventory {request.inventory} has no host in group {pattern}")
    raise UsageError(f"cannot use inventory {request.inventory}: {error}")


def _ansible_list_hosts(
    request: RunRequest, pattern: str, limit: str | None
) -> tuple[list[str], str | None]:
    command = [
        _tool("ansible"),
        pattern,
        "-i",
        str(request.inventory),
        "--list-hosts",
    ]
    if limit is not None:
        command += ["--limit", limit]
    env = ansible_env(request.project_dir)
    done = subprocess.run(
        command,
        cwd=request.project_dir,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return [], _ansible_error(done.stderr + done.stdout)
    lines = [line.strip() for line in done.stdout.splitlines()]
    return [line for line in lines if line and not line.startswith("hosts (")], None


def _ansible_error(text: str) -> str:
    """The lines of ansible's stderr that say what went wrong."""
    lines = [ANSI.sub("", line).strip() for line in text.splitlines()]
    errors = [line for line in lines if line.startswith("[ERROR]") or "Unable to parse" in line]
    chosen = errors or [line for line in lines if line][-2:]
    return "; ".join(re.sub(r"^\[(ERROR|WARNING)\]:\s*", "", line) for line in chosen) or "failed"


def _tool(name: str) -> str:
    """An Ansible executable from the same environment as this CLI."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else name


def ansible_env(project_dir: Path) -> dict[str, str]:
    """Environment for every Ansible process the CLI starts."""
    bindir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    return {
        "ANSIBLE_CONFIG": str(project_dir / "ansible.cfg"),
        # A typo'd or broken inventory must fail, not fall back to localhost.
        "ANSIBLE_INVENTORY_UNPARSED_FAILED": "1",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "PATH": bindir if not path else f"{bindir}{os.pathsep}{path}",
    }


def _write_extravars(directory: Path, extravars: list[dict[str, Any] | Path]) -> list[str]:
    """-e @FILE arguments, in order; inline vars go to 0600 files in the private dir."""
    args: list[str] = []
    vars_dir = directory / "vars"
    vars_dir.mkdir(mode=0o700)
    for index, item in enumerate(extravars):
        if isinstance(item, Path):
            args += ["-e", f"@{item}"]
            continue
        path = vars_dir / f"{index:03d}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(item, handle)
        args += ["-e", f"@{path}"]
    return args


def run_playbook(
    request: RunRequest,
    event_handler: Callable[[dict[str, Any]], None],
    cancel: Callable[[], bool] | None = None,
) -> RunResult:
    """Run the playbook; every runner event goes to event_handler as it happens."""
    import ansible_runner

    with tempfile.TemporaryDirectory(prefix="vllm-fleet-") as private:
        private_dir = Path(private)
        cmdline = _write_extravars(private_dir, request.extravars)
        if request.check:
            cmdline.append("--check")
        if request.diff:
            cmdline.append("--diff")

        broken: list[str] = []

        def on_event(event: dict[str, Any]) -> bool:
            try:
                event_handler(event)
            except Exception as exc:  # a display bug must not abort a deploy midway
                if not broken:
                    sys.stderr.write(f"vllm-fleet: cannot display an event ({exc!r}); continuing\n")
                broken.append(repr(exc))
            # False: runner keeps no copy of the event (it may hold secrets) on disk.
            return False

        runner = ansible_runner.run(
            private_data_dir=str(private_dir),
            project_dir=str(request.project_dir),
            playbook=request.playbook,
            inventory=str(request.inventory),
            limit=request.limit,
            tags=request.tags,
            skip_tags=request.skip_tags,
            verbosity=request.verbosity or None,
            forks=request.forks,
            cmdline=shlex.join(cmdline),
            envvars=ansible_env(request.project_dir),
            event_handler=on_event,
            cancel_callback=cancel,
            quiet=True,
            suppress_env_files=True,
            rotate_artifacts=1,
        )
        return RunResult(status=str(runner.status), rc=int(runner.rc or 0))
