"""The state holder: heartbeats out of the shared state, cheap polls while a round fills."""

from __future__ import annotations

import pickle
import random
import time
from datetime import datetime, timezone
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from trainguard.runtime.etcd_v3.backend import EtcdV3RendezvousBackend

__all__ = ["ScalableStateHolder"]


def _meta(state: _RendezvousState) -> bytes:
    """What a node waiting for a round to fill must not miss: round, completion, closing, the
    last-call deadline, and whether nodes wait for the next round."""
    deadline = state.deadline.isoformat() if state.deadline else ""
    return (
        f"{state.round}|{int(state.complete)}|{int(state.closed)}|{deadline}|{len(state.wait_list)}"
    ).encode()


class ScalableStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder, made to scale on :class:`EtcdV3RendezvousBackend`.

    torch keeps every node's keep-alive time inside the one shared state, so each keep-alive is
    a compare-and-swap of the whole state that races every join: with a few hundred nodes the
    keep-alives alone outrun what one key can take, nodes that cannot land theirs are declared
    dead and removed, rejoin, and the round never completes. Here:

    - a write that changes nothing but this node's keep-alive time goes to the node's own key
      (``heartbeat/<node>``, no race); every full read overlays those times on the state before
      torch's dead-node check, so liveness means exactly what it means in torch;
    - a node waiting for an incomplete round to fill reads only a small summary key (round,
      complete, closed, deadline, wait-list size, written with every state write) and reads
      the full state only when it changes, or every ``max(keep_alive_interval, nodes/100 s)``
      to check liveness, instead of decoding the whole state every second;
    - a won write keeps the state it wrote instead of decoding it again.

    Every decision is still torch's (the same operations and the same compare-and-swap); a
    decision taken on a state that turns out stale simply loses its race and is retried.
    """

    def __init__(
        self,
        backend: EtcdV3RendezvousBackend,
        settings: RendezvousSettings,
        node: _NodeDesc,
        cache_duration: int = 1,
    ) -> None:
        super().__init__(backend, settings, cache_duration)
        self._etcd = backend
        self._node = node
        self._node_key = repr(node)
        self._last_full = -float("inf")
        self._meta_seen: bytes | None = None
        self._poll = 1.0
        self._next_poll = 0.0
        self._snapshot: tuple[Any, ...] | None = None
        self._joins: dict[_NodeDesc, float] = {}
        self._join_round: int | None = None
        self._join_beat = 0.0
        self._beats: dict[str, float] = {}
        self._beats_rev = 0
        self._admitted: list[_NodeDesc] = []
        self.batched = 0
        """Other nodes this node added to a round on their request (statistics)."""

    def _take_snapshot(self) -> tuple[Any, ...]:
        st = self._state
        return (
            st.round,
            st.complete,
            st.closed,
            st.deadline,
            dict(st.participants),
            set(st.wait_list),
            set(st.redundancy_list),
            set(st.last_heartbeats),
        )

    def _heartbeat_only(self) -> bool:
        return (
            self._token is not None
            and self._snapshot is not None
            and self._node in self._state.last_heartbeats
            and self._take_snapshot() == self._snapshot
        )

    def _joining(self) -> bool:
        """This write adds this node to the participants of an open round."""
        snap = self._snapshot
        st = self._state
        return (
            snap is not None
            and self._node not in snap[4]
            and self._node in st.participants
            and not st.closed
        )

    def _add_requested_joins(self, st: _RendezvousState) -> int:
        """Add the nodes that asked to join this round, as each would add itself (torch's
        ``_add_to_participants``: last-call deadline at ``min_nodes``, ranks at ``max_nodes``),
        so one write admits many nodes instead of each racing for its own."""
        settings = self._settings
        fresh = (
            time.time()
            - (settings.keep_alive_interval * settings.keep_alive_max_attempt).total_seconds()
        )
        added = 0
        self._admitted = []
        for node, t in sorted(self._joins.items(), key=lambda kv: kv[1]):
            if st.complete or len(st.participants) >= settings.max_nodes:
                break
            if node in st.participants or node in st.redundancy_list or t < fresh:
                continue
            st.wait_list.discard(node)
            st.participants[node] = 0
            self._admitted.append(node)
            # as of now: the node learns of its admission at its next read and keeps its
            # heartbeat key fresh meanwhile
            st.last_heartbeats[node] = datetime.now(timezone.utc)
            added += 1
            if len(st.participants) == settings.min_nodes:
                st.deadline = datetime.now(timezone.utc) + settings.timeout.last_call
            if len(st.participants) == settings.max_nodes:
                st.complete = True
                st.deadline = None
                for rank, member in enumerate(sorted(st.participants)):
                    st.participants[member] = rank
        return added

    def _load_full(self) -> None:
        loaded = self._etcd.load(self._beats_rev)
        if loaded is None:
            self._state, self._token = _RendezvousState(), None
        else:
            bits, self._token, beats, joins, self._beats_rev = loaded
            self._beats.update(beats)
            try:
                self._state = pickle.loads(bits)  # torch's own state format
            except pickle.PickleError as exc:
                raise RendezvousStateError(
                    "The rendezvous state is corrupt. See inner exception for details."
                ) from exc
            self._joins = {}
            for rnd, j in joins:
                if rnd == self._state.round:
                    try:
                        node = _NodeDesc(str(j["addr"]), int(j["pid"]), int(j["local_id"]))
                        self._joins[node] = float(j["t"])
                    except (KeyError, TypeError, ValueError):
                        continue
            hb = self._state.last_heartbeats
            for node, when in hb.items():
                t = self._beats.get(repr(node))
                if t is not None and t > when.timestamp():
                    hb[node] = datetime.fromtimestamp(t, timezone.utc)
        self._meta_seen = _meta(self._state)
        self._last_full = time.monotonic()
        self._done()

    def _done(self) -> None:
        self._dirty = False
        self._last_sync_time = time.monotonic()
        self._sanitize()
        self._snapshot = self._take_snapshot()

    def _may_skip_full_read(self, now: float) -> bool:
        st = self._state
        if self._token is None or st.complete or self._node not in st.participants:
            return False
        full_every = max(
            self._settings.keep_alive_interval.total_seconds(), len(st.last_heartbeats) / 100.0
        )
        if now - self._last_full >= full_every:
            return False
        if now < self._next_poll:
            return True
        if self._etcd.meta() != self._meta_seen:
            return False
        self._poll = min(self._poll * 1.5, 2.0)
        self._next_poll = now + self._poll * random.uniform(0.5, 1.0)
        return True

    def _refresh_pending_join(self) -> None:
        """A node that asked to join keeps its heartbeat key fresh until it sees itself in the
        state (another node may have admitted it already)."""
        if self._join_round is None or self._join_round != self._state.round:
            return
        if self._node in self._state.last_heartbeats:
            return
        now = time.time()
        if now - self._join_beat >= self._settings.keep_alive_interval.total_seconds():
            self._etcd.put_heartbeat(self._node_key, now)
            self._join_beat = now

    def sync(self) -> bool | None:
        self._refresh_pending_join()
        now = time.monotonic()
        if self._dirty:
            if self._heartbeat_only():
                when = self._state.last_heartbeats[self._node].timestamp()
                self._etcd.put_heartbeat(self._node_key, when)
                self._done()
                return True
            was_complete = self._snapshot is not None and self._snapshot[1]
            if self._joining():
                st = self._state
                if (
                    self._join_round != st.round
                    or time.time() - self._join_beat
                    >= self._settings.keep_alive_interval.total_seconds()
                ):
                    self._join_beat = time.time()
                    self._etcd.put_heartbeat(self._node_key, self._join_beat)
                    self._etcd.put_join(st.round, self._node, self._join_beat)
                    self._join_round = st.round
                added = self._add_requested_joins(st)
            else:
                added = 0
            bits = pickle.dumps(self._state)
            meta = _meta(self._state)
            out = self._etcd.set_state(bits, self._token, meta=meta, fetch=False)
            if out is not None and out[2]:
                self._token = out[1]
                self._meta_seen = meta
                self.batched += added
                try:
                    if self._state.complete and not was_complete:
                        self._etcd.forget_joins(self._state.round)
                    elif added:
                        self._etcd.forget_join_requests(self._state.round, self._admitted)
                except RendezvousConnectionError:
                    pass  # they expire with the run's lease
                self._done()
                return True
            self._load_full()
            self._poll, self._next_poll = 1.0, 0.0
            return False
        if self._cache_duration > 0 and self._last_sync_time >= max(now - self._cache_duration, 0):
            return None
        if self._may_skip_full_read(now):
            self._last_sync_time = now
            return None
        self._load_full()
        self._poll, self._next_poll = 1.0, 0.0
        return None
