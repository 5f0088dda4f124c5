"""Hot spares on torch's dynamic rendezvous: liveness beacons, dead-node removal, no spare races.

``--nnodes N`` (or ``MIN:N``) with more than N agents: torch's dynamic rendezvous (c10d,
etcd-v3) puts the agents beyond N into the round's *redundancy list*, where they wait warm (the
interpreter and torch loaded, the preflight passed) without disturbing the running round. When
an active node dies, the survivors' workers fail with a peer-connection error, their agents
leave the round and wait for the next one; as soon as the dead node is out of the round's
participants, a spare moves from the redundancy list into the next round and the job goes on at
full world size. What torch lacks, and this module adds:

- **Dead nodes leave in seconds, not after the keep-alive expiry.** torch removes a node only
  when its keep-alive is ``keep_alive_interval x keep_alive_max_attempt`` old (15 s with its
  defaults), and its keep-alive runs on wall-clock times written into the shared state. Here
  every agent advances a counter in the rendezvous store every ``beacon_interval_s``
  (:class:`LivenessBeacon`); the agents waiting in a rendezvous read the counters of the
  round's nodes (each node by ``REAP_NEIGHBOURS`` of them) and remove a node whose counter
  stood still for ``dead_after_s`` from the shared state (:class:`Reaper`), through the
  backend's compare-and-swap, exactly as torch's own dead-node check would. The observer
  judges on its own clock (no clock skew), and an agent that exits writes a tombstone, so a node that leaves (evicted, drained, stopped) is removed at
  once. On etcd-v3 the reapers judge the nodes of the state their
  handlers already hold (no read of the shared state per pass, which made every waiting agent
  fetch the whole state after each of its changes). A node without a beacon (a plain torchrun agent) is left to torch's keep-alive.
- **No race between spares.** With k > 1 spares and one dead node, the survivors and every
  spare move to the wait list and race for the free slots; torch completes the round at N and
  the losers stay in the *wait list*, so every active agent sees ``num_nodes_waiting() > 0`` and
  restarts the whole group, again and again (a restart loop; cf. NVIDIA resiliency-ext #348,
  pytorch #114097). Here a node in the wait list of a complete, full round moves itself back to
  the redundancy list, and ``num_nodes_waiting`` counts no node that no slot is free for.

Every decision is an event: ``node_dead`` (which node, how long silent, who removed it),
``spare_waiting`` (this node waits as a spare), ``spare_joined`` (a spare got a slot).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from trainguard.core.config.spares import SparesConfig
from trainguard.runtime import _torch
from trainguard.runtime._torch import NodeDesc, RendezvousState

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = [
    "BEACON_PREFIX",
    "C10D_STORE_LOST",
    "LivenessBeacon",
    "Reaper",
    "SpareController",
    "attach",
    "own_connection",
]

logger = logging.getLogger(__name__)

BEACON_PREFIX = "trainguard/liveness/"
LEFT = "left"
"""A beacon's value once its agent has exited (removed at once, no silence to wait for)."""

Emit = Callable[..., object]

C10D_STORE_LOST = (
    "trainguard run: the rendezvous store is gone: with --rdzv-backend c10d it is a TCPStore "
    "server inside the agent that started first ({endpoint}), and that node was lost with the "
    "job's rendezvous state, keep-alives and spare list; no node can take its place. Use "
    "--rdzv-backend etcd-v3 to survive the loss of any node"
)
"""What a c10d agent says when the store's host died (the job cannot go on)."""


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes | bytearray) else str(v)


REAP_NEIGHBOURS = 3
"""How many of the agents waiting in a rendezvous watch each node's beacon: the ones after
that node on a ring of the waiting agents ordered by a hash of each (nodes that fail together,
one host's or one rack's, rarely watch each other). The waiting agents are every node of the
round while it fills, and the spares (wait and redundancy lists) once it is complete and its
participants train; with up to ``REAP_NEIGHBOURS + 1`` of them, each watches every node (as
a participant still in the rendezvous of a complete round watches its share of all nodes). A pass
then costs a few reads, not one per node of the round (every agent reading every beacon four
times a second is N x N reads: 4 million a second for 1000 nodes)."""


