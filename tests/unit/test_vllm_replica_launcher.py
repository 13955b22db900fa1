"""roles/vllm_service/files/vllm_replica.py: each node of a replica ends when another does.

The watches run for real (processes, TCP on loopback); no vLLM is started: the
process that would run the engine only sleeps, standing in for it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "roles/vllm_service/files/vllm_replica.py"
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


def test_the_leader_names_the_follower_that_went_and_exits_75() -> None:
    port = free_port()
    leader = stand_in(
        f"server = socket.create_server(('127.0.0.1', {port}))\n"
        "threading.Thread(target=replica.watch_followers, args=(server,), daemon=True).start()"
    )
    try:
        follower = connect(port)
        follower.sendall(b"follower gpu-b (rank 1)\n")
        time.sleep(0.5)
        assert leader.poll() is None, "the leader ended while its follower was there"
        follower.close()
        assert leader.wait(timeout=10) == 75
    finally:
        leader.kill()
    err = leader.stderr.read() if leader.stderr else ""
    assert "vllm-fleet replica: follower gpu-b (rank 1) joined" in err
    assert "follower gpu-b (rank 1) is gone: exiting (75) so that the replica restarts whole" in err


def test_a_follower_waits_for_its_leader_then_ends_with_it() -> None:
    port = free_port()
    follower = stand_in(
        "threading.Thread(target=replica.watch_leader, "
        f"args=('127.0.0.1', {port}, 'gpu-b', '1'), daemon=True).start()"
    )
    try:
        # No leader yet: the follower keeps trying and stays up.
        time.sleep(2.5)
        assert follower.poll() is None
        with socket.create_server(("127.0.0.1", port)) as server:
            server.settimeout(15)
            conn, _ = server.accept()
            assert conn.recv(64) == b"follower gpu-b (rank 1)\n"
            time.sleep(0.5)
            assert follower.poll() is None
            conn.close()
        assert follower.wait(timeout=10) == 75
    finally:
        follower.kill()
    err = follower.stderr.read() if follower.stderr else ""
    assert f"the leader at 127.0.0.1:{port} is gone" in err


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
            assert conn.recv(64) == b"follower gpu-b (Ray worker)\n"
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
