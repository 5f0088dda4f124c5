"""Hostile or broken etcd answers, against a real etcd 3.4 (Debian etcd-server, on loopback).

- a rendezvous state that is a pickle (what anyone with write access to the key prefix could
  plant) is never unpickled unless the reader opted in; the agent refuses it with one log line
  and an event, writes a fresh state over it, and its rendezvous completes; a real
  ``trainguard run`` job does the same;
- a corrupt JSON state (a deadline out of range) and a zlib bomb are refused the same way;
- an etcd user over plain http is warned about in one line (the password and the token cross
  the network unencrypted);
- answers and watch lines are read up to a size limit (a real etcd with a small limit, and a
  hostile "etcd" that streams without end); a compare-and-swap that always loses ends at the
  store's timeout.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from tests.launch_utils import REPO, base_env, steps_done
from trainguard.runtime import etcd_v3
from trainguard.testing.etcd import Etcd

pytestmark = pytest.mark.etcd

EXAMPLE = str(REPO / "examples" / "train_mlp.py")


def _params(etcd: Etcd, run_id: str, **conf: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, min_nodes=1, max_nodes=1, **conf
    )


class _Evil:
    """Unpickling this creates a directory: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def _within(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` in a daemon thread; fails the test when it has not returned in time."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # reported below
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"still running after {timeout_s} s"
    if err:
        raise err[0]
    return out[0]


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if "refused the rendezvous state" in r.getMessage()
    ]


# -- 1: the rendezvous state ----------------------------------------------------------------------
def test_a_pickled_state_never_runs_and_the_rendezvous_writes_over_it(
    etcd: Etcd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "code-ran"
    backend, _ = etcd_v3.create_backend(_params(etcd, "evil"))
    hostile = backend._client.put(backend.key, etcd_v3._pack(pickle.dumps(_Evil(marker))))
    handler = etcd_v3.create_rdzv_handler(_params(etcd, "evil"))
    events: list[tuple[str, dict[str, Any]]] = []
    etcd_v3.report_rdzv_events(handler, lambda kind, **f: events.append((kind, f)))
    caplog.set_level(logging.WARNING)
    try:
        info = _within(handler.next_rendezvous, 60)
    finally:
        handler._stop_heartbeats()  # type: ignore[attr-defined]
    assert not marker.exists(), "the pickled state was unpickled"
    assert (info.rank, info.world_size) == (0, 1)
    lines = _refusals(caplog)
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "accept_pickle_state=1" in lines[0] and backend.key in lines[0]
    assert [k for k, _ in events] == ["rdzv_state_refused"]
    assert events[0][1]["key"] == backend.key and "pickle" in events[0][1]["reason"]
    # the state in etcd is trainguard's JSON now, with this node in it
    value, revision = backend._client.get(backend.key)  # type: ignore[misc]
    state = backend.decode(value, revision)
    assert state is not None and len(state.participants) == 1
    assert state.round == hostile  # a round number no earlier round of the run had


def test_pickle_only_with_the_explicit_opt_in(
    etcd: Etcd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    st = _RendezvousState()
    st.round = 7
    st.participants = {_NodeDesc("h", 1, 0): 0}
    caplog.set_level(logging.WARNING)
    safe, _ = etcd_v3.create_backend(_params(etcd, "stock"))
    assert not [r for r in caplog.records if "accept_pickle_state" in r.getMessage()]
    _, token, won = safe.set_state(pickle.dumps(st))  # as torch's stock holder writes it
    assert won
    value, revision = safe.get_state_since(None)  # type: ignore[misc]
    assert safe.decode(value, revision) is None
    opted, _ = etcd_v3.create_backend(_params(etcd, "stock", accept_pickle_state="1"))
    warned = [
        r.getMessage() for r in caplog.records if "accept_pickle_state is on" in r.getMessage()
    ]
    assert len(warned) == 1 and opted.key in warned[0]
    got = opted.decode(value, revision)
    assert got is not None and got.round == 7
    # an opted-in pickle is not cached for a reader of the same revision that did not opt in
    assert safe.decode(value, revision) is None
    with pytest.raises(etcd_v3.EtcdV3ConfigError, match="accept_pickle_state"):
        etcd_v3.create_backend(_params(etcd, "stock", accept_pickle_state="maybe"))
    # the [rendezvous] config section passes it on
    from trainguard.core.config import load_config

    cfg = load_config(env={"TRAINGUARD_RENDEZVOUS_ETCD_ACCEPT_PICKLE_STATE": "true"})
    assert cfg.rendezvous.rdzv_conf() == {"accept_pickle_state": "True"}
    assert load_config(env={}).rendezvous.rdzv_conf() == {}


@pytest.mark.parametrize(
    "what, value, reason",
    [
        (
            "deadline out of range",
            b'TGJ1{"round":1,"complete":false,"closed":false,"deadline":1e300,"participants":[],'
            b'"wait":[],"redundancy":[],"beats":[],"nodes":[]}',
            "corrupt JSON (OverflowError",
        ),
        ("absurd nesting", b"TGJ1" + b"[" * 100_000, "corrupt JSON"),
        ("a zlib bomb", b"\0" * (96 << 20), "inflates to over"),
        ("a truncated stream", None, "truncated"),
    ],
    ids=["deadline", "nesting", "bomb", "truncated"],
)
def test_corrupt_states_are_refused_not_raised(
    etcd: Etcd, what: str, value: bytes | None, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend, _ = etcd_v3.create_backend(_params(etcd, "corrupt"))
    if value is None:
        stored = etcd_v3._pack(b"TGJ1" + b"x" * 100_000)[:-20]
    else:
        stored = etcd_v3._pack(value)
    assert len(stored) < 1 << 20  # etcd takes it (its request limit is 1.5 MiB)
    backend._client.put(backend.key, stored)
    got = backend.get_state_since(None)
    assert got is not None
    caplog.set_level(logging.WARNING)
    t0 = time.monotonic()
    assert backend.decode(*got) is None, what
    assert time.monotonic() - t0 < 5
    lines = _refusals(caplog)
    assert len(lines) == 1 and reason in lines[0], lines
    assert backend.decode(*got) is None and len(_refusals(caplog)) == 1  # once per revision


def test_a_job_whose_etcd_state_is_hostile_runs(etcd: Etcd, tmp_path: Path) -> None:
    """A real ``trainguard run`` over etcd-v3 with a pickle planted as its state: refused in one
    line and an event, written over, and the job finishes."""
    marker = tmp_path / "code-ran"
    backend, _ = etcd_v3.create_backend(_params(etcd, "job-evil"))
    backend._client.put(backend.key, etcd_v3._pack(pickle.dumps(_Evil(marker))))
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "trainguard", "run", "--nnodes", "1", "--nproc-per-node", "1",
         "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "job-evil",
         "--tg-run-dir", str(run_dir), EXAMPLE, "--steps", "5"],
        cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=240,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    assert not marker.exists()
    assert steps_done(run_dir) == 4
    lines = [x for x in p.stderr.splitlines() if "refused the rendezvous state" in x]
    assert len(lines) == 1, p.stderr[-4000:]
    assert "Traceback" not in p.stderr
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    refused = [e for e in events if e["kind"] == "rdzv_state_refused"]
    assert len(refused) == 1 and refused[0]["key"] == backend.key


# -- 5: credentials over plain http ---------------------------------------------------------------
def _etcdctl(e: Etcd, *args: str) -> None:
    subprocess.run(
        ["etcdctl", "--endpoints", e.url, *args],
        check=True, capture_output=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"},
    )  # fmt: skip


def test_a_user_over_plain_http_is_warned_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    e = Etcd(tmp_path / "etcd")
    try:
        _etcdctl(e, "user", "add", "root:rootpw", "--interactive=false")
        _etcdctl(e, "user", "add", "tg:s3cret-pw", "--interactive=false")
        _etcdctl(e, "role", "add", "tgrole")
        _etcdctl(e, "role", "grant-permission", "tgrole", "--prefix=true", "readwrite", "/tg/")
        _etcdctl(e, "user", "grant-role", "tg", "tgrole")
        _etcdctl(e, "auth", "enable")
        caplog.set_level(logging.WARNING)
        _, anon = etcd_v3.create_backend(_params(e, "plain", key_prefix="/tg"))
        assert not [r for r in caplog.records if "unencrypted" in r.getMessage()]
        monkeypatch.setenv(etcd_v3.PASSWORD_ENV, "s3cret-pw")
        _, store = etcd_v3.create_backend(_params(e, "plain", user="tg", key_prefix="/tg"))
        store.set("k", "v")  # it still works: a warning, not a refusal
        assert store.get("k") == b"v"
        warned = [r.getMessage() for r in caplog.records if "unencrypted" in r.getMessage()]
        assert len(warned) == 1 and "\n" not in warned[0], warned
        assert "'tg'" in warned[0] and e.endpoint in warned[0] and "ca_cert" in warned[0]
        assert all("s3cret-pw" not in r.getMessage() for r in caplog.records)
    finally:
        e.kill()


# -- 16: bounded reads, a bounded compare-and-swap ------------------------------------------------
def test_answers_over_the_size_limit_are_refused(etcd: Etcd) -> None:
    backend, _ = etcd_v3.create_backend(_params(etcd, "big"))
    backend._client.put("/trainguard/rdzv/big/blob", b"x" * 300_000)
    small = etcd_v3.EtcdV3Client(
        etcd_v3.parse_endpoints(etcd.endpoint), max_response_bytes=100_000, retry_timeout=5
    )
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="over the 100000-byte limit"):
        small.get("/trainguard/rdzv/big/blob")
    assert time.monotonic() - t0 < 2  # not retried: it would be as large again
    assert small.get("/trainguard/rdzv/big/missing") is None  # the client still works
    # a watch event over the limit ends the watch (the caller reads instead)
    rev = small.put("/trainguard/rdzv/big/w", b"y" * 200_000)
    assert small.watch("/trainguard/rdzv/big/w", start_revision=rev, timeout=5) is False
    assert backend._client.watch("/trainguard/rdzv/big/w", start_revision=rev, timeout=5)


class _Endless(BaseHTTPRequestHandler):
    """An "etcd" that answers every request with a body that never ends."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        chunk = b"[" * 65536
        try:
            for _ in range(10_000):  # 640 MiB at most, then the test has long failed
                self.wfile.write(chunk)
        except OSError:
            pass  # the client hung up: what it should do

    def log_message(self, *a: object) -> None:
        pass


def test_a_hostile_endpoint_cannot_make_the_client_read_without_end() -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Endless)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        client = etcd_v3.EtcdV3Client(
            [("127.0.0.1", srv.server_address[1])], max_response_bytes=1 << 20, retry_timeout=5
        )
        with pytest.raises(RendezvousConnectionError, match="over the 1048576-byte limit"):
            _within(lambda: client.get("k"), 30)
        assert _within(lambda: client.watch("k", start_revision=1, timeout=10), 30) is False
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_compare_and_swap_that_always_loses_ends_at_the_store_timeout(etcd: Etcd) -> None:
    _, store = etcd_v3.create_backend(_params(etcd, "cas-flood"))
    rival = etcd_v3.create_backend(_params(etcd, "cas-flood"))[1]
    store.set_timeout(timedelta(seconds=1.5))
    n = [0]

    def racing(cur: bytes | None) -> bytes:
        n[0] += 1
        rival.set("counter", str(1000 + n[0]))  # another writer lands first, every time
        return str(int(cur or b"0") + 1).encode()

    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="every compare-and-swap lost"):
        _within(lambda: store._cas_loop("counter", racing), 30)
    assert 1.4 < time.monotonic() - t0 < 10 and n[0] > 1
    assert store.add("counter2", 5) == 5  # an uncontended one lands at once


# -- round 2: every entry under the prefix is hostile ----------------------------------------------
def _raw_put(backend: Any, key: bytes, value: bytes) -> None:
    """A put as any writer of the prefix makes it: any bytes, no lease."""
    from trainguard.runtime.etcd_v3._common import _b64

    backend._client.call("kv/put", {"key": _b64(key), "value": _b64(value)})


def _rendezvous(etcd: Etcd, run_id: str, n: int, timeout_s: float = 120, **conf: str) -> list:
    """``n`` real handlers (one per thread) of one rendezvous; their RendezvousInfo."""
    params = RendezvousParameters(
        backend="etcd-v3", endpoint=etcd.endpoint, run_id=run_id, min_nodes=n, max_nodes=n,
        join_timeout="90", **conf,
    )  # fmt: skip
    handlers = [etcd_v3.create_rdzv_handler(params) for _ in range(n)]
    out: list[Any] = [None] * n
    err: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = handlers[i].next_rendezvous()
        except BaseException as e:  # reported below
            err.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in threads), f"no rendezvous in {timeout_s} s"
        if err:
            raise err[0]
        return out
    finally:
        for h in handlers:
            h._stop_heartbeats()  # type: ignore[attr-defined]


def test_hostile_keys_and_values_under_the_prefix_never_end_a_rendezvous(
    etcd: Etcd, caplog: pytest.LogCaptureFixture
) -> None:
    """Non-UTF-8 keys under heartbeat/ and join/, a join request nested past the recursion
    limit and one of the wrong types, and a lease key naming no lease of this run: the
    rendezvous completes, the monitor's reads skip them, the lease key is written over."""
    run = "hostile-keys"
    backend, _ = etcd_v3.create_backend(_params(etcd, run))
    base = f"/trainguard/rdzv/{run}/".encode()
    _raw_put(backend, base + b"heartbeat/\xff\xfe", b"1")
    _raw_put(backend, base + b"join/0/\xff", b"{}")
    _raw_put(backend, base + b"join/0/deep", b'{"addr":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    _raw_put(backend, base + b"join/0/types", b'{"addr": 1, "pid": -1, "local_id": 0, "t": 1e999}')
    _raw_put(backend, base + b"join/x/y", b"{}")
    _raw_put(backend, base + b"lease", b"not-a-lease")
    caplog.set_level(logging.WARNING)
    infos = _within(lambda: _rendezvous(etcd, run, 2), 150)
    assert sorted(i.rank for i in infos) == [0, 1]
    # what the monitor tick and the admitting node read, with the hostile keys still there
    assert "\ufffd" not in "".join(backend.live_nodes())
    assert backend.live_nodes()  # the two nodes' own keys
    # the spares' liveness read (one range over heartbeat/ when they watch many nodes)
    assert "\ufffd" not in "".join(backend.heartbeats())
    assert set(backend.heartbeats()) == backend.live_nodes()
    assert backend.join_requests() == []  # none of the hostile ones is a request
    from trainguard.runtime.etcd_v3.codec import parse_lease

    value, _rev = backend._client.get(f"/trainguard/rdzv/{run}/lease")  # type: ignore[misc]
    assert parse_lease(value) == backend._client._run_lease_id()
    assert any("not this run's" in r.getMessage() for r in caplog.records)


def test_member_announcements_that_are_not_trainguards_never_end_the_agent(
    etcd: Etcd, caplog: pytest.LogCaptureFixture
) -> None:
    """The agents' store lives under the prefix too: a rank's announcement that is not one
    (deep nesting, wrong types, not UTF-8) makes that rank foreign, with one line each."""
    from trainguard.runtime.rendezvous import AttemptRendezvousHandler

    _backend, store = etcd_v3.create_backend(_params(etcd, "hostile-members"))
    store.set("trainguard/member/0", json.dumps({"node": "n0", "host": "h", "pid": 7,
                                                  "last_attempt": 2}))  # fmt: skip
    store.set("trainguard/member/1", b'{"node": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    store.set(
        "trainguard/member/2", b'{"node": "n2", "host": "h", "pid": 1, "last_attempt": 1e308}'
    )
    store.set("trainguard/member/3", b"\xff\xfe")
    handler = AttemptRendezvousHandler(None, node="n0", member_timeout_s=2.0)  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING)
    members = handler._members(store, "trainguard/", 4)
    assert members[0] == {"node": "n0", "host": "h", "pid": 7, "last_attempt": 2}
    assert [m.get("foreign") for m in members[1:]] == [True, True, True]
    lines = [
        r.getMessage() for r in caplog.records if "not a trainguard announcement" in r.getMessage()
    ]
    assert len(lines) == 3 and all("\n" not in line for line in lines), lines


def test_a_lease_value_that_is_no_integer_is_never_adopted(etcd: Etcd) -> None:
    run = "hostile-lease"
    backend, _ = etcd_v3.create_backend(_params(etcd, run))
    c = backend._client
    # another (live) lease of someone else's, named at the run's lease key
    theirs = int(c.call("lease/grant", {"TTL": "60"})["ID"])
    _raw_put(backend, f"/trainguard/rdzv/{run}/lease".encode(), str(theirs).encode())
    backend.load()  # reads the lease key with the state: not adopted
    assert c.lease_known() is None
    assert c.lease_id() == c._run_lease_id() != theirs


def test_an_expired_admission_lock_is_taken_over_at_the_default_keep_alive(
    etcd: Etcd,
) -> None:
    """A crashed holder's lock (expired) stalls no round: two nodes at torch's default 5 s
    keep-alive complete the rendezvous long before the join timeout."""
    run = "stale-lock"
    backend, _ = etcd_v3.create_backend(_params(etcd, run))
    lock = json.dumps({"owner": "crashed", "until": time.time() - 1}).encode()
    _raw_put(backend, f"/trainguard/rdzv/{run}/admit".encode(), lock)
    t0 = time.monotonic()
    infos = _within(lambda: _rendezvous(etcd, run, 2, timeout_s=85), 90)
    assert sorted(i.rank for i in infos) == [0, 1]
    assert time.monotonic() - t0 < 85  # the join timeout is 90 s


def test_an_admission_lock_held_forever_is_capped(
    etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainguard.runtime.etcd_v3 import backend as backend_mod

    monkeypatch.setattr(backend_mod, "MAX_LOCK_HOLD_S", 1.0)
    run = "forever-lock"
    backend, _ = etcd_v3.create_backend(_params(etcd, run))
    for until in (b"1e308", b"Infinity", b'"soon"', b"[" * 50_000):
        value = b'{"owner": "x", "until": ' + until + b"}"
        _raw_put(backend, f"/trainguard/rdzv/{run}/admit".encode(), value)
        deadline = time.monotonic() + 30
        while (rev := backend.try_lock_admission("me", 0.5)) is None:
            assert time.monotonic() < deadline, f"lock with until {until[:20]!r} never expired"
            time.sleep(0.2)
        backend.unlock_admission(rev)


def _doc(**over: Any) -> bytes:
    doc: dict[str, Any] = {
        "round": 3, "complete": True, "closed": False, "deadline": None,
        "participants": [[0, 0], [1, 1]], "wait": [], "redundancy": [],
        "beats": [[0, 1.7e9], [1, 1.7e9]], "nodes": [["a", 1, 0], ["b", 2, 0]],
    }  # fmt: skip
    doc.update(over)
    return b"TGJ1" + json.dumps(doc).encode()


@pytest.mark.parametrize(
    "over, reason",
    [
        ({"nodes": [["a", 1, 0], ["b", 2, 0]] + [["c", i, 0] for i in range(3, 5000)]},
         "nodes in its table"),
        ({"participants": [[0, 0], [1, 0]]}, "ranks are not distinct"),
        ({"participants": [[0, -1], [1, 0]]}, "rank -1"),
        ({"participants": [[0, 0], [-1, 1]]}, "node index -1"),
        ({"wait": [7]}, "node index 7"),
        ({"round": -1}, "round -1"),
        ({"nodes": [["a", 1, 0], ["a", 1, 0]]}, "listed twice"),
        ({"nodes": [["a", 1 << 64, 0], ["b", 2, 0]]}, "node ['a'"),
        ({"beats": [[0, float("nan")], [1, 1.7e9]]}, "time nan"),
        ({"complete": 1}, "complete/closed"),
        ({"beats": [[0, 1.7e9]] * 100_000}, "entries in beats"),
        ({"wait": [0, 0]}, "listed twice in the wait"),
    ],
    ids=["table", "dup-rank", "neg-rank", "neg-index", "bad-index", "neg-round", "dup-node",
         "huge-pid", "nan-time", "complete-int", "long-list", "dup-wait"],
)  # fmt: skip
def test_invalid_states_are_refused_by_the_codec(
    etcd: Etcd, over: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend, _ = etcd_v3.create_backend(_params(etcd, "invalid-state"))
    backend._client.put(backend.key, etcd_v3._pack(_doc(**over)))
    got = backend.get_state_since(None)
    assert got is not None
    caplog.set_level(logging.WARNING)
    assert backend.decode(*got) is None
    lines = _refusals(caplog)
    assert len(lines) == 1 and reason in lines[0], lines


def test_valid_states_with_gaps_in_a_complete_round_are_kept(etcd: Etcd) -> None:
    """torch keeps a round complete when a participant leaves it: ranks 0 and 2 of 3 left."""
    backend, _ = etcd_v3.create_backend(_params(etcd, "gap-state"))
    value = _doc(participants=[[0, 0], [1, 2]])
    backend._client.put(backend.key, etcd_v3._pack(value))
    got = backend.get_state_since(None)
    assert got is not None
    st = backend.decode(*got)
    assert st is not None and sorted(st.participants.values()) == [0, 2]


def test_a_state_built_to_collide_in_hash_tables_is_refused_at_once(etcd: Etcd) -> None:
    """pids equal modulo 2**61 - 1 hash alike: a table of them made every agent spend tens of
    seconds per revision; pids are bounded, the table must be distinct and referenced."""
    m = (1 << 61) - 1
    nodes = [["h", 1 + k * m, 0] for k in range(20_000)]
    value = _doc(nodes=nodes, participants=[[i, 0] for i in range(20_000)], beats=[],
                 complete=False)  # fmt: skip
    backend, _ = etcd_v3.create_backend(_params(etcd, "collide-state"))
    stored = etcd_v3._pack(value)
    assert len(stored) < 1 << 20
    backend._client.put(backend.key, stored)
    got = backend.get_state_since(None)
    assert got is not None
    t0 = time.monotonic()
    assert backend.decode(*got) is None
    assert time.monotonic() - t0 < 10  # generous: a loaded 2-core box; was ~37 s
