"""One node of a multi-node vLLM replica, bound to the others' lives.

Managed by Ansible (role vllm_service). vLLM launches one replica across nodes
itself (``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``):
the leader (rank 0) runs ``vllm serve``, every follower ``vllm serve
--headless``. Both run in this process through vLLM's CLI module
(``vllm.entrypoints.cli.main``, what the ``vllm`` console script runs), so
that the watch below lives exactly as long as the engine.

Neither side notices the other's death: a follower waits forever on the
process group, a leader stays healthy until a request reaches the dead rank.
Systemd cannot bind units across nodes, so each follower holds one TCP
connection to its leader's watch port, saying who it is. It proves that it
is one of the replica's nodes first: the leader sends a fresh nonce, the
follower answers with HMAC-SHA256 over it and its name, keyed with the
replica's secret (VLLM_FLEET_REPLICA_KEY, from the unit's 0600 environment
file; taken out of the environment before vLLM starts). A connection that
does not answer right within HANDSHAKE_S is a stranger: closed, logged with
its bytes sanitised, and it ends nothing. When an authenticated follower's
connection ends, the leader logs which one and exits; when the leader's ends,
the follower exits. Both exit with status 75, and their units' Restart=always
starts them again: the replica comes back whole, and the leader's journal
names the node that went first.

    vllm_replica.py leader LEADER_IP:WATCH_PORT NODE -- MODEL VLLM_SERVE_ARGS...
    vllm_replica.py follower LEADER_IP:WATCH_PORT NODE -- MODEL VLLM_SERVE_ARGS...

With the Ray executor the same watch binds the nodes, and each node's unit
runs its Ray process: the leader starts a Ray head (a child, at the port in
RAY_ADDRESS, on VLLM_HOST_IP), opens the watch port once the head listens,
and runs the API server, which joins the head through RAY_ADDRESS; a follower
waits for the leader's watch port, then runs a Ray worker joined to the head.
The leader exits when its head does, a follower with its worker's status.

    vllm_replica.py ray-head LEADER_IP:WATCH_PORT NODE -- MODEL VLLM_SERVE_ARGS...
    vllm_replica.py ray-worker LEADER_IP:WATCH_PORT NODE --
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import runpy
import socket
import subprocess
import sys
import threading
import time

# The exit status when another node of the replica is gone (EX_TEMPFAIL).
PEER_GONE = 75
RETRY_S = 2.0
# The watch's handshake: the time a peer has to answer, and what a stranger's
# bytes may put in the journal.
HANDSHAKE_S = 5.0
CHALLENGE = b"vllm-fleet-watch 1 "
LINE_MAX = 512
SHOWN_MAX = 64
KEY_ENV = "VLLM_FLEET_REPLICA_KEY"


def _log(message: str) -> None:
    # One write(2) per line: strangers are handled on threads at once, and print()
    # writes text and newline apart, so two lines could merge into one.
    line = f"vllm-fleet replica: {message}\n".encode(errors="backslashreplace")
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), line)


def _keepalive(conn: socket.socket) -> None:
    """A peer host that vanishes sends no FIN: keepalive finds it in about 20 s."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 2)):
        if hasattr(socket, option):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _until_closed(conn: socket.socket) -> None:
    try:
        while conn.recv(4096):
            pass
    except OSError:
        pass


def _gone(who: str) -> None:
    _log(f"{who} is gone: exiting ({PEER_GONE}) so that the replica restarts whole")
    os._exit(PEER_GONE)


def sanitised(data: bytes) -> str:
    """A peer's bytes fit for one journal line: printable ASCII, capped."""
    shown = "".join(chr(b) if 0x20 <= b < 0x7F else "?" for b in data[:SHOWN_MAX])
    return repr(shown + ("..." if len(data) > SHOWN_MAX else ""))


