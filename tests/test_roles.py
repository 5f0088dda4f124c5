"""Roles in one job: engine fleets beside the trainer, with real processes.

The replicas are tests/workers/role_replica.py (a real HTTP server process), the trainer is
tests/workers/role_trainer.py under ``trainguard run``. Faults are real: kill -9, SIGSTOP, a
command that exits at once, one that never becomes ready.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.launch_utils import WORKERS, base_env, free_port, popen
from tests.procs import alive, kill_tree
from trainguard.cli.cmd_run import run_job
from trainguard.core.config import ConfigError, load_config
from trainguard.core.config.roles import RolesConfig, RoleSpec, parse_role_flag
from trainguard.core.contracts.engine import ReplicaStatus as S
from trainguard.core.contracts.envvars import parse_role_nodes
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import EventLog, read_events
from trainguard.core.fleetauth import job_secret, role_token
from trainguard.core.plugin import AgentContext
from trainguard.roles.node import run_role_node
from trainguard.roles.placement import place_roles
from trainguard.roles.plugin import RoleFailedError, RolesPlugin
from trainguard.roles.supervisor import RoleSupervisor, probe_health
from trainguard.telemetry.report import write_report

REPLICA = [sys.executable, str(WORKERS / "role_replica.py")]
TRAINER = str(WORKERS / "role_trainer.py")
FAST = {"probe_interval_s": 0.25, "probe_timeout_s": 1.0, "stop_timeout_s": 3.0}


def wait_for(what: str, cond: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def kinds(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir) if e["kind"] == kind]


def path_of(run_dir: Path, kind: str, last: str, **match: Any) -> list[str]:
    """The states of one replica (or standby) once its events end in ``last``, without
    ``suspect``: a probe that timed out on a loaded machine, then an answer again, is
    behaviour too, not a death."""

    def states() -> list[str] | None:
        got = [e["state"] for e in kinds(run_dir, kind)
               if all(e[k] == v for k, v in match.items()) and e["state"] != "suspect"]  # fmt: skip
        return got if got and got[-1] == last else None

    return list(wait_for(f"{kind} {match} ending in {last}", states, timeout=30))


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Callable[..., RoleSupervisor]]:
    made: list[RoleSupervisor] = []

    def make(table: dict[str, Any], **settings: Any) -> RoleSupervisor:
        cfg = RolesConfig(rollout=table, **{**FAST, **settings})
        sup = RoleSupervisor(cfg, tmp_path, EventLog(tmp_path), env=base_env())
        made.append(sup)
        sup.start()
        return sup

    yield make
    for sup in made:
        sup.stop()


def serving_pids(sup: RoleSupervisor) -> list[int] | None:
    reps = sup.replicas["rollout"]
    if all(r.state == "serving" for r in reps):
        return [r.pid for r in reps if r.pid is not None]
    return None


# -- the spec: file, flag, bad input ----------------------------------------------------------
def test_role_flag_and_table_give_the_same_spec(tmp_path: Path) -> None:
    name, table = parse_role_flag(
        "rollout=2,port=8100,budget=3,policy=never,ready=30,standby=1:python -m eng --model 'a b'"
    )
    assert name == "rollout"
    spec = RoleSpec.from_mapping(name, table, "flag")
    assert spec.command == ("python", "-m", "eng", "--model", "a b")
    assert (spec.replicas, spec.port, spec.restart_budget, spec.standby) == (2, 8100, 3, 1)
    assert (spec.restart_policy, spec.readiness_timeout_s, spec.health_path) == (
        "never",
        30.0,
        "/health",
    )
    toml = tmp_path / "tg.toml"
    toml.write_text(
        '[roles.rollout]\ncommand = ["python", "-m", "eng", "--model", "a b"]\nreplicas = 2\n'
        'port = 8100\nrestart_budget = 3\nrestart_policy = "never"\nreadiness_timeout_s = 30\n'
        "standby = 1\n"
    )
    assert load_config(str(toml), env={}).roles.specs() == [spec]
    env = {"TRAINGUARD_ROLES_REWARD": json.dumps({"command": "srv", "replicas": 1})}
    assert [s.name for s in load_config(env=env).roles.specs()] == ["reward"]


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("rollout", "malformed role"),
        ("rollout=2", "malformed role"),
        ("rollout=:python x", "replica count is missing"),
        ("rollout=two:python x", "'two' is not a number"),
        ("rollout=0:python x", "has 0 replicas"),
        ("rollout=2:", "command is missing"),
        ("rollout=2,colour=red:python x", "unknown option 'colour=red'"),
        ("engines=2:python x", "unknown role 'engines'"),
        ("rollout=2,port=65535:python x", "go past 65535"),
        ("rollout=1,policy=sometimes:python x", "restart_policy 'sometimes'"),
        ("rollout=1:python 'unclosed", "No closing quotation"),
        ("rollout=1,standby=-1:python x", "standby -1 must be in 0..64"),
    ],
)
def test_bad_role_flag_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, says: str
) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(SystemExit) as e:
        run_job(["--tg-role", flag, "--tg-run-dir", str(tmp_path / "run"), str(script)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("trainguard run: error: --tg-role") and says in err, err


def test_role_command_not_found_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(SystemExit) as e:
        run_job(["--tg-role", "reward=1:./no-such-server --port 1",
                 "--tg-run-dir", str(tmp_path / "run"), str(script)])  # fmt: skip
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "role reward: command './no-such-server' not found" in err


def test_role_nodes_outside_sbatch_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRAINGUARD_SBATCH_ROLE_NODES", raising=False)
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(SystemExit) as e:
        run_job(["--tg-role", f"rollout=2,nodes=1,port=8100:{sys.executable} x.py",
                 "--tg-run-dir", str(tmp_path / "run"), str(script)])  # fmt: skip
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "role rollout: nodes = 1 runs it on nodes of its own" in err
    assert "only a trainguard sbatch job allocates" in err


def test_roles_on_their_own_nodes_are_placed_the_same_everywhere() -> None:
    cfg = RolesConfig(
        rollout={"command": "e", "replicas": 3, "nodes": 2, "port": 8100},
        reward={"command": "r", "replicas": 1, "nodes": 1, "port": 8200, "bind": "0.0.0.0"},
    )
    nodes = parse_role_nodes("n3=10.0.0.3,n4=10.0.0.4,n5=10.0.0.5")
    placed = place_roles(cfg.specs(), nodes)
    assert [(p.node, p.url) for p in placed["rollout"]] == [
        ("n3", "http://10.0.0.3:8100"),
        ("n4", "http://10.0.0.4:8101"),
        ("n3", "http://10.0.0.3:8102"),
    ]
    assert [(p.node, p.url) for p in placed["reward"]] == [("n5", "http://10.0.0.5:8200")]
    assert cfg.node_count() == 3
    with pytest.raises(ValueError, match="ask for 3 node.s. of their own, the job has 2"):
        place_roles(cfg.specs(), nodes[:2])


def test_role_node_replicas_bind_and_are_probed_on_the_node_address(tmp_path: Path) -> None:
    """A role node's supervisor runs only its replicas, bound to the node's address (here
    127.0.0.2, another loopback address), probed there, with that host in their URL."""
    port = free_port(2)
    cfg = RolesConfig(rollout={"command": REPLICA, "replicas": 2, "nodes": 2, "port": port}, **FAST)
    sup = RoleSupervisor(
        cfg, tmp_path, EventLog(tmp_path), env=base_env(), specs=cfg.specs(),
        indices={"rollout": [1]}, host="127.0.0.2",
    )  # fmt: skip
    sup.start()
    try:
        (rep,) = sup.replicas["rollout"]
        wait_for("replica 1 serving", lambda: rep.state == "serving", 30)
        assert (rep.index, rep.url) == (1, f"http://127.0.0.2:{port + 1}")
        assert probe_health(rep.port, "/health", 2.0, "127.0.0.2").outcome == "ok"
        assert probe_health(rep.port, "/health", 2.0).outcome == "refused"  # not on 127.0.0.1
    finally:
        sup.stop()


def test_role_node_agent_runs_its_replicas_and_reports_a_failure(tmp_path: Path) -> None:
    """The agent of a role node (``trainguard slurm roles``) runs the replicas placed on its
    node until the stop file appears; a command it cannot start is one line in the failure
    file, which the trainer's agents end the job with."""
    port = free_port(3)
    stop, failed = tmp_path / "stop", tmp_path / "failed"
    env = base_env(
        TRAINGUARD_SBATCH_ROLE_NODES="n1=127.0.0.1,n2=127.0.0.2",
        TRAINGUARD_SBATCH_ROLES_STOP=str(stop),
        TRAINGUARD_SBATCH_ROLES_FAILED=str(failed),
    )
    cfg = RolesConfig(rollout={"command": REPLICA, "replicas": 3, "nodes": 2, "port": port}, **FAST)
    codes: list[int] = []
    t = threading.Thread(target=lambda: codes.append(run_role_node(cfg, tmp_path, "n1", env=env)))
    t.start()
    try:
        states = wait_for("replicas 0 and 2 serving on n1", lambda: (
            (s := RunDir(tmp_path).role_states().get("rollout", []))
            and len(s) == 2 and all(r["state"] == "serving" for r in s) and s), 30)  # fmt: skip
        assert [(r["replica"], r["url"]) for r in states] == [
            (0, f"http://127.0.0.1:{port}"),
            (2, f"http://127.0.0.1:{port + 2}"),
        ]
        pids = [r["pid"] for r in states]
    finally:
        stop.touch()
        t.join(30)
    assert codes == [0] and not any(alive(p) for p in pids) and not failed.exists()
    bad = RolesConfig(rollout={"command": "no-such-engine", "nodes": 1, "port": port}, **FAST)
    assert run_role_node(bad, tmp_path, "n1", env=env) == 2
    line = failed.read_text().strip()
    assert "role rollout: command 'no-such-engine' not found" in line and "\n" not in line
    # a trainer node's plugin: the URLs of both nodes' replicas, and that line ends its job
    ctx = AgentContext(config=load_config(env={}), run_dir=tmp_path, events=EventLog(tmp_path))
    ctx.config.roles = cfg
    plugin = RolesPlugin(ctx, env=env)
    try:
        # the role node's replicas check the token of the job secret both agents read
        assert plugin.worker_env(ctx) == {
            "TRAINGUARD_ROLLOUT_URLS": f"http://127.0.0.1:{port},http://127.0.0.2:{port + 1},"
            f"http://127.0.0.1:{port + 2}",
            "TRAINGUARD_ROLLOUT_TOKEN": role_token(job_secret(tmp_path), "rollout"),
        }
        with pytest.raises(RoleFailedError, match="command 'no-such-engine' not found"):
            plugin.before_rendezvous(ctx)
    finally:
        plugin.close()


