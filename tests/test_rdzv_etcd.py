"""The etcd v3 rendezvous backend against a real etcd 3.4 (Debian etcd-server, on loopback).

Backend compare-and-swap semantics (two writers race, one wins), the Store operations, the run's
lease, a real 2-agent x 1-process gloo job over ``--rdzv-backend etcd-v3`` (the assertions are
about the agents' rendezvous, so one worker per agent), kill -9 of the rank-0 agent (the one that
hosts the store under c10d) with its worker, and etcd stopped for 10 s mid-run and started again
on the same data directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from tests.launch_utils import REPO, base_env, steps_done
from tests.procs import descendants
from trainguard.runtime import etcd_v3
from trainguard.runtime.etcd_v3.codec import decode_state
from trainguard.testing.etcd import Etcd, make_certs

pytestmark = pytest.mark.etcd

EXAMPLE = str(REPO / "examples" / "train_mlp.py")


def _params(
    etcd: Etcd, run_id: str, *, min_nodes: int = 1, max_nodes: int = 2, **conf: str
) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, min_nodes=min_nodes,
        max_nodes=max_nodes, **conf,
    )  # fmt: skip


# -- backend and store against real etcd --------------------------------------------------------
def test_backend_cas_two_writers_race_one_wins(etcd: Etcd) -> None:
    a, _ = etcd_v3.create_backend(_params(etcd, "cas"))
    b, _ = etcd_v3.create_backend(_params(etcd, "cas"))
    assert a.get_state() is None
    first = a.set_state(b"s0")
    assert first is not None and first[0] == b"s0" and first[2] is True
    state, token = b.get_state()  # type: ignore[misc]
    assert state == b"s0" and token == first[1]

    # Both writers hold the same token; they race from two threads at once.
    results: dict[str, tuple[bytes, object, bool] | None] = {}
    go = threading.Barrier(2)

    def write(name: str, backend: etcd_v3.EtcdV3RendezvousBackend) -> None:
        go.wait()
        results[name] = backend.set_state(name.encode(), token)

    threads = [threading.Thread(target=write, args=(n, be)) for n, be in (("A", a), ("B", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    won = [n for n, r in results.items() if r and r[2]]
    assert len(won) == 1, results
    loser = "B" if won == ["A"] else "A"
    lost = results[loser]
    # the loser gets the winner's state and its token back, not its own write
    assert lost is not None and lost[0] == won[0].encode() and lost[2] is False
    assert a.get_state() == (won[0].encode(), results[won[0]][1])  # type: ignore[index]

    # a first write (token None) when the key exists fails too: the state is never clobbered
    again = b.set_state(b"clobber", None)
    assert again is not None and again[2] is False and again[0] == won[0].encode()
    stale = a.set_state(b"stale", token)
    assert stale is not None and stale[2] is False and stale[0] == won[0].encode()


def test_store_ops(etcd: Etcd) -> None:
    _, s = etcd_v3.create_backend(_params(etcd, "store"))
    _, other = etcd_v3.create_backend(_params(etcd, "store"))  # a second agent, same run
    s.set("k", "v")
    assert other.get("k") == b"v"
    s.set("bin", b"\x00\xff")
    assert other.get("bin") == b"\x00\xff"
    assert s.add("n", 3) == 3 and other.add("n", 2) == 5 and s.add("n", 0) == 5
    assert s.compare_set("cs", "", "x") == b"x"  # absent + expected empty: set
    assert s.compare_set("cs", "y", "z") == b"x"  # mismatch: current value
    assert s.compare_set("cs", "x", "z") == b"z"
    assert s.compare_set("absent", "e", "d") == b"e"  # absent + expected set: expected back
    assert s.check(["k", "n"]) and not s.check(["k", "nope"])
    n = s.num_keys()
    assert s.delete_key("k") and not s.delete_key("k") and s.num_keys() == n - 1

    # wait/get block until another agent sets the key
    threading.Timer(0.5, lambda: other.set("late", "here")).start()
    t0 = time.monotonic()
    assert s.get("late") == b"here" and time.monotonic() - t0 >= 0.4
    with pytest.raises(dist.DistStoreError):
        s.wait(["never"], timedelta(seconds=0.3))
    s.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError):
        s.get("never")

    # through torch's PrefixStore, as the handler hands it out (multi_get/multi_set too)
    p = dist.PrefixStore("torch.rendezvous.store.0", s)
    p.multi_set(["a", "b"], ["1", "2"])
    assert p.multi_get(["a", "b"]) == [b"1", b"2"]
    p.append("a", "3")
    assert p.get("a") == b"13"
    # two runs do not see each other's keys
    _, run2 = etcd_v3.create_backend(_params(etcd, "store-2"))
    assert not run2.check(["n"])
    # every key under a prefix in one read
    s.multi_set(["under/a", "under/b", "underway"], ["1", "2", "3"])
    assert s.under("under/") == {"under/a": b"1", "under/b": b"2"}


def test_a_reaper_watching_many_beacons_reads_them_in_one_range(etcd: Etcd) -> None:
    """A spare of a large job watches every node's beacon: past UNDER_FROM beacons the reaper
    reads the job's beacons in one range (the same values as one read of each)."""
    from trainguard.core.config.spares import SparesConfig
    from trainguard.runtime import spares

    h = etcd_v3.create_rdzv_handler(_params(etcd, "beacons", min_nodes=1, max_nodes=400))
    prefix = f"{spares.BEACON_PREFIX}beacons/"
    reaper = spares.Reaper(h, SparesConfig(), lambda *a, **k: None, beacon_prefix=prefix)
    store = h._store  # type: ignore[attr-defined]
    many = [f"node{i}" for i in range(spares.UNDER_FROM + 50)]
    store.multi_set([prefix + n for n in many[:-1]], [str(i) for i in range(len(many) - 1)])
    expected = {n: str(i) for i, n in enumerate(many[:-1])}  # the last one has no beacon
    client = store._client
    calls: list[str] = []
    call = client.call
    client.call = lambda path, payload, **kw: (calls.append(path), call(path, payload, **kw))[1]
    assert reaper._beacons(list(many)) == expected
    assert calls == ["kv/range"]  # one read
    assert store_values(store, prefix, many) == expected  # as read one by one
    calls.clear()
    few = many[:5]
    assert reaper._beacons(few) == {n: expected[n] for n in few}
    assert calls == ["kv/txn"]  # a few: one read of those keys


