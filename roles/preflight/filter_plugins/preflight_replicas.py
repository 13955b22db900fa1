# Copyright: vllm-fleet contributors
# Apache-2.0
"""Filters: a node's replica as the inventory declares it, and the replica's plans.

Read from ``hostvars`` (the inventory's group_vars and host_vars): a node's
``vllm_fleet_replica`` name, its ``vllm_fleet_replica_rank`` (0 leads) and, on the
leader, ``vllm_fleet_replica_address`` (else ``ansible_host``, else its name). The
validation play has already refused an inconsistent topology.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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
    """preflight_replica_of, preflight_replica_disagreements."""

    def filters(self) -> dict[str, Any]:
        return {
            "preflight_replica_of": replica_of,
            "preflight_replica_disagreements": replica_disagreements,
        }
