"""The rendezvous wrapper's flip of ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` (torch's uncached
path while ``next_rendezvous`` runs) when several handlers overlap in one process; the etcd-v3
state holder's keep-alive times, reads and what a node waiting out a round wakes for."""

from __future__ import annotations

import os
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings

from trainguard.runtime import rendezvous
from trainguard.runtime._torch import NodeDesc, RendezvousState
from trainguard.runtime.etcd_v3.holder import _meta

KEY = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@pytest.mark.parametrize("user", [None, "0", "1"])
def test_overlapping_rounds_restore_the_users_value(
    monkeypatch: pytest.MonkeyPatch, user: str | None
) -> None:
    if user is None:
        monkeypatch.delenv(KEY, raising=False)
    else:
        monkeypatch.setenv(KEY, user)
    a_in, b_in, a_may_leave = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def a() -> None:
        with rendezvous._uncached_store_path():
            a_in.set()
            a_may_leave.wait(10)
        seen["a_left"] = os.environ.get(KEY)

    def b() -> None:
        a_in.wait(10)
        with rendezvous._uncached_store_path():
            b_in.set()
            seen["inside"] = os.environ.get(KEY)
            seen["agent_store"] = rendezvous._user_uses_agent_store()
            a_may_leave.set()  # a leaves first: b is still inside
            while "a_left" not in seen:
                threading.Event().wait(0.01)
            seen["after_a"] = os.environ.get(KEY)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen["inside"] == "1" and seen["after_a"] == "1"  # torch's uncached path for b
    assert seen["agent_store"] is (user != "1")  # what torch tells the workers: the user's
    assert os.environ.get(KEY) == user  # both out: the user's value, not a leftover "1"
    assert rendezvous._user_uses_agent_store() is None


def test_rendezvous_event_names_without_the_stack_are_torchs() -> None:
    """torch names a rendezvous event after the function that called ``_record``
    (``get_method_name(depth=2)`` over ``inspect.stack()``); trainguard's replacement, which
    every agent installs, names the same function."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from trainguard.runtime import _torch

    def torchs(depth: int = 2) -> str:  # torch 2.13's get_method_name, as written there
        if len(inspect.stack()) > depth:
            return inspect.stack()[depth].function
        return "no_method_name"

    def _record(name_of) -> str:  # noqa: ANN001 - as torch's handler._record calls it
        return name_of()

    def next_rendezvous(name_of) -> str:  # noqa: ANN001
        return _record(name_of)

    _torch.cheap_rendezvous_event_names()
    assert dr.get_method_name.__module__ == "trainguard.runtime._torch"  # installed
    assert next_rendezvous(dr.get_method_name) == next_rendezvous(torchs) == "next_rendezvous"


def _settings(min_nodes: int, max_nodes: int) -> RendezvousSettings:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    return RendezvousSettings(
        run_id="u", min_nodes=min_nodes, max_nodes=max_nodes,
        timeout=RendezvousTimeout(last_call=timedelta(seconds=30)),
        keep_alive_interval=timedelta(seconds=5), keep_alive_max_attempt=3,
    )  # fmt: skip


def test_a_node_waiting_out_a_complete_round_wakes_for_its_end_or_a_free_slot() -> None:
    """A node in the wait list (or a spare) of a complete round waits on the state's summary
    and wakes only when the round ends or closes, or (a spare) a slot is free: not for each
    exit batch or keep-alive of the round's participants."""
    from trainguard.runtime.etcd_v3.holder import ScalableStateHolder

    me = NodeDesc("h", 9, 0)
    st = RendezvousState()
    st.round, st.complete = 2, True
    st.participants = {NodeDesc("h", 1, i): i for i in range(4)}
    holder = object.__new__(ScalableStateHolder)
    holder._node = me  # type: ignore[attr-defined]
    holder._settings = _settings(4, 4)  # type: ignore[attr-defined]
    holder.held = st

    def summary(**changes: object) -> bytes:
        other = RendezvousState()
        other.round, other.complete, other.closed = st.round, st.complete, st.closed
        other.participants = dict(st.participants)
        for k, v in changes.items():
            setattr(other, k, v)
        return _meta(other)

    st.wait_list = {me}
    fewer = {NodeDesc("h", 1, i): i for i in range(3)}
    assert not holder._moves(summary(participants=fewer))  # an exit: not its business
    assert holder._moves(summary(round=3, complete=False))  # the round ended
    assert holder._moves(summary(closed=True))
    assert holder._moves(b"garbage")  # anything unreadable: read the state
    st.wait_list, st.redundancy_list = set(), {me}
    assert holder._moves(summary(participants=fewer))  # a spare: a free slot
    assert not holder._moves(summary())


