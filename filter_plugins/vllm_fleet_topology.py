# Copyright: vllm-fleet contributors
# Apache-2.0
"""Filters: the fleet's replicas from the inventory, and every problem with them.

A replica is one node (the default) or the nodes that share a
``vllm_fleet_replica`` name, ranked by ``vllm_fleet_replica_rank`` (0 leads).
The validation play (playbooks/validate.yml) reports every problem at once;
role preflight reads a node's replica (``vllm_fleet_replica_of``: its leader's
address from ``vllm_fleet_replica_address``, else ``ansible_host``, else its
name) and compares the plans of a replica's nodes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# What every node of one replica must agree on (each node's own values, after
# the inventory's group_vars and host_vars).
SHARED = (
    "vllm_fleet_model",
    "vllm_fleet_vllm_package",
    "vllm_fleet_vllm_version",
    "vllm_fleet_tensor_parallel_size",
    "vllm_fleet_pipeline_parallel_size",
)


def _whole(value: Any) -> int | None:
    """A rank or parallel size as an int, or None when it is not a whole number >= 0."""
    if isinstance(value, bool):
        return None
    try:
        rank = int(value)
    except (TypeError, ValueError):
        return None
    return rank if rank >= 0 and str(value).strip() == str(rank) else None


def _by_replica(members: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Replica name -> its members, in the play's order; a node without a replica is its own."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for member in members:
        groups.setdefault(str(member.get("replica") or member["host"]), []).append(member)
    return groups


def replicas(members: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Replica name -> its nodes by rank; a node without a replica is its own."""
    return {
        name: [m["host"] for m in sorted(nodes, key=lambda m: _whole(m.get("rank")) or 0)]
        for name, nodes in _by_replica(members).items()
    }


def _membership_problems(members: Sequence[Mapping[str, Any]]) -> list[str]:
    problems = []
    for member in members:
        host, replica, rank = member["host"], member.get("replica") or "", member.get("rank")
        if not replica:
            if rank is not None:
                problems.append(
                    f"{host} sets vllm_fleet_replica_rank {rank!r} but no vllm_fleet_replica"
                )
            continue
        if not isinstance(replica, str) or not NAME_RE.match(replica):
            problems.append(
                f"{host}: vllm_fleet_replica {replica!r} is not a name "
                "(letters, digits, '.', '_', '-')"
            )
        if rank is None:
            problems.append(f"{host} is in replica {replica} but sets no vllm_fleet_replica_rank")
        elif _whole(rank) is None:
            problems.append(f"{host}: vllm_fleet_replica_rank {rank!r} is not a whole number >= 0")
    return problems


def _rank_problems(name: str, members: Sequence[Mapping[str, Any]]) -> list[str]:
    by_rank: dict[int, list[str]] = {}
    for member in members:
        rank = _whole(member.get("rank"))
        if rank is not None:
            by_rank.setdefault(rank, []).append(member["host"])
    problems = [
        f"replica {name}: rank {rank} is set on {', '.join(hosts)} (one node per rank)"
        for rank, hosts in sorted(by_rank.items())
        if len(hosts) > 1
    ]
    if sum(map(len, by_rank.values())) < len(members):
        return problems  # a node without a valid rank is reported on its own
    expected = set(range(len(members)))
    parts = []
    if missing := sorted(expected - set(by_rank)):
        parts.append(f"missing {', '.join(map(str, missing))}")
    if beyond := sorted(set(by_rank) - expected):
        parts.append(f"out of range {', '.join(map(str, beyond))}")
    if parts:
        problems.append(
            f"replica {name}: its {len(members)} nodes need ranks 0..{len(members) - 1}, "
            f"one each ({'; '.join(parts)})"
        )
    return problems


def _agreement_problems(name: str, members: Sequence[Mapping[str, Any]]) -> list[str]:
    problems = []
    for var in SHARED:
        values = {str(member.get(var)) for member in members}
        if len(values) > 1:
            found = ", ".join(f"{m['host']}: {m.get(var)}" for m in members)
            problems.append(f"replica {name}: its nodes differ in {var} ({found})")
    if problems:
        return problems
    first = members[0]
    world = _whole(first.get("vllm_fleet_tensor_parallel_size"))
    pipeline = _whole(first.get("vllm_fleet_pipeline_parallel_size"))
    if world and pipeline and (world * pipeline) % len(members):
        problems.append(
            f"replica {name}: tensor x pipeline parallel = {world} x {pipeline} = "
            f"{world * pipeline} does not split evenly over its {len(members)} nodes "
            "(each node runs the same number of ranks)"
        )
    return problems


