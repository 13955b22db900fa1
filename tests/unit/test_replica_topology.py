"""The replica topology filters (filter_plugins/vllm_fleet_topology.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleFilterError

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location(
    "vllm_fleet_topology", ROOT / "filter_plugins" / "vllm_fleet_topology.py"
)
assert _SPEC and _SPEC.loader
topology = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(topology)


def member(host: str, replica: str = "", rank: Any = None, **values: Any) -> dict[str, Any]:
    shared = {
        "vllm_fleet_model": "kimi",
        "vllm_fleet_vllm_package": "vllm",
        "vllm_fleet_vllm_version": "0.16.0",
        "vllm_fleet_tensor_parallel_size": 8,
        "vllm_fleet_pipeline_parallel_size": 2,
        "vllm_fleet_executor": "mp",
        "replica_secret": True,
    }
    return {"host": host, "replica": replica, "rank": rank, **shared, **values}


def test_single_node_replicas_and_a_consistent_pair_have_no_problem() -> None:
    members = [member("a"), member("b", "r1", 1), member("c", "r1", 0)]
    inventory = {"a": "", "b": "r1", "c": "r1"}
    assert topology.replica_problems(members, inventory) == []
    assert topology.replicas(members) == {"a": ["a"], "r1": ["c", "b"]}


def test_every_problem_is_listed_at_once() -> None:
    members = [
        member("a", rank=0),
        member("b", "r1", 0),
        member("c", "r1", 0),
        member("d", "r1", "x"),
        member("e", "r2"),
        member("f", "bad name", 0),
        member("g", "r3", 0, vllm_fleet_vllm_version="0.17.0"),
        member("h", "r3", 1, vllm_fleet_executor="ray"),
    ]
    inventory = {m["host"]: m["replica"] for m in members} | {"i": "r3"}
    assert topology.replica_problems(members, inventory) == [
        "a sets vllm_fleet_replica_rank 0 but no vllm_fleet_replica",
        "d: vllm_fleet_replica_rank 'x' is not a whole number >= 0",
        "e is in replica r2 but sets no vllm_fleet_replica_rank",
        "f: vllm_fleet_replica 'bad name' is not a name (letters, digits, '.', '_', '-')",
        "replica r1: rank 0 is set on b, c (one node per rank)",
        "replica r1: tensor x pipeline parallel = 8 x 2 = 16 does not split evenly over its "
        "3 nodes (each node runs the same number of ranks)",
        "replica r3: i not in this run (-l); a replica's nodes change together",
        "replica r3: its nodes differ in vllm_fleet_vllm_version (g: 0.17.0, h: 0.16.0)",
        "replica r3: its nodes differ in vllm_fleet_executor (g: mp, h: ray)",
    ]


def test_a_ray_replica_needs_the_ray_token_on_every_node() -> None:
    """Without a token Ray's port runs any code sent to it; only whether one
    is set reaches the filter (set_fact's bool or its text), never the token."""
    ray = {"vllm_fleet_executor": "ray"}
    assert (
        topology.replica_problems(
            [
                member("a", "r1", 0, ray_token=True, **ray),
                member("b", "r1", 1, ray_token="True", **ray),
            ]
        )
        == []
    )
    assert topology.replica_problems(
        [member("a", "r1", 0, ray_token=True, **ray), member("b", "r1", 1, ray_token=False, **ray)]
    ) == [
        "replica r1: the ray executor needs vllm_fleet_ray_token on b (in vault, the same on "
        "every node of the replica): a Ray port without a token runs any code sent to it"
    ]
    # vLLM's own launch (mp) needs none.
    assert topology.replica_problems([member("a", "r1", 0), member("b", "r1", 1)]) == []


def test_a_replica_of_several_nodes_needs_the_watch_secret_on_every_node() -> None:
    """Only whether one is set reaches the filter, never the secret."""
    assert topology.replica_problems(
        [member("a", "r1", 0), member("b", "r1", 1, replica_secret="False")]
    ) == [
        "replica r1: its watch needs vllm_fleet_replica_secret on b (in vault, the same on "
        "every node of the replica): without it a stranger on the watch port could end the replica"
    ]
    # A replica of one node has no watch.
    assert topology.replica_problems([member("a", "r1", 0, replica_secret=False)]) == []


def test_ranks_must_cover_zero_to_the_node_count() -> None:
    members = [member("a", "r", 0), member("b", "r", 2)]
    assert topology.replica_problems(members) == [
        "replica r: its 2 nodes need ranks 0..1, one each (missing 1; out of range 2)"
    ]


@pytest.mark.parametrize(
    ("tensor", "pipeline", "nodes", "fits"),
    [(8, 2, 2, True), (2, 1, 2, True), (3, 1, 2, False), (1, 3, 2, False), (4, 1, 3, False)],
)
def test_parallel_sizes_must_split_evenly_over_the_nodes(
    tensor: int, pipeline: int, nodes: int, fits: bool
) -> None:
    members = [
        member(f"n{rank}", "r", rank, vllm_fleet_tensor_parallel_size=tensor,
               vllm_fleet_pipeline_parallel_size=pipeline)
        for rank in range(nodes)
    ]  # fmt: skip
    problems = topology.replica_problems(members)
    if fits:
        assert problems == []
    else:
        assert problems == [
            f"replica r: tensor x pipeline parallel = {tensor} x {pipeline} = "
            f"{tensor * pipeline} does not split evenly over its {nodes} nodes "
            "(each node runs the same number of ranks)"
        ]


@pytest.mark.parametrize(
    ("rank", "valid"),
    [
        (0, True),
        ("1", True),
        (-1, False),
        (True, False),
        (1.5, False),
        ("01", False),
        (None, False),
    ],
)
def test_a_rank_is_a_whole_number_from_zero(rank: Any, valid: bool) -> None:
    assert (topology._whole(rank) is not None) is valid


def test_a_node_finds_its_replica_and_the_leader_address_in_the_inventory() -> None:
    hostvars = {
        "a": {"vllm_fleet_replica": "r1", "vllm_fleet_replica_rank": 1},
        "b": {"vllm_fleet_replica": "r1", "vllm_fleet_replica_rank": "0",
              "ansible_host": "10.0.0.2"},
        "c": {},
    }  # fmt: skip
    hosts = ["a", "b", "c"]

    def replica(host: str) -> dict:
        # 8000: role vllm_fleet's default API port, where the leader sets none.
        return topology.replica_of(
            hostvars[host].get("vllm_fleet_replica"), host, hostvars, hosts, 8000
        )

    assert replica("a") == {
        "name": "r1", "nodes": 2, "rank": 1, "leader": "b", "leader_address": "10.0.0.2",
        "leader_api_port": 8000, "leader_port": 0,
    }  # fmt: skip
    # The leader's own vllm_fleet_replica_address wins over its ansible_host.
    hostvars["b"]["vllm_fleet_replica_address"] = "192.168.7.2"
    assert replica("b")["leader_address"] == "192.168.7.2"
    # Followers wait on the leader's own API port.
    hostvars["b"]["vllm_fleet_port"] = "8802"
    assert replica("a")["leader_api_port"] == 8802
    # And at the leader's rendezvous port.
    hostvars["b"]["vllm_fleet_replica_port"] = 29531
    assert replica("a")["leader_port"] == 29531
    assert replica("c") == {
        "name": "", "nodes": 1, "rank": 0, "leader": "c", "leader_address": "",
        "leader_api_port": 0, "leader_port": 0,
    }  # fmt: skip


def test_the_nodes_of_a_replica_must_plan_alike() -> None:
    def plan(kv: str, leader_ip: str) -> dict[str, Any]:
        replica = {"name": "r1", "leader_ip": leader_ip, "port": 29501}
        return {"vllm_fleet_plan": {"device": "cuda", "vllm_version": "0.16.0",
                                    "kv_cache_quant": kv, "replica": replica}}  # fmt: skip

    alone = {"vllm_fleet_plan": {"kv_cache_quant": "original", "replica": {}}}
    hostvars = {"a": plan("absent", "10.0.0.1"), "b": plan("absent", "10.0.0.1"), "c": alone}
    assert topology.replica_disagreements(["a", "b", "c"], hostvars) == []
    hostvars["b"] = plan("original", "10.0.0.9")
    assert topology.replica_disagreements(["a", "b", "c"], hostvars) == [
        "replica r1: its nodes plan different kv_cache_quant (a: absent, b: original)",
        "replica r1: its nodes plan different leader address (a: 10.0.0.1, b: 10.0.0.9)",
    ]
    # One node on Ray, the other on vLLM's own launch: they would never meet.
    hostvars["b"] = plan("absent", "10.0.0.1")
    hostvars["b"]["vllm_fleet_plan"]["replica"]["executor"] = "ray"
    hostvars["a"]["vllm_fleet_plan"]["replica"]["executor"] = "mp"
    assert topology.replica_disagreements(["a", "b", "c"], hostvars) == [
        "replica r1: its nodes plan different executor (a: mp, b: ray)",
    ]


def _rollout_hostvars() -> dict[str, Any]:
    def node(replica: str = "") -> dict[str, Any]:
        return {"vllm_fleet_plan": {"replica": {"name": replica} if replica else {}}}

    return {"a": node(), "b1": node("r1"), "c": node(), "b2": node("r1"), "d": node(),
            "e1": node("r2"), "e2": node("r2")}  # fmt: skip


def test_the_rolling_path_keeps_a_replica_in_one_batch() -> None:
    hostvars = _rollout_hostvars()
    groups = {"vllm_fleet_rollout_idle": ["a"], "vllm_fleet_rollout_live": ["b1", "c", "b2", "d"]}
    # The idle first; each replica's nodes side by side, in its first node's place.
    assert topology.rollout_hosts(groups, hostvars) == ["a", "b1", "b2", "c", "d"]
    # One replica (or single node) at a time: r1's two nodes are one batch.
    assert topology.rollout_serial(groups, hostvars, 1) == [1, 2, 1, 1]
    assert topology.rollout_serial(groups, hostvars, "2") == [1, 3, 1]
    # A percentage of the replicas, rounded down as Ansible does (50% of 3: 1).
    assert topology.rollout_serial(groups, hostvars, "50%") == [1, 2, 1, 1]
    assert topology.rollout_serial(groups, hostvars, "67%") == [1, 3, 1]
    groups["vllm_fleet_rollout_live"] += ["e1", "e2"]
    assert topology.rollout_serial(groups, hostvars, 2) == [1, 3, 3]
    with pytest.raises(AnsibleFilterError, match="counts replicas"):
        topology.rollout_serial(groups, hostvars, [1, 2])


def test_a_fleet_of_single_nodes_rolls_as_before() -> None:
    hostvars = _rollout_hostvars()
    groups = {"vllm_fleet_rollout_idle": ["a", "c"], "vllm_fleet_rollout_live": ["d"]}
    assert topology.rollout_hosts(groups, hostvars) == ["a", "c", "d"]
    # vllm_fleet_serial passes through untouched (a number, a percentage, a list).
    assert topology.rollout_serial(groups, hostvars, [1, "50%"]) == [2, 1, "50%"]
    assert topology.rollout_serial({"vllm_fleet_rollout_live": ["d"]}, hostvars, "25%") == ["25%"]
    # A replica that is idle starts with the other idle nodes, in the first batch.
    idle = {"vllm_fleet_rollout_idle": ["b1", "a", "b2"], "vllm_fleet_rollout_live": ["c"]}
    assert topology.rollout_hosts(idle, hostvars) == ["b1", "b2", "a", "c"]
    assert topology.rollout_serial(idle, hostvars, 1) == [3, 1]
    assert topology.rollout_hosts({}, hostvars) == []


def test_without_a_plan_the_rolling_path_reads_the_inventory_replica() -> None:
    """rollback.yml plans nothing: its batches come from vllm_fleet_replica."""
    hostvars = {"a": {"vllm_fleet_replica": ""}, "b1": {"vllm_fleet_replica": "r1"},
                "c": {}, "b2": {"vllm_fleet_replica": "r1"}}  # fmt: skip
    groups = {"vllm_fleet_rollout_live": ["a", "b1", "c", "b2"]}
    assert topology.rollout_hosts(groups, hostvars) == ["a", "b1", "b2", "c"]
    assert topology.rollout_serial(groups, hostvars, 1) == [1, 2, 1]


def released(
    release_id: str, name: str = "", rank: int = 0, nodes: int = 2, leader: str = "a"
) -> dict[str, Any]:
    replica = {"name": name, "nodes": nodes, "rank": rank, "leader_host": leader} if name else {}
    return {"id": release_id, "replica": replica}


def rolled(host: str, replica: str, now: dict[str, Any], to: dict[str, Any]) -> dict[str, Any]:
    return {"host": host, "replica": replica, "now": now, "to": to}


def test_a_replica_returns_whole_to_one_shape() -> None:
    # Back from replica r1 to two single nodes, and from there to r1 again.
    apart = [rolled("a", "r1", released("A2", "r1", 0), released("A1")),
             rolled("b", "r1", released("B2", "r1", 1), released("B1"))]  # fmt: skip
    together = [rolled("a", "r1", released("A1"), released("A2", "r1", 0)),
                rolled("b", "r1", released("B1"), released("B2", "r1", 1))]  # fmt: skip
    alone = [rolled("c", "", released("C2"), released("C1"))]
    assert topology.rollback_problems(apart + alone) == []
    assert topology.rollback_problems(together + alone) == []


def test_a_replica_that_would_not_return_whole_is_refused_naming_each_node() -> None:
    # r1's nodes return to releases of different shapes.
    mixed = [rolled("a", "r1", released("A2", "r1", 0), released("A1", "r1", 0)),
             rolled("b", "r1", released("B2", "r1", 1), released("B1"))]  # fmt: skip
    assert topology.rollback_problems(mixed) == [
        "replica r1: its nodes return to releases of different shapes (a: release A1 (rank 0 "
        "of replica r1: 2 nodes led by a), b: release B1 (alone))"
    ]
    # The inventory no longer declares the replica the nodes run, or return to.
    undeclared = [rolled("a", "", released("A2", "r1", 0), released("A1")),
                  rolled("b", "", released("B1"), released("B0", "r1", 1))]  # fmt: skip
    assert topology.rollback_problems(undeclared) == [
        "a runs release A2 (rank 0 of replica r1: 2 nodes led by a), but the inventory has it "
        "alone: declare replica r1 again (vllm_fleet_replica, vllm_fleet_replica_rank) so that "
        "its nodes change together",
        "b returns to release B0 (rank 1 of replica r1: 2 nodes led by a), but the inventory "
        "has it alone: declare replica r1 again (vllm_fleet_replica, vllm_fleet_replica_rank) "
        "so that its nodes change together",
    ]
    # A replica of three recorded, two declared now.
    shrunk = [rolled("a", "r1", released("A2", "r1", 0), released("A1", "r1", 0, 3)),
              rolled("b", "r1", released("B2", "r1", 1), released("B1", "r1", 1, 3))]  # fmt: skip
    assert topology.rollback_problems(shrunk) == [
        "replica r1: its 2 nodes return to releases of a replica of 3 nodes (a: release A1 "
        "(rank 0 of replica r1: 3 nodes led by a), b: release B1 (rank 1 of replica r1: 3 "
        "nodes led by a))"
    ]


def test_the_batches_follow_the_inventory_order_not_the_answer_order() -> None:
    """The rolling groups fill as the nodes answer the compare play: the batches
    still take the nodes in the inventory's order, run after run."""
    hostvars = _rollout_hostvars()
    answered = {"all": ["a", "b1", "b2", "c", "d"], "vllm_fleet_rollout_live": ["d", "c", "a"]}
    assert topology.rollout_hosts(answered, hostvars) == ["a", "c", "d"]
    answered["vllm_fleet_rollout_idle"] = ["b2", "b1"]
    assert topology.rollout_hosts(answered, hostvars) == ["b1", "b2", "a", "c", "d"]
    assert topology.rollout_serial(answered, hostvars, 1) == [2, 1]