def proof(key: bytes, nonce: bytes, hello: str) -> str:
    """The follower's answer: bound to this connection's nonce and to its name."""
    return hmac.new(key, CHALLENGE + nonce + b"\0" + hello.encode(), hashlib.sha256).hexdigest()


def _read_line(conn: socket.socket, deadline: float) -> bytes:
    """Up to LINE_MAX bytes through the first newline, by the deadline (else: what came)."""
    data = b""
    while b"\n" not in data and len(data) < LINE_MAX:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        conn.settimeout(left)
        try:
            chunk = conn.recv(LINE_MAX - len(data))
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


def authenticated(conn: socket.socket, key: bytes) -> tuple[str | None, bytes]:
    """The follower's name once it proves it holds the key; None and its bytes if not."""
    nonce = os.urandom(32)
    try:
        conn.sendall(CHALLENGE + nonce.hex().encode() + b"\n")
    except OSError:
        return None, b""
    data = _read_line(conn, time.monotonic() + HANDSHAKE_S)
    line = data.split(b"\n", 1)[0] if b"\n" in data else b""
    mac, _, hello = line.decode("ascii", errors="replace").partition(" ")
    if hello and hmac.compare_digest(mac.encode(), proof(key, nonce, hello).encode()):
        return hello, data
    return None, data


def _follower_watched(conn: socket.socket, peer: str, key: bytes) -> None:
    hello, data = authenticated(conn, key)
    if hello is None:
        _log(f"a stranger at {peer} did not prove it is a node of this replica "
             f"(sent {sanitised(data)}): closed; the replica carries on")  # fmt: skip
        conn.close()
        return
    conn.settimeout(None)
    name = sanitised(hello.encode())[1:-1]
    _log(f"{name} joined")
    _until_closed(conn)
    _gone(name)


def watch_followers(server: socket.socket, key: bytes) -> None:
    """The leader: accept each connection; exit when an authenticated follower's ends."""
    while True:
        conn, where = server.accept()
        _keepalive(conn)
        peer = f"{where[0]}:{where[1]}"
        threading.Thread(target=_follower_watched, args=(conn, peer, key), daemon=True).start()


def _connect(address: str, port: int) -> socket.socket:
    """A connection to the leader's port, retried until it opens."""
    while True:
        try:
            conn = socket.create_connection((address, port), timeout=RETRY_S)
            break
        except OSError:
            time.sleep(RETRY_S)
    conn.settimeout(None)
    return conn


def _answer(conn: socket.socket, key: bytes, hello: str) -> None:
    """Answer the leader's challenge (a connection that sends none ends like a closed one)."""
    line = _read_line(conn, time.monotonic() + HANDSHAKE_S)
    conn.settimeout(None)
    if not line.startswith(CHALLENGE) or not line.endswith(b"\n"):
        return
    try:
        nonce = bytes.fromhex(line[len(CHALLENGE) :].strip().decode("ascii"))
    except ValueError:
        return
    conn.sendall(f"{proof(key, nonce, hello)} {hello}\n".encode())


def _watched(conn: socket.socket, address: str, port: int, hello: str, key: bytes) -> None:
    _keepalive(conn)
    with contextlib.suppress(OSError):
        _answer(conn, key, hello)
    _log(f"watching the leader at {address}:{port}")
    _until_closed(conn)
    _gone(f"the leader at {address}:{port}")


def watch_leader(address: str, port: int, node: str, rank: str, key: bytes) -> None:
    """A follower: connect to the leader's watch port (retried until it opens),
    prove who this is, and exit when the connection ends."""
    _watched(_connect(address, port), address, port, f"follower {node} (rank {rank})", key)


def ray_command(*args: str) -> list[str]:
    """Ray's CLI from the interpreter's venv (its console script beside python)."""
    return [os.path.join(os.path.dirname(sys.executable), "ray"), *args]


def _ray_address() -> tuple[str, str]:
    host, port = os.environ["RAY_ADDRESS"].rsplit(":", 1)
    return host.strip("[]"), port


