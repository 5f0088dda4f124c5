"""The trainer's watch over the role nodes (trainguard.roles.nodeloss), its logic on a clock of
its own: beacons written by the test, a recording fencer. The real thing (agents killed -9 on
a real Slurm, the spare serving, the drain, exit 96) is tests/test_slurm_roles.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard.core.config.roles import RolesConfig
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import EventLog, read_events
from trainguard.core.fencing import FenceResult
from trainguard.roles.nodeloss import RoleNodeWatch, assignment, declared_lost

NODES = [("a", "10.0.0.1"), ("b", "10.0.0.2"), ("s", "10.0.0.3")]


class Fencer:
    def __init__(self) -> None:
        self.fenced: list[tuple[str, str]] = []

    def fence(self, node: str, reason: str) -> FenceResult:
        self.fenced.append((node, reason))
        return FenceResult(node, True, f"drained node {node}")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _roles(**rollout: object) -> RolesConfig:
    table = {"command": "e", "replicas": 2, "nodes": 2, "spares": 1, "port": 8100, "floor": 2}
    return RolesConfig(rollout={**table, **rollout}, node_dead_after_s=3.0)


def _beat(run_dir: Path, *nodes: str) -> None:
    d = RunDir(run_dir).role_nodes
    d.mkdir(parents=True, exist_ok=True)
    for n in nodes:
        p = d / f"{n}.alive"
        p.write_text(str(int(p.read_text()) + 1 if p.exists() else 1))


def _advance(w: RoleNodeWatch, clock: Clock, run_dir: Path, seconds: float, *alive: str) -> None:
    for _ in range(int(seconds / 0.5)):
        clock.t += 0.5
        _beat(run_dir, *alive)
        w.poll()


def test_a_lost_node_goes_to_the_spare_then_the_next_loss_is_below_the_floor(
    tmp_path: Path,
) -> None:
    clock, fencer = Clock(), Fencer()
    w = RoleNodeWatch(_roles(), tmp_path, NODES, EventLog(tmp_path, node="t"), fencer,
                      job_id="7", clock=clock)  # fmt: skip
    _advance(w, clock, tmp_path, 2, "a", "b", "s")
    assert w.holders() == {"a": ("rollout", [0]), "b": ("rollout", [1])}
    _advance(w, clock, tmp_path, 2.5, "b", "s")  # a silent for 2.5 s: not yet
    assert not declared_lost(tmp_path, "a") and fencer.fenced == []
    _advance(w, clock, tmp_path, 1, "b", "s")
    assert declared_lost(tmp_path, "a")
    assert fencer.fenced[0][0] == "a" and "role node agent lost in job 7" in fencer.fenced[0][1]
    got = assignment(tmp_path, "s")
    assert got is not None and (got.role, got.replicas, got.replaces) == ("rollout", [0], "a")
    assert w.holders() == {"s": ("rollout", [0]), "b": ("rollout", [1])}
    assert w.failure is None
    # another trainer agent's watch derives the same from the files, and does not act again
    other = RoleNodeWatch(_roles(), tmp_path, NODES, EventLog(tmp_path, node="t2"), Fencer())
    assert other.holders() == w.holders() and other.lost() == {"a"}

    _advance(w, clock, tmp_path, 4, "s")  # b lost, no spare left: 1 of 2, floor 2
    assert w.failure == (
        "role rollout below its floor of 2: 1 of 2 replicas left; lost node b with replicas 1 "
        "and no spare node left for them"
    )
    assert RunDir(tmp_path).role_below_floor.read_text().strip() == w.failure
    lost = [e for e in read_events(tmp_path) if e["kind"] == "role_node_lost"]
    assert [(e["node_name"], e["spare"], e["left"], e["drained"]) for e in lost] == [
        ("a", "s", 2, True),
        ("b", None, 1, True),
    ]


def test_a_starved_watcher_judges_nothing_across_its_gap(tmp_path: Path) -> None:
    clock = Clock()
    w = RoleNodeWatch(_roles(), tmp_path, NODES, EventLog(tmp_path, node="t"), Fencer(),
                      clock=clock)  # fmt: skip
    _advance(w, clock, tmp_path, 1, "a", "b", "s")
    clock.t += 60  # this process did not run for a minute; the beacons did not move meanwhile
    w.poll()
    assert w.lost() == set()
    _advance(w, clock, tmp_path, 1, "a", "b", "s")
    assert w.lost() == set()


def test_below_the_floor_with_floor_1_keeps_going_and_a_lost_idle_spare_is_drained(
    tmp_path: Path,
) -> None:
    clock, fencer = Clock(), Fencer()
    w = RoleNodeWatch(_roles(floor=1), tmp_path, NODES, EventLog(tmp_path, node="t"), fencer,
                      clock=clock)  # fmt: skip
    _advance(w, clock, tmp_path, 1, "a", "b", "s")
    _advance(w, clock, tmp_path, 4, "a", "b")  # the idle spare is lost: drained, nothing moved
    assert [n for n, _ in fencer.fenced] == ["s"] and w.failure is None
    _advance(w, clock, tmp_path, 4, "b")  # a lost, no spare: 1 left, floor 1
    assert w.failure is None and w.lost() == {"a", "s"}
    assert w.holders() == {"a": ("rollout", [0]), "b": ("rollout", [1])}  # a's: lost
    states = json.dumps(RunDir(tmp_path).role_states())  # nothing published: nothing marked
    assert states == "{}"


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ({"spares": 1, "nodes": 0}, "spares 1 without nodes"),
        ({"floor": 3}, "floor 3 > replicas 2"),
    ],
)
def test_role_spare_and_floor_settings_are_checked(table: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        _roles(**table)
