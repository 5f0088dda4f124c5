"""The fleet database and lemon nodes, with real SQLite files, a real PostgreSQL (Debian's
``postgresql``, a throwaway cluster on loopback stopped by its PID) and real jobs.

- SQLite: records land once (retried batches are idempotent); a corrupt file, a database of
  another schema version and a wrong URL are one clear line; odd node names are stored escaped;
- PostgreSQL: many writers at once lose nothing; the server stopped while records are written
  and started again: every record lands, ``put`` never blocked;
- jobs: a user-code failure is recorded under the runs root; a node with 3 hardware incidents
  from earlier jobs is refused at the next job's start (``node_refused`` with its history,
  exit 94) and the spare runs in its place; ``trainguard fleet nodes | lemons | release``.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.launch_utils import base_env, free_port, wait_listening
from tests.procs import kill_tree
from trainguard.core.config.fleet import FleetConfig
from trainguard.core.failures import EVICTED_EXIT_CODE
from trainguard.fleet.db import SCHEMA_VERSION, FleetDBError, Record, open_db, safe_node_name
from trainguard.fleet.lemons import lemon_status
from trainguard.fleet.writer import FleetWriter
from trainguard.testing.postgres import Postgres

FAULTY = Path(__file__).resolve().parent / "workers" / "faulty.py"


def hw(node: str, job: str, attempt: int = 0, **kw: object) -> Record:
    return Record(node=node, kind="failure", cause="hardware", verdict="evict", job=job,
                  attempt=attempt, detail={"summary": "XID 79 on GPU 3"}, **kw)  # type: ignore[arg-type]  # fmt: skip


def wait_for(cond, timeout: float = 60.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


# -- SQLite --------------------------------------------------------------------------------------


def test_sqlite_records_lemons_release_and_bad_input(tmp_path: Path) -> None:
    db = open_db("", runs_root=tmp_path).connect()
    assert db.where == str(tmp_path / "fleet.db")
    assert sqlite3.connect(tmp_path / "fleet.db").execute("PRAGMA journal_mode").fetchone() == (
        "wal",
    )
    recs = [hw("n0", f"job{i}") for i in range(3)]
    # the same incident recorded three ways counts once; the same uid written twice lands once
    recs += [Record(node="n0", kind="eviction", cause="hardware", job="job0", attempt=0)]
    db.write(recs)
    db.write(recs[:2])
    assert db.count() == 4
    cfg = FleetConfig()
    st = lemon_status(db, "n0", cfg)
    assert st.is_lemon and st.incidents == 3 and len(st.history) == 3
    assert "XID 79" in st.history[0]["summary"] and "fleet release n0" in st.reason()
    assert not lemon_status(
        db, "n0", FleetConfig(lemon_window_days=0.00001), now=time.time() + 5
    ).is_lemon
    db.release("n0", by="op", reason="GPU replaced")
    assert not lemon_status(db, "n0", cfg).is_lemon
    db.close()

    # a name with odd characters: stored escaped, printable
    name, changed = safe_node_name("gpu\n17\x00")
    assert changed and name == "gpu\\x0a17\\x00"

    # another schema version: one line naming both
    with sqlite3.connect(tmp_path / "fleet.db") as c:
        c.execute("UPDATE trainguard_meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(
        FleetDBError, match=rf"schema version 99; this trainguard uses {SCHEMA_VERSION}"
    ):
        open_db("", runs_root=tmp_path).connect()
    # a corrupt file
    bad = tmp_path / "bad" / "fleet.db"
    bad.parent.mkdir()
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(FleetDBError, match="not a usable SQLite database.*move it aside"):
        open_db("", runs_root=bad.parent).connect()
    with pytest.raises(FleetDBError, match="is not postgresql"):
        open_db("mysql://x", runs_root=tmp_path)


def test_writer_never_blocks_and_drops_past_its_bound(tmp_path: Path) -> None:
    """A database that cannot be opened (a corrupt file): puts return at once, the records
    wait, the oldest are dropped past the bound (counted), close reports what is left."""
    bad = tmp_path / "fleet.db"
    bad.write_bytes(b"garbage" * 100)
    w = FleetWriter(lambda: open_db("", runs_root=tmp_path), queue_max=50, retry_s=0.2)
    t0 = time.monotonic()
    for i in range(200):
        w.put(hw("n1", "j", attempt=i))
    assert time.monotonic() - t0 < 5.0  # never waits on the database (generous on a loaded box)
    assert wait_for(lambda: w.errors > 0)
    assert "not a usable SQLite database" in (w.last_error or "")
    bad.unlink()  # repaired: the waiting records land
    assert w.flush(60)
    # a batch the writer had taken before the first failure goes back under the same bound:
    # exactly the newest 50 wait and land, the oldest 150 are dropped and counted
    assert w.close(5) == 0 and (w.written, w.dropped) == (50, 150)
    assert open_db("", runs_root=tmp_path).connect().count() == 50


# -- PostgreSQL ----------------------------------------------------------------------------------


@pytest.fixture
def pg():  # type: ignore[no-untyped-def]
    server = Postgres(max_connections=60)
    try:
        yield server
    finally:
        server.close()


def test_postgres_concurrent_writers_and_an_outage(pg: Postgres) -> None:
    url = pg.url
    cfg = FleetConfig(url=url)
    writers = [FleetWriter(lambda: open_db(url, runs_root="."), retry_s=0.3) for _ in range(40)]
    threads = [
        threading.Thread(
            target=lambda w=w, i=i: [w.put(hw(f"node{i}", f"j{k}")) for k in range(25)]
        )
        for i, w in enumerate(writers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(w.flush(120) for w in writers)
    assert sum(w.close(5) for w in writers) == 0
    with open_db(url, runs_root=".") as db:
        assert db.count() == 1000
        assert lemon_status(db, "node3", cfg).is_lemon  # 25 incidents in distinct jobs

    # the server goes away while records are written; they wait and land once it is back
    w = FleetWriter(lambda: open_db(url, runs_root=".", connect_timeout_s=1), retry_s=0.3)
    pg.stop()
    t0 = time.monotonic()
    for i in range(100):
        w.put(hw("down", f"j{i}"))
    assert time.monotonic() - t0 < 5.0
    assert wait_for(lambda: w.errors > 0)
    assert "unreachable" in (w.last_error or "") and w.pending == 100
    pg.start()
    assert w.flush(120), w.last_error
    assert w.close(5) == 0 and w.dropped == 0
    with open_db(url, runs_root=".") as db:
        assert len(db.history("down")) == 100
        # another schema version on PostgreSQL too
        db._exec("UPDATE trainguard_meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(FleetDBError, match="schema version 99"):
        open_db(url, runs_root=".").connect()


# -- real jobs -----------------------------------------------------------------------------------


def tg(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip


def job_env(**extra: str) -> dict[str, str]:
    return base_env(
        TRAINGUARD_TELEMETRY_ENABLED="false",
        TRAINGUARD_CHECKPOINT_MEMORY_TIER="false",
        TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0",
        TRAINGUARD_HEALTH_MIN_FREE_DISK_GIB="0",
        TRAINGUARD_HEALTH_MIN_FREE_MEMORY_GIB="0",
        **extra,
    )


@pytest.mark.timeout(600)
def test_lemon_refused_at_the_next_job_spare_runs_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    env = job_env(TRAINGUARD_RUNTIME_RUNS_ROOT=str(runs))
    # the successful `trainguard fleet` reads run in-process (the CLI's main, same config from
    # the environment); the one-line error at the end is one real launch
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAINGUARD_RUNTIME_RUNS_ROOT", str(runs))

    def fleet(*argv: str) -> tuple[int, str]:
        from trainguard.cli.cmd_fleet import main

        capsys.readouterr()
        rc = main(list(argv))
        return rc, capsys.readouterr().out

    # an earlier job's user error is recorded under the runs root
    r = tg("run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
           "--tg-run-dir", str(tmp_path / "first"), str(FAULTY), "--fault", "shape",
           cwd=tmp_path, env={**env, "SLURMD_NODENAME": "n1"})  # fmt: skip
    assert r.returncode == 93, r.stderr[-2000:]
    with open_db("", runs_root=runs) as db:
        (rec,) = db.history("n1")
    assert (rec.kind, rec.cause, rec.verdict) == ("failure", "user_code", "stop")
    assert rec.detail["place"] == f"{FAULTY}:32"

    # three hardware incidents of n0 in earlier jobs
    with open_db("", runs_root=runs) as db:
        db.write([hw("n0", f"old{i}") for i in range(3)])
    rc, out = fleet("lemons")
    assert rc == 0 and out.split()[4:6] == ["n0", "3"], out

    # the next job: 2 nodes wanted; n1 (hosting the rendezvous store) and n0 start, n0 refuses
    # to join; the spare n2 started then takes its place
    run_dir = tmp_path / "job"
    port = free_port()
    agents: dict[str, subprocess.Popen[str]] = {}
    try:
        for node in ("n1", "n0", "n2"):
            agents[node] = subprocess.Popen(
                [sys.executable, "-m", "trainguard", "run", "--nnodes", "2", "--nproc-per-node",
                 "1", "--max-restarts", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                 f"127.0.0.1:{port}", "--rdzv-id", "lemon", "--tg-run-dir", str(run_dir),
                 str(FAULTY), "--fault", "none", "--steps", "5"],
                cwd=tmp_path, env={**env, "SLURMD_NODENAME": node}, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                start_new_session=True,
            )  # fmt: skip
            if node == "n1":
                wait_listening(port)
            if node == "n0":
                agents[node].wait(timeout=300)
        codes = {n: p.wait(timeout=400) for n, p in agents.items()}
        errs = {n: p.stderr.read() if p.stderr else "" for n, p in agents.items()}
    finally:
        for p in agents.values():
            kill_tree(p)
    assert codes == {"n0": EVICTED_EXIT_CODE, "n1": 0, "n2": 0}, errs
    last = errs["n0"].strip().splitlines()[-1]
    assert "node n0 refused by job lemon: lemon node: 3 hardware incident(s)" in last, errs["n0"]
    evs = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    (refused,) = [e for e in evs if e["kind"] == "node_refused"]
    assert refused["node"] == "n0" and refused["lemon"] and len(refused["history"]) == 3
    started = {e["node"] for e in evs if e["kind"] == "workers_started"}
    assert started == {"n1", "n2"}

    rc, out = fleet("nodes")
    assert rc == 0 and "n0" in out and "n1" in out
    rc, out = fleet("release", "n0")
    assert rc == 0 and "node n0 released (3 incident(s)" in out
    assert fleet("lemons")[1].strip() == "no lemon nodes"
    bad = tg("fleet", "--url", "postgresql://x@127.0.0.1:1/db", "nodes", cwd=tmp_path, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "unreachable" in bad.stderr


@pytest.mark.timeout(400)
def test_job_runs_when_the_database_is_unusable(tmp_path: Path) -> None:
    """A corrupt SQLite file and a PostgreSQL URL whose password has a stray ``%``: the job
    trains and finishes, the lemon gate admits the node with one warning line; no part of the
    password reaches the agent's output, events.jsonl or config.json."""
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "fleet.db").write_bytes(b"corrupt" * 200)
    for extra in ({}, {"TRAINGUARD_FLEET_URL": "postgresql://tg:s3cr%zzet@127.0.0.1:1/fleet"}):
        env = job_env(TRAINGUARD_RUNTIME_RUNS_ROOT=str(runs), TRAINGUARD_FLEET_FLUSH_TIMEOUT_S="1",
                      **extra)  # fmt: skip
        r = tg("run", "--standalone", "--nproc-per-node", "1", "--tg-run-dir",
               str(tmp_path / f"job{len(extra)}"), str(FAULTY), "--fault", "none", "--steps", "3",
               cwd=tmp_path, env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        assert "fleet database: lemon check skipped, node admitted" in r.stderr
        assert "Traceback" not in r.stderr
        run_dir = tmp_path / f"job{len(extra)}"
        files = "".join(p.read_text() for p in (run_dir / "events.jsonl", run_dir / "config.json"))
        assert "s3cr" not in r.stderr + r.stdout + files
        if extra:
            (rec,) = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()
                      if '"fleet_records"' in x]  # fmt: skip
            assert "a password in the URL must be percent-encoded" in rec["error"], rec