def test_bad_role_table_is_one_config_error(tmp_path: Path) -> None:
    toml = tmp_path / "tg.toml"
    for body, says in [
        ('[roles.rollout]\ncommand = "x"\nreplicas = 0\n', "has 0 replicas"),
        ("[roles.rollout]\nreplicas = 2\n", "has no command"),
        ('[roles.rollout]\ncommand = "x"\nweights = 1\n', "unknown key 'weights'"),
        ("[roles]\nprobe_timeout_s = 9\ndead_after_s = 3\n", "must be >= probe_timeout_s"),
        ('[roles.rollout]\ncommand = "x"\nreplicas = -1\n', "replicas -1 must be >= 0"),
        ('[roles.rollout]\ncommand = "x"\nreplicas = true\n', "replicas True is not an integer"),
        ('[roles.rollout]\ncommand = "x"\nreplicas = 1.5\n', "replicas 1.5 is not an integer"),
        ("[roles.rollout]\ncommand = [1, 2]\n", "must be a string or a list of strings"),
        ('[roles.rollout]\ncommand = "x"\nreadiness_timeout_s = "nan"\n', "must be > 0"),
        ('[roles.rollout]\ncommand = "x"\nenv = "A=1"\n', "env must be a table of strings"),
        ('[roles]\nrollout = "python x"\n', "expected a JSON object"),
        ('[roles.rollout]\ncommand = "x"\nstandby = "one"\n', "standby 'one' is not an integer"),
        ("[roles]\nstandby_nice = 20\n", "standby_nice must be in 0..19"),
    ]:
        toml.write_text(body)
        with pytest.raises(ConfigError, match=says) as e:
            load_config(str(toml), env={})
        assert "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="TRAINGUARD_ROLES_ROLLOUT: expected a JSON object"):
        load_config(env={"TRAINGUARD_ROLES_ROLLOUT": "{not json"})


