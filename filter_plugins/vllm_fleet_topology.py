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

from ansible.errors import AnsibleFilterError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# What every node of one replica must agree on (each node's own values, after
# the inventory's group_vars and host_vars).
SHARED = (
    "vllm_fleet_model",
    "vllm_fleet_vllm_package",
    "vllm_fleet_vllm_version",
    "vllm_fleet_tensor_parallel_size",
    "vllm_fleet_pipeline_parallel_size",
    "vllm_fleet_executor",
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
    unkeyed = [m["host"] for m in members if not _true(m.get("replica_secret"))]
    if unkeyed and len(members) > 1:
        problems.append(
            f"replica {name}: its watch needs vllm_fleet_replica_secret on "
            f"{', '.join(unkeyed)} (in vault, the same on every node of the replica): "
            "without it a stranger on the watch port could end the replica"
        )
    untokened = [m["host"] for m in members if not _true(m.get("ray_token"))]
    if first.get("vllm_fleet_executor") == "ray" and untokened:
        problems.append(
            f"replica {name}: the ray executor needs vllm_fleet_ray_token on "
            f"{', '.join(untokened)} (in vault, the same on every node of the replica): "
            "a Ray port without a token runs any code sent to it"
        )
    return problems


def _true(value: Any) -> bool:
    # set_fact hands a templated boolean over as a bool or its text.
    return str(value).lower() == "true"


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
LEADER = {
    "leader": "leader_host",
    "leader address": "leader_ip",
    "leader port": "port",
    "leader API port": "api_port",
    "executor": "executor",
}
# vllm_service's default port, for a leader whose inventory sets none.


def _replica_name(hostvars: Mapping[str, Any], host: str) -> str:
    return str(hostvars[host].get("vllm_fleet_replica") or "")


def replica_of(
    name: str,
    host: str,
    hostvars: Mapping[str, Any],
    hosts: Sequence[str],
    default_api_port: int,
) -> dict[str, Any]:
    """``host``'s replica ``name`` (its own vllm_fleet_replica) among ``hosts``: node count,
    rank, leader, its address and its API port (where followers wait for the replica's
    /health; ``default_api_port``, role vllm_fleet's, where the leader's inventory sets
    none). A node in no replica reads no hostvars (each read merges a node's variables)."""
    name = str(name or "")
    if not name:
        return {
            "name": "", "nodes": 1, "rank": 0, "leader": host, "leader_address": "",
            "leader_api_port": 0, "leader_port": 0,
        }  # fmt: skip
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
        "leader_api_port": int(leading.get("vllm_fleet_port") or default_api_port),
        # Set on the leader like its address (or for the group); 0: the node's own.
        "leader_port": int(leading.get("vllm_fleet_replica_port") or 0),
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


def _spans(replica: Mapping[str, Any] | None) -> bool:
    """Whether a recorded replica (a release's, the plan's) has several nodes."""
    return bool(replica) and int(replica.get("nodes") or 1) > 1


def _shape(release: Mapping[str, Any]) -> str:
    """A release's place in a replica, in words (``release``: id and replica)."""
    replica = release.get("replica") or {}
    if not _spans(replica):
        return f"release {release.get('id') or 'none'} (alone)"
    return (
        f"release {release.get('id')} (rank {replica.get('rank')} of replica "
        f"{replica.get('name')}: {replica.get('nodes')} nodes led by {replica.get('leader_host')})"
    )


def _rollback_member_problems(member: Mapping[str, Any]) -> list[str]:
    problems = []
    for verb, key in (("runs", "now"), ("returns to", "to")):
        release = member.get(key) or {}
        recorded = release.get("replica") or {}
        if _spans(recorded) and recorded.get("name") != (member.get("replica") or ""):
            place = (
                f"puts it in replica {member['replica']}"
                if member.get("replica")
                else "has it alone"
            )
            problems.append(
                f"{member['host']} {verb} {_shape(release)}, but the inventory {place}: declare "
                f"replica {recorded.get('name')} again (vllm_fleet_replica, "
                "vllm_fleet_replica_rank) so that its nodes change together"
            )
    return problems


def rollback_problems(members: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every reason rollback.yml cannot return the replicas of ``members`` whole.

    ``members``: per node of the run, ``host``, ``replica`` (the inventory's
    vllm_fleet_replica), and the releases it runs (``now``) and returns to
    (``to``), each ``id`` and ``replica`` (its plan's replica, empty: alone).
    A replica's nodes return together, to releases of one shape: all alone, or
    all of the one replica the inventory declares, with all its nodes.
    """
    problems = [p for member in members for p in _rollback_member_problems(member)]
    named = _by_replica([member for member in members if member.get("replica")])
    for name, nodes in sorted(named.items()):
        targets = [(m["host"], (m.get("to") or {}).get("replica") or {}) for m in nodes]
        shapes = {
            (r.get("name"), r.get("nodes"), r.get("leader_host")) if _spans(r) else None
            for _, r in targets
        }
        found = ", ".join(f"{m['host']}: {_shape(m.get('to') or {})}" for m in nodes)
        if len(shapes) > 1:
            problems.append(
                f"replica {name}: its nodes return to releases of different shapes ({found})"
            )
        elif _spans(targets[0][1]) and int(targets[0][1]["nodes"]) != len(nodes):
            problems.append(
                f"replica {name}: its {len(nodes)} nodes return to releases of a replica of "
                f"{targets[0][1]['nodes']} nodes ({found})"
            )
    return problems


def _rollout_units(hosts: Sequence[str], hostvars: Mapping[str, Any]) -> list[list[str]]:
    """``hosts`` as rollout units: a replica's nodes together, in its first node's place
    (the plan's replica; without a plan, as in rollback.yml, the inventory's)."""
    units: dict[str, list[str]] = {}
    for host in hosts:
        replica = (hostvars[host].get("vllm_fleet_plan") or {}).get("replica") or {}
        name = replica.get("name") or _replica_name(hostvars, host)
        units.setdefault(name or f"node {host}", []).append(host)
    return list(units.values())


def _rollout(groups: Mapping[str, Sequence[str]], hostvars: Mapping[str, Any]) -> tuple:
    # The rolling groups fill in the order the nodes answered the compare play;
    # the batches follow the inventory's order instead, the same every run.
    place = {host: index for index, host in enumerate(groups.get("all", []))}

    def in_order(name: str) -> list[str]:
        return sorted(groups.get(name, []), key=lambda host: place.get(host, len(place)))

    idle = _rollout_units(in_order("vllm_fleet_rollout_idle"), hostvars)
    live = _rollout_units(in_order("vllm_fleet_rollout_live"), hostvars)
    return idle, live


def rollout_hosts(groups: Mapping[str, Sequence[str]], hostvars: Mapping[str, Any]) -> list[str]:
    """The serve play's hosts: the nodes that do not serve, then those that do, each
    in the inventory's order, each replica's nodes side by side (serial batches never
    split one)."""
    idle, live = _rollout(groups, hostvars)
    return [host for unit in idle + live for host in unit]


def _units_per_batch(serial: Any, units: int) -> int:
    text = str(serial).strip()
    if text.endswith("%") and text[:-1].isdigit():
        return max(1, units * int(text[:-1]) // 100)
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise AnsibleFilterError(
        f"vllm_fleet_serial {serial!r}: with replicas of several nodes it counts replicas, "
        "so it must be a whole number above 0 or a percentage such as 25%"
    )


def rollout_serial(
    groups: Mapping[str, Sequence[str]], hostvars: Mapping[str, Any], serial: Any
) -> list[Any]:
    """The serve play's serial: every node that does not serve in one batch, then
    ``serial`` serving nodes at a time; with replicas of several nodes, ``serial``
    replicas at a time, each batch the sum of their nodes."""
    idle, live = _rollout(groups, hostvars)
    head = [sum(len(unit) for unit in idle)] if idle else []
    if all(len(unit) == 1 for unit in live):
        return [*head, *(serial if isinstance(serial, list) else [serial])]
    per = _units_per_batch(serial, len(live))
    return head + [
        sum(len(unit) for unit in live[start : start + per]) for start in range(0, len(live), per)
    ]


class FilterModule:
    """vllm_fleet_replicas, vllm_fleet_replica_problems, vllm_fleet_replica_of,
    vllm_fleet_replica_disagreements, vllm_fleet_rollback_problems, vllm_fleet_rollout_hosts,
    vllm_fleet_rollout_serial."""

    def filters(self) -> dict[str, Any]:
        return {
            "vllm_fleet_replicas": replicas,
            "vllm_fleet_replica_problems": replica_problems,
            "vllm_fleet_replica_of": replica_of,
            "vllm_fleet_replica_disagreements": replica_disagreements,
            "vllm_fleet_rollback_problems": rollback_problems,
            "vllm_fleet_rollout_hosts": rollout_hosts,
            "vllm_fleet_rollout_serial": rollout_serial,
        }