def replica_problems(
    members: Sequence[Mapping[str, Any]], inventory: Mapping[str, Any] | None = None
) -> list[str]:
    """Every problem with the replicas of ``members`` (the play's nodes).

    ``members``: per node of the play, ``host``, ``replica``, ``rank`` and the
    SHARED values. ``inventory``: every fleet node -> its ``vllm_fleet_replica``,
    to find a replica that the run's limit (-l) cuts in two.
    """
    problems = _membership_problems(members)
    named = _by_replica([member for member in members if member.get("replica")])
    in_run = {member["host"] for member in members}
    for name, nodes in sorted(named.items()):
        left_out = sorted(
            host for host, replica in (inventory or {}).items()
            if replica == name and host not in in_run
        )  # fmt: skip
        if left_out:
            problems.append(
                f"replica {name}: {', '.join(left_out)} not in this run (-l); "
                "a replica's nodes change together"
            )
        problems += _rank_problems(name, nodes) + _agreement_problems(name, nodes)
    return problems


# What every node of one replica must plan alike (vllm_fleet_plan), and where
# each must find the leader.
ALIKE = (
    "device",
    "vllm_version",
    "kv_cache_quant",
    "expected_attention_backend",
    "tensor_parallel_size",
    "pipeline_parallel_size",
)
LEADER = {"leader address": "leader_ip", "leader port": "port"}


def _replica_name(hostvars: Mapping[str, Any], host: str) -> str:
    return str(hostvars[host].get("vllm_fleet_replica") or "")


def replica_of(host: str, hostvars: Mapping[str, Any], hosts: Sequence[str]) -> dict[str, Any]:
    """``host``'s replica among ``hosts``: name, node count, rank, leader and its address."""
    name = _replica_name(hostvars, host)
    if not name:
        return {"name": "", "nodes": 1, "rank": 0, "leader": host, "leader_address": ""}
    members = [other for other in hosts if _replica_name(hostvars, other) == name]
    leader = next(
        (m for m in members if str(hostvars[m].get("vllm_fleet_replica_rank")) == "0"), ""
    )
    leading = hostvars[leader] if leader else {}
    address = leading.get("vllm_fleet_replica_address") or leading.get("ansible_host") or leader
    return {
        "name": name,
        "nodes": len(members),
        "rank": int(hostvars[host].get("vllm_fleet_replica_rank") or 0),
        "leader": leader,
        "leader_address": str(address),
    }


def _shared(plan: Mapping[str, Any]) -> dict[str, Any]:
    """What a node's plan must share with the rest of its replica."""
    leader = {label: plan["replica"].get(key) for label, key in LEADER.items()}
    return {**{key: plan.get(key) for key in ALIKE}, **leader}


def replica_disagreements(hosts: Sequence[str], hostvars: Mapping[str, Any]) -> list[str]:
    """Every way the nodes of one replica plan differently (each node's vllm_fleet_plan)."""
    groups: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for host in hosts:
        plan = hostvars[host].get("vllm_fleet_plan") or {}
        if (plan.get("replica") or {}).get("name"):
            groups.setdefault(plan["replica"]["name"], []).append((host, _shared(plan)))
    problems = []
    for name, members in sorted(groups.items()):
        for key in members[0][1]:
            if len({str(shared[key]) for _, shared in members}) > 1:
                found = ", ".join(f"{host}: {shared[key]}" for host, shared in members)
                problems.append(f"replica {name}: its nodes plan different {key} ({found})")
    return problems


class FilterModule:
    """vllm_fleet_replicas, vllm_fleet_replica_problems, vllm_fleet_replica_of,
    vllm_fleet_replica_disagreements."""

    def filters(self) -> dict[str, Any]:
        return {
            "vllm_fleet_replicas": replicas,
            "vllm_fleet_replica_problems": replica_problems,
            "vllm_fleet_replica_of": replica_of,
            "vllm_fleet_replica_disagreements": replica_disagreements,
        }