# -- the supervisor alone: lifecycle with real replica processes --------------------------------
def test_killed_replica_restarts_alone_on_its_port(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    sup = supervisor({"command": REPLICA + ["--loading-s", "0.5"], "replicas": 2})
    pids = wait_for("both replicas serving", lambda: serving_pids(sup))
    ports = [r.port for r in sup.replicas["rollout"]]
    # what each replica was told
    who = [json.loads(_get(p, "/whoami")) for p in ports]
    assert [w["replica"] for w in who] == ["0", "1"] and {w["role"] for w in who} == {"rollout"}
    assert who[0]["pid"] == pids[0] and who[0]["run_dir"] == str(tmp_path)
    token = role_token(job_secret(tmp_path), "rollout")  # from the run dir's job secret
    assert [w["token"] for w in who] == [token, token]
    assert sup.trainer_env() == {
        "TRAINGUARD_ROLLOUT_URLS": ",".join(f"http://127.0.0.1:{p}" for p in ports),
        "TRAINGUARD_ROLLOUT_TOKEN": token,
    }

    os.kill(pids[0], signal.SIGKILL)
    new = wait_for(
        "replica 0 replaced and serving",
        lambda: (p := serving_pids(sup)) and p[0] != pids[0] and p,
    )
    assert new[1] == pids[1]  # the other replica was not touched
    assert [r.port for r in sup.replicas["rollout"]] == ports  # same port, same URL
    assert json.loads(_get(ports[0], "/whoami"))["pid"] == new[0]
    assert sup.restarts["rollout"] == 1 and sup.failure is None
    failed = kinds(tmp_path, "role_replica_failed")
    assert [(e["replica"], e["pid"], e["reason"]) for e in failed] == [
        (0, pids[0], "was killed by signal 9")
    ]
    states = path_of(tmp_path, "role_replica_state", "serving", replica=0)
    assert _lifecycle(states) == [
        "starting",
        "serving",
        "dead",
        "restarting",
        "starting",
        "serving",
    ]
    state = json.loads(RunDir(tmp_path).role_state("rollout", 0).read_text())
    assert state["pid"] == new[0] and state["restarts"] == 1 and state["state"] == "serving"
    assert state["port"] == ports[0] and state["weight_version"] == 0

    sup.stop()
    assert not alive(new[0]) and not alive(new[1])
    assert {s["state"] for s in RunDir(tmp_path).role_states()["rollout"]} == {"stopped"}


def _lifecycle(states: list[str]) -> list[str]:
    """The states without ``loading``: this replica's half second of it (``--loading-s``) is
    wall-clock time a loaded machine's probes may miss."""
    return [s for s in states if s != "loading"]


def _standby(sup: RoleSupervisor, pid: int | None = None) -> dict[str, Any] | None:
    """The role's standby once ready (and another process than ``pid``)."""
    sb = sup.standbys["rollout"][0]
    if sb.state != "standby" or sb.pid == pid:
        return None
    return json.loads(_get(sb.port, "/whoami"))


def test_picked_replica_ports_are_held_until_the_job_ends(
    supervisor: Callable[..., RoleSupervisor],
) -> None:
    """A replica without a fixed port gets one that no other process is given while the job
    runs (a port picked and let go was taken by another job's replica in the seconds before
    this one bound it): an ordinary bind of it fails, the replica binds it and serves; once
    the supervisor stops, it holds the port no more."""
    import errno
    import socket

    def plain_bind(port: int) -> int:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                return e.errno or -1
        return 0

    sup = supervisor({"command": REPLICA, "replicas": 2})
    ports = [r.port for r in sup.replicas["rollout"]]
    assert [plain_bind(p) for p in ports] == [errno.EADDRINUSE] * 2
    wait_for("both replicas serving", lambda: serving_pids(sup))
    sup.stop()  # (the replicas' closed connections may keep the ports in TIME_WAIT a while)
    assert [s.fileno() for s in sup._reserved] == [-1, -1]


def test_dead_replica_is_replaced_by_the_warm_standby(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    sup = supervisor({"command": REPLICA + ["--loading-s", "0.5"], "replicas": 2, "standby": 1})
    pids = wait_for("both replicas serving", lambda: serving_pids(sup))
    spare = wait_for("the standby ready", lambda: _standby(sup))
    ports = [r.port for r in sup.replicas["rollout"]]
    standby_port = sup.standbys["rollout"][0].port
    # kept out of routing, started at low priority, not a replica yet
    assert str(standby_port) not in sup.trainer_env()["TRAINGUARD_ROLLOUT_URLS"]
    assert spare["replica"] is None and spare["role"] == "rollout"
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert spare["nice"] == min(19, mine + 10)

    os.kill(pids[0], signal.SIGKILL)
    new = wait_for(
        "replica 0 replaced and serving",
        lambda: (p := serving_pids(sup)) and p[0] != pids[0] and p,
    )
    assert new == [spare["pid"], pids[1]]  # the standby took replica 0's place and port
    who = json.loads(_get(ports[0], "/whoami"))
    assert who["pid"] == spare["pid"] and who["replica"] == "0"
    if os.geteuid() == 0:  # a user without RLIMIT_NICE cannot lower it again
        assert who["nice"] == mine
    # the promoted standby starts as the replica (the engine's refit gate, loading before
    # serving: test_the_real_engine_as_a_rollout_replica, tests/test_rl_fleet_job.py)
    states = path_of(tmp_path, "role_replica_state", "serving", replica=0)
    assert _lifecycle(states) == [
        "starting",
        "serving",
        "dead",
        "restarting",
        "starting",
        "serving",
    ]
    started = kinds(tmp_path, "role_replica_started")
    assert [(e["replica"], e["standby"]) for e in started][-1] == (0, 0)
    assert sup.restarts["rollout"] == 1 and sup.failure is None
    # a new standby behind it
    again = wait_for("a new standby ready", lambda: _standby(sup, spare["pid"]))
    assert again["pid"] not in (*pids, spare["pid"])
    sb_states = path_of(tmp_path, "role_standby_state", "standby")
    assert sb_states == ["starting", "standby", "promoted", "starting", "standby"]

    sup.stop()
    assert not any(alive(p) for p in (*new, again["pid"]))
    sb = json.loads(RunDir(tmp_path).role_standby("rollout", 0, "json").read_text())
    assert sb["state"] == "stopped" and sb["starts"] == 2


def test_standby_that_ignores_the_contract_is_one_event_and_cold_restarts_go_on(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    sup = supervisor({"command": REPLICA + ["--ignore-standby"], "replicas": 1, "standby": 1})
    pids = wait_for("the replica serving", lambda: serving_pids(sup))
    # the event awaited, not the state: the supervisor sets the state, then writes the event
    # (a loaded machine showed the state with the event not written yet)
    (ev,) = wait_for("the standby given up", lambda: [
        e for e in kinds(tmp_path, "role_standby_state") if e["state"] == "failed"])  # fmt: skip
    assert sup.standbys["rollout"][0].state == "failed"
    assert "answered 'serving' as a standby" in ev["reason"] and "cold restarts" in ev["reason"]
    assert not alive(ev["pid"])
    os.kill(pids[0], signal.SIGKILL)
    wait_for("a cold restart", lambda: (p := serving_pids(sup)) and p[0] != pids[0])
    assert sup.failure is None


def test_each_role_has_its_own_budget_and_urls(tmp_path: Path) -> None:
    """The reward role spends its budget and fails; the rollout role's replica, killed once,
    is restarted from its own budget and counted apart."""
    cfg = RolesConfig(
        rollout={"command": REPLICA, "replicas": 1, "restart_budget": 1},
        reward={"command": REPLICA + ["--exit-at-once", "4"], "replicas": 1, "restart_budget": 2},
        **FAST,
    )
    sup = RoleSupervisor(cfg, tmp_path, EventLog(tmp_path), env=base_env())
    try:
        env = sup.trainer_env()
        assert set(env) == {
            "TRAINGUARD_ROLLOUT_URLS",
            "TRAINGUARD_REWARD_URLS",
            "TRAINGUARD_ROLLOUT_TOKEN",
            "TRAINGUARD_REWARD_TOKEN",
        }
        # each role its own token: a reward server cannot sign requests to the engines
        assert env["TRAINGUARD_ROLLOUT_TOKEN"] != env["TRAINGUARD_REWARD_TOKEN"]
        assert env["TRAINGUARD_REWARD_URLS"] == sup.replicas["reward"][0].url
        sup.start()
        failure = wait_for("the reward role failure", lambda: sup.failure)
        assert failure.startswith("role reward failed: replica 0") and "budget 2 spent" in failure
        (pid,) = wait_for("the rollout replica serving", lambda: serving_pids(sup))
        os.kill(pid, signal.SIGKILL)
        wait_for("the rollout replacement", lambda: (p := serving_pids(sup)) and p != [pid])
        assert sup.restarts == {"rollout": 1, "reward": 2}
        (spent,) = kinds(tmp_path, "role_restart_budget_exhausted")
        assert spent["role"] == "reward"
        assert {e["role"] for e in kinds(tmp_path, "role_replica_failed")} == {"rollout", "reward"}
    finally:
        sup.stop()


def test_policy_never_fails_the_role_on_the_first_death(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    sup = supervisor({"command": REPLICA, "replicas": 1, "restart_policy": "never"})
    (pid,) = wait_for("the replica serving", lambda: serving_pids(sup))
    os.kill(pid, signal.SIGKILL)
    failure = wait_for("the role failure", lambda: sup.failure)
    assert "was killed by signal 9; restart_policy is never" in failure
    assert sup.restarts["rollout"] == 0 and len(kinds(tmp_path, "role_replica_started")) == 1


def test_frozen_replica_is_declared_dead_within_10s_and_replaced(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    # the default health settings (probe every 1 s, 2 s timeout, dead after 6 s)
    sup = supervisor({"command": REPLICA, "replicas": 1}, probe_interval_s=1.0, probe_timeout_s=2.0)
    (pid,) = wait_for("the replica serving", lambda: serving_pids(sup))
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        dead = wait_for(
            "the frozen replica declared dead",
            lambda: [e for e in kinds(tmp_path, "role_replica_state") if e["state"] == "dead"],
            timeout=30,
        )
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
    assert dead[0]["time"] - stopped_at <= 10.0, dead[0]
    assert "no good health answer" in dead[0]["reason"]
    suspect = [e for e in kinds(tmp_path, "role_replica_state") if e["state"] == "suspect"]
    assert suspect and suspect[0]["time"] <= dead[0]["time"]
    (new,) = wait_for(
        "the replacement serving", lambda: (p := serving_pids(sup)) and p != [pid] and p
    )
    assert not alive(pid)  # killed by PID although stopped
    assert sup.restarts["rollout"] == 1


@pytest.mark.parametrize("bad", ["malformed", "500"])
def test_replica_with_bad_health_answers_is_suspect_then_replaced(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor], bad: str
) -> None:
    cmd = REPLICA + ["--bad-health-after", "2", "--bad-health", bad]
    sup = supervisor({"command": cmd, "replicas": 1}, dead_after_s=2.0)
    (pid,) = wait_for("the replica serving", lambda: serving_pids(sup))
    dead = wait_for(
        "the replica declared dead",
        lambda: [e for e in kinds(tmp_path, "role_replica_state") if e["state"] == "dead"],
    )
    suspect = [e for e in kinds(tmp_path, "role_replica_state") if e["state"] == "suspect"]
    detail = "health answer is not JSON" if bad == "malformed" else "HTTP 500"
    assert suspect and detail in suspect[0]["reason"], suspect
    assert dead[0]["pid"] == pid and "no good health answer" in dead[0]["reason"]
    wait_for("the replacement started", lambda: (p := sup.replicas["rollout"][0].pid) != pid and p)
    assert not alive(pid) and sup.restarts["rollout"] >= 1


def test_quarantined_replica_counts_against_the_budget_and_is_kept(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    """A replica whose refit failed a client's check answers ``quarantined`` (it refits and
    serves nothing meanwhile): the supervisor records the state, counts it against the
    role's restart budget and keeps the process; once the budget is spent, a quarantine
    ends the replica like a death (here: the role fails)."""
    cmd = REPLICA + ["--quarantined", "1.5", "3", "--quarantined", "5", "100"]
    sup = supervisor({"command": cmd, "replicas": 1, "restart_budget": 1})
    (pid,) = wait_for("the replica serving", lambda: serving_pids(sup))
    wait_for("quarantined", lambda: sup.replicas["rollout"][0].state == "quarantined")
    assert sup.restarts["rollout"] == 1 and sup.replicas["rollout"][0].pid == pid

    def states() -> list[str]:
        return [e["state"] for e in kinds(tmp_path, "role_replica_state") if e["pid"] == pid]

    wait_for("serving again", lambda: states()[-2:] == ["quarantined", "serving"])
    assert sup.replicas["rollout"][0].pid == pid  # the same process
    # the budget spent: its next quarantine ends it, and the role with it
    wait_for("the role failed", lambda: kinds(tmp_path, "role_restart_budget_exhausted"), 30)
    (failed,) = kinds(tmp_path, "role_replica_failed")
    assert failed["pid"] == pid and "quarantined" in failed["reason"]
    assert not alive(pid)


def test_replica_that_refuses_connections_is_dead_at_once(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    # dead_after_s is long: only the refused connection can end this replica in time
    cmd = REPLICA + ["--close-after", "2"]
    sup = supervisor({"command": cmd, "replicas": 1}, dead_after_s=600.0)
    (pid,) = wait_for("the replica serving", lambda: serving_pids(sup))
    dead = wait_for(
        "the replica declared dead",
        lambda: [e for e in kinds(tmp_path, "role_replica_state") if e["state"] == "dead"],
        timeout=60,
    )
    assert dead[0]["pid"] == pid and dead[0]["reason"] == "refused connections"
    wait_for("the replacement started", lambda: (p := sup.replicas["rollout"][0].pid) != pid and p)
    assert not alive(pid)  # the process was still running: killed by PID


def test_command_that_exits_at_once_spends_the_budget_then_fails_the_role(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    sup = supervisor(
        {"command": REPLICA + ["--exit-at-once", "3"], "replicas": 2, "restart_budget": 2}
    )
    failure = wait_for("the role failure", lambda: sup.failure, timeout=60)
    assert failure.startswith("role rollout failed: replica ")
    assert "exited with code 3 before it was ever ready; restart budget 2 spent" in failure
    assert "role_replica.py --exit-at-once 3" in failure and "\n" not in failure
    assert sup.restarts["rollout"] == 2  # the role's budget, both replicas together
    (ev,) = kinds(tmp_path, "role_restart_budget_exhausted")
    assert ev["restart_budget"] == 2 and ev["message"] == failure
    assert len(kinds(tmp_path, "role_replica_failed")) >= 3
    assert "role_replica: exiting at once" in RunDir(tmp_path).role_log("rollout", 0).read_text()


def test_replica_that_never_becomes_ready_is_named(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    sup = supervisor(
        {"command": REPLICA + ["--never-ready"], "replicas": 1}, readiness_timeout_s=3.0
    )
    failure = wait_for("the readiness failure", lambda: sup.failure, timeout=60)
    assert failure.startswith("role rollout failed: replica 0 (")
    assert "never became ready" in failure and "within 3 s (readiness_timeout_s)" in failure
    pid = sup.replicas["rollout"][0].pid
    assert pid is not None and not alive(pid)
    assert sup.replicas["rollout"][0].state == "failed"


def test_probe_outcomes_of_a_real_server(tmp_path: Path) -> None:
    from trainguard.testing.ports import free_port

    port = free_port()
    assert probe_health(port, "/health", 1.0).outcome == "refused"
    env = base_env(TRAINGUARD_AGENT_ROLE_PORT=str(port))
    proc = subprocess.Popen(REPLICA + ["--weight-version", "7"], env=env)
    try:
        p = wait_for(
            "the server", lambda: (r := probe_health(port, "/health", 1.0)).outcome == "ok" and r
        )
        assert (p.status, p.weight_version) == ("serving", 7)
        assert probe_health(port, "/missing", 1.0).outcome == "http_error"
        assert probe_health(port, "/whoami", 1.0).outcome == "malformed"  # no "status"
        os.kill(proc.pid, signal.SIGSTOP)
        assert probe_health(port, "/health", 0.5).outcome == "timeout"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def _get(port: int, path: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.read().decode()


@pytest.mark.slow  # two engine starts: torch, transformers and the tiny model each
def test_the_real_engine_as_a_rollout_replica(tmp_path: Path) -> None:
    """trainguard.rl's engine under the supervisor: loading until the trainer publishes a
    weight version, then serving it; killed -9, it is replaced on its port and the
    replacement serves the current version again."""
    from trainguard.rl import WeightStore
    from trainguard.rl.tiny import tiny_gpt2

    engine = [sys.executable, "-m", "trainguard.rl.engine", "--poll-interval-s", "0.2"]
    cfg = RolesConfig(rollout={"command": engine, "replicas": 1}, **FAST)
    sup = RoleSupervisor(cfg, tmp_path, EventLog(tmp_path), env=base_env())
    rep = sup.replicas["rollout"][0]
    try:
        sup.start()
        wait_for("the engine loading", lambda: rep.state == "loading", timeout=120)
        assert rep.weight_version is None and rep.ready_at is not None
        WeightStore(tmp_path / "rl" / "weights").publish(3, tiny_gpt2(seed=1).state_dict())
        (pid,) = wait_for("the engine serving", lambda: serving_pids(sup), timeout=60)
        assert rep.weight_version == 3
        os.kill(pid, signal.SIGKILL)
        new = wait_for(
            "the replacement serving", lambda: (p := serving_pids(sup)) and p != [pid] and p, 120
        )
        state = json.loads(RunDir(tmp_path).role_state("rollout", 0).read_text())
        assert state["pid"] == new[0] and state["weight_version"] == 3 and state["restarts"] == 1
        assert state["url"] == rep.url and sup.failure is None

        # each incarnation served the published version from its first answer on (the event
        # follows the replica's state by a moment: the supervisor sets it, then emits)
        def served() -> list[tuple[int, int]]:
            events = kinds(tmp_path, "role_replica_state")
            return [(e["pid"], e["weight_version"]) for e in events if e["state"] == "serving"]

        wait_for("the replacement's serving event", lambda: len(served()) >= 2, timeout=10)
        assert served() == [(pid, 3), (new[0], 3)]
    finally:
        sup.stop()


# -- in a job: isolation both ways ----------------------------------------------------------------
def _job_env(**extra: str) -> dict[str, str]:
    return base_env(
        TRAINGUARD_HEALTH_ENABLED="0",
        TRAINGUARD_ROLES_PROBE_INTERVAL_S="0.25",
        TRAINGUARD_ROLES_PROBE_TIMEOUT_S="1.0",
        **extra,
    )


def _records(out: Path) -> list[dict[str, Any]]:
    recs = []
    for f in sorted(out.glob("rank_*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                recs.append({"rank": int(f.stem.split("_")[1]), **json.loads(line)})
            except ValueError:
                continue
    return recs


def _engine_pids(run_dir: Path) -> list[int] | None:
    states = RunDir(run_dir).role_states().get("rollout", [])
    if len(states) == 2 and all(s["state"] == "serving" for s in states):
        return [s["pid"] for s in states]
    return None


def test_engine_and_trainer_fail_apart_in_one_job(tmp_path: Path) -> None:
    """An engine killed -9 restarts alone (the trainer keeps its attempt and PIDs); a trainer
    rank killed -9 restarts the trainer group (the engines keep their PIDs)."""
    out, run = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    role = f"rollout=2:{' '.join(REPLICA)}"
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
            "--monitor-interval", "0.1", "--no-tg-warm", "--tg-run-dir", str(run),
            "--tg-role", role, TRAINER]  # fmt: skip
    job = popen("trainguard", args, cwd=tmp_path, env=_job_env(OUT_DIR=str(out)))
    try:
        engines = wait_for("both engines serving", lambda: _engine_pids(run), timeout=90)

        def attempt0_sees(pids: list[int]) -> dict[int, int] | None:
            recs = [r for r in _records(out) if r["engines"] == pids]
            ranks = {r["rank"]: r["pid"] for r in recs}
            return ranks if len(ranks) == 2 else None

        workers = wait_for("both ranks reach both engines", lambda: attempt0_sees(engines), 90)
        first = _records(out)[0]
        ports = [s["port"] for s in RunDir(run).role_states()["rollout"]]
        assert first["urls"] == [f"http://127.0.0.1:{p}" for p in ports]
        assert first["role_env"] is None  # a trainer worker is not a replica

        # 1. an engine dies: it alone restarts
        os.kill(engines[0], signal.SIGKILL)
        engines2 = wait_for(
            "engine 0 replaced",
            lambda: (p := _engine_pids(run)) and p[0] != engines[0] and p,
            timeout=60,
        )
        assert engines2[1] == engines[1]
        after = wait_for("the ranks reach the new engine", lambda: attempt0_sees(engines2), 60)
        assert after == workers  # same worker PIDs
        assert {r["restart"] for r in _records(out)} == {0}
        assert kinds(run, "restart") == [] and kinds(run, "worker_failed") == []

        # 2. a trainer rank dies: the group restarts, the engines do not
        os.kill(workers[1], signal.SIGKILL)
        wait_for(
            "the restarted trainer group reaches the engines",
            lambda: (
                len(
                    {
                        r["rank"]
                        for r in _records(out)
                        if r["restart"] == 1 and r["engines"] == engines2
                    }
                )
                == 2
            ),
            timeout=90,
        )
        assert _engine_pids(run) == engines2
        assert len(kinds(run, "role_replica_started")) == 3  # two starts and one replacement
        (out / "stop").touch()
        _, err = job.communicate(timeout=90)
        assert job.returncode == 0, err[-3000:]
    finally:
        kill_tree(job.pid)
        job.wait()
    assert not any(alive(p) for p in engines2)  # stopped with the job
    (restart,) = kinds(run, "restart")
    failed = kinds(run, "role_replica_failed")
    assert [e["pid"] for e in failed] == [engines[0]]
    assert {s["state"] for s in RunDir(run).role_states()["rollout"]} == {"stopped"}
    assert "rollout: 1 replica failure (replica 0), restarted alone" in err
    # the report's engine-fleet timeline: the trainer's two attempts beside each replica
    html = write_report(run).read_text()
    fleet = html.split('<div id="fleet">', 1)[1].split("</div>", 1)[0]
    lanes = fleet.split('class="tg-ytick">')[1:]
    assert [ln.split("<", 1)[0] for ln in lanes] == ["trainer", "rollout 0", "rollout 1"]
    assert lanes[0].count('class="tg-attempt"') == 2
    assert 'class="tg-role-dead"' in lanes[1] and 'class="tg-role-dead"' not in lanes[2]
    assert lanes[1].count('class="tg-role-serving"') == 2 and 'class="tg-role-serving"' in lanes[2]


def test_engines_die_with_an_agent_killed_9(tmp_path: Path) -> None:
    """No orphan engine holds its port after the node agent itself is killed -9."""
    out, run = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    args = ["--standalone", "--nproc-per-node", "1", "--no-tg-warm", "--tg-run-dir", str(run),
            "--tg-role", f"rollout=2:{' '.join(REPLICA)}", TRAINER]  # fmt: skip
    job = popen("trainguard", args, cwd=tmp_path, env=_job_env(OUT_DIR=str(out)))
    workers: set[int] = set()
    try:
        engines = wait_for("both engines serving", lambda: _engine_pids(run), timeout=90)
        workers = wait_for("the trainer", lambda: {r["pid"] for r in _records(out)}, 90)
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
        wait_for("the engines gone", lambda: not any(alive(p) for p in engines), timeout=30)
    finally:
        kill_tree(job.pid)
        for pid in workers:  # torch's workers are not ours to save from an agent's kill -9
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        job.communicate()


def test_role_failure_ends_the_job_with_one_line(tmp_path: Path) -> None:
    out, run = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    role = f"rollout=1,budget=1:{' '.join(REPLICA)} --exit-at-once 3"
    args = ["--standalone", "--nproc-per-node", "1", "--no-tg-warm", "--tg-run-dir", str(run),
            "--tg-role", role, TRAINER]  # fmt: skip
    job = popen("trainguard", args, cwd=tmp_path, env=_job_env(OUT_DIR=str(out)))
    try:
        _, err = job.communicate(timeout=120)
    finally:
        kill_tree(job.pid)
        job.wait()
    assert job.returncode == 2, err[-3000:]
    lines = [ln for ln in err.splitlines() if "role rollout failed" in ln]
    assert len(lines) >= 1 and lines[-1].startswith(
        "trainguard run: role rollout failed: replica 0"
    )
    assert "exited with code 3 before it was ever ready; restart budget 1 spent" in lines[-1]
    trainer_pids = {r["pid"] for r in _records(out)}
    assert not any(alive(p) for p in trainer_pids)
    assert kinds(run, "job_finished")[-1]["state"] == "failed"
    assert "role rollout failed: replica 0" in write_report(run).read_text()


def test_frozen_promoted_standby_does_not_make_its_successor_ready_or_dead(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    """The standby is SIGSTOPped (starved) when it is promoted: it still answers nothing and
    moves nowhere. Its successor is never ``standby`` from its predecessor's answers, never
    ``dead`` while it starts, and is ready by its own answer."""
    sup = supervisor({"command": REPLICA + ["--loading-s", "0.5"], "replicas": 1, "standby": 1})
    (pid,) = wait_for("the replica serving", lambda: serving_pids(sup))
    spare = wait_for("the standby ready", lambda: _standby(sup))
    os.kill(spare["pid"], signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        wait_for("the standby promoted", lambda: sup.replicas["rollout"][0].pid == spare["pid"])
        time.sleep(3.0)  # the successor starts while its predecessor holds its old port
    finally:
        os.kill(spare["pid"], signal.SIGCONT)
    wait_for("the promoted standby serving", lambda: serving_pids(sup) == [spare["pid"]])
    again = wait_for("a new standby ready", lambda: _standby(sup, spare["pid"]), timeout=60)
    states = path_of(tmp_path, "role_standby_state", "standby")
    assert states == ["starting", "standby", "promoted", "starting", "standby"]
    ready = {e["pid"] for e in kinds(tmp_path, "role_standby_state") if e["state"] == "standby"}
    assert ready == {spare["pid"], again["pid"]}  # each by its own answer


def test_back_to_back_deaths_are_each_covered_by_the_standby_pool(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    """A pool of 2 standbys for the role: two replicas killed 2 s apart are both replaced by
    a standby (no cold start), each by one that proved its readiness with its own answer."""
    sup = supervisor({"command": REPLICA, "replicas": 2, "standby": 2})
    pids = wait_for("both replicas serving", lambda: serving_pids(sup))
    slots = sup.standbys["rollout"]
    wait_for("both standbys ready", lambda: all(s.state == "standby" for s in slots))
    spares = {s.pid for s in slots}
    os.kill(pids[0], signal.SIGKILL)
    time.sleep(2.0)
    os.kill(pids[1], signal.SIGKILL)
    new = wait_for(
        "both replicas replaced and serving",
        lambda: (p := serving_pids(sup)) and not set(p) & set(pids) and p,
    )
    assert set(new) == spares  # both were standbys: no cold start
    started = kinds(tmp_path, "role_replica_started")[2:]
    assert sorted(e["replica"] for e in started) == [0, 1]
    assert all(e["standby"] is not None for e in started)
    ready = {e["pid"]: e["incarnation"] for e in kinds(tmp_path, "role_standby_state")
             if e["state"] == "standby"}  # fmt: skip
    assert {e["pid"]: e["incarnation"] for e in started} == {p: ready[p] for p in new}
    assert sup.restarts["rollout"] == 2 and sup.failure is None
    wait_for("two new standbys ready", lambda: all(
        s.state == "standby" and s.pid not in spares for s in slots))  # fmt: skip


def test_stopped_standby_is_out_of_the_pool_not_dead(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    """A standby SIGSTOPped for longer than ``dead_after_s`` (a starved low-priority process) is
    ``suspect``, not promoted: the replica killed meanwhile restarts cold; continued, the
    standby answers again and is back in the pool, the same process."""
    sup = supervisor({"command": REPLICA, "replicas": 1, "standby": 1}, dead_after_s=1.5)
    (pid,) = wait_for("the replica serving", lambda: serving_pids(sup))
    spare = wait_for("the standby ready", lambda: _standby(sup))
    sb = sup.standbys["rollout"][0]
    os.kill(spare["pid"], signal.SIGSTOP)
    try:
        wait_for("the standby suspect", lambda: sb.state == "suspect", timeout=30)
        os.kill(pid, signal.SIGKILL)
        (cold,) = wait_for("a cold restart", lambda: (p := serving_pids(sup)) and p != [pid] and p)
        assert cold != spare["pid"]
        time.sleep(3 * 1.5)  # stopped well past dead_after_s
    finally:
        os.kill(spare["pid"], signal.SIGCONT)

    # never dead, never started again: out of the pool while silent, the same process back
    def back() -> list[str] | None:
        got = [e["state"] for e in kinds(tmp_path, "role_standby_state")]
        return got if "suspect" in got and got[-1] == "standby" else None

    states = wait_for("the standby back", back, timeout=30)
    assert "dead" not in states and states.count("starting") == 1, states
    assert sb.pid == spare["pid"]
    (started,) = kinds(tmp_path, "role_replica_started")[1:]
    assert started["standby"] is None and started["pid"] == cold


def test_squatter_on_a_replica_port_is_never_the_replica(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    """Another process answers health on replica 0's port, claiming the engine contract: it
    is never counted as the replica; one event names the port and the squatter; the replica
    waits for its port (bounded), is retired, and the role goes on with replica 1 without
    spending its restart budget."""
    port = free_port(2)
    env = base_env(TRAINGUARD_AGENT_ROLE_PORT=str(port))
    squatter = subprocess.Popen(REPLICA + ["--squat-incarnation", "forged"], env=env)
    try:
        wait_for("the squatter", lambda: probe_health(port, "/health", 1.0).outcome == "ok")
        sup = supervisor({"command": REPLICA, "replicas": 2, "port": port}, port_wait_s=2.0)
        rep0, rep1 = sup.replicas["rollout"]
        # the retirement's event awaited (the state is set before it is written)
        (retired,) = wait_for("replica 0 retired",
                              lambda: kinds(tmp_path, "role_replica_retired"), timeout=30)  # fmt: skip
        assert rep0.state == "retired"
        wait_for("replica 1 serving", lambda: rep1.state == "serving")
        taken = [e for e in kinds(tmp_path, "role_port_taken") if e["replica"] == 0]
        assert taken and {(e["port"], e["holder_pid"]) for e in taken} == {(port, squatter.pid)}
        assert "role_replica.py --squat-incarnation forged" in taken[0]["holder"]
        states = [e["state"] for e in kinds(tmp_path, "role_replica_state") if e["replica"] == 0]
        assert "serving" not in states and "loading" not in states
        assert (retired["replica"], retired["left"], retired["floor"]) == (0, 1, 1)
        assert f"port {port} stayed taken" in retired["reason"]
        assert sup.failure is None and sup.restarts["rollout"] == 0
        assert kinds(tmp_path, "role_replica_started")[0]["replica"] == 1  # never started 0
    finally:
        squatter.kill()
        squatter.wait()


def test_replica_that_dies_after_every_load_is_retired_then_the_floor_stops_the_role(
    tmp_path: Path, supervisor: Callable[..., RoleSupervisor]
) -> None:
    sup = supervisor(
        {"command": REPLICA + ["--die-after-s", "0.3"], "replicas": 1, "retire_after": 2,
         "restart_budget": 10},
    )  # fmt: skip
    failure = wait_for("the floor failure", lambda: sup.failure, timeout=60)
    assert failure.startswith("role rollout failed: 0 of 1 replicas left, below its floor of 1")
    assert "replica 0 (" in failure and "exited with code 5, after 2 restarts" in failure
    assert "\n" not in failure
    assert sup.restarts["rollout"] == 2  # the role's budget was not what stopped it
    (retired,) = kinds(tmp_path, "role_replica_retired")
    assert (retired["restarts"], retired["left"]) == (2, 0)
    assert len(kinds(tmp_path, "role_replica_failed")) == 3
    assert sup.replicas["rollout"][0].state == "retired"


def test_health_answers_count_only_from_the_process_started() -> None:
    """The identity rule, for every kind of answer (the real-process cases are above)."""
    from trainguard.core.contracts.engine import HealthAnswer, Probe
    from trainguard.roles.health import Whose, whose
    from trainguard.roles.liveness import Incarnation

    def ok(status: str, pid: int | None = None, incarnation: str | None = None) -> Probe:
        return Probe("ok", HealthAnswer(S(status), pid=pid, incarnation=incarnation))

    me = os.getpid()
    assert whose(ok("serving", incarnation="abc"), me, "abc") is Whose.OWN
    assert whose(ok("serving", pid=me, incarnation="xyz"), me, "abc") is Whose.FOREIGN
    assert whose(ok("serving", pid=me), os.getpgid(me), "abc") is Whose.OWN
    assert whose(ok("serving", pid=1), me, "abc") is Whose.FOREIGN
    assert whose(ok("serving"), me, "abc") is Whose.ANONYMOUS
    inc = Incarnation(me, "abc", ready_deadline_s=10, dead_after_s=2, slow_limit_s=8,
                      ready_statuses=(S.SERVING,))  # fmt: skip
    t0 = inc.started
    assert inc.judge(ok("serving", incarnation="other"), False, t0).verdict == "foreign"
    assert inc.judge(Probe("timeout"), False, t0 + 5).verdict == "wait"  # start-up: no death
    assert inc.judge(ok("starting", incarnation="abc"), False, t0 + 11).verdict == "late"
    assert inc.judge(ok("serving", incarnation="abc"), False, t0 + 1).verdict == "ok"
    assert inc.judge(ok("serving", incarnation="other"), True, t0 + 2).verdict == "dead"
    assert inc.judge(ok("serving"), True, t0 + 4).verdict == "dead"  # anonymous