def test_round_summary_round_trips_and_refuses_what_is_not_one() -> None:
    """The summary key's six ``|``-joined fields, as written with every state write."""
    from trainguard.runtime.etcd_v3.holder import RoundSummary

    st = RendezvousState()
    st.round, st.complete = 5, True
    st.deadline = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    st.participants = {NodeDesc("h", 1, i): i for i in range(3)}
    st.wait_list = {NodeDesc("h", 2, 0)}
    got = RoundSummary.parse(_meta(st))
    assert got == RoundSummary(5, True, False, "2026-01-02T03:04:05+00:00", 1, 3)
    assert _meta(st) == b"5|1|0|2026-01-02T03:04:05+00:00|1|3"
    for bad in (b"", b"garbage", b"5|1|0||1", b"5|2|0||1|3", b"x|1|0||1|3", b"5|1|0||1|3|9"):
        assert RoundSummary.parse(bad) is None, bad


class _NoEtcd:
    """A backend that fails any use but the holder's setting of its heartbeat TTL."""

    heartbeat_ttl = 0

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"etcd used: {name}")


def _holder_of(st: RendezvousState, me: NodeDesc, etcd: _NoEtcd | None = None) -> Any:
    from trainguard.runtime.etcd_v3.holder import ScalableStateHolder

    holder = ScalableStateHolder(etcd or _NoEtcd(), _settings(4, 4), me)  # type: ignore[arg-type]
    holder.held, holder.token = st, 7
    holder.lease.renewed = time.monotonic()  # its lease just renewed
    return holder


def test_a_held_state_loses_no_node_to_its_old_keep_alive_times() -> None:
    """The times in a held state are those of its last write or keep-alive overlay: once held
    past torch's dead-node threshold (a waiting node reads the whole state every 20 s at 1000
    nodes), torch's check would take every live node for dead, the round would end in the
    holder's copy (which the beacon reaper judges) and its next write would persist that.
    Only a fresh read with the keep-alive overlay runs that check."""
    old = datetime.now(timezone.utc) - timedelta(seconds=60)
    me = NodeDesc("h", 9, 0)
    st = RendezvousState()
    st.round, st.complete = 3, True
    st.participants = {NodeDesc("h", 1, i): i for i in range(4)}
    st.redundancy_list = {me}
    st.last_heartbeats = {n: old for n in (*st.participants, me)}
    st.last_heartbeats[me] = datetime.now(timezone.utc)  # this node's keep-alive just now
    holder = _holder_of(st, me)
    holder._done()  # after a keep-alive or a won write
    assert holder.held.round == 3 and holder.held.complete
    assert len(holder.held.participants) == 4


def test_the_periodic_keep_alive_reads_nothing() -> None:
    """torch's keep-alive gives its first sync 5 s; here it renews a lease and writes no
    state, so its sync reads nothing (a slow read under load failed it, and three failures
    let the node's heartbeat lease expire)."""
    me = NodeDesc("h", 9, 0)
    st = RendezvousState()
    st.round, st.complete = 3, True
    st.participants = {me: 0}
    st.last_heartbeats = {me: datetime.now(timezone.utc)}
    holder = _holder_of(st, me)
    holder.dirty = False
    holder.last_sync_time = -1e9  # past the cache: would read
    with holder.keep_alive_only():
        assert holder.sync() is None
    with pytest.raises(AssertionError, match="etcd used"):
        holder.sync()  # any other sync reads


