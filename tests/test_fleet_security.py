"""The fleet database's trust boundary, on a real PostgreSQL (one throwaway cluster for the module)
and real jobs:

- a URL whose password holds a stray ``%`` or an ``@`` is one line that quotes no part of the
  password (not the driver's message, which quotes it whole or sends part of it to the
  resolver), from the API, the writer and ``trainguard fleet``; a percent-encoded one works;
- with ``[fleet] node_role`` the database stamps each row with the role that wrote it: hardware
  records planted for a node by another writer (even one naming the node's role as writer) are
  not counted, and the next job on that node is admitted (a warning line says what was left
  out); the node's own records make it a lemon (the job refused, exit 94); a release counts
  only from the operator's role (a node role may not write one); planted sniff records do not
  move the baseline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_fleet import FAULTY, hw, job_env, tg
from trainguard.core.config.fleet import FleetConfig
from trainguard.core.failures import EVICTED_EXIT_CODE
from trainguard.core.urls import scrub_secrets, url_secrets, userinfo_problem
from trainguard.fleet.db import FleetDBError, Record, open_db
from trainguard.fleet.lemons import lemon_status
from trainguard.fleet.sniff import fleet_baseline
from trainguard.fleet.writer import FleetWriter
from trainguard.testing.postgres import Postgres


@pytest.fixture(scope="module")
def pg() -> Iterator[Postgres]:
    server = Postgres(max_connections=30)
    try:
        yield server
    finally:
        server.close()


def _url(pg: Postgres, userinfo: str) -> str:
    return f"postgresql://{userinfo}@127.0.0.1:{pg.port}/postgres"


def _fleet(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from trainguard.cli.cmd_fleet import main

    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_url_password_is_never_in_error_text(tmp_path: Path, pg: Postgres) -> None:
    stray, at = _url(pg, "postgres:s3cr%zzet"), _url(pg, "postgres:p@ssw0rd")
    for url, needle, encoded in ((stray, "s3cr", "%25"), (at, "ssw0rd", "%40")):
        with pytest.raises(FleetDBError) as got:
            open_db(url, runs_root=tmp_path).connect()
        msg = str(got.value)
        assert needle not in msg and "\n" not in msg, msg
        assert msg.startswith(f"[fleet] url postgresql://127.0.0.1:{pg.port}/... cannot be used")
        assert f"not percent-encoded ({encoded})" in msg and "must be percent-encoded" in msg
        # the writer keeps it as its last error (logged, and in the fleet_records event)
        w = FleetWriter(lambda u=url: open_db(u, runs_root=tmp_path), retry_s=0.2)
        w.put(hw("n0", "j"))
        assert w.close(0.5) == 1 and w.last_error == msg
    # the command line: one line, exit 2
    r = tg("fleet", "--url", stray, "nodes", cwd=tmp_path, env=job_env())
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "s3cr" not in r.stderr + r.stdout and "must be percent-encoded" in r.stderr
    # percent-encoded, the same password works (the test cluster trusts loopback logins)
    with open_db(_url(pg, "postgres:s3cr%25zzet%40x"), runs_root=tmp_path) as db:
        assert db.count() >= 0
    # what the driver says about a URL is scrubbed of its user info and password
    secrets = url_secrets("postgresql://tg:p@ss%25word@h:5432/db?password=qs3cret")
    said = "invalid token: \"p@ss%25word\"; host 'ss%25word@h'; pass p@ss%word qs3cret"
    assert scrub_secrets(said, secrets) == "invalid token: \"***\"; host '***@h'; pass *** ***"
    slash = "postgresql://tg:pass/word@h/db"  # read as host tg, port "pass"
    assert "'/', '?' or '#'" in (userinfo_problem(slash) or "")
    assert scrub_secrets('invalid port "pass"', url_secrets(slash)) == 'invalid port "***"'
    assert userinfo_problem("postgresql://tg:p%40ss%2Fw@h/db") is None


@pytest.fixture(scope="module")
def roles(pg: Postgres) -> FleetConfig:
    """Node roles tg_n0, tg_n1 (members of trainguard_nodes) and the operator role, granted
    with ``trainguard fleet grant`` by the tables' owner."""
    with open_db(pg.url, runs_root=".") as db:  # the owner creates the tables
        for stmt in (
            "CREATE ROLE trainguard_nodes",
            "CREATE ROLE tg_n0 LOGIN IN ROLE trainguard_nodes",
            "CREATE ROLE tg_n1 LOGIN IN ROLE trainguard_nodes",
            "CREATE ROLE trainguard_operator LOGIN",
        ):
            db._exec(stmt)
    from trainguard.cli.cmd_fleet import main

    assert main(["--url", pg.url, "grant", "--nodes", "trainguard_nodes"]) == 0
    return FleetConfig(url=pg.url, node_role="tg_{node}")