def store_values(store: Any, prefix: str, nodes: list[str]) -> dict[str, str]:
    """One read per key (the reaper's path for a few beacons)."""
    found = store.existing([prefix + n for n in nodes])
    return {n: found[prefix + n].decode() for n in nodes if prefix + n in found}


def test_atomic_add_from_many_clients(etcd: Etcd) -> None:
    stores = [etcd_v3.create_backend(_params(etcd, "adds"))[1] for _ in range(4)]

    def bump(s: etcd_v3.EtcdV3Store) -> None:
        for _ in range(10):
            s.add("ctr", 1)

    threads = [threading.Thread(target=bump, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert stores[0].add("ctr", 0) == 40


def test_run_keys_expire_with_the_last_agent(etcd: Etcd) -> None:
    backend, store = etcd_v3.create_backend(_params(etcd, "lease", lease_ttl="2"))
    backend.set_state(b"x")
    store.set("k", "v")
    store._client.close()  # the agent is gone: nobody keeps the run's lease alive
    probe = etcd_v3.create_backend(_params(etcd, "other-run"))[0]._client
    deadline = time.monotonic() + 20
    while probe.get(backend.key) is not None:
        assert time.monotonic() < deadline, "the run's keys did not expire"
        time.sleep(0.2)
    assert probe.get("/trainguard/rdzv/lease/store/k") is None


def test_lease_is_kept_alive_while_an_agent_lives(etcd: Etcd) -> None:
    backend, _ = etcd_v3.create_backend(_params(etcd, "alive", lease_ttl="2"))
    written = backend.set_state(b"x")
    assert written is not None and written[2], written
    time.sleep(5)  # well past the TTL: the keep-alive thread refreshed it
    probe = etcd_v3.create_backend(_params(etcd, "alive"))[0]  # another agent of the run
    assert probe.key == backend.key
    seen = probe.get_state()
    assert seen is not None, "the state expired although its agent lives"
    # the value written, at the revision written: kept by the lease, never rewritten
    assert seen == (b"x", written[1])


def test_bad_options_are_one_line_errors(etcd: Etcd, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(etcd_v3.EtcdV3ConfigError, match="password_file"):
        etcd_v3.create_backend(_params(etcd, "x", user="u", password="secret"))
    with pytest.raises(etcd_v3.EtcdV3ConfigError, match="not host:port"):
        etcd_v3.parse_endpoints("a:b:c:d")
    assert etcd_v3.parse_endpoints("h1:1,http://h2:2,h3") == [("h1", 1), ("h2", 2), ("h3", 2379)]
    monkeypatch.setenv(etcd_v3.PASSWORD_ENV, "pw")
    with pytest.raises(etcd_v3.EtcdV3ConfigError, match="no user"):
        etcd_v3.create_backend(_params(etcd, "x"))
    # a bad endpoint fails where the launcher builds the handler (torch's registry), with the
    # error it turns into a one-line usage error (test_cli_bad_etcd_options_one_line)
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    etcd_v3.register()
    bad = RendezvousParameters(backend="etcd-v3", endpoint="h:1:2:3", run_id="bad",
                               min_nodes=1, max_nodes=1)  # fmt: skip
    with pytest.raises(etcd_v3.EtcdV3ConfigError, match="not host:port"):
        rdzv_registry.get_rendezvous_handler(bad)


def test_calls_retry_through_an_etcd_restart(tmp_path: Path) -> None:
    e = Etcd(tmp_path / "etcd")
    try:
        _, s = etcd_v3.create_backend(_params(e, "restart"))
        s.set("k", "before")
        e.stop()
        threading.Timer(3.0, e.start).start()
        t0 = time.monotonic()
        s.set("k", "after")  # blocks, retrying, until etcd is back
        assert time.monotonic() - t0 >= 2.5
        assert s.get("k") == b"after"
    finally:
        time.sleep(0.1)
        e.kill()


def test_calls_fail_after_the_retry_deadline(tmp_path: Path) -> None:
    e = Etcd(tmp_path / "etcd")
    _, s = etcd_v3.create_backend(_params(e, "gone", retry_timeout="1.5"))
    s.set("k", "v")
    e.kill()
    t0 = time.monotonic()
    with pytest.raises(etcd_v3.EtcdUnavailableError, match="did not answer"):
        s.set("k", "w")
    assert 1.0 < time.monotonic() - t0 < 15


# -- real jobs ------------------------------------------------------------------------------------
def _agent(
    tmp: Path,
    name: str,
    etcd: Etcd,
    run_id: str,
    run_dir: Path,
    steps: int,
    step_sleep: float,
    *extra: str,
) -> subprocess.Popen[bytes]:
    args = [
        sys.executable, "-m", "trainguard", "run",
        "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id,
        "--max-restarts", "3", "--monitor-interval", "0.2",
        "--tg-run-dir", str(run_dir), *extra,
        EXAMPLE, "--no-ddp", "--steps", str(steps), "--step-sleep", str(step_sleep),
        "--ckpt-every", "10",
    ]  # fmt: skip
    log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    # no telemetry component (metrics endpoint, OTLP, the agent's reading of the workers'
    # records): nothing here asserts on it; the workers' JSONL records the tests read stay on
    env = base_env(TRAINGUARD_TELEMETRY_ENABLED="false")
    return subprocess.Popen(
        args, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def _kill_tree(p: subprocess.Popen[bytes]) -> None:
    for pid in [p.pid, *descendants(p.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _cleanup(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            _kill_tree(p)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait(timeout=30)


def _events(run_dir: Path) -> list[dict]:
    f = run_dir / "events.jsonl"
    if not f.exists():
        return []
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()]


def _log(tmp: Path, name: str) -> str:
    return (tmp / f"{name}.log").read_text(errors="replace")[-4000:]


def _two_agents(
    tmp: Path, etcd: Etcd, run_id: str, steps: int, step_sleep: float, *extra: str
) -> tuple[list[subprocess.Popen[bytes]], Path]:
    """Two agents of one job, one worker each; every step sleeps ``step_sleep`` s, so a job of
    N steps runs at least N * step_sleep s (the tests' faults land while it still runs)."""
    run_dir = tmp / "run"
    a = _agent(tmp, "a", etcd, run_id, run_dir, steps, step_sleep, *extra)
    time.sleep(0.5)  # a starts first
    b = _agent(tmp, "b", etcd, run_id, run_dir, steps, step_sleep, *extra)
    return [a, b], run_dir


def _wait_steps(procs: list[subprocess.Popen[bytes]], tmp: Path, run_dir: Path, n: int) -> None:
    deadline = time.monotonic() + 180
    while steps_done(run_dir) < n:
        assert time.monotonic() < deadline, _log(tmp, "a") + _log(tmp, "b")
        for p, name in zip(procs, "ab", strict=False):
            assert p.poll() is None, f"agent {name} exited early:\n" + _log(tmp, name)
        time.sleep(0.2)


FAST_RDZV = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=5"


def test_kill9_of_the_rank0_agent_the_other_finishes(
    tmp_path: Path, etcd: Etcd, capsys: pytest.CaptureFixture[str]
) -> None:
    # 100 steps of >= 0.1 s: >= 7 s from step 30 to the end for the kill to land in
    procs, run_dir = _two_agents(tmp_path, etcd, "job-kill", 100, 0.1, "--rdzv-conf", FAST_RDZV)
    try:
        _wait_steps(procs, tmp_path, run_dir, 30)
        first = [e for e in _events(run_dir) if e["kind"] == "rendezvous"]
        members = first[-1]["members"]
        rank0_pid = members[0]["pid"]
        victim = next(p for p in procs if p.pid == rank0_pid)
        survivor = next(p for p in procs if p is not victim)
        assert victim is procs[0], "the agent started first is expected to be rank 0"
        # the node is gone: agent and its workers, kill -9 (found from the run dir's events)
        # (``trainguard chaos kill-agent`` run in this process: its command line is
        # test_chaos_targets's subject)
        from trainguard.cli import cmd_chaos

        code = cmd_chaos.main(["kill-agent", str(run_dir), "--group-rank", "0"])
        out = capsys.readouterr()
        assert code == 0 and f"killed agent {rank0_pid}" in out.out, out.err
        victim.wait(timeout=30)
        assert survivor.wait(timeout=240) == 0, _log(tmp_path, "b")
    finally:
        _cleanup(procs)
    assert steps_done(run_dir) == 99
    after = [
        e for e in _events(run_dir) if e["kind"] == "rendezvous" and e.get("group_world_size") == 1
    ]
    assert after, "the survivor did not re-rendezvous alone"
    assert after[-1]["members"][0]["pid"] == survivor.pid


def test_two_agent_job_over_etcd_v3_finishes_through_10s_of_etcd_down(
    tmp_path: Path, etcd: Etcd
) -> None:
    # 180 steps of >= 0.15 s: the job still runs >= 24 s after step 20, well past the 10 s
    # etcd is down (the job must still be running when etcd comes back)
    procs, run_dir = _two_agents(tmp_path, etcd, "job-etcd-down", 180, 0.15)
    try:
        _wait_steps(procs, tmp_path, run_dir, 20)
        etcd.stop()
        down_at = steps_done(run_dir)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            for p, name in zip(procs, "ab", strict=True):
                assert p.poll() is None, f"agent {name} died while etcd was down:\n" + _log(
                    tmp_path, name
                )
            time.sleep(0.2)
        progressed = steps_done(run_dir) - down_at
        etcd.start()
        for p, name in zip(procs, "ab", strict=True):
            assert p.wait(timeout=240) == 0, _log(tmp_path, name)
    finally:
        if etcd.proc is None or etcd.proc.poll() is not None:
            etcd.start()  # the module's later tests need it
        _cleanup(procs)
    assert steps_done(run_dir) == 179
    # training went on while etcd was down (the workers never need it)
    assert progressed > 0
    rdzv = [e for e in _events(run_dir) if e["kind"] == "rendezvous"]
    assert {e["group_world_size"] for e in rdzv} == {2}
    assert sorted(e["group_rank"] for e in rdzv) == [0, 1]
    # nothing of the job lives on the agents but the workers' store: the rendezvous state and
    # the round's keys are in etcd (and survived its restart)
    client = etcd_v3.create_backend(_params(etcd, "job-etcd-down"))[0]._client
    out = client.range("/trainguard/rdzv/job-etcd-down/", prefix=True, keys_only=True)
    keys = {etcd_v3._unb64(kv["key"]).decode() for kv in out.get("kvs", [])}
    assert "/trainguard/rdzv/job-etcd-down/state" in keys
    assert any("/store/torch.rendezvous.job-etcd-down." in k for k in keys), keys


# -- auth and TLS ---------------------------------------------------------------------------------
def _etcdctl(e: Etcd, *args: str) -> None:
    subprocess.run(
        ["etcdctl", "--endpoints", e.url, *args],
        check=True, capture_output=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"},
    )  # fmt: skip


def test_user_password_from_env_or_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    e = Etcd(tmp_path / "etcd")
    try:
        _etcdctl(e, "user", "add", "root:rootpw", "--interactive=false")
        _etcdctl(e, "user", "add", "tg:s3cret", "--interactive=false")
        _etcdctl(e, "role", "add", "tgrole")
        _etcdctl(e, "role", "grant-permission", "tgrole", "--prefix=true", "readwrite", "/tg/")
        _etcdctl(e, "user", "grant-role", "tg", "tgrole")
        _etcdctl(e, "auth", "enable")

        monkeypatch.setenv(etcd_v3.PASSWORD_ENV, "s3cret")
        backend, store = etcd_v3.create_backend(_params(e, "auth", user="tg", key_prefix="/tg"))
        assert backend.set_state(b"x") is not None and backend.get_state()[0] == b"x"  # type: ignore[index]
        store.set("k", "v")
        assert store.get("k") == b"v"

        monkeypatch.delenv(etcd_v3.PASSWORD_ENV)
        pw = tmp_path / "pw"
        pw.write_text("s3cret\n")
        _, s2 = etcd_v3.create_backend(
            _params(e, "auth", user="tg", key_prefix="/tg", password_file=str(pw))
        )
        assert s2.get("k") == b"v"

        # no credentials, a wrong password, or keys outside the role: clear errors, quickly
        _, anon = etcd_v3.create_backend(_params(e, "auth", key_prefix="/tg", retry_timeout="2"))
        with pytest.raises(RendezvousConnectionError):
            anon.set("k", "v")
        monkeypatch.setenv(etcd_v3.PASSWORD_ENV, "wrong")
        _, bad = etcd_v3.create_backend(_params(e, "auth", user="tg", key_prefix="/tg"))
        with pytest.raises(RendezvousConnectionError, match="rejected user 'tg'"):
            bad.set("k", "v")
        monkeypatch.setenv(etcd_v3.PASSWORD_ENV, "s3cret")
        _, outside = etcd_v3.create_backend(_params(e, "auth", user="tg", key_prefix="/other"))
        with pytest.raises(RendezvousConnectionError, match="may not use these keys"):
            outside.set("k", "v")
    finally:
        e.kill()


def test_mutual_tls(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    e = Etcd(tmp_path / "etcd", tls=certs)
    try:
        backend, store = etcd_v3.create_backend(
            _params(
                e, "tls", ca_cert=str(certs["ca"]), ssl_cert=str(certs["client_cert"]),
                ssl_cert_key=str(certs["client_key"]),
            )
        )  # fmt: skip
        store.set("k", "v")
        assert store.get("k") == b"v"
        assert backend.set_state(b"s") is not None
        # without a client certificate etcd refuses the connection
        _, nocert = etcd_v3.create_backend(
            _params(e, "tls", ca_cert=str(certs["ca"]), retry_timeout="1")
        )
        with pytest.raises(RendezvousConnectionError):
            nocert.get("k")
    finally:
        e.kill()


# -- many agents: the scalable state holder -------------------------------------------------------
def test_forty_agents_one_round_admitted_in_batches(etcd: Etcd) -> None:
    """40 real dynamic-rendezvous handlers (threads) complete one round over etcd-v3: every rank
    once, and far fewer state writes than agents (join requests admitted in batches)."""
    n = 40
    params = [
        RendezvousParameters(
            backend="etcd-v3",
            endpoint=etcd.endpoint,
            run_id="forty",
            min_nodes=n,
            max_nodes=n,
            join_timeout="120",
        )  # fmt: skip
        for _ in range(n)
    ]
    handlers = [etcd_v3.create_rdzv_handler(p) for p in params]
    ranks: list[int] = []
    errors: list[BaseException] = []

    def join(h: object) -> None:
        try:
            ranks.append(h.next_rendezvous().rank)  # type: ignore[attr-defined]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    try:
        assert not errors, errors[:3]
        assert sorted(ranks) == list(range(n))
        holders = [h._state_holder for h in handlers]  # type: ignore[attr-defined]
        assert all(isinstance(x, etcd_v3.ScalableStateHolder) for x in holders)
        wins = sum(x._etcd.wins for x in holders)
        assert sum(x.batched for x in holders) > 0
        assert wins < n  # admitted by another's write, not each its own race
        # keep-alives go to each node's own key, not through the shared state
        h0 = handlers[0]
        h0._keep_alive()  # type: ignore[attr-defined]
    finally:
        for h in handlers:
            h._stop_heartbeats()  # type: ignore[attr-defined]


def _keep_alive_handlers(etcd: Etcd, run: str, count: int, **conf: Any) -> list:
    """``count`` etcd-v3 handlers of run ``run`` with torch's keep-alive every 1 s, a node dead
    after 2 missed."""
    conf = {"join_timeout": "60", "keep_alive_interval": "1", "keep_alive_max_attempt": "2", **conf}
    return [etcd_v3.create_rdzv_handler(_params(etcd, run, **conf)) for _ in range(count)]


def test_keep_alives_do_not_write_the_state_an_expired_lease_is_a_dead_node(etcd: Etcd) -> None:
    """3 handlers complete a round with torch's keep-alive every 1 s (dead after 2 missed):
    over 5 keep-alive periods neither the state nor any heartbeat key gets a new revision (a
    keep-alive renews the node's lease) and every node stays in the round; then one node stops
    its keep-alives without a word, its lease expires on etcd, and the survivors' reads drop
    it as torch's dead-node check does."""
    run = "keepalive"
    handlers = _keep_alive_handlers(etcd, run, 3, min_nodes=3, max_nodes=3)
    client = etcd_v3.EtcdV3Client(etcd_v3.parse_endpoints(etcd.endpoint))
    base = f"/trainguard/rdzv/{run}/"

    def revisions() -> dict[str, int]:
        out = client.range(base, prefix=True)
        return {
            etcd_v3._unb64(kv["key"]).decode(): int(kv["mod_revision"])
            for kv in out.get("kvs") or []
            if "/state" in etcd_v3._unb64(kv["key"]).decode()
            or "/heartbeat/" in etcd_v3._unb64(kv["key"]).decode()
        }

    threads = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in handlers]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(h._state_holder.state.complete for h in handlers)  # type: ignore[attr-defined]
        time.sleep(1.5)  # the last writes of the round (join requests, heartbeats) settle
        before = revisions()
        assert sum("/heartbeat/" in k for k in before) == 3 and base + "state" in before
        time.sleep(5.0)  # 5 keep-alive periods: each node renewed its lease ~5 times
        assert revisions() == before
        nodes = [h._this_node for h in handlers]  # type: ignore[attr-defined]
        for h in handlers:
            st = h._state_holder  # type: ignore[attr-defined]
            st._last_full = -1e9  # a full read now (liveness check)
            st.last_sync_time = -1e9
            st.sync()
            assert set(st.state.participants) == set(nodes)
        # the third node stops keeping alive (as a frozen or lost agent would)
        handlers[2]._stop_heartbeats()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 15
        while True:
            views = []
            for h in handlers[:2]:
                st = h._state_holder  # type: ignore[attr-defined]
                st._last_full = -1e9
                st.last_sync_time = -1e9
                st.sync()
                views.append(set(st.state.participants))
            if all(v == set(nodes[:2]) for v in views):
                break
            assert time.monotonic() < deadline, f"the dead node is still there: {views}"
            time.sleep(0.5)
        assert base + "heartbeat/" + repr(nodes[2]) not in revisions()  # its lease expired
    finally:
        for h in handlers:
            h._stop_heartbeats()  # type: ignore[attr-defined]


def test_the_first_survivor_to_leave_ends_the_round_and_the_others_complete_the_next(
    etcd: Etcd,
) -> None:
    """8 handlers complete a round; one goes silent (no keep-alive: a lost node) and 6 others
    enter the next rendezvous at once, as their agents do once their workers fail on the lost
    peer. The first to leave ends the round for every node: the 6 are in the next round in
    fewer state writes than there are of them (torch: two contended writes each, an exit and
    a wait-list add), without waiting for the lost node's lease to expire; the 7th survivor,
    whose workers still run (hung on the lost peer), is told by ``num_nodes_waiting`` that its
    round is over, joins, and the 7 complete the next round together."""
    run = "survivors"
    handlers = _keep_alive_handlers(etcd, run, 8, min_nodes=7, max_nodes=8, last_call_timeout="1")
    worlds: list[int] = []
    errors: list[BaseException] = []

    def join(h: object) -> None:
        try:
            worlds.append(h.next_rendezvous().world_size)  # type: ignore[attr-defined]
        except BaseException as e:  # reported below
            errors.append(e)

    def wins() -> int:
        return sum(h._state_holder._etcd.wins for h in handlers)  # type: ignore[attr-defined]

    client = etcd_v3.EtcdV3Client(etcd_v3.parse_endpoints(etcd.endpoint))
    lost = handlers[7]._this_node  # type: ignore[attr-defined]
    lost_key = f"/trainguard/rdzv/{run}/heartbeat/{lost!r}"

    def state() -> Any:
        got = client.get(f"/trainguard/rdzv/{run}/state")
        assert got is not None
        return decode_state(etcd_v3._unpack(got[0]))

    try:
        first = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
        for t in first:
            t.start()
        for t in first:
            t.join(60)
        assert worlds == [8] * 8 and not errors, errors
        assert handlers[6].num_nodes_waiting() == 0  # type: ignore[attr-defined]
        handlers[7]._stop_heartbeats()  # type: ignore[attr-defined]
        before = wins()
        survivors = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers[:6]]
        for t in survivors:
            t.start()
        deadline = time.monotonic() + 30
        while True:
            st = state()
            if st.round == 1 and len(st.participants) == 6:
                break
            assert time.monotonic() < deadline, f"the 6 are not in the next round: {st}"
            time.sleep(0.05)
        assert wins() - before < 6, "every survivor raced its own exit"
        assert lost not in st.participants and lost not in st.last_heartbeats
        assert client.get(lost_key) is not None, "the round waited for the lost node's lease"
        # the survivor whose workers still run learns that its round is over (within the
        # second the handler caches the state)
        deadline = time.monotonic() + 5
        while handlers[6].num_nodes_waiting() < 1:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the 7th survivor is not told its round ended"
            time.sleep(0.2)
        last = threading.Thread(target=join, args=(handlers[6],), daemon=True)
        last.start()
        for t in [*survivors, last]:
            t.join(60)
        assert not errors, errors
        assert worlds[8:] == [7] * 7
        st = state()
        assert st.round == 1 and st.complete and lost not in st.participants
    finally:
        for h in handlers:
            h._stop_heartbeats()  # type: ignore[attr-defined]


def test_agents_starting_together_share_one_lease_and_no_join_request_is_stranded(
    etcd: Etcd,
) -> None:
    """16 agents of one run starting at once share one lease and leave no other behind; the
    admission lock is not given up while a join request that came after its holder's last read
    is pending (that node would wait for its watch to time out), and is once none is."""
    before = len(etcd_v3.create_backend(_params(etcd, "probe"))[0]._client.call(
        "lease/leases", {}).get("leases") or [])  # fmt: skip
    backends = [etcd_v3.create_backend(_params(etcd, "one-lease"))[0] for _ in range(16)]
    leases: list[int | None] = []
    threads = [
        threading.Thread(target=lambda b=b: leases.append(b._client.lease_id())) for b in backends
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(leases) == 16 and len(set(leases)) == 1
    after = backends[0]._client.call("lease/leases", {}).get("leases") or []
    assert len(after) - before <= 1  # the run's lease only

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    writer, late = backends[0], backends[1]
    lock, locked = writer.put_join(0, _NodeDesc("a", 1, 0), time.time(), lock_owner="a")
    assert locked
    writer.join_requests()
    seen = writer.joins_read_rev
    _, late_locked = late.put_join(0, _NodeDesc("b", 2, 0), time.time(), lock_owner="b")
    assert not late_locked  # the lock is held: "b" waits for the writer to admit it
    assert writer.unlock_admission_if_idle(lock, 0, seen) is False  # kept: "b" is pending
    late.put_join(1, _NodeDesc("c", 3, 0), time.time())  # another round's request: no matter
    assert {j["addr"] for _, j in writer.join_requests()} == {"a", "b", "c"}
    assert writer.unlock_admission_if_idle(lock + 1000, 0, writer.joins_read_rev) is None
    assert writer.unlock_admission_if_idle(lock, 0, writer.joins_read_rev) is True
    assert late.try_lock_admission("b", 10) is not None  # released


def test_a_join_request_outlives_the_nodes_expired_heartbeat_lease(etcd: Etcd) -> None:
    """A node whose own heartbeat lease expired (etcd overloaded, the agent starved) asks to
    join at once on a new lease: the request, the heartbeat key and the run's lease are
    written, instead of the write failing on the gone lease until the retry deadline."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    backend, _ = etcd_v3.create_backend(_params(etcd, "lease-gone", retry_timeout="20"))
    node = _NodeDesc("a", 1, 0)
    backend.put_heartbeat(repr(node), time.time())
    lease = backend._hb_leases[repr(node)]
    backend._client.call("lease/revoke", {"ID": str(lease)})
    t0 = time.monotonic()
    backend.put_join(0, node, time.time())
    assert time.monotonic() - t0 < 5
    assert backend._hb_leases[repr(node)] != lease
    assert [j["addr"] for _, j in backend.join_requests()] == ["a"]
    assert repr(node) in backend.live_nodes()


def test_cli_bad_etcd_options_one_line(tmp_path: Path) -> None:
    """A bad etcd-v3 option is a one-line usage error (exit 2) of ``trainguard run``. One launch:
    every such option is an EtcdV3ConfigError raised where the launcher builds the handler
    (the bad endpoint's: test_bad_options_are_one_line_errors)."""
    from tests.launch_utils import launch

    r = launch(
        "trainguard",
        ["--nnodes", "1", "--rdzv-backend", "etcd-v3", "--rdzv-id", "bad",
         "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "user=u,password=p",
         "--tg-run-dir", str(tmp_path / "run"), EXAMPLE],
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "password_file" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len([x for x in r.stderr.splitlines() if "error" in x]) == 1, r.stderr


_FROZEN_AGENT = """
import sys, time
from torch.distributed.elastic.rendezvous import RendezvousParameters
from trainguard.core.config.spares import SparesConfig
from trainguard.runtime import etcd_v3, spares
from trainguard.runtime.rendezvous import AttemptRendezvousHandler

endpoint, run = sys.argv[1:3]
params = RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id=run, min_nodes=3,
                              max_nodes=3, join_timeout="600")
h = AttemptRendezvousHandler(etcd_v3.create_rdzv_handler(params), node="frozen")
spares.attach(h, SparesConfig(), lambda *a, **k: None)
print(repr(h._inner._this_node), flush=True)
h.next_rendezvous()
"""


def test_a_round_that_cannot_complete_names_the_frozen_node_within_the_join_timeout(
    etcd: Etcd,
) -> None:
    """3 nodes wanted; an agent joins (with the hot spares' liveness, its heartbeat lease) and
    freezes (SIGSTOP): its lease expires, the waiting node's reaper takes it out of the round,
    and the round can no longer complete. The waiting node's rendezvous ends at its join
    timeout with an error naming the frozen node and the timeout, not a hang."""
    from trainguard.core.config.spares import SparesConfig
    from trainguard.runtime import spares
    from trainguard.runtime.rendezvous import AttemptRendezvousHandler

    run = "frozen"
    join_timeout = 30
    frozen = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_AGENT, etcd.endpoint, run],
        stdout=subprocess.PIPE,
        text=True,
        env=base_env(),
        start_new_session=True,
    )
    client = etcd_v3.EtcdV3Client(etcd_v3.parse_endpoints(etcd.endpoint))

    def participants() -> set[str]:
        found = client.get(f"/trainguard/rdzv/{run}/state")
        if found is None:
            return set()
        return {repr(n) for n in decode_state(etcd_v3._unpack(found[0])).participants}

    def wait_for(cond: Any, what: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out: {what}"
            time.sleep(0.2)

    errors: list[BaseException] = []
    try:
        frozen_node = frozen.stdout.readline().strip()  # type: ignore[union-attr]
        assert frozen_node, "the agent to freeze did not start"
        wait_for(lambda: frozen_node in participants(), "the agent to freeze joined")
        params = _params(etcd, run, min_nodes=3, max_nodes=3, join_timeout=str(join_timeout))
        h = AttemptRendezvousHandler(etcd_v3.create_rdzv_handler(params), node="waiting")
        assert spares.attach(h, SparesConfig(), lambda *a, **k: None) is not None
        me = repr(h._inner._this_node)  # type: ignore[attr-defined]

        def join() -> None:
            try:
                h.next_rendezvous()
            except BaseException as e:
                errors.append(e)

        t0 = time.monotonic()
        t = threading.Thread(target=join, daemon=True)
        t.start()
        wait_for(lambda: participants() == {frozen_node, me}, "2 of 3 nodes joined")
        os.kill(frozen.pid, signal.SIGSTOP)  # joined, then frozen: no keep-alive any more
        wait_for(lambda: participants() == {me}, "the frozen node taken out of the round")
        t.join(join_timeout + 60)
        elapsed = time.monotonic() - t0
        assert not t.is_alive(), "the rendezvous hangs past its join timeout"
        assert len(errors) == 1, errors
        text = str(errors[0])
        assert type(errors[0]).__name__ == "RendezvousTimeoutError", text
        assert f"did not complete in {join_timeout} s (join_timeout)" in text, text
        assert frozen_node in text and "missing" in text, text
        assert "\n" not in text
        assert elapsed >= join_timeout - 1, elapsed  # the stated timeout, not sooner
        h.shutdown()
    finally:
        frozen.kill()  # SIGKILL ends a stopped process too
        frozen.wait()


# -- etcd stalls inside a rendezvous ----------------------------------------------------------------
STALL_CONF = {"retry_timeout": "1", "request_timeout": "0.5", "last_call_timeout": "1"}


def _rendezvous_in_thread(h: Any, out: dict[str, Any]) -> threading.Thread:
    def join() -> None:
        try:
            out["info"] = h.next_rendezvous()
        except BaseException as e:  # asserted by the test
            out["error"] = e

    t = threading.Thread(target=join, daemon=True)
    t.start()
    return t


def _participants(etcd: Etcd, run: str) -> set[str]:
    client = etcd_v3.EtcdV3Client(etcd_v3.parse_endpoints(etcd.endpoint))
    try:
        found = client.get(f"/trainguard/rdzv/{run}/state")
    finally:
        client.close()
    if found is None:
        return set()
    return {repr(n) for n in decode_state(etcd_v3._unpack(found[0])).participants}


def _wait(cond: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.1)


def test_a_round_completes_through_an_etcd_stall_longer_than_retry_timeout(
    etcd: Etcd, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd frozen (SIGSTOP) for 6 s, six times the agents' retry_timeout (1 s), while one
    agent waits in a round of two and the second one starts: both keep retrying until the
    round's join timeout (60 s) instead of failing after retry_timeout, and the round
    completes once etcd answers again."""
    run = "stall"
    conf = {**STALL_CONF, "join_timeout": "60"}
    a, b = (
        etcd_v3.create_rdzv_handler(_params(etcd, run, min_nodes=2, max_nodes=2, **conf))
        for _ in range(2)
    )
    got_a: dict[str, Any] = {}
    got_b: dict[str, Any] = {}
    assert etcd.proc is not None
    caplog.set_level("WARNING", logger="trainguard.runtime.etcd_v3.client")
    stopped = False
    try:
        ta = _rendezvous_in_thread(a, got_a)
        _wait(lambda: len(_participants(etcd, run)) == 1, "the first agent joined")
        os.kill(etcd.proc.pid, signal.SIGSTOP)
        stopped = True
        tb = _rendezvous_in_thread(b, got_b)
        time.sleep(6.0)
        assert "error" not in got_a and "error" not in got_b, (got_a, got_b)
        os.kill(etcd.proc.pid, signal.SIGCONT)
        stopped = False
        ta.join(60)
        tb.join(60)
        assert not ta.is_alive() and not tb.is_alive(), "the round did not complete"
        assert "error" not in got_a and "error" not in got_b, (got_a, got_b)
        assert sorted([got_a["info"].rank, got_b["info"].rank]) == [0, 1]
        assert got_a["info"].world_size == got_b["info"].world_size == 2
        # the calls were retried past retry_timeout, until the rendezvous' deadline
        assert "retrying until the rendezvous' deadline" in caplog.text
    finally:
        if stopped:
            os.kill(etcd.proc.pid, signal.SIGCONT)
        for h in (a, b):
            h._stop_heartbeats()  # type: ignore[attr-defined]


def test_a_round_etcd_keeps_from_completing_ends_at_its_join_timeout_naming_what_it_lacks(
    etcd: Etcd,
) -> None:
    """One of two agents joins, then etcd freezes for good: the rendezvous retries etcd until
    its join timeout (6 s, six times retry_timeout) and then fails with the round's timeout
    error: the nodes missing, and what etcd did."""
    run = "stall-deadline"
    join_timeout = 6
    h = etcd_v3.create_rdzv_handler(
        _params(etcd, run, min_nodes=2, max_nodes=2, join_timeout=str(join_timeout), **STALL_CONF)
    )
    got: dict[str, Any] = {}
    assert etcd.proc is not None
    stopped = False
    try:
        t0 = time.monotonic()
        t = _rendezvous_in_thread(h, got)
        _wait(lambda: len(_participants(etcd, run)) == 1, "the agent joined")
        os.kill(etcd.proc.pid, signal.SIGSTOP)
        stopped = True
        t.join(join_timeout + 30)
        elapsed = time.monotonic() - t0
        assert not t.is_alive(), "the rendezvous hangs past its join timeout"
        err = got.get("error")
        assert type(err).__name__ == "RendezvousTimeoutError", got
        text = str(err)
        assert f"did not complete in {join_timeout} s (join_timeout)" in text, text
        assert "missing: 1 node(s) that never joined" in text, text
        assert f"etcd at {etcd.endpoint} did not answer" in text, text
        assert "\n" not in text
        assert join_timeout - 1 <= elapsed < join_timeout + 10, elapsed
    finally:
        if stopped:
            os.kill(etcd.proc.pid, signal.SIGCONT)
        h._stop_heartbeats()  # type: ignore[attr-defined]


def test_the_round_store_retries_through_a_stall_right_after_the_round(etcd: Etcd) -> None:
    """trainguard's member announcements in the round's store right after torch's round
    (``after_round``): an etcd stall (SIGSTOP 3 s, three times retry_timeout) there is
    retried; outside that window the same write fails after retry_timeout."""
    h = etcd_v3.create_rdzv_handler(_params(etcd, "after-round", max_nodes=1, **STALL_CONF))
    assert etcd.proc is not None
    stopped = False
    try:
        store = h.next_rendezvous().store
        results: dict[str, BaseException | None] = {}
        sent = {"within": threading.Event(), "outside": threading.Event()}

        def write(name: str, window: float | None) -> None:
            try:
                with h.after_round(window) if window else contextlib.nullcontext():
                    sent[name].set()
                    store.set(f"k/{name}", "v")
                results[name] = None
            except BaseException as e:  # asserted below
                results[name] = e

        os.kill(etcd.proc.pid, signal.SIGSTOP)
        stopped = True
        threads = [threading.Thread(target=write, args=a, daemon=True)
                   for a in (("within", 30.0), ("outside", None))]  # fmt: skip
        for t in threads:
            t.start()
        # the stall counts from the writes (a loaded machine may start a thread late), and
        # lasts until the write outside the window gave up (after retry_timeout; a starved
        # thread may start its request late) and at least three retry_timeouts
        assert all(e.wait(30) for e in sent.values())
        t0 = time.monotonic()
        threads[1].join(30)
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
        os.kill(etcd.proc.pid, signal.SIGCONT)
        stopped = False
        for t in threads:
            t.join(30)
        assert results["within"] is None, results
        assert isinstance(results.get("outside"), Exception), results
        assert store.get("k/within") == b"v"
    finally:
        if stopped:
            os.kill(etcd.proc.pid, signal.SIGCONT)
        h._stop_heartbeats()  # type: ignore[attr-defined]