def _ray_start_args() -> list[str]:
    # In the foreground (the unit's main process), and no usage report.
    return ["--block", "--disable-usage-stats"]


def start_ray_head(timeout_s: float = 120.0) -> subprocess.Popen[bytes]:
    """The leader's Ray head, a child of this process (in the unit's cgroup):
    returns once its port accepts connections; the node exits when it does."""
    host, port = _ray_address()
    head = subprocess.Popen(
        ray_command("start", "--head", "--port", port, "--node-ip-address",
                    os.environ.get("VLLM_HOST_IP", host), *_ray_start_args(),
                    # No dashboard: one more web service in the unit (a head-only flag).
                    "--include-dashboard=false")
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        if head.poll() is not None:
            _log(f"the Ray head exited ({head.returncode}) before it listened on {host}:{port}")
            sys.exit(head.returncode or 1)
        try:
            socket.create_connection((host, int(port)), timeout=RETRY_S).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                _log(f"the Ray head did not listen on {host}:{port} within {timeout_s:.0f} s")
                sys.exit(1)
            time.sleep(0.5)
    _log(f"Ray head listening on {host}:{port}")
    threading.Thread(target=_exit_with, args=(head, "the Ray head"), daemon=True).start()
    return head


def _exit_with(child: subprocess.Popen[bytes], what: str) -> None:
    child.wait()
    _log(f"{what} exited ({child.returncode})")
    _gone(what)


def run_ray_worker(address: str, watch_port: int, node: str, key: bytes) -> None:
    """A follower's Ray worker, started once the leader (and so its head) is up."""
    conn = _connect(address, watch_port)
    threading.Thread(
        target=_watched,
        args=(conn, address, watch_port, f"follower {node} (Ray worker)", key),
        daemon=True,
    ).start()
    head, port = _ray_address()
    worker = ray_command("start", "--address", f"{head}:{port}", *_ray_start_args())
    if "VLLM_HOST_IP" in os.environ:
        worker += ["--node-ip-address", os.environ["VLLM_HOST_IP"]]
    status = subprocess.call(worker)
    _log(f"the Ray worker exited ({status})")
    sys.exit(status or PEER_GONE)


def vllm_serve(args: list[str]) -> None:
    """Run `vllm serve ARGS` in this process (vLLM's CLI, the console script's module),
    so that the watch threads live as long as the engine."""
    sys.argv = ["vllm", "serve", *args]
    runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__", alter_sys=True)


def watch_port(address: str, port: str, key: bytes) -> None:
    """The leader's watch: bound here, not in the thread, so that a port in use
    stops the start with its error."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    server = socket.create_server((address, int(port)), family=family)
    threading.Thread(target=watch_followers, args=(server, key), daemon=True).start()


def replica_key() -> bytes:
    """The replica's secret, taken out of the environment (vLLM and Ray never see it)."""
    key = os.environ.pop(KEY_ENV, "")
    if not key:
        _log(f"no {KEY_ENV} in the environment (vllm_fleet_replica_secret): "
             "a replica's watch needs it to tell its nodes from strangers")  # fmt: skip
        sys.exit(1)
    return key.encode()


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1] if name in args else "?"


ROLES = ("leader", "follower", "ray-head", "ray-worker")


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[0] not in ROLES or argv[3] != "--":
        sys.exit(__doc__)
    role, where, node, _, *args = argv
    address, port = where.rsplit(":", 1)
    address = address.strip("[]")
    key = replica_key()
    if role == "ray-worker":
        run_ray_worker(address, int(port), node, key)
        return
    if role in ("leader", "ray-head"):
        if role == "ray-head":
            start_ray_head()
        watch_port(address, port, key)
        vllm_serve(args)
        return
    watch = (address, int(port), node, _option(args, "--node-rank"), key)
    threading.Thread(target=watch_leader, args=watch, daemon=True).start()
    vllm_serve([*args, "--headless"])


if __name__ == "__main__":
    main(sys.argv[1:])