def test_a_node_waiting_for_admission_reads_an_unchanged_state_as_a_few_bytes() -> None:
    """After a wait for its admission (exit or join) a node reads the state again only when
    its revision moved: an unchanged one comes from the decode cache (a thousand nodes
    waiting out a node loss each re-read the whole state every few seconds)."""
    from trainguard.runtime.etcd_v3.codec import encode_state, remember

    me = NodeDesc("h", 9, 0)
    st = RendezvousState()
    st.round, st.complete = 3, True
    st.participants = {NodeDesc("h", 1, i): i for i in range(4)}
    key = "/trainguard/rdzv/unit-reload/state"
    remember(st, key=key, revision=41)
    calls: list[object] = []

    class Etcd(_NoEtcd):
        def __init__(self, since: tuple[bytes, int]) -> None:
            self.since = since

        key = "/trainguard/rdzv/unit-reload/state"

        def get_state_since(self, token: int) -> tuple[bytes, int]:
            calls.append(token)
            return self.since

        def decode(self, bits: bytes, revision: int) -> RendezvousState:
            from trainguard.runtime.etcd_v3.codec import decode_state

            return decode_state(bits, key=key, revision=revision)

    holder = _holder_of(RendezvousState(), me)
    holder.token = 41
    holder._etcd = Etcd((b"", 41))
    holder.reload()
    assert calls == [41] and holder.held.participants == st.participants
    moved = RendezvousState()
    moved.round = 4
    holder._etcd = Etcd((encode_state(moved), 57))
    holder.reload()
    assert holder.token == 57 and holder.held.round == 4
    assert not holder.held.participants


def test_a_participant_reading_its_complete_round_takes_no_node_out_of_it() -> None:
    """A participant's full read of its complete round runs no dead-node check: with most
    leases gone for longer than the threshold (an overloaded etcd), the check would take the
    live nodes and this one out of the round, and its next write (itself to the wait list)
    would leave the round the others returned from short of them."""
    from trainguard.runtime.etcd_v3.codec import decode_state, encode_state

    me = NodeDesc("h", 9, 0)
    nodes = [me, *(NodeDesc("h", 1, i) for i in range(3))]
    st = RendezvousState()
    st.round, st.complete = 3, True
    st.participants = {n: i for i, n in enumerate(nodes)}
    old = datetime.now(timezone.utc) - timedelta(seconds=60)
    st.last_heartbeats = {n: old for n in nodes}

    class Etcd(_NoEtcd):
        def load(self) -> tuple[bytes, int, bytes | None, int]:
            return encode_state(st), 8, None, 8

        def decode(self, bits: bytes, token: int) -> RendezvousState:
            return decode_state(bits)

        def live_nodes(self) -> set[str]:
            return set()  # every lease gone

        def trouble_at(self) -> float:
            return -1e9

    holder = _holder_of(RendezvousState(), me, Etcd())
    holder.overlay.mass_since = time.monotonic() - 20  # for 20 s
    holder.load_full()
    assert set(holder.held.participants) == set(nodes)
    assert not holder.lost


def test_most_heartbeat_leases_expiring_at_once_is_an_overloaded_etcd_until_it_lasts() -> None:
    """A fresh read finds its nodes' heartbeat keys to overlay their keep-alive times: one
    node's key gone is a dead node; most of them gone at once (an etcd too loaded to renew
    leases: 621 of 1000 in one read) keeps them all alive until that has lasted torch's
    dead-node threshold."""
    me = NodeDesc("h", 9, 0)
    nodes = [NodeDesc("h", 1, i) for i in range(8)]
    old = datetime.now(timezone.utc) - timedelta(seconds=60)

    class Etcd(_NoEtcd):
        lease_trouble = -1e9

        def __init__(self, live: set[str]) -> None:
            self.live = live

        def live_nodes(self) -> set[str]:
            return self.live

        def trouble_at(self) -> float:
            return self.lease_trouble

    def read(live: list[NodeDesc], since: float | None = None) -> tuple[object, set[NodeDesc]]:
        st = RendezvousState()
        st.round, st.complete = 3, True
        st.participants = {n: i for i, n in enumerate(nodes)}
        st.last_heartbeats = {n: old for n in nodes}
        holder = _holder_of(st, me, Etcd({repr(n) for n in live}))
        holder.overlay.mass_since = since
        holder.overlay.apply(holder.held, None)
        holder.sanitize()
        return holder, set(holder.held.participants)

    assert read(nodes[1:])[1] == set(nodes[1:])  # one dead node
    holder, kept = read(nodes[:2])  # 6 of 8 at once: etcd, not nodes
    assert kept == set(nodes) and holder.overlay.mass_since is not None
    assert read(nodes[:2], since=time.monotonic() - 20)[1] == set(nodes[:2])  # for 20 s: dead


