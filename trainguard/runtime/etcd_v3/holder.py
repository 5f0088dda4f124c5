"""The state holder: heartbeats out of the shared state, cheap polls while a round fills."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings

from trainguard.runtime._torch import (
    NodeDesc,
    RendezvousState,
    StateHolderBase,
)
from trainguard.runtime.etcd_v3._common import _unb64
from trainguard.runtime.etcd_v3.admission import ADMISSION_LOCK_TTL, Admission
from trainguard.runtime.etcd_v3.backend import EtcdV3RendezvousBackend
from trainguard.runtime.etcd_v3.codec import cached_state, encode_state, remember
from trainguard.runtime.etcd_v3.deadline import RoundDeadline
from trainguard.runtime.etcd_v3.lease import NodeLease
from trainguard.runtime.etcd_v3.overlay import HeartbeatOverlay

__all__ = ["ADMISSION_LOCK_TTL", "ScalableStateHolder"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RoundSummary:
    """The summary key's content, written with every state write: what a node waiting for a
    round to fill must not miss (round, completion, closing, the last-call deadline, whether
    nodes wait for the next round) and the participants' count (a spare waits for a free
    slot). On the wire: the six fields joined by ``|`` (``round|complete|closed|deadline|
    waiting|participants``, booleans as 0/1, the deadline in ISO format or empty)."""

    round: int
    complete: bool
    closed: bool
    deadline: str
    waiting: int
    participants: int

    @classmethod
    def of(cls, state: RendezvousState) -> RoundSummary:
        deadline = state.deadline.isoformat() if state.deadline else ""
        return cls(
            state.round,
            state.complete,
            state.closed,
            deadline,
            len(state.wait_list),
            len(state.participants),
        )

    def encode(self) -> bytes:
        return (
            f"{self.round}|{int(self.complete)}|{int(self.closed)}|{self.deadline}|"
            f"{self.waiting}|{self.participants}"
        ).encode()

    @classmethod
    def parse(cls, meta: bytes) -> RoundSummary | None:
        """The summary in ``meta``; None when it is not one (another writer's bytes)."""
        f = meta.decode(errors="replace").split("|")
        if len(f) != 6 or f[1] not in ("0", "1") or f[2] not in ("0", "1"):
            return None
        try:
            return cls(int(f[0]), f[1] == "1", f[2] == "1", f[3], int(f[4]), int(f[5]))
        except ValueError:
            return None


SUMMARY_WATCH_S = 300.0
"""How long one watch of the summary key by a participant of a complete round lasts before it
is renewed (a read and a new watch: two requests per this many seconds)."""


class _SummaryWatch:
    """The summary key as a participant of a complete round sees it, kept current by one watch
    from a thread of its own: ``num_nodes_waiting`` (asked every monitor tick by torch's agent,
    answered by a read of the summary at most once a second) costs etcd nothing while the
    round runs. The thread ends when the summary's head changes from the one it started with
    (the round ended or closed): the holder then reads the state, as on any change."""

    def __init__(self, backend: EtcdV3RendezvousBackend, head: bytes | None) -> None:
        self._etcd = backend
        self._head = head
        self.value: bytes | None = None
        self.live = False
        """The watch is established and :attr:`value` is current."""
        self.done = False
        threading.Thread(target=self._run, name="tg-rdzv-summary", daemon=True).start()

    def _run(self) -> None:
        client = self._etcd._client
        key = self._etcd._meta_key
        try:
            while not self.done:
                found = client.get(key)
                if found is None or _head(found[0]) != self._head:
                    break
                self.value = found[0]

                def seen(ev: dict[str, Any]) -> bool:
                    if ev.get("type", "PUT") != "PUT":
                        return True
                    value = _unb64((ev.get("kv") or {}).get("value"))
                    if _head(value) != self._head:
                        self.live = False  # the round moved on: the holder reads it
                        return True
                    self.value = value
                    return False

                def created() -> bool:
                    self.live = True
                    return False

                t0 = time.monotonic()
                changed = client.watch(
                    key,
                    timeout=SUMMARY_WATCH_S,
                    start_revision=found[1] + 1,
                    wanted=seen,
                    changed=created,
                )
                self.live = False
                if changed:
                    break
                if time.monotonic() - t0 < SUMMARY_WATCH_S / 2:
                    time.sleep(1.0)  # the watch failed (etcd unreachable): the holder reads
        except Exception as e:  # etcd unreachable: the holder reads the summary itself
            logger.debug("summary watch ended: %s", e)
        finally:
            self.live = False
            self.done = True


def _meta(state: RendezvousState) -> bytes:
    """The encoded :class:`RoundSummary` of ``state``."""
    return RoundSummary.of(state).encode()


def _head(meta: bytes | None) -> bytes | None:
    """The summary less the participants' count: what a participant waits on (a round that
    fills changes its count with every admission, which is none of a waiting one's business)."""
    return None if meta is None else b"|".join(meta.split(b"|")[:5])


def _count(meta: bytes | None) -> int:
    """The participants' count in the summary ``meta`` (-1: none there)."""
    try:
        return int(meta.rsplit(b"|", 1)[1]) if meta else -1
    except (IndexError, ValueError):
        return -1


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """What this node last held of the state, compared field by field to what it holds now
    (a write that changes none of it but this node's keep-alive time is a lease renewal)."""

    round: int
    complete: bool
    closed: bool
    deadline: datetime | None
    participants: dict[NodeDesc, int]
    wait_list: set[NodeDesc]
    redundancy_list: set[NodeDesc]
    heartbeats: set[NodeDesc]

    @classmethod
    def of(cls, st: RendezvousState) -> _Snapshot:
        return cls(
            st.round,
            st.complete,
            st.closed,
            st.deadline,
            dict(st.participants),
            set(st.wait_list),
            set(st.redundancy_list),
            set(st.last_heartbeats),
        )


class ScalableStateHolder(StateHolderBase):
    """torch's state holder, made to scale on :class:`EtcdV3RendezvousBackend`.

    torch keeps every node's keep-alive time inside the one shared state, so each keep-alive is
    a compare-and-swap of the whole state that races every join: with a few hundred nodes the
    keep-alives alone outrun what one key can take, nodes that cannot land theirs are declared
    dead and removed, rejoin, and the round never completes. Here:

    - a write that changes nothing but this node's keep-alive time is a keep-alive of the
      lease of the node's own key (``heartbeat/<node>``, TTL torch's dead-node threshold
      ``keep_alive_interval x keep_alive_max_attempt``): no write to etcd's log, no race, no
      new revision of the state, which is written only when its membership changes. A full
      read whose keep-alive times are past half the threshold overlays the read's time on
      every node whose key exists (one keys-only read) before torch's dead-node check: a node
      is dead when its lease expired (on etcd's clock) and its time in the state is past the
      threshold, and torch's check removes it as in torch;
    - a node waiting for an incomplete round to fill reads only a small summary key (round,
      complete, closed, deadline, wait-list size, written with every state write) and reads
      the full state only when it changes, or every ``max(keep_alive_interval, nodes/100 s)``
      to check liveness, instead of decoding the whole state every second;
    - a node in the wait list or the redundancy list of a complete round waits on the
      summary key too (it carries the participants' count), and wakes only when the round
      ends or closes or, for a spare, a slot is free: not once a second for a full read;
    - the first node to leave a complete round ends it for every node (after a node loss,
      one write instead of one per survivor; see :meth:`_end_round`), and the joins of the
      next round are admitted in batches;
    - a won write keeps the state it wrote instead of decoding it again;
    - torch's dead-node check runs only on a state just read with the keep-alive overlay,
      never on one held since (its times would be older than the threshold), and not while
      most leases expired at once (an overloaded etcd, see :meth:`HeartbeatOverlay.mass_expiry`); torch's
      periodic keep-alive reads nothing (:meth:`keep_alive_only`).

    Every decision is still torch's (the same operations and the same compare-and-swap); a
    decision taken on a state that turns out stale simply loses its race and is retried.
    """

    def __init__(
        self,
        backend: EtcdV3RendezvousBackend,
        settings: RendezvousSettings,
        node: NodeDesc,
        cache_duration: int = 1,
    ) -> None:
        super().__init__(backend, settings, cache_duration)
        self._etcd = backend
        backend.heartbeat_ttl = max(
            2,
            int(
                -(
                    -(settings.keep_alive_interval * settings.keep_alive_max_attempt)
                    // timedelta(seconds=1)
                )
            ),
        )
        self._node = node
        self._node_key = repr(node)
        self._last_full = -float("inf")
        self._meta_seen: bytes | None = None
        self._seen_rev = 0
        """etcd's revision when this node last read or wrote the state: a watch from the next
        revision misses nothing."""
        self._snapshot: _Snapshot | None = None
        self._beat_at: datetime | None = None
        """When this node last kept its heartbeat lease alive (torch's keep-alive time)."""
        self.batched = 0
        """Other nodes this node added to a round on their request (statistics)."""
        self._tls = threading.local()
        self._summary: _SummaryWatch | None = None
        self.lost: dict[str, str] = {}
        """Nodes taken out of a round for their liveness (node -> what happened), for the
        error of a round that cannot complete."""
        self.lease = NodeLease(backend, self._node_key)
        """This node's heartbeat key and its lease."""
        self.overlay = HeartbeatOverlay(backend, settings, node)
        self.deadline = RoundDeadline(backend, settings, node, lambda: self.held, self.lost)
        """The deadline of the rendezvous this node runs (torch's handler reaches it here)."""
        self._admission = Admission(self, backend, node, self.lease)

    def _take_snapshot(self) -> _Snapshot:
        return _Snapshot.of(self.held)

    def _heartbeat_only(self) -> bool:
        return (
            self.token is not None
            and self._snapshot is not None
            and self._node in self.held.last_heartbeats
            and self._take_snapshot() == self._snapshot
        )

    def _joining(self) -> bool:
        """This write adds this node to the participants of an open round."""
        snap = self._snapshot
        st = self.held
        return (
            snap is not None
            and self._node not in snap.participants
            and self._node in st.participants
            and not st.closed
        )

    def _leaving(self) -> bool:
        """This write takes this node out of the participants of a complete round (torch's
        exit at the start of ``next_rendezvous``, after this node's workers failed)."""
        snap = self._snapshot
        return (
            snap is not None
            and snap.complete
            and self._node in snap.participants
            and self._node not in self.held.participants
            and not self.held.closed
        )

    def _end_round(self, st: RendezvousState) -> None:
        """End the complete round this node just left (torch's exit op took it out of the
        participants): every other participant out of it too, the next round open. torch ends
        a round only when its last participant has left, and a node leaves a complete round
        only when its workers stopped (they failed, or nodes wait to join), which breaks the
        group's collectives, so every other participant leaves after it anyway (its workers
        fail on the lost peer, or it sees the round over: ``num_nodes_waiting``). After a
        node loss that is every survivor taking itself out with a write of its own, a
        thousand writes racing for one key before the next round can even start, and the
        lost node holding the round until its liveness runs out. Here the first write ends
        it: the others find themselves out of it (torch's exit op then has nothing to do) and
        join the next round, in batches; the wait and redundancy lists stay."""
        snap = self._snapshot
        if snap is None or st.round != snap.round or st.closed:
            return  # it was the last participant: torch opened the next round itself
        for node in st.participants:
            st.last_heartbeats.pop(node, None)
        st.participants.clear()
        st.complete = False
        st.deadline = None
        st.round += 1

    # -- reads -------------------------------------------------------------------------------
    def load_full(self, overlay: float | None = 1.0) -> None:
        """Read the state; overlay the nodes' own keep-alive keys when some node's time in it
        is older than ``overlay`` x the dead-node threshold (None: never, and no dead-node
        check on this read; a node waiting to be admitted reads again under the admission
        lock before it writes for others)."""
        loaded = self._etcd.load()
        if loaded is None:
            self.held, self.token = RendezvousState(), None
            self._seen_rev = 0
        else:
            bits, token, _meta_value, self._seen_rev = loaded
            state = self._etcd.decode(bits, token)
            if state is None:
                # a refused state (logged and reported once) counts as an empty one at its
                # revision: this node's next write replaces it and the rendezvous goes on, in
                # a round numbered by that revision (above any round before it, whose store
                # keys must not be met again; the same on every node that refused it)
                state = RendezvousState()
                state.round = int(token)
                overlay = None
            self.held = state
            self.token = token
            if overlay is not None and self.overlay.stale(self.held, overlay):
                self.overlay.apply(self.held, self._beat_at)
        self._meta_seen = _meta(self.held)
        self._last_full = time.monotonic()
        # torch's dead-node check only on keep-alive times that are known to be current: the
        # times in the state are those of its last write (keep-alives renew leases, not the
        # state), so without the overlay it would drop every live node not written for a
        # while, and this node's next write (its wait-list add after its exit, say) would
        # take them all out of the round
        self._done(sanitize=overlay is not None)

    def _done(self, sanitize: bool = False) -> None:
        """The held state is in sync. torch's dead-node check (``sanitize``) runs only on a
        state just read with the nodes' keep-alive times overlaid (``load_full``): the times
        in the state are those of its last write and of the last overlay, so on a state held
        a while (a won write or a keep-alive of this node after seconds without a full read,
        20 s for a waiting node at 1000 nodes) it would take every live node for dead, and
        this node's next write would empty the round."""
        self.dirty = False
        self.last_sync_time = time.monotonic()
        if sanitize:
            known = set(self.held.last_heartbeats)
            before = len(known)
            self.sanitize()
            gone = before - len(self.held.last_heartbeats)
            for node in known.difference(self.held.last_heartbeats):
                self.lost[repr(node)] = "its heartbeat lease expired: dead or frozen"
            if gone:
                logger.warning(
                    "rendezvous %s: %d node(s) past the keep-alive threshold (their heartbeat "
                    "lease expired) dropped from round %d",
                    self.settings.run_id,
                    gone,
                    self.held.round,
                )
        self._renew_if_due()
        self._snapshot = self._take_snapshot()

    def _renew_if_due(self) -> None:
        """Renew this node's heartbeat lease when it is a member of the held state (a
        participant, waiting, a spare) and its last renewal is half a keep-alive interval old.
        torch renews it when the node's keep-alive time in the state is an interval old, but
        that time is often another node's "now" (an admission, say), later than this
        node's last renewal: at torch's threshold of two intervals, a loaded node renewed too
        late and its lease expired while it was alive."""
        if self._node not in self.held.last_heartbeats or self.lease.own_thread:
            return
        half = self.settings.keep_alive_interval.total_seconds() / 2
        if time.monotonic() - self.lease.renewed < half:
            return
        with contextlib.suppress(RendezvousConnectionError):  # torch's own keep-alive retries
            self.lease.put(time.time())

    def _full_every(self) -> float:
        """Seconds between full reads of a node that otherwise waits on the summary key (to
        see dead nodes): twice the keep-alive interval, longer for large rounds."""
        n = len(self.held.last_heartbeats)
        return max(2 * self.settings.keep_alive_interval.total_seconds(), n / 50.0)

    def _wait_budget(self) -> float:
        """How long a waiting participant may block on a watch: until its own keep-alive or
        the round's last-call deadline is due, at most 3 s."""
        st = self.held
        s = self.settings
        budget = 3.0
        mine = st.last_heartbeats.get(self._node)
        if mine is not None:
            due = mine.timestamp() + s.keep_alive_interval.total_seconds() - time.time()
            budget = min(budget, due)
        if st.deadline is not None:
            budget = min(budget, (st.deadline - datetime.now(timezone.utc)).total_seconds())
        return max(budget, 0.05)

    def _may_skip_full_read(self, now: float) -> bool:
        """A participant reads the whole state only when the summary changed (or for the
        periodic liveness check): while the round fills it blocks on a watch of the summary
        key; once the round is complete it reads the summary (a few bytes) instead. A node
        waiting out a complete round (wait list, spare) blocks on the same watch until the
        round ends or closes, or a spare's slot is free."""
        st = self.held
        if self.token is None or st.closed:
            return False
        if st.complete and self._node in st.participants and self.lease.own_thread:
            # the round runs: its end is all that matters here (dead nodes are found by the
            # nodes watching their leases), and one watch tells it
            return _head(self._watched_summary()) == _head(self._meta_seen)
        if now - self._last_full >= self._full_every():
            return False
        if self._node not in st.participants:
            if not st.complete or (
                self._node not in st.wait_list and self._node not in st.redundancy_list
            ):
                return False
            # waiting out a complete round (wait list, spare): only its end or a free slot
            # matters, not each keep-alive of its participants
            changed, rev = self._etcd.wait_meta(self._seen_rev, self._wait_budget(), self._moves)
            if not changed:
                self._seen_rev = rev
            return not changed
        if st.complete:
            return _head(self._etcd.meta()) == _head(self._meta_seen)
        seen = _head(self._meta_seen)
        count = _count(self._meta_seen)

        def wanted(meta: bytes) -> bool:
            # or fewer participants than seen: nodes were taken out (dead ones, or this one
            # by a reaper that took it for dead), and a node out of the round must rejoin
            # now, not at its next periodic read (20 s at 1000 nodes: the round waited)
            return _head(meta) != seen or _count(meta) < count

        changed, rev = self._etcd.wait_meta(self._seen_rev, self._wait_budget(), wanted)
        if not changed:
            self._seen_rev = rev  # the next watch need not replay what this one saw
        return not changed

    def _watched_summary(self) -> bytes | None:
        """The summary key, from the watch of it while that is established (no request),
        else read (and the watch started again)."""
        w = self._summary
        if w is not None and w.live and w.value is not None:
            return w.value
        value = self._etcd.meta()
        if (w is None or w.done) and _head(value) == _head(self._meta_seen):
            self._summary = _SummaryWatch(self._etcd, _head(value))
        return value

    def _moves(self, meta: bytes) -> bool:
        """Whether the summary ``meta`` matters to this node, waiting out the complete round
        it holds (in the wait list or as a spare): the round ended or closed, or has a slot
        free for a spare."""
        st = self.held
        got = RoundSummary.parse(meta)
        if got is None or got.round != st.round or not got.complete or got.closed:
            return True
        return self._node in st.redundancy_list and got.participants < self.settings.max_nodes

    # -- writes ------------------------------------------------------------------------------
    def reload(self, got: tuple[bytes, Any] | None | Literal[False] = False) -> None:
        """Read the state again, as :meth:`load_full` without the keep-alive overlay, but in
        one compare-and-read: a state still at the held revision is not sent again (a node
        whose request the writer has not come to yet, one of a thousand after a node loss,
        reads a few bytes instead of the whole state every few seconds) and is taken from
        the decode cache. ``got``: that read, made already."""
        token = self.token
        if got is False:
            got = self._etcd.get_state_since(token) if token is not None else None
        if got is None:
            self.load_full(overlay=None)
            return
        bits, token = got
        state = self._etcd.decode(bits, int(token)) if bits else cached_state(
            self._etcd.key, int(token)
        )  # fmt: skip
        if state is None:
            self.load_full(overlay=None)
            return
        self.held, self.token = state, token
        self._seen_rev = max(self._seen_rev, int(token))
        self._meta_seen = _meta(state)
        self._done()

    def write_state(self) -> bool:
        """Compare-and-swap this node's state, with every pending join request it may admit
        (when it holds the admission lock); True when it won."""
        was_complete = self._snapshot is not None and self._snapshot.complete
        was_round = self._snapshot.round if self._snapshot is not None else None
        added = 0
        admission = self._admission
        if admission.lock_rev:
            admission.read_joins()
            added = admission.add_requested_joins(self.held)
        meta = _meta(self.held)
        out = self._etcd.set_state(encode_state(self.held), self.token, meta=meta, fetch=False)
        if out is None or not out[2]:
            return False
        self.token = out[1]
        self._meta_seen = meta
        self._seen_rev = int(out[1])
        remember(self.held, key=self._etcd.key, revision=int(out[1]))
        self.batched += added
        try:
            if self.held.complete and (not was_complete or self.held.round != was_round):
                self._etcd.forget_joins(self.held.round)  # wakes every admitted node
            elif added:
                self._etcd.forget_join_requests(self.held.round, admission.admitted)
        except RendezvousConnectionError:
            pass  # they expire with the run's lease
        self._done()
        return True

    def _leave(self) -> bool:
        """This node leaves the complete round it is a participant of and ends it for every
        node (:meth:`_end_round`); True when its write did it.

        After a node loss every survivor leaves at once, and a thousand compare-and-swaps of
        the whole state (~20 KB at 1000 nodes), all but one bound to fail, each went through
        etcd's log: enough to stall a small etcd. So a node first checks that its state is
        still the newest (a compare-and-read: a few bytes), then takes the admission lock (a
        small transaction); only its holder writes. Any other node waits on the summary key
        until the round has ended (at most 2 s), reads the state again (decoded once per
        process) and torch's exit op finds it out of the round."""
        token = self.token
        if token is not None:
            got = self._etcd.get_state_since(token)
            if got is None or got[0]:
                self.reload(got)  # changed meanwhile: torch decides again on the new state
                return False
        lock = self._etcd.try_lock_admission(self._node_key, ADMISSION_LOCK_TTL)
        if lock is None:
            prefix = f"{self.held.round}|".encode()
            self._etcd.wait_meta(self._seen_rev, 2.0, lambda meta: not meta.startswith(prefix))
            self.reload()
            return False
        self._admission.lock_rev = lock  # given up by sync() once written
        ended, left = self.held.round, len(self.held.participants)
        self._end_round(self.held)
        if self.write_state():
            report = self._etcd.on_round_ended
            if report is not None and self.held.round > ended:
                try:
                    report(round=ended, left=left)
                except Exception:  # reporting must never break the rendezvous
                    logger.debug("on_round_ended failed", exc_info=True)
            return True
        self.reload()
        return False

    # -- liveness ----------------------------------------------------------------------------
    def keep_lease_alive(self, period_s: float, ttl_s: float) -> None:
        """This node's liveness from now on: its lease kept alive from a thread of its own
        (:meth:`NodeLease.keep_alive`; the hot spares' liveness on etcd-v3)."""
        self.lease.keep_alive(period_s, ttl_s)

    def stop_lease(self, *, left: bool) -> None:
        """Stop keeping this node's lease alive (:meth:`NodeLease.stop`)."""
        self.lease.stop(left=left)

    @contextlib.contextmanager
    def keep_alive_only(self) -> Iterator[None]:
        """While torch's periodic keep-alive runs in this thread: its syncs read nothing. The
        keep-alive writes no state here (it renews this node's heartbeat lease), and torch
        gives it ``timeout.heartbeat`` (5 s) from before its first sync: a read slowed down
        by an overloaded etcd (seen at 1000 nodes) failed it, three of those in a row let the
        node's lease expire, and the next reader's dead-node check took the live node out of
        the round. The state is read as before by the agent's other calls (its rendezvous,
        ``num_nodes_waiting``)."""
        self._tls.keep_alive = True
        try:
            yield
        finally:
            self._tls.keep_alive = False

    def sync(self) -> bool | None:
        if not self.dirty and self.token is not None and getattr(self._tls, "keep_alive", False):
            return None
        admission = self._admission
        admission.refresh_pending_join()
        now = time.monotonic()
        if self.dirty:
            if self._heartbeat_only():
                self._beat_at = self.held.last_heartbeats[self._node]
                if not self.lease.own_thread:  # else its own thread keeps the lease alive
                    self.lease.put(self._beat_at.timestamp())
                synced = self.last_sync_time
                self._done()
                self.last_sync_time = synced  # it read nothing: the next sync may
                return True
            try:
                if self._joining() and admission.ask_to_join():
                    return False
                if self._leaving():
                    return self._leave()
                ok = self.write_state()
                if not ok and admission.lock_rev:
                    admission.waits = 1  # lost a race holding the lock: take it again at once
                if ok and admission.lock_rev:
                    admission.admit_batches()  # the admission writer admits who comes next too
            finally:
                admission.unlock()
            if ok:
                return True
            self.load_full()
            return False
        if self.cache_duration > 0 and self.last_sync_time >= max(now - self.cache_duration, 0):
            return None
        if self._may_skip_full_read(now):
            self.last_sync_time = time.monotonic()
            return None
        self.load_full()
        return None