REAP_OBSERVERS_MAX = 64
"""At most this many of the agents waiting in a rendezvous watch beacons: the ones first on
the ring (the same on every agent that holds the same state); the others read none. Each
node still has ``REAP_NEIGHBOURS`` watchers, each watcher reads its share in one request per
pass, and a pass of 1000 waiting agents (every survivor of a node loss in a 1000-node round)
is 64 reads instead of 1000 (2000 a second at the 0.5 s pass of a 1000-node job: etcd
saturated, and the round after the loss took minutes)."""


UNDER_FROM = 200
"""An agent watching more beacons than this (a spare of a large job watches every node) reads
all of the job's beacons in one range instead of each of its own (1000 beacons: a fifth of
etcd's CPU of ten transactions of 100 reads)."""


@functools.lru_cache(maxsize=1 << 16)
def _ring(key: str) -> tuple[bytes, str]:
    return hashlib.blake2b(key.encode(), digest_size=8).digest(), key


def _watched_by(me: str, state: RendezvousState) -> dict[str, NodeDesc]:
    """The nodes of ``state`` whose beacons the agent ``me`` (waiting in the rendezvous)
    watches: see ``REAP_NEIGHBOURS``."""
    listed = {repr(n): n for n in (*state.participants, *state.wait_list, *state.redundancy_list)}
    targets = {k: n for k, n in listed.items() if k != me}
    if state.complete and me not in {repr(n) for n in state.participants}:
        observers = {repr(n) for n in (*state.wait_list, *state.redundancy_list)}
    else:  # a participant still here (leaving the rendezvous) shares with every node
        observers = set(listed)
    observers.add(me)  # this agent waits in the rendezvous, listed yet or not
    if len(observers) <= REAP_NEIGHBOURS + 1:
        return targets
    if len(observers) > REAP_OBSERVERS_MAX:
        kept = sorted(_ring(o) for o in observers)[:REAP_OBSERVERS_MAX]
        observers = {o for _, o in kept}
        if me not in observers:
            return {}
    # a node's watchers are the REAP_NEIGHBOURS observers after it on the ring (itself
    # skipped): this agent's share is the observers just before it, and the other nodes
    # between the REAP_NEIGHBOURS-th observer before it and itself
    ring = sorted(_ring(o) for o in observers)
    m = ring.index(_ring(me))
    before = {ring[(m - j) % len(ring)][1] for j in range(1, REAP_NEIGHBOURS + 1)}
    lo, hi = ring[(m - REAP_NEIGHBOURS) % len(ring)], ring[m]
    mine: dict[str, NodeDesc] = {}
    for key, node in targets.items():
        if key in observers:
            if key in before:
                mine[key] = node
            continue
        at = _ring(key)
        if (lo < at < hi) if lo < hi else (at > lo or at < hi):
            mine[key] = node
    return mine


def own_connection(store: Store) -> Store:
    """A connection of the beacon's own to ``store`` (a TCPStore: ``clone()``, the same server).

    A TCPStore client runs one request at a time: on the connection the agent shares with
    torch, a beat waits behind any blocking call, such as the exit barrier's ``wait`` for the
    other agents (as long as the slowest node takes to finish), and a node that waits there
    longer than ``dead_after_s`` would look dead to the spares. Another store (a FileStore)
    is used as it is."""
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    try:
        return clone()
    except Exception as e:  # a store that cannot clone: its shared connection
        logger.debug("liveness beacon on the shared store connection: %s", e)
        return store