def test_a_rendezvous_retries_etcd_until_its_join_deadline_a_spare_for_as_long_as_it_waits() -> (
    None
):
    """Until when a rendezvous' etcd calls retry: torch's join deadline, noted only from the
    thread inside ``next_rendezvous`` (not a keep-alive's); for ever for a spare in the
    redundancy list (torch gives it no timeout). An etcd error is the round's timeout only
    past that deadline, and then names what the round lacked and what etcd did."""
    from trainguard.runtime.etcd_v3 import EtcdUnavailableError
    from trainguard.runtime.etcd_v3.deadline import RoundDeadline

    me = NodeDesc("h", 9, 0)
    st = RendezvousState()
    st.participants = {me: 0}
    holder = RoundDeadline(_NoEtcd(), _settings(2, 2), me, lambda: st, {})  # type: ignore[arg-type]
    down = EtcdUnavailableError("etcd at e:1 did not answer for 60 s (TimeoutError: timed out)")

    holder.round_deadline(123.0)  # no rendezvous runs in this thread: not its deadline
    assert holder.retry_until() == -float("inf")
    holder._thread = threading.get_ident()
    soon = time.monotonic() + 30
    holder.round_deadline(soon)
    assert holder.retry_until() == soon
    assert holder.unavailable(timedelta(seconds=30), down) is None  # before it: as raised
    st.redundancy_list = {me}
    assert holder.retry_until() == float("inf")
    st.redundancy_list = set()

    holder.round_deadline(time.monotonic() - 1)  # the deadline passed
    text = holder.unavailable(timedelta(seconds=30), down)
    assert text is not None and "\n" not in text
    assert "did not complete in 30 s (join_timeout): 1 of 2 node(s) joined" in text, text
    assert "missing: 1 node(s) that never joined; etcd at e:1 did not answer" in text, text
    assert holder.unavailable(timedelta(seconds=30), ValueError("x")) is None


class _FlakyMember:
    """An etcd member (the client's transport) that refuses connections until ``until``
    (monotonic), then answers ``answers`` in turn, then an empty answer."""

    host, port = "127.0.0.1", 1

    def __init__(self, until: float, answers: list[tuple[int, str]] | None = None) -> None:
        self.until, self.answers, self.posts = until, list(answers or []), 0

    def post(self, path: str, payload: object, headers: object) -> tuple[int, str]:
        self.posts += 1
        if time.monotonic() < self.until:
            raise ConnectionRefusedError("refused")
        return self.answers.pop(0) if self.answers else (200, '{"header":{"revision":"3"}}')


def test_an_etcd_call_retries_past_retry_timeout_only_inside_a_rendezvous() -> None:
    """A call etcd does not answer for retry_timeout fails, but inside ``retrying_until`` (a
    rendezvous) it retries on until that deadline; past it, it fails too. "too many
    requests" (HTTP 429, an overloaded etcd) is retried like a timeout."""
    from trainguard.runtime.etcd_v3 import EtcdUnavailableError
    from trainguard.runtime.etcd_v3.client import EtcdV3Client

    c = EtcdV3Client([("127.0.0.1", 1)], retry_timeout=0.2)
    c._members = [_FlakyMember(time.monotonic() + 0.8)]  # type: ignore[list-item]
    with pytest.raises(EtcdUnavailableError, match="did not answer"):
        c.call("kv/range", {})
    with c.retrying_until(lambda: time.monotonic() + 30):
        assert c.call("kv/range", {}) == {"header": {"revision": "3"}}
    c._members = [_FlakyMember(time.monotonic() + 30)]  # type: ignore[list-item]
    t0 = time.monotonic()
    with c.retrying_until(lambda: t0 + 0.6), pytest.raises(EtcdUnavailableError):
        c.call("kv/range", {})
    assert 0.5 < time.monotonic() - t0 < 5
    busy = '{"error":"etcdserver: too many requests","code":8}'
    c._members = [_FlakyMember(0.0, [(429, busy), (429, busy)])]  # type: ignore[list-item]
    assert c.call("kv/range", {}) == {"header": {"revision": "3"}}
