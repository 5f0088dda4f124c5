"""Admission into an open round, the etcd-v3 state holder's part: a node that joins puts a
join request instead of racing for the state with a write of its own; one node at a time,
holding the admission lock, adds every request there is to the state, one write per batch."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Protocol

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings

from trainguard.runtime._torch import NodeDesc, RendezvousState
from trainguard.runtime.etcd_v3.backend import EtcdV3RendezvousBackend
from trainguard.runtime.etcd_v3.lease import NodeLease

__all__ = ["ADMISSION_LOCK_TTL", "Admission", "StateAccess", "add_participant"]


class StateAccess(Protocol):
    """What the admission uses of its state holder: the held state and its public reads and
    writes (``holder.ScalableStateHolder``; a protocol, so that the holder imports this module
    and not the other way round)."""

    held: RendezvousState

    @property
    def settings(self) -> RendezvousSettings: ...

    def load_full(self, overlay: float | None = 1.0) -> None:
        """Read the whole state (keep-alive times overlaid past ``overlay`` x the threshold)."""

    def reload(self) -> None:
        """Read the state again where it changed since the held revision."""

    def write_state(self) -> bool:
        """Compare-and-swap the held state; True when it won."""


ADMISSION_LOCK_TTL = 10.0
"""Seconds the node that admits pending join requests holds the admission lock at most."""


def add_participant(st: RendezvousState, settings: RendezvousSettings, node: NodeDesc) -> None:
    """Add ``node`` to the participants of the open round ``st`` as it would add itself
    (torch's ``_add_to_participants``: last-call deadline at ``min_nodes``, complete with
    ranks at ``max_nodes``), its keep-alive time now."""
    st.wait_list.discard(node)
    st.participants[node] = 0
    st.last_heartbeats[node] = datetime.now(timezone.utc)
    if len(st.participants) == settings.min_nodes:
        st.deadline = datetime.now(timezone.utc) + settings.timeout.last_call
    if len(st.participants) == settings.max_nodes:
        st.complete = True
        st.deadline = None
        for rank, member in enumerate(sorted(st.participants)):
            st.participants[member] = rank


class Admission:
    """One node's side of the admission: its join request, the admission lock when it holds
    it, and the requests it read. The holder calls it from ``sync``; it reads and writes the
    state through the holder's :class:`StateAccess`, and keeps the node's lease fresh while
    it waits to be admitted."""

    def __init__(
        self,
        holder: StateAccess,
        backend: EtcdV3RendezvousBackend,
        node: NodeDesc,
        lease: NodeLease,
    ) -> None:
        self._holder = holder
        self._etcd = backend
        self._node = node
        self._lease = lease
        self._node_key = lease.key
        self.join_rev = 0
        """etcd's revision of this node's join request."""
        self.lock_rev = 0
        """etcd's revision of the admission lock while this node holds it; 0 otherwise."""
        self.waits = 0
        """Waits for admission since this node's request (one without it: take the lock)."""
        self.joins: dict[NodeDesc, float] = {}
        """The join requests of the held round read last: node → its request's time."""
        self.round: int | None = None
        """The round this node asked to join."""
        self.beat = 0.0
        """When (wall clock) this node last put its join request or refreshed its key."""
        self.admitted: list[NodeDesc] = []
        """The nodes the last write added on their request."""

    def add_requested_joins(self, st: RendezvousState) -> int:
        """Add the nodes that asked to join this round, as each would add itself (torch's
        ``_add_to_participants``: last-call deadline at ``min_nodes``, ranks at ``max_nodes``),
        so one write admits many nodes instead of each racing for its own."""
        settings = self._holder.settings
        fresh = (
            time.time()
            - (settings.keep_alive_interval * settings.keep_alive_max_attempt).total_seconds()
        )
        added = 0
        self.admitted = []
        for node, t in sorted(self.joins.items(), key=lambda kv: kv[1]):
            if st.complete or len(st.participants) >= settings.max_nodes:
                break
            if node in st.participants or node in st.redundancy_list or t < fresh:
                continue
            # its keep-alive time as of now: the node learns of its admission at its next
            # read and keeps its heartbeat key fresh meanwhile
            add_participant(st, settings, node)
            self.admitted.append(node)
            added += 1
        return added

    def read_joins(self) -> None:
        """The requests to join the held round."""
        self.joins = {}
        for rnd, j in self._etcd.join_requests():
            if rnd == self._holder.held.round:
                try:
                    node = NodeDesc(str(j["addr"]), int(j["pid"]), int(j["local_id"]))
                    self.joins[node] = float(j["t"])
                except (KeyError, TypeError, ValueError):
                    continue

    def refresh_pending_join(self) -> None:
        """A node that asked to join keeps its heartbeat key fresh until it sees itself in the
        state (another node may have admitted it already)."""
        holder = self._holder
        if self.round is None or self.round != holder.held.round:
            return
        if self._node in holder.held.last_heartbeats or self._lease.own_thread:
            return
        now = time.time()
        if now - self.beat >= holder.settings.keep_alive_interval.total_seconds():
            self._lease.put(now)
            self.beat = now

    def ask_to_join(self) -> bool:
        """Put this node's join request; in the same transaction, become the admission
        writer if nobody is (False: write now, holding the lock). Otherwise wait until the
        writer admits this node, which deletes its request (a watch on that one key: each
        waiting node is woken once), then read the state (True: torch decides again).

        One writer at a time admits every node that asked so far, in one write per batch,
        instead of hundreds of nodes racing for the same key with the whole state each."""
        holder = self._holder
        s = holder.settings
        rnd = holder.held.round
        # waited once already in this round without being admitted: the writer may be gone
        waited = self.round == rnd and self.waits > 0
        if self.round != rnd or time.time() - self.beat >= s.keep_alive_interval.total_seconds():
            self.beat = time.time()
            rev, locked = self._etcd.put_join(
                rnd, self._node, self.beat, lock_owner=self._node_key,
                lock_ttl=ADMISSION_LOCK_TTL,
            )  # fmt: skip
            self._lease.renewed = time.monotonic()  # the request renews the node's lease
            self.join_rev, self.round = rev, rnd
            self.waits = self.waits if waited else 0
            if locked:
                self.lock_rev = rev
        if waited and not self.lock_rev:
            # an expired lock (its holder died) is taken over; also when the request was just
            # renewed, as it is after every wait at a keep-alive of 5 s or less
            lock = self._etcd.try_lock_admission(self._node_key, ADMISSION_LOCK_TTL)
            if lock is not None:
                self.lock_rev = lock
        if self.lock_rev:
            # the newest state under the lock, with fresh keep-alive times for everyone
            holder.load_full(overlay=0.5)
            return False
        self.waits += 1
        wait = min(s.keep_alive_interval.total_seconds(), 5.0)
        self._etcd.wait_join_admitted(rnd, self._node, self.join_rev, wait)
        holder.reload()
        return True

    def unlock(self) -> None:
        if self.lock_rev:
            rev, self.lock_rev = self.lock_rev, 0
            try:
                self._etcd.unlock_admission(rev)
            except RendezvousConnectionError:
                pass  # it expires

    def admit_batches(self) -> None:
        """Holding the admission lock: keep admitting the join requests that come in, one
        write per batch, until none came for a second (or the round is complete), so that
        the waiting nodes never need to contend for the lock themselves. The lock is given
        up only when no request came after the last read of them (in the same transaction):
        a node whose request met the lock held is admitted by its holder, never left waiting
        for its watch to time out."""
        holder = self._holder
        start = last = time.monotonic()
        while not holder.held.closed and not holder.held.complete:
            now = time.monotonic()
            if now - last > 1.0 or now - start > ADMISSION_LOCK_TTL - 2.0:
                released = self._etcd.unlock_admission_if_idle(
                    self.lock_rev, holder.held.round, self._etcd.joins_read_rev
                )
                if released is not False:
                    self.lock_rev = 0
                    return
                if now - start > ADMISSION_LOCK_TTL - 2.0:
                    rev = self._etcd.extend_admission(
                        self.lock_rev, self._node_key, ADMISSION_LOCK_TTL
                    )
                    if rev is None:
                        self.lock_rev = 0
                        return
                    self.lock_rev, start = rev, now
                last = now
            time.sleep(0.2)
            self.read_joins()
            st = holder.held
            pending = any(
                n not in st.participants and n not in st.redundancy_list for n in self.joins
            )
            if not pending:
                continue
            last = time.monotonic()
            if not holder.write_state():
                holder.load_full(overlay=0.5)  # another writer: again on the new state
