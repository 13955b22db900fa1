"""roles/vllm_service/files/vllm_replica.py: each node of a replica ends when another does,
and a stranger on the watch port ends nothing.

The watches run for real (processes, TCP on loopback); no vLLM is started: the
process that would run the engine only sleeps, standing in for it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "roles/vllm_service/files/vllm_replica.py"
KEY = "s3cret-of-r1"
CHALLENGE = b"vllm-fleet-watch 1 "
# Stands in for the engine: the launcher's watch thread, then a long sleep.
STAND_IN = """
import importlib.util, socket, sys, threading, time
spec = importlib.util.spec_from_file_location("vllm_replica", {launcher!r})
replica = importlib.util.module_from_spec(spec); spec.loader.exec_module(replica)
{start}
time.sleep(60)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stand_in(start: str) -> subprocess.Popen[str]:
    code = STAND_IN.format(launcher=str(LAUNCHER), start=start)
    return subprocess.Popen(
        [sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def connect(port: int, timeout: float = 10) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=1)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def answer(conn: socket.socket, hello: str, key: str = KEY) -> None:
    """What a follower answers to the leader's challenge (the protocol, written out again)."""
    line = conn.recv(256)
    assert line.startswith(CHALLENGE) and line.endswith(b"\n"), line
    nonce = bytes.fromhex(line[len(CHALLENGE) :].decode())
    mac = hmac.new(key.encode(), CHALLENGE + nonce + b"\0" + hello.encode(), hashlib.sha256)
    conn.sendall(f"{mac.hexdigest()} {hello}\n".encode())


def leader_stand_in(port: int) -> subprocess.Popen[str]:
    return stand_in(
        f"server = socket.create_server(('127.0.0.1', {port}))\n"
        "threading.Thread(target=replica.watch_followers, "
        f"args=(server, {KEY.encode()!r}), daemon=True).start()"
    )


def test_the_leader_names_the_follower_that_went_and_exits_75() -> None:
    port = free_port()
    leader = leader_stand_in(port)
    try:
        follower = connect(port)
        answer(follower, "follower gpu-b (rank 1)")
        time.sleep(0.5)
        assert leader.poll() is None, "the leader ended while its follower was there"
        follower.close()
        assert leader.wait(timeout=10) == 75
    finally:
        leader.kill()
    err = leader.stderr.read() if leader.stderr else ""
    assert "vllm-fleet replica: follower gpu-b (rank 1) joined" in err
    assert "follower gpu-b (rank 1) is gone: exiting (75) so that the replica restarts whole" in err


def test_a_stranger_on_the_watch_port_ends_nothing_and_is_named_sanitised() -> None:
    port = free_port()
    leader = leader_stand_in(port)
    try:
        follower = connect(port)
        answer(follower, "follower gpu-b (rank 1)")
        for _ in range(3):
            # Connect, send a forged hello, close.
            with connect(port) as conn:
                conn.sendall(b"follower gpu-z (rank 9)\nvllm-fleet replica: forged\x1b[2J\n")
            # Connect and say nothing.
            with connect(port):
                pass
            # Garbage, longer than a journal line may show.
            with connect(port) as conn:
                conn.sendall(bytes(range(256)) * 4)
            # A right-looking answer with the wrong key.
            with connect(port) as conn:
                answer(conn, "follower gpu-b (rank 1)", key="not-the-key")
                assert conn.recv(64) == b"", "the leader kept a connection with the wrong key"
        # Silent until the handshake times out: closed by the leader.
        with connect(port) as silent:
            silent.settimeout(10)
            silent.recv(256)
            started = time.monotonic()
            assert silent.recv(64) == b""
            assert time.monotonic() - started < 8
        assert leader.poll() is None, "a stranger ended the leader"
        # The real follower is still watched: its death still ends the leader.
        follower.close()
        assert leader.wait(timeout=10) == 75
    finally:
        leader.kill()
    err = leader.stderr.read() if leader.stderr else ""
    strangers = [line for line in err.splitlines() if "a stranger at 127.0.0.1:" in line]
    assert len(strangers) == 13, err
    assert all(line.startswith("vllm-fleet replica: a stranger at") for line in strangers)
    assert all(line.isascii() and line.isprintable() and len(line) < 220 for line in strangers)
    # The forged hello made no line of its own, and nothing the strangers sent joined.
    assert not any(line.startswith("vllm-fleet replica: forged") for line in err.splitlines())
    print(strangers[0], strangers[2], sep="\n")
    assert err.count(" joined") == 1
    assert "follower gpu-b (rank 1) is gone: exiting (75)" in err


def test_a_leader_without_the_key_refuses_to_start() -> None:
    done = subprocess.run(
        [sys.executable, str(LAUNCHER), "leader", "127.0.0.1:1", "n", "--"],
        capture_output=True, text=True, check=False, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 1
    assert "no VLLM_FLEET_REPLICA_KEY in the environment (vllm_fleet_replica_secret)" in done.stderr


def test_a_follower_waits_for_its_leader_then_ends_with_it() -> None:
    port = free_port()
    follower = stand_in(
        "threading.Thread(target=replica.watch_leader, "
        f"args=('127.0.0.1', {port}, 'gpu-b', '1', {KEY.encode()!r}), daemon=True).start()"
    )
    try:
        # No leader yet: the follower keeps trying and stays up.
        time.sleep(2.5)
        assert follower.poll() is None
        with socket.create_server(("127.0.0.1", port)) as server:
            server.settimeout(15)
            conn, _ = server.accept()
            assert_proves(conn, "follower gpu-b (rank 1)")
            time.sleep(0.5)
            assert follower.poll() is None
            conn.close()
        assert follower.wait(timeout=10) == 75
    finally:
        follower.kill()
    err = follower.stderr.read() if follower.stderr else ""
    assert f"the leader at 127.0.0.1:{port} is gone" in err


def assert_proves(conn: socket.socket, hello: str) -> None:
    """Challenge a follower as its leader does and check its answer."""
    nonce = bytes(range(32))
    conn.sendall(CHALLENGE + nonce.hex().encode() + b"\n")
    mac = hmac.new(KEY.encode(), CHALLENGE + nonce + b"\0" + hello.encode(), hashlib.sha256)
    assert conn.recv(256) == f"{mac.hexdigest()} {hello}\n".encode()


def test_wrong_usage_prints_the_usage() -> None:
    done = subprocess.run(
        [sys.executable, str(LAUNCHER), "boss", "127.0.0.1:1", "n", "--"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 1 and "vllm_replica.py follower LEADER_IP:WATCH_PORT" in done.stderr


# Stands in for Ray's CLI (ray start) where the launcher looks for it, beside the
# interpreter: it records its arguments; a "head" listens on its --port, a
# "worker" holds a connection to its --address; both until killed or cut off.
RAY_STAND_IN = """#!{python}
import socket, sys, time
args = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(" ".join(args) + "\\n")
if "--head" in args:
    server = socket.create_server(("127.0.0.1", int(args[args.index("--port") + 1])))
    while True:
        server.accept()
host, port = args[args.index("--address") + 1].rsplit(":", 1)
conn = socket.create_connection((host, int(port)))
while conn.recv(64):
    pass
sys.exit(3)
"""


def ray_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv-shaped bin/ holding python and the stand-in ray; and the stand-in's log."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/python").symlink_to(sys.executable)
    log = tmp_path / "ray-calls.log"
    ray = tmp_path / "bin/ray"
    ray.write_text(RAY_STAND_IN.format(python=sys.executable, log=str(log)))
    ray.chmod(0o755)
    return tmp_path / "bin/python", log


def ray_env(port: int) -> dict[str, str]:
    return {
        "RAY_ADDRESS": f"127.0.0.1:{port}",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_FLEET_REPLICA_KEY": KEY,
        "PATH": "/usr/bin:/bin",
    }


def test_a_ray_leader_starts_its_head_first_and_ends_with_it(tmp_path: Path) -> None:
    python, log = ray_venv(tmp_path)
    ray_port = free_port()
    code = STAND_IN.format(launcher=str(LAUNCHER), start="head = replica.start_ray_head(30)")
    leader = subprocess.Popen(
        [str(python), "-c", code], stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=ray_env(ray_port),
    )  # fmt: skip
    try:
        connect(ray_port).close()
        assert log.read_text().split() == [
            "start", "--head", "--port", str(ray_port), "--node-ip-address", "127.0.0.1",
            "--block", "--disable-usage-stats", "--include-dashboard=false",
        ]  # fmt: skip
        time.sleep(0.5)
        assert leader.poll() is None
        # The head dies (the stand-in, killed): the leader ends, for Restart= to bring both back.
        subprocess.run(["pkill", "-f", f"{tmp_path}/bin/ray"], check=False)
        assert leader.wait(timeout=10) == 75
    finally:
        leader.kill()
    err = leader.stderr.read() if leader.stderr else ""
    assert f"Ray head listening on 127.0.0.1:{ray_port}" in err
    assert "the Ray head is gone: exiting (75)" in err


def test_a_ray_worker_joins_after_its_leader_and_ends_with_it(tmp_path: Path) -> None:
    python, log = ray_venv(tmp_path)
    watch, ray_port = free_port(), free_port()
    worker = subprocess.Popen(
        [str(python), str(LAUNCHER), "ray-worker", f"127.0.0.1:{watch}", "gpu-b", "--"],
        stderr=subprocess.PIPE, text=True, start_new_session=True, env=ray_env(ray_port),
    )  # fmt: skip
    try:
        # No leader yet: no Ray worker is started.
        time.sleep(2.5)
        assert worker.poll() is None and not log.exists()
        with (
            socket.create_server(("127.0.0.1", ray_port)) as head,
            socket.create_server(("127.0.0.1", watch)) as server,
        ):
            server.settimeout(15)
            head.settimeout(15)
            conn, _ = server.accept()
            assert_proves(conn, "follower gpu-b (Ray worker)")
            joined, _ = head.accept()
            assert log.read_text().split() == [
                "start", "--address", f"127.0.0.1:{ray_port}", "--block",
                "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
            ]  # fmt: skip
            conn.close()
            assert worker.wait(timeout=10) == 75
            joined.close()
    finally:
        worker.kill()
    err = worker.stderr.read() if worker.stderr else ""
    assert f"the leader at 127.0.0.1:{watch} is gone" in err


# Stands in for vLLM's CLI module (the `vllm` console script's), which the
# launcher runs in its own process: it prints the argv it was run with and
# whether it ran as __main__. The real `vllm serve` runs in the e2e fleet.
CLI_STAND_IN = """import json, sys
if __name__ == "__main__":
    print(json.dumps(sys.argv), flush=True)
"""


@pytest.mark.parametrize("role", ["leader", "follower"])
def test_each_node_runs_vllm_serve_through_vllms_cli(tmp_path: Path, role: str) -> None:
    """The leader runs `vllm serve ARGS`, a follower `vllm serve ARGS --headless`,
    both through vLLM's public CLI (vllm.entrypoints.cli.main), not its internals."""
    cli = tmp_path / "site/vllm/entrypoints/cli"
    cli.mkdir(parents=True)
    for package in (cli.parents[1], cli.parent, cli):
        (package / "__init__.py").write_text("")
    (cli / "main.py").write_text(CLI_STAND_IN)
    args = [
        "/srv/m",
        "--tensor-parallel-size",
        "2",
        "--node-rank",
        "0" if role == "leader" else "1",
    ]
    done = subprocess.run(
        [sys.executable, str(LAUNCHER), role, f"127.0.0.1:{free_port()}", "node-a", "--", *args],
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site"), "VLLM_FLEET_REPLICA_KEY": KEY},
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    headless = ["--headless"] if role == "follower" else []
    # runpy sets argv[0] to the module's file, as `python -m` does; vLLM parses argv[1:].
    argv = json.loads(done.stdout.splitlines()[-1])
    assert argv[0].endswith("vllm/entrypoints/cli/main.py")
    assert argv[1:] == ["serve", *args, *headless]