class LivenessBeacon:
    """Advances ``key`` in ``store`` every ``interval_s`` from a daemon thread."""

    def __init__(self, store: Store, key: str, interval_s: float) -> None:
        self._store = store
        self.key = key
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats = 0
        self.last_ok: float | None = None
        """Monotonic time this node's last beat landed in the store."""

    def start(self) -> None:
        if self._thread is None:
            self._beat()
            self._thread = threading.Thread(target=self._run, name="tg-liveness", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        self.beats += 1
        try:
            self._store.set(self.key, str(self.beats))
            self.last_ok = time.monotonic()
        except Exception as e:  # the store host may be gone; the rendezvous says so itself
            logger.debug("liveness beacon not written: %s", e)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._beat()

    def close(self, *, left: bool = True) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if left:
            try:
                self._store.set(self.key, LEFT)
            except Exception as e:
                logger.debug("liveness tombstone not written: %s", e)


class Reaper:
    """Reads the rendezvous state and the round's beacons; removes dead nodes and keeps a
    surplus node out of the wait list. ``tick()`` is one pass (what the watcher thread runs
    every ``poll_s`` while this agent waits in a rendezvous)."""

    def __init__(
        self,
        handler: DynamicRendezvousHandler,
        cfg: SparesConfig,
        emit: Emit,
        *,
        beacon_prefix: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._handler = handler
        self._me: NodeDesc = _torch.handler_node(handler)
        self._settings = _torch.handler_settings(handler)
        # torch's backend or etcd-v3's (compact state, summary): told apart by _etcd_v3()
        self._backend: Any = _torch.handler_backend(handler)
        self._store = _torch.handler_store(handler)
        self._cfg = cfg
        self._emit = emit
        self._prefix = beacon_prefix
        self._clock = clock
        self._seen: dict[str, tuple[str, float]] = {}
        """node key -> (last beacon value, when it last changed on our clock)"""
        self._last_read: float | None = None
        self._etcd_bits = b""
        self._etcd_token: Any = None
        self._watch_cache: tuple[Any, dict[str, NodeDesc]] | None = None
        self.beacon: LivenessBeacon | None = None
        """This node's own beacon (when set): while its beats do not land, no node is judged."""
        self.spare_since: float | None = None
        """Monotonic time this node entered the redundancy list (None: not a spare now)."""
        self.removed: list[str] = []
        self.from_handler = self._etcd_v3()
        """etcd-v3: judge the nodes of the state this agent's handler holds (no read of the
        shared state per pass)."""
        self._gone: set[str] = set()
        """Nodes found dead and already out of the newest state (not read for again)."""
        self.leases = False
        """etcd-v3: every node's liveness is its heartbeat lease (kept alive by its state
        holder, see ``ScalableStateHolder.keep_lease_alive``), not a beacon: a node is dead
        when its heartbeat key is gone (the lease expired) or says it left."""
        self._mass_logged = False

    # -- reading -------------------------------------------------------------------------------
    def read_state(self) -> RendezvousState | None:
        """The rendezvous state as the backend holds it now (None: none yet)."""
        got = self._state()
        return None if got is None else got[0]

    def _state(self) -> tuple[RendezvousState, Any] | None:
        if self._etcd_v3():  # compact JSON there (trainguard.runtime.etcd_v3.codec)
            # an unchanged state is neither sent again nor decoded again
            got = self._backend.get_state_since(self._etcd_token)
            if got is None:
                return None
            if got[0]:
                self._etcd_bits, self._etcd_token = got
            # a refused state (logged and reported once) is nothing to reap from
            state = self._backend.decode(self._etcd_bits, int(self._etcd_token))
            return None if state is None else (state, self._etcd_token)
        got = self._backend.get_state()
        if got is None:
            return None
        bits, token = got
        return pickle.loads(bits), token  # torch's own state format, from the job's store

    def _etcd_v3(self) -> bool:
        return getattr(self._backend, "_meta_key", None) is not None

    def _beacons(self, nodes: list[str]) -> dict[str, str]:
        keys = [self._prefix + n for n in nodes]
        if not keys:
            return {}
        under = getattr(self._store, "under", None)
        if under is not None and len(keys) > UNDER_FROM:  # etcd-v3: every beacon in one range
            values = under(self._prefix)
            return {n: _text(values[k]) for n, k in zip(nodes, keys, strict=True) if k in values}
        existing = getattr(self._store, "existing", None)
        if existing is not None:  # etcd-v3's store: one read for every beacon there is
            values = existing(keys)
            return {n: _text(values[k]) for n, k in zip(nodes, keys, strict=True) if k in values}
        if self._store.check(keys):
            return {n: _text(v) for n, v in zip(nodes, self._store.multi_get(keys), strict=True)}
        out = {}
        for n, k in zip(nodes, keys, strict=True):
            if self._store.check([k]):
                out[n] = _text(self._store.get(k))
        return out

    def dead_nodes(self, state: RendezvousState) -> dict[NodeDesc, tuple[float, str]]:
        """The nodes of ``state`` (but this one) whose beacon stood still for ``dead_after_s``
        (``liveness_silent``) or says they exited (``left``), with how long they have been
        silent as seen from here."""
        by_key = self._watched(state)
        if self.leases:
            return self._dead_by_lease(by_key)
        values = self._beacons(sorted(by_key))
        now = self._clock()
        if (
            self._last_read is None
            or now - self._last_read > self._cfg.dead_after_s / 2
            or self._own_beats_lag()
        ):
            # we could not look for a while (store unreachable, this agent starved), or our
            # own beats do not land (the store is overloaded: theirs are late too): silence
            # seen across that gap proves nothing, so every node starts a fresh window
            self._seen.clear()
        self._last_read = now
        dead: dict[NodeDesc, tuple[float, str]] = {}
        for key, value in values.items():
            last = self._seen.get(key)
            if value == LEFT:
                dead[by_key[key]] = (0.0 if last is None else now - last[1], "left")
                continue
            if last is None or last[0] != value:
                self._seen[key] = (value, now)
            elif now - last[1] >= self._cfg.dead_after_s:
                dead[by_key[key]] = (now - last[1], "liveness_silent")
        for key in list(self._seen):
            if key not in by_key:
                del self._seen[key]
        return dead

    def _dead_by_lease(self, by_key: dict[str, NodeDesc]) -> dict[NodeDesc, tuple[float, str]]:
        """etcd-v3: the watched nodes whose heartbeat key is gone (lease expired: silent for
        its TTL, ``dead_after_s``) on two reads in a row, or says they left. Not while more
        than a twentieth of them (and more than two) are gone at once, nor within a TTL of
        this node's own trouble with etcd (a request retried, its lease late): an etcd too
        loaded to renew leases in time, not dead nodes."""
        if not by_key:
            return {}
        # a spare of a large job watches every node: one range; a share of a few: those keys
        live = self._backend.heartbeats(None if len(by_key) > UNDER_FROM else sorted(by_key))
        now = self._clock()
        ttl = self._cfg.dead_after_s
        gone = [k for k in by_key if k not in live]
        dead: dict[NodeDesc, tuple[float, str]] = {}
        if len(gone) > max(2, len(by_key) // 20) or (
            time.monotonic() - self._backend.trouble_at() < ttl
        ):
            if gone and not self._mass_logged:
                self._mass_logged = True
                logger.warning(
                    "spares: %d of %d watched nodes' heartbeat leases gone at once, or this "
                    "node's own lease late: taken for an overloaded etcd, no node judged",
                    len(gone),
                    len(by_key),
                )
            self._seen.clear()
            gone = []
        else:
            self._mass_logged = False
        for key, node in by_key.items():
            if live.get(key) == LEFT:
                dead[node] = (0.0, "left")
            elif key in gone:
                first = self._seen.get(key)
                if first is None:
                    self._seen[key] = ("gone", now)  # gone again at the next read: dead
                else:
                    dead[node] = (ttl + now - first[1], "liveness_silent")
            else:
                self._seen.pop(key, None)
        for key in list(self._seen):
            if key not in by_key:
                del self._seen[key]
        return dead

    def _watched(self, state: RendezvousState) -> dict[str, NodeDesc]:
        """:func:`_watched_by` this node, computed once per state read from etcd."""
        if self.from_handler:  # the handler's state: its size says when the share changes
            token: Any = (
                state.round, state.complete, len(state.participants), len(state.wait_list),
                len(state.redundancy_list),
            )  # fmt: skip
        else:
            token = self._etcd_token if self._etcd_v3() else None
        if token is None or self._watch_cache is None or self._watch_cache[0] != token:
            watched = _watched_by(repr(self._me), state)
            if token is None:
                return watched
            self._watch_cache = (token, watched)
        return self._watch_cache[1]

    def _own_beats_lag(self) -> bool:
        b = self.beacon
        if b is None or b.last_ok is None:
            return False
        return time.monotonic() - b.last_ok > self._cfg.dead_after_s / 2

    def forget(self) -> None:
        """Start every node's silence window afresh (after a pass that could not read)."""
        self._seen.clear()
        self._last_read = None

    # -- writing -------------------------------------------------------------------------------
    def _write(self, mutate: Callable[[RendezvousState], bool]) -> bool:
        """Apply ``mutate`` to the newest state and write it back with the backend's
        compare-and-swap, retrying on a lost race; False when there was nothing to change."""
        for _ in range(10):
            got = self._state()
            if got is None or not mutate(got[0]):
                return False
            state, token = got
            if self._etcd_v3():  # JSON state and a summary of it for cheap watches
                from trainguard.runtime.etcd_v3.codec import encode_state
                from trainguard.runtime.etcd_v3.holder import _meta

                out = self._backend.set_state(encode_state(state), token, meta=_meta(state))
            else:
                out = self._backend.set_state(pickle.dumps(state), token)
            if out is not None and out[2]:
                return True
        return False

    def _remove(
        self, dead: dict[NodeDesc, tuple[float, str]], round_: int, complete: bool = True
    ) -> None:
        """Take ``dead`` (judged on round ``round_``, ``complete`` or filling) out of the
        newest state. Out of its participants only while that is still the round judged, in
        the same phase: a round that completed meanwhile (or a later one) has the node's
        slot and rank decided, and its other participants are gone to train with them; a
        live node taken out of it then (a lease renewed late under load) finds the round
        complete without itself and waits for a next round that never comes, while the
        others wait for its rank. A participant of a running round that is dead fails its
        group's collectives, and the next rendezvous takes it out."""
        outcome: list[bool] = []
        taken: list[NodeDesc] = []

        def mutate(state: RendezvousState) -> bool:
            changed = participant = False
            same_round = state.round == round_ and state.complete == complete
            taken.clear()
            for node in dead:
                if node in state.participants and not same_round:
                    continue  # a participant of a round decided since it was judged
                hit = state.last_heartbeats.pop(node, None) is not None
                if state.participants.pop(node, None) is not None:
                    hit = participant = True
                for lst in (state.wait_list, state.redundancy_list):
                    if node in lst:
                        lst.discard(node)
                        hit = True
                if hit:
                    taken.append(node)
                    changed = True
            if participant:
                _torch.remove_participant_epilogue(state, self._settings)
            outcome.append(changed)
            return changed

        wrote = self._write(mutate)
        if self.from_handler and (wrote or outcome[-1:] == [False]):
            # out of the newest state (by this write or another's): not read for again
            self._gone.update(repr(n) for n in dead)
        if wrote:
            lost = getattr(_torch.handler_state_holder(self._handler), "lost", None)
            for node in taken:
                silent, reason = dead[node]
                key = repr(node)
                if lost is not None:  # named if the round cannot complete without it
                    lost[key] = f"removed as dead ({reason}, silent {silent:.1f} s)"
                self.removed.append(key)
                self._seen.pop(key, None)
                logger.warning(
                    "node %s is dead (%s, silent %.1f s): removed from the rendezvous",
                    key,
                    reason,
                    silent,
                )
                self._emit(
                    "node_dead",
                    dead_node=key,
                    silent_s=round(silent, 2),
                    round=round_,
                    reason=reason,
                    removed_by=repr(self._me),
                )

    def _demote(self) -> bool:
        """This node waits for a round that is complete and full: back to the redundancy list
        (out of the wait list, which makes every active agent restart)."""
        me, max_nodes = self._me, self._settings.max_nodes

        def mutate(state: RendezvousState) -> bool:
            if not (state.complete and me in state.wait_list):
                return False
            if len(state.participants) < max_nodes:
                return False
            state.wait_list.discard(me)
            state.redundancy_list.add(me)
            return True

        return self._write(mutate)

    # -- one pass ------------------------------------------------------------------------------
    def _held(self) -> RendezvousState | None:
        """The state this agent's rendezvous handler last read (etcd-v3): no
        read of the shared state per pass, which would make every waiting agent fetch the
        whole state after each of its changes (N agents x N nodes per change). None while the
        held state has changes of this node's own not written yet: a node leaving a complete
        round holds it with itself out of the participants, which would make it one of the
        few nodes waiting out that round and so a watcher of every node's beacon (after a
        node loss at 1000 nodes, a thousand survivors reading a thousand beacons twice a
        second kept etcd saturated for 30 s)."""
        from trainguard.runtime.etcd_v3.codec import copy_state

        if _torch.handler_state_pending(self._handler):
            return None
        for _ in range(3):
            try:
                return copy_state(_torch.handler_state(self._handler))
            except RuntimeError:  # changed while copied (the handler's thread): again
                continue
        return None

    def tick(self) -> None:
        if self.from_handler:
            state = self._held()
            if state is None or state.round == 0 and not state.participants:
                return
        else:
            got = self._state()
            if got is None:
                return
            state = got[0]
        if state.closed:
            return
        dead = self.dead_nodes(state)
        if dead:
            self._remove(dead, state.round, state.complete)
        if (
            state.complete
            and self._me in state.wait_list
            and len(state.participants) >= self._settings.max_nodes
            and self._demote()
        ):
            self._emit("spare_waiting", round=state.round, reason="round_full")
            self.spare_since = self.spare_since or self._clock()
            return
        if self._me in state.redundancy_list and self.spare_since is None:
            self.spare_since = self._clock()
            self._emit("spare_waiting", round=state.round, reason="redundancy_list")


class SpareController:
    """One agent's beacon and, while it waits in a rendezvous, its reaper thread."""

    def __init__(self, handler: DynamicRendezvousHandler, cfg: SparesConfig, emit: Emit) -> None:
        settings = _torch.handler_settings(handler)
        self._max_nodes: int = settings.max_nodes
        cfg = cfg.for_nodes(settings.max_nodes)  # beacons of a large job beat slower
        self.cfg = cfg
        self._emit = emit
        self._handler = handler
        prefix = f"{BEACON_PREFIX}{settings.run_id}/"
        self._prefix = prefix
        self.reaper = Reaper(handler, cfg, emit, beacon_prefix=prefix)
        self._holder = _torch.handler_state_holder(handler)
        self.beacon: LivenessBeacon | None = None
        if self.reaper.from_handler and hasattr(self._holder, "keep_lease_alive"):
            # etcd-v3: the node's heartbeat lease is its liveness (keep-alives, no writes)
            self._holder.keep_lease_alive(cfg.beacon_interval_s, cfg.dead_after_s)
            self.reaper.leases = True
        else:
            self.beacon = LivenessBeacon(
                own_connection(_torch.handler_store(handler)),
                prefix + repr(_torch.handler_node(handler)),
                cfg.beacon_interval_s,
            )
            self.reaper.beacon = self.beacon
            self.beacon.start()
        self._next_check = 0.0

    def num_nodes_waiting(self, waiting: int) -> int:
        """torch's count, less the nodes no slot is free for: a complete round at
        ``max_nodes`` admits no one, so restarting the group for them would only loop."""
        if waiting <= 0:
            return waiting
        state = _torch.handler_state(self._handler)
        if state.complete and len(state.participants) >= self._max_nodes:
            return 0
        return waiting

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Run the reaper every ``poll_s`` while the body (torch's ``next_rendezvous``) runs."""
        stop = threading.Event()

        seen: set[type[BaseException]] = set()

        def loop() -> None:
            while not stop.is_set():
                try:
                    self.reaper.tick()
                except Exception as e:  # the store may be briefly unreachable (etcd restart)
                    # each kind of failure once at warning (a store that is down says so;
                    # anything else would otherwise leave dead nodes to torch's keep-alive
                    # without a word), the rest at debug
                    first = type(e) not in seen
                    seen.add(type(e))
                    logger.log(
                        logging.WARNING if first else logging.DEBUG,
                        "spares: reaper pass failed (retried every %.1f s): %s: %s",
                        self.cfg.poll_s,
                        type(e).__name__,
                        e,
                    )
                    self.reaper.forget()
                stop.wait(self.cfg.poll_s)

        thread = threading.Thread(target=loop, name="tg-reaper", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=10)

    def dead_participants(self) -> dict[str, float]:
        """While the round runs: the round's participants whose beacon this agent watches and
        that stood still for ``dead_after_s`` (node id → seconds silent).
        Read at most every ``poll_s``; nothing is removed (the next rendezvous does that)."""
        now = time.monotonic()
        if now < self._next_check:
            return {}
        self._next_check = now + self.cfg.poll_s
        try:
            # etcd-v3: the round this node's handler holds (no read of the state per check)
            state = self.reaper._held() if self.reaper.leases else self.reaper.read_state()
            if state is None:
                return {}
            dead = self.reaper.dead_nodes(state)
        except Exception as e:  # the store may be briefly unreachable
            logger.debug("spares: liveness read failed: %s", e)
            self.reaper.forget()
            return {}
        running = {repr(n) for n in state.participants}
        # "left" (a tombstone) is an agent that exited: its workers' connections closed with it
        return {
            repr(n): silent
            for n, (silent, why) in dead.items()
            if repr(n) in running and why == "liveness_silent"
        }

    def joined(self) -> None:
        """This node got a slot in a round: an event if it waited as a spare."""
        since = self.reaper.spare_since
        if since is not None:
            self.reaper.spare_since = None
            self._emit(
                "spare_joined",
                round=_torch.handler_state(self._handler).round,
                waited_s=round(time.monotonic() - since, 3),
            )

    def close(self, *, left: bool = True) -> None:
        if self.beacon is not None:
            self.beacon.close(left=left)
        else:
            self._holder.stop_lease(left=left)


def attach(handler: Any, cfg: SparesConfig, emit: Emit) -> SpareController | None:
    """Give ``handler`` (trainguard's rendezvous wrapper around torch's dynamic handler) a
    :class:`SpareController`; None for backends without torch's dynamic rendezvous (static)."""
    if not cfg.enabled:
        return None
    inner = getattr(handler, "_inner", handler)
    if not isinstance(inner, DynamicRendezvousHandler):
        return None
    try:
        controller = SpareController(inner, cfg, emit)
    except Exception as e:
        logger.warning("spares: no liveness beacon (%s); torch's keep-alive finds dead nodes", e)
        return None
    handler.spares = controller
    return controller