@pytest.mark.timeout(400)
def test_planted_records_and_releases_do_not_count(
    tmp_path: Path,
    pg: Postgres,
    roles: FleetConfig,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = roles
    # another node's role plants 3 hardware incidents of n0 from made-up jobs, and one row
    # that names n0's role as its writer
    with open_db(pg.url, runs_root=".", role="tg_n1") as planter:
        planter.write([hw("n0", f"made-up-{i}") for i in range(3)])
        planter._exec(
            "INSERT INTO trainguard_records (uid, time, node, kind, cause, job, attempt, writer) "
            "VALUES ('forged', extract(epoch from now()), 'n0', 'failure', 'hardware', "
            "'made-up-3', 0, 'tg_n0')"
        )
        st = lemon_status(planter, "n0", cfg)
        assert not st.is_lemon and st.incidents == 0 and st.ignored == 4
        assert {r.writer for r in planter.history("n0")} == {"tg_n1"}
        # without node roles every writer is trusted: that is what node_role closes
        assert lemon_status(planter, "n0", FleetConfig(url=pg.url)).is_lemon

    # the next job on n0 is admitted, with one warning line naming what was left out
    env = job_env(TRAINGUARD_FLEET_URL=pg.url, TRAINGUARD_FLEET_NODE_ROLE="tg_{node}",
                  TRAINGUARD_RUNTIME_RUNS_ROOT=str(tmp_path / "runs"), SLURMD_NODENAME="n0")  # fmt: skip
    r = tg("run", "--standalone", "--nproc-per-node", "1", "--tg-run-dir", str(tmp_path / "a"),
           str(FAULTY), "--fault", "none", "--steps", "2", cwd=tmp_path, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 record(s) of node n0 not written by its role tg_n0: not counted" in r.stderr
    evs = [json.loads(x) for x in (tmp_path / "a" / "events.jsonl").read_text().splitlines()]
    assert not [e for e in evs if e["kind"] == "node_refused"]

    # n0's own three incidents: a lemon, and the next job on n0 is refused
    with open_db(pg.url, runs_root=".", role="tg_n0") as node:
        node.write([hw("n0", f"job{i}") for i in range(3)])
        assert lemon_status(node, "n0", cfg).incidents == 3
    r = tg("run", "--standalone", "--nproc-per-node", "1", "--tg-run-dir", str(tmp_path / "b"),
           str(FAULTY), "--fault", "none", "--steps", "2", cwd=tmp_path, env=env)  # fmt: skip
    assert r.returncode == EVICTED_EXIT_CODE, r.stderr[-3000:]
    assert "node n0 refused by job" in r.stderr.strip().splitlines()[-1]

    # a node's role may not release; a release by a role other than the operator's (here the
    # tables' owner) does not count; the operator's does
    rc, _, err = _fleet(capsys, "--url", _url(pg, "tg_n1"), "release", "n0")
    assert rc == 2 and err.count("\n") == 1, err
    assert "permission denied for table trainguard_releases" in err
    with open_db(pg.url, runs_root=".") as owner:
        owner.release("n0", by="someone", reason="not an operator")
        assert lemon_status(owner, "n0", cfg).is_lemon
    monkeypatch.setenv("TRAINGUARD_FLEET_NODE_ROLE", "tg_{node}")  # release: as the operator
    rc, out, err = _fleet(capsys, "--url", pg.url, "release", "n0", "--reason", "GPU replaced")
    assert rc == 0 and "node n0 released (3 incident(s)" in out, err  # as trainguard_operator
    with open_db(pg.url, runs_root=".", role="tg_n0") as node:
        assert not lemon_status(node, "n0", cfg).is_lemon
        (rel,) = node._exec(
            "SELECT writer FROM trainguard_releases WHERE reason = %s", ("GPU replaced",)
        )
        assert rel == ("trainguard_operator",)


def test_planted_sniff_records_do_not_move_the_baseline(pg: Postgres, roles: FleetConfig) -> None:
    def sniff(node: str, gemm_s: float) -> Record:
        return Record(node=node, kind="sniff", cause="ok", job="j",
                      detail={"device_model": "cpu-test", "gemm_size": 64, "gemm_s": gemm_s})  # fmt: skip

    with open_db(pg.url, runs_root=".", role="tg_n1") as n1:
        n1.write([sniff("n1", 0.01) for _ in range(3)])  # n1's own
        n1.write([sniff("n0", 9.0) for _ in range(7)])  # planted as n0's
        assert fleet_baseline(n1, cfg=roles)["cpu-test|64"] == 0.01
        assert fleet_baseline(n1)["cpu-test|64"] == 9.0  # what trusting every writer gives


def test_node_role_needs_postgres_and_a_node(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for url, role, why in (
        ("", "tg_{node}", "needs a postgresql:// url"),
        ("postgresql://h/db", "tg_nodes", "names no node"),
    ):
        monkeypatch.setenv("TRAINGUARD_FLEET_URL", url)
        monkeypatch.setenv("TRAINGUARD_FLEET_NODE_ROLE", role)
        rc, _, err = _fleet(capsys, "nodes")
        assert rc == 2 and err.count("\n") == 1 and why in err, err


V1 = (  # the tables as schema version 1 made them
    "CREATE TABLE trainguard_meta (key TEXT PRIMARY KEY, value TEXT)",
    "INSERT INTO trainguard_meta VALUES ('schema_version', '1')",
    "CREATE TABLE trainguard_records (uid TEXT PRIMARY KEY, time REAL, node TEXT, device TEXT, "
    "job TEXT, attempt INTEGER, kind TEXT, cause TEXT, verdict TEXT, detail TEXT)",
    "CREATE TABLE trainguard_releases (node TEXT, time REAL, by_whom TEXT, reason TEXT)",
    "INSERT INTO trainguard_records VALUES ('old', 1e9, 'n9', '', 'j', 0, 'failure', "
    "'hardware', 'evict', '{}')",
)


def test_a_version_1_database_is_upgraded_in_place(tmp_path: Path, pg: Postgres) -> None:
    import sqlite3

    import psycopg

    with sqlite3.connect(tmp_path / "fleet.db") as c:
        for stmt in V1:
            c.execute(stmt)
    with psycopg.connect(pg.url, autocommit=True) as c:
        c.execute("CREATE DATABASE fleet_v1")
    with psycopg.connect(pg.url.rsplit("/", 1)[0] + "/fleet_v1") as c:
        for stmt in V1:
            c.execute(stmt)
    for url in ("", pg.url.rsplit("/", 1)[0] + "/fleet_v1"):
        with open_db(url, runs_root=tmp_path) as db:
            (old,) = db.history("n9")
            assert old.writer == ""  # written before: no node's role wrote it
            db.write([hw("n9", "new")])
            db.release("n9", by="op", reason="r")
            new = db.history("n9")[-1]
            assert new.job == "new" and new.writer == ("postgres" if url else "")
            assert db._exec("SELECT value FROM trainguard_meta")[0] == ("2",)
